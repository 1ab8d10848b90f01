"""Policy families as classes: each owns what it decides, and a registry names them.

A family is a frozen dataclass. What sets it apart from the others is not a flag the rest
of the code tests but a method it answers: whether it copies experts to one GPU (the
planner's path), serves decode from the host, keeps a cache, pays for a predictor, which
axes a what-if sweeps for it, which command-line knobs it reads, how many device slots
it needs, where it stands in the deployment answer, and, for the static layouts, the
layout itself (:meth:`Policy.layout`). The simulator and the executor ask these
questions; a new family answers them in one class and joins with one :func:`register`
line (``tests/test_policy_families.py`` adds one).

The families (docs/policies.md):

- :class:`Resident`: every expert on the device (all-resident).
- :class:`CopyExperts`: experts copied to the device on demand, ahead (prefetch), or
  speculatively executed; the oracle is its bound (on-demand, prefetch-fom, prefetch-spec,
  oracle).
- :class:`CpuLayers`: whole MoE layers' experts on the CPU (cpu-static, llama.cpp --n-cpu-moe).
- :class:`HotExperts`: the hottest experts on the GPU, the rest on the CPU (KTransformers).
- :class:`CpuOnMiss`: a device cache; a miss runs on the CPU or is copied (Fiddler).
- :class:`GpuLayers`: the last N layers wholly on the GPU(s), the rest on the CPU (llama.cpp -ngl).
- :class:`WeightStreaming`: every layer on the GPU(s), the first layers' weights read over
  the link at every step (vLLM --cpu-offload-gb).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar

from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.layout import Layout, first_layers_gib, stream_layers
from moesim.models import ModelSpec, cache_capacity, model_named
from moesim.quant_recipes import store_as

EVICTIONS = ("lru", "lfu")

#: The command-line knobs a family may read (each family names its own in ``knobs``); a knob
#: given to a run none of whose families reads it is noted as having changed nothing.
HOST_KNOBS = frozenset({"--host", "--no-amx", "--threads", "--link-gbps"})
CACHE_KNOBS = frozenset({"--cache-gib", "--eviction", "--cache-per-layer"})


def resolved_count(value: Any, kind: type = int) -> Any:
    """A result row's resolved count: ``12`` or ``"auto (12)"`` (None: neither)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return kind(value)
    if isinstance(value, str) and value.startswith("auto (") and value.endswith(")"):
        return kind(value[6:-1])
    return None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _expert_bytes(row: dict[str, Any]) -> float:
    """Bytes of one expert in the row's format (hot-experts' budget in GiB, for the table)."""
    try:
        return store_as(model_named(row["base_model"]), row["expert_dtype"]).expert_bytes
    except MoesimError:
        return float("nan")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """One offloading policy of some family: its name, what it does in a line, other names.

    Keyword-only, so a row reads as what it means (``prefetch=True``) rather than as the
    third of five booleans. The class-level facts and methods below are the family's; a
    subclass answers them for its policies.
    """

    name: str
    summary: str
    aliases: tuple[str, ...] = ()  # other names get_policy accepts

    #: Experts live in host memory (False: all resident on the device).
    offload: ClassVar[bool] = True
    #: Where the experts not on the device run, as moesim.policy.placement and moesim.layout name it:
    #: "" = copied to the device; "layers", "hot", "miss", "whole", "stream" (each family's docstring).
    cpu: ClassVar[str] = ""
    #: The deployment answer's order, from the least to the most that moves at run time: on a
    #: tie the simpler deployment is named (a cpu-static run with 0 layers on the CPU *is* all-resident).
    rank: ClassVar[int] = 6
    #: The command-line options (beyond model, machine and engine) whose values this family reads.
    knobs: ClassVar[frozenset[str]] = frozenset()
    prefetch: ClassVar[bool] = False  # copies a predicted set ahead (CopyExperts' field)
    executes_predicted: ClassVar[bool] = False  # runs the predicted experts (speculative execution)
    oracle: ClassVar[bool] = False  # the prediction is the truth (an upper bound)
    #: Whether moesim's reference executor runs it (the whole-layer layouts are simulated only).
    executed: ClassVar[bool] = True
    #: Whether it cannot run without a device expert cache (cpu-on-miss).
    needs_cache: ClassVar[bool] = False

    @property
    def exact(self) -> bool:
        """Whether outputs equal the all-resident model's."""
        return True

    @property
    def family(self) -> str:
        """The deployment family it belongs to (the deployment answer's rows): its own name
        unless several policies share one."""
        return self.name

    #: The class of published deployments whose residuals price its range (the published
    #: suite's kinds, moesim.sim.published.KINDS), where the prediction does not say better
    #: (moesim.sim.intervals.kind_of: several GPUs, none, no CPU time and no copy).
    range_kind: ClassVar[str] = "copy offload"

    def row_knobs(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The layout knobs a result row of this family was laid out with, as
        :class:`moesim.setting.Setting` takes them (``resident_experts``: a hot set of that many
        experts), so that an engine's arguments spell the deployment timed; None for a family
        that places no static layout (a copy family's cache is no engine argument)."""
        return None

    def row_words(self, row: dict[str, Any]) -> str:
        """A result row's knobs of this family, in words (short: they go in a table)."""
        what = f"{row['policy']}, cache {number(row['cache_gib'])} GiB"
        if row["copy_queue"] not in ("fifo", "-"):
            what += f", {row['copy_queue']}"
        if row["prefetch_top"] != "-":
            what += f", top {row['prefetch_top']}"
        return what

    @property
    def copies_experts(self) -> bool:
        """Whether it copies experts to one GPU as tokens route them (the planner's path:
        :class:`moesim.policy.Planner`, the copy engine and its queue)."""
        return False

    @property
    def uses_host(self) -> bool:
        """Whether the host serves decode beside the GPU: its cores run experts or layers, or
        its memory holds weights the GPU reads (the families of :class:`WithHost`; a host's
        cores, threads, AMX and RAM matter). Never the planner's path."""
        return False

    @property
    def caches(self) -> bool:
        """Whether it keeps a cross-token expert cache on the device (what a cache size, an
        eviction or a per-layer split changes)."""
        return False

    @property
    def predicts(self) -> bool:
        """Whether it runs a predictor at decode time (and pays for it)."""
        return False

    @property
    def prefetches(self) -> bool:
        """Whether it copies a predicted set ahead of its layer (how far: ``--lookahead``)."""
        return False

    @property
    def places_hot_set(self) -> bool:
        """Whether it places experts by routing frequency (a calibration trace says which)."""
        return False

    @property
    def needs_gpu(self) -> bool:
        """Whether it needs a GPU (without one only all-resident runs: every layer on the CPU)."""
        return True

    @property
    def places_experts(self) -> bool:
        """Whether its layout places single experts on the device or the CPU (cpu-static,
        hot-experts, cpu-on-miss: :class:`moesim.policy.placement.HostPlanner` plays it step by step)
        rather than whole layers or nothing."""
        return False

    def cache_capacity(self, spec: ModelSpec, cache_gib: float = 0.0, cache_experts: int = 0) -> int:
        """Experts its cross-token device cache holds given ``--cache-gib`` or a count (0 for
        a family that keeps none; :func:`moesim.models.cache_capacity` for one that does)."""
        return cache_capacity(spec, cache_gib, cache_experts) if self.caches else 0

    def held_experts(self, placement: Any) -> int:
        """Experts its placement keeps on the device for good (0 without one)."""
        return placement.n_resident if placement is not None else 0

    @property
    def is_bound(self) -> bool:
        """Whether it is a bound no one can run (the oracle): never the answer."""
        return self.family == "oracle (bound)"

    def cannot_run_on(self, n_gpus: int) -> str | None:
        """Why it cannot run on a machine of ``n_gpus`` GPUs, or None (it can)."""
        if n_gpus == 0 and self.needs_gpu:
            return "without a GPU only all-resident applies (every weight in host memory, computed on the CPU)"
        return None

    def answer_columns(self, result: Any, asked: Any) -> dict[str, Any]:
        """A what-if row's columns for its own knobs as the layout resolved them (``result``:
        the simulation's; ``asked``: the group's values, ``auto`` or a number)."""
        return {}

    def device_experts(self, spec: ModelSpec, cache_experts: int = 0, resident_experts: int = 0,
                       lookahead: int = 1) -> int:
        """Routed experts it keeps on each GPU's memory: its slots and cache, plus a placement's
        or a pinned hot set's ``resident_experts``."""
        return expert_slots(spec, self, cache_experts, lookahead) + resident_experts

    @property
    def records_predictions(self) -> bool:
        """Whether the executor runs a predictor under it: a copy policy other than the oracle,
        on-demand too (its trace records predictions so it can stand in for the prefetching ones)."""
        return False

    @property
    def verifies_drafts(self) -> bool:
        """Whether speculative decoding can verify drafts under it: exact, runnable, on the copy
        engine (all-resident, on-demand, prefetch-fom)."""
        return self.exact and not self.is_bound and not self.uses_host

    def predictor(self, asked: str) -> str:
        """The predictor it runs when ``asked`` is asked for (the oracle reads the truth; the
        CPU-compute families predict nothing, docs/policies.md)."""
        return asked

    def static_on(self, n_gpus: int) -> bool:
        """Whether, on a machine of ``n_gpus`` GPUs, it is a static layout (nothing moves at
        run time: :mod:`moesim.sim.static` times it)."""
        return False

    def expert_slots(self, spec: ModelSpec, cache_experts: int = 0, lookahead: int = 1) -> int:
        """Device buffers, in experts, it needs for routed experts beyond the resident model
        (:func:`moesim.policy.expert_slots` says what is counted)."""
        return 0

    def sweep_axes(self, axes: Any) -> list[dict[str, Any]]:
        """The configurations a what-if sweeps for it, as keyword arguments of the sweep's
        group (``axes``: the sweep's values of cache, host, layout and copy-queue knobs)."""
        return [{"cache_gib": c} for c in axes.cache_gib]

    def layout(self, spec: ModelSpec, machine: Any, make, fits, knobs: Any, hot_placement=None) -> Layout:
        """The static layout on ``machine`` (``make(**kw)`` builds one, ``fits(layout)`` says
        whether it fits; ``knobs``: the setting's layout knobs)."""
        raise MoesimError(f"{self.name} is not a static layout (it copies experts): one GPU, moesim.sim.simulate")


@dataclass(frozen=True, kw_only=True)
class Resident(Policy):
    """Every expert on the device; no copies (the reference without offloading)."""

    range_kind = "all-GPU"

    def row_knobs(self, row):
        return {}

    def row_words(self, row):
        return "every layer on the CPU" if row["hw"] == "none" else "all experts on GPU"

    offload: ClassVar[bool] = False
    rank: ClassVar[int] = 0

    @property
    def needs_gpu(self) -> bool:
        return False

    def device_experts(self, spec, cache_experts=0, resident_experts=0, lookahead=1):
        return spec.n_moe_layers * spec.n_experts

    def static_on(self, n_gpus: int) -> bool:
        return n_gpus != 1  # one GPU: the copy path's timing with nothing to copy

    def sweep_axes(self, axes: Any) -> list[dict[str, Any]]:
        # The host matters only on a machine whose layout uses the CPU.
        return [{"cache_gib": 0.0, "host": h} for h in (axes.hosts if axes.several_or_none else (None,))]

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        return replace(make(), source=f"every layer on {machine.name}")


@dataclass(frozen=True, kw_only=True)
class CopyExperts(Policy):
    """Experts copied to one GPU: on demand after each router, ahead of their layer from a
    prediction (``prefetch``), run as predicted (``executes_predicted``: speculative
    execution, outputs may change), or with the truth as prediction (``oracle``: the bound)."""

    prefetch: bool = False
    executes_predicted: bool = False
    oracle: bool = False

    def __post_init__(self) -> None:
        if self.executes_predicted and not self.prefetch:
            raise MoesimError(f"policy {self.name!r}: speculative execution runs the prefetched set; needs prefetch")

    @property
    def knobs(self) -> frozenset[str]:  # type: ignore[override]  # what it reads depends on whether it prefetches
        copying = CACHE_KNOBS | {"--copy-queue", "--link-gbps"}
        return copying | {"--prefetch-top", "--lookahead", "--predictor"} if self.prefetch else copying

    @property
    def exact(self) -> bool:
        return not self.executes_predicted

    @property
    def family(self) -> str:
        return "oracle (bound)" if self.oracle else "prefetching"

    @property
    def copies_experts(self) -> bool:
        return True

    @property
    def caches(self) -> bool:
        return True

    @property
    def predicts(self) -> bool:
        return self.prefetch and not self.oracle

    @property
    def prefetches(self) -> bool:
        return self.prefetch

    @property
    def records_predictions(self) -> bool:
        return not self.oracle

    def predictor(self, asked):
        return "oracle" if self.oracle else asked

    def cannot_run_on(self, n_gpus):
        return super().cannot_run_on(n_gpus) or (f"{self.name} runs on one GPU" if n_gpus != 1 else None)

    def expert_slots(self, spec, cache_experts=0, lookahead=1):
        ahead = check_lookahead(lookahead) if self.prefetch else 1
        return (1 + ahead) * spec.n_experts + cache_experts

    def sweep_axes(self, axes):
        if not self.predicts:
            return super().sweep_axes(axes)
        return [{"cache_gib": c, "copy_queue": q, "prefetch_top": m} for c in axes.cache_gib
                for q in axes.copy_queues for m in axes.prefetch_top]


@dataclass(frozen=True, kw_only=True)
class WithHost(Policy):
    """A family whose decode the host serves beside the GPU: some experts or layers run on
    the CPU, or weights stay in host memory; none copies ahead (docs/policies.md says why).
    By default a static layout swept over the hosts; a subclass gives its :meth:`layout`."""

    knobs: ClassVar[frozenset[str]] = HOST_KNOBS

    def sweep_axes(self, axes):
        return [{"cache_gib": 0.0, "host": h} for h in axes.hosts]

    def predictor(self, asked):
        return "none"

    @property
    def uses_host(self) -> bool:
        return True

    def device_experts(self, spec, cache_experts=0, resident_experts=0, lookahead=1):
        return resident_experts  # a static placement's resident set; nothing copied

    def static_on(self, n_gpus: int) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class CpuLayers(WithHost):
    """The experts of N MoE layers in host memory, run on the CPU; the rest resident."""

    range_kind = "experts on the CPU"

    def row_knobs(self, row):
        return {"cpu_layers": resolved_count(row["cpu_layers"])}

    def row_words(self, row):
        return f"{row['cpu_layers']} MoE layers on CPU"

    cpu: ClassVar[str] = "layers"
    rank: ClassVar[int] = 3
    knobs: ClassVar[frozenset[str]] = HOST_KNOBS | {"--cpu-layers"}

    @property
    def places_experts(self) -> bool:
        return True

    def sweep_axes(self, axes):
        return [{"cache_gib": 0.0, "host": h, "cpu_layers": n} for h in axes.hosts for n in axes.cpu_layers]

    def answer_columns(self, result, asked):
        n = result.config["cpu_layers"] if "cpu_layers" in result.config else int(
            (~result.placement.resident).all(1).sum())
        return {"cpu_layers": n if asked.cpu_layers != "auto" else f"auto ({n})"}  # the count "auto" resolved to

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        m = spec.n_moe_layers
        n = knobs.cpu_layers
        if n == "auto":
            n = next((n for n in range(m + 1) if fits(make(cpu_moe_layers=n))), m)
        return replace(make(cpu_moe_layers=n), source=f"first {n} of {m} MoE layers' experts on the CPU")


@dataclass(frozen=True, kw_only=True)
class HotExperts(WithHost):
    """The most frequently routed experts, up to a device budget, resident; the rest on the CPU."""

    range_kind = "experts on the CPU"

    def row_knobs(self, row):
        return {"resident_experts": resolved_count(row["resident_experts"])}

    def row_words(self, row):
        n = row["resident_experts"]
        gib = n * _expert_bytes(row) / 2**30 if _finite(n) else None
        kind = "uniformly placed" if "uniform placement" in str(row.get("placement", "")) else "hot"
        return f"{n} {kind} experts on GPU" + (f" ({number(gib)} GiB)" if _finite(gib) else "")

    cpu: ClassVar[str] = "hot"
    rank: ClassVar[int] = 4
    # --gpu-experts: the executor's count of resident experts (KTransformers' --kt-num-gpu-experts).
    knobs: ClassVar[frozenset[str]] = HOST_KNOBS | {"--gpu-expert-gib", "--gpu-experts", "--placement-from",
                                                    "--calibrate-on-replay"}

    @property
    def places_experts(self) -> bool:
        return True

    @property
    def places_hot_set(self) -> bool:
        return True

    def cannot_run_on(self, n_gpus):
        return super().cannot_run_on(n_gpus) or ("hot-experts places experts on one GPU (cpu-static places them on "
                                                 "several)" if n_gpus != 1 else None)

    def sweep_axes(self, axes):
        return [{"cache_gib": 0.0, "host": h, "gpu_expert_gib": g} for h in axes.hosts for g in axes.gpu_expert_gib]

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        if machine.n_gpus != 1:
            raise MoesimError("hot-experts places experts on one GPU; give one GPU profile (or use cpu-static on several)")
        return make(hot=hot_placement.resident, source=hot_placement.source, optimistic=hot_placement.optimistic)


@dataclass(frozen=True, kw_only=True)
class CpuOnMiss(WithHost):
    """A device expert cache; a miss runs on the CPU or is copied, whichever ends first."""

    range_kind = "experts on the CPU"

    def row_words(self, row):
        return f"cache {number(row['cache_gib'])} GiB"

    cpu: ClassVar[str] = "miss"
    rank: ClassVar[int] = 5
    needs_cache: ClassVar[bool] = True
    knobs: ClassVar[frozenset[str]] = HOST_KNOBS | CACHE_KNOBS | {"--placement-from", "--calibrate-on-replay"}

    @property
    def places_experts(self) -> bool:
        return True

    @property
    def caches(self) -> bool:
        return True

    def held_experts(self, placement):
        return 0  # its placement only warms its cache (counted in the cache)

    def device_experts(self, spec, cache_experts=0, resident_experts=0, lookahead=1):
        return Policy.device_experts(self, spec, cache_experts, resident_experts, lookahead)  # slots and cache

    def static_on(self, n_gpus: int) -> bool:
        return False

    def expert_slots(self, spec, cache_experts=0, lookahead=1):
        return spec.n_experts + cache_experts  # misses it copies land in the cache's buffers, plus one layer to stage

    def cannot_run_on(self, n_gpus):
        return super().cannot_run_on(n_gpus) or (f"{self.name} runs on one GPU" if n_gpus != 1 else None)

    def sweep_axes(self, axes):
        return [{"cache_gib": c, "host": h} for h in axes.hosts for c in axes.cache_gib if c > 0]


@dataclass(frozen=True, kw_only=True)
class GpuLayers(WithHost):
    """The last N model layers wholly on the GPU(s), the rest (attention and experts) on the CPU."""

    range_kind = "layer split"

    def row_knobs(self, row):
        return {"gpu_layers": resolved_count(row["gpu_layers"])}

    def row_words(self, row):
        return f"{row['gpu_layers']} layers on GPU, the rest on CPU"

    cpu: ClassVar[str] = "whole"
    rank: ClassVar[int] = 1
    executed: ClassVar[bool] = False
    knobs: ClassVar[frozenset[str]] = HOST_KNOBS | {"--gpu-layers"}

    def sweep_axes(self, axes):
        return [{"cache_gib": 0.0, "host": h, "gpu_layers": n} for h in axes.hosts for n in axes.gpu_layers]

    def answer_columns(self, result, asked):
        n = result.config["gpu_layers"]
        return {"gpu_layers": n if asked.gpu_layers != "auto" else f"auto ({n})"}

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        L = spec.n_layers
        n = knobs.gpu_layers
        if n == "auto":
            n = next((n for n in range(L, -1, -1) if fits(make(gpu_layers=n))), 0)
        return replace(make(gpu_layers=n), source=f"last {n} of {L} layers on {machine.name}, the rest on the CPU")


@dataclass(frozen=True, kw_only=True)
class WeightStreaming(WithHost):
    """Every layer on the GPU(s); the first layers' weights stay in host memory and are read
    over the link at every step (nothing runs on the CPU)."""

    range_kind = "copy offload"

    def row_knobs(self, row):
        return {"offload_gib": resolved_count(row["offload_gib"], float)}

    def row_words(self, row):
        gib = resolved_count(row["offload_gib"], float)
        shown = row["offload_gib"] if gib is None else f"{gib:.1f}"
        if isinstance(row["offload_gib"], str) and row["offload_gib"].startswith("auto"):
            shown = f"auto ({shown})"
        return f"{shown} GiB of weights read over the link"

    cpu: ClassVar[str] = "stream"
    rank: ClassVar[int] = 2
    executed: ClassVar[bool] = False
    knobs: ClassVar[frozenset[str]] = HOST_KNOBS | {"--offload-gib"}

    def sweep_axes(self, axes):
        return [{"cache_gib": 0.0, "host": h, "offload_gib": g} for h in axes.hosts for g in axes.offload_gib]

    def answer_columns(self, result, asked):
        gib = math.floor(result.config["offload_gib"] * 1e4) / 1e4  # rounded down: streams the same layers again
        want = asked.offload_gib
        return {"offload_gib": f"auto ({gib:g})" if want == "auto" else want if gib >= want
                else f"{want:g} (capped: {gib:g}, every layer)"}

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        lay = replace(make(), source=f"every layer on {machine.name}")
        if knobs.offload_gib != "auto":
            return stream_layers(spec, lay, knobs.offload_gib)
        n = next((n for n in range(spec.n_layers + 1) if fits(stream_layers(spec, lay, first_layers_gib(spec, n)))),
                 spec.n_layers)
        return stream_layers(spec, lay, first_layers_gib(spec, n))


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, Policy] = {}
_ALIASES: dict[str, str] = {}
#: Read-only views of the registry: name -> policy, alias -> name.
POLICIES: Mapping[str, Policy] = MappingProxyType(_REGISTRY)
ALIASES: Mapping[str, str] = MappingProxyType(_ALIASES)


def register(policy: Policy) -> Policy:
    """Add ``policy`` (and its aliases) to the registry; names are lower-case and unique."""
    if not isinstance(policy, Policy) or type(policy) is Policy:  # the base class answers no question its own way
        raise MoesimError(f"register() takes a policy of some family (a subclass of Policy), got "
                          f"{type(policy).__name__}")
    for n in (policy.name, *policy.aliases):
        if n != n.strip().lower() or not n:
            raise MoesimError(f"policy name {n!r} must be non-empty lower-case without spaces around it")
        if n in _REGISTRY or n in _ALIASES:
            raise MoesimError(f"policy name {n!r} is already registered")
    _REGISTRY[policy.name] = policy
    _ALIASES.update({a: policy.name for a in policy.aliases})
    return policy


register(Resident(name="all-resident", aliases=("resident",),
                  summary="every expert on the device; no copies (the reference without offloading)"))
register(CopyExperts(name="on-demand", aliases=("ondemand",),
                     summary="after each router, copy the missing top-k experts and wait for them"))
register(CopyExperts(name="prefetch-spec", prefetch=True, executes_predicted=True,
                     summary="copy the predicted next-layer experts ahead and execute them (speculative "
                             "execution: no miss penalty, outputs may change)"))
register(CopyExperts(name="prefetch-fom", prefetch=True, aliases=("prefetch",),
                     summary="copy the predicted experts ahead; copy the mispredicted ones on demand "
                             "(fetch-on-miss: exact outputs)"))
register(CpuLayers(name="cpu-static", aliases=("n-cpu-moe",),
                   summary="the experts of N MoE layers stay in host memory and run on the CPU, the rest are "
                           "resident on the device (llama.cpp --n-cpu-moe N; N given or the fewest that fit)"))
register(HotExperts(name="hot-experts", aliases=("ktransformers",),
                    summary="the most frequently routed experts, up to a device memory budget, are resident; the "
                            "rest run on the CPU (KTransformers; frequencies from a calibration trace)"))
register(CpuOnMiss(name="cpu-on-miss", aliases=("fiddler",),
                   summary="a device expert cache; a miss runs on the CPU or is copied, whichever the cost model "
                           "says finishes first given the link's queue (Fiddler)"))
register(GpuLayers(name="gpu-layers", aliases=("ngl",),
                   summary="the last N model layers wholly on the GPU(s), the rest (attention and experts) on the "
                           "CPU (llama.cpp -ngl N, Ollama; N given or the most that fit)"))
register(WeightStreaming(name="weight-streaming", aliases=("cpu-offload-gb",),
                         summary="every layer runs on the GPU(s); the first layers' weights, N GB, stay in host memory "
                                 "and are read over the link at every step (vLLM --cpu-offload-gb N; N given or the "
                                 "least that fits)"))
register(CopyExperts(name="oracle", prefetch=True, oracle=True,
                     summary="prefetch the true next-layer experts (a perfect predictor: the upper bound of "
                             "prefetching)"))


def get_policy(name: str | Policy) -> Policy:
    """A registered policy by name or alias (case-insensitive); a Policy passes through."""
    if isinstance(name, Policy):
        return name
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        aliases = ", ".join(f"{a} = {n}" for a, n in _ALIASES.items())
        raise MoesimError(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)} (aliases: {aliases})")
    return _REGISTRY[key]


