"""Replay a trace under a policy on a hardware profile: the simulator's front door."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moesim.costmodel import CostModel, CostModels
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, Machine, get_machine
from moesim.memory import device_bytes
from moesim.models import ModelSpec, cache_capacity  # noqa: F401 (cache_capacity: defined with the byte accounting)
from moesim.policy import EVICTIONS, QUEUES, Policy, as_policy, get_policy
from moesim.policy.placement import expert_budget, hot_set, routing_counts
from moesim.setting import DEFAULT_SETTING, Setting
from moesim.sim.costs import Costs, charge_prediction, measured_costs, roofline_costs
from moesim.sim.cpu_compute import CpuResult, simulate_cpu_compute
from moesim.sim.engine import Span, run_simpy, run_simpy_queued
from moesim.sim.fastpath import run_fast_many
from moesim.sim.plan import Plan, build_plan
from moesim.sim.prefill import prefill_time
from moesim.sim.static import simulate_static
from moesim.sim.stats_kernels import recall_counts
from moesim.sim.workload import Link, Workload, make_workload
from moesim.traces.format import Trace

SIMS = ("simpy", "fast")  # the simulator: the SimPy reference or the compiled fast path
TIMINGS = ("auto", "profile", "measured")


def pick_costs(trace: Trace, cm: CostModel, timing: str) -> Costs:
    """Compute times from the trace's measurements or from the cost model ``cm``.

    ``auto`` uses the measurements when the trace has them and was recorded on ``cm``'s
    GPU (measured times belong to the machine that measured them), else the roofline.
    """
    if timing not in TIMINGS:
        raise MoesimError(f"unknown timing source {timing!r}; known: {', '.join(TIMINGS)}")
    meta = trace.meta
    if timing == "measured" or (timing == "auto" and "expert_s" in trace.timings and meta.hw_profile == cm.gpu.name):
        # Charge other policies at the recorded run's measured per-expert rate.
        recorded_plan = build_plan(trace, meta.replay_policy)
        return measured_costs(trace.timings, recorded_plan.execute)
    return roofline_costs(cm, trace.n_tokens, trace.prompt_len, trace.batch)


def time_workload(work: Workload, links: list[Link], queue: str = "fifo", sim: str = "fast",
                  record: bool = False) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, list[Span]]]:
    """Time one workload on each link: per link, per-step (end time, copy seconds issued,
    stall seconds) and the recorded spans. The one dispatch to the simulators that
    ``replay``, ``whatif`` and validation share: the compiled fast path for FIFO sweeps
    (every link in one call), the SimPy reference, or SimPy's copy-queue disciplines."""
    if queue != "fifo":
        return [run_simpy_queued(work, k, queue, record) for k in links]
    if sim == "simpy":
        return [run_simpy(work, k, record) for k in links]
    ends, copy, stall = run_fast_many(work, links)
    return [(ends[i], copy[i], stall[i], []) for i in range(len(links))]


@dataclass
class SimResult:
    """Per-step results of one simulated configuration, and their summary."""

    config: dict[str, Any]
    tpot: np.ndarray
    compute: np.ndarray
    copy: np.ndarray
    stall: np.ndarray
    plan: Plan
    expert_bytes: int
    ttft: float
    pred_recall: float  # the trace's prediction hit rate (recall@k), layers with a prediction
    spans: list[Span] = field(default_factory=list)

    @property
    def serial_bound(self) -> np.ndarray:
        return self.compute + self.copy

    @property
    def overlap_bound(self) -> np.ndarray:
        return np.maximum(self.compute, self.copy)

    def summary(self) -> dict[str, Any]:
        totals = self.plan.totals
        loads, executed = totals["loads_per_token"], totals["executed"]
        tp = self.tpot
        ms = 1e3
        p50, p90, p99 = np.percentile(tp, [50, 90, 99])
        return {
            **self.config,
            "tokens": int(tp.size),
            "tpot_ms": float(tp.mean() * ms),
            "tpot_p50_ms": float(p50 * ms),
            "tpot_p90_ms": float(p90 * ms),
            "tpot_p99_ms": float(p99 * ms),
            "tokens_per_s": float(1 / tp.mean()),
            "compute_ms": float(self.compute.mean() * ms),
            "copy_ms": float(self.copy.mean() * ms),
            "stall_ms": float(self.stall.mean() * ms),
            "overlap_ms": float(np.maximum(self.copy - self.stall, 0).mean() * ms),
            "serial_bound_ms": float(self.serial_bound.mean() * ms),
            "overlap_bound_ms": float(self.overlap_bound.mean() * ms),
            "max_prefetch_gain": float(np.minimum(self.compute, self.copy).sum() / self.serial_bound.sum()),
            "experts_loaded_per_token": loads,
            "gb_moved_per_token": float(loads * self.expert_bytes / 1e9),
            "cache_hit_rate": float(totals["cache_hits"] / executed),
            "prefetch_hit_rate": float(totals["prefetch_hits"] / executed),
            "pred_recall": self.pred_recall,
            "ttft_ms": float(self.ttft * ms),
        }


