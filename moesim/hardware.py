"""Hardware profiles: the one place hardware figures come from.

A profile is a TOML file (format: ``docs/hwprofile-format.md``). Every figure carries its
value, whether it is a datasheet peak, a measurement or an estimate, and its source, so a
prediction can always be traced back to where its numbers came from.

Two kinds: a GPU profile (:class:`HardwareProfile`, ``hwprofiles/*.toml``) and a host
profile (:class:`HostProfile`, ``hwprofiles/hosts/*.toml``): the CPU and host memory that
hold offloaded experts and, under the CPU-compute policies (llama.cpp, KTransformers,
Fiddler), multiply them. A GPU profile names its usual host (``host = "..."``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import tomllib
import warnings
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.fmt import nearest_hint, number
from moesim.gpu_detect import PCIE_LANE_GBS, GpuFacts, name_key, read_gpus
from moesim.host_detect import CpuFacts, description_isa, read_this_machine
from moesim.inputs import TOML_CAP, check_name, kind_of, read_text
from moesim.models import INTEGER_DTYPES  # models imports nothing from here; keep it that way

LINK_KINDS = ("pcie3", "pcie4", "pcie5", "nvlink-c2c", "emulated")
FIGURE_KINDS = ("datasheet", "measured", "derived", "estimate", "fitted")  # derived: computed from measured figures
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
    "transfer_latency_us": ("us", True, False, "fixed cost of one host-to-device transfer"),
    "kernel_launch_us": ("us", True, False, "fixed cost of one kernel launch"),
    "layer_overhead_us": ("us", False, False, "fixed framework cost per layer (calibration)"),
    "copy_interference": ("ratio", False, False, "compute slowdown while host-to-device copies run: time with them / "
                                                 "time alone - 1 (0 = none; above 1 where copies and compute share "
                                                 "the cores)"),
    "copy_interference_gbs": ("GB/s", False, False, "link rate at which copy_interference was measured"),
    "wait_wakeup_us": ("us", False, False, "delay from a copy landing to a compute stream that waited on it resuming"),
    "peer_gbs": ("GB/s", False, False, "GPU-to-GPU bandwidth per direction, NVLink (absent: through the host's "
                                       "PCIe, at h2d_pinned_gbs)"),
    "collective_latency_us": ("us", False, False, "fixed cost of one small collective (all-reduce) between these "
                                                  "GPUs (absent: PCIE_COLLECTIVE_US, or NVLINK_COLLECTIVE_US with "
                                                  "peer_gbs)"),
}
#: Fixed cost of one small-message collective between GPUs (estimates: an NCCL all-reduce of
#: a few KB takes tens of microseconds through the host's PCIe, about ten inside an NVLink
#: node; NCCL's nccl-tests report latencies of this order for small messages).
PCIE_COLLECTIVE_US = 20.0
NVLINK_COLLECTIVE_US = 10.0
TOP_KEYS = {"name", "description", "link", "host", "figures"}
#: Figures older profiles carried that nothing modelled: loading one warns and drops it.
#: Expert copies run on one stream, so one DMA engine serves them whatever the count;
#: experts live in pinned memory, so the pageable rate never applies; host memory
#: bandwidth belongs to the host profile (``mem_bw_achievable_gbs`` there), where the
#: CPU-compute policies use it.
RETIRED_FIGURES = {
    "copy_engines": "expert copies use one stream, so one engine",
    "h2d_pageable_gbs": "experts live in pinned memory",
    "host_mem_bw_gbs": "host memory bandwidth is the host profile's mem_bw_achievable_gbs (--host)",
}

#: The most a profile's count figure (cores, sockets, kernels a block) may say: beyond any machine.
MAX_COUNT = 65536

#: Host figures: name -> (unit, required, whether an integer, description).
HOST_FIGURES: dict[str, tuple[str, bool, bool, str]] = {
    "cores": ("count", True, True, "physical cores of the socket that computes experts"),
    "mem_bw_peak_gbs": ("GB/s", True, False, "host memory bandwidth of one socket, theoretical peak"),
    "mem_bw_achievable_gbs": ("GB/s", True, False, "host memory bandwidth a STREAM-like kernel reaches"),
    "bf16_tflops": ("TFLOP/s", True, False, "dense bf16 rate of the vector units (AVX-512 BF16, or fp32 FMA), peak"),
    "int8_tops": ("TOP/s", True, False, "int8 dot-product rate of the vector units (AVX-512 VNNI / AVX2), peak"),
    "amx_bf16_tflops": ("TFLOP/s", False, False, "bf16 rate of the matrix units (Intel AMX), peak (absent: none)"),
    "amx_int8_tops": ("TOP/s", False, False, "int8 rate of the matrix units (Intel AMX), peak (absent: none)"),
    "compute_efficiency": ("fraction", True, False, "achievable share of the peak rates"),
    "expert_dispatch_us": ("us", True, False, "fixed CPU cost to start one expert's matrix work"),
    "activation_roundtrip_us": ("us", True, False, "GPU->CPU hidden state, CPU->GPU expert output: "
                                                    "latency of the round trip per layer"),
    "sockets": ("count", False, True, "CPU sockets of the machine (absent: 1); every other figure is one socket's"),
    "mem_bw_per_core_gbs": ("GB/s", False, False, "host memory bandwidth one core reaches alone (absent: the "
                                                  "socket's figure is reached with any thread count)"),
    "ram_gb": ("GB", False, False, "host memory capacity of the machine (absent: assumed large enough)"),
    "disk_read_gbs": ("GB/s", False, False, "random-read rate of the disk that holds the weights, at the size a "
                                            "memory-mapped model faults in (absent: DEFAULT_DISK_READ_GBS)"),
}
#: The disk a memory-mapped model pages from, when the host profile does not say (estimate:
#: a PCIe 4.0 NVMe SSD reads 5-7 GB/s sequentially and far less at 4 KB; page faults of a
#: memory-mapped file with the kernel's readahead land between, taken here as 2 GB/s).
DEFAULT_DISK_READ_GBS = 2.0
HOST_TOP_KEYS = {"name", "description", "figures"}


@dataclass(frozen=True)
class Figure:
    value: float
    kind: str
    source: str


class _FigureLookup:
    """``profile["name"]`` is a figure's value; ``profile.get(name, default)`` for optional ones."""

    figures: dict[str, Figure]

    def __getitem__(self, key: str) -> float:
        return self.figures[key].value

    def get(self, key: str, default: float = 0.0) -> float:
        f = self.figures.get(key)
        return f.value if f is not None else default