def of_row(row: dict[str, Any]) -> Policy:
    """The registered policy a result row ran (its ``policy`` is a registered name already:
    looked up, not resolved as a user's spelling is by :func:`get_policy`, which any other
    name goes through: one line for a name no policy has)."""
    return _REGISTRY.get(row["policy"]) or get_policy(row["policy"])


def family_range_kind(family: str) -> str:
    """The range class of a deployment family by name (a result row's ``family``):
    :attr:`Policy.range_kind` of the registered policies of that family; "other" for none."""
    return next((p.range_kind for p in _REGISTRY.values() if p.family == family), "other")


def engine_policies(engine) -> tuple[str, ...]:
    """The registered names of the policies an engine profile lists (its aliases resolved), or
    one line naming the profile and the name it gives that no policy has; ``()``: every one.
    Here, where the registry and the engine are both known (moesim.engines keeps names as
    strings, so that the engine layer never imports the policies)."""
    try:
        return tuple(dict.fromkeys(get_policy(p).name for p in engine.policies))
    except MoesimError as e:
        raise MoesimError(f"engine {engine.name}: its policies: {e}") from None


def runs_on(engine, policies: list[str]) -> tuple[list[str], str | None]:
    """(those of ``policies`` (registered names) that ``engine`` runs, a note naming the others,
    or None); one line when it runs none of them. What ``replay`` and ``whatif`` both do."""
    runs = engine_policies(engine)
    kept = [p for p in policies if not runs or p in runs]
    dropped = [p for p in policies if p not in kept]
    if dropped and not kept:
        raise MoesimError(f"{engine.name} runs none of {', '.join(dropped)}; it runs {', '.join(runs)}")
    return kept, (f"{engine.name} does not run {', '.join(dropped)} (it runs {', '.join(runs)}): left out"
                  if dropped else None)


