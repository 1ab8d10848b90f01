"""The compiled recurrence of :mod:`moesim.sim.fastpath` (imported lazily: numba is slow to import)."""

from __future__ import annotations

import numpy as np
from numba import njit

from moesim.jit import use_user_cache
from moesim.sim.workload import compute_end

use_user_cache()  # before the decorators: compiled code goes to the user cache, not the package

#: The interference formula, the SimPy engine's own (moesim.sim.workload.compute_end), inlined.
#: numba keys a cached kernel to this file, not to the functions it calls: this hash of that
#: function's source (held by tests/test_sim.py) makes a change there a change here, so the
#: cached recurrence is compiled again.
COMPUTE_END_SHA256 = "aeda1592d2457d166517f5ba7f434246bdaa8c9ebb1efda2bcd5222792ca6c2e"
_compute_end = njit(inline="always")(compute_end)


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
                t = _compute_end(T[c], a, LF[c], sl)
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
                T[c] = _compute_end(t, g, link_free, sl)
                LF[c] = link_free
        for c in range(C):
            T[c] = _compute_end(T[c], other[s], LF[c], slow[c])
            ends[c, s] = T[c]
            copied[c, s] = IS[c]
            stalls[c, s] = ST[c]