@dataclass(frozen=True)
class HardwareProfile(_FigureLookup):
    """A GPU (or emulated device) and its link to host memory."""

    name: str
    description: str
    link: str
    figures: dict[str, Figure]
    path: str = ""
    host: str = ""  # the host profile this GPU usually sits in (``hwprofiles/hosts``)

    # Figures in SI units, as the cost model uses them.
    @property
    def link_bw(self) -> float:
        """Host-to-device bytes/s for expert copies (experts live in pinned memory)."""
        return self["h2d_pinned_gbs"] * 1e9

    @property
    def transfer_latency(self) -> float:
        return self["transfer_latency_us"] * 1e-6

    @property
    def peer_bw(self) -> float:
        """GPU-to-GPU bytes/s per direction: NVLink where the profile gives it, else the
        host's PCIe (a peer copy crosses the host link)."""
        return self["peer_gbs"] * 1e9 if "peer_gbs" in self.figures else self.link_bw

    @property
    def collective_latency(self) -> float:
        """Seconds of one small collective's fixed cost between GPUs of this kind."""
        default = NVLINK_COLLECTIVE_US if "peer_gbs" in self.figures else PCIE_COLLECTIVE_US
        return self.get("collective_latency_us", default) * 1e-6

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
        _check_given(self.name, key, value, source)
        figs = dict(self.figures)
        figs[key] = Figure(float(value), kind, source)
        return replace(self, figures=figs)

    def to_toml(self) -> str:
        top = {"name": self.name, "description": self.description, "link": self.link}
        return _dump_profile(top | ({"host": self.host} if self.host else {}), self.figures, FIGURES)


def _dump_profile(top: dict[str, str], figures: dict[str, Figure], table: dict) -> str:
    """A profile as TOML, through tomli-w (a well-kept writer: quoting and escaping of any
    source text, which a hand-written one gets wrong on control characters)."""
    import tomli_w

    figs = {k: {"value": int(f.value) if table[k][2] else f.value, "kind": f.kind, "source": f.source}
            for k, f in figures.items()}
    return tomli_w.dumps({**top, "figures": figs})


#: Figures that may be exactly 0 (a cost that is absent, a switch that is off); every
#: other figure must be positive.
ZERO_OK = {"layer_overhead_us", "copy_interference", "wait_wakeup_us"}


def _check_given(where: str, key: str, value: Any, source: str) -> None:
    """:func:`_check_value` of a figure a what-if replaces; a value given as an option
    (``source`` ``--link-gbps``, ...) is refused in that option's words, not the figure's."""
    try:
        _check_value(where, key, value)
    except MoesimError:
        if not source.startswith("--"):
            raise
        raise MoesimError(f"{source} {value!r}: {'a fraction in (0, 1]' if key.endswith('efficiency') else 'a positive, finite number'}"
                          ) from None


def _check_value(where: str, key: str, value: Any, zero_ok: set[str] = ZERO_OK) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MoesimError(f"{where}: figure {key!r} must be a number, got {value!r}")
    if (not math.isfinite(value) or value <= 0) and not (key in zero_ok and value == 0):
        what = "0 or positive" if key in zero_ok else "positive"
        raise MoesimError(f"{where}: figure {key!r} must be {what} and finite, got {number(value)}")
    if key.endswith("efficiency") and value > 1:
        raise MoesimError(f"{where}: {key} is a fraction of peak; got {value} > 1")


