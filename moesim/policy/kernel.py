"""The :class:`moesim.policy.Planner`'s per-layer decisions over a whole trace, compiled.

One function replays exactly what ``Planner.prefetch``/``route``/``finish`` decide, layer
by layer, and keeps only the counts the simulator needs. ``tests/test_policy.py`` holds
it to the per-layer methods on random traces, every policy, both evictions and cache
sizes from none to larger than the model, so the Planner stays the single source of the
decisions; this is its batch form, not a second policy.

Why numba and not numpy: without a cache every layer is independent and numpy could do
it, but the cross-token cache is a recurrence (what layer l keeps decides layer l's hits
a step later), so it is a loop either way; one compiled loop serves both cases at
~10-50 M layer-steps/s, where the Python methods manage ~25 k. Imported lazily: numba
costs ~0.4 s to import and the first call loads the compiled code from numba's cache.

State layout (keys are ``layer * n_experts + expert``):

- ``resident``/``count``/``last``: the cache's members, use counts and tick of last use;
- LFU: an indexed binary heap (``pos[key]`` = its index) holding each resident key once,
  ordered by ``(count, tick of last use)``; a use raises its key's priority in place, so
  there are no stale entries (ExpertCache cleans its heap lazily instead: the same order);
- LRU: a queue of ``(tick, key)`` entries in push order, which is tick order, so its
  first live entry is the least recently used key (OrderedDict order) at O(1) a pop;
- ``prot``: keys a prefetch relied on (cached, so not copied) until their layer ran.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moesim.jit import use_user_cache

use_user_cache()  # before the decorators: compiled code goes to the user cache, not the package

TICK_BITS = 40  # a heap priority is (use count << TICK_BITS) | tick of last use: ~1e12 uses per trace
TICK_MASK = (1 << TICK_BITS) - 1


@njit(cache=True, nogil=True)  # nogil: callers may plan several policies on threads
def plan_steps(tr, pr, out, offload, prefetch, speculative, lookahead, cap, lfu, n_exp, state, resident, count, last,
               prot, inuse, pos, hp, hk, per_layer, size_l, pinned):
    """Decide steps ``tr.shape[0]`` of a trace; ``tr``/``pr`` are [steps, moe layers, batch*top_k]
    expert ids (-1 = none), ``out`` [7, steps, layers] receives (prefetch, demand, execute,
    assign, cache_hits, prefetch_hits, prefetch_need). Layer l's prefetch is issued at layer
    ``l - lookahead``'s router (``Planner.issue_layer``). ``state`` = [tick, heap size or queue
    end, cache size, stamp, queue start] carries over between calls (chunks of one trace), as
    ``size_l`` (each layer's cache size when ``per_layer``: a cache of ``cap`` experts per
    layer, its victim found by a scan of the layer's keys). ``pinned`` keys are always on
    the device (a hot set): hits, never copied, never cached or evicted."""
    steps, m, bk = tr.shape
    tick, hs, size, stamp, head = state[0], state[1], state[2], state[3], state[4]
    tu = np.empty(bk, np.int64)
    pcur = np.empty(bk, np.int64)
    pnext = np.empty(bk, np.int64)
    mark = np.zeros(n_exp, np.int64)
    slot = np.zeros(m * n_exp, np.int64)  # slot[key] == layer_sid[layer]: prefetched into that layer's slots
    slotpos = np.zeros(m * n_exp, np.int64)  # ... as its prefetch's slotpos[key]-th copy
    layer_sid = np.full(m, -1, np.int64)  # this step's prefetch of each layer (-1: none issued)
    skipped = np.empty(hp.size, np.int64)
    skipped_p = np.empty(hp.size, np.int64)
    protected = np.empty((m, bk), np.int64)  # keys each layer's prefetch protected until the layer ran
    n_prot = np.zeros(m, np.int64)

    # Heap and set helpers are closures, which numba inlines: separate jitted functions
    # taking arrays cost ~100 ns a call here (measured), ten times the work they do. One
    # int64 priority per entry, (count << 40) | tick, and "hole" sifts keep a pop ~3x cheaper
    # than tuple comparisons and swaps.
    def sift_down(i, n):
        """Move entry i down to its place in heap [0, n); ``pos`` follows every key (LFU)."""
        p, k = hp[i], hk[i]
        while True:
            a = 2 * i + 1
            if a >= n:
                break
            if a + 1 < n and hp[a + 1] < hp[a]:
                a += 1
            if hp[a] >= p:
                break
            hp[i], hk[i] = hp[a], hk[a]
            pos[hk[i]] = i
            i = a
        hp[i], hk[i] = p, k
        pos[k] = i

    def sift_up(i):
        p, k = hp[i], hk[i]
        while i > 0:
            parent = (i - 1) >> 1
            if hp[parent] <= p:
                break
            hp[i], hk[i] = hp[parent], hk[parent]
            pos[hk[i]] = i
            i = parent
        hp[i], hk[i] = p, k
        pos[k] = i

    def pop_root(n):
        """Remove the heap's smallest entry; returns the new size."""
        n -= 1
        if n > 0:
            hp[0], hk[0] = hp[n], hk[n]
            sift_down(0, n)
        return n

    def compact():
        """Rebuild the LRU queue in tick order from the resident keys only (drops stale entries)."""
        n = 0
        for key in range(resident.size):
            if resident[key]:
                hp[n], hk[n] = last[key], key
                n += 1
        order = np.argsort(hp[:n])
        ticks, keys = hp[:n][order], hk[:n][order]
        hp[:n], hk[:n] = ticks, keys
        return n

    def dedup(ids, s, layer, out, stamp):
        """Ordered distinct non-negative ids of ``ids[s, layer]`` into ``out``; returns how many."""
        n = 0
        for j in range(bk):
            e = ids[s, layer, j]
            if e >= 0 and mark[e] != stamp:
                mark[e] = stamp
                out[n] = e
                n += 1
        return n

    sid = 0
    for s in range(steps):
        layer_sid[:] = -1
        for layer in range(m):
            cur_sid = layer_sid[layer]
            have_cur = cur_sid >= 0
            stamp += 1
            nt = dedup(tr, s, layer, tu, stamp)
            n_pred = 0
            if speculative and have_cur and layer >= lookahead:  # only route() reads it, and only then
                stamp += 1
                n_pred = dedup(pr, s, layer, pcur, stamp)
            # route(): the speculative policy runs the prediction it prefetched.
            ex = pcur if (speculative and n_pred > 0 and have_cur) else tu
            nx = n_pred if (speculative and n_pred > 0 and have_cur) else nt
            out[2, s, layer] = nx
            out[3, s, layer] = bk
            if not offload:
                continue
            base = layer * n_exp
            hits = demand = pf_hits = need = 0
            for j in range(nx):
                e = ex[j]
                if have_cur and slot[base + e] == cur_sid:
                    pf_hits += 1
                    need = max(need, slotpos[base + e] + 1)
                elif resident[base + e] or pinned[base + e]:
                    hits += 1
                else:
                    demand += 1
            out[1, s, layer] = demand
            out[4, s, layer] = hits
            out[5, s, layer] = pf_hits
            out[6, s, layer] = need
            # prefetch(layer + lookahead): copy the predicted experts the cache does not hold.
            nxt = layer + lookahead
            if prefetch and nxt < m:
                stamp += 1
                nn = dedup(pr, s, nxt, pnext, stamp)
                n_prot[nxt] = 0
                if nn > 0:
                    sid += 1
                    layer_sid[nxt] = sid
                    loads = 0
                    nbase = nxt * n_exp
                    for j in range(nn):
                        e = pnext[j]
                        if pinned[nbase + e]:
                            continue  # on the device for good: nothing to copy or protect
                        if resident[nbase + e]:
                            prot[nbase + e] = True
                            protected[nxt, n_prot[nxt]] = nbase + e
                            n_prot[nxt] += 1
                        else:
                            slot[nbase + e] = sid
                            slotpos[nbase + e] = loads
                            loads += 1
                    out[0, s, nxt] = loads
            # finish(layer): release its protection, let the cache keep what ran.
            if cap > 0:
                for j in range(n_prot[layer]):
                    prot[protected[layer, j]] = False
                n_prot[layer] = 0
                new = 0
                for j in range(nx):
                    key = base + ex[j]
                    inuse[key] = True
                    if not resident[key] and not pinned[key]:
                        new += 1
                if per_layer:
                    # One cache a layer: its least recently (LRU) or least often, then least
                    # recently (LFU) used unprotected key, found by a scan of the layer.
                    while size_l[layer] + new > cap:
                        victim = -1
                        best = np.int64(0)
                        for e2 in range(n_exp):
                            key = base + e2
                            if resident[key] and not prot[key] and not inuse[key]:
                                pri = (count[key] << TICK_BITS) | last[key] if lfu else last[key]
                                if victim < 0 or pri < best:
                                    best = pri
                                    victim = key
                        if victim < 0:
                            break
                        resident[victim] = False
                        count[victim] = 0
                        size_l[layer] -= 1
                    room = cap - size_l[layer]
                    for j in range(nx):
                        key = base + ex[j]
                        inuse[key] = False
                        if pinned[key]:
                            continue
                        if resident[key] or room > 0:
                            if not resident[key]:
                                resident[key] = True
                                count[key] = 0
                                size_l[layer] += 1
                                room -= 1
                            tick += 1
                            count[key] += 1
                            last[key] = tick
                    continue
                while size + new > cap:
                    n_skip = 0
                    victim = -1
                    if lfu:  # the heap's smallest unprotected entry; protected ones are set aside
                        while hs > 0:
                            key = hk[0]
                            if prot[key] or inuse[key]:
                                skipped_p[n_skip], skipped[n_skip] = hp[0], key
                                n_skip += 1
                                hs = pop_root(hs)
                                continue
                            victim = key
                            hs = pop_root(hs)
                            break
                        for i in range(n_skip):
                            hp[hs], hk[hs] = skipped_p[i], skipped[i]
                            sift_up(hs)
                            hs += 1
                    else:  # LRU: ticks only grow, so the queue [head, hs) is in LRU order already
                        while head < hs:
                            key = hk[head]
                            head += 1
                            if not resident[key] or last[key] != hp[head - 1]:
                                continue  # stale
                            if prot[key] or inuse[key]:
                                skipped[n_skip] = head - 1
                                n_skip += 1
                                continue
                            victim = key
                            break
                        for i in range(n_skip - 1, -1, -1):  # back in front, in order (targets >= sources)
                            head -= 1
                            hp[head], hk[head] = hp[skipped[i]], hk[skipped[i]]
                    if victim < 0:
                        break
                    resident[victim] = False
                    count[victim] = 0
                    size -= 1
                room = cap - size
                for j in range(nx):
                    key = base + ex[j]
                    inuse[key] = False
                    if pinned[key]:
                        continue
                    if resident[key] or room > 0:
                        admitted = not resident[key]
                        if admitted:
                            resident[key] = True
                            count[key] = 0
                            size += 1
                            room -= 1
                        tick += 1
                        count[key] += 1
                        last[key] = tick
                        if lfu:  # one entry per resident key, its priority updated in place
                            if admitted:
                                hp[hs], hk[hs] = (count[key] << TICK_BITS) | tick, key
                                sift_up(hs)
                                hs += 1
                            else:
                                hp[pos[key]] = (count[key] << TICK_BITS) | tick
                                sift_down(pos[key], hs)
                        else:
                            if hs >= hp.size:
                                hs = compact()
                                head = 0
                            hp[hs], hk[hs] = tick, key
                            hs += 1
    state[0], state[1], state[2], state[3], state[4] = tick, hs, size, stamp, head