def simulate(trace: Trace, hw: HardwareProfile | Machine | str, policy: str | Policy = "on-demand",
             s: Setting = DEFAULT_SETTING, *, record: bool = False, plan: Plan | None = None, costs: Costs | None = None,
             progress: Callable[[int, int], None] | None = None, as_recorded: bool = False,
             shared: PerTrace | None = None) -> SimResult:
    """Simulate ``trace`` under ``policy`` (a name or the resolved object) on ``hw``, set up as
    ``s`` (:class:`~moesim.setting.Setting`: the cache, link, engine, host and layout
    knobs, each described there).

    ``hw`` is a GPU profile or a machine (:func:`moesim.hardware.get_machine`: ``none``,
    ``2xrtx5090``, ``rtx4090+rtx3090``; several GPUs or none take the static layouts of
    :mod:`moesim.sim.static`; the CPU-compute policies (docs/policies.md) go to
    :func:`moesim.sim.cpu_compute.simulate_cpu_compute`). ``plan`` and ``costs`` may be
    passed in when a sweep reuses them; ``progress(steps_planned, steps)`` reports planning,
    the part that grows with the trace (see :func:`simulate_policies` for a whole replay);
    ``record`` keeps the timeline's spans; ``shared`` (:class:`PerTrace`) is what the trace's
    other configurations computed already (its prediction recall, its cost models, its TTFTs),
    a replay's policies or a chart's points sharing one. A copy queue of None is the trace's own
    (``moesim profile --copy-queue`` records it), else FIFO, and FIFO for the CPU-compute
    policies, which copy at most their misses.

    ``as_recorded`` (validation: replaying the run the trace measured) keeps the recorded
    prediction time in the measured compute whatever ``policy`` is: the executor ran its
    predictor under every offloading policy (an on-demand trace records predictions so it
    can stand in for the prefetching policies), so the measured run paid for it. A what-if
    of a policy that predicts nothing takes it back out.
    """
    if s.sim not in SIMS:
        raise MoesimError(f"unknown simulator {s.sim!r}; known: {', '.join(SIMS)}")
    shared = shared or PerTrace()
    pred_recall, models = shared.pred_recall, shared.models
    pol = as_policy(policy)
    copy_queue = s.copy_queue
    if copy_queue is None:  # as recorded
        copy_queue = trace.header.get("copy_queue", "fifo") if pol.copies_experts else "fifo"
        if copy_queue != "fifo" and s.sim != "simpy":
            raise MoesimError(f"the trace was recorded with copy queue {copy_queue!r}, which only the SimPy simulator "
                              "models: use --sim simpy, or --copy-queue fifo to time it as FIFO")
    if copy_queue not in QUEUES:
        raise MoesimError(f"unknown copy queue {copy_queue!r}; known: {', '.join(QUEUES)}")
    if copy_queue != "fifo" and s.sim != "simpy":
        raise MoesimError(f"copy queue {copy_queue!r} is modelled by the SimPy simulator only (--sim simpy)")
    if s.eviction not in EVICTIONS:
        raise MoesimError(f"unknown eviction policy {s.eviction!r}; known: {', '.join(EVICTIONS)}")
    machine = get_machine(hw)
    # Static layouts go to the static step model; on one GPU the SimPy simulator times the
    # static CPU policies as the reference the static model is held to (tests/test_deploy.py).
    static = pol.static_on(machine.n_gpus)
    if static and s.sim == "simpy" and machine.n_gpus == 1 and pol.places_experts:
        static = False
    if machine.n_gpus != 1 and not static:
        where = "no GPU" if not machine.n_gpus else f"{machine.n_gpus} GPUs"
        raise MoesimError(f"{pol.name} copies experts to one GPU; on a machine with {where} only the static layouts "
                          "apply (all-resident, cpu-static, hot-experts, gpu-layers, weight-streaming)")
    if static and s.timing == "measured" and (not pol.places_experts or machine.n_gpus != 1):
        raise MoesimError(f"{pol.name} on {machine.name} is timed from the profiles only (--timing profile): a trace's "
                          "measured times belong to the one GPU that recorded it")
    hot = _hot_set(trace, machine, pol, s.gpu_expert_gib, s.calibration, s.calibrate_on_replay)
    if static and s.timing != "measured":
        if copy_queue != "fifo":
            raise MoesimError(f"{pol.name} copies nothing; copy queues apply to the copy policies")
        res = simulate_static(trace, machine, pol, s, placement=hot if pol.places_hot_set else None)
        return _with_recall(res, trace, pred_recall)
    hw = machine.gpus[0]
    if pol.uses_host:  # experts computed on the CPU: the CPU-compute step model (moesim.sim.cpu_compute)
        if s.timing == "measured" and not trace.measured:
            raise MoesimError("the trace has no measured timings (--timing profile)")
        if copy_queue != "fifo":
            raise MoesimError(f"{pol.name} copies at most its misses; copy queues apply to the copy policies")
        capacity = cache_capacity(trace.model, s.cache_gib, s.cache_experts)
        timed = replace(s, cache_gib=0.0, cache_experts=capacity, timing="measured" if s.timing == "measured" else "profile")
        res = simulate_cpu_compute(trace, hw, pol, timed, record=record, placement=hot if pol.places_hot_set else None,
                                   models=models)
        return _with_recall(res, trace, pred_recall)
    spec = trace.model
    if s.link_gbps is not None:
        hw = hw.with_figure("h2d_pinned_gbs", s.link_gbps)
    capacity = pol.cache_capacity(spec, s.cache_gib, s.cache_experts)
    pinned = hot.hottest if hot is not None and pol.copies_experts else ()
    plan = plan or build_plan(trace, pol, capacity, s.eviction, progress, s.lookahead, s.cache_per_layer, pinned)
    costs = costs or pick_costs(trace, models.of(spec, hw, s), s.timing)  # the caller's, once
    (result,) = time_plan(trace, pol, plan, costs, [hw], replace(s, copy_queue=copy_queue), record=record,
                          as_recorded=as_recorded, shared=shared)
    return result


