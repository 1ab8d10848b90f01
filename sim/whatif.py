"""What-if sweeps: the cross product of models, hardware, policies, link bandwidths and
cache sizes, timed on one trace per model, on every core.

Work is grouped by (model, policy, cache): a group builds its plan once (the expensive,
hardware-independent part) and times it on every hardware profile and link bandwidth
with the fast path. Groups run in a process pool.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile
from moesim.models import ModelSpec
from moesim.policy import expert_slots, get_policy
from moesim.sim.plan import build_plan
from moesim.sim.simulate import cache_capacity, pick_costs, simulate
from moesim.traces.format import Trace

GOALS = {
    "tpot": ("tpot_ms", "lowest mean time per output token"),
    "p99": ("tpot_p99_ms", "lowest p99 time per output token"),
    "ttft": ("ttft_ms", "lowest time to first token"),
    "bytes": ("gb_moved_per_token", "fewest bytes over the host link per token"),
}


@dataclass(frozen=True)
class Sweep:
    traces: dict[str, Trace]  # model name -> trace
    hws: list[HardwareProfile]
    policies: list[str]
    link_gbps: list[float | None]  # None = the profile's own figure
    cache_gib: list[float]
    eviction: str = "lru"
    engine: str = "fast"
    timing: str = "auto"

    def __post_init__(self) -> None:
        for p in self.policies:
            get_policy(p)
        if any(g is not None and g <= 0 for g in self.link_gbps):
            raise MoesimError("link bandwidths must be positive GB/s")
        if any(c < 0 for c in self.cache_gib):
            raise MoesimError("cache sizes must be >= 0 GiB")

    @property
    def size(self) -> int:
        """Configurations the sweep times."""
        return len(self.groups()) * len(self.hws) * len(self.link_gbps)

    def groups(self) -> list[tuple[str, str, float]]:
        out = []
        for model, policy, cache in itertools.product(self.traces, self.policies, self.cache_gib):
            if not get_policy(policy).offload and (cache, model) != (self.cache_gib[0], model):
                continue  # all-resident ignores the cache: one row is enough
            out.append((model, policy, cache))
        return out


def device_bytes_needed(spec: ModelSpec, policy: str, cache_experts: int, batch: int, context: int) -> int:
    """Device memory a configuration needs: resident weights, all experts (all-resident) or
    the expert slots the executor allocates (:func:`moesim.policy.expert_slots`: two whole
    layers for prefill plus the cross-token cache), and the KV cache at ``context`` tokens."""
    kv = batch * context * spec.n_layers * spec.kv_bytes_per_token_layer
    if not get_policy(policy).offload:
        return spec.non_expert_bytes + spec.all_expert_bytes + kv
    return spec.non_expert_bytes + expert_slots(spec, policy, cache_experts) * spec.expert_bytes + kv


def _run_group(sweep: Sweep, model: str, policy: str, cache_gib: float) -> list[dict[str, Any]]:
    trace = sweep.traces[model]
    spec = trace.model
    capacity = cache_capacity(spec, cache_gib) if get_policy(policy).offload else 0
    plan = build_plan(trace, policy, capacity, sweep.eviction)
    rows = []
    for hw in sweep.hws:
        costs = pick_costs(trace, spec, hw, sweep.timing)
        for gbps in sweep.link_gbps:
            r = simulate(trace, hw, policy, cache_experts=capacity, eviction=sweep.eviction,
                         engine=sweep.engine, link_gbps=gbps, plan=plan, costs=costs)
            row = r.summary()
            row["cache_gib"] = cache_gib if capacity else 0.0  # as asked; cache_experts is what fits
            need = device_bytes_needed(spec, policy, capacity, trace.batch, trace.prompt_len + trace.n_tokens)
            row["device_gb_needed"] = need / 1e9
            row["fits"] = need <= hw["device_memory_gb"] * 1e9
            rows.append(row)
    return rows


_WORKER_SWEEP: Sweep | None = None


def _init_worker(sweep: Sweep) -> None:
    global _WORKER_SWEEP
    _WORKER_SWEEP = sweep


def _worker(group: tuple[str, str, float]) -> list[dict[str, Any]]:
    assert _WORKER_SWEEP is not None
    return _run_group(_WORKER_SWEEP, *group)


def run_sweep(sweep: Sweep, jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """All rows of the sweep, in a stable order; ``progress(done, total)`` after each group."""
    groups = sweep.groups()
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(groups)))
    results: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    if jobs == 1:
        for i, g in enumerate(groups):
            results[g] = _run_group(sweep, *g)
            if progress:
                progress(i + 1, len(groups))
    else:
        with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(sweep,)) as pool:
            futures = {pool.submit(_worker, g): g for g in groups}
            for i, fut in enumerate(as_completed(futures)):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(i + 1, len(groups))
    return [row for g in groups for row in results[g]]


def best(rows: list[dict[str, Any]], goal: str = "tpot") -> dict[str, Any] | None:
    """The best row for ``goal`` among those that fit in device memory. The oracle is a
    bound, not a policy anyone can run, so it is never the answer."""
    if goal not in GOALS:
        raise MoesimError(f"unknown goal {goal!r}; known: {', '.join(GOALS)}")
    key = GOALS[goal][0]
    fitting = [r for r in rows if r["fits"] and not get_policy(r["policy"]).oracle]
    return min(fitting, key=lambda r: r[key]) if fitting else None
