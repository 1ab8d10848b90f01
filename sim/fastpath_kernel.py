"""The compiled recurrence of :mod:`moesim.sim.fastpath` (imported lazily: numba is slow to import)."""

from __future__ import annotations

import numpy as np
from numba import njit

from moesim.jit import use_user_cache

use_user_cache()  # before the decorators: compiled code goes to the user cache, not the package


@njit(cache=True)
def recurrence(attn, demand, prefetch, target, experts, other, per, slow, wake, ends, copied, stalls):
    """For each link c (``per`` seconds per expert copy, compute ``slow`` times slower while
    the link copies, ``wake`` seconds to resume after a wait), fill ``ends``/``copied``/
    ``stalls`` [c, step]. Mirrors ``sim.engine.ComputeStream.run`` step for step: at each
    layer attention, then this layer's on-demand copies and the prefetch issued here (for
    layer ``target[layer]``) on one FIFO engine, a wait for this layer's copies, then the
    experts."""
    steps, layers = attn.shape
    C = per.size

    def run(t, work, link_free, sl):
        """When ``work`` seconds of compute started at ``t`` end (``Link.compute_end``)."""
        if sl == 1.0 or link_free <= t:
            return t + work
        busy = link_free - t
        if work * sl <= busy:
            return t + work * sl
        return link_free + work - busy / sl

    # Per link: compute-stream clock, copy-engine clock, when each layer's prefetch lands,
    # this step's stall and copy seconds. Links are the innermost loop: their recurrences are
    # independent, so the CPU overlaps them (measured ~2x over one link at a time).
    T = np.zeros(C)
    LF = np.zeros(C)
    RN = np.zeros((layers, C))
    ST = np.zeros(C)
    IS = np.zeros(C)
    for s in range(steps):
        RN[:, :] = 0.0
        ST[:] = 0.0
        IS[:] = 0.0
        for layer in range(layers):
            a, g = attn[s, layer], experts[s, layer]
            nd, nf, to = demand[s, layer], prefetch[s, layer], target[layer]
            for c in range(C):
                p, sl = per[c], slow[c]
                t = run(T[c], a, LF[c], sl)
                link_free = LF[c]
                ready = RN[layer, c]
                d = nd * p
                f = nf * p
                if d:
                    if link_free < t:
                        link_free = t
                    link_free += d
                    IS[c] += d
                    ready = link_free
                if f:
                    if link_free < t:
                        link_free = t
                    link_free += f
                    IS[c] += f
                    RN[to, c] = link_free
                if ready > t:  # wait for this layer's copies
                    ST[c] += ready + wake[c] - t
                    t = ready + wake[c]
                T[c] = run(t, g, link_free, sl)
                LF[c] = link_free
        for c in range(C):
            T[c] = run(T[c], other[s], LF[c], slow[c])
            ends[c, s] = T[c]
            copied[c, s] = IS[c]
            stalls[c, s] = ST[c]
