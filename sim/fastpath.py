"""The fast path: the SimPy model's pipeline as a per-layer recurrence, no event queue.

Two clocks carry the state: ``t``, when the compute stream is next free, and ``link``,
when the copy engine is next free. A copy issued at ``t`` lands at
``max(link, t) + n * per_expert``. Tests hold it to the SimPy model (``sim.engine``) on
every policy; sweeps use it because it is far faster.
"""

from __future__ import annotations

import numpy as np

from sim.workload import Link, Workload


def run_fast(w: Workload, link: Link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step (end time, copy-engine seconds issued, compute-stall seconds)."""
    per = link.per_expert
    demand_s, prefetch_s = w.demand * per, w.prefetch_next * per
    copied = demand_s.sum(1) + prefetch_s.sum(1)
    rows = zip(w.attn.tolist(), demand_s.tolist(), prefetch_s.tolist(), w.experts.tolist(), w.other.tolist())
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
