"""The step model of the CPU-compute policies (cpu-static, hot-experts, cpu-on-miss).

At MoE layer l of a decode step the device has just run attention and the router. The
routed experts split (:class:`moesim.policy.placement.HostPlanner`) into those the device
holds and misses; under cpu-on-miss :func:`moesim.policy.cpu_or_copy` sends some misses
over the link, the others (all of them under the static policies) run on the CPU. Device
and CPU work concurrently; the layer ends when the later finishes:

    gpu_end = (copies landed, or now) + max(n_dev * (gpu_mem + launches), a_dev * gpu_tok)
    cpu_end = now + roundtrip + max(n_cpu * cpu_mem, a_cpu * cpu_tok) + n_cpu * dispatch

with ``n`` experts serving ``a`` token-expert pairs (:class:`moesim.costmodel.ExpertTimes`):
CPU time grows with batch and prompt length once the math outweighs reading the weights.
The SimPy reference (``sim.engine.run_simpy_cpu``) and the fast recurrence
(``sim.fastpath_cpu.run_fast_cpu``) take the same :class:`CpuWork` and drive the
same planner, so they must agree (a property test holds them to it).

Not modelled here: copy/compute interference and the wake-up delay (only cpu-on-miss
copies at all, and its decisions are made without them), and the activation transfer's
share of the link. Compute times are the roofline's; a trace's measured per-expert times
are device times and say nothing about the CPU.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moesim.costmodel import CostModel, CostModels, ExpertTimes
from moesim.engines import EngineProfile, get_engine
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, HostProfile, get_host
from moesim.memory import device_bytes
from moesim.policy import EVICTIONS, Policy, as_policy
from moesim.policy.placement import HostPlanner, Placement, make_placement
from moesim.setting import DEFAULT_SETTING, Setting
from moesim.sim.costs import roofline_costs
from moesim.sim.cpu_run import CpuResult, CpuWork, routed_sets, token_counts  # noqa: F401 (re-exported)
from moesim.sim.engine import run_simpy_cpu
from moesim.sim.fastpath_cpu import run_fast_cpu
from moesim.sim.plan import Plan
from moesim.sim.prefill import prefill_time_cpu_compute
from moesim.sim.static import simulate_static
from moesim.sim.workload import Link
from moesim.traces.format import Trace, load_calibration, read_trace  # noqa: F401 (load_calibration re-exported)


def separate_calibration(calibration: np.ndarray, trace: Trace, path: object) -> np.ndarray:
    """``calibration`` unless it is the replayed trace's own routing (the same file, or a
    copy): a placement counted on the run it is judged on has seen the future, which only
    ``--calibrate-on-replay`` may do, and then the rows say optimistic."""
    if calibration.shape == trace.true_ids.shape and np.array_equal(calibration, trace.true_ids):
        raise MoesimError(f"--placement-from {path} holds the very routing being replayed: a placement counted on it "
                          "has seen the future; pass --calibrate-on-replay instead (rows marked optimistic), or a "
                          "separate calibration trace")
    return calibration


def build_work(trace: Trace, cm: CostModel, times: ExpertTimes) -> CpuWork:
    spec = trace.model
    costs = roofline_costs(cm, trace.n_tokens, trace.prompt_len, trace.batch)
    return CpuWork(costs.attn, costs.other, spec.moe_layers, routed_sets(trace.true_ids), times,
                      token_counts(trace.true_ids, spec.n_experts))


def measured_work(trace: Trace, times: ExpertTimes) -> CpuWork:
    """The step model's inputs from an executor trace's measured times: attention (less
    the recording's prediction, which these policies do not run) and the rest per step as
    recorded, and per (step, MoE layer) the recorded device seconds per
    device expert (``expert_s`` / experts the device ran) and CPU seconds per CPU expert
    (``cpu_s`` / ``cpu_experts``, the activation round trip included). A trace of a copy
    policy has no CPU times: the CPU's share is then timed by the roofline (``times``).
    Decisions (cpu-on-miss) are still made with ``times``, the figures the executor decided
    with, so replay and recording decide alike."""
    tm = trace.timings
    missing = [k for k in ("attn_s", "expert_s", "other_s") if k not in tm]
    if missing:
        raise MoesimError(f"the trace lacks measured {', '.join(missing)}; use --timing profile")
    spec = trace.model
    t, m, b, k = trace.true_ids.shape
    flat = trace.true_ids.reshape(t, m, b * k)
    distinct = np.array([[len(set(row[row >= 0].tolist())) for row in step] for step in flat])
    n_cpu = tm["cpu_experts"].astype(float) if "cpu_experts" in tm else np.zeros((t, m))
    n_dev = distinct - n_cpu
    with np.errstate(divide="ignore", invalid="ignore"):
        dev_per = np.where(n_dev > 0, tm["expert_s"] / n_dev, np.nan)
        cpu_per = np.where(n_cpu > 0, tm["cpu_s"] / n_cpu, np.nan) if "cpu_s" in tm else np.full((t, m), np.nan)
    attn = tm["attn_s"].astype(float)
    if "predict_s" in tm:  # a copy policy's recording predicted inside attn_s; these policies predict nothing
        attn = np.maximum(attn - tm["predict_s"], 0.0)
    return CpuWork(attn, tm["other_s"].astype(float), spec.moe_layers,
                      routed_sets(trace.true_ids), times, None, dev_per, cpu_per)


def simulate_cpu_compute(trace: Trace, hw: HardwareProfile, policy: str | Policy = "cpu-static",
                         s: Setting = DEFAULT_SETTING, *, record: bool = False,
                         placement: Placement | None = None, models: CostModels | None = None) -> CpuResult:
    """Simulate ``trace`` under a CPU-compute policy on GPU ``hw`` and ``host`` (default:
    the GPU profile's host). ``calibration`` is the ``[t, m, b, k]`` routing of a separate
    calibration trace (hot-experts; warms cpu-on-miss's cache). ``placement`` replaces the
    one the policy would choose (a what-if sweep's smaller hot-experts budget).
    ``timing="measured"`` times the work with the trace's own measured times
    (:func:`measured_work`; the fast path). A static placement timed by the cost model on
    the fast path is :func:`moesim.sim.static.simulate_static` (its one step model; the
    SimPy run here is its reference); ``engine`` and ``threads`` as there."""
    pol = as_policy(policy)
    if not pol.uses_host:
        raise MoesimError(f"policy {pol.name!r} computes no experts on the CPU; use moesim.sim.simulate.simulate")
    sim, cache_experts = s.sim, s.cache_experts
    timing = "profile" if s.timing == "auto" else s.timing  # the cost model's, unless measured times are asked for
    if sim not in ("simpy", "fast"):
        raise MoesimError(f"unknown simulator {sim!r}; known: simpy, fast")
    if s.eviction not in EVICTIONS:
        raise MoesimError(f"unknown eviction policy {s.eviction!r}; known: {', '.join(EVICTIONS)}")
    spec = trace.model
    cache_experts = pol.cache_capacity(spec, cache_experts=cache_experts)  # static placements: none (the placement)
    host = s.host if isinstance(s.host, HostProfile) else get_host(s.host, hw)
    engine = s.engine if isinstance(s.engine, EngineProfile) else get_engine(s.engine)
    if s.link_gbps is not None:
        hw = hw.with_figure("h2d_pinned_gbs", s.link_gbps)
    context = trace.prompt_len + trace.n_tokens
    placement = placement or make_placement(pol, spec, hw["device_memory_gb"] * 1e9, batch=trace.batch, context=context,
                               cpu_layers_n=s.cpu_layers, calibration=s.calibration, replay_ids=trace.true_ids,
                               calibrate_on_replay=s.calibrate_on_replay,
                               strategy=engine.expert_placement)
    if pol.static_on(1) and timing == "profile" and sim == "fast":
        return simulate_static(trace, hw, pol, replace(s, host=host, engine=engine), placement=placement)
    models = models if models is not None else CostModels()  # a caller's: shared by its configurations
    cm = models.of(spec, hw, replace(s, engine=engine), host)
    link = Link.of(cm)
    times = cm.expert_times(trace.batch)
    if timing not in ("profile", "measured"):
        raise MoesimError(f"unknown timing {timing!r} for {pol.name}; known: profile, measured")
    work = measured_work(trace, times) if timing == "measured" else build_work(trace, cm, times)
    planner = HostPlanner(pol, spec, placement, cache_experts, s.eviction)
    if timing == "measured":
        sim = "fast"  # per-(step, layer) measured times: the recurrence reads them
    run = run_simpy_cpu(work, planner, link, record) if sim == "simpy" else run_fast_cpu(work, planner)
    tpot = np.diff(run.ends, prepend=0.0)
    b, k = trace.batch, spec.top_k
    n_exec = run.n_gpu + run.n_cpu
    zeros = np.zeros_like(n_exec)
    plan = Plan(pol, cache_experts, s.eviction, 1, zeros, run.n_copied, n_exec, np.full_like(n_exec, b * k), run.n_hits,
                zeros, zeros)
    resident = placement.resident if placement is not None else None
    ttft = prefill_time_cpu_compute(cm, times, resident, trace.prompt_len, b)
    config = {
        "model": spec.name, "hw": hw.name, "host": host.name, "policy": pol.name, "cache_experts": cache_experts,
        "eviction": s.eviction if cache_experts else "-", "link_gbps": hw["h2d_pinned_gbs"], "batch": b,
        "sim": sim, "engine": cm.engine.name, "threads": cm.threads,
        "timing": ("measured (trace); decisions by the roofline" if timing == "measured" else
                   f"roofline ({hw.name} + {host.name}, {cm.engine.label}{'' if s.amx and host.has_amx else ', no AMX'})"),
        "placement": placement.source if placement is not None else "cold cache",
        "optimistic_placement": bool(placement is not None and placement.optimistic),
        "resident_experts": placement.n_resident if placement is not None else 0,
        "expert_bytes": spec.expert_bytes, "synthetic_trace": trace.synthetic,
    }
    # cpu-on-miss's placement only warms its cache (inside cache_experts); the static ones hold theirs
    held = pol.held_experts(placement)
    need = device_bytes(spec, pol, cache_experts=cache_experts, batch=b, context=context, resident_experts=held)
    config["device_gb_needed"] = need / 1e9
    config["fits"] = need <= hw["device_memory_gb"] * 1e9
    return CpuResult(config, tpot, run, plan, ttft, placement)