def _hot_set(trace: Trace, machine: Machine, pol: Policy, gpu_expert_gib: float | None,
             calibration: np.ndarray | None, calibrate_on_replay: bool):
    """The hottest experts within ``gpu_expert_gib`` of one GPU (None without a budget): a
    copy policy's pinned set or hot-experts' placement, counted on the calibration routing
    (or, marked optimistic, on the replayed trace itself)."""
    if gpu_expert_gib is None or not (pol.places_hot_set or pol.copies_experts):
        return None
    if not (isinstance(gpu_expert_gib, (int, float)) and 0 <= gpu_expert_gib < float("inf")):
        raise MoesimError(f"--gpu-expert-gib {gpu_expert_gib!r}: GiB of experts kept on the GPU, >= 0")
    if machine.n_gpus != 1:
        raise MoesimError("--gpu-expert-gib places the hottest experts on one GPU")
    spec = trace.model
    if calibration is not None and calibrate_on_replay:
        raise MoesimError("give a calibration trace or ask to calibrate on the replayed trace, not both")
    if calibration is None and not calibrate_on_replay:
        raise MoesimError("--gpu-expert-gib keeps the hottest experts: name the calibration trace that says which "
                          "(--placement-from), or --calibrate-on-replay for an optimistic bound")
    ids, source = (calibration, "a calibration trace") if calibration is not None else (trace.true_ids,
                                                                                       "the replayed trace")
    room = expert_budget(spec, machine.gpus[0]["device_memory_gb"] * 1e9, trace.batch, trace.prompt_len + trace.n_tokens)
    return hot_set(routing_counts(ids, spec.n_experts), spec, min(room, int(gpu_expert_gib * 2**30)), source,
                   calibration is None)


def _with_recall(res: CpuResult, trace: Trace, pred_recall: float | None) -> CpuResult:
    """A CPU-compute or static result carrying the trace's prediction recall, as a copy
    policy's does (the column is the trace's, whatever the policy: on-demand's says it too)."""
    res.pred_recall = prediction_recall(trace) if pred_recall is None else pred_recall
    return res


@dataclass
class PerTrace:
    """What is computed once per trace and shared by the configurations timed on it (a sweep's
    groups, a replay's policies): the model as the rows name it (``spec``; None: the
    trace's), the trace's prediction recall (None: counted when needed) and a memo of the
    time to first token by profile (``ttfts``)."""

    spec: ModelSpec | None = None
    pred_recall: float | None = None
    ttfts: dict[tuple, float] = field(default_factory=dict)
    models: CostModels = field(default_factory=CostModels)


