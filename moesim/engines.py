"""Engine profiles: what the software that runs the model adds to the hardware.

The same GPU and CPU decode at different speeds under llama.cpp, KTransformers, vLLM or
a Hugging Face model in PyTorch eager: their kernels reach different shares of the
memory bandwidth for each weight format, launch different numbers of kernels, pay
different per-layer costs, and read the KV cache more or less efficiently. An engine
profile is a TOML file under ``hwprofiles/engines/`` (format: ``docs/engine-format.md``)
whose every figure has a value, a kind (``datasheet``, ``measured``, ``estimate`` or
``fitted``) and a source, as hardware figures do; :class:`moesim.costmodel.CostModel`
reads them, and nothing else does.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.fmt import nearest_hint, number
from moesim.hardware import Figure, _FigureLookup, given_path, parse_figures, read_toml
from moesim.models import DTYPES

#: Figure name -> (unit, required, whether an integer, description).
ENGINE_FIGURES: dict[str, tuple[str, bool, bool, str]] = {
    "attention_kernels": ("count", True, True, "GPU kernels per attention block (norms, projections, rope, "
                                               "attention, residual, router, top-k)"),
    "expert_kernels": ("count", True, True, "GPU kernels per routed expert (per layer's experts when fused)"),
    "fused_experts": ("0/1", True, True, "1: one grouped kernel set runs a layer's experts (launches once a layer)"),
    "head_kernels": ("count", True, True, "GPU kernels of the final norm, LM head and sampling"),
    "predict_kernels": ("count", True, True, "GPU kernels of one next-layer expert prediction"),
    "kernel_launch_us": ("us", False, False, "cost of one GPU kernel (absent: the GPU profile's kernel_launch_us)"),
    "launch_overlap": ("0/1", False, True, "1: launches overlap the kernels' execution (a replayed CUDA graph): a "
                                          "block takes max(work, launches); 0: they add up (absent: 0)"),
    "layer_overhead_us": ("us", False, False, "fixed framework cost per layer on the GPU (absent: the GPU "
                                              "profile's layer_overhead_us)"),
    "partial_offload_launch_us": ("us", False, False, "cost of one GPU kernel when some of the model runs on the "
                                                      "CPU (partial offload), where the engine launches kernels one "
                                                      "by one instead of replaying a CUDA graph (absent: "
                                                      "kernel_launch_us)"),
    "kv_read_efficiency": ("fraction", False, False, "share of the device bandwidth attention reaches reading the "
                                                     "KV cache (absent: its kernels' share on bf16 weights)"),
    "link_efficiency": ("fraction", False, False, "share of the GPU profile's pinned host-to-device bandwidth the "
                                                  "engine's expert copies reach (absent: 1; pageable or small copies "
                                                  "reach less)"),
    "evicted_copy_back": ("0/1", False, True, "1: each expert copied in frees its cache slot by copying the expert "
                                              "it evicts back to host memory over the link first, on the same "
                                              "stream, so a miss moves an expert each way in turn (absent: 0: the "
                                              "host copy is kept and an evicted expert is dropped)"),
    "cpu_layer_overhead_us": ("us", False, False, "fixed cost per layer with work on the CPU: thread-pool "
                                                  "barriers and graph scheduling (absent: 0)"),
    "cpu_expert_dispatch_us": ("us", False, False, "CPU cost to start one expert (absent: the host profile's)"),
    "activation_roundtrip_us": ("us", False, False, "GPU -> CPU -> GPU activation round trip per layer (absent: "
                                                    "the host profile's)"),
    "numa_efficiency": ("fraction", False, False, "share of each further socket's bandwidth the engine turns "
                                                  "into speed (absent: 0: one socket's bandwidth)"),
    "pages_from_disk": ("0/1", False, True, "1: the weights are a memory-mapped file, so a model larger than host "
                                            "RAM pages from disk (llama.cpp's mmap); 0: it must fit"),
    "layer_split_graph_replay": ("0/1", False, True, "0: with the model's layers split over several GPUs the "
                                                     "engine launches its kernels one by one (at "
                                                     "partial_offload_launch_us) instead of replaying a CUDA graph "
                                                     "(absent: 1)"),
    "state_passes": ("count", False, True, "passes over a linear-attention layer's recurrent state a decode token "
                                           "makes on the GPU, reads and writes counted apart (absent: 2, one read "
                                           "and one write: a fused kernel)"),
}
#: Weight-format efficiencies: fraction of the processor's achievable memory bandwidth the
#: engine's kernels reach reading weights of a format (``default``, or a format name of
#: ``moesim.models.DTYPES``).
EFFICIENCY_TABLES = ("cpu_weight_efficiency", "gpu_weight_efficiency")
#: Kernel rates: G multiply-adds a second ONE CPU thread of the engine's matrix-vector
#: kernels reaches on weights of a format, dequantisation included (``default`` or a format
#: name). A decode step's CPU math runs at ``threads`` times it, never above the host's GEMM
#: rate; absent, the host's GEMM rate alone bounds it. Where one thread cannot keep up with
#: the memory (a format that is costly to unpack, few threads), this, not the bandwidth,
#: sets the speed, and more threads help.
RATE_TABLES = ("cpu_kernel_gmacs",)
#: Per layer kind, the share of the roofline the engine's kernels reach on a layer's token
#: mixer (its attention or linear-attention weights, its KV cache or recurrent state, and
#: their math): ``full`` (grouped-query attention), ``mla`` (DeepSeek's latent attention),
#: ``sliding``, ``chunked``, ``linear`` (gated delta-net and other linear attention). An
#: engine is not equally mature on every kind: a kind its version runs with unfused or
#: CPU-fallback kernels says so here, with the version in the source ("not optimised in
#: version X"). Absent: 1, the roofline.
#: The engine's graph for a layer kind, per kind: ``layer_kernels`` the GPU kernels of the block
#: before the routed experts (norms, projections, the mixer, residuals, router; absent: the
#: figure ``attention_kernels``), counted from the engine's source; ``graph_replay`` 0 where the
#: engine cannot replay a CUDA graph for a model that has a layer of the kind (its kernels are
#: then launched one by one, at ``partial_offload_launch_us``; absent: 1).
LAYER_TABLES = ("layer_efficiency", "layer_kernels", "graph_replay")
LAYER_EFFICIENCY_KINDS = ("full", "mla", "sliding", "chunked", "linear")
MIN_LAYER_EFFICIENCY = 1e-3
TABLES = EFFICIENCY_TABLES + RATE_TABLES + LAYER_TABLES
ZERO_OK = {"fused_experts", "layer_overhead_us", "cpu_layer_overhead_us", "numa_efficiency", "pages_from_disk",
           "launch_overlap", "layer_split_graph_replay", "evicted_copy_back"}
TOP_KEYS = {"name", "description", "runs_on", "policies", "figures", "expert_placement", "calibration", "runs_as",
            "before", "as_of", *TABLES}
#: What a ``[[before]]`` entry holds: the build date it ends at and the figures (``figures`` or a
#: table of :data:`TABLES`) that builds from before that date had instead.
BEFORE_KEYS = {"date", "figures", *TABLES}
#: A calibrated profile's ``[calibration]`` (``moesim fit --measured`` writes it): the range its
#: answers carry (factors on predicted tokens/s, leave one measured row out) and on what.
CALIBRATION_KEYS = {"low": float, "high": float, "rows": int, "basis": str}
#: Which experts an engine keeps on the GPU when it computes the rest on the CPU and is told
#: only how many (hot-experts): ``frequency``, the most routed ones (by a calibration trace),
#: or ``uniform``, the lowest-numbered ones of every layer, blind to popularity
#: (:func:`moesim.policy.placement.uniform_set`).
PLACEMENTS = ("frequency", "uniform")
RUNS_ON = ("gpu", "cpu")


@dataclass(frozen=True)
class EngineProfile(_FigureLookup):
    """An inference engine's figures (see the module docstring)."""

    name: str
    description: str
    runs_on: tuple[str, ...]
    figures: dict[str, Figure]
    policies: tuple[str, ...] = ()  # the moesim policies the engine runs (empty: every one)
    cpu_weight_efficiency: dict[str, Figure] = field(default_factory=dict)
    gpu_weight_efficiency: dict[str, Figure] = field(default_factory=dict)
    cpu_kernel_gmacs: dict[str, Figure] = field(default_factory=dict)
    layer_efficiency: dict[str, Figure] = field(default_factory=dict)
    layer_kernels: dict[str, Figure] = field(default_factory=dict)
    graph_replay: dict[str, Figure] = field(default_factory=dict)
    path: str = ""
    expert_placement: str = "frequency"  # one of PLACEMENTS: the engine's default
    calibration: dict[str, Any] | None = field(default=None, compare=False)  # CALIBRATION_KEYS, when calibrated
    #: Earlier versions, newest first: (a build date, the figures builds before it had).
    before: tuple[tuple[str, dict[str, Figure]], ...] = ()
    as_of: str = ""  # the build date :meth:`at` priced ("": the newest build)
    #: The built-in engine whose command-line arguments run this profile's deployments: a
    #: built-in's own name; a user's file says it (``runs_as = "llama.cpp"``), else none is printed.
    runs_as: str = ""

    # The figures in the units the cost model uses.
    @property
    def attention_kernels(self) -> int:
        return int(self["attention_kernels"])

    @property
    def expert_kernels(self) -> int:
        return int(self["expert_kernels"])

    @property
    def fused_experts(self) -> bool:
        return bool(self["fused_experts"])

    @property
    def head_kernels(self) -> int:
        return int(self["head_kernels"])

    @property
    def predict_kernels(self) -> int:
        return int(self["predict_kernels"])

    @property
    def kernel_launch_us(self) -> float | None:
        return self["kernel_launch_us"] if "kernel_launch_us" in self.figures else None

    @property
    def layer_overhead_us(self) -> float | None:
        return self["layer_overhead_us"] if "layer_overhead_us" in self.figures else None

    @property
    def pages_from_disk(self) -> bool:
        return bool(self.get("pages_from_disk"))

    def runs(self, policy: str) -> bool:
        """Whether the engine runs the registered policy named ``policy``: its profile's names are
        kept as written (an engine that lists none runs every one); :func:`moesim.policy.runs_on`
        checks them against the registry, where both are known."""
        return not self.policies or policy in self.policies

    def weight_efficiency(self, where: str, dtype: str) -> float:
        """Share of ``where``'s (``cpu`` or ``gpu``) bandwidth its kernels reach on ``dtype`` weights."""
        table = self.cpu_weight_efficiency if where == "cpu" else self.gpu_weight_efficiency
        f = table.get(dtype) or table.get("default")
        return f.value if f is not None else 1.0

    def mixer_efficiency(self, kind: str) -> float:
        """Share of the roofline the engine reaches on a token mixer of ``kind`` (one of
        :data:`LAYER_EFFICIENCY_KINDS`; 1 where its profile says nothing)."""
        f = self.layer_efficiency.get(kind)
        return f.value if f is not None else 1.0

    def kernels_before_experts(self, kind: str) -> int:
        """GPU kernels of a layer's block before its routed experts when its token mixer is of
        ``kind`` (the ``layer_kernels`` table, else ``attention_kernels``)."""
        f = self.layer_kernels.get(kind)
        return int(f.value) if f is not None else self.attention_kernels

    def replays_graph(self, kinds) -> bool:
        """Whether the engine replays a CUDA graph for a model with layers of ``kinds`` (its
        ``launch_overlap``, unless ``graph_replay`` says a kind stops it)."""
        return bool(self.get("launch_overlap")) and all(
            self.graph_replay[k].value for k in kinds if k in self.graph_replay)

    def at(self, date: str | None) -> EngineProfile:
        """The engine as a build from ``date`` (:func:`build_date`; None: the newest) ran it: the
        figures of every ``[[before]]`` change made after that date, the oldest last, so that a
        build older than two changes gets the older figures (an engine without such entries is
        the same at every date)."""
        if date is None or not self.before:
            return self
        day = build_date(date, self.name, llama_builds=(self.runs_as or self.name) == "llama.cpp")
        out = self
        for until, figs in self.before:  # newest first
            if day < until:
                for key, fig in figs.items():
                    out = out.with_figure(key, fig.value, fig.kind, fig.source)
        # One build, fixed: no earlier builds left to choose (a profile written from it is that build).
        return replace(out, description=f"{self.description} (a build from {day})", before=(), as_of=day)

    @property
    def label(self) -> str:
        """The engine as an answer names it: with the build date it was priced at, if one was given."""
        return f"{self.name}@{self.as_of}" if self.as_of else self.name

    def cpu_kernel_flops(self, dtype: str) -> float | None:
        """FLOPs a second one CPU thread's kernels reach on ``dtype`` weights (``cpu_kernel_gmacs``
        x 2e9); None where the engine gives no rate for it."""
        f = self.cpu_kernel_gmacs.get(dtype) or self.cpu_kernel_gmacs.get("default")
        return None if f is None else 2e9 * f.value

    def with_figure(self, key: str, value: float, kind: str = "estimate", source: str = "what-if") -> EngineProfile:
        """A copy with one figure (``name``, or ``TABLE.FORMAT`` such as ``cpu_weight_efficiency.q4_k``) replaced."""
        table, _, name = key.rpartition(".")
        fig = Figure(float(value), kind, source)
        if table:
            if table not in TABLES:
                raise MoesimError(f"unknown engine table {table!r}; known: {', '.join(TABLES)}")
            return replace(self, **{table: {**getattr(self, table), name: fig}})
        if name not in ENGINE_FIGURES:
            raise MoesimError(f"unknown engine figure {name!r}; known: {', '.join(ENGINE_FIGURES)}")
        return replace(self, figures={**self.figures, name: fig})

    def to_toml(self) -> str:
        """The profile as an engine TOML :func:`load_engine` reads back (through tomli-w: a
        well-kept writer quotes and escapes any source text)."""
        import tomli_w

        def figs(table: dict[str, Figure], known: dict | None = None) -> dict[str, dict[str, Any]]:
            return {k: {"value": int(f.value) if known and known[k][2] else f.value, "kind": f.kind, "source": f.source}
                    for k, f in table.items()}

        data: dict[str, Any] = {"name": self.name, "description": self.description, "runs_on": list(self.runs_on)}
        if self.policies:
            data["policies"] = list(self.policies)
        data["expert_placement"] = self.expert_placement
        if self.runs_as:  # a copy (a calibrated profile) still prints the arguments of the engine it runs as
            data["runs_as"] = self.runs_as
        if self.as_of:  # the build it describes (NAME@DATE), kept when written and read back
            data["as_of"] = self.as_of
        if self.calibration:
            data["calibration"] = dict(self.calibration)
        data["figures"] = figs(self.figures, ENGINE_FIGURES)
        for t in TABLES:
            if getattr(self, t):
                data[t] = figs(getattr(self, t))
        if self.before:
            data["before"] = [_before_table(day, fs, figs) for day, fs in self.before]
        return tomli_w.dumps(data)

    def sources(self) -> list[tuple[str, Figure]]:
        """Every figure with its name, for ``moesim hw --engines NAME``."""
        out = list(self.figures.items())
        for t in TABLES:
            out += [(f"{t}.{k}", v) for k, v in getattr(self, t).items()]
        return out