def parse_figures(raw: Any, table: dict[str, tuple[str, bool, bool, str]], where: str,
                  retired: dict[str, str] | None = None, zero_ok: set[str] = ZERO_OK,
                  section: str = "figures") -> dict[str, Figure]:
    """Validate a ``[figures]`` table against ``table`` (name -> (unit, required, integer,
    description)): each entry ``{ value, kind, source }``, a known kind, a positive finite
    value (0 only for ``zero_ok``), whole numbers where the table says so."""
    if not isinstance(raw, dict):
        raise MoesimError(f"{where}: [{section}] must be a table")
    figures: dict[str, Figure] = {}
    for key, entry in raw.items():
        if retired and key in retired:
            warnings.warn(f"{where}: figure {key!r} is no longer used ({retired[key]}); ignored",
                          UserWarning, stacklevel=3)
            continue
        if key not in table:
            raise MoesimError(f"{where}: unknown figure {key!r} in [{section}]; known: {', '.join(table)}")
        if not isinstance(entry, dict) or set(entry) != {"value", "kind", "source"}:
            raise MoesimError(f"{where}: figure {key!r} must be {{ value, kind, source }}")
        if entry["kind"] not in FIGURE_KINDS:
            raise MoesimError(f"{where}: figure {key!r} kind {entry['kind']!r} not in {', '.join(FIGURE_KINDS)}")
        _check_value(where, key, entry["value"], zero_ok)
        if table[key][0] == "fraction" and entry["value"] > 1:
            raise MoesimError(f"{where}: figure {key!r} is a fraction (at most 1), got {entry['value']}")
        if table[key][2] and entry["value"] != int(entry["value"]):
            raise MoesimError(f"{where}: figure {key!r} must be a whole number, got {entry['value']}")
        if table[key][0] == "count" and entry["value"] > MAX_COUNT:  # cores = 1e8 was printed as `-t 100000000`
            raise MoesimError(f"{where}: figure {key!r} is a count of at most {MAX_COUNT:,}, got {number(entry['value'])}")
        figures[key] = Figure(float(entry["value"]), entry["kind"], str(entry["source"]))
    missing = [k for k, (_, req, _, _) in table.items() if req and k not in figures]
    if missing:
        raise MoesimError(f"{where}: missing required figure(s) {', '.join(missing)}")
    return figures


def _memory_figures(raw: Any, table, where: str, retired: dict[str, str] | None = None) -> dict[str, Figure]:
    figures = parse_figures(raw, table, where, retired)
    if figures["mem_bw_achievable_gbs"].value > figures["mem_bw_peak_gbs"].value:
        raise MoesimError(f"{where}: achievable memory bandwidth exceeds the peak")
    return figures


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
    host = data.get("host", "")
    if not isinstance(host, str):
        raise MoesimError(f"{where}: host must be the name of a host profile, got {host!r}")
    figures = _memory_figures(data["figures"], FIGURES, where, RETIRED_FIGURES)
    return HardwareProfile(_name(data, where), str(data.get("description", "")), data["link"], figures, where, host)


#: The longest profile name (it heads table columns and report titles).
NAME_MAX = 100