def time_plan(trace: Trace, pol: Policy, plan: Plan, costs: Costs, profiles: list[HardwareProfile],
              s: Setting = DEFAULT_SETTING, *, record: bool = False, as_recorded: bool = False,
              shared: PerTrace | None = None) -> list[SimResult]:
    """The results of one plan of a copy policy on each of ``profiles`` (one GPU whose link
    figures differ: ``costs`` are its compute times, computed once), timed by ``s.sim`` with
    ``s.engine``'s figures and ``s.copy_queue``: the path ``replay`` and ``whatif`` share, so
    one deployment gets one number from both. ``shared``: what its trace's other
    configurations computed already (:class:`PerTrace`)."""
    shared = shared or PerTrace()
    spec = shared.spec or trace.model
    copy_queue = s.copy_queue or "fifo"
    cms = [shared.models.of(spec, h, s) for h in profiles]  # one per profile: the first prices the predictor
    # A predicting policy pays for its predictor (the recorded one, replaying the run as measured).
    costs = charge_prediction(costs, cms[0], pol.predicts or as_recorded, trace.batch,
                              trace.timings.get("predict_s"), plan.lookahead)
    work = make_workload(spec, plan, costs)
    links = [sim_link(trace, c, costs) for c in cms]
    held = plan.cache_experts * spec.n_moe_layers if plan.per_layer else plan.cache_experts
    need = device_bytes(spec, pol, cache_experts=held, batch=trace.batch, context=trace.prompt_len + trace.n_tokens,
                        lookahead=plan.lookahead)  # what the GPU holds: weights, KV cache, expert slots and cache
    results = []
    for c, timed in zip(cms, time_workload(work, links, copy_queue, s.sim, record)):
        # Everything ttft_of reads: the model and prompt of the trace, the GPU and its link, the engine.
        key = (spec, trace.prompt_len, trace.batch, costs.source, trace.meta.prefill_s, c.gpu.name, c.gpu.path,
               c.gpu["h2d_pinned_gbs"], c.gpu["transfer_latency_us"], pol.copies_experts, c.engine.name)
        if key not in shared.ttfts:
            shared.ttfts[key] = ttft_of(trace, c, pol, costs)
        result = make_result(trace, c, pol, plan, costs, work, timed, sim="simpy" if copy_queue != "fifo" else s.sim,
                             ttft=shared.ttfts[key], shared=shared)
        if copy_queue != "fifo":
            result.config["copy_queue"] = copy_queue
        if plan.lookahead != 1:
            result.config["lookahead"] = plan.lookahead
        if plan.per_layer:
            result.config["cache_per_layer"] = True
            result.config["cache_experts"] = plan.cache_experts * spec.n_moe_layers  # the total held
        if plan.pinned:
            result.config["pinned_experts"] = plan.pinned
        result.config["device_gb_needed"] = need / 1e9
        result.config["fits"] = need <= c.gpu["device_memory_gb"] * 1e9
        results.append(result)
    return results


def sim_link(trace: Trace, cm: CostModel, costs: Costs) -> Link:
    """The copy engine of ``cm``'s GPU for this trace's model, as the timing source needs it."""
    link = Link.of(cm)
    recorded = trace.meta.recorded_policy
    if costs.source.startswith("measured") and recorded is not None and recorded.prefetches:
        # Times measured while copies overlapped compute already include the interference.
        link = replace(link, interference=0.0)
    return link


def ttft_of(trace: Trace, cm: CostModel, pol: Policy, costs: Costs) -> float:
    """Time to first token: the trace's measured prefill with measured times, else the roofline."""
    ttft = trace.meta.prefill_s if costs.source.startswith("measured") else None
    if ttft is None:
        ttft = prefill_time(cm, trace.prompt_len, pol.copies_experts, trace.batch)
    return float(ttft)


