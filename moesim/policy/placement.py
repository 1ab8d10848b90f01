"""Where experts live when some of them are computed on the CPU: static placements and the
device/CPU split of every layer.

Three deployed designs, one registry policy each (``moesim.policy``):

- ``cpu-static`` (llama.cpp ``--n-cpu-moe N``): the experts of the first N MoE layers
  stay in host memory and run on the CPU; every other layer's experts are resident on
  the device. ``N = "auto"`` is the fewest layers that leave the rest fitting in device
  memory (what llama.cpp users tune by hand, issue #27501 asks to automate).
- ``hot-experts`` (KTransformers ``--kt-num-gpu-experts``): the most frequently routed
  (layer, expert) pairs, up to a device-memory budget, are resident; the rest run on the
  CPU. Frequencies come from a separate calibration trace; counting them on the trace
  being replayed is allowed only when asked and is marked an optimistic bound (the
  placement has seen the future).
- ``cpu-on-miss`` (Fiddler): a device expert cache (LRU/LFU); each miss runs on the CPU
  or is copied, whichever :func:`moesim.policy.cpu_or_copy` says ends first.

Data in, data out: no timing here. The simulator and the executor drive the same
:class:`HostPlanner`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.costmodel import CostModel, ExpertTimes
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, HostProfile
from moesim.memory import WORKSPACE_BYTES, expert_budget, kv_bytes  # noqa: F401 (re-exported for the executor)
from moesim.models import ModelSpec
from moesim.policy.families import Policy, get_policy
from moesim.policy.planner import ExpertCache


def routing_counts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """``[t, m, b, k]`` routed ids (-1 = none) -> ``[m, E]`` how often each expert was routed."""
    t, m, b, k = ids.shape
    counts = np.zeros((m, n_experts), np.int64)
    layer = np.broadcast_to(np.arange(m)[None, :, None, None], ids.shape)
    ok = ids >= 0
    np.add.at(counts, (layer[ok], ids[ok]), 1)
    return counts


def cpu_layers(spec: ModelSpec, n: int | str, device_memory: float, batch: int = 1, context: int = 0) -> int:
    """How many MoE layers (the first ones, as llama.cpp counts) keep their experts on the CPU.

    ``n`` is a count, or ``"auto"``: the fewest that let the other layers' experts fit.
    """
    m = spec.n_moe_layers
    if n == "auto":
        fit = expert_budget(spec, device_memory, batch, context) // spec.layer_expert_bytes
        return int(max(0, m - fit))
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= m:
        raise MoesimError(f"--cpu-layers must be 'auto' or a count from 0 to {m} (the MoE layers of {spec.name}), got {n!r}")
    return n


@dataclass(frozen=True)
class Placement:
    """Which (MoE layer, expert) pairs are resident on the device, and where that came from."""

    resident: np.ndarray  # [m, E] bool
    source: str  # how it was chosen, for reports
    optimistic: bool = False  # chosen from the replayed trace itself: an upper bound
    hottest: tuple[tuple[int, int], ...] = ()  # resident (layer, expert) keys, most routed first (hot sets)

    @property
    def n_resident(self) -> int:
        return int(self.resident.sum())


def static_layers(spec: ModelSpec, n_cpu: int) -> Placement:
    resident = np.ones((spec.n_moe_layers, spec.n_experts), bool)
    resident[:n_cpu] = False
    return Placement(resident, f"first {n_cpu} of {spec.n_moe_layers} MoE layers on the CPU")


def hot_set(counts: np.ndarray, spec: ModelSpec, budget_bytes: int, source: str, optimistic: bool) -> Placement:
    """The most frequently routed (layer, expert) pairs that fit ``budget_bytes``; ties go
    to the lower (layer, expert) index so the choice is deterministic."""
    m, e = spec.n_moe_layers, spec.n_experts
    if counts.shape != (m, e):
        raise MoesimError(f"calibration routing has {counts.shape[0]} MoE layers x {counts.shape[1]} experts; "
                          f"{spec.name} has {m} x {e}")
    n = min(m * e, budget_bytes // spec.expert_bytes)
    order = np.lexsort((np.arange(m * e), -counts.reshape(-1)))[:n]
    resident = np.zeros(m * e, bool)
    resident[order] = True
    what = f"{n} hottest experts ({n / (m * e):.0%}) by {source}"
    keys = tuple((int(i) // e, int(i) % e) for i in order)
    return Placement(resident.reshape(m, e), what + (" (optimistic: counted on the replayed trace)" if optimistic else ""),
                     optimistic, keys)


def hot_per_layer(counts: np.ndarray, spec: ModelSpec, per_layer: int, source: str, optimistic: bool) -> Placement:
    """The ``per_layer`` most routed experts of EVERY MoE layer (KTransformers'
    ``--kt-num-gpu-experts``: a count per layer, not one budget); ties to the lower index."""
    m, e = spec.n_moe_layers, spec.n_experts
    if counts.shape != (m, e):
        raise MoesimError(f"calibration routing has {counts.shape[0]} MoE layers x {counts.shape[1]} experts; "
                          f"{spec.name} has {m} x {e}")
    if isinstance(per_layer, bool) or not isinstance(per_layer, int) or not 0 <= per_layer <= e:
        raise MoesimError(f"--gpu-experts-per-layer {per_layer!r}: a count from 0 to {e} ({spec.name})")
    order = np.argsort(-counts, axis=1, kind="stable")[:, :per_layer]  # stable: ties to the lower index
    resident = np.zeros((m, e), bool)
    np.put_along_axis(resident, order, True, axis=1)
    hottest = sorted(((int(layer), int(x)) for layer, row in enumerate(order) for x in row),
                     key=lambda k: (-counts[k], k))
    what = f"{per_layer} hottest experts of each layer ({per_layer / e:.0%}) by {source}"
    return Placement(resident, what + (" (optimistic: counted on the replayed trace)" if optimistic else ""),
                     optimistic, tuple(hottest))


#: How a uniform placement says where it came from (KTransformers' default: moesim.engines.PLACEMENTS).
UNIFORM = "uniform placement: the lowest-numbered experts of every layer, blind to popularity (KTransformers' default)"


def uniform_set(spec: ModelSpec, budget_bytes: int) -> Placement:
    """The experts that fit ``budget_bytes``, taken round-robin over expert ordinals (expert 0
    of every MoE layer, then expert 1, ...): KTransformers' ``--kt-expert-placement-strategy
    uniform``, its default, which never looks at which experts are routed."""
    m, e = spec.n_moe_layers, spec.n_experts
    n = int(min(m * e, budget_bytes // spec.expert_bytes))
    order = [(layer, x) for x in range(e) for layer in range(m)][:n]
    resident = np.zeros((m, e), bool)
    for layer, x in order:
        resident[layer, x] = True
    return Placement(resident, f"{n} experts ({n / (m * e):.0%}) by {UNIFORM}", False, tuple(order))


def uniform_per_layer(spec: ModelSpec, per_layer: int) -> Placement:
    """Experts ``0 .. per_layer - 1`` of every MoE layer (:func:`uniform_set` at a count a layer)."""
    if isinstance(per_layer, bool) or not isinstance(per_layer, int) or not 0 <= per_layer <= spec.n_experts:
        raise MoesimError(f"--gpu-experts-per-layer {per_layer!r}: a count from 0 to {spec.n_experts} ({spec.name})")
    return uniform_set(spec, per_layer * spec.n_moe_layers * spec.expert_bytes)


def make_placement(policy: str | Policy, spec: ModelSpec, device_memory: float, *, batch: int = 1, context: int = 0,
                   cpu_layers_n: int | str = "auto", calibration: np.ndarray | None = None,
                   replay_ids: np.ndarray | None = None, calibrate_on_replay: bool = False,
                   strategy: str = "frequency") -> Placement | None:
    """The static placement a CPU-compute policy starts from (None for other policies).

    ``calibration`` is ``[t, m, b, k]`` routing recorded separately (``--placement-from``);
    ``calibrate_on_replay`` counts ``replay_ids`` instead, marked optimistic. cpu-on-miss
    uses the hot set, when a calibration is given, to warm its cache. Without either,
    hot-experts under an engine whose ``strategy`` (``EngineProfile.expert_placement``) is
    ``uniform`` takes :func:`uniform_set`, as that engine does.
    """
    pol = get_policy(policy)
    if not pol.cpu:
        return None
    if pol.cpu == "layers":
        return static_layers(spec, cpu_layers(spec, cpu_layers_n, device_memory, batch, context))
    if calibration is not None and calibrate_on_replay:
        raise MoesimError("give a calibration trace or ask to calibrate on the replayed trace, not both")
    if calibration is not None:
        ids, source, optimistic = calibration, "a calibration trace", False
    elif calibrate_on_replay and replay_ids is not None:
        ids, source, optimistic = replay_ids, "the replayed trace", True
    elif pol.cpu == "miss":
        return None  # a cold cache
    elif strategy == "uniform":
        return uniform_set(spec, expert_budget(spec, device_memory, batch, context))
    else:
        raise MoesimError(f"{pol.name} needs expert frequencies: a calibration trace (--placement-from), or "
                          "counting on the replayed trace itself (an optimistic bound) when asked")
    return hot_set(routing_counts(ids, spec.n_experts), spec, expert_budget(spec, device_memory, batch, context),
                   source, optimistic)


class HostPlanner:
    """Per-layer split of the routed experts into those the device runs and the misses.

    Static policies (``layers``, ``hot``) hold a fixed resident set and every miss runs on
    the CPU. ``miss`` holds an :class:`~moesim.policy.ExpertCache` of ``cache_experts``
    (warmed with the placement's hottest experts when one is given); misses the caller
    chose to copy enter it after the layer ran.
    """

    def __init__(self, policy: str | Policy, spec: ModelSpec, placement: Placement | None = None,
                 cache_experts: int = 0, eviction: str = "lru") -> None:
        self.policy = get_policy(policy)
        if not self.policy.cpu:
            raise MoesimError(f"policy {self.policy.name!r} computes no experts on the CPU")
        self.cache: ExpertCache | None = None
        self.resident = placement.resident if placement is not None else np.zeros((spec.n_moe_layers, spec.n_experts), bool)
        if self.policy.cpu == "miss":
            if cache_experts <= 0:
                raise MoesimError("cpu-on-miss needs a device expert cache (--cache-gib or --cache-experts > 0)")
            self.cache = ExpertCache(cache_experts, eviction)
            if placement is not None:  # warm: the hottest that fit, used coldest first (LRU/LFU order)
                keys = placement.hottest or tuple(tuple(map(int, k)) for k in np.argwhere(placement.resident))
                for key in reversed(keys[:cache_experts]):
                    self.cache.use(key)
        elif placement is None:
            raise MoesimError(f"{self.policy.name} needs a placement")

    @property
    def copies(self) -> bool:
        """Whether a miss may be copied (only cpu-on-miss ever moves experts)."""
        return self.cache is not None

    def split(self, layer: int, experts: list[int]) -> tuple[list[int], list[int]]:
        """(experts the device holds, misses), each in the given order."""
        if self.cache is not None:
            held = [(layer, e) in self.cache for e in experts]
        else:
            row = self.resident[layer]
            held = [bool(row[e]) for e in experts]
        return [e for e, h in zip(experts, held) if h], [e for e, h in zip(experts, held) if not h]

    def finish(self, layer: int, hits: list[int], copied: list[int]) -> None:
        """After the layer ran: the cache records its hits and admits the copied misses."""
        if self.cache is None:
            return
        for e in hits:
            self.cache.use((layer, e))
        in_use = {(layer, e) for e in hits + copied}
        self.cache.evict_for(len(copied), in_use)
        room = self.cache.capacity - len(self.cache)
        for e in copied[:max(room, 0)]:
            self.cache.use((layer, e))


def expert_times(spec: ModelSpec, hw: HardwareProfile, host: HostProfile, batch: int = 1,
                 amx: bool = True) -> ExpertTimes:
    """The cost model's figures of one expert on the device and on the CPU and one copy over
    ``hw``'s link (:meth:`moesim.costmodel.CostModel.expert_times`): what the simulator
    times the CPU policies with and what the executor and the simulator decide cpu-on-miss
    with (one definition for both)."""
    return CostModel(spec, hw, host, amx=amx).expert_times(batch)