def _name(data: dict[str, Any], where: str) -> str:
    """A profile's ``name``: text, printable, not blank, at most :data:`NAME_MAX` characters
    (every table, row and report names the profile by it)."""
    name = data["name"]
    if not isinstance(name, str) or not name.strip() or not name.isprintable() or len(name) > NAME_MAX:
        raise MoesimError(f"{where}: name {name!r} must be printable text of 1 to {NAME_MAX} characters, "
                          "not blank (tables and reports name the profile by it)")
    return name.strip()


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """A profile TOML (:mod:`moesim.inputs`: a device, socket, silent named pipe, a name too
    long or a file over TOML_CAP is one line before a byte is read; a pipe is read)."""
    check_name(path, what)
    if kind_of(path) == "folder":
        raise MoesimError(f"{what} {path} is a directory, not a .toml file")
    text = read_text(path, what, TOML_CAP, expected="a TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MoesimError(f"{path}: not valid TOML ({e})") from None


def given_path(name_or_path: str, what: str) -> Path | None:
    """``name_or_path`` as a path when something is there (a file, a folder, a pipe, a
    device: the reader says which it will not read), None for a name; a .toml that is not
    there, or a name longer than the file system allows, is one line."""
    p = check_name(Path(name_or_path), what)
    if kind_of(p) == "missing":
        if p.suffix == ".toml":
            raise MoesimError(f"{what} file {p} does not exist")
        return None
    return p


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile TOML; a directory, a binary or non-UTF-8 file or bad TOML is one line."""
    path = Path(path)
    return parse_profile(read_toml(path, "hardware profile"), str(path))


def builtin_profiles() -> dict[str, Path]:
    """Name -> path of the profiles shipped in ``hwprofiles/``."""
    return dict(_shipped(""))


@functools.cache
def _shipped(folder: str) -> tuple[tuple[str, Path], ...]:
    """(name, path) of the TOML files shipped in ``hwprofiles/<folder>``: read once a process
    (the package's files do not change under it; a sweep or a fit looks them up thousands of times)."""
    root = resources.files("moesim.hwprofiles")
    root = root.joinpath(folder) if folder else root
    return tuple((p.name[:-5], Path(str(p))) for p in sorted(root.iterdir(), key=lambda p: p.name)
                 if p.name.endswith(".toml") and p.is_file())


@functools.lru_cache(maxsize=128)
def _builtin_profile(name: str) -> HardwareProfile:
    return load_profile(builtin_profiles()[name])  # parsed once a process: profiles are frozen values


@functools.lru_cache(maxsize=128)
def _builtin_host(name: str) -> HostProfile:
    return load_host(builtin_hosts()[name])


def get_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (``a6000``) or a user's TOML file by path."""
    if not name_or_path.strip():  # Path('') is '.': "hardware profile . is a directory" named no file the user gave
        raise MoesimError("--hw '': give a profile name (moesim hw) or a .toml path")
    builtin = builtin_profiles()
    if name_or_path.lower() in builtin:
        return _builtin_profile(name_or_path.lower())
    if name_or_path.strip().lower() == THIS_HOST:  # one GPU profile: this machine's only GPU
        gpus = this_machine().gpus
        if len(gpus) != 1:
            raise MoesimError(f"this machine has {len(gpus)} GPUs; where one GPU profile is asked for, give its name "
                              "(`moesim hw this` shows them)")
        return gpus[0]
    p = given_path(name_or_path, "hardware profile")
    if p is not None:
        return load_profile(p)
    if name_or_path.lower() in builtin_hosts():
        raise MoesimError(f"{name_or_path!r} is a host (CPU) profile, not a GPU one: `moesim hw {name_or_path} --hosts` "
                          "shows it, and --host picks it")
    n = None
    if re.fullmatch(r"none|\d+x.+|.+\+.+", name_or_path.strip().lower()):  # `2xa6000`, `a+b`, `none`: a machine
        with contextlib.suppress(MoesimError):  # not a machine either: the unknown name below
            n = get_machine(name_or_path).n_gpus
    if n is not None:
        raise MoesimError(f"{name_or_path!r} is a machine of {n or 'no'} GPU{'s' if n != 1 else ''}; this command "
                          f"takes one GPU profile (built-in: {', '.join(builtin)}, or a .toml path)")
    raise MoesimError(f"unknown hardware profile {name_or_path!r}{nearest_hint(name_or_path, builtin)}; built-in: "
                      f"{', '.join(builtin)} (or a .toml path)")


# ---------------------------------------------------------------------------------------
# Host profiles: the CPU that holds (and may compute) offloaded experts
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostProfile(_FigureLookup):
    """One CPU socket and its memory, as the CPU-compute policies use it.

    Figures describe ONE socket: llama.cpp and KTransformers bind expert compute to one
    NUMA node in the configurations their users report, and a second socket's memory is
    reached over the inter-socket link at a fraction of the local bandwidth.
    """

    name: str
    description: str
    figures: dict[str, Figure]
    path: str = ""

    @property
    def has_amx(self) -> bool:
        return "amx_bf16_tflops" in self.figures

    @property
    def mem_bw(self) -> float:
        """Bytes/s the CPU streams expert weights from host memory."""
        return self["mem_bw_achievable_gbs"] * 1e9

    def flops(self, dtype: str = "bf16", amx: bool = True) -> float:
        """Achievable multiply-add rate (x 2, per second) for weights of ``dtype``.

        Integer formats (:data:`moesim.models.INTEGER_DTYPES`) run int8 dot-product
        kernels; every other format is dequantised and multiplied in bf16. ``amx``
        uses the matrix units where the part has them (KTransformers' AMX kernels);
        ``amx=False`` is the vector-only rate (AVX-512 / AVX2 kernels).
        """
        integer = dtype in INTEGER_DTYPES
        if amx and self.has_amx:
            peak = self["amx_int8_tops"] if integer else self["amx_bf16_tflops"]
        else:
            peak = self["int8_tops"] if integer else self["bf16_tflops"]
        return peak * 1e12 * self["compute_efficiency"]

    @property
    def dispatch(self) -> float:
        return self["expert_dispatch_us"] * 1e-6

    @property
    def roundtrip(self) -> float:
        return self["activation_roundtrip_us"] * 1e-6

    @property
    def sockets(self) -> int:
        return int(self.get("sockets", 1))

    @property
    def cores(self) -> int:
        """Physical cores of one socket."""
        return int(self["cores"])

    def socket_bw(self, threads: int) -> float:
        """Bytes/s one socket's memory delivers to ``threads`` threads on it: its achievable
        bandwidth, or less when too few threads run to saturate it (``mem_bw_per_core_gbs``)."""
        per_core = self.get("mem_bw_per_core_gbs") * 1e9
        return min(self.mem_bw, threads * per_core) if per_core else self.mem_bw

    @property
    def ram_bytes(self) -> float | None:
        """Host memory of the machine, or None when the profile does not say."""
        return self["ram_gb"] * 1e9 if "ram_gb" in self.figures else None

    @property
    def disk_bw(self) -> float:
        """Bytes/s a memory-mapped model pages in from disk (:data:`DEFAULT_DISK_READ_GBS`
        when the profile does not say)."""
        return self.get("disk_read_gbs", DEFAULT_DISK_READ_GBS) * 1e9

    def with_figure(self, key: str, value: float, kind: str = "estimate", source: str = "what-if") -> HostProfile:
        """A copy with one figure replaced (what-if sweeps over host bandwidth)."""
        if key not in HOST_FIGURES:
            raise MoesimError(f"unknown host figure {key!r}; known: {', '.join(HOST_FIGURES)}")
        _check_given(self.name, key, value, source)
        figs = dict(self.figures)
        figs[key] = Figure(float(value), kind, source)
        return replace(self, figures=figs)

    def to_toml(self) -> str:
        return _dump_profile({"name": self.name, "description": self.description}, self.figures, HOST_FIGURES)


def parse_host(data: dict[str, Any], where: str) -> HostProfile:
    """Validate a parsed host TOML and build the profile (errors name the field)."""
    unknown = set(data) - HOST_TOP_KEYS
    if unknown:
        hint = " (a GPU profile? --host takes a host profile)" if {"link"} & unknown else ""
        raise MoesimError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(HOST_TOP_KEYS))}{hint}")
    for key in ("name", "figures"):
        if key not in data:
            raise MoesimError(f"{where}: missing required key {key!r}")
    figures = _memory_figures(data["figures"], HOST_FIGURES, where)
    if ("amx_bf16_tflops" in figures) != ("amx_int8_tops" in figures):
        raise MoesimError(f"{where}: give both amx_bf16_tflops and amx_int8_tops, or neither")
    return HostProfile(_name(data, where), str(data.get("description", "")), figures, where)