#: The figures that are 0 or 1.
FLAGS = ("fused_experts", "pages_from_disk", "launch_overlap", "layer_split_graph_replay")


def _check_values(figures: dict[str, Figure], tables: dict[str, dict[str, Figure]], where: str) -> None:
    """What a figure's own parse cannot say, for a profile and each ``[[before]]`` entry alike:
    a flag is 0 or 1, a layer efficiency at least a thousandth."""
    for flag in FLAGS:
        if flag in figures and figures[flag].value not in (0, 1):
            raise MoesimError(f"{where}: {flag} is 0 or 1, got {number(figures[flag].value)}")
    for kind, f in tables.get("layer_efficiency", {}).items():
        if f.value < MIN_LAYER_EFFICIENCY:
            raise MoesimError(f"{where}: layer_efficiency.{kind} {number(f.value)}: at least {MIN_LAYER_EFFICIENCY:g} "
                              "(a thousandth of the roofline; below that no kernel runs)")


def _before_table(day: str, figures: dict[str, Figure], figs) -> dict[str, Any]:
    """One ``[[before]]`` entry as TOML data (the inverse of :func:`_before`)."""
    out: dict[str, Any] = {"date": day}
    for key, f in figures.items():
        table, _, name = key.rpartition(".")
        out.setdefault(table or "figures", {}).update(figs({name: f}))
    return out


