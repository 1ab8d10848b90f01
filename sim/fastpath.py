"""The fast path: the SimPy model's pipeline as a per-layer recurrence, no event queue.

Two clocks carry the state: ``t``, when the compute stream is next free, and ``link``,
when the copy engine is next free. A copy issued at ``t`` lands at
``max(link, t) + n * per_expert``. Tests hold it to the SimPy model (``sim.engine``) on
every policy; sweeps use it because it is far faster.
"""

from __future__ import annotations

import numpy as np

from moesim.sim.workload import Link, Workload


def run_fast(w: Workload, link: Link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step (end time, copy-engine seconds issued, compute-stall seconds)."""
    per = link.per_expert
    demand_s, prefetch_s = w.demand * per, w.prefetch_next * per
    copied = demand_s.sum(1) + prefetch_s.sum(1)
    rows = zip(w.attn.tolist(), demand_s.tolist(), prefetch_s.tolist(), w.experts.tolist(), w.other.tolist())
    if link.interference or link.wakeup:
        return _run_interfered(w, link, demand_s.tolist(), prefetch_s.tolist(), copied)
    ends, stalls = [], []
    t = link_free = 0.0
    for attn, demand, prefetch, experts, other in rows:
        stalled = ready_next = 0.0  # ready_next: when the next layer's prefetch lands
        for a, d, f, g in zip(attn, demand, prefetch, experts):
            t += a
            ready = ready_next
            if d:
                if link_free < t:
                    link_free = t
                link_free += d
                ready = link_free  # FIFO: lands after this layer's prefetch too
            if f:
                if link_free < t:
                    link_free = t
                link_free += f
                ready_next = link_free
            else:
                ready_next = 0.0
            if ready > t:
                stalled += ready - t
                t = ready
            t += g
        t += other
        ends.append(t)
        stalls.append(stalled)
    return np.array(ends), copied, np.array(stalls)


def _run_interfered(w: Workload, link: Link, demand: list, prefetch: list, copied: np.ndarray):
    """The same recurrence with compute slowed while the link is busy and a wake-up delay
    after each wait (kept apart so the common case stays a tight loop)."""
    run, wake = link.compute_end, link.wakeup
    ends, stalls = [], []
    t = link_free = 0.0
    for attn, dem, pf, experts, other in zip(w.attn.tolist(), demand, prefetch, w.experts.tolist(), w.other.tolist()):
        stalled = ready_next = 0.0
        for a, d, f, g in zip(attn, dem, pf, experts):
            t = run(t, a, link_free)
            ready = ready_next
            if d:
                link_free = max(link_free, t) + d
                ready = link_free
            if f:
                link_free = max(link_free, t) + f
                ready_next = link_free
            else:
                ready_next = 0.0
            if ready > t:
                stalled += ready + wake - t
                t = ready + wake
            t = run(t, g, link_free)
        t = run(t, other, link_free)
        ends.append(t)
        stalls.append(stalled)
    return np.array(ends), copied, np.array(stalls)