def load_host(path: str | Path) -> HostProfile:
    """Read a host profile TOML; problems are one line naming the file and field."""
    path = Path(path)
    return parse_host(read_toml(path, "host profile"), str(path))


def builtin_hosts() -> dict[str, Path]:
    """Name -> path of the host profiles shipped in ``hwprofiles/hosts/``."""
    return dict(_shipped("hosts"))


#: ``--host this``: the machine moesim runs on (:func:`this_host`).
THIS_HOST = "this"
#: Figures scaled by a machine's cores over its nearest known part's: the cores' peak rates.
PER_CORE = ("bf16_tflops", "int8_tops", "amx_bf16_tflops", "amx_int8_tops")


def nearest_part(facts: CpuFacts) -> tuple[HostProfile, str]:
    """The built-in host a machine's undetected figures come from, and why that one: the part
    whose model number the model name holds, else the same instruction-set class with the
    nearest core count."""
    hosts = [load_host(p) for p in builtin_hosts().values()]
    for h in hosts:
        number = h.name.split("-")[-1].removesuffix("plus")  # epyc-9654 -> 9654, xeon-8592plus -> 8592
        if re.search(rf"(?<![0-9a-z]){re.escape(number)}(?![0-9a-z])", facts.model.lower()):
            return h, f"the model name {facts.model!r} names it"
    same = [h for h in hosts if description_isa(h.description) == facts.isa]
    best = min(same or hosts, key=lambda h: (abs(math.log(h.cores / facts.cores)), h.name))
    how = f"the same instruction sets ({facts.isa})" if same else f"no built-in part has {facts.isa}"
    return best, f"no built-in part is named {facts.model!r}; {best.name}: {how}, the nearest core count"


def this_host(facts: CpuFacts | None = None) -> HostProfile:
    """The host profile of this machine (``--host this``): cores, sockets and RAM as the OS
    says (measured), the cores' peak rates scaled from the nearest known part, and its
    memory system and the rest as that part's (moesim.host_detect says why)."""
    facts = facts or read_this_machine()
    base, why = nearest_part(facts)
    figures = {k: Figure(f.value, "estimate", f"estimate: the nearest known part's, {base.name} ({why}): {f.source}")
               for k, f in base.figures.items()}  # another part's datasheet is an estimate of this one
    for k in PER_CORE:
        if k in figures:
            v = base.figures[k].value
            figures[k] = Figure(v * facts.cores / base.cores, "estimate",
                                f"estimate: {base.name}'s {v:g} for {base.cores} cores x {facts.cores} detected cores")
    per_core = base.get("mem_bw_per_core_gbs")
    if per_core and facts.cores < base.cores:  # a small VM on a big part cannot draw the whole socket's bandwidth
        bw = min(base["mem_bw_achievable_gbs"], per_core * facts.cores)
        figures["mem_bw_achievable_gbs"] = Figure(
            round(bw, 1), "estimate", f"estimate: {base.name}'s {per_core:g} GB/s a core x {facts.cores} detected cores "
            f"(its {base['mem_bw_achievable_gbs']:g} GB/s needs {base.cores}); `moesim profile --hardware` measures "
            "this machine's")
    os_said = "detected on this machine (/proc/cpuinfo)"
    figures["cores"] = Figure(facts.cores, "measured", f"{os_said}: physical cores of one socket")
    figures["sockets"] = Figure(facts.sockets, "measured", os_said)
    if facts.ram_gb is not None:
        figures["ram_gb"] = Figure(round(facts.ram_gb, 1), "measured", "detected on this machine (/proc/meminfo)")
    desc = (f"this machine: {facts.model}, {facts.sockets} x {facts.cores} cores, {facts.isa}"
            + (f", {facts.ram_gb:.0f} GB RAM" if facts.ram_gb else "")
            + f"; memory channels, bandwidth and rates from {base.name} ({why}), scaled to the detected cores; "
            "`moesim profile --hardware` measures this machine's")
    return HostProfile(THIS_HOST, desc, figures, "/proc/cpuinfo")