def make_result(trace: Trace, cm: CostModel, pol: Policy, plan: Plan, costs: Costs, work: Workload,
                timed: tuple[np.ndarray, np.ndarray, np.ndarray, list[Span]], *, sim: str, ttft: float | None = None,
                shared: PerTrace | None = None) -> SimResult:
    """The :class:`SimResult` of one timed configuration on ``cm``'s GPU (which carries any
    link override) and engine: ``timed`` is :func:`time_workload`'s (end times, copy seconds,
    stalls, spans); ``ttft`` and ``shared`` (:class:`PerTrace`) computed once per trace and link."""
    shared = shared or PerTrace()
    spec, hw = shared.spec or trace.model, cm.gpu
    ends, copy, stall, spans = timed
    capacity = plan.cache_experts
    tpot = np.diff(ends, prepend=0.0)
    config = {
        "model": spec.name, "hw": hw.name, "policy": pol.name, "cache_experts": capacity,
        "cache_gib": float(f"{capacity * spec.expert_bytes / 2**30:.4g}"),
        "eviction": plan.eviction if capacity else "-", "link_gbps": hw["h2d_pinned_gbs"], "batch": trace.batch,
        "sim": sim, "engine": cm.engine.name, "timing": costs.source, "synthetic_trace": trace.synthetic,
    }
    if ttft is None:
        ttft = ttft_of(trace, cm, pol, costs)
    recall = prediction_recall(trace) if shared.pred_recall is None else shared.pred_recall
    return SimResult(config, tpot, work.compute_per_token, copy, stall, plan, spec.expert_bytes, float(ttft),
                     recall, spans or [])


def prediction_recall(trace: Trace) -> float:
    """Mean recall@k of the recorded predictions (share of true experts predicted), over
    the (step, layer, sequence) rows that have a prediction; NaN when none has. A true
    expert the row's prediction names is a hit, however many times it names it: the one
    definition ``moesim stats`` reports too (:func:`moesim.sim.stats_kernels.recall_counts`).
    Long traces are counted in that compiled pass (0.1 s against 2 s of numpy on 100,000
    Qwen3-30B-A3B tokens), short ones by numpy, which spares them numba's start-up;
    tests/test_speed_recall.py holds the two equal."""
    if trace.true_ids.size < RECALL_COMPILED_MIN:
        return _prediction_recall_numpy(trace)
    hits, rows = recall_counts(trace.true_ids, trace.pred_ids, trace.model.n_experts)
    return hits / trace.true_ids.shape[-1] / rows if rows else float("nan")


#: Routing slots from which :func:`prediction_recall` counts in compiled code.
RECALL_COMPILED_MIN = 1 << 21


def _prediction_recall_numpy(trace: Trace) -> float:
    hits_sum, rows = 0.0, 0
    chunk = max(1, 1_000_000 // max(1, trace.true_ids[0].size * trace.true_ids.shape[-1]))  # bounded temporaries
    for t0 in range(0, trace.n_tokens, chunk):
        pred, true = trace.pred_ids[t0:t0 + chunk], trace.true_ids[t0:t0 + chunk]
        has = (pred >= 0).any(-1)
        hits = (pred[..., :, None] == true[..., None, :]).any(-2).sum(-1) / true.shape[-1]  # per true expert
        hits_sum += float(hits[has].sum())
        rows += int(has.sum())
    return hits_sum / rows if rows else float("nan")


def simulate_policies(trace: Trace, hw: HardwareProfile | Machine | str, policies: list[str],
                      s: Setting = DEFAULT_SETTING, *,
                      progress: Callable[[int, int], None] | None = None, as_recorded: bool = False
                      ) -> list[SimResult]:
    """:func:`simulate` for each policy, set up as ``s``, sharing the compute times and the
    prediction recall (they do not depend on the policy). ``progress(done, total)`` counts
    layer-steps planned and timed over all policies, for a progress bar on long traces."""
    for p in policies:
        get_policy(p)  # every name checked before any work
    per_policy = trace.n_tokens * trace.model.n_moe_layers
    total = 2 * per_policy * len(policies)  # planning, then timing, per policy
    machine = get_machine(hw)
    shared = PerTrace(pred_recall=prediction_recall(trace))  # and one cost model a profile, for every policy
    costs = None
    if machine.n_gpus == 1:
        profile = machine.gpus[0]
        profile = profile.with_figure("h2d_pinned_gbs", s.link_gbps) if s.link_gbps is not None else profile
        costs = pick_costs(trace, shared.models.of(trace.model, profile, s), s.timing)
    results = []
    for i, p in enumerate(policies):
        done = 2 * i * per_policy

        def planned(steps: int, _total: int, done: int = done) -> None:
            if progress is not None:
                progress(done + steps * trace.model.n_moe_layers, total)

        results.append(simulate(trace, hw, p, s, costs=costs, progress=planned, as_recorded=as_recorded,
                                shared=shared))
        if progress is not None:
            progress(done + 2 * per_policy, total)
    return results
