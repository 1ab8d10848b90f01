"""Turn a trace and a policy into per-layer work: how many experts to copy ahead, copy on
demand and execute at every (step, MoE layer).

The decisions come from :class:`moesim.policy.Planner`, the same object the executor
drives; this module only counts them. Plans depend on routing and policy, not on
hardware, so a what-if sweep builds each plan once and times it on every profile.
"""

from __future__ import annotations

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

    @property
    def loads(self) -> np.ndarray:
        """Experts copied host-to-device per step and layer."""
        return self.prefetch + self.demand


def _sets(ids: np.ndarray) -> list[list[list[int]]]:
    """[t, m, b, k] ids -> per (t, m) the ordered union over the batch (-1 dropped)."""
    t, m, b, k = ids.shape
    flat = ids.reshape(t, m, b * k).tolist()
    return [[[e for e in dict.fromkeys(row) if e >= 0] for row in layer] for layer in flat]


def build_plan(trace: Trace, policy: Policy | str, cache_experts: int = 0, eviction: str = "lru") -> Plan:
    policy = get_policy(policy) if isinstance(policy, str) else policy
    t, m, b, k = trace.true_ids.shape
    true = _sets(trace.true_ids)
    pred = true if policy.oracle else _sets(trace.pred_ids)
    planner = Planner(policy, cache_experts, eviction)
    counts = np.zeros((6, t, m), np.int32)
    for step in range(t):
        tr, pr = true[step], pred[step]
        for layer in range(m):
            # The first MoE layer has no earlier router to predict from; it is on demand.
            plan = planner.route(layer, tr[layer], pr[layer] if layer > 0 and pr[layer] else None)
            if layer + 1 < m:  # layer+1's prediction exists once this router ran
                counts[0, step, layer + 1] = len(planner.prefetch(layer + 1, pr[layer + 1] or None))
            planner.finish(layer, plan)
            counts[1:, step, layer] = (len(plan.demand), len(plan.execute), b * k,
                                       plan.cache_hits, plan.prefetch_hits)
    return Plan(policy, cache_experts, eviction, *counts)