def build_date(text: Any, where: str, llama_builds: bool = False) -> str:
    """An engine build's date as ``YYYY-MM-DD`` (``YYYY-MM`` or ``YYYY``: its first day; with
    ``llama_builds``, a llama.cpp release ``bNNNN``: :func:`release_date`), or one line."""
    t = str(text).strip()
    for fmt in ("%Y-%m-%d", "%Y-%m", "%Y"):
        try:
            return datetime.datetime.strptime(t, fmt).date().isoformat()
        except ValueError:
            continue
    if re.fullmatch(r"[bB]\d+", t):  # llama.cpp's build number (b6000): dated by its release list
        if llama_builds:
            return release_date(int(t[1:]), where)
        raise MoesimError(f"{where}: {t} is a llama.cpp release number; give this build's date (YYYY-MM-DD)")
    raise MoesimError(f"{where}: build date {t!r}: YYYY-MM-DD, YYYY-MM or YYYY, or a llama.cpp build (b6000)")


#: llama.cpp's releases are its build numbers (``b6000``: the 6000th commit on master, tagged
#: as it lands), so a number is a date. These are dated releases (the number, the day the
#: release was taken up, where): projects that bundle llama.cpp bump to the newest tag the day
#: they write the change, so each day is the release's or within days of it. A number between two
#: is dated by linear interpolation (builds land at a steady few dozen a day), which is as
#: fine as the profile's ``[[before]]`` dates need; outside them it is refused.
LLAMA_CPP_RELEASES: tuple[tuple[int, str, str], ...] = (
    (5165, "2025-04-21", "termux/termux-packages#24443"),
    (5233, "2025-04-30", "termux/termux-packages#24559"),
    (5857, "2025-07-10", "janhq/jan#5703"),
    (6089, "2025-08-05", "termux/termux-packages#25599"),
    (6301, "2025-08-28", "luncliff/vcpkg-registry#433"),
    (6451, "2025-09-13", "xorbitsai/xllamacpp#81"),
    (6709, "2025-10-11", "mybigday/llama.rn#224"),
    (7045, "2025-11-13", "docker/model-runner#404"),
    (7815, "2026-01-23", "ferranpons/Llamatik#37"),
    (8651, "2026-04-03", "gominimal/pkgs#40"),
    (9174, "2026-05-16", "docker/model-runner#918"),
    (9512, "2026-06-04", "containers/ramalama#2783"),
    (9701, "2026-06-18", "containers/ramalama#2805"),
    (9986, "2026-07-14", "containers/ramalama#2842"),
    (10630, "2026-08-25", "ollama/ollama#18003"),
    (10760, "2026-09-02", "ollama/ollama#18199"),
    (10864, "2026-09-08", "ollama/ollama#18317"),
)


