import pytest

from moesim import policy as policy_module
from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.policy import POLICIES, ExpertCache, Planner, Policy, expert_slots, get_policy, register


def test_policy_registry_and_aliases():
    assert set(POLICIES) == {"all-resident", "on-demand", "prefetch-spec", "prefetch-fom", "oracle",
                             "cpu-static", "hot-experts", "cpu-on-miss"}
    assert get_policy("prefetch").name == "prefetch-fom"
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
        Policy("cpu-static", "summary", True)  # rows are keyword-only: no positional booleans
    register(Policy(name="hot-test", prefetch=True, aliases=("hot",), summary="keep the hottest experts"))
    assert get_policy("hot") is POLICIES["hot-test"]
    assert Planner("hot-test").policy.prefetch
    with pytest.raises(MoesimError, match="already registered"):
        register(Policy(name="other", aliases=("hot",), summary="clashes with an alias"))
    with pytest.raises(MoesimError, match="cannot be exact"):
        register(Policy(name="bad", prefetch=True, speculative=True, summary="speculative but exact"))
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
    p = Planner("on-demand")
    assert p.prefetch(1, [1, 2]) == []
    plan = p.route(1, [3, 4], [1, 2])
    assert plan.demand == (3, 4) and plan.execute == (3, 4)


def test_fetch_on_miss_copies_only_the_misses():
    p = Planner("prefetch-fom")
    assert p.prefetch(1, [1, 2]) == [1, 2]
    plan = p.route(1, [2, 3], [1, 2])
    assert plan.demand == (3,) and plan.execute == (2, 3) and plan.prefetch_hits == 1


def test_speculative_execution_runs_the_prediction():
    p = Planner("prefetch-spec")
    p.prefetch(1, [1, 2])
    plan = p.route(1, [2, 3], [1, 2])
    assert plan.demand == () and plan.execute == (1, 2)


def test_first_layer_without_prediction_is_on_demand_even_when_speculative():
    plan = Planner("prefetch-spec").route(0, [5, 6], None)
    assert plan.demand == (5, 6) and plan.execute == (5, 6)


def test_cache_hits_skip_copies_and_cached_experts_are_not_evicted_while_planned():
    p = Planner("prefetch-fom", cache_experts=2)
    plan = p.route(0, [1, 2], None)
    p.finish(0, plan)  # cache: (0,1), (0,2)
    assert p.prefetch(0, [1, 5]) == [5]  # (0, 1) is cached: no copy, and now protected
    plan = p.route(0, [1, 5], [1, 5])
    assert plan.cache_hits == 1 and plan.demand == ()


def test_all_resident_never_copies():
    p = Planner("all-resident", cache_experts=0)
    assert p.prefetch(1, [1]) == []
    assert p.route(1, [1, 2], [1]).demand == ()


def test_the_cache_never_evicts_an_expert_the_layer_just_used():
    p = Planner("on-demand", cache_experts=2, eviction="lfu")
    for _ in range(3):
        p.finish(0, p.route(0, [1], None))
    p.finish(0, p.route(0, [2], None))  # counts: (0,1) x3, (0,2) x1
    plan = p.route(0, [2, 3], None)  # (0,2) hits; (0,3) needs room
    assert plan.cache_hits == 1
    admitted, evicted = p.finish(0, plan)
    assert evicted == [(0, 1)] and admitted == [3]  # not (0,2), the rarest but just used
    assert (0, 2) in p.cache and (0, 3) in p.cache
