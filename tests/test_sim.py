"""The simulator: a hand-worked example, the engines' agreement, and its invariants."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import hand_trace, two_layer_spec
from moesim.costmodel import CostModel
from moesim.engines import get_engine
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.policy import POLICIES
from moesim.setting import Setting
from moesim.sim.costs import Costs
from moesim.sim.engine import run_simpy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import build_plan
from moesim.sim.simulate import simulate
from moesim.sim.workload import Link, make_workload
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

# The copy-family policies; the CPU-compute ones have their own model and tests (test_deploy.py).
COPY_POLICIES = [p for p in POLICIES if not POLICIES[p].cpu]

# --------------------------------------------------------------------------------------
# Worked by hand: 2 MoE layers, top-2, one step. Attention 1 s a layer, each expert 1 s
# of compute, LM head 0.5 s; each expert copy 0.5 s latency + 192 B / 192 B/s = 1.5 s.
# --------------------------------------------------------------------------------------

HAND_COSTS = Costs(attn=np.array([[1.0, 1.0]]), per_expert=np.array([[1.0, 1.0]]), other=np.array([0.5]), source="hand")
HAND_LINK = Link(per_expert=0.5 + 192 / 192)


def _hand(policy, pred_layer1):
    spec = two_layer_spec()
    trace = hand_trace(spec, true=[[[0, 1], [2, 3]]], pred=[[[-1, -1], pred_layer1]])
    plan = build_plan(trace, policy)
    work = make_workload(spec, plan, HAND_COSTS)
    return run_fast(work, HAND_LINK), run_simpy(work, HAND_LINK)[:3]


@pytest.mark.parametrize("policy, pred, tpot, copy, stall", [
    # L0: attn 0-1, copy 2 experts 1-4, experts 4-6. L1: attn 6-7, copy 7-10, experts 10-12; head 12-12.5.
    ("on-demand", [2, 3], 12.5, 6.0, 6.0),
    # Prefetch of L1 issued at 1 (after L0's router) queues behind L0's copy: 4-7. L1 attn 6-7,
    # no wait, experts 7-9, head 9-9.5.
    ("oracle", [2, 3], 9.5, 6.0, 3.0),
    ("prefetch-fom", [2, 3], 9.5, 6.0, 3.0),
    # Predicted {2, 0}: prefetch 4-7; at 7 the miss (3) is copied 7-8.5; experts 8.5-10.5; head -11.
    ("prefetch-fom", [2, 0], 11.0, 7.5, 4.5),
    # Speculative: executes {2, 0} as soon as they land at 7; experts 7-9; head -9.5.
    ("prefetch-spec", [2, 0], 9.5, 6.0, 3.0),
    ("all-resident", [2, 0], 6.5, 0.0, 0.0),
])
def test_two_layer_example_worked_by_hand(policy, pred, tpot, copy, stall):
    for ends, copied, stalled in _hand(policy, pred):
        assert ends[0] == pytest.approx(tpot)
        assert copied[0] == pytest.approx(copy)
        assert stalled[0] == pytest.approx(stall)


# --------------------------------------------------------------------------------------
# Properties over random synthetic traces
# --------------------------------------------------------------------------------------

MODELS = ["tiny", "olmoe-1b-7b", "deepseek-v2-lite"]
configs = st.fixed_dictionaries({
    "model": st.sampled_from(MODELS),
    "tokens": st.integers(1, 12),
    "batch": st.integers(1, 3),
    "hit_rate": st.floats(0, 1),
    "reuse": st.floats(0, 0.9),
    "seed": st.integers(0, 10_000),
    "cache": st.sampled_from([0, 3, 40]),
    "eviction": st.sampled_from(["lru", "lfu"]),
    "link_gbps": st.floats(0.5, 500),
    "hw": st.sampled_from(["a6000", "gh200", "h100-pcie"]),
    "interference": st.sampled_from([0.0, 0.0, 0.3]),
    "wakeup": st.sampled_from([0.0, 0.0, 20.0]),
})
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _trace(c):
    return synthetic_trace(get_model(c["model"]), SyntheticParams(
        tokens=c["tokens"], batch=c["batch"], hit_rate=c["hit_rate"], reuse=c["reuse"], seed=c["seed"], prompt_len=4))


def _run(trace, c, policy, sim="fast", **kw):
    kw.setdefault("cache_experts", c["cache"])
    kw.setdefault("link_gbps", c["link_gbps"])
    hw = get_profile(c["hw"])
    if c["interference"]:
        hw = hw.with_figure("copy_interference", c["interference"])
    if c.get("wakeup"):
        hw = hw.with_figure("wait_wakeup_us", c["wakeup"])
    return simulate(trace, hw, policy, Setting(eviction=c["eviction"], sim=sim, **kw))


@SETTINGS
@given(configs)
def test_fast_path_agrees_with_simpy_on_every_policy(c):
    trace = _trace(c)
    for policy in COPY_POLICIES:
        ref = _run(trace, c, policy, "simpy")
        fast = _run(trace, c, policy, "fast")
        # Required: within 0.5 %. They implement the same pipeline, so they agree to rounding.
        np.testing.assert_allclose(fast.tpot.sum(), ref.tpot.sum(), rtol=1e-9)
        np.testing.assert_allclose(fast.tpot, ref.tpot, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(fast.stall, ref.stall, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(fast.copy, ref.copy, rtol=1e-9, atol=1e-15)


@SETTINGS
@given(configs)
def test_tpot_lies_between_the_overlap_and_serial_bounds(c):
    c = {**c, "wakeup": 0.0}  # a wake-up delay idles both resources: outside the serial bound by design
    trace = _trace(c)
    for policy in COPY_POLICIES:
        r = _run(trace, c, policy)
        total = r.tpot.sum()
        assert r.overlap_bound.sum() * (1 - 1e-9) <= total <= r.serial_bound.sum() * (1 + 1e-9)
        if c["cache"] == 0:  # no copy outlives its step, so the bounds hold step by step
            assert (r.tpot >= r.overlap_bound * (1 - 1e-9)).all()
            assert (r.tpot <= r.serial_bound * (1 + 1e-9)).all()


@SETTINGS
@given(configs, st.floats(1.05, 8))
def test_more_link_bandwidth_never_hurts(c, factor):
    trace = _trace(c)
    for policy in COPY_POLICIES:
        slow = _run(trace, c, policy)
        fast = _run(trace, c, policy, link_gbps=c["link_gbps"] * factor)
        ends_slow, ends_fast = np.cumsum(slow.tpot), np.cumsum(fast.tpot)
        assert (ends_fast <= ends_slow * (1 + 1e-12)).all()


def test_compute_slows_while_the_link_copies():
    """Worked by hand: 1 s of compute at t=0, link busy until 1 s, compute 2x slower meanwhile:
    0.5 s of work done by t=1, the remaining 0.5 s at full speed: ends at 1.5 s."""
    link = Link(1.0, interference=1.0)
    assert link.compute_end(0.0, 1.0, 1.0) == pytest.approx(1.5)
    assert link.compute_end(0.0, 0.25, 1.0) == pytest.approx(0.5)  # entirely inside the busy window
    assert link.compute_end(2.0, 1.0, 1.0) == pytest.approx(3.0)  # link already idle
    hw = get_profile("a6000").with_figure("copy_interference", 0.2).with_figure("copy_interference_gbs", 50)
    assert hw.interference == pytest.approx(0.2 * 25 / 50)  # scaled by the link's rate


@SETTINGS
@given(configs)
def test_oracle_is_the_best_prefetcher_without_a_cache(c):
    c = {**c, "wakeup": 0.0}
    trace = _trace(c)
    oracle = _run(trace, c, "oracle", cache_experts=0)
    for policy in ("on-demand", "prefetch-fom"):
        other = _run(trace, c, policy, cache_experts=0)
        assert oracle.tpot.sum() <= other.tpot.sum() * (1 + 1e-12)


@SETTINGS
@given(configs)
def test_speculative_prefetch_moves_exactly_the_oracles_bytes_at_batch_1(c):
    c = {**c, "batch": 1}
    trace = _trace(c)
    spec_ = _run(trace, c, "prefetch-spec", cache_experts=0)
    oracle = _run(trace, c, "oracle", cache_experts=0)
    assert spec_.plan.loads.sum() == oracle.plan.loads.sum()
    assert spec_.summary()["gb_moved_per_token"] == oracle.summary()["gb_moved_per_token"]


@SETTINGS
@given(configs)
def test_bytes_are_conserved(c):
    trace = _trace(c)
    for policy in COPY_POLICIES:
        r = _run(trace, c, policy)
        spec = trace.model
        per = get_profile(c["hw"]).transfer_latency + spec.expert_bytes / (c["link_gbps"] * 1e9)
        loads = r.plan.loads.sum()
        assert r.copy.sum() == pytest.approx(loads * per)
        assert r.summary()["gb_moved_per_token"] * 1e9 * trace.n_tokens == pytest.approx(loads * spec.expert_bytes)
        # Every executed expert was copied, cached, prefetched or resident.
        if POLICIES[policy].offload:
            executed = r.plan.execute.sum()
            assert r.plan.demand.sum() + r.plan.cache_hits.sum() + r.plan.prefetch_hits.sum() == executed


def test_a_cache_cuts_copies_when_routing_repeats():
    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=64, reuse=0.7))
    hw = get_profile("a6000")
    none = simulate(trace, hw, "on-demand", Setting(sim="fast"))
    cached = simulate(trace, hw, "on-demand", Setting(cache_gib=2, sim="fast"))
    assert cached.summary()["cache_hit_rate"] > 0.5
    assert cached.plan.loads.sum() < 0.5 * none.plan.loads.sum()
    assert cached.tpot.mean() < none.tpot.mean()


def test_measured_compute_times_are_used_and_said(tiny_trace):
    hw = get_profile("a6000")
    t = tiny_trace
    t.timings = {"attn_s": np.full((t.n_tokens, 4), 1e-3), "expert_s": np.full((t.n_tokens, 4), 2e-3),
                 "other_s": np.full(t.n_tokens, 5e-4)}
    r = simulate(t, hw, "all-resident", Setting(timing="measured"))
    assert r.config["timing"] == "measured (trace)"
    assert r.tpot.mean() == pytest.approx(4 * 1e-3 + 4 * 2e-3 + 5e-4)
    assert simulate(t, hw, "all-resident").config["timing"].startswith("roofline")  # recorded on another machine


def test_ttft_grows_with_prompt_length_and_offload_costs_whole_layers():
    from moesim.sim.prefill import prefill_time

    spec, hw = get_model("qwen3-30b-a3b"), get_profile("h100-sxm")
    cm = CostModel(spec, hw)
    short, long = prefill_time(cm, 128, True), prefill_time(cm, 4096, True)
    assert long > short
    assert short >= spec.all_expert_bytes / hw.link_bw  # every expert crosses the link once
    assert prefill_time(cm, 128, False) < short


def test_simpy_records_a_timeline(tiny_trace):
    r = simulate(tiny_trace, get_profile("a6000"), "prefetch-fom", record=True)
    lanes = {s.lane for s in r.spans}
    assert lanes == {"compute", "copy"}
    assert all(s.end >= s.start for s in r.spans)
    copies = [s for s in r.spans if s.lane == "copy"]
    assert all(a.end <= b.start + 1e-15 for a, b in zip(copies, copies[1:], strict=False))  # one FIFO engine


def test_prediction_recall_is_the_traces_hit_rate():
    from moesim.sim.simulate import prediction_recall

    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=200, hit_rate=0.7, early_layers=0))
    assert prediction_recall(trace) == pytest.approx(0.7, abs=0.02)
    perfect = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=20, hit_rate=1.0, early_hit_rate=1.0))
    assert prediction_recall(perfect) == 1.0


# --------------------------------------------------------------------------------------
# One definition of each cost
# --------------------------------------------------------------------------------------


def _compute_bound(hw):
    """A profile whose memory is effectively free, so the roofline is its math time."""
    return hw.with_figure("mem_bw_achievable_gbs", 1e12).with_figure("kernel_launch_us", 1e-9)


def test_roofline_charges_a_bf16_dense_layer_two_flops_per_weight():
    from moesim.models import ModelSpec
    from moesim.sim.costs import roofline_costs

    spec = ModelSpec("dense", n_layers=2, n_experts=4, top_k=2, hidden=256, expert_inter=64, vocab=64,
                     dense_layers=(0,), dense_inter=4096)
    hw = _compute_bound(get_profile("h100-sxm"))
    batch, ctx = 64, 10
    c = roofline_costs(CostModel(spec, hw), tokens=1, prompt_len=ctx, batch=batch)
    weights = 3 * spec.hidden * spec.dense_inter  # the dense FFN's weight COUNT
    flops = batch * (spec.attention_flops(ctx) + 2 * weights)
    # 2 x bytes (the old formula) would be twice the FFN's FLOPs for bf16 weights.
    assert c.attn[0, 0] == pytest.approx(flops / hw.flops("bf16"), rel=1e-6)
    assert c.attn[0, 0] < batch * (spec.attention_flops(ctx) + 2 * spec.dense_ffn_bytes) / hw.flops("bf16")


def test_lm_head_and_copy_time_are_defined_once():
    from moesim.sim.costs import roofline_costs
    from moesim.sim.prefill import prefill_time

    spec, hw = get_model("olmoe-1b-7b"), get_profile("a6000")
    c = roofline_costs(CostModel(spec, hw), tokens=1, prompt_len=4)
    assert c.other[0] == pytest.approx(spec.lm_head_bytes / hw.mem_bw + get_engine().head_kernels * hw.launch)
    link = Link.of(CostModel(spec, hw))
    assert link.copy_time(3) == pytest.approx(3 * (hw.transfer_latency + spec.expert_bytes / hw.link_bw))
    # With compute almost free, prefill is the link copying every MoE layer once.
    fast = _compute_bound(hw).with_figure("bf16_tflops", 1e9)
    expected = spec.n_moe_layers * Link.of(CostModel(spec, fast)).copy_time(spec.n_experts)
    assert prefill_time(CostModel(spec, fast), 16, offload=True) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v3", "qwen3.5-35b-a3b", "llama-4-maverick-17b-128e",
                                  "jamba-1.5-mini", "qwen3-30b-a3b"])
def test_attention_by_layer_is_each_layers_own_attention(name):
    """The cost model times each layer signature once (CostModel.attention_by_layer): on
    models that mix sliding, chunked, linear, dense and MoE layers it equals timing every
    layer by itself, at contexts either side of the window and chunk sizes."""
    spec = get_model(name)
    cm = CostModel(spec, get_profile("a6000"))
    ctx = np.array([0, 1, 127, 128, 4095, 8192, 9000, 131071], dtype=np.int64)
    alone = np.stack([np.broadcast_to(cm.attention(layer, ctx, rows=2), ctx.shape) for layer in range(spec.n_layers)],
                     axis=1)
    assert np.array_equal(cm.attention_by_layer(ctx, rows=2), alone)


def test_the_compiled_fast_path_is_compiled_again_when_the_interference_formula_changes():
    """The fast path inlines moesim.sim.workload.compute_end, but numba keys its cached kernel to
    fastpath_kernel.py alone: the hash of the formula's source kept there must follow it, so an
    edit of the formula is an edit of the kernel's file (and its cached code is not reused)."""
    import hashlib
    import inspect

    from moesim.sim import fastpath_kernel
    from moesim.sim.workload import compute_end

    assert hashlib.sha256(inspect.getsource(compute_end).encode()).hexdigest() == fastpath_kernel.COMPUTE_END_SHA256, \
        "compute_end changed: update COMPUTE_END_SHA256 in sim/fastpath_kernel.py"


@pytest.mark.parametrize("fixed, overlap", [(0.0, False), (3e-5, False), (3e-5, True)])
def test_expert_compute_of_one_value_everywhere_is_the_full_computation(fixed, overlap):
    """Costs.expert_compute prices a broadcast of one count at a broadcast rate once: the
    same float64 values, bit for bit, as the cell-by-cell rule on full arrays."""
    from moesim.sim.costs import Costs

    shape = (7, 5)
    rate = np.broadcast_to(np.float64(1.7e-4), shape)
    costs = Costs(np.zeros(shape), rate, np.zeros(7), "roofline (test)", 2.3e-6, fixed, overlap)
    full = Costs(np.zeros(shape), np.array(rate), np.zeros(7), "roofline (test)", 2.3e-6, fixed, overlap)
    for n, a in ((8, 8), (0, 0), (3, 40)):
        one = costs.expert_compute(np.broadcast_to(np.int32(n), shape), np.broadcast_to(np.int32(a), shape))
        cells = full.expert_compute(np.full(shape, n, np.int32), np.full(shape, a, np.int32))
        assert one.shape == shape and one.tobytes() == cells.tobytes()