def release_date(build: int, where: str = "engine") -> str:
    """The day llama.cpp's release ``b{build}`` was tagged, from :data:`LLAMA_CPP_RELEASES`
    (exact for a listed one, interpolated between the two around it), or one line."""
    days = [(n, datetime.date.fromisoformat(d)) for n, d, _ in LLAMA_CPP_RELEASES]
    (first, d0), (last, d1) = days[0], days[-1]
    if not first <= build <= last:
        raise MoesimError(f"{where}: b{build} is outside the llama.cpp releases moesim can date (b{first} of {d0} to "
                          f"b{last} of {d1}): give its date (YYYY-MM-DD; "
                          f"github.com/ggml-org/llama.cpp/releases/tag/b{build} says it)")
    for (n0, a), (n1, b) in zip(days, days[1:]):
        if n0 <= build <= n1:
            return (a + datetime.timedelta(days=round((b - a).days * (build - n0) / (n1 - n0)))).isoformat()
    raise AssertionError("unreachable: the releases are in order")


def _before(raw: Any, where: str) -> tuple[tuple[str, dict[str, Figure]], ...]:
    """The ``[[before]]`` entries: a date and the figures builds before it had, newest first."""
    if not isinstance(raw, list) or not all(isinstance(b, dict) for b in raw):
        raise MoesimError(f"{where}: [[before]] entries are tables (date and figures)")
    optional = {k: (u, False, i, d) for k, (u, _, i, d) in ENGINE_FIGURES.items()}
    out = []
    for n, b in enumerate(raw, 1):
        at = f"{where}: [[before]] #{n}"
        unknown = set(b) - BEFORE_KEYS
        if unknown or "date" not in b or len(b) < 2:
            raise MoesimError(f"{at}: a date and at least one of figures, {', '.join(TABLES)} "
                              f"{'(unknown: ' + ', '.join(sorted(unknown)) + ')' if unknown else ''}".rstrip())
        figures = parse_figures(b.get("figures", {}), optional, at, zero_ok=ZERO_OK)
        tables = {t: _by_format(b.get(t, {}), at, t) for t in TABLES}
        _check_values(figures, tables, at)
        figs = {**figures, **{f"{t}.{k}": f for t, fs in tables.items() for k, f in fs.items()}}
        if not figs:
            raise MoesimError(f"{at}: its tables hold no figure (a date and at least one figure)")
        out.append((build_date(b["date"], at), figs))
    days = [d for d, _ in out]
    if len(set(days)) != len(days):
        raise MoesimError(f"{where}: two [[before]] entries with one date")
    return tuple(sorted(out, key=lambda x: x[0], reverse=True))