#: NVML's own names (``nvmlDeviceGetName``, as :func:`moesim.gpu_detect.name_key` reduces them)
#: for parts whose name holds no built-in profile's, or holds another part's: the H100 SXM is
#: "NVIDIA H100 80GB HBM3", the A100 80GB PCIe card "NVIDIA A100 80GB PCIe", the Max-Q card
#: "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition" (which also holds the 600 W card's
#: name), the GH200's GPU "NVIDIA GH200 480GB" / "NVIDIA GH200 144G HBM3e" (which hold "h200").
NVML_NAMES = {"h10080gbhbm3": "h100-sxm", "h100sxm": "h100-sxm", "a10080gbpcie": "a100-pcie",
              "a10040gbpcie": "a100-pcie", "maxq": "rtx-pro-6000-maxq", "gh200": "gh200"}
#: Links a GPU has only when its name says so (NVLink-C2C: a Grace Hopper superchip); a card
#: NVML does not name as one is matched among the PCIe parts only.
NAMED_LINKS = {"nvlink-c2c": ("gh200", "gb200", "gb10")}


def nearest_gpu(facts: GpuFacts) -> tuple[HardwareProfile, str, bool]:
    """The built-in GPU profile a detected GPU's other figures come from, why that one, and
    whether it is the same part: NVML's own name for it (:data:`NVML_NAMES`), else the profile
    whose name the GPU's name holds (the longest such name: ``gh200`` before ``h200``; the
    nearest in memory where several are as long: an RTX 4090 of 48 GB), else the nearest in
    memory bandwidth of its family (the parts whose name starts as the GPU's model does: an
    H100 NVL takes an H100's figures), else of every part; never a link the GPU's name does not
    claim (a PCIe card never gets NVLink-C2C's host link)."""
    key = name_key(facts.name)
    profiles = [_builtin_profile(n) for n in builtin_profiles()]
    by_name = {p.name: p for p in profiles}
    for alias in sorted(NVML_NAMES, key=len, reverse=True):
        if alias in key and NVML_NAMES[alias] in by_name:
            return by_name[NVML_NAMES[alias]], f"the GPU's name {facts.name!r} is NVML's name for it", True
    allowed = [p for p in profiles if not any(p.link == link and not any(w in key for w in words)
                                              for link, words in NAMED_LINKS.items())]
    # a profile's name inside the GPU's, not followed by a digit (an L40 is no L4)
    named = [(len(k), p) for p in allowed
             if re.search(re.escape(k := name_key(re.sub(r"-\d+gb$", "", p.name))) + r"(?!\d)", key)]
    if named:
        longest = max(n for n, _ in named)
        best = min((p for n, p in named if n == longest),
                   key=lambda p: (abs(p["device_memory_gb"] - facts.memory_gb), p.name))
        return best, f"the GPU's name {facts.name!r} names it", True
    model = re.match(r"[a-z]+\d+", key)
    family = [p for p in allowed if model and (k := name_key(p.name)).startswith(model.group(0))
              and not k[len(model.group(0)):][:1].isdigit()] or allowed  # an L4 is no L40S
    bw = facts.mem_bw_peak_gbs
    best = min(family, key=lambda p: (abs(math.log(p["mem_bw_peak_gbs"] / bw)) if bw else
                                      abs(math.log(p["device_memory_gb"] / facts.memory_gb)), p.name))
    kin = f"the nearest of its family ({model.group(0)}) in " if family is not allowed else "the nearest "
    return best, (f"no built-in profile is named {facts.name!r}; {best.name}: {kin}"
                  + ("memory bandwidth" if bw else "memory size")), False


def this_gpu(facts: GpuFacts, index: int = 0) -> HardwareProfile:
    """One detected GPU's profile (``--hw this``): its memory as NVML says (measured), its
    peak bandwidth and link from NVML's bus width, memory clock and PCIe link (derived), the
    rest from the nearest known part (moesim.gpu_detect says why)."""
    base, why, same = nearest_gpu(facts)
    figures = dict(base.figures) if same else {
        k: Figure(f.value, "estimate", f"estimate: the nearest known part's, {base.name} ({why}): {f.source}")
        for k, f in base.figures.items()}
    nvml = f"detected on this machine (NVML, GPU {index}: {facts.name})"
    figures["device_memory_gb"] = Figure(round(facts.memory_gb, 2), "measured", nvml)
    if (bw := facts.mem_bw_peak_gbs) is not None:
        share = base["mem_bw_achievable_gbs"] / base["mem_bw_peak_gbs"]
        src = f"{nvml}: {facts.bus_bits}-bit bus x {facts.mem_clock_mhz} MHz x 2"
        figures["mem_bw_peak_gbs"] = Figure(round(bw, 1), "derived", src)
        figures["mem_bw_achievable_gbs"] = Figure(round(bw * share, 1), "estimate",
                                                  f"estimate: {src}, at {base.name}'s achievable share ({share:.2f})")
    link = base.link
    if (peak := facts.link_peak_gbs) is not None and base.link.startswith("pcie"):
        base_peak = PCIE_LANE_GBS[int(base.link[-1])] * 16
        link = f"pcie{facts.pcie_gen}" if f"pcie{facts.pcie_gen}" in LINK_KINDS else base.link
        figures["h2d_pinned_gbs"] = Figure(round(base["h2d_pinned_gbs"] * peak / base_peak, 2), "estimate",
                                           f"estimate: {nvml}: PCIe {facts.pcie_gen}.0 x{facts.pcie_width} "
                                           f"({peak:.1f} GB/s peak), at {base.name}'s pinned-copy share of its "
                                           f"x16 {base.link} link")
    desc = (f"this machine's GPU {index}: {facts.name}, {facts.memory_gb:.0f} GB"
            + (f", PCIe {facts.pcie_gen}.0 x{facts.pcie_width}" if facts.link_peak_gbs else "")
            + ("" if same else f"; rates from {base.name} ({why})"))
    return HardwareProfile(f"this-{base.name}" if same else "this-gpu", desc, link, figures, "NVML", THIS_HOST)


