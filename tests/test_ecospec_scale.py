"""EcoSpec at scale: synthetic speculative traces, deployments, draft cost, the what-if.

The fitted-generator check records a real speculative trace of the shipped tiny model
with the executor (``moesim speculate``, the real command run in-process), fits the generator to it, and
compares a fresh-seed synthetic sample's statistics with the recording's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from cli_run import BOTH_WAYS, in_process

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.sim.deployment import DEPLOYMENTS, Deployment, check_fits, seconds_per_distinct_expert, time_steps
from moesim.sim.draft import DraftProfile
from moesim.sim.ecospec import Selection, ecospec_whatif, latency_fit, selected_steps
from moesim.traces.format import read_trace, write_trace
from moesim.traces.sd_ids import PAD, ids_to_mask, mask_to_ids
from moesim.traces.synthetic_speculative import (
    SpecSynthParams,
    SynthSpec,
    fit_params,
    generate,
    recorded_views,
    statistics,
    synth_speculative,
    synthetic_sd_trace,
    synthetic_views,
    to_trace,
)

SMALL = SpecSynthParams(steps=12, branch=2, depth=3, seed=4)


def test_id_codec_round_trips_masks():
    rng = np.random.default_rng(0)
    mask = rng.random((5, 3, 7, 40)) < 0.1
    ids = mask_to_ids(mask)
    assert ids.dtype == np.int16 and ids.shape[-1] == mask.sum(-1).max()
    assert (ids_to_mask(ids, 40) == mask).all()
    assert (mask_to_ids(np.zeros((2, 4), bool), 3) == PAD).all()
    with pytest.raises(ValueError):
        mask_to_ids(np.ones((1, 5), bool), 2)


def test_synthetic_trace_is_marked_round_trips_and_replays_like_the_in_memory_steps(tmp_path):
    """The written v2 trace, re-selected by the simulator's existing what-if, gives the very
    steps the in-memory exact what-if gives (same selection code, same truth)."""
    from moesim.hardware import get_profile
    from moesim.sim.speculative import replay_sd, reselected_steps

    synth = generate(get_model("tiny"), SMALL)
    back = read_trace(write_trace(to_trace(synth), tmp_path / "sd.npz"))
    assert back.synthetic and back.speculative and back.header["generator"]["name"] == "moesim.synthetic_speculative"
    assert (back.timings["sd_chosen"] >= 0).sum() == SMALL.steps * SMALL.nodes  # every node verified
    assert back.timings["sd_accepted"].tolist() == [1 + len(s.path) for s in synth.steps]
    with pytest.raises(MoesimError, match="no measurements"):
        replay_sd(back, get_profile("a6000"))
    for gamma, sel in [(2, Selection("confidence")), (5, Selection("ecospec", "ratio")),
                       (4, Selection("ecospec", "lagrangian", 1.0))]:
        mine = selected_steps(synth, gamma, sel)
        theirs = reselected_steps(back, gamma, sel.strategy, sel.score, sel.lam(synth.spec))
        assert [s.produced for s in mine] == [s.produced for s in theirs]
        assert [s.true_union for s in mine] == [s.true_union for s in theirs]
        assert [s.rows for s in mine] == [s.rows for s in theirs]


def test_same_seed_same_steps_and_overlap_knob_moves_dispersion():
    spec = get_model("tiny")
    a, b = generate(spec, SMALL), generate(spec, SMALL)
    assert all((x.true_ids == y.true_ids).all() and x.path == y.path for x, y in zip(a.steps, b.steps, strict=True))
    lo = statistics(synthetic_views(generate(spec, replace(SMALL, steps=60, parent_overlap=0.0, sibling_overlap=0.0)),
                                    6, "confidence"), 3, 2)
    hi = statistics(synthetic_views(generate(spec, replace(SMALL, steps=60, parent_overlap=0.9, sibling_overlap=0.9)),
                                    6, "confidence"), 3, 2)
    assert hi["parent_overlap"] > lo["parent_overlap"] + 0.3
    assert hi["distinct_experts_per_step"] < lo["distinct_experts_per_step"]


def test_bad_synthetic_parameters_are_one_line_errors():
    for bad in ({"recall": 1.5}, {"steps": 0}, {"accept": (1.2,)}, {"child_prob": (0.7, 0.5)},
                {"overlap_concentration": 0}):
        with pytest.raises(MoesimError):
            SpecSynthParams(**bad)


def test_a_trace_whose_mask_would_not_fit_is_refused_before_allocating():
    spec = get_model("deepseek-v3")
    huge = SynthSpec(spec, SpecSynthParams(steps=1000, branch=2, depth=4), steps=[None] * 1000)
    with pytest.raises(MoesimError, match="MiB expert mask"):
        to_trace(huge)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sd") / "sd.npz"
    r = in_process("speculate", "--tokens", "96", "--gamma", "6", "--depth", "4", "--out", out)  # the trace the tests read
    assert r.returncode == 0, r.stderr
    return read_trace(out)


def test_fitted_generator_reproduces_a_recorded_trace(recorded):
    """Tolerances: tokens a step and distinct experts a step within 12 %, overlaps and
    recall within 0.06, per-depth acceptance within 0.12 (where the recording saw >= 10
    trials), on a fresh seed (the fit calibrates on another)."""
    sp = recorded.header["speculative"]
    depth, branch = sp["depth"], sp["branch"]
    want = statistics(recorded_views(recorded), depth, branch)
    params = fit_params(recorded, steps=150, seed=11, rounds=3)
    assert params.branch == branch and params.depth == depth
    got = statistics(synthetic_views(generate(recorded.model, params), sp["gamma"], sp["strategy"], sp["score"],
                                     sp["lambda"]), depth, branch)
    for key in ("tokens_per_step", "distinct_experts_per_step"):
        assert got[key] == pytest.approx(want[key], rel=0.12), key
    for key in ("parent_overlap", "sibling_overlap", "step_overlap", "recall"):
        assert abs(got[key] - want[key]) < 0.06, (key, got[key], want[key])
    for d, (g, w, n) in enumerate(zip(got["accept_by_depth"], want["accept_by_depth"], want["accept_trials"],
                                      strict=True)):
        if n >= 10:
            assert abs(g - w) < 0.12, (d + 1, g, w)


def test_large_models_fit_eight_h200_and_deepseek_does_not_fit_eight_h100():
    for name in ("qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3"):
        for dep in ("8xh200-tp", "8xh200-ep", "1xh200-offload"):
            check_fits(get_model(name), DEPLOYMENTS[dep])
    with pytest.raises(MoesimError, match="does not fit 8xh100-tp"):
        check_fits(get_model("deepseek-v3"), DEPLOYMENTS["8xh100-tp"])
    with pytest.raises(MoesimError):
        Deployment("x", "h200", 8, "single")
    with pytest.raises(MoesimError):
        Deployment("x", "h200", 8, "tp", offload=True)


def test_no_speculation_limit_gives_speedup_one():
    """Gamma 0, or a depth-0 tree with a free draft: every step verifies only the root."""
    spec = get_model("gpt-oss-120b")
    rows = ecospec_whatif(spec, ["8xh200-tp", "1xh200-offload"], [0], params=replace(SMALL, steps=6))
    assert rows and all(r["speedup_vs_none"] == 1.0 and r["tokens_per_step"] == 1.0 for r in rows)
    flat = ecospec_whatif(spec, ["8xh200-tp"], [4], params=replace(SMALL, steps=6, depth=0),
                          draft=DraftProfile("none"))
    assert all(r["speedup_vs_none"] == pytest.approx(1.0, abs=1e-12) for r in flat)


def test_verification_latency_is_linear_in_distinct_experts_with_the_hbm_slope():
    spec = get_model("qwen3-235b-a22b")
    synth = generate(spec, replace(SMALL, steps=8))
    for dep in ("8xh200-tp", "1xh200-offload"):
        f = latency_fit(spec, dep, synth, [1, 4, 8])
        assert f["r2"] > 0.99
        assert f["slope_ms_per_expert"] == pytest.approx(f["analytic_ms_per_expert"], rel=0.15)
    # The analytic slope is one expert's bytes split over the 8 GPUs, read at the rate the cost
    # model gives the engine (vLLM's fitted weight efficiency), never bytes / datasheet rate.
    dep = DEPLOYMENTS["8xh200-tp"]
    one = dep.cost_model(spec, shards=1)
    assert seconds_per_distinct_expert(spec, dep) == pytest.approx(one.read(spec.expert_bytes / 8, kernels=0))


def test_ecospec_loads_fewer_experts_than_confidence_when_candidates_differ():
    spec = get_model("qwen3-30b-a3b")
    synth = generate(spec, SpecSynthParams(steps=20, branch=3, depth=3, overlap_concentration=0.3,
                                           parent_overlap=0.5, sibling_overlap=0.3, recall=0.9, seed=2))

    def distinct(sel):
        return np.mean([sum(len(u) for u in s.true_union) for s in selected_steps(synth, 6, sel)])

    assert distinct(Selection("ecospec", "lagrangian", 2.0)) < 0.97 * distinct(Selection("confidence"))


def test_draft_profiles_cost():
    spec, dep = get_model("deepseek-v3"), DEPLOYMENTS["8xh200-tp"]
    one = dep.cost_model(spec, shards=1)
    eagle = DraftProfile("eagle")
    assert DraftProfile("none").tree_seconds(one, 2, 4, True) == 0.0
    shallow, deep = eagle.tree_seconds(one, 2, 2, False), eagle.tree_seconds(one, 2, 4, False)
    assert 0 < shallow < deep
    assert eagle.tree_seconds(one, 2, 4, True) > deep  # the expert predictor is charged
    assert eagle.tree_seconds(dep.cost_model(spec), 2, 4, False) < deep  # split over 8 GPUs
    dense = DraftProfile("dense", params_b=1.0)
    assert dense.forward_bytes(spec) == pytest.approx(2e9)
    with pytest.raises(MoesimError):
        DraftProfile("dense")
    with pytest.raises(MoesimError):
        DraftProfile("medusa")


def test_steps_of_another_model_are_refused():
    steps = selected_steps(generate(get_model("tiny"), SMALL), 2, Selection("confidence"))
    with pytest.raises(MoesimError, match="another model"):
        time_steps(get_model("gpt-oss-120b"), steps, DEPLOYMENTS["8xh200-tp"])


def test_synthetic_sd_trace_for_a_catalogue_model_with_dense_layers(tmp_path):
    spec = get_model("deepseek-v2-lite")
    tr = synthetic_sd_trace(spec, SpecSynthParams(steps=3, depth=2))
    back = read_trace(write_trace(tr, tmp_path / "ds.npz"))
    assert back.timings["sd_node_pred"].shape[2:] == (spec.n_moe_layers, spec.n_experts)
    assert back.timings["sd_row_true"].shape[2:] == (spec.n_moe_layers, spec.top_k)
    from moesim.hardware import get_profile
    from moesim.sim.speculative import recorded_steps, simulate_steps

    with pytest.raises(MoesimError, match="dense layers"):  # not an IndexError
        simulate_steps(back, recorded_steps(back), get_profile("h200"), "on-demand", timing="profile")


def test_synth_speculative_writes_a_trace_and_refuses_a_non_speculative_like(tmp_path, tiny_trace):
    trace, params = synth_speculative("tiny", tmp_path / "s.npz", steps=5, depth=2, recall=0.9)
    assert params.recall == 0.9 and read_trace(tmp_path / "s.npz").timings["sd_accepted"].shape == (5,)
    plain = write_trace(tiny_trace, tmp_path / "plain.npz")
    with pytest.raises(MoesimError, match="not a speculative"):
        synth_speculative("tiny", tmp_path / "x.npz", like=plain)
    with pytest.raises(MoesimError, match="unknown synthetic"):
        synth_speculative("tiny", tmp_path / "x.npz", branches=3)
    assert not (tmp_path / "x.npz").exists()


def test_synth_speculative_like_a_recording(recorded, tmp_path):
    path = tmp_path / "rec.npz"
    write_trace(recorded, path)
    trace, params = synth_speculative("qwen3-30b-a3b", tmp_path / "q.npz", like=path, steps=4)
    assert trace.header["generator"]["fitted_from"] == str(path)
    assert params.depth == recorded.header["speculative"]["depth"] and trace.model.name == "qwen3-30b-a3b"


def test_selections_parse_and_bad_ones_are_one_line():
    from moesim.errors import MoesimError
    from moesim.sim.ecospec import Selection, parse_selections

    assert parse_selections("confidence,ecospec,ecospec:lagrangian:0.5") == (
        Selection("confidence"), Selection("ecospec", "ratio"), Selection("ecospec", "lagrangian", 0.5))
    for bad in ("ecospec:lagrangian:x", "confidence:1", "ecospec:ratio:1:2", "ecospec:lagrangian:-1", "", "ecospec:ratio:1",
                "ecospec:bogus", "nope"):
        with pytest.raises(MoesimError):
            parse_selections(bad)


def test_lambda_changes_what_ecospec_verifies():
    """A larger Lagrangian lambda trades more probability for fewer experts: never more
    distinct experts per verification at the same budget (here clearly fewer)."""
    from moesim.sim.ecospec import ecospec_whatif, parse_selections
    from moesim.traces.synthetic_speculative import SpecSynthParams

    rows = ecospec_whatif("qwen3-235b-a22b", ["8xh200-tp"], [8], parse_selections("ecospec:lagrangian:0,ecospec:lagrangian:4"),
                          SpecSynthParams(steps=24, branch=3, depth=4))
    low, high = [r for r in rows if r["gamma"] == 8]
    assert high["distinct_experts_per_step"] < 0.9 * low["distinct_experts_per_step"]  # 2,359 against 3,070
    assert (low["selection"], high["selection"]) == ("ecospec lagrangian 0", "ecospec lagrangian 4")


def test_bit_mask_selection_equals_the_set_selection():
    """select_bits (the what-if's numpy path) makes select's decisions: same scores, same
    ties, same order, for confidence, ratio and Lagrangian, with and without padding."""
    from moesim.selection import Tree, pack_experts, select, select_bits

    rng = np.random.default_rng(1)
    for trial in range(150):
        n, m = int(rng.integers(1, 40)), int(rng.integers(1, 5))
        e = int(rng.choice([8, 32, 64, 100, 256]))
        k = int(rng.integers(1, min(e, 6) + 1))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        prob = rng.choice([0.5, 0.25, 0.1], n) if trial % 3 == 0 else rng.random(n)  # ties, or none
        ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(m)]) for _ in range(n + 1)])
        if trial % 5 == 0:
            ids[:, :, -1] = PAD
        tree = Tree(list(range(n)), parents, [float(x) for x in prob],
                    [[set(r[r >= 0].tolist()) for r in ids[1 + i]] for i in range(n)])
        root = [set(r[r >= 0].tolist()) for r in ids[0]]
        bits = pack_experts(ids, e)
        for strategy, kind, lam in [("confidence", "ratio", 0.0), ("ecospec", "ratio", 0.0),
                                    ("ecospec", "lagrangian", 0.05), ("ecospec", "lagrangian", 0.0)]:
            g = int(rng.integers(0, n + 2))
            assert select(tree, g, strategy, root, kind, lam) == select_bits(parents, prob, g, strategy, bits[1:],
                                                                             bits[0], kind, lam)
        full = select_bits(parents, prob, n, "ecospec", bits[1:], bits[0], "lagrangian", 0.05)
        assert select_bits(parents, prob, n // 2, "ecospec", bits[1:], bits[0], "lagrangian", 0.05) == full[: n // 2]


def test_a_dynamic_tree_grows_only_its_best_nodes():
    """expand=N: EAGLE-2's dynamic tree; each level's N most probable candidates get children."""
    p = SpecSynthParams(steps=6, branch=4, depth=3, expand=2, seed=1)
    assert p.level_sizes == [4, 8, 8] and p.nodes == 20
    synth = generate(get_model("tiny"), p)
    for st in synth.steps:
        assert len(st.tokens) == 20 and st.true_ids.shape[0] == 21
        for level_start, level_end in ((0, 4), (4, 12)):
            grown = {q for q in st.parents if level_start <= q < level_end}
            best = sorted(range(level_start, level_end), key=lambda i: (-st.prob[i], i))[:2]
            assert grown == set(best)
        node = -1
        for q in st.path:
            assert st.parents[q] == node
            node = q
    assert SpecSynthParams(branch=10, depth=6).nodes == sum(10 ** d for d in range(1, 7))


def test_the_load_ratio_and_the_lifts_carry_across_expert_counts():
    """The calibrated knobs are scale-free: the same parameters give the same load ratio
    (shared experts of unrelated tokens over uniform routing) and the same lift over chance
    on 32 experts and on 128, while a fixed Zipf exponent does not."""
    from moesim.traces.synthetic_speculative import load_ratio_of_skew, skew_for_load_ratio

    p = SpecSynthParams(steps=40, branch=2, depth=3, load_ratio=1.4, parent_overlap=0.1, seed=3)
    for name in ("tiny", "qwen3-235b-a22b"):
        spec = get_model(name)
        got = statistics(synthetic_views(generate(spec, p), 14, "confidence"), 3, 2)
        assert got["chance_overlap"] * spec.n_experts / spec.top_k == pytest.approx(1.4, rel=0.2), name
        assert abs(got["parent_lift"] - 0.1) < 0.05, (name, got["parent_lift"])
    assert load_ratio_of_skew(128, 8, skew_for_load_ratio(128, 8, 1.4)) == pytest.approx(1.4, rel=0.01)
    assert load_ratio_of_skew(128, 8, 1.0) > 3 * load_ratio_of_skew(32, 4, 1.0) / 2  # a Zipf exponent does not carry
    with pytest.raises(MoesimError):
        SpecSynthParams(load_ratio=0.5)


def test_speedups_are_reported_against_every_baseline():
    spec = get_model("gpt-oss-120b")
    rows = ecospec_whatif(spec, ["8xh200-tp", "1xh200-offload"], [1, 4, 8], params=replace(SMALL, steps=6),
                          sd_gamma=8)
    assert [r["deployment"] for r in rows[:10]] == ["8xh200-tp"] * 10  # deployment-major, as before
    for dep in ("8xh200-tp", "1xh200-offload"):
        conf = [r for r in rows if r["deployment"] == dep and r["strategy"] == "confidence" and r["gamma"] > 0]
        assert max(r["speedup_vs_best_confidence"] for r in conf) == pytest.approx(1.0)
        sd = next(r for r in conf if r["gamma"] == 8)
        assert sd["speedup_vs_sd"] == pytest.approx(1.0) and sd["speedup_vs_confidence"] == pytest.approx(1.0)
        for r in rows:
            if r["deployment"] == dep and r["gamma"] > 0:
                assert r["speedup_vs_sd"] == pytest.approx(r["speedup_vs_none"] / sd["speedup_vs_none"])
    assert all(r["speedup_vs_sd"] != r["speedup_vs_sd"] for r in ecospec_whatif(
        spec, ["8xh200-tp"], [1, 4], params=replace(SMALL, steps=4), sd_gamma=60))  # not among the gammas: NaN


def _cpu_seconds(fn, *args) -> float:
    """CPU seconds of a warm call, the fewest of three: the first call, untimed, compiles or loads
    the numba kernels it needs (a fresh clone's cold cache put one case's compilation into its
    time: a 3.1x spread), and the timed calls run with the garbage collector off after a
    collection: one timed call of the smallest case took 3.4x the others' share in the full
    suite (a collection of the suite's garbage landing in it), where alone it never did, and
    with two timed calls it did again."""
    import gc
    import time

    fn(*args)
    times = []
    for _ in range(3):
        gc.collect()
        gc.disable()
        try:
            t = time.process_time()
            fn(*args)
            times.append(time.process_time() - t)
        finally:
            gc.enable()
    return min(times)


def test_estimates_follow_the_work_within_3x_of_each_other(tmp_path):
    """What `moesim synth --speculative` and `moesim ecospec` announce before they start
    follows the work they then do: each case's estimate over its CPU seconds is within 3x of
    the others' (ratios of times taken in one run, so neither a busy machine nor a faster one
    decides the test: held to 3x in seconds it failed at 3.0x and 3.4x, the work taking less CPU
    time than where the constants were measured). How close estimates are in seconds is a
    benchmark's question (bench/bench_estimates.py; the speculative ones are not in it yet)."""
    from moesim.sim.ecospec import WHATIF_FIXED_S, parse_selections, whatif_estimate
    from moesim.traces.synthetic_speculative import synth_estimate

    ratios = {}
    cases = [("qwen3-235b-a22b", SpecSynthParams(steps=24, seed=1)),
             ("tiny", SpecSynthParams(steps=24, branch=10, depth=3, seed=1)),
             ("deepseek-v3", SpecSynthParams(steps=4, branch=10, depth=4, expand=10, seed=1))]
    for name, p in cases:
        est = synth_estimate(get_model(name), p)
        ratios[f"synth {name}"] = est.seconds / _cpu_seconds(synth_speculative, name, tmp_path / f"{name}.npz", p)
    sels = parse_selections("confidence,ecospec:lagrangian:1")
    for name, deps, gammas, p in [("qwen3-235b-a22b", ["8xh200-tp", "1xh200-offload"], [1, 4, 8],
                                   SpecSynthParams(steps=16, seed=1)),
                                  ("gpt-oss-120b", ["8xh200-tp"], [4, 16, 60],
                                   SpecSynthParams(steps=6, branch=10, depth=5, expand=10, seed=1))]:
        est = whatif_estimate([get_model(name)], len(deps), gammas, sels, p).seconds - WHATIF_FIXED_S
        ratios[f"ecospec {name}"] = est / _cpu_seconds(ecospec_whatif, name, deps, gammas, sels, p)
    assert max(ratios.values()) <= 3 * min(ratios.values()), ratios


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_long_runs_are_refused_in_one_line_with_their_estimate(tmp_path, run):
    """A tree of 10^40 candidates, or a what-if of a billion steps, is refused before any
    work, in one line that gives the estimate."""
    import time

    def moesim(*args):
        return run(*args, timeout=120, cwd=tmp_path)

    t = time.time()
    r = moesim("synth", "--speculative", "--model", "tiny", "--depth", 40, "--branch", 10, "--out", tmp_path / "x.npz")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "1.11e+40 candidates" in r.stderr and "years" in r.stderr and "refusing" in r.stderr
    r = moesim("ecospec", "--model", "deepseek-v3", "--steps", 10**9, "--gamma", "1,2,4,8,16",
               "--deployment", "8xh200-tp,8xh200-ep,1xh200-offload")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "the EcoSpec what-if" in r.stderr and "refusing" in r.stderr
    assert time.time() - t < 60 and not (tmp_path / "x.npz").exists()


def test_speculate_counts_a_steps_tokens_without_the_prefills(tmp_path):
    """--gamma 0 verifies the root alone: one token a step (it said 1.20 over 5 steps, counting the token the
    prefill produced)."""
    r = in_process("speculate", "--tokens", "6", "--gamma", "0", "--out", tmp_path / "sd.npz")
    assert r.returncode == 0, r.stderr
    assert "6 tokens in 5 verification steps (1.00 a step; the first token is the prefill's)" in " ".join(r.stderr.split())
