"""The planner's fast paths (issue 25) against its per-layer methods: planning without a
cache in chunks of steps on several threads makes exactly the decisions of one pass and
of ``Planner.plan_trace_stepwise``. Speed itself is measured by bench/bench_sim.py."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy import _ids, routing

from moesim.policy import POLICIES, Planner
from moesim.policy import planner as policy_mod


@contextmanager
def chunking(slots: int, threads: int):
    """Plan ``slots`` expert slots a kernel call on up to ``threads`` threads."""
    old = policy_mod.PLAN_CHUNK, policy_mod._plan_threads
    policy_mod.PLAN_CHUNK, policy_mod._plan_threads = slots, lambda: threads
    try:
        yield
    finally:
        policy_mod.PLAN_CHUNK, policy_mod._plan_threads = old


@settings(max_examples=60, deadline=None)
@given(routing, st.sampled_from([0, 0, 3]), st.sampled_from([1, 1, 2]), st.integers(0, 3), st.integers(1, 40),
       st.integers(1, 4))
def test_threaded_chunks_make_the_per_layer_decisions(r, capacity, lookahead, n_pinned, slots, threads):
    """Chunks as small as one step, on 1 to 4 threads: every copy policy, with and without
    a pinned hot set, one or more layers ahead; a cache (which runs in one pass) too."""
    true, pred = _ids(r)
    rng = np.random.default_rng(r["seed"])
    pinned = {(int(rng.integers(r["layers"])), int(rng.integers(r["experts"]))) for _ in range(n_pinned)}
    for policy in (p for p in POLICIES if not POLICIES[p].cpu):
        kw = dict(pinned=pinned if POLICIES[policy].offload else ())
        stepwise = Planner(policy, capacity, "lru", lookahead, **kw).plan_trace_stepwise(true, pred)
        seen: list[tuple[int, int]] = []
        with chunking(slots, threads):
            batch = Planner(policy, capacity, "lru", lookahead, **kw).plan_trace(
                true, pred, r["experts"], lambda d, t, seen=seen: seen.append((d, t)))
        np.testing.assert_array_equal(batch, stepwise, err_msg=f"{policy}, cache {capacity}, lookahead {lookahead}")
        assert seen[-1] == (true.shape[0], true.shape[0]) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_long_trace_plans_the_same_on_threads():
    """Many chunks of a realistic shape (top-8 of 64 experts, 6 layers): threads or not."""
    rng = np.random.default_rng(0)
    true = np.argsort(rng.random((3000, 6, 1, 64)), -1)[..., :8].astype(np.int16)  # distinct within a row
    pred = np.where(rng.random(true.shape) < 0.8, true, rng.integers(0, 64, true.shape)).astype(np.int16)
    pred[:, 0] = -1
    for policy in ("on-demand", "prefetch-fom", "prefetch-spec", "oracle"):
        with chunking(10**9, 1):
            one = Planner(policy).plan_trace(true, pred, 64)
        with chunking(6 * 8 * 97, 2):
            np.testing.assert_array_equal(Planner(policy).plan_trace(true, pred, 64), one, err_msg=policy)


@settings(max_examples=60, deadline=None)
@given(routing, st.sampled_from([0, 0, 3]), st.sampled_from([1, 1, 2]), st.integers(0, 2), st.floats(0, 1))
def test_steps_alike_plan_one_step_and_broadcast_it(r, capacity, lookahead, n_pinned, none):
    """Distinct experts per row (as a trace's are): where a policy decides the same counts
    every step (batch 1, no cache, nothing pinned, no prediction used or the oracle's),
    planning one step and broadcasting it gives the per-layer methods' counts; everywhere
    else ``distinct`` changes nothing."""
    rng = np.random.default_rng(r["seed"])
    t, m, b, e = r["tokens"], r["layers"], r["batch"], r["experts"]
    k = min(r["top_k"], e)
    true = np.argsort(rng.random((t, m, b, e)), -1)[..., :k].astype(np.int16)
    pred = np.where(rng.random(true.shape) < 0.6, true, rng.integers(0, e, true.shape)).astype(np.int16)
    pred = np.where(rng.random(true.shape[:3] + (1,)) < none, -1, pred).astype(np.int16)
    pinned = {(int(rng.integers(m)), int(rng.integers(e))) for _ in range(n_pinned)}
    for policy in (p for p in POLICIES if not POLICIES[p].cpu):
        kw = dict(pinned=pinned if POLICIES[policy].offload else ())
        stepwise = Planner(policy, capacity, "lru", lookahead, **kw).plan_trace_stepwise(true, pred)
        planner = Planner(policy, capacity, "lru", lookahead, **kw)
        rows = planner.plan_rows(true, pred, e, distinct=True)
        np.testing.assert_array_equal(np.stack(rows), stepwise, err_msg=f"{policy}, cache {capacity}, batch {b}")
        if planner.steps_alike(b, capacity):
            assert all(row.strides[0] == 0 for row in rows)  # planned once, a view for every step


def test_on_demand_and_the_oracle_are_alike_every_step_and_prefetching_is_not():
    assert Planner("on-demand").steps_alike(1, 0) and Planner("oracle").steps_alike(1, 0)
    assert not Planner("prefetch-fom").steps_alike(1, 0) and not Planner("prefetch-spec").steps_alike(1, 0)
    assert not Planner("on-demand").steps_alike(2, 0) and not Planner("oracle", 4).steps_alike(1, 4)
    assert not Planner("oracle", pinned=[(0, 1)]).steps_alike(1, 0)
