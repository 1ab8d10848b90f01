import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.policy import (
    EVICTIONS,
    POLICIES,
    CopyExperts,
    ExpertCache,
    Planner,
    Policy,
    expert_slots,
    get_policy,
    register,
)
from moesim.policy import families as policy_module


def test_policy_registry_and_aliases():
    assert set(POLICIES) == {"all-resident", "on-demand", "prefetch-spec", "prefetch-fom", "oracle",
                             "cpu-static", "hot-experts", "cpu-on-miss", "gpu-layers", "weight-streaming"}
    assert get_policy("prefetch").name == "prefetch-fom"
    assert get_policy("ngl").name == "gpu-layers"
    assert get_policy("cpu-offload-gb").name == "weight-streaming"
    assert get_policy(" Resident ").name == "all-resident"
    with pytest.raises(MoesimError, match="unknown policy"):
        get_policy("yolo")


@pytest.fixture
def scratch_registry():
    """Restore the global registry after a test registers into it."""
    saved = dict(policy_module._REGISTRY), dict(policy_module._ALIASES)
    yield
    for live, old in zip((policy_module._REGISTRY, policy_module._ALIASES), saved, strict=True):
        live.clear()
        live.update(old)


def test_a_new_policy_joins_in_one_place(scratch_registry):
    with pytest.raises(TypeError):
        CopyExperts("cpu-static", "summary", True)  # rows are keyword-only: no positional booleans
    register(CopyExperts(name="hot-test", prefetch=True, aliases=("hot",), summary="keep the hottest experts"))
    assert get_policy("hot") is POLICIES["hot-test"]
    assert Planner("hot-test").policy.prefetches
    with pytest.raises(MoesimError, match="already registered"):
        register(CopyExperts(name="other", aliases=("hot",), summary="clashes with an alias"))
    with pytest.raises(MoesimError, match="needs prefetch"):
        CopyExperts(name="bad", executes_predicted=True, summary="speculative execution of nothing prefetched")
    assert not CopyExperts(name="spec", prefetch=True, executes_predicted=True, summary="s").exact  # never said exact
    with pytest.raises(MoesimError, match="a policy of some family"):
        register(Policy(name="no-family", summary="the base class decides nothing"))
    with pytest.raises(TypeError):
        POLICIES["sneaky"] = POLICIES["oracle"]  # a read-only view: registering is the only way in


def test_expert_slots_is_the_executor_pool_and_the_memory_check():
    spec = get_model("qwen3-30b-a3b")
    assert expert_slots(spec, "all-resident", 100) == 0  # every expert resident, counted with the model
    # Prefill copies two whole layers (double-buffered), more than decode's 2 x batch x k.
    assert expert_slots(spec, "on-demand", 10) == 2 * spec.n_experts + 10 > 2 * spec.top_k + 10
    with pytest.raises(MoesimError, match=">= 0"):
        expert_slots(spec, "on-demand", -1)


def test_lru_evicts_least_recently_used():
    c = ExpertCache(2, "lru")
    c.use((0, 1))
    c.use((0, 2))
    c.use((0, 1))  # 2 is now the least recent
    assert c.evict_for(1, set()) == [(0, 2)]


def test_lfu_evicts_least_frequently_used_and_respects_protection():
    c = ExpertCache(3, "lfu")
    for key, uses in (((0, 1), 3), ((0, 2), 1), ((0, 3), 2)):
        for _ in range(uses):
            c.use(key)
    assert c.evict_for(1, {(0, 2)}) == [(0, 3)]  # (0, 2) is rarest but protected
    assert (0, 2) in c and (0, 1) in c


def test_on_demand_copies_the_true_experts_after_the_router():
    planner = Planner("on-demand")
    assert planner.prefetch(1, [1, 2]) == []
    plan = planner.route(1, [3, 4], [1, 2])
    assert plan.demand == (3, 4) and plan.execute == (3, 4)


def test_fetch_on_miss_copies_only_the_misses():
    planner = Planner("prefetch-fom")
    assert planner.prefetch(1, [1, 2]) == [1, 2]
    plan = planner.route(1, [2, 3], [1, 2])
    assert plan.demand == (3,) and plan.execute == (2, 3) and plan.prefetch_hits == 1