def this_machine(facts: list[GpuFacts] | None = None) -> Machine:
    """``--hw this``: every GPU NVML sees (:func:`this_gpu`), on this machine's host (``--host this``)."""
    gpus = tuple(this_gpu(f, i) for i, f in enumerate(facts if facts is not None else read_gpus()))
    names = [g.name for g in gpus]  # named as get_machine names machines: this-rtx4090, 2xthis-rtx4090, A+B
    name = names[0] if len(gpus) == 1 else f"{len(gpus)}x{names[0]}" if len(set(names)) == 1 else "+".join(names)
    return Machine(gpus, name)


#: ``--host NAME@CxM[@Ns]``: what varies inside one machine, said after its host profile:
#: C memory channels of one socket populated at M MT/s, N sockets.
_VARIANT = re.compile(r"^(?:(?P<channels>\d+)x(?P<mts>\d+(?:\.\d+)?)|(?P<sockets>\d+)s)$")


def host_variant(base: HostProfile, spec: str) -> HostProfile:
    """``base`` with its memory system or sockets as ``spec`` says (``12x4800``: 12 channels
    of one socket at 4800 MT/s; ``2s``: two sockets; several joined by ``@``). The peak is
    channels x MT/s x 8 bytes (a DDR channel is 64 bits wide); the achievable bandwidth keeps
    the profile's achievable share of its own peak, so a desktop with two DIMMs of DDR5-6400
    is one figure away from the shipped profile, not a hand-edited TOML."""
    figs, names = dict(base.figures), []
    for item in spec.split("@"):
        m = _VARIANT.match(item.strip().lower())
        said = [n for n in names if (m is not None) and (n.endswith("s") == bool(m["sockets"]))]
        if said:
            raise MoesimError(f"--host {base.name}@{spec}: {said[0]} and {item.strip()} both set the "
                              + ("sockets" if said[0].endswith("s") else "memory channels and speed") + "; give one")
        if m is None:
            raise MoesimError(f"--host {base.name}@{spec}: after @, CHANNELSxMTS (12x4800: 12 memory channels at 4800 "
                              "MT/s) or Ns (2s: two sockets), joined by @")
        if m["sockets"]:
            n = int(m["sockets"])
            if not 1 <= n <= 16:
                raise MoesimError(f"--host {base.name}@{spec}: {n} sockets; from 1 to 16")
            figs["sockets"] = Figure(float(n), "estimate", f"--host ...@{item}: {n} sockets, each as the profile's one")
            item = f"{n}s"  # named by its value: @02s is @2s
        else:
            ch, mts = int(m["channels"]), float(m["mts"])
            if not (1 <= ch <= 24 and 800 <= mts <= 20000):
                raise MoesimError(f"--host {base.name}@{spec}: {ch} channels at {mts:g} MT/s; 1 to 24 channels of a "
                                  "socket, 800 to 20000 MT/s")
            peak = ch * mts * 8 / 1000
            share = base["mem_bw_achievable_gbs"] / base["mem_bw_peak_gbs"]
            src = f"--host ...@{item}: {ch} channels x {mts:g} MT/s x 8 bytes"
            figs["mem_bw_peak_gbs"] = Figure(peak, "estimate", src)
            figs["mem_bw_achievable_gbs"] = Figure(peak * share, "estimate", f"{src}, at {base.name}'s achievable share "
                                                                            f"of its own peak ({share:.2f})")
            item = f"{ch}x{mts:g}"  # named by its value: @02x4800.0 is @2x4800
        names.append(item.strip().lower())
    names.sort(key=lambda n: n.endswith("s"))  # @2s@12x4800 is @12x4800@2s: one name for one value
    sockets = int(figs["sockets"].value) if "sockets" in figs else 1
    return replace(base, name=f"{base.name}@{'@'.join(names)}", figures=figs,
                   description=f"{base.description}; as varied by @{'@'.join(names)}: {sockets} socket"
                               f"{'s' if sockets != 1 else ''}, memory {figs['mem_bw_peak_gbs'].value:g} GB/s peak "
                               "a socket (the figures below say which were given)")


