"""The data the CPU-compute step models share: their work, one run's per-step results, and
the result a summary is read from. The SimPy reference (``moesim.sim.engine``), the fast
recurrence (``moesim.sim.fastpath_cpu``), the static layouts (``moesim.sim.static``) and
the front door (``moesim.sim.cpu_compute``) all import these; none imports another's engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moesim.costmodel import ExpertTimes
from moesim.sim.plan import Plan

if TYPE_CHECKING:  # annotations only
    from moesim.layout import Layout
    from moesim.policy.placement import Placement


@dataclass(frozen=True)
class CpuWork:
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
class CpuRun:
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
    device: np.ndarray | None = None  # GPU work per step, where it is not TPOT less waits (static layouts)
    transfer: np.ndarray | None = None  # hidden states crossing between processors per step (static layouts)
    moved: np.ndarray | None = None  # bytes over the link per step, where not n_copied experts (streamed weights)


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


def token_counts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """``[t, m, b, k]`` ids -> ``[t, m, E]`` tokens routed to each expert."""
    t, m, b, k = ids.shape
    flat = ids.reshape(t * m, b * k).astype(np.int64)
    row = np.repeat(np.arange(t * m), b * k)
    ok = flat.reshape(-1) >= 0
    counts = np.zeros(t * m * n_experts, np.int32)
    np.add.at(counts, row[ok] * n_experts + flat.reshape(-1)[ok], 1)
    return counts.reshape(t, m, n_experts)


@dataclass
class CpuResult:
    """A CPU-compute policy's simulated run: per-step times and the summary reports read."""

    config: dict[str, Any]
    tpot: np.ndarray
    run: CpuRun
    plan: Plan
    ttft: float
    placement: Placement | Layout | None
    #: the trace's prediction recall, as every policy's result reports it (these policies use none)
    pred_recall: float = float("nan")

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
        if self.run.device is not None:
            return self.run.device
        return self.tpot - self.run.stall - self.run.cpu_wait

    @property
    def spans(self) -> list:
        return self.run.spans

    def summary(self) -> dict[str, Any]:
        r, tp, ms = self.run, self.tpot, 1e3
        executed = (r.n_gpu + r.n_cpu).sum()
        device = self.compute  # the device stream's own work: attention, its experts, the head
        transfer = r.transfer if r.transfer is not None else 0.0
        hidden_cpu = r.cpu_busy - (tp - device - r.stall - transfer)  # CPU work that ran beside the device's
        return {
            **self.config,
            "cache_gib": float(f"{self.config['cache_experts'] * self.config['expert_bytes'] / 2**30:.4g}"),
            "compute_ms": float(device.mean() * ms),
            # The bounds of the whole step, CPU included: serial, nothing overlapped (the copies and
            # the CPU work hidden under the device's added back); ideal, the copies hidden entirely.
            "serial_bound_ms": float((tp + np.maximum(r.copy - r.stall, 0) + np.maximum(hidden_cpu, 0)).mean() * ms),
            "overlap_bound_ms": float(np.maximum(tp - r.stall, r.copy).mean() * ms),
            "cache_hit_rate": float(r.n_hits.sum() / executed) if self.config["cache_experts"] else 0.0,
            "prefetch_hit_rate": 0.0,
            "pred_recall": self.pred_recall,
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
            "gb_moved_per_token": float((r.moved.mean() if r.moved is not None else
                                         r.n_copied.sum(1).mean() * self.config["expert_bytes"]) / 1e9),
            "device_hit_rate": float(r.n_hits.sum() / executed),
            "ttft_ms": float(self.ttft * ms),
        }