def unit_of(key: str) -> str:
    """The unit of an engine figure, ``name`` or ``TABLE.KEY`` (what ``moesim hw --engines`` prints)."""
    table, _, name = key.rpartition(".")
    if not table:
        return ENGINE_FIGURES[name][0] if name in ENGINE_FIGURES else ""
    return {"layer_kernels": "count", "graph_replay": "0/1"}.get(table, "GMAC/s" if table in RATE_TABLES
                                                                  else "fraction")


def _by_format(raw: Any, where: str, table: str) -> dict[str, Figure]:
    """A table of one figure per weight format (``default`` or a name of moesim.models.DTYPES)."""
    if not isinstance(raw, dict):
        raise MoesimError(f"{where}: [{table}] must be a table")
    unit = unit_of(f"{table}.x")
    keys = LAYER_EFFICIENCY_KINDS if table in LAYER_TABLES else ("default", *DTYPES)
    known = {k: (unit, False, unit != "fraction" and unit != "GMAC/s", "") for k in keys}
    figs = parse_figures(raw, known, where, section=table, zero_ok=set(keys) if table == "graph_replay" else set())
    bad = [k for k, f in figs.items() if unit == "0/1" and f.value not in (0, 1)]
    if bad:
        raise MoesimError(f"{where}: {table}.{bad[0]} is 0 or 1, got {number(figs[bad[0]].value)}")
    return figs


