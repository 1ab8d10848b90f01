"""The compiled recurrence of :mod:`moesim.sim.fastpath` (imported lazily: numba is slow to import)."""

from __future__ import annotations

from numba import njit


@njit(cache=True)
def recurrence(attn, demand, prefetch, experts, other, per, slow, wake, ends, copied, stalls):
    """For each link c (``per`` seconds per expert copy, compute ``slow`` times slower while
    the link copies, ``wake`` seconds to resume after a wait), fill ``ends``/``copied``/
    ``stalls`` [c, step]. Mirrors ``sim.engine.ComputeStream.run`` step for step."""
    steps, layers = attn.shape

    def run(t, work, link_free, sl):
        """When ``work`` seconds of compute started at ``t`` end (``Link.compute_end``)."""
        if sl == 1.0 or link_free <= t:
            return t + work
        busy = link_free - t
        if work * sl <= busy:
            return t + work * sl
        return link_free + work - busy / sl

    for c in range(per.size):
        p, sl, wk = per[c], slow[c], wake[c]
        t = link_free = 0.0
        for s in range(steps):
            stalled = ready_next = issued = 0.0  # ready_next: when the next layer's prefetch lands
            for layer in range(layers):
                t = run(t, attn[s, layer], link_free, sl)
                ready = ready_next
                d = demand[s, layer] * p
                f = prefetch[s, layer] * p
                if d:
                    if link_free < t:
                        link_free = t
                    link_free += d
                    issued += d
                    ready = link_free  # FIFO: lands after this layer's prefetch too
                if f:
                    if link_free < t:
                        link_free = t
                    link_free += f
                    issued += f
                    ready_next = link_free
                else:
                    ready_next = 0.0
                if ready > t:
                    stalled += ready + wk - t
                    t = ready + wk
                t = run(t, experts[s, layer], link_free, sl)
            t = run(t, other[s], link_free, sl)
            ends[c, s] = t
            copied[c, s] = issued
            stalls[c, s] = stalled
