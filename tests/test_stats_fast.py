"""The compiled routing statistics (moesim.sim.stats) against the plain Python definitions
they replaced, kept here verbatim as the reference: on short random traces and random
access streams with ties (keys shared across batch rows, repeated groups, equal next
uses), every eviction policy, and cache sizes from none to more than every key."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hand_trace
from moesim.models import ModelSpec
from moesim.policy import ExpertCache
from moesim.sim import stats
from moesim.traces.metrics import recall_per_layer

# ---------------------------------------------------------------------------------------
# The reference: moesim.sim.stats as it was before it was compiled
# ---------------------------------------------------------------------------------------


def reference_expert_counts(trace) -> np.ndarray:
    t, m, b, k = trace.true_ids.shape
    e = trace.model.n_experts
    flat = trace.true_ids.transpose(1, 0, 2, 3).reshape(m, -1).astype(np.int64)
    return np.stack([np.bincount(row, minlength=e) for row in flat])


def reference_reuse_stats(trace) -> dict[str, Any]:
    ids = trace.true_ids.astype(np.intp)
    t, m, b, k = ids.shape
    e = trace.model.n_experts
    last = np.full((m, b, e), -1, np.int64)
    hist = np.zeros(stats.MAX_DISTANCE + 2, np.int64)
    never = 0
    overlap = np.zeros(m)
    for s in range(t):
        row = ids[s]
        prev = np.take_along_axis(last, row, -1)
        seen = prev >= 0
        never += int((~seen).sum())
        d = np.minimum(s - prev[seen], stats.MAX_DISTANCE + 1)
        hist += np.bincount(d, minlength=stats.MAX_DISTANCE + 2)
        if s:
            overlap += (prev == s - 1).sum((1, 2))
        np.put_along_axis(last, row, s, -1)
    pairs = max(t - 1, 1) * b * k
    total = hist.sum()
    cdf = np.cumsum(hist[1:]) / max(total, 1)
    median = int(np.searchsorted(cdf, 0.5) + 1) if total else None
    return {"reuse_prev_token": overlap / pairs, "distance_hist": hist[1:].tolist(), "first_uses": never,
            "median_distance": median if median is not None and median <= stats.MAX_DISTANCE else None}


def reference_adjacent_layer_overlap(trace) -> dict[str, Any]:
    ids = trace.true_ids
    t, m, b, k = ids.shape
    e = trace.model.n_experts
    if m < 2:
        return {"per_layer": [], "mean": float("nan"), "chance": k * k / e}
    shared = (ids[:, :-1, :, :, None] == ids[:, 1:, :, None, :]).any(-1).sum(-1)
    per = shared.mean((0, 2))
    return {"per_layer": per.tolist(), "mean": float(per.mean()), "chance": k * k / e}


def reference_access_groups(trace) -> list[list[int]]:
    t, m, b, k = trace.true_ids.shape
    e = trace.model.n_experts
    flat = (trace.true_ids.reshape(t, m, b * k).astype(np.int64) + (np.arange(m) * e)[None, :, None]).tolist()
    return [list(dict.fromkeys(row)) for step in flat for row in step]


def reference_online_hits(groups: Sequence[Sequence[int]], capacity: int, eviction: str) -> int:
    if capacity <= 0:
        return 0
    cache = ExpertCache(capacity, eviction)
    hits = 0
    for g in groups:
        keys = [(0, x) for x in g]
        present = [key in cache for key in keys]
        hits += sum(present)
        new = len(keys) - sum(present)
        cache.evict_for(new, set(keys))
        room = capacity - len(cache)
        for key, was in zip(keys, present, strict=True):
            if was:
                cache.use(key)
            elif room > 0:
                cache.use(key)
                room -= 1
    return hits


def reference_belady_hits(groups: Sequence[Sequence[int]], capacity: int) -> int:
    if capacity <= 0:
        return 0
    n = len(groups)
    nxt: list[list[int]] = [[] for _ in range(n)]
    upcoming: dict[int, int] = {}
    for gi in range(n - 1, -1, -1):
        nxt[gi] = [upcoming.get(x, n + 1) for x in groups[gi]]
        for x in groups[gi]:
            upcoming[x] = gi
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for gi, g in enumerate(groups):
        for x, nu in zip(g, nxt[gi], strict=True):
            if x in cached:
                hits += 1
            cached[x] = nu
            heapq.heappush(heap, (-nu, x))
        while len(cached) > capacity:
            neg, x = heapq.heappop(heap)
            if cached.get(x) == -neg:
                del cached[x]
    return hits


def reference_hit_rate_curve(trace, sizes: Sequence[int]) -> dict[str, Any]:
    groups = reference_access_groups(trace)
    accesses = sum(len(g) for g in groups)
    curve = {"sizes": list(sizes), "accesses": accesses}
    for name in ("lru", "lfu"):
        curve[name] = [reference_online_hits(groups, s, name) / accesses for s in sizes]
    curve["belady"] = [reference_belady_hits(groups, s) / accesses for s in sizes]
    return curve


# ---------------------------------------------------------------------------------------
# Random traces and streams
# ---------------------------------------------------------------------------------------


def random_trace(seed: int, tokens: int, layers: int, experts: int, top_k: int, batch: int, skew: float,
                 pred_share: float):
    """A trace of arbitrary routing: distinct experts per row drawn from a skewed law (so
    keys repeat across batch rows and steps), predictions on some rows (-1 padded)."""
    rng = np.random.default_rng(seed)
    top_k = min(top_k, experts)
    spec = ModelSpec("rnd", n_layers=layers, n_experts=experts, top_k=top_k, hidden=8, expert_inter=4, vocab=16)
    w = np.exp(-skew * np.log(np.arange(1, experts + 1)))
    w /= w.sum()
    true = np.empty((tokens, layers, batch, top_k), np.int16)
    pred = np.full_like(true, -1)
    for idx in np.ndindex(tokens, layers, batch):
        true[idx] = rng.choice(experts, top_k, replace=False, p=w)
        if idx[1] > 0 and rng.random() < pred_share:
            n = rng.integers(1, top_k + 1)
            pred[idx][:n] = rng.choice(experts, n, replace=False)
    t = hand_trace(spec, true=true[:, :, 0].tolist(), pred=pred[:, :, 0].tolist())
    if batch > 1:  # hand_trace is one sequence: put the batch back
        t.true_ids, t.pred_ids, t.exec_ids = true, pred, true.copy()
        t.true_gates = np.full(true.shape, 1 / top_k, np.float32)
        t.pred_gates = np.where(pred >= 0, t.true_gates, 0).astype(np.float32)
        t.prompt_ids, t.token_ids = np.zeros((batch, 0), np.int32), np.zeros((batch, tokens), np.int32)
        t.header["batch"] = batch
    return t


traces = st.builds(random_trace, seed=st.integers(0, 2**31), tokens=st.integers(1, 30), layers=st.integers(1, 4),
                   experts=st.integers(2, 12), top_k=st.just(1) | st.integers(1, 3), batch=st.integers(1, 3),
                   skew=st.sampled_from([0.0, 1.0, 3.0]), pred_share=st.sampled_from([0.0, 0.5, 1.0]))

# Groups of distinct keys from a small alphabet: ties in LFU counts, equal next uses, repeats.
groups_lists = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=5, unique=True), min_size=0, max_size=60)
# Longer streams over more keys: deeper caches, keys crossing many sizes at once.
wide_lists = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True), min_size=1, max_size=250)



def skewed_stream(seed: int, n: int, keys: int, width: int, skew: float) -> list[list[int]]:
    """``n`` groups of up to ``width`` distinct keys from a Zipf-like law over ``keys``."""
    rng = np.random.default_rng(seed)
    w = np.exp(-skew * np.log(np.arange(1, keys + 1)))
    w /= w.sum()
    return [rng.choice(keys, int(rng.integers(1, min(width, keys) + 1)), replace=False, p=w).tolist()
            for _ in range(n)]


# Long skewed streams: the cache kernel's queue of once-used keys fills and is compacted
# many times, LFU keys climb into its heap and are evicted from it (once the queue holds
# no live unprotected key), hot keys reach high counts.
long_lists = st.builds(skewed_stream, seed=st.integers(0, 2**31), n=st.integers(200, 1500),
                       keys=st.integers(5, 60), width=st.integers(1, 6), skew=st.sampled_from([0.0, 1.0, 2.0]))


# ---------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(groups=groups_lists | wide_lists, capacity=st.integers(0, 12) | st.integers(0, 45))
def test_online_and_belady_equal_the_reference_on_random_streams(groups, capacity):
    for ev in ("lru", "lfu"):
        assert stats.online_hits(groups, capacity, ev) == reference_online_hits(groups, capacity, ev), ev
    assert stats.belady_hits(groups, capacity) == reference_belady_hits(groups, capacity)


@settings(max_examples=40, deadline=None)
@given(groups=long_lists, capacity=st.integers(1, 64))
def test_online_equals_the_reference_on_long_skewed_streams(groups, capacity):
    for ev in ("lru", "lfu"):
        assert stats.online_hits(groups, capacity, ev) == reference_online_hits(groups, capacity, ev), ev


@settings(max_examples=80, deadline=None)
@given(groups=groups_lists | wide_lists, caps=st.lists(st.integers(0, 45), min_size=1, max_size=8))
def test_belady_at_many_sizes_in_one_pass_equals_one_reference_run_per_size(groups, caps):
    ids, n = stats._groups_stream(groups)
    hits = stats._belady_layer_hits(ids, n, caps).sum(0)
    assert hits.tolist() == [reference_belady_hits(groups, c) for c in caps]


@settings(max_examples=80, deadline=None)
@given(groups=groups_lists | wide_lists, caps=st.lists(st.integers(0, 45), min_size=1, max_size=8))
def test_lru_at_many_sizes_in_one_pass_equals_one_reference_run_per_size(groups, caps):
    """Mattson's stack algorithm: exact at every size holding a whole group (the curve
    routing_stats reports below that comes from a replay of the cache itself)."""
    ids, n = stats._groups_stream(groups)
    widest = max((len(g) for g in groups), default=0)
    caps = [c for c in caps if c >= widest]
    hits, acc, first = stats._lru_layer_hits(ids, n, caps)
    assert hits.sum(0).tolist() == [reference_online_hits(groups, c, "lru") for c in caps]
    assert acc.sum() == sum(len(g) for g in groups) and first.sum() == len({x for g in groups for x in g})


@settings(max_examples=40, deadline=None)
@given(trace=traces, data=st.data())
def test_every_statistic_equals_the_reference_on_random_traces(trace, data):
    total = trace.model.n_moe_layers * trace.model.n_experts
    sizes = sorted(set(data.draw(st.lists(st.integers(0, total + 3), min_size=1, max_size=6))) | {0, 1, total})
    fast = stats.hit_rate_curve(trace, sizes)
    ref = reference_hit_rate_curve(trace, sorted({min(s, total) for s in sizes}))  # a size above the model is the model
    for key in ("sizes", "accesses", "lru", "lfu", "belady"):
        assert fast[key] == ref[key], key
    assert bool(fast["notes"]) == (max(sizes) > total)
    per = fast["per_layer"]
    for name in ("lru", "lfu", "belady"):  # each layer's hits add up to the whole curve
        hits = np.nansum(np.array(per[name], float) * np.array(per["accesses"])[:, None], 0)
        np.testing.assert_allclose(hits / fast["accesses"], fast[name], rtol=1e-12, atol=1e-12)
    r, rr = stats.reuse_stats(trace), reference_reuse_stats(trace)
    assert r["distance_hist"] == rr["distance_hist"] and r["first_uses"] == rr["first_uses"]
    assert r["median_distance"] == rr["median_distance"]
    np.testing.assert_array_equal(r["reuse_prev_token"], rr["reuse_prev_token"])
    o, ro = stats.adjacent_layer_overlap(trace), reference_adjacent_layer_overlap(trace)
    assert o["per_layer"] == ro["per_layer"] and o["chance"] == ro["chance"]
    assert o["mean"] == ro["mean"] or (np.isnan(o["mean"]) and np.isnan(ro["mean"]))
    np.testing.assert_array_equal(stats.expert_counts(trace), reference_expert_counts(trace))
    np.testing.assert_array_equal(stats._routing_summary(trace)["counts"], reference_expert_counts(trace))
    rec = stats._recall_from(stats._routing_summary(trace))
    np.testing.assert_array_equal(rec, recall_per_layer(trace.true_ids, trace.pred_ids))


def test_routing_stats_equals_the_reference_on_a_synthetic_trace():
    """The whole report on a trace the old loops still finish quickly (OLMoE, 60 steps,
    batch 2: repeated experts across the batch), at the default sizes."""
    from moesim.models import get_model
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=60, batch=2, seed=4))
    res = stats.routing_stats(trace)
    ref = reference_hit_rate_curve(trace, res["hit_rate"]["sizes"])
    for key in ("accesses", "lru", "lfu", "belady"):
        assert res["hit_rate"][key] == ref[key]
    assert res["popularity"]["counts"] == reference_expert_counts(trace).tolist()
    assert res["reuse"]["distance_hist"] == reference_reuse_stats(trace)["distance_hist"]
    assert res["adjacent_layer_overlap"]["per_layer"] == reference_adjacent_layer_overlap(trace)["per_layer"]
    assert res["predictor_recall"]["main"] == pytest.approx(
        recall_per_layer(trace.true_ids, trace.pred_ids).tolist(), nan_ok=True, rel=0, abs=0)


@settings(max_examples=40, deadline=None)
@given(trace=traces)
def test_recall_counts_give_the_simulators_prediction_recall(trace):
    from moesim.sim.simulate import prediction_recall

    hits, rows = stats.recall_counts(trace.true_ids, trace.pred_ids, trace.model.n_experts)
    ref = prediction_recall(trace)
    assert (rows == 0 and np.isnan(ref)) or hits / trace.true_ids.shape[-1] / rows == pytest.approx(ref, rel=1e-12)
