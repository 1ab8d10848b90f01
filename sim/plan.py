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

from moesim.errors import MoesimError
from moesim.policy import Planner, Policy, check_lookahead, get_policy
from moesim.traces.format import Trace


@dataclass(frozen=True)
class Plan:
    """Counts per [step, MoE layer]; ``prefetch[t, m]`` copies are issued at MoE layer
    ``m - lookahead``'s router (:meth:`moesim.policy.Planner.issue_layer`)."""

    policy: Policy
    cache_experts: int  # capacity: of the whole cache, or of each layer's (per_layer)
    eviction: str
    lookahead: int
    prefetch: np.ndarray
    demand: np.ndarray
    execute: np.ndarray
    assign: np.ndarray  # token-expert pairs executed (batch x top-k)
    cache_hits: np.ndarray
    prefetch_hits: np.ndarray
    prefetch_need: np.ndarray  # the prefetch's first copies the layer waits for (moesim.policy.LayerPlan)

    per_layer: bool = False  # one cache of cache_experts per MoE layer
    pinned: int = 0  # experts of a hot set pinned on the device (never copied)

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


def trace_lookahead(trace: Trace) -> int:
    """How many MoE layers ahead the trace's predictions were made (its header's ``lookahead``)."""
    return int(trace.header.get("lookahead", 1))


def plan_lookahead(trace: Trace, policy: Policy, lookahead: int | None) -> int:
    """The lookahead to plan ``policy`` with: ``lookahead``, else the trace's. A policy that
    prefetches from predictions needs predictions made that far ahead (the trace's own);
    the oracle reads the true routing, so any lookahead the model allows is fine."""
    recorded = trace_lookahead(trace)
    if lookahead is None:
        return recorded
    check_lookahead(lookahead, trace.model.n_moe_layers)
    if lookahead != recorded and policy.predicts:
        raise MoesimError(f"--lookahead {lookahead}: the trace's predictions were made {recorded} MoE layer"
                          f"{'s' if recorded != 1 else ''} ahead; record or synthesise it with --lookahead "
                          f"{lookahead} (only the oracle can look any distance ahead)")
    return lookahead


def build_plan(trace: Trace, policy: Policy | str, cache_experts: int = 0, eviction: str = "lru",
               progress: Callable[[int, int], None] | None = None, lookahead: int | None = None,
               per_layer: bool = False, pinned: tuple = ()) -> Plan:
    """The plan of ``trace`` under ``policy``: :meth:`Planner.plan_trace`, the compiled batch
    form of the executor's per-layer calls (held identical to them by tests/test_policy.py).
    Memory: up to seven int32 counts per (step, MoE layer), a count that is one number
    everywhere a read-only broadcast of it (:meth:`Planner.plan_rows`); ``progress(steps_done, steps)``;
    ``lookahead`` None: the trace's (:func:`plan_lookahead`); ``per_layer`` and ``pinned``
    as :class:`moesim.policy.Planner` has them."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    n = plan_lookahead(trace, policy, lookahead)
    planner = Planner(policy, cache_experts, eviction, n, per_layer, pinned)
    # constant rows: views; a Trace's rows never repeat an expert (traces.format.validate)
    counts = planner.plan_rows(trace.true_ids, trace.pred_ids, trace.model.n_experts, progress, distinct=True)
    return Plan(policy, cache_experts, eviction, n, *counts, per_layer=per_layer, pinned=len(planner.pinned))


@dataclass
class Step:
    """One speculative-decoding verification step as the simulator sees it: ``rows`` rows
    (the root and the verified candidates) sharing, per MoE layer, one union of true and
    one of predicted experts."""

    rows: int
    true_union: list[set[int]]  # per MoE layer
    pred_union: list[set[int]]
    produced: float  # tokens the step produced (accepted candidates + the bonus token); expected under a model


def plan_sets(true_sets: list[list[set[int]]], pred_sets: list[list[set[int]]], policy: Policy | str,
              cache_experts: int = 0, eviction: str = "lru", lookahead: int = 1) -> Plan:
    """The plan of steps given as expert SETS per [step][MoE layer] (speculative-decoding
    verification: a step's rows share one union), decided by the Planner's per-layer calls
    exactly as :meth:`Planner.plan_trace_stepwise` makes them. ``assign`` is left 0: the
    caller knows each step's token-expert pairs."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    planner = Planner(pol, cache_experts, eviction, lookahead)
    s_n = len(true_sets)
    m_n = len(true_sets[0]) if s_n else 0
    counts = np.zeros((len(Planner.COUNTS), s_n, m_n), np.int32)
    for s, (true, pred) in enumerate(zip(true_sets, pred_sets)):
        for m in range(m_n):
            ahead = planner.issue_layer(m) is not None
            plan = planner.route(m, sorted(true[m]), sorted(pred[m]) if ahead and pred[m] else None)
            nxt = planner.prefetch_target(m, m_n)
            if nxt is not None:
                counts[0, s, nxt] = len(planner.prefetch(nxt, sorted(pred[nxt]) or None))
            planner.finish(m, plan)
            counts[1:, s, m] = (len(plan.demand), len(plan.execute), 0, plan.cache_hits, plan.prefetch_hits,
                                plan.prefetch_need)
    return Plan(pol, cache_experts, eviction, lookahead, *counts)
