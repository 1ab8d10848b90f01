"""Routing statistics: skew metrics, reuse, overlap, hit-rate curves (the simulator's own
cache for LRU/LFU, Belady as the ceiling), the TPOT knee, and the fitted synthetic trace."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import hand_trace, two_layer_spec
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.setting import Setting
from moesim.sim import stats
from moesim.sim.simulate import simulate
from moesim.traces.format import read_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

EXAMPLE = Path(stats.__file__).resolve().parents[1] / "traces" / "examples" / "moe-stdlib-routing.npz"


def test_skew_metrics_at_the_extremes():
    m = stats.skew_metrics(np.array([[5] * 20, [100] + [0] * 19]))
    np.testing.assert_allclose(m["norm_entropy"], [1.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(m["top10_share"], [0.1, 1.0], atol=1e-12)
    np.testing.assert_allclose(m["gini"], [0.0, 1 - 1 / 20], atol=1e-12)


def test_reuse_distances_worked_by_hand():
    # One layer pair, top-2: expert 0 at steps 0, 1, 3; expert 1 at 0; 2 at 1; 3 at 2, 3.
    spec = two_layer_spec()
    t = hand_trace(spec, true=[[[0, 1], [0, 1]], [[0, 2], [0, 1]], [[1, 3], [0, 1]], [[0, 3], [0, 1]]],
                   pred=[[[-1, -1], [-1, -1]]] * 4)
    r = stats.reuse_stats(t)
    # Layer 0: distances 1 (0@1), 2 (1@2), 2 (0@3), 1 (3@3); layer 1: six of distance 1.
    assert r["distance_hist"][:3] == [8, 2, 0] and r["first_uses"] == 4 + 2
    np.testing.assert_allclose(r["reuse_prev_token"], [2 / 6, 1.0])
    ov = stats.adjacent_layer_overlap(t)
    assert ov["chance"] == 1.0 and ov["per_layer"] == [pytest.approx(5 / 4)]  # ids shared: 2, 1, 1, 1


def test_lru_and_lfu_curves_equal_the_simulators_cache():
    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=40, batch=2, reuse=0.5, seed=2))
    sizes = [0, 100, 300, 700]
    curve = stats.hit_rate_curve(trace, sizes)
    for ev in ("lru", "lfu"):
        sim = [simulate(trace, get_profile("a6000"), "on-demand", Setting(cache_experts=s, eviction=ev, sim="fast"))
               .summary()["cache_hit_rate"] if s else 0.0 for s in sizes]
        np.testing.assert_allclose(curve[ev], sim, atol=1e-12)
    assert curve["bytes"][1] == 100 * get_model("olmoe-1b-7b").expert_bytes


def test_belady_is_the_ceiling():
    # Cyclic a, b, c at one layer with room for 2: LRU never hits, Belady keeps two of three.
    groups = [[x] for x in [0, 1, 2] * 4]
    assert stats.online_hits(groups, 2, "lru") == 0
    assert stats.belady_hits(groups, 2) == 6  # after 3 cold misses, 2 hits in every 3 accesses
    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=120, skew=0.8, reuse=0.3, seed=1))
    c = stats.hit_rate_curve(trace)
    for ev in ("lru", "lfu"):
        assert all(b >= o - 1e-12 for b, o in zip(c["belady"], c[ev], strict=True))
    assert all(np.diff(c["belady"]) >= -1e-12) and all(np.diff(c["lru"]) >= -1e-12)
    first_uses = stats.reuse_stats(trace)["first_uses"]
    assert c["belady"][-1] == pytest.approx(1 - first_uses / c["accesses"])  # everything fits: only cold misses


def test_knee_rule():
    k = stats.knee([0, 10, 20, 40], [10.0, 6.0, 5.2, 5.0])
    assert k["knee_experts"] == 20 and k["best_tpot_ms"] == 5.0  # 5.2 <= 1.05 * 5.0


def test_routing_stats_on_a_recorded_trace_with_tpot():
    real = read_trace(EXAMPLE)
    s = stats.routing_stats(real, get_profile("a6000"), sizes=[0, 16, 64, 128])
    assert s["synthetic"] is False and len(s["popularity"]["gini"]) == real.model.n_moe_layers
    assert set(s["predictor_recall"]) == {"quasi", "stale", "oracle"}
    tp = s["tpot"]
    assert tp["tpot_ms"][0] > tp["tpot_ms"][-1] and tp["knee_experts"] in tp["sizes"]
    assert tp["knee_tpot_ms"] <= 1.05 * min(tp["tpot_ms"])


def test_fitted_synthetic_reproduces_the_recorded_hit_rates_and_tpot():
    """A synthetic trace fitted to real routing (the shipped moe-stdlib, recorded by
    moesim.executor.record) matches its hit-rate curves within 0.08 absolute and its
    simulated TPOT within 3% at every cache size tried."""
    real = read_trace(EXAMPLE)
    fake = stats.synth_like(real, real.n_tokens, real.batch, seed=3)
    assert fake.synthetic and "fitted to" in fake.header["recorded"]["how"]
    sizes = [0, 16, 32, 48, 64, 96, 128]
    a, b = stats.hit_rate_curve(real, sizes), stats.hit_rate_curve(fake, sizes)
    for ev in ("lru", "lfu", "belady"):
        np.testing.assert_allclose(b[ev], a[ev], atol=0.08)
    hw = get_profile("a6000")
    for s in (16, 64):
        ta = simulate(real, hw, "prefetch-fom", Setting(cache_experts=s, sim="fast", timing="profile")).summary()
        tb = simulate(fake, hw, "prefetch-fom", Setting(cache_experts=s, sim="fast", timing="profile")).summary()
        assert tb["tpot_ms"] == pytest.approx(ta["tpot_ms"], rel=0.03)
        assert tb["pred_recall"] == pytest.approx(ta["pred_recall"], abs=0.03)
    longer = stats.synth_like(real, 600, 3)
    assert longer.true_ids.shape == (600, real.model.n_moe_layers, 3, real.model.top_k)


def test_stats_report_writes_json_figures_and_html(tmp_path):
    from moesim.reports.stats import stats_report

    s = stats_report(EXAMPLE, tmp_path, hw="a6000", sizes=[0, 32, 128])
    for f in ("stats.json", "report.html", "popularity.png", "reuse.png", "recall.png", "hit_rate.png", "tpot.png"):
        assert (tmp_path / f).stat().st_size > 0
    back = json.loads((tmp_path / "stats.json").read_text())
    assert back["hit_rate"]["lru"] == s["hit_rate"]["lru"] and back["tpot"]["knee_experts"] == s["tpot"]["knee_experts"]
    page = (tmp_path / "report.html").read_text()
    assert page.count("<img") == 5 and "recorded trace moe-stdlib-routing.npz" in page


def test_synth_like_file_writes_a_marked_synthetic_trace(tmp_path):
    out = tmp_path / "like.npz"
    stats.synth_like_file(EXAMPLE, out, tokens=50, batch=2, seed=1)
    t = read_trace(out)
    assert t.synthetic and t.n_tokens == 50 and t.batch == 2
    assert t.header["generator"]["like"] == "moe-stdlib-routing.npz"


def test_cache_sizes_above_the_models_experts_are_cut_with_a_note():
    """A cache of 10**8 experts on a model of 4 x 16 holds the whole model: the size is cut
    to 64 (one row, not a '100000000 experts (x GiB)' row and a knee there) and said so."""
    from moesim.sim.stats import routing_stats, summary_lines

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=40, seed=1))
    res = routing_stats(trace, get_profile("a6000"), sizes=[0, 8, 64, 10**8, 200])
    assert res["hit_rate"]["sizes"] == [0, 8, 64]
    assert res["hit_rate"]["notes"] == ["cache sizes 200, 100000000 above the 64 experts tiny has "
                                        "(4 MoE layers x 16): cut to 64"]
    assert res["tpot"]["knee_experts"] <= 64
    assert any(line.startswith("note: cache sizes 200, 100000000") for line in summary_lines(res))
    assert routing_stats(trace, sizes=[0, 8])["hit_rate"]["notes"] == []