def get_host(name_or_path: str | None = None, gpu: HardwareProfile | None = None) -> HostProfile:
    """A built-in host by name, a user's TOML by path, ``this`` (:func:`this_host`), or (no
    name) the GPU profile's own host; ``NAME@12x4800@2s`` varies its memory channels and speed
    and its sockets (:func:`host_variant`)."""
    if not name_or_path:
        if gpu is None or not gpu.host:
            where = f"GPU profile {gpu.name!r} names no host" if gpu is not None else "no host given"
            raise MoesimError(f"{where}; pick one with --host (built-in: {', '.join(builtin_hosts())})")
        name_or_path = gpu.host  # `--hw this`: `this` too
    if "@" in name_or_path and not Path(name_or_path).exists():
        if Path(name_or_path).suffix == ".toml":  # a file named with @ that is not there, not a variant
            given_path(name_or_path, "host profile")
        parts = name_or_path.split("@")
        if not parts[0].strip():
            raise MoesimError(f"--host {name_or_path}: name the host before @ (e.g. epyc-9654{name_or_path}; "
                              "`moesim hw --hosts` lists them)")
        cut = next((i for i in range(len(parts) - 1, 0, -1) if Path("@".join(parts[:i])).exists()), 1)
        return host_variant(get_host("@".join(parts[:cut]), gpu), "@".join(parts[cut:]))  # the base: a file with @ too
    if name_or_path.strip().lower() == THIS_HOST:
        return this_host()
    builtin = builtin_hosts()
    if name_or_path.lower() in builtin:
        return _builtin_host(name_or_path.lower())
    p = given_path(name_or_path, "host profile")
    if p is not None:
        return load_host(p)
    raise MoesimError(f"unknown host profile {name_or_path!r}{nearest_hint(name_or_path, builtin)}; built-in: "
                      f"{', '.join(builtin)} (or a .toml path)")


# ---------------------------------------------------------------------------------------
# A machine: the GPUs of one host
# ---------------------------------------------------------------------------------------

#: ``--hw none``: a machine without a GPU (every weight in host memory, computed by the CPU).
NO_GPU = "none"


@dataclass(frozen=True)
class Machine:
    """The GPUs of one host: none, one, or several of the same or mixed profiles
    (``--hw none``, ``--hw rtx4090``, ``--hw 2xrtx5090``, ``--hw rtx4090+rtx3090``)."""

    gpus: tuple[HardwareProfile, ...]
    name: str

    @property
    def n_gpus(self) -> int:
        return len(self.gpus)

    @property
    def host(self) -> str:
        """The host profile the (first) GPU names; none for a machine without GPUs."""
        return self.gpus[0].host if self.gpus else ""

    def with_figure(self, key: str, value: float, kind: str = "estimate", source: str = "what-if") -> Machine:
        """Every GPU with one figure replaced (a what-if's link bandwidth)."""
        return replace(self, gpus=tuple(g.with_figure(key, value, kind, source) for g in self.gpus))

    def link_gbps(self) -> float | None:
        return self.gpus[0]["h2d_pinned_gbs"] if self.gpus else None

    def device_memory_gb(self) -> list[float]:
        return [g["device_memory_gb"] for g in self.gpus]


def get_machine(text: str | HardwareProfile | Machine) -> Machine:
    """``none``, a GPU profile (name or path), ``NxPROFILE`` or ``A+B+...`` as a machine."""
    if isinstance(text, Machine):
        return text
    if isinstance(text, HardwareProfile):
        return Machine((text,), text.name)
    t = text.strip()
    if t.lower() == NO_GPU:
        return Machine((), NO_GPU)
    if t.lower() == THIS_HOST:
        return this_machine()
    if "+" in t:
        parts = [p.strip() for p in t.split("+")]
        if not all(parts):
            raise MoesimError(f"--hw {text!r}: join GPU profiles with '+', e.g. rtx4090+rtx3090")
        gpus = tuple(g for p in parts for g in get_machine(p).gpus)
        if len(gpus) != len(parts) and any(get_machine(p).n_gpus != 1 for p in parts):
            raise MoesimError(f"--hw {text!r}: each part joined by '+' is one GPU profile")
        return Machine(gpus, "+".join(g.name for g in gpus))
    many = re.fullmatch(r"(\d+)x(.+)", t, re.IGNORECASE)  # 2Xrtx3090 as 2xrtx3090 (get_profile reads it so)
    if many and t.lower() not in builtin_profiles():
        n = int(many.group(1))
        if not 1 <= n <= 64:
            raise MoesimError(f"--hw {text!r}: 1 to 64 GPUs of one profile")
        if many.group(2).strip().lower() == NO_GPU:
            raise MoesimError(f"--hw {text!r}: {NO_GPU} is the machine without a GPU, which takes no count; "
                              f"give --hw {NO_GPU}, or NxPROFILE for N GPUs")
        gpu = get_profile(many.group(2))
        return Machine((gpu,) * n, gpu.name if n == 1 else f"{n}x{gpu.name}")
    gpu = get_profile(t)
    return Machine((gpu,), gpu.name)
