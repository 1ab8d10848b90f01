"""The step model of the CPU-compute policies (cpu-static, hot-experts, cpu-on-miss).

At MoE layer l of a decode step the device has just run attention and the router. The
routed experts split (:class:`moesim.placement.HybridPlanner`) into those the device
holds and misses; under cpu-on-miss :func:`moesim.policy.cpu_or_copy` sends some misses
over the link, the others (all of them under the static policies) run on the CPU. Device
and CPU work concurrently; the layer ends when the later finishes:

    gpu_end = (copies landed, or now) + max(n_dev * (gpu_mem + launches), a_dev * gpu_tok)
    cpu_end = now + roundtrip + max(n_cpu * cpu_mem, a_cpu * cpu_tok) + n_cpu * dispatch

with ``n`` experts serving ``a`` token-expert pairs (:class:`moesim.policy.ExpertTimes`):
CPU time grows with batch and prompt length once the math outweighs reading the weights.
The SimPy reference (``sim.engine.run_simpy_hybrid``) and the fast recurrence
(``sim.fastpath_cpu.run_fast_hybrid``) take the same :class:`HybridWork` and drive the
same planner, so they must agree (a property test holds them to it).

Not modelled here: copy/compute interference and the wake-up delay (only cpu-on-miss
copies at all, and its decisions are made without them), and the activation transfer's
share of the link. Compute times are the roofline's; a trace's measured per-expert times
are device times and say nothing about the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesim.costmodel import CostModel, ExpertTimes
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, HostProfile, get_host
from moesim.memory import device_bytes
from moesim.placement import HybridPlanner, Placement, make_placement
from moesim.policy import EVICTIONS, get_policy
from moesim.sim.costs import roofline_costs
from moesim.sim.plan import Plan
from moesim.sim.prefill import prefill_time_hybrid
from moesim.sim.workload import Link
from moesim.traces.format import Trace, load_calibration, read_trace  # noqa: F401 (load_calibration re-exported)


@dataclass(frozen=True)
class HybridWork:
    """Per step and model layer: attention time; per MoE layer: the routed experts with
    their token counts, heaviest first (ties by expert id)."""

    attn: np.ndarray  # [t, n_layers] seconds
    other: np.ndarray  # [t] seconds (embedding, final norm, LM head)
    moe: tuple[int, ...]  # model layer index of each MoE layer
    routed: list[list[list[tuple[int, int]]]]  # [t][m] -> [(expert, tokens)]
    times: ExpertTimes
    counts: np.ndarray | None = None  # [t, m, E] tokens routed to each expert (the vectorised static path)
    # Measured timing (a trace the executor recorded): seconds per expert the device / the CPU
    # took at [step, MoE layer], NaN where the recording ran none there (the roofline is used).
    dev_per: np.ndarray | None = None
    cpu_per: np.ndarray | None = None


@dataclass
class HybridRun:
    """Per-step results of one engine run, and per (step, MoE layer) counts."""

    ends: np.ndarray
    copy: np.ndarray  # link seconds issued per step
    stall: np.ndarray  # seconds the device waited for copies per step
    cpu_wait: np.ndarray  # seconds a layer's end waited on the CPU past the device's end, per step
    cpu_busy: np.ndarray  # CPU seconds per step (with round trips)
    n_gpu: np.ndarray  # [t, m] experts the device ran
    n_cpu: np.ndarray  # [t, m] experts the CPU ran
    n_copied: np.ndarray  # [t, m] misses copied
    n_hits: np.ndarray  # [t, m] experts the device already held
    spans: list = field(default_factory=list)


def routed_sets(ids: np.ndarray) -> list[list[list[tuple[int, int]]]]:
    """``[t, m, b, k]`` ids -> per (t, m) the (expert, token count) pairs, heaviest first."""
    t, m, b, k = ids.shape
    out = []
    for step in ids.reshape(t, m, b * k).tolist():
        rows = []
        for row in step:
            count: dict[int, int] = {}
            for e in row:
                if e >= 0:
                    count[e] = count.get(e, 0) + 1
            rows.append(sorted(count.items(), key=lambda p: (-p[1], p[0])))
        out.append(rows)
    return out


def separate_calibration(calibration: np.ndarray, trace: Trace, path: object) -> np.ndarray:
    """``calibration`` unless it is the replayed trace's own routing (the same file, or a
    copy): a placement counted on the run it is judged on has seen the future, which only
    ``--calibrate-on-replay`` may do, and then the rows say optimistic."""
    if calibration.shape == trace.true_ids.shape and np.array_equal(calibration, trace.true_ids):
        raise MoesimError(f"--placement-from {path} holds the very routing being replayed: a placement counted on it "
                          "has seen the future; pass --calibrate-on-replay instead (rows marked optimistic), or a "
                          "separate calibration trace")
    return calibration


def token_counts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """``[t, m, b, k]`` ids -> ``[t, m, E]`` tokens routed to each expert."""
    t, m, b, k = ids.shape
    flat = ids.reshape(t * m, b * k).astype(np.int64)
    row = np.repeat(np.arange(t * m), b * k)
    ok = flat.reshape(-1) >= 0
    counts = np.zeros(t * m * n_experts, np.int32)
    np.add.at(counts, row[ok] * n_experts + flat.reshape(-1)[ok], 1)
    return counts.reshape(t, m, n_experts)


def build_work(trace: Trace, cm: CostModel, times: ExpertTimes) -> HybridWork:
    spec = trace.model
    costs = roofline_costs(cm, trace.n_tokens, trace.prompt_len, trace.batch)
    return HybridWork(costs.attn, costs.other, spec.moe_layers, routed_sets(trace.true_ids), times,
                      token_counts(trace.true_ids, spec.n_experts))


def measured_work(trace: Trace, times: ExpertTimes) -> HybridWork:
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
    return HybridWork(attn, tm["other_s"].astype(float), spec.moe_layers,
                      routed_sets(trace.true_ids), times, None, dev_per, cpu_per)


@dataclass
class HybridResult:
    """A CPU-compute policy's simulated run: per-step times and the summary reports read."""

    config: dict[str, Any]
    tpot: np.ndarray
    run: HybridRun
    plan: Plan
    ttft: float
    placement: Placement | None

    # The copy family's per-step arrays, so reports and sweeps read either result alike.
    @property
    def copy(self) -> np.ndarray:
        return self.run.copy

    @property
    def stall(self) -> np.ndarray:
        return self.run.stall

    @property
    def compute(self) -> np.ndarray:
        """The device stream's own work per step (attention, its experts, the head)."""
        return self.tpot - self.run.stall - self.run.cpu_wait

    @property
    def spans(self) -> list:
        return self.run.spans

    def summary(self) -> dict[str, Any]:
        r, tp, ms = self.run, self.tpot, 1e3
        executed = (r.n_gpu + r.n_cpu).sum()
        device = tp - r.stall - r.cpu_wait  # the device stream's own work: attention, its experts, the head
        return {
            **self.config,
            "cache_gib": float(f"{self.config['cache_experts'] * self.config['expert_bytes'] / 2**30:.4g}"),
            "compute_ms": float(device.mean() * ms),
            "serial_bound_ms": float((device + r.copy).mean() * ms),
            "overlap_bound_ms": float(np.maximum(device, r.copy).mean() * ms),
            "cache_hit_rate": float(r.n_hits.sum() / executed) if self.config["cache_experts"] else 0.0,
            "prefetch_hit_rate": 0.0,
            "pred_recall": float("nan"),  # these policies use no prediction
            "tokens": int(tp.size),
            "tpot_ms": float(tp.mean() * ms),
            "tpot_p50_ms": float(np.percentile(tp, 50) * ms),
            "tpot_p90_ms": float(np.percentile(tp, 90) * ms),
            "tpot_p99_ms": float(np.percentile(tp, 99) * ms),
            "tokens_per_s": float(1 / tp.mean()),
            "copy_ms": float(r.copy.mean() * ms),
            "stall_ms": float(r.stall.mean() * ms),
            "cpu_ms": float(r.cpu_busy.mean() * ms),
            "cpu_wait_ms": float(r.cpu_wait.mean() * ms),
            "cpu_expert_share": float(r.n_cpu.sum() / executed),
            "cpu_experts_per_token": float(r.n_cpu.sum(1).mean()),
            "experts_loaded_per_token": float(r.n_copied.sum(1).mean()),
            "gb_moved_per_token": float(r.n_copied.sum(1).mean() * self.config["expert_bytes"] / 1e9),
            "device_hit_rate": float(r.n_hits.sum() / executed),
            "ttft_ms": float(self.ttft * ms),
        }


