"""The input both timing engines share: per-step, per-layer work in seconds and experts.

A :class:`Workload` is a plan laid over the model's layers with compute times attached;
a :class:`Link` is the host-to-device copy engine. The SimPy model and the fast path
take exactly these two and must agree. Neither says how far ahead a policy looks: a
workload carries explicit issue -> target pairs (the prefetch issued at layer l is for
layer ``target[l]``), so both engines and the executor are generic over the lookahead
(:meth:`moesim.policy.Planner.issue_layer` decides it, once).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moesim.costmodel import CostModel
from moesim.sim.costs import Costs
from moesim.sim.plan import Plan


@dataclass(frozen=True)
class Link:
    """Host-to-device copies: one engine, each expert one transfer of ``per_expert``
    seconds (the cost model's :meth:`~moesim.costmodel.CostModel.copy_expert`)."""

    per_expert: float  # seconds one expert's copy occupies the link
    interference: float = 0.0  # compute runs (1 + interference) times slower while the link copies
    wakeup: float = 0.0  # seconds from a copy landing to a stream that waited on it resuming

    def copy_time(self, n_experts: int | float) -> float:
        """Seconds ``n_experts`` back-to-back expert copies occupy the link (decode and prefill)."""
        return n_experts * self.per_expert

    @classmethod
    def of(cls, cm: CostModel) -> Link:
        """The copy engine of ``cm``'s GPU for its model."""
        hw = cm.gpu
        return cls(cm.copy_expert(), hw.interference, hw.get("wait_wakeup_us") * 1e-6)

    @classmethod
    def from_profile(cls, hw, spec) -> Link:
        """:meth:`of` the default cost model of ``spec`` on ``hw``."""
        return cls.of(CostModel(spec, hw))

    def compute_end(self, t: float, work: float, link_free: float) -> float:
        """:func:`compute_end` on this link."""
        return compute_end(t, work, link_free, 1.0 + self.interference)


def compute_end(t: float, work: float, link_free: float, slow: float) -> float:
    """When ``work`` seconds of compute started at ``t`` end, if it runs ``slow`` times slower
    while the link is busy until ``link_free`` (no copy is issued in between, so the link is
    busy on [t, link_free) and idle after). The one definition: the SimPy engine calls it
    through :meth:`Link.compute_end`, the compiled fast path as a jitted copy of this function
    (:mod:`moesim.sim.fastpath_kernel`)."""
    if slow == 1.0 or link_free <= t:
        return t + work
    busy = link_free - t
    if work * slow <= busy:
        return t + work * slow
    return link_free + work - busy / slow


@dataclass(frozen=True)
class Workload:
    """Arrays over [step, model layer] (``other`` over steps, ``target`` over layers).

    At layer l of step t the compute stream runs ``attn`` (attention and router), then
    issues ``demand`` expert copies for layer l and ``prefetch`` copies for layer
    ``target[l]`` (-1: none), waits for layer l's copies (its demand and the prefetch
    issued for it earlier; with a queue that lets it go early, only for the first
    ``need[t, l]`` of that prefetch), and runs ``experts`` seconds of expert compute.
    """

    attn: np.ndarray
    experts: np.ndarray
    demand: np.ndarray
    prefetch: np.ndarray
    target: np.ndarray
    need: np.ndarray
    other: np.ndarray
    compute_source: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.attn.shape

    @functools.cached_property
    def compute_per_token(self) -> np.ndarray:
        return self.attn.sum(1) + self.experts.sum(1) + self.other

    @classmethod
    def build(cls, attn: np.ndarray, experts: np.ndarray, demand: np.ndarray, other: np.ndarray, source: str,
              prefetch: np.ndarray | None = None, target: np.ndarray | None = None,
              need: np.ndarray | None = None) -> Workload:
        """A workload from per-layer arrays; without ``prefetch``, nothing is prefetched;
        without ``need``, a layer waits for its whole prefetch."""
        t, n_layers = attn.shape
        prefetch = np.zeros((t, n_layers), np.int32) if prefetch is None else prefetch.astype(np.int32)
        target = np.full(n_layers, -1, np.int64) if target is None else np.asarray(target, np.int64)
        if need is None:
            need = np.zeros((t, n_layers), np.int32)
            for src in np.flatnonzero(target >= 0):
                need[:, target[src]] = prefetch[:, src]
        return cls(attn, experts, demand.astype(np.int32), prefetch, target, need.astype(np.int32), other, source)


def prefetch_pairs(moe: tuple[int, ...], lookahead: int, prefetching: bool) -> np.ndarray:
    """``target[l]`` over model layers: the model layer whose prefetch is issued at model
    layer l's router (MoE layer m's prefetch at MoE layer ``m - lookahead``,
    :meth:`moesim.policy.Planner.issue_layer`), -1 where none is."""
    n_layers = (moe[-1] + 1) if moe else 0
    target = np.full(max(n_layers, 1), -1, np.int64)
    if prefetching:
        for m in range(lookahead, len(moe)):
            target[moe[m - lookahead]] = moe[m]
    return target


def lay_out(spec, plan: Plan, attn: np.ndarray, experts_moe: np.ndarray, other: np.ndarray, source: str) -> Workload:
    """A workload from ``plan``'s copies laid over ``spec``'s model layers and the compute
    given: ``attn`` [t, n_layers], ``experts_moe`` [t, moe layers] and ``other`` [t]."""
    t, n_layers = attn.shape
    moe = list(spec.moe_layers)
    pol, n = plan.policy, plan.lookahead
    prefetch = np.zeros((t, n_layers), np.int32)
    if moe == list(range(n_layers)):  # every layer routed: the plan's arrays are the layers' (no copy)
        experts = np.ascontiguousarray(experts_moe, float)
        demand, need = (np.ascontiguousarray(a, np.int32) for a in (plan.demand, plan.prefetch_need))
        if n < n_layers:
            prefetch[:, :n_layers - n] = plan.prefetch[:, n:]
    else:
        # A run of consecutive MoE layers (dense layers first, as DeepSeek's) is one slice, not a
        # column list (which numpy copies through an index map).
        cols = slice(moe[0], moe[-1] + 1) if moe and moe == list(range(moe[0], moe[-1] + 1)) else moe
        experts = np.zeros((t, n_layers))
        demand = np.zeros((t, n_layers), np.int32)
        need = np.zeros((t, n_layers), np.int32)
        experts[:, cols] = experts_moe
        demand[:, cols] = plan.demand
        for m in range(n, len(moe)):
            prefetch[:, moe[m - n]] = plan.prefetch[:, m]
        need[:, cols] = plan.prefetch_need
    target = np.full(n_layers, -1, np.int64)
    pairs = prefetch_pairs(spec.moe_layers, n, pol.prefetches)
    target[:pairs.size] = pairs
    return Workload(attn=attn, experts=experts, demand=demand, prefetch=prefetch, target=target, need=need,
                    other=other, compute_source=source)


def make_workload(spec, plan: Plan, costs: Costs) -> Workload:
    """The plan of a trace laid over its model's layers, timed by ``costs``."""
    return lay_out(spec, plan, costs.attn, costs.expert_compute(plan.execute, plan.assign), costs.other, costs.source)