def default_policies(engine, defaults) -> list[str]:
    """The policies to compare when none is chosen: those of ``defaults`` ``engine`` runs, else
    every one it runs."""
    runs = engine_policies(engine)
    return [p for p in defaults if not runs or p in runs] or list(runs)


def as_policy(policy: str | Policy) -> Policy:
    """``policy`` itself when it is one (resolved once, above), else :func:`get_policy` of its name."""
    return policy if isinstance(policy, Policy) else get_policy(policy)


def check_eviction(name: str) -> None:
    """One line for an eviction policy no cache knows (every command that takes ``--eviction``)."""
    if name not in EVICTIONS:
        raise MoesimError(f"--eviction: unknown eviction policy {name!r}; known: {', '.join(EVICTIONS)}")


def check_lookahead(lookahead: int, n_moe_layers: int | None = None) -> int:
    """``lookahead`` if it is a whole number >= 1 that leaves some MoE layer to prefetch
    (below ``n_moe_layers`` when given), else a one-line error."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise MoesimError(f"lookahead must be a whole number of MoE layers >= 1, got {lookahead!r}")
    if n_moe_layers is not None and lookahead >= n_moe_layers:
        raise MoesimError(f"lookahead {lookahead} leaves nothing to prefetch: the model has {n_moe_layers} MoE layers")
    return lookahead


def expert_slots(spec: ModelSpec, policy: str | Policy, cache_experts: int = 0, lookahead: int = 1) -> int:
    """Device buffers, in experts, that a policy needs for routed experts beyond the resident model.

    The one count both the executor's slot pool and the memory-fit test use. An
    offloading policy holds ``1 + lookahead`` whole layers of experts plus the cross-token
    cache: prefill routes (nearly) every expert of a layer and copies layer l+1 while layer
    l computes (double-buffered, as the cost model's prefill has it), so the peak is
    ``2 * n_experts``; decode holds the current layer's experts (at most ``n_experts``
    distinct ones, prefetched plus missed) and the prefetches in flight, one layer each for
    the ``lookahead`` layers ahead (at most ``n_experts`` each). ``2 * min(E, batch * k)``
    would undercount prefill and prefetch-on-miss. All-resident keeps every expert on the
    device (counted with the model, not here), so it needs no slots and no cache. The
    static CPU-compute policies copy nothing (their resident experts are the placement's);
    cpu-on-miss stages at most one layer's misses.
    """
    if cache_experts < 0:
        raise MoesimError(f"cache capacity must be >= 0 experts, got {cache_experts}")
    return as_policy(policy).expert_slots(spec, cache_experts, lookahead)


#: What a what-if compares when no --policy is given (those its engine runs); defined here,
#: not in moesim.sim.whatif, so that the CLI names them in its help without importing the simulator.
WHATIF_POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle", "all-resident", "cpu-static", "gpu-layers",
                   "hot-experts", "cpu-on-miss", "weight-streaming")

__all__ = ["ALIASES", "EVICTIONS", "POLICIES", "WHATIF_POLICIES", "CopyExperts", "CpuLayers", "CpuOnMiss", "GpuLayers",
           "HotExperts", "Policy", "Resident", "WeightStreaming", "as_policy", "check_eviction", "check_lookahead",
           "expert_slots", "get_policy", "register"]