def parse_engine(data: dict[str, Any], where: str) -> EngineProfile:
    """Validate a parsed engine TOML and build the profile (errors name the field)."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise MoesimError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(TOP_KEYS))}")
    for key in ("name", "runs_on", "figures"):
        if key not in data:
            raise MoesimError(f"{where}: missing required key {key!r}")
    runs = data["runs_on"]
    if not isinstance(runs, list) or not runs or any(r not in RUNS_ON for r in runs):
        raise MoesimError(f"{where}: runs_on must be a non-empty list of {', '.join(RUNS_ON)}")
    figures = parse_figures(data["figures"], ENGINE_FIGURES, where, zero_ok=ZERO_OK)
    tables = {t: _by_format(data.get(t, {}), where, t) for t in TABLES}
    _check_values(figures, tables, where)
    pols = data.get("policies", [])
    if not isinstance(pols, list) or not all(isinstance(p, str) for p in pols):
        raise MoesimError(f"{where}: policies must be a list of policy names")
    if "policies" in data and not pols:  # absent means every policy; an empty list would say the same silently
        raise MoesimError(f"{where}: policies must name at least one policy (leave it out: the engine runs every one)")
    pols = tuple(p.strip().lower() for p in pols)  # policy names: moesim.policy.runs_on checks them
    placement = data.get("expert_placement", "frequency")
    if placement not in PLACEMENTS:
        raise MoesimError(f"{where}: expert_placement is one of {', '.join(PLACEMENTS)}, got {placement!r}")
    runs_as = data.get("runs_as", "")
    if "runs_as" in data and (not isinstance(runs_as, str) or runs_as.lower() not in builtin_engines()):
        raise MoesimError(f"{where}: runs_as {runs_as!r}: the built-in engine whose arguments run this profile, one "
                          f"of {', '.join(builtin_engines())}")
    as_of = data.get("as_of", "")
    if "as_of" in data:
        if not isinstance(as_of, str):
            raise MoesimError(f"{where}: as_of {as_of!r}: the build date the profile describes (YYYY-MM-DD)")
        as_of = build_date(as_of, str(data["name"]))
        if data.get("before"):
            raise MoesimError(f"{where}: as_of names one build; a profile of one build has no [[before]] entries")
    return EngineProfile(str(data["name"]), str(data.get("description", "")), tuple(runs), figures, pols, **tables,
                         path=where, expert_placement=placement, calibration=_calibration(data, where),
                         before=_before(data.get("before", []), where), runs_as=runs_as.lower(), as_of=as_of)


def _calibration(data: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A calibrated profile's ``[calibration]`` table, checked (:data:`CALIBRATION_KEYS`)."""
    if "calibration" not in data:
        return None
    cal = data["calibration"]
    if not isinstance(cal, dict) or set(cal) != set(CALIBRATION_KEYS):
        raise MoesimError(f"{where}: [calibration] holds exactly {', '.join(CALIBRATION_KEYS)}")
    for key, kind in CALIBRATION_KEYS.items():
        v = cal[key]
        if kind is str:
            ok = isinstance(v, str)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if not ok:
            raise MoesimError(f"{where}: calibration.{key} {v!r}: {'text' if kind is str else 'a positive number'}")
    if cal["low"] > cal["high"] or cal["rows"] != int(cal["rows"]):
        raise MoesimError(f"{where}: calibration low <= high (factors on the prediction), rows a whole number")
    return {k: kind(cal[k]) for k, kind in CALIBRATION_KEYS.items()}


