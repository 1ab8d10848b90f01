"""The policies people deploy: host profiles, quantised expert bytes, CPU expert compute
(cpu-static, hot-experts, cpu-on-miss), their step model and its two engines."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
from cli_run import BOTH_WAYS
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.costmodel import CostModel, ExpertTimes
from moesim.engines import get_engine
from moesim.errors import MoesimError
from moesim.hardware import builtin_hosts, builtin_profiles, get_host, get_profile, load_profile
from moesim.models import GGML_BLOCKS, get_model, matrix_bytes
from moesim.policy import POLICIES, CpuOnMiss, cpu_or_copy, get_policy
from moesim.policy.placement import (
    WORKSPACE_BYTES,
    cpu_layers,
    expert_budget,
    expert_times,
    make_placement,
    routing_counts,
)
from moesim.setting import Setting
from moesim.sim.cpu_compute import simulate_cpu_compute
from moesim.sim.prefill import prefill_time, prefill_time_cpu_compute
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

# -- quantised expert formats ------------------------------------------------------------


def test_ggml_blocks_are_the_published_sizes():
    # ggml-common.h: block_q8_0 = fp16 d + 32 int8; block_q4_K = fp16 d, dmin + 12 scale
    # bytes + 128 nibble bytes; block_q5_K adds 32 high-bit bytes; block_q6_K = 128 + 64 +
    # 16 + fp16 d.
    assert matrix_bytes(1, 32, "q8_0") == 34
    assert matrix_bytes(1, 256, "q4_k") == 144
    assert matrix_bytes(1, 256, "q5_k") == 176
    assert matrix_bytes(1, 256, "q6_k") == 210
    assert GGML_BLOCKS["q4_k"] == (256, 144)
    assert matrix_bytes(3, 512, "q6_k") == 3 * 2 * 210


def test_weight_only_int_formats_count_scales_and_zeros():
    assert matrix_bytes(4, 64, "int8") == 4 * 64 + 4 * 2  # fp16 scale per output row
    assert matrix_bytes(2, 64, "int4-g32") == 2 * 32 + 2 * 2 * (2 + 2)  # fp16 scale + zero per group
    assert matrix_bytes(2, 64, "int4-g128") == 2 * 32 + 2 * 1 * 4  # one short group still has both
    assert matrix_bytes(2, 256, "int4-g128") == 2 * 128 + 2 * 2 * 4


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(MoesimError, match="blocks of 256"):
        matrix_bytes(4, 300, "q4_k")


def test_choosing_the_expert_dtype_of_a_catalogue_model():
    spec = get_model("qwen3-30b-a3b")
    q4 = spec.with_expert_dtype("q4_k")
    assert q4.expert_bytes == 3 * 2048 * 768 // 256 * 144
    assert q4.attention_bytes == spec.attention_bytes and q4.expert_flops(1) == spec.expert_flops(1)
    assert spec.with_expert_dtype("bf16") is spec
    with pytest.raises(MoesimError, match="expert_inter 1408") as e:
        get_model("deepseek-v2-lite").with_expert_dtype("q4_k")
    assert "\n" not in str(e.value)
    with pytest.raises(MoesimError, match="unknown expert dtype"):
        spec.with_expert_dtype("q3_z")


# -- host profiles ----------------------------------------------------------------------


def test_every_host_loads_with_public_sources():
    assert set(builtin_hosts()) >= {"xeon-8480", "epyc-9654", "epyc-7742", "ryzen-7950x", "grace"}
    for name in builtin_hosts():
        h = get_host(name)
        assert h.name == name
        assert h["mem_bw_achievable_gbs"] <= h["mem_bw_peak_gbs"]
        for key, fig in h.figures.items():
            where = f"{name}.{key}"
            assert "shared/" not in fig.source and "reference/" not in fig.source, where
            if fig.kind == "datasheet":
                assert "https://" in fig.source, where
            else:
                assert fig.source.startswith(f"{fig.kind}: ") and len(fig.source) > 40, where


def test_every_gpu_profile_names_a_shipped_host():
    for name in builtin_profiles():
        gpu = get_profile(name)
        assert gpu.host in builtin_hosts(), name
        assert get_host(None, gpu).name == gpu.host


def test_host_rates_follow_the_kernel_and_the_format():
    spr = get_host("xeon-8480")
    assert spr.flops("bf16") > spr.flops("bf16", amx=False)  # AMX tiles vs AVX-512
    assert spr.flops("q4_k") > spr.flops("bf16")  # integer dot products
    rome = get_host("epyc-7742")
    assert not rome.has_amx and rome.flops("bf16") == rome.flops("bf16", amx=False)


def test_bad_host_input_is_one_line(tmp_path):
    with pytest.raises(MoesimError, match="a GPU profile\\? --host takes a host profile"):
        get_host(str(get_profile("a6000").path))
    with pytest.raises(MoesimError, match="unknown host profile 'pentium'"):
        get_host("pentium")
    text = get_host("grace").to_toml().replace("[figures.cores]\nvalue = 72", "[figures.cores]\nvalue = 7.5")
    assert "value = 7.5" in text
    (tmp_path / "h.toml").write_text(text)
    with pytest.raises(MoesimError, match="whole number"):
        get_host(str(tmp_path / "h.toml"))


def test_retired_gpu_figures_warn_and_are_dropped(tmp_path):
    text = get_profile("a6000").to_toml() + '[figures.copy_engines]\nvalue = 2\nkind = "estimate"\nsource = "x"\n'
    (tmp_path / "old.toml").write_text(text)
    with pytest.warns(UserWarning, match="copy_engines"):
        p = load_profile(tmp_path / "old.toml")
    assert "copy_engines" not in p.figures


# -- the registry and the cpu-or-copy decision ----------------------------------------------


def test_cpu_policies_are_registered_and_checked():
    assert {POLICIES[n].cpu for n in ("cpu-static", "hot-experts", "cpu-on-miss")} == {"layers", "hot", "miss"}
    assert get_policy("n-cpu-moe").name == "cpu-static" and get_policy("fiddler").name == "cpu-on-miss"
    with pytest.raises(TypeError, match="prefetch"):  # a CPU-compute family has no prefetch knob to set
        CpuOnMiss(name="cpu-prefetch-test", summary="x", prefetch=True)


T = ExpertTimes(gpu_mem=1.0, gpu_tok=0.0, gpu_fixed=0.0, cpu_mem=4.0, cpu_tok=0.0, cpu_fixed=0.0, roundtrip=0.0, copy=2.0)


def test_cpu_or_copy_weighs_the_link_queue():
    # Idle link: one copy (2 + 1 on the device) ends before the CPU (4).
    assert cpu_or_copy([1], 0, 0, now=0.0, link_free=0.0, times=T) == 1
    # The link is busy for 10 more seconds: the CPU wins.
    assert cpu_or_copy([1], 0, 0, now=0.0, link_free=10.0, times=T) == 0
    # Three misses, idle link: copy c, CPU the rest; max(2c + c, 4(3-c)) is least at c = 2 (6 vs 4).
    assert cpu_or_copy([1, 1, 1], 0, 0, now=0.0, link_free=0.0, times=T) == 2
    # A tie (copy end 3 = CPU end 3) keeps the link free.
    assert cpu_or_copy([1], 0, 0, now=0.0, link_free=0.0, times=replace(T, cpu_mem=3.0)) == 0


@given(st.lists(st.integers(1, 8), max_size=6), st.floats(0, 5), st.floats(0.1, 5), st.floats(0.1, 5))
@settings(max_examples=60, deadline=None)
def test_cpu_or_copy_is_the_best_split(miss, link_free, cpu_mem, copy):
    miss = sorted(miss, reverse=True)
    times = replace(T, cpu_mem=cpu_mem, copy=copy, roundtrip=0.5, cpu_tok=0.1, gpu_tok=0.01)
    c = cpu_or_copy(miss, 3, 1, now=1.0, link_free=link_free, times=times)

    def end(c):
        gpu_start = max(link_free, 1.0) + c * copy if c else 1.0
        return max(gpu_start + times.gpu(1 + c, 3 + sum(miss[:c])), 1.0 + times.cpu(len(miss) - c, sum(miss[c:])))
    assert end(c) <= min(end(x) for x in range(len(miss) + 1)) + 1e-12


# -- placements -------------------------------------------------------------------------


def test_auto_cpu_layers_is_the_fewest_that_fit():
    spec, gb = get_model("qwen3-30b-a3b"), 24e9
    n = cpu_layers(spec, "auto", gb, 1, 4096)
    budget = expert_budget(spec, gb, 1, 4096)
    assert (spec.n_moe_layers - n) * spec.layer_expert_bytes <= budget < (spec.n_moe_layers - n + 1) * spec.layer_expert_bytes
    assert budget == int(gb - (spec.non_expert_bytes - spec.input_embedding_bytes) - 4096 * spec.n_layers * spec.kv_bytes_per_token_layer - WORKSPACE_BYTES)
    assert cpu_layers(spec, "auto", 200e9) == 0
    with pytest.raises(MoesimError, match="--cpu-layers"):
        cpu_layers(spec, 49, gb)


def test_hot_experts_take_the_most_routed_and_need_a_calibration():
    spec = get_model("tiny")
    cal = synthetic_trace(spec, SyntheticParams(tokens=40, prompt_len=4, seed=5, skew=1.5))
    counts = routing_counts(cal.true_ids, spec.n_experts)
    assert counts.sum() == (cal.true_ids >= 0).sum()
    budget_experts = 10
    device = spec.non_expert_bytes - spec.input_embedding_bytes + WORKSPACE_BYTES + budget_experts * spec.expert_bytes + 1
    p = make_placement("hot-experts", spec, device, context=0, calibration=cal.true_ids)
    assert p.n_resident == budget_experts and not p.optimistic
    assert counts[p.resident].min() >= counts[~p.resident].max()
    with pytest.raises(MoesimError, match="calibration trace"):
        make_placement("hot-experts", spec, device)
    q = make_placement("hot-experts", spec, device, replay_ids=cal.true_ids, calibrate_on_replay=True)
    assert q.optimistic and "optimistic" in q.source


# -- the step model and its two engines ------------------------------------------------------


@given(policy=st.sampled_from(["cpu-static", "hot-experts", "cpu-on-miss"]), batch=st.integers(1, 3),
       seed=st.integers(0, 5), link=st.sampled_from([2.0, 25.0, 400.0]), host_bw=st.sampled_from([5.0, 60.0, 400.0]),
       cache=st.integers(1, 40), eviction=st.sampled_from(["lru", "lfu"]), n_cpu=st.integers(0, 4))
@settings(max_examples=30, deadline=None)
def test_fast_path_equals_simpy(policy, batch, seed, link, host_bw, cache, eviction, n_cpu):
    spec = get_model("tiny")
    trace = synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=4, batch=batch, seed=seed))
    cal = synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=4, seed=seed + 1)).true_ids
    hw = get_profile("rtx4090").with_figure("device_memory_gb", 1.5)
    host = get_host("ryzen-7950x").with_figure("mem_bw_achievable_gbs", host_bw)
    kw = dict(host=host, link_gbps=link, cpu_layers=n_cpu, calibration=cal, eviction=eviction,
              cache_experts=cache if policy == "cpu-on-miss" else 0)
    a = simulate_cpu_compute(trace, hw, policy, Setting(sim="simpy", **kw))
    b = simulate_cpu_compute(trace, hw, policy, Setting(sim="fast", **kw))
    np.testing.assert_allclose(a.tpot, b.tpot, rtol=1e-12, atol=1e-15)
    for name in ("n_gpu", "n_cpu", "n_copied", "n_hits"):
        np.testing.assert_array_equal(getattr(a.run, name), getattr(b.run, name))
    np.testing.assert_allclose(a.run.cpu_wait, b.run.cpu_wait, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(a.run.stall, b.run.stall, rtol=1e-9, atol=1e-15)
    assert (a.run.n_gpu + a.run.n_cpu == a.plan.execute).all()


def test_static_layers_put_exactly_those_layers_on_the_cpu(tiny_trace):
    hw = get_profile("a6000")
    r = simulate_cpu_compute(tiny_trace, hw, "cpu-static", Setting(cpu_layers=2, sim="fast"))
    assert (r.run.n_cpu[:, :2] > 0).all() and (r.run.n_gpu[:, :2] == 0).all()
    assert (r.run.n_cpu[:, 2:] == 0).all() and r.run.copy.sum() == 0
    none = simulate_cpu_compute(tiny_trace, hw, "cpu-static", Setting(cpu_layers=0, sim="fast"))
    assert none.run.cpu_busy.sum() == 0 and none.tpot.mean() < r.tpot.mean()


def test_cpu_time_grows_with_batch_once_compute_bound():
    spec = get_model("qwen3-30b-a3b").with_layers(4)
    hw = get_profile("rtx4090")
    host = get_host("ryzen-7950x")
    per_expert = []
    for batch in (1, 2048):
        tr = synthetic_trace(spec, SyntheticParams(tokens=3, prompt_len=8, batch=batch, seed=1))
        r = simulate_cpu_compute(tr, hw, "cpu-static", Setting(host=host, cpu_layers=4, sim="fast"))
        per_expert.append(r.run.cpu_busy.sum() / r.run.n_cpu.sum())
    assert per_expert[1] > 2 * per_expert[0]  # math, not the weight read, dominates at 128 tokens an expert


def test_prefill_picks_cpu_for_short_prompts_and_copies_for_long_ones():
    spec = get_model("qwen3-30b-a3b")
    hw, host = get_profile("rtx4090"), get_host("ryzen-7950x")
    times = expert_times(spec, hw, host)
    never_copy = replace(times, copy=1e9)
    never_cpu = replace(times, cpu_mem=1e9)
    resident = np.zeros((spec.n_moe_layers, spec.n_experts), bool)
    picks = []
    for prompt in (1, 8192):
        both = prefill_time_cpu_compute(CostModel(spec, hw, host), times, resident, prompt)
        cpu = prefill_time_cpu_compute(CostModel(spec, hw, host), never_copy, resident, prompt)
        copy = prefill_time_cpu_compute(CostModel(spec, hw, host), never_cpu, resident, prompt)
        assert both == pytest.approx(min(cpu, copy), rel=1e-12)
        picks.append("cpu" if cpu < copy else "copy")
    assert picks == ["cpu", "copy"]


def test_cpu_on_miss_needs_a_cache_and_optimistic_is_marked(tiny_trace):
    hw = get_profile("a6000")
    with pytest.raises(MoesimError, match="cache"):
        simulate_cpu_compute(tiny_trace, hw, "cpu-on-miss")
    r = simulate_cpu_compute(tiny_trace, hw, "hot-experts", Setting(calibrate_on_replay=True, sim="fast")).summary()
    assert r["optimistic_placement"] is True and r["synthetic_trace"] is True
    with pytest.raises(MoesimError, match="computes no experts on the CPU"):
        simulate_cpu_compute(tiny_trace, hw, "on-demand")


def test_no_warnings_from_shipped_profiles():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in builtin_profiles():
            get_profile(name)


# -- sharper copy model: prediction costs time ------------------------------------------------


def test_prediction_is_charged_where_a_prefetch_is_issued():
    from moesim.sim.costs import prediction_seconds

    spec, hw = get_model("glm-4.7-flash"), get_profile("h100-sxm")  # layer 0 is dense
    p = prediction_seconds(CostModel(spec, hw))
    moe = spec.moe_layers
    expected = max((2 * spec.hidden + spec.router_bytes) / hw.mem_bw, 2 * spec.n_experts * spec.hidden / hw.flops()) \
        + get_engine().predict_kernels * hw.launch
    charged = list(moe[:-1])  # at each MoE layer's router, for the next MoE layer
    assert np.allclose(p[charged], expected) and p[[i for i in range(spec.n_layers) if i not in charged]].sum() == 0


def test_predicting_policies_pay_for_the_predictor(tiny_trace):
    from moesim.sim.costs import prediction_seconds
    from moesim.sim.simulate import simulate

    hw = get_profile("a6000")
    extra = prediction_seconds(CostModel(tiny_trace.model, hw)).sum()
    rows = {p: simulate(tiny_trace, hw, p, Setting(sim="fast")) for p in ("prefetch-fom", "oracle", "on-demand")}
    assert rows["prefetch-fom"].config["timing"].endswith("+ predictor")
    assert rows["oracle"].config["timing"] == rows["on-demand"].config["timing"] == "roofline (a6000)"
    assert rows["prefetch-fom"].compute.mean() == pytest.approx(rows["oracle"].compute.mean() + extra, rel=1e-12)


def test_measured_prediction_time_is_removed_for_policies_without_one(tiny_trace):
    from moesim.sim.simulate import simulate

    t, hw = tiny_trace, get_profile("a6000")
    t.timings = {"attn_s": np.full((t.n_tokens, 4), 1e-3), "expert_s": np.full((t.n_tokens, 4), 2e-3),
                 "other_s": np.full(t.n_tokens, 5e-4), "predict_s": np.full((t.n_tokens, 4), 2e-4)}
    resident = simulate(t, hw, "all-resident", Setting(timing="measured"))
    assert resident.tpot.mean() == pytest.approx(4 * 0.8e-3 + 4 * 2e-3 + 5e-4)
    assert simulate(t, hw, "prefetch-fom", Setting(timing="measured")).compute.mean() == pytest.approx(4 * 1e-3 + 4 * 2e-3 + 5e-4)


# -- sharper copy model: demand before prefetch ---------------------------------------------


def test_queued_engine_is_fifo_when_nothing_competes(tiny_trace):
    from moesim.sim.simulate import simulate

    hw = get_profile("a6000")
    # The oracle never copies on demand and uses every prefetched expert: no order to change.
    fifo = simulate(tiny_trace, hw, "oracle")
    for queue in ("demand-first", "cancel-unstarted"):
        q = simulate(tiny_trace, hw, "oracle", Setting(copy_queue=queue))
        np.testing.assert_allclose(q.tpot, fifo.tpot, rtol=1e-9)
        assert q.config["copy_queue"] == queue


@given(seed=st.integers(0, 50), hit=st.floats(0.2, 0.95), link=st.sampled_from([5.0, 25.0, 100.0]),
       cache=st.sampled_from([0, 8]))
@settings(max_examples=25, deadline=None)
def test_demand_first_and_cancelling_never_hurt(seed, hit, link, cache):
    from moesim.sim.simulate import simulate

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=8, prompt_len=4, seed=seed, hit_rate=hit))
    hw = get_profile("a6000")
    kw = dict(link_gbps=link, cache_experts=cache)
    fifo = simulate(trace, hw, "prefetch-fom", Setting(**kw)).tpot.sum()
    first = simulate(trace, hw, "prefetch-fom", Setting(copy_queue="demand-first", **kw))
    cancel = simulate(trace, hw, "prefetch-fom", Setting(copy_queue="cancel-unstarted", **kw))
    assert first.tpot.sum() <= fifo * (1 + 1e-9)
    assert cancel.tpot.sum() <= first.tpot.sum() * (1 + 1e-9)
    assert cancel.copy.sum() <= first.copy.sum() + 1e-12  # cancelled copies are not issued work


def test_queues_other_than_fifo_need_simpy(tiny_trace):
    from moesim.sim.simulate import simulate

    with pytest.raises(MoesimError, match="SimPy simulator only"):
        simulate(tiny_trace, get_profile("a6000"), "prefetch-fom", Setting(sim="fast", copy_queue="demand-first"))
    with pytest.raises(MoesimError, match="unknown copy queue"):
        simulate(tiny_trace, get_profile("a6000"), "prefetch-fom", Setting(copy_queue="lifo"))


def test_memory_check_and_calibration_file(tmp_path, tiny_trace):
    from moesim.memory import device_bytes
    from moesim.policy import expert_slots
    from moesim.sim.cpu_compute import load_calibration
    from moesim.traces.format import write_trace

    spec = tiny_trace.model
    assert expert_slots(spec, "cpu-static") == 0 and expert_slots(spec, "cpu-on-miss", 5) == spec.n_experts + 5
    hw = get_profile("a6000")
    r = simulate_cpu_compute(tiny_trace, hw, "cpu-static", Setting(cpu_layers=1, sim="fast"))
    assert r.config["device_gb_needed"] * 1e9 == device_bytes(spec, "cpu-static", resident_experts=r.placement.n_resident,
                                                               context=tiny_trace.prompt_len + tiny_trace.n_tokens)
    assert r.placement.n_resident == 3 * spec.n_experts and r.config["fits"]
    path = write_trace(tiny_trace, tmp_path / "cal.npz")
    assert (load_calibration(str(path), spec) == tiny_trace.true_ids).all()
    with pytest.raises(MoesimError, match="calibration trace .* is of tiny"):
        load_calibration(str(path), get_model("olmoe-1b-7b"))


def test_a_warm_cpu_on_miss_cache_starts_with_the_hottest():
    from moesim.policy.placement import HostPlanner, hot_set

    spec = get_model("tiny")
    counts = np.zeros((spec.n_moe_layers, spec.n_experts), np.int64)
    counts[2, 5], counts[0, 1], counts[3, 0] = 9, 7, 5
    p = hot_set(counts, spec, 3 * spec.expert_bytes, "hand counts", False)
    assert p.hottest == ((2, 5), (0, 1), (3, 0))
    planner = HostPlanner("cpu-on-miss", spec, p, cache_experts=2)
    assert set(planner.cache.keys()) == {(2, 5), (0, 1)}
    assert planner.split(2, [5, 6]) == ([5], [6])


@pytest.mark.parametrize("batch", [1, 4])
def test_no_cpu_layers_is_the_all_resident_model(batch):
    from moesim.sim.simulate import simulate

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6, prompt_len=4, batch=batch, seed=2))
    hw = get_profile("h100-sxm")
    hybrid = simulate_cpu_compute(trace, hw, "cpu-static", Setting(cpu_layers=0, sim="fast"))
    resident = simulate(trace, hw, "all-resident", Setting(sim="fast"))
    np.testing.assert_allclose(hybrid.tpot, resident.tpot, rtol=1e-12)


def test_simulate_is_the_one_front_door_for_cpu_policies(tiny_trace):
    from moesim.sim.simulate import simulate

    hw = get_profile("a6000")
    via = simulate(tiny_trace, hw, "hot-experts", Setting(host="xeon-8480", calibration=tiny_trace.true_ids, sim="fast"))
    direct = simulate_cpu_compute(tiny_trace, hw, "hot-experts", Setting(host="xeon-8480", calibration=tiny_trace.true_ids, sim="fast"))
    np.testing.assert_array_equal(via.tpot, direct.tpot)
    assert via.config["host"] == "xeon-8480"
    with pytest.raises(MoesimError, match="measured"):
        simulate(tiny_trace, hw, "cpu-static", Setting(timing="measured"))


def test_a_quantised_replay_moves_fewer_bytes(tiny_trace):
    from moesim.sim.quantised import with_expert_dtype
    from moesim.sim.simulate import simulate

    t = tiny_trace
    t.timings = {"attn_s": np.full((t.n_tokens, 4), 1e-3), "expert_s": np.full((t.n_tokens, 4), 2e-3),
                 "other_s": np.full(t.n_tokens, 5e-4)}
    q = with_expert_dtype(t, "int4-g32")
    assert q.model.expert_bytes == get_model("tiny").with_expert_dtype("int4-g32").expert_bytes
    assert q.timings == {} and t.timings  # measured at bf16: not reused
    assert (q.true_ids == t.true_ids).all()
    hw = get_profile("a6000")
    bf16 = simulate(t, hw, "on-demand", Setting(timing="profile", sim="fast")).summary()
    int4 = simulate(q, hw, "on-demand", Setting(sim="fast")).summary()
    assert int4["gb_moved_per_token"] == pytest.approx(bf16["gb_moved_per_token"] * q.model.expert_bytes
                                                       / t.model.expert_bytes)
    assert int4["tpot_ms"] < bf16["tpot_ms"]


def test_prefetch_top_m_copies_fewer_ahead(tmp_path):
    from moesim.sim.plan import build_plan
    from moesim.sim.prefetch_top import keep_top_predictions
    from moesim.traces.format import read_trace, write_trace

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=12, prompt_len=4, batch=2, seed=4))
    top1 = keep_top_predictions(trace, 1)
    assert keep_top_predictions(trace, 2) is trace
    full, cut = build_plan(trace, "prefetch-fom"), build_plan(top1, "prefetch-fom")
    assert (cut.prefetch <= 1 * trace.batch).all() and cut.prefetch.sum() < full.prefetch.sum()
    assert (cut.execute == full.execute).all()  # fetch-on-miss: the same experts run, the rest on demand
    assert cut.demand.sum() >= full.demand.sum()
    back = read_trace(write_trace(top1, tmp_path / "top1.npz"))  # still a valid trace
    assert (back.pred_ids == top1.pred_ids).all()
    with pytest.raises(MoesimError, match="top-m"):
        keep_top_predictions(trace, 3)


def test_without_amx_the_cpu_is_slower_once_compute_bound():
    spec, hw = get_model("qwen3-30b-a3b"), get_profile("h100-sxm")
    host = get_host("xeon-8480")
    amx, vec = expert_times(spec, hw, host, amx=True), expert_times(spec, hw, host, amx=False)
    assert vec.cpu_mem == amx.cpu_mem and vec.cpu_tok > 5 * amx.cpu_tok
    assert vec.cpu(4, 4) == amx.cpu(4, 4)  # batch 1: reading the weights dominates either way
    assert vec.cpu(4, 4096) > 2 * amx.cpu(4, 4096)


def test_prefill_with_nothing_on_the_cpu_is_the_resident_prefill():
    spec, hw = get_model("glm-4.7-flash"), get_profile("h100-sxm")  # a dense first layer too
    cm = CostModel(spec, hw, get_host(None, hw))
    times = cm.expert_times()
    resident = np.ones((spec.n_moe_layers, spec.n_experts), bool)
    for prompt in (16, 2048):
        assert prefill_time_cpu_compute(cm, times, resident, prompt) == pytest.approx(
            prefill_time(cm, prompt, offload=False), rel=1e-12)


def test_the_copy_planner_refuses_cpu_policies(tiny_trace):
    from moesim.policy import Planner
    from moesim.sim.plan import build_plan

    for name in ("cpu-static", "hot-experts", "cpu-on-miss"):
        with pytest.raises(MoesimError, match="HostPlanner"):
            Planner(name)
    with pytest.raises(MoesimError, match="computes experts on the CPU"):
        build_plan(tiny_trace, "cpu-static")


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_replay_cli_reports_a_cpu_policy(tmp_path, run):
    """The real command: a CPU-compute policy replays, and its timeline has a CPU lane."""
    import json

    trace = tmp_path / "t.npz"
    r = run("synth", "--model", "tiny", "--tokens", "4", "--out", trace, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run("replay", trace, "--hw", "a6000", "--policy", "cpu-on-miss", "--cache-gib", "0.001",
            "--out", tmp_path / "rep", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    events = json.loads((tmp_path / "rep" / "simulated.trace.json").read_text())["traceEvents"]
    assert any(e.get("tid") == 3 and e["ph"] == "X" for e in events)  # the CPU lane
    assert (tmp_path / "rep" / "timeline.png").exists()