def test_a_layer_needs_its_prefetch_up_to_the_last_expert_it_executes():
    """prefetch_need counts the prefetch's copies in issue order up to the last executed
    one: what a demand-first or cancel-unstarted queue lets the layer wait for."""
    planner = Planner("prefetch-fom")
    assert planner.prefetch(1, [5, 3, 7, 2]) == [5, 3, 7, 2]
    assert planner.route(1, [3, 9], [5, 3, 7, 2]).prefetch_need == 2  # 5 (useless) and 3; 7 and 2 are not needed
    planner.prefetch(2, [4, 6])
    assert planner.route(2, [1], [4, 6]).prefetch_need == 0  # nothing useful: wait for no prefetch copy


def test_speculative_execution_runs_the_prediction():
    planner = Planner("prefetch-spec")
    planner.prefetch(1, [1, 2])
    plan = planner.route(1, [2, 3], [1, 2])
    assert plan.demand == () and plan.execute == (1, 2)


def test_first_layer_without_prediction_is_on_demand_even_when_speculative():
    plan = Planner("prefetch-spec").route(0, [5, 6], None)
    assert plan.demand == (5, 6) and plan.execute == (5, 6)


def test_cache_hits_skip_copies_and_cached_experts_are_not_evicted_while_planned():
    planner = Planner("prefetch-fom", cache_experts=2)
    plan = planner.route(0, [1, 2], None)
    planner.finish(0, plan)  # cache: (0,1), (0,2)
    assert planner.prefetch(0, [1, 5]) == [5]  # (0, 1) is cached: no copy, and now protected
    plan = planner.route(0, [1, 5], [1, 5])
    assert plan.cache_hits == 1 and plan.demand == ()


def test_all_resident_never_copies():
    planner = Planner("all-resident", cache_experts=0)
    assert planner.prefetch(1, [1]) == []
    assert planner.route(1, [1, 2], [1]).demand == ()


def test_the_cache_never_evicts_an_expert_the_layer_just_used():
    planner = Planner("on-demand", cache_experts=2, eviction="lfu")
    for _ in range(3):
        planner.finish(0, planner.route(0, [1], None))
    planner.finish(0, planner.route(0, [2], None))  # counts: (0,1) x3, (0,2) x1
    plan = planner.route(0, [2, 3], None)  # (0,2) hits; (0,3) needs room
    assert plan.cache_hits == 1
    admitted, evicted = planner.finish(0, plan)
    assert evicted == [(0, 1)] and admitted == [3]  # not (0,2), the rarest but just used
    assert (0, 2) in planner.cache and (0, 3) in planner.cache


# --------------------------------------------------------------------------------------
# The batch form the simulator uses is the per-layer methods, decision for decision
# --------------------------------------------------------------------------------------

routing = st.fixed_dictionaries({
    "tokens": st.integers(1, 30), "layers": st.integers(1, 5), "batch": st.integers(1, 3), "top_k": st.integers(1, 3),
    "experts": st.integers(2, 12), "none": st.floats(0, 0.3), "seed": st.integers(0, 2**31),
})