def load_engine(path: str | Path) -> EngineProfile:
    path = Path(path)
    return parse_engine(read_toml(path, "engine profile"), str(path))


def builtin_engines() -> dict[str, Path]:
    """Name -> path of the engine profiles shipped in ``hwprofiles/engines/``."""
    root = resources.files("moesim.hwprofiles").joinpath("engines")
    return {p.name[:-5]: Path(str(p)) for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".toml")}


@functools.lru_cache(maxsize=64)
def _builtin(name: str) -> EngineProfile:
    e = load_engine(builtin_engines()[name])
    return replace(e, runs_as=e.runs_as or name)


def _users(p: Path) -> EngineProfile:
    """A user's engine file: the built-in file itself (named by path) is the built-in; any other
    file is the user's, named so even where its ``name`` is a built-in's (a copy of llama.cpp's
    figures that says ``name = "vllm"`` is not vLLM), and it runs as what its ``runs_as`` says."""
    builtin = {q.resolve(): n for n, q in builtin_engines().items()}
    if p.resolve() in builtin:
        return _builtin(builtin[p.resolve()])
    e = load_engine(p)
    if e.name.lower() in builtin_engines():
        e = replace(e, name=f"{e.name} ({p.name}, a user's file)")
    return e


#: The engine a result uses when none is named: PyTorch eager, the reference executor's.
DEFAULT_ENGINE = "pytorch-eager"
#: Names of applications that run an engine moesim has a profile of: Ollama and LM Studio load
#: GGUF files through the llama.cpp build they bundle (their own build's date is not known here),
#: so they are priced as llama.cpp and print llama.cpp's arguments, and the answer says so.
ENGINE_ALIASES = {"ollama": "llama.cpp", "lm-studio": "llama.cpp", "lmstudio": "llama.cpp"}


