"""Turn a trace and a policy into per-layer work: how many experts to copy ahead, copy on
demand and execute at every (step, MoE layer).

The decisions come from :class:`moesim.policy.Planner`, the same object the executor
drives; this module only counts them. Plans depend on routing and policy, not on
hardware, so a what-if sweep builds each plan once and times it on every profile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moesim.policy import Planner, Policy, get_policy
from moesim.traces.format import Trace


@dataclass(frozen=True)
class Plan:
    """Counts per [step, MoE layer]; ``prefetch`` copies are issued at the previous layer's router."""

    policy: Policy
    cache_experts: int
    eviction: str
    prefetch: np.ndarray
    demand: np.ndarray
    execute: np.ndarray
    assign: np.ndarray  # token-expert pairs executed (batch x top-k)
    cache_hits: np.ndarray
    prefetch_hits: np.ndarray
    prefetch_need: np.ndarray  # the prefetch's first copies the layer waits for (moesim.policy.LayerPlan)

    @property
    def loads(self) -> np.ndarray:
        """Experts copied host-to-device per step and layer."""
        return self.prefetch + self.demand

    @functools.cached_property
    def totals(self) -> dict[str, float]:
        """Whole-trace figures every summary of this plan needs, computed once per plan
        (a sweep summarises one plan on every profile and link)."""
        return {"loads_per_token": float(self.loads.sum(1).mean()), "executed": float(self.execute.sum()),
                "cache_hits": float(self.cache_hits.sum()), "prefetch_hits": float(self.prefetch_hits.sum())}


def build_plan(trace: Trace, policy: Policy | str, cache_experts: int = 0, eviction: str = "lru",
               progress: Callable[[int, int], None] | None = None) -> Plan:
    """The plan of ``trace`` under ``policy``: :meth:`Planner.plan_trace`, the compiled batch
    form of the executor's per-layer calls (held identical to them by tests/test_policy.py).
    Memory: seven int32 counts per (step, MoE layer); ``progress(steps_done, steps)``."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    planner = Planner(policy, cache_experts, eviction)
    counts = planner.plan_trace(trace.true_ids, trace.pred_ids, trace.model.n_experts, progress)
    return Plan(policy, cache_experts, eviction, *counts)