def simulate_hybrid(trace: Trace, hw: HardwareProfile, policy: str = "cpu-static", *, host: str | HostProfile | None = None,
                    cpu_layers: int | str = "auto", calibration: np.ndarray | None = None,
                    calibrate_on_replay: bool = False, cache_experts: int = 0, eviction: str = "lru",
                    engine: str = "simpy", link_gbps: float | None = None, amx: bool = True,
                    record: bool = False, placement: Placement | None = None,
                    timing: str = "profile") -> HybridResult:
    """Simulate ``trace`` under a CPU-compute policy on GPU ``hw`` and ``host`` (default:
    the GPU profile's host). ``calibration`` is the ``[t, m, b, k]`` routing of a separate
    calibration trace (hot-experts; warms cpu-on-miss's cache). ``placement`` replaces the
    one the policy would choose (a what-if sweep's smaller hot-experts budget).
    ``timing="measured"`` times the work with the trace's own measured times
    (:func:`measured_work`; the fast engine)."""
    from moesim.sim.engine import run_simpy_hybrid
    from moesim.sim.fastpath_cpu import run_fast_hybrid

    pol = get_policy(policy)
    if not pol.cpu:
        raise MoesimError(f"policy {pol.name!r} computes no experts on the CPU; use moesim.sim.simulate.simulate")
    if engine not in ("simpy", "fast"):
        raise MoesimError(f"unknown engine {engine!r}; known: simpy, fast")
    if eviction not in EVICTIONS:
        raise MoesimError(f"unknown eviction policy {eviction!r}; known: {', '.join(EVICTIONS)}")
    spec = trace.model
    if pol.cpu != "miss":
        cache_experts = 0  # static placements keep no cache: their resident set is the placement
    host = host if isinstance(host, HostProfile) else get_host(host, hw)
    if link_gbps is not None:
        hw = hw.with_figure("h2d_pinned_gbs", link_gbps)
    context = trace.prompt_len + trace.n_tokens
    placement = placement or make_placement(pol, spec, hw["device_memory_gb"] * 1e9, batch=trace.batch, context=context,
                               cpu_layers_n=cpu_layers, calibration=calibration, replay_ids=trace.true_ids,
                               calibrate_on_replay=calibrate_on_replay)
    cm = CostModel(spec, hw, host, amx=amx)
    link = Link.of(cm)
    times = cm.expert_times(trace.batch)
    if timing not in ("profile", "measured"):
        raise MoesimError(f"unknown timing {timing!r} for {pol.name}; known: profile, measured")
    work = measured_work(trace, times) if timing == "measured" else build_work(trace, cm, times)
    planner = HybridPlanner(pol, spec, placement, cache_experts, eviction)
    if timing == "measured":
        engine = "fast"  # per-(step, layer) measured times: the recurrence reads them
    run = run_simpy_hybrid(work, planner, link, record) if engine == "simpy" else run_fast_hybrid(work, planner)
    tpot = np.diff(run.ends, prepend=0.0)
    b, k = trace.batch, spec.top_k
    n_exec = run.n_gpu + run.n_cpu
    zeros = np.zeros_like(n_exec)
    plan = Plan(pol, cache_experts, eviction, 1, zeros, run.n_copied, n_exec, np.full_like(n_exec, b * k), run.n_hits,
                zeros, zeros)
    resident = placement.resident if placement is not None else None
    ttft = prefill_time_hybrid(cm, times, resident, trace.prompt_len, b)
    config = {
        "model": spec.name, "hw": hw.name, "host": host.name, "policy": pol.name, "cache_experts": cache_experts,
        "eviction": eviction if cache_experts else "-", "link_gbps": hw["h2d_pinned_gbs"], "batch": b,
        "engine": engine, "timing": ("measured (trace); decisions by the roofline" if timing == "measured" else
                                     f"roofline ({hw.name} + {host.name}{'' if amx and host.has_amx else ', no AMX'})"),
        "placement": placement.source if placement is not None else "cold cache",
        "optimistic_placement": bool(placement is not None and placement.optimistic),
        "resident_experts": placement.n_resident if placement is not None else 0,
        "expert_bytes": spec.expert_bytes, "synthetic_trace": trace.synthetic,
    }
    need = device_bytes(spec, pol, cache_experts=cache_experts, batch=b, context=context,
                        resident_experts=placement.n_resident if placement is not None else 0)
    config["device_gb_needed"] = need / 1e9
    config["fits"] = need <= hw["device_memory_gb"] * 1e9
    return HybridResult(config, tpot, run, plan, ttft, placement)