def alias_note(engine: EngineProfile) -> str | None:
    """What an answer says of an engine named by :data:`ENGINE_ALIASES`, else None."""
    if engine.name not in ENGINE_ALIASES:
        return None
    base = ENGINE_ALIASES[engine.name]
    return (f"{engine.name} runs the {base} build it bundles: priced as {base} (its newest figures; give --engine "
            f"{base}@YYYY-MM-DD for the bundled build's date), and the arguments printed are {base}'s, which "
            f"{engine.name} sets through its own options (num_gpu: -ngl, num_thread: -t, num_ctx: -c)")


def get_engine(name_or_path: str | EngineProfile | None = None) -> EngineProfile:
    """A built-in engine by name (``llama.cpp``), a user's TOML by path, or the default;
    ``NAME@YYYY-MM-DD`` the engine as a build from that date ran (:meth:`EngineProfile.at`)."""
    if isinstance(name_or_path, EngineProfile):
        return name_or_path
    name = name_or_path or DEFAULT_ENGINE
    if "@" in name and not Path(name).exists():
        base, _, day = name.rpartition("@")
        if not base or "@" in base:
            raise MoesimError(f"engine {name!r}: NAME@YYYY-MM-DD (or llama.cpp@bNNNN), one engine and one build date "
                              "(e.g. llama.cpp@2026-02-05)")
        engine = get_engine(base)
        if not engine.before:
            raise MoesimError(f"engine {name!r}: {engine.name}'s profile holds no earlier builds ([[before]] entries), so "
                              f"every date prices it alike: give {base} without @")
        return engine.at(build_date(day, f"engine {name}", llama_builds=(engine.runs_as or engine.name) == "llama.cpp"))
    builtin = builtin_engines()
    if name.lower() in builtin:
        return _builtin(name.lower())
    if name.lower() in ENGINE_ALIASES:  # an application bundling an engine: that engine, named as the user named it
        base = _builtin(ENGINE_ALIASES[name.lower()])
        return replace(base, name=name.lower(), runs_as=base.runs_as or base.name,
                       description=f"{base.description}; as bundled by {name.lower()}")
    p = given_path(name, "engine profile")
    if p is not None:
        return _users(p)
    raise MoesimError(f"unknown engine {name!r}{nearest_hint(name, [*builtin, *ENGINE_ALIASES])}; built-in: "
                      f"{', '.join(builtin)}, and {', '.join(ENGINE_ALIASES)} as the engine they bundle (or a .toml path)")
