"""Offloading policies as plain decisions: what to copy, what to execute, what to keep.

Data in, data out, no timing and no tensors: the executor performs a :class:`Planner`'s
decisions with real copies and the simulator times the very same decisions, so
cross-validation tests the timing model rather than two re-implementations of a policy.

The life of one MoE layer ``l`` of one decode step, as both sides drive it:

1. ``prefetch(l, predicted)`` at the end of MoE layer ``l - N``'s router (``N`` = the
   planner's ``lookahead``, 1 by default): experts to copy ahead.
2. ``route(l, true, predicted)`` at the end of layer ``l``'s router: experts to copy now
   (misses) and experts to execute.
3. ``finish(l)`` after layer ``l``'s experts ran: the cross-token cache keeps what it will.
"""

from __future__ import annotations

import heapq
import os
import queue
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moesim.errors import MoesimError
from moesim.policy.families import EVICTIONS, Policy, check_lookahead, get_policy

if TYPE_CHECKING:  # a type only: the cost model imports the engines, whose profiles name policies
    from moesim.costmodel import ExpertTimes


Key = tuple[int, int]  # (layer, expert)


class ExpertCache:
    """Cross-token device cache of experts, keyed by (layer, expert), with LRU or LFU eviction.

    LFU breaks ties by least recent use. Keys in ``protect`` are never evicted: a plan
    that skipped copying an expert because it was cached relies on it staying there.
    """

    def __init__(self, capacity: int, eviction: str = "lru") -> None:
        if capacity < 0:
            raise MoesimError(f"cache capacity must be >= 0 experts, got {capacity}")
        if eviction not in EVICTIONS:
            raise MoesimError(f"unknown eviction policy {eviction!r}; known: {', '.join(EVICTIONS)}")
        self.capacity = capacity
        self.eviction = eviction
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._count: dict[Key, int] = {}
        self._last: dict[Key, int] = {}  # tick of each resident key's latest use
        self._heap: list[tuple[int, int, Key]] = []  # (count, tick, key), lazily cleaned
        self._tick = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[Key]:
        return list(self._lru)

    def room(self, layer: int | None = None) -> int:
        """Keys it can still admit (``layer``: for a per-layer cache, that layer's)."""
        return self.capacity - len(self._lru)

    def use(self, key: Key) -> None:
        """Record a use of a resident key, or admit it (evicting if full)."""
        if self.eviction == "lfu" and len(self._heap) > 4 * self.capacity + 64:
            # Drop stale heap entries, so memory stays O(capacity) over a long trace.
            self._heap = [(self._count[k], self._last[k], k) for k in self._lru]
            heapq.heapify(self._heap)
        self._tick += 1
        if key in self._lru:
            self._lru.move_to_end(key)
            self._count[key] += 1
        else:
            self._lru[key] = None
            self._count[key] = 1
        self._last[key] = self._tick
        if self.eviction == "lfu":
            heapq.heappush(self._heap, (self._count[key], self._tick, key))

    def evict_for(self, n_new: int, protect: set[Key], layer: int | None = None) -> list[Key]:
        """Evict until ``n_new`` more keys fit (``layer``: a per-layer cache's); returns the evicted keys."""
        evicted: list[Key] = []
        while len(self._lru) + n_new > self.capacity:
            victim = self._victim(protect)
            if victim is None:
                break
            del self._lru[victim]
            del self._count[victim]
            del self._last[victim]
            evicted.append(victim)
        return evicted

    def _victim(self, protect: set[Key]) -> Key | None:
        if self.eviction == "lru":
            return next((k for k in self._lru if k not in protect), None)
        skipped = []
        victim = None
        while self._heap:
            count, tick, key = heapq.heappop(self._heap)
            if self._last.get(key) != tick:
                continue  # stale: the key was used again since (or evicted; a re-admission has a new tick)
            if key in protect:
                skipped.append((count, tick, key))
                continue
            victim = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victim


