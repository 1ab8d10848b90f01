"""The input both timing engines share: per-step, per-layer work in seconds and experts.

A :class:`Workload` is a plan laid over the model's layers with compute times attached;
a :class:`Link` is the host-to-device copy engine. The SimPy model and the fast path
take exactly these two and must agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from moesim.hardware import HardwareProfile
from moesim.models import ModelSpec
from moesim.sim.costs import Costs
from moesim.sim.plan import Plan


@dataclass(frozen=True)
class Link:
    """Host-to-device copies: one FIFO engine, each expert a transfer of
    ``latency + expert_bytes / bandwidth`` seconds (one contiguous buffer per expert)."""

    bandwidth: float  # bytes/s
    latency: float  # seconds per transfer
    expert_bytes: int
    interference: float = 0.0  # compute runs (1 + interference) times slower while the link copies
    wakeup: float = 0.0  # seconds from a copy landing to a stream that waited on it resuming

    @property
    def per_expert(self) -> float:
        """Seconds one expert's copy occupies the link: the one definition of copy time."""
        return self.latency + self.expert_bytes / self.bandwidth

    def copy_time(self, n_experts: int | float) -> float:
        """Seconds ``n_experts`` back-to-back expert copies occupy the link (decode and prefill)."""
        return n_experts * self.per_expert

    @classmethod
    def from_profile(cls, hw: HardwareProfile, spec: ModelSpec) -> Link:
        return cls(hw.link_bw, hw.transfer_latency, spec.expert_bytes, hw.interference, hw.get("wait_wakeup_us") * 1e-6)

    def compute_end(self, t: float, work: float, link_free: float) -> float:
        """When ``work`` seconds of compute started at ``t`` end, if it runs slower while the
        link is busy until ``link_free`` (no copy is issued in between, so the link is busy
        on [t, link_free) and idle after)."""
        slow = 1.0 + self.interference
        if slow == 1.0 or link_free <= t:
            return t + work
        busy = link_free - t
        if work * slow <= busy:
            return t + work * slow
        return link_free + work - busy / slow


@dataclass(frozen=True)
class Workload:
    """Arrays over [step, model layer] (``other`` over steps).

    At layer l of step t the compute stream runs ``attn`` (attention and router), then
    issues ``demand`` expert copies for layer l and ``prefetch_next`` copies for the next
    layer, waits for layer l's copies, and runs ``experts`` seconds of expert compute.
    """

    attn: np.ndarray
    experts: np.ndarray
    demand: np.ndarray
    prefetch_next: np.ndarray
    other: np.ndarray
    compute_source: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.attn.shape

    @functools.cached_property
    def compute_per_token(self) -> np.ndarray:
        return self.attn.sum(1) + self.experts.sum(1) + self.other


def make_workload(spec: ModelSpec, plan: Plan, costs: Costs) -> Workload:
    t, n_layers = costs.attn.shape
    moe = list(spec.moe_layers)
    experts = np.zeros((t, n_layers))
    demand = np.zeros((t, n_layers), np.int32)
    prefetch_next = np.zeros((t, n_layers), np.int32)
    experts[:, moe] = costs.expert_compute(plan.execute, plan.assign)
    demand[:, moe] = plan.demand
    for m in range(1, len(moe)):
        # Layer m's prefetch is issued at the end of the model layer just before it.
        prefetch_next[:, moe[m] - 1] = plan.prefetch[:, m]
    return Workload(costs.attn, experts, demand, prefetch_next, costs.other, costs.source)