def _ids(r):
    """Random routing with repeats, -1 gaps (no prediction) and duplicates within a row."""
    rng = np.random.default_rng(r["seed"])
    shape = (r["tokens"], r["layers"], r["batch"], r["top_k"])
    hot = rng.integers(0, r["experts"], size=max(1, r["experts"] // 3))  # a few popular experts: cache hits
    true = np.where(rng.random(shape) < 0.5, rng.choice(hot, shape), rng.integers(0, r["experts"], shape))
    pred = np.where(rng.random(shape) < 0.6, true, rng.integers(0, r["experts"], shape))
    pred = np.where(rng.random(shape[:3] + (1,)) < r["none"], -1, pred)
    return true.astype(np.int16), pred.astype(np.int16)


@settings(max_examples=80, deadline=None)
@given(routing, st.sampled_from([0, 1, 2, 3, 7, 1000]), st.sampled_from(EVICTIONS), st.sampled_from([1, 1, 2, 3]),
       st.booleans(), st.integers(0, 3))
def test_plan_trace_makes_the_per_layer_decisions(r, capacity, eviction, lookahead, per_layer, n_pinned):
    """The compiled batch form makes exactly the per-layer methods' decisions: every policy,
    both evictions, caches from none to the whole model (global or one per layer), a pinned
    hot set, prefetches one or more layers ahead."""
    true, pred = _ids(r)
    rng = np.random.default_rng(r["seed"])
    pinned = {(int(rng.integers(r["layers"])), int(rng.integers(r["experts"]))) for _ in range(n_pinned)}
    for policy in (p for p in POLICIES if not POLICIES[p].cpu):  # CPU-compute policies: moesim.policy.placement
        kw = dict(per_layer=per_layer, pinned=pinned if POLICIES[policy].offload else ())
        stepwise = Planner(policy, capacity, eviction, lookahead, **kw).plan_trace_stepwise(true, pred)
        batch = Planner(policy, capacity, eviction, lookahead, **kw).plan_trace(true, pred, r["experts"])
        np.testing.assert_array_equal(batch, stepwise, err_msg=f"{policy}, cache {capacity} {eviction}, "
                                                               f"lookahead {lookahead}, {kw}")


def test_a_per_layer_cache_keeps_each_layers_experts_apart():
    """mixtral-offloading's per-layer LRU: a cache of 1 expert per layer keeps one expert of
    EVERY layer, where one global cache of the same total (2) keeps only the last two used."""
    true = np.array([[[[0]], [[1]]], [[[0]], [[1]]]], np.int16)  # 2 tokens, 2 layers, top-1
    per = dict(zip(Planner.COUNTS, Planner("on-demand", 1, per_layer=True).plan_trace_stepwise(true, true)))
    assert per["cache_hits"][1].tolist() == [1, 1]  # the second token hits in both layers
    pinned = dict(zip(Planner.COUNTS, Planner("on-demand", pinned={(0, 0)}).plan_trace_stepwise(true, true)))
    assert pinned["demand"][:, 0].tolist() == [0, 0] and pinned["cache_hits"][:, 0].tolist() == [1, 1]


def test_lookahead_prefetches_n_layers_ahead_and_keeps_every_prefetch_in_flight():
    """With lookahead 2, layer l's prefetch is issued at layer l - 2's router: layers 0 and 1
    load on demand, and the prefetches of layers l + 1 and l + 2 are both held (neither
    one's slots are released by the other's issue)."""
    p = Planner("prefetch-fom", lookahead=2)
    assert [p.issue_layer(m) for m in range(4)] == [None, None, 0, 1]
    assert [p.prefetch_target(m, 4) for m in range(4)] == [2, 3, None, None]
    assert Planner("on-demand", lookahead=2).issue_layer(3) is None
    true = np.array([[[[1]], [[2]], [[3]], [[4]]]], np.int16)  # [1 token, 4 layers, batch 1, top-1]
    pred = np.array([[[[-1]], [[-1]], [[3]], [[5]]]], np.int16)  # made 2 layers earlier; layer 3 mispredicted
    counts = dict(zip(Planner.COUNTS, Planner("prefetch-fom", lookahead=2).plan_trace_stepwise(true, pred)[:, 0]))
    assert counts["prefetch"].tolist() == [0, 0, 1, 1]
    assert counts["demand"].tolist() == [1, 1, 0, 1]  # layer 3's wrong prefetch: fetched on miss
    assert counts["prefetch_hits"].tolist() == [0, 0, 1, 0]
    with pytest.raises(MoesimError, match="lookahead"):
        Planner("prefetch-fom", lookahead=0)


def test_plan_trace_reports_progress_and_refuses_a_used_planner():
    true, pred = _ids({"tokens": 50, "layers": 3, "batch": 1, "top_k": 2, "experts": 8, "none": 0, "seed": 1})
    seen = []
    Planner("on-demand", 4).plan_trace(true, pred, 8, lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (50, 50)
    used = Planner("on-demand", 4)
    used.finish(0, used.route(0, [1], None))
    with pytest.raises(MoesimError, match="empty planner"):
        used.plan_trace(true, pred, 8)
    with pytest.raises(MoesimError, match="n_experts"):
        Planner("on-demand").plan_trace(true, pred, 4)


def test_lfu_breaks_ties_by_the_current_residency_not_an_old_one():
    c = ExpertCache(2, "lfu")
    c.use((0, 1))  # tick 1
    c.use((0, 2))  # tick 2
    assert c.evict_for(1, set()) == [(0, 1)]
    c.use((0, 1))  # re-admitted at tick 3: now more recent than (0, 2)
    assert c.evict_for(1, set()) == [(0, 2)]


def test_lfu_heap_stays_proportional_to_the_capacity():
    c = ExpertCache(4, "lfu")
    for i in range(10_000):
        c.use((0, i % 3))
    assert len(c._heap) <= 4 * 4 + 64 + 1