class LayerCaches:
    """One :class:`ExpertCache` of ``capacity`` experts per MoE layer (mixtral-offloading's
    per-layer LRU): a layer's keys only ever evict each other. The same interface as one
    cache, so the planner and the executor use either."""

    def __init__(self, capacity: int, eviction: str = "lru") -> None:
        ExpertCache(capacity, eviction)  # the same checks
        self.capacity, self.eviction = capacity, eviction
        self._caches: dict[int, ExpertCache] = {}

    def _of(self, layer: int) -> ExpertCache:
        if layer not in self._caches:
            self._caches[layer] = ExpertCache(self.capacity, self.eviction)
        return self._caches[layer]

    def __contains__(self, key: Key) -> bool:
        return key[0] in self._caches and key in self._caches[key[0]]

    def __len__(self) -> int:
        return sum(len(c) for c in self._caches.values())

    def keys(self) -> list[Key]:
        return [k for layer in sorted(self._caches) for k in self._caches[layer].keys()]  # noqa: SIM118 (not a dict)

    def use(self, key: Key) -> None:
        self._of(key[0]).use(key)

    def room(self, layer: int | None = None) -> int:
        return self._of(layer).room() if layer is not None else self.capacity

    def evict_for(self, n_new: int, protect: set[Key], layer: int | None = None) -> list[Key]:
        if layer is None:
            raise MoesimError("a per-layer cache evicts for one layer")
        return self._of(layer).evict_for(n_new, protect)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does after its router: copy ``demand`` now, then run ``execute``."""

    demand: tuple[int, ...]
    execute: tuple[int, ...]
    cache_hits: int  # executed experts that were already in the cross-token cache
    prefetch_hits: int  # executed experts that a prefetch brought in
    # How many of the prefetch's first copies (in the order it issued them) the layer waits
    # for: 1 + the position of the last one it executes. A copy queue that lets the layer
    # go once its useful copies landed (demand-first, cancel-unstarted) waits this far.
    prefetch_need: int = 0


#: How a copy engine orders its queue (``moesim.sim.engine`` models them, the executor's
#: emulated links run them): ``fifo`` copies in issue order; ``demand-first`` serves a
#: layer's on-demand copies before queued prefetch copies, expert by expert;
#: ``cancel-unstarted`` also drops, at a layer's router, the unstarted tail of its prefetch
#: past the last expert it executes.
QUEUES = ("fifo", "demand-first", "cancel-unstarted")


def _kernel_ids(ids: np.ndarray) -> np.ndarray:
    """A chunk of expert ids as the planner's kernel is compiled for them: int16 (what the
    synthetic traces draw and ``moesim.sim.sweep`` compiles ahead), or wider for a model of
    more experts. A file's one-byte ids (traces/format.py's ``id_dtype``) are widened a chunk
    at a time, not compiled for again: a second ~7 s compile on a first ``whatif --trace``."""
    return ids.astype(np.promote_types(ids.dtype, np.int16), copy=False)


class Planner:
    """Online policy decisions for one decode stream (see the module docstring).

    ``cache_experts`` > 0 adds a cross-token cache of that many experts (``per_layer``: that
    many in EACH MoE layer, :class:`LayerCaches`); executed experts enter it after their
    layer ran. Without a cache every layer copies every expert it does not already hold in
    its slot sets. ``pinned`` (layer, expert) keys stay on the device for good (a hot set
    placed from a calibration trace): hits, never copied, never in the cache.
    ``lookahead`` = N: the prefetch of MoE layer ``l`` is issued at MoE layer ``l - N``'s
    router, from a prediction made there, so up to N prefetches are in flight
    (:meth:`issue_layer`); the first N MoE layers load on demand.
    """

    def __init__(self, policy: Policy | str, cache_experts: int = 0, eviction: str = "lru",
                 lookahead: int = 1, per_layer: bool = False, pinned: Iterable[Key] = ()) -> None:
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        if self.policy.uses_host:  # planning it as a copy policy would be a silently wrong answer
            raise MoesimError(f"policy {self.policy.name!r} computes experts on the CPU: it is planned by "
                              "moesim.policy.placement.HostPlanner (moesim.sim.simulate / the executor's host experts)")
        self.lookahead = check_lookahead(lookahead)
        self.per_layer = per_layer
        self.pinned = frozenset((int(a), int(b)) for a, b in pinned)
        if self.pinned and not self.policy.offload:
            raise MoesimError("a pinned hot set is for the policies that copy experts; all-resident holds them all")
        if cache_experts > 0 and self.policy.caches:  # all-resident keeps no cache: it holds every expert
            self.cache = LayerCaches(cache_experts, eviction) if per_layer else ExpertCache(cache_experts, eviction)
        else:
            self.cache = None
        self._slots: dict[int, dict[int, int]] = {}  # layer -> {expert prefetched into its slots: issue position}
        self._protect: set[Key] = set()

    def _cached(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.pinned or (self.cache is not None and (layer, expert) in self.cache)

    def holds(self, layer: int, expert: int) -> bool:
        """Whether the device keeps (layer, expert) after its layer ran: cached or pinned
        (the executor frees every other slot)."""
        return self._cached(layer, expert)

    def issue_layer(self, layer: int) -> int | None:
        """The MoE layer at whose router ``layer``'s prefetch is issued, or None (no prefetch):
        the one place that says how far ahead a prefetch looks. Executor, planner, workload
        and both timing engines take it from here."""
        if not (self.policy.offload and self.policy.prefetch):
            return None
        src = layer - self.lookahead
        return src if src >= 0 else None

    def prefetch_target(self, layer: int, n_moe_layers: int) -> int | None:
        """The MoE layer whose prefetch is issued at ``layer``'s router, or None."""
        if not (self.policy.offload and self.policy.prefetch):
            return None
        dst = layer + self.lookahead
        return dst if dst < n_moe_layers else None

    def prefetch(self, layer: int, predicted: Iterable[int] | None) -> list[int]:
        """Experts to copy now, ahead of ``layer``; ``predicted`` is None where no prediction ran."""
        if not (self.policy.offload and self.policy.prefetch) or predicted is None:
            return []
        want = list(dict.fromkeys(predicted))
        load = [e for e in want if not self._cached(layer, e)]
        self._protect.update((layer, e) for e in want if self._cached(layer, e))
        self._slots[layer] = {e: i for i, e in enumerate(load)}
        return load

    def route(self, layer: int, true: Iterable[int], predicted: Iterable[int] | None) -> LayerPlan:
        """At ``layer``'s router: what to copy on demand and what to execute."""
        true = list(dict.fromkeys(true))
        slots = self._slots.get(layer, {})
        if self.policy.executes_predicted and predicted is not None and layer in self._slots:
            execute = list(dict.fromkeys(predicted))
        else:
            execute = true
        if not self.policy.offload:
            return LayerPlan((), tuple(execute), 0, 0)
        cache_hits = sum(1 for e in execute if e not in slots and self._cached(layer, e))
        demand = tuple(e for e in execute if e not in slots and not self._cached(layer, e))
        prefetch_hits = sum(1 for e in execute if e in slots)
        need = max((slots[e] + 1 for e in execute if e in slots), default=0)
        return LayerPlan(demand, tuple(execute), cache_hits, prefetch_hits, need)

    def finish(self, layer: int, plan: LayerPlan) -> tuple[list[int], list[Key]]:
        """After ``layer`` ran: release its slots and let the cache keep what it executed.

        Returns (experts of this layer the cache newly keeps, keys it evicted), so the
        executor knows which device buffers stay and which it may reuse.
        """
        self._slots.pop(layer, None)
        self._protect = {k for k in self._protect if k[0] != layer}
        if self.cache is None:
            return [], []
        execute = [e for e in plan.execute if (layer, e) not in self.pinned]
        new = [e for e in execute if (layer, e) not in self.cache]
        in_use = {(layer, e) for e in plan.execute}  # never evict what this layer just used
        evicted = self.cache.evict_for(len(new), self._protect | in_use, layer)
        room = self.cache.room(layer)
        admitted = []
        for e in execute:
            if (layer, e) in self.cache:
                self.cache.use((layer, e))
            elif room > 0:
                self.cache.use((layer, e))
                admitted.append(e)
                room -= 1
        return admitted, evicted

    # ----------------------------------------------------------------------------------
    # A whole trace at once: the counts the simulator times
    # ----------------------------------------------------------------------------------

    #: Rows of :meth:`plan_trace`'s result, each [step, MoE layer].
    COUNTS = ("prefetch", "demand", "execute", "assign", "cache_hits", "prefetch_hits", "prefetch_need")

    def _check_fresh(self, true_ids: np.ndarray, pred_ids: np.ndarray) -> None:
        if self._slots or self._protect or (self.cache is not None and len(self.cache)):
            raise MoesimError("plan_trace starts from an empty planner; make a new Planner per trace")
        if true_ids.ndim != 4 or pred_ids.shape != true_ids.shape:
            raise MoesimError(f"routing ids must both be [tokens, moe_layers, batch, top_k], got "
                              f"{true_ids.shape} and {pred_ids.shape}")

    def steps_alike(self, batch: int, capacity: int) -> bool:
        """Whether every step of a trace with distinct experts per row decides the same counts:
        at batch 1 each layer routes exactly top-k experts; with no cache and nothing pinned
        no decision depends on an earlier step; and a policy that copies or runs no prediction
        (on demand), or whose prediction is the truth (the oracle), then sees the same sets'
        sizes and overlaps every step, whichever experts they are (keys are per layer)."""
        pol = self.policy
        blind = not pol.offload or not (pol.prefetch or pol.executes_predicted)
        return batch == 1 and capacity == 0 and not self.pinned and (pol.oracle or blind)

    def plan_trace_stepwise(self, true_ids: np.ndarray, pred_ids: np.ndarray) -> np.ndarray:
        """The counts of :attr:`COUNTS` over a trace, by calling prefetch/route/finish per layer
        exactly as the executor does. The reference :meth:`plan_trace` is tested against;
        ~25 k layer-steps/s, so only for tests and small traces."""
        self._check_fresh(true_ids, pred_ids)
        t, m, b, k = true_ids.shape

        def sets(ids: np.ndarray) -> list[list[list[int]]]:
            flat = ids.reshape(t, m, b * k).tolist()  # per (step, layer): ordered union over the batch
            return [[[e for e in dict.fromkeys(row) if e >= 0] for row in layer] for layer in flat]

        true = sets(true_ids)
        pred = true if self.policy.oracle else sets(pred_ids)
        counts = np.zeros((len(self.COUNTS), t, m), np.int32)
        for step in range(t):
            tr, pr = true[step], pred[step]
            for layer in range(m):
                # The first N MoE layers have no router N layers earlier to predict from: on demand.
                ahead = self.issue_layer(layer) is not None
                plan = self.route(layer, tr[layer], pr[layer] if ahead and pr[layer] else None)
                nxt = self.prefetch_target(layer, m)
                if nxt is not None:  # layer nxt's prediction exists once this router ran
                    counts[0, step, nxt] = len(self.prefetch(nxt, pr[nxt] or None))
                self.finish(layer, plan)
                counts[1:, step, layer] = (len(plan.demand), len(plan.execute), b * k,
                                           plan.cache_hits, plan.prefetch_hits, plan.prefetch_need)
        return counts

    def plan_trace(self, true_ids: np.ndarray, pred_ids: np.ndarray, n_experts: int,
                   progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """The same counts as :meth:`plan_trace_stepwise`, decided by one compiled loop
        (``moesim.policy.kernel``) that makes the per-layer methods' decisions: identical
        results (property-tested), ~1,000x faster. ``progress(steps_done, steps)`` is called
        between chunks. The planner's own cache object is not updated (the kernel keeps the
        cache in arrays); use a fresh Planner per trace."""
        return np.stack(self.plan_rows(true_ids, pred_ids, n_experts, progress))

    def plan_rows(self, true_ids: np.ndarray, pred_ids: np.ndarray, n_experts: int,
                  progress: Callable[[int, int], None] | None = None, distinct: bool = False) -> list[np.ndarray]:
        """:meth:`plan_trace`'s counts as one [step, MoE layer] array per row of :attr:`COUNTS`,
        a row that holds one value everywhere (a policy's zeros, top-k executed at batch 1)
        being a read-only broadcast of it: what :func:`moesim.sim.plan.build_plan` keeps
        (a 100,000-token Qwen3-30B-A3B plan: 134 MB as one array, 19 MB a row).

        ``distinct``: the caller vouches that no row of ``true_ids`` names an expert twice (a
        :class:`~moesim.traces.format.Trace`'s, which its checks refuse otherwise). Then, where
        every step decides the same counts (:meth:`steps_alike`), one step is planned and
        broadcast to all (each row a read-only view)."""
        self._check_fresh(true_ids, pred_ids)
        from moesim.policy import kernel as kern  # numba: compiled on first use, not at import

        t, m, b, k = true_ids.shape
        if true_ids.size and (true_ids.max() >= n_experts or pred_ids.max() >= n_experts):
            raise MoesimError(f"routing ids must be < n_experts ({n_experts})")
        tr = np.ascontiguousarray(true_ids.reshape(t, m, b * k))
        pr = tr if self.policy.oracle else np.ascontiguousarray(pred_ids.reshape(t, m, b * k))
        keys = m * n_experts
        # A cache that holds every (layer, expert) never evicts: a larger one behaves the same
        # and must not size the heap (a 1e12 GiB what-if would allocate terabytes).
        cap = min(self.cache.capacity, n_experts if self.per_layer else keys) if self.cache is not None else 0
        resident, inuse, prot, pinned = (np.zeros(keys, np.bool_) for _ in range(4))
        for layer, e in self.pinned:
            if layer < m and e < n_experts:
                pinned[layer * n_experts + e] = True
        size_l = np.zeros(m, np.int64)
        count, last, pos = (np.zeros(keys, np.int64) for _ in range(3))
        heap = [np.zeros(max(4 * cap, keys) + 64 if cap else 1, np.int64) for _ in range(2)]  # priorities, keys
        state = np.zeros(5, np.int64)
        lfu = self.cache is not None and self.cache.eviction == "lfu"
        offload = self.policy.offload
        chunk = max(1, PLAN_CHUNK // max(1, m * b * k))  # steps per call: progress ~ every 0.1 s
        rows = _Rows(len(self.COUNTS), t, m)

        # Each call decides into a scratch block, copied into the rows in step order; the blocks
        # are reused (fresh ones a call leave freed memory the allocator keeps, ~50 MB a plan).
        free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()

        def run(s0: int, s1: int, state: np.ndarray) -> tuple[int, int, np.ndarray]:
            try:
                buf = free.get_nowait()
            except queue.Empty:
                buf = None
            if buf is None or buf.shape[1] != s1 - s0:
                # A block the chunk's own length, never a slice of a longer one: the kernel then
                # always sees a C-contiguous array and is compiled once (a slice compiled a second
                # specialisation, about a third of a first run's 30 s).
                buf = np.empty((len(self.COUNTS), s1 - s0, m), np.int32)
            buf[...] = 0
            kern.plan_steps(_kernel_ids(tr[s0:s1]), _kernel_ids(pr[s0:s1]), buf, offload, offload and self.policy.prefetch,
                            self.policy.executes_predicted, self.lookahead, cap, lfu, n_experts, state, resident, count,
                            last, prot, inuse, pos, *heap, self.per_layer, size_l, pinned)
            return s0, s1, buf

        if distinct and t and self.steps_alike(b, cap):
            one = run(0, 1, state)[2][:, 0].copy()  # [counts, MoE layers]
            if progress is not None:
                progress(t, t)
            return [np.broadcast_to(np.int32(r[0]) if (r == r[0]).all() else r, (t, m)) for r in one]
        spans = [(s0, min(t, s0 + chunk)) for s0 in range(0, t, chunk)]
        workers = min(len(spans), _plan_threads())
        if cap == 0 and workers > 1:
            # Without a cache no decision outlives its step (the slots are the step's; nothing
            # is resident, so nothing is protected or evicted): chunks of steps are independent
            # and run on threads (the kernel releases the GIL), each from a fresh state. Same
            # counts as one pass (tests/test_speed_plan.py).
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(workers)
            try:
                for s0, s1, buf in pool.map(lambda sp: run(*sp, np.zeros(5, np.int64)), spans):  # in step order
                    rows.put(s0, s1, buf)
                    free.put(buf)
                    if progress is not None:
                        progress(s1, t)
            finally:  # Ctrl-C (or a failing progress callback) drops the chunks not started
                pool.shutdown(cancel_futures=True)
            return rows.rows()
        for s0, s1 in spans:
            s0, s1, buf = run(s0, s1, state)
            rows.put(s0, s1, buf)
            free.put(buf)
            if progress is not None:
                progress(s1, t)
        return rows.rows()


class _Rows:
    """[step, layer] rows filled a chunk of steps at a time, in step order; a row stays one
    number (no array) for as long as every chunk holds only that number."""

    def __init__(self, n: int, t: int, m: int) -> None:
        self.shape = (t, m)
        self.value: list[int | None] = [None] * n
        self.full: list[np.ndarray | None] = [None] * n

    def put(self, s0: int, s1: int, out: np.ndarray) -> None:
        for i, block in enumerate(out):
            if self.full[i] is None:
                if not block.size:
                    continue
                lo, hi = int(block.min()), int(block.max())
                if lo == hi and self.value[i] in (None, lo):
                    self.value[i] = lo
                    continue
                self.full[i] = np.empty(self.shape, np.int32)
                self.full[i][:s0] = self.value[i] or 0
            self.full[i][s0:s1] = block

    def rows(self) -> list[np.ndarray]:
        return [f if f is not None else np.broadcast_to(np.int32(v or 0), self.shape)
                for f, v in zip(self.full, self.value)]


#: Expert slots (steps x MoE layers x batch x top-k) :meth:`Planner.plan_trace` decides per
#: kernel call: progress is reported between calls, and without a cache calls run on threads.
PLAN_CHUNK = 2_000_000


def _plan_threads() -> int:
    """Threads :meth:`Planner.plan_trace` may use: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------
# CPU or copy: the one decision of cpu-on-miss, shared by the simulator and the executor
# ---------------------------------------------------------------------------------------


def cpu_or_copy(miss_assign: list[int], hit_assign: int, n_hits: int, *, now: float, link_free: float,
                times: ExpertTimes) -> int:
    """How many of a layer's missed experts to copy; the rest run on the CPU.

    ``miss_assign`` holds each miss's token count, heaviest first: copied experts are
    taken from the front (a heavily routed expert gains most from the device's FLOPs),
    the CPU gets the light tail. Copying ``c`` of them lands at
    ``max(link_free, now) + c * copy`` (the link's queue at this moment), after which the
    device runs its hits and the copies; the CPU starts at ``now``. The answer minimises
    when the later of the two ends; ties go to fewer copies (the link stays free for the
    next layer). Greedy per layer: it does not weigh what a copy is worth to later tokens
    through the cache.
    """
    n = len(miss_assign)
    start = max(link_free, now)
    prefix = [0]
    for a in miss_assign:
        prefix.append(prefix[-1] + a)
    best_c, best_end = 0, float("inf")
    for c in range(n + 1):
        gpu_start = start + c * times.copy if c else now
        gpu_end = gpu_start + times.gpu(n_hits + c, hit_assign + prefix[c])
        cpu_end = now + times.cpu(n - c, prefix[n] - prefix[c])
        end = max(gpu_end, cpu_end)
        if end < best_end - 1e-15:
            best_c, best_end = c, end
    return best_c
