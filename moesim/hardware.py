"""Hardware profiles: the one place hardware figures come from.

A profile is a TOML file (format: ``docs/hwprofile-format.md``). Every figure carries its
value, whether it is a datasheet peak, a measurement or an estimate, and its source, so a
prediction can always be traced back to where its numbers came from.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError

LINK_KINDS = ("pcie3", "pcie4", "pcie5", "nvlink-c2c", "emulated")
FIGURE_KINDS = ("datasheet", "measured", "estimate", "fitted")
# The profile a run uses when nothing names one: a trace that does not record its hardware
# (a synthetic trace) and the executor's emulated link. A PCIe 4.0 workstation GPU is the
# common case for offloading (experts in host memory because they do not fit).
DEFAULT_PROFILE = "a6000"

#: Figure name -> (unit, required, whether an integer, description).
FIGURES: dict[str, tuple[str, bool, bool, str]] = {
    "device_memory_gb": ("GB", True, False, "device memory capacity"),
    "mem_bw_peak_gbs": ("GB/s", True, False, "device-memory bandwidth, datasheet peak"),
    "mem_bw_achievable_gbs": ("GB/s", True, False, "device-memory bandwidth a streaming kernel reaches"),
    "bf16_tflops": ("TFLOP/s", True, False, "dense bf16 tensor rate, peak"),
    "fp8_tflops": ("TFLOP/s", False, False, "dense fp8 tensor rate, peak (absent: no fp8 units)"),
    "compute_efficiency": ("fraction", True, False, "achievable share of the peak FLOP rate"),
    "h2d_pinned_gbs": ("GB/s", True, False, "host-to-device copy bandwidth from pinned memory"),
    "h2d_pageable_gbs": ("GB/s", True, False, "host-to-device copy bandwidth from pageable memory"),
    "transfer_latency_us": ("us", True, False, "fixed cost of one host-to-device transfer"),
    "copy_engines": ("count", True, True, "DMA copy engines"),
    "kernel_launch_us": ("us", True, False, "fixed cost of one kernel launch"),
    "host_mem_bw_gbs": ("GB/s", True, False, "host memory bandwidth"),
    "layer_overhead_us": ("us", False, False, "fixed framework cost per layer (calibration)"),
    "copy_interference": ("fraction", False, False, "compute slowdown while host-to-device copies run (0 = none)"),
    "copy_interference_gbs": ("GB/s", False, False, "link rate at which copy_interference was measured"),
    "wait_wakeup_us": ("us", False, False, "delay from a copy landing to a compute stream that waited on it resuming"),
}
TOP_KEYS = {"name", "description", "link", "figures"}


@dataclass(frozen=True)
class Figure:
    value: float
    kind: str
    source: str


@dataclass(frozen=True)
class HardwareProfile:
    """A GPU (or emulated device) and its link to host memory."""

    name: str
    description: str
    link: str
    figures: dict[str, Figure]
    path: str = ""

    def __getitem__(self, key: str) -> float:
        return self.figures[key].value

    def get(self, key: str, default: float = 0.0) -> float:
        f = self.figures.get(key)
        return f.value if f is not None else default

    # Figures in SI units, as the cost model uses them.
    @property
    def link_bw(self) -> float:
        """Host-to-device bytes/s for expert copies (experts live in pinned memory)."""
        return self["h2d_pinned_gbs"] * 1e9

    @property
    def transfer_latency(self) -> float:
        return self["transfer_latency_us"] * 1e-6

    @property
    def mem_bw(self) -> float:
        return self["mem_bw_achievable_gbs"] * 1e9

    def flops(self, dtype: str = "bf16") -> float:
        """Achievable dense FLOP/s for weights of ``dtype`` (fp8 units when the part has them)."""
        peak = self["bf16_tflops"]
        if dtype.startswith("fp8") and "fp8_tflops" in self.figures:
            peak = self["fp8_tflops"]
        return peak * 1e12 * self["compute_efficiency"]

    @property
    def launch(self) -> float:
        return self["kernel_launch_us"] * 1e-6

    @property
    def layer_overhead(self) -> float:
        return self.get("layer_overhead_us") * 1e-6

    @property
    def interference(self) -> float:
        """Compute slowdown while the link copies: ``copy_interference``, scaled by how busy
        the link's memory traffic is relative to the rate it was measured at (a copy
        engine pacing below that rate moves fewer bytes a second and disturbs less)."""
        alpha = self.get("copy_interference")
        at = self.get("copy_interference_gbs")
        return alpha * min(1.0, self["h2d_pinned_gbs"] / at) if alpha and at else alpha
    def with_figure(self, key: str, value: float, kind: str = "estimate", source: str = "what-if") -> HardwareProfile:
        """A copy with one figure replaced (what-if sweeps change link bandwidth this way)."""
        _check_value(self.name, key, value)
        figs = dict(self.figures)
        figs[key] = Figure(float(value), kind, source)
        return replace(self, figures=figs)

    def to_toml(self) -> str:
        lines = [f"name = {_q(self.name)}", f"description = {_q(self.description)}",
                 f"link = {_q(self.link)}", "", "[figures]"]
        for key, f in self.figures.items():
            v = int(f.value) if FIGURES[key][2] else f.value
            lines.append(f"{key} = {{ value = {v}, kind = {_q(f.kind)}, source = {_q(f.source)} }}")
        return "\n".join(lines) + "\n"


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_value(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MoesimError(f"{where}: figure {key!r} must be a number, got {value!r}")
    zero_ok = key in ("layer_overhead_us", "copy_interference", "wait_wakeup_us") and value == 0
    if (not math.isfinite(value) or value <= 0) and not zero_ok:
        raise MoesimError(f"{where}: figure {key!r} must be positive and finite, got {value}")
    if key == "compute_efficiency" and value > 1:
        raise MoesimError(f"{where}: compute_efficiency is a fraction of peak; got {value} > 1")


def parse_profile(data: dict[str, Any], where: str) -> HardwareProfile:
    """Validate a parsed TOML document and build the profile (errors name the field)."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise MoesimError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(TOP_KEYS))}")
    for key in ("name", "link", "figures"):
        if key not in data:
            raise MoesimError(f"{where}: missing required key {key!r}")
    if data["link"] not in LINK_KINDS:
        raise MoesimError(f"{where}: link {data['link']!r} is not one of {', '.join(LINK_KINDS)}")
    raw = data["figures"]
    if not isinstance(raw, dict):
        raise MoesimError(f"{where}: [figures] must be a table")
    figures: dict[str, Figure] = {}
    for key, entry in raw.items():
        if key not in FIGURES:
            raise MoesimError(f"{where}: unknown figure {key!r}; known: {', '.join(FIGURES)}")
        if not isinstance(entry, dict) or set(entry) != {"value", "kind", "source"}:
            raise MoesimError(f"{where}: figure {key!r} must be {{ value, kind, source }}")
        if entry["kind"] not in FIGURE_KINDS:
            raise MoesimError(f"{where}: figure {key!r} kind {entry['kind']!r} not in {', '.join(FIGURE_KINDS)}")
        _check_value(where, key, entry["value"])
        figures[key] = Figure(float(entry["value"]), entry["kind"], str(entry["source"]))
    missing = [k for k, (_, req, _, _) in FIGURES.items() if req and k not in figures]
    if missing:
        raise MoesimError(f"{where}: missing required figure(s) {', '.join(missing)}")
    if figures["mem_bw_achievable_gbs"].value > figures["mem_bw_peak_gbs"].value:
        raise MoesimError(f"{where}: achievable memory bandwidth exceeds the peak")
    return HardwareProfile(str(data["name"]), str(data.get("description", "")), data["link"], figures, where)


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile TOML; a directory, a binary or non-UTF-8 file or bad TOML is one line."""
    path = Path(path)
    if path.is_dir():
        raise MoesimError(f"hardware profile {path} is a directory, not a .toml file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise MoesimError(f"cannot read hardware profile {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MoesimError(f"{path}: not a hardware profile (not UTF-8 text; a TOML file is expected)") from None
    if "\x00" in text:
        raise MoesimError(f"{path}: not a hardware profile (binary data; a TOML file is expected)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MoesimError(f"{path}: not valid TOML ({e})") from None
    return parse_profile(data, str(path))


def builtin_profiles() -> dict[str, Path]:
    """Name -> path of the profiles shipped in ``hwprofiles/``."""
    root = resources.files("moesim.hwprofiles")
    return {p.name[:-5]: Path(str(p)) for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".toml")}


def get_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (``a6000``) or a user's TOML file by path."""
    builtin = builtin_profiles()
    if name_or_path.lower() in builtin:
        return load_profile(builtin[name_or_path.lower()])
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise MoesimError(f"hardware profile file {p} does not exist")
        return load_profile(p)
    raise MoesimError(f"unknown hardware profile {name_or_path!r}; built-in: {', '.join(builtin)} (or a .toml path)")
