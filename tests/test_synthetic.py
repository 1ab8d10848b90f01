"""The synthetic generator: memory that never scales with the expert count, seeds,
per-layer (fitted) parameters, and the statistical knobs it promises."""

import tracemalloc

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.models import ModelSpec, get_model
from moesim.traces import synthetic as synth
from moesim.traces.format import validate
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def _output_bytes(trace):
    return sum(getattr(trace, a).nbytes for a in ("true_ids", "true_gates", "pred_ids", "pred_gates", "exec_ids"))


def test_memory_is_bounded_by_the_output_not_by_the_expert_count():
    # 4096 experts: a [tokens, layers, experts] float64 array would be 4000*4*4096*8 = 524 MB.
    spec = ModelSpec("wide", n_layers=4, n_experts=4096, top_k=8, hidden=64, expert_inter=32, vocab=256)
    tracemalloc.start()
    trace = synthetic_trace(spec, SyntheticParams(tokens=4000, prompt_len=0, skew=1.0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    scratch = 8 * synth.SCRATCH  # int64 draws of one chunk
    assert peak < _output_bytes(trace) + 6 * scratch < 4000 * 4 * 4096 * 8 / 2
    validate(trace, "wide")


def test_same_seed_same_trace_other_seed_other_trace():
    spec = get_model("deepseek-v2-lite")
    a, b = (synthetic_trace(spec, SyntheticParams(tokens=30, batch=2, seed=5)) for _ in range(2))
    for k in ("true_ids", "true_gates", "pred_ids", "token_ids"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    c = synthetic_trace(spec, SyntheticParams(tokens=30, batch=2, seed=6))
    assert not np.array_equal(a.true_ids, c.true_ids)


def test_popularity_follows_the_zipf_law():
    # Sequential sampling without replacement: with skew 0 every expert is equally likely.
    spec = get_model("olmoe-1b-7b")
    flat = synthetic_trace(spec, SyntheticParams(tokens=1500, skew=0.0, reuse=0.0)).true_ids
    counts = np.bincount(flat[:, 2].ravel(), minlength=64)  # mean 187.5, binomial sd ~13
    assert counts.min() > 0.7 * counts.mean() and counts.max() < 1.3 * counts.mean()
    skewed = synthetic_trace(spec, SyntheticParams(tokens=300, skew=1.2, reuse=0.0)).true_ids
    c = np.sort(np.bincount(skewed[:, 2].ravel(), minlength=64))[::-1]
    assert c[0] > 4 * np.median(c)


def test_fitted_per_layer_parameters_are_honoured():
    spec = get_model("tiny")  # 4 MoE layers, 16 experts, top-2
    pop = [[1.0] * 4 + [0.0] * 12, [1.0] * 16, [1.0] * 16, [0.0] * 8 + [1.0] * 8]
    p = SyntheticParams(tokens=200, popularity=tuple(map(tuple, pop)), layer_reuse=(0.0, 1.0, 0.0, 0.0),
                        layer_hit=(0.0, 1.0, 0.0, 0.5), like="a test")
    t = synthetic_trace(spec, p)
    assert t.true_ids[:, 0].max() < 4 and t.true_ids[:, 3].min() >= 8  # zero popularity: never drawn
    same = np.sort(t.true_ids[1:, 1], -1) == np.sort(t.true_ids[:-1, 1], -1)
    assert same.all()  # reuse 1: the previous token's experts forced back in
    hit = (t.pred_ids[..., :, None] == t.true_ids[..., None, :]).any(-2).mean((0, 2, 3))
    assert hit[1] == 1.0 and hit[3] == pytest.approx(0.5, abs=0.08)
    assert "fitted to a test" in t.header["recorded"]["how"] and t.header["generator"]["layer_reuse"][1] == 1.0


def test_per_layer_parameters_must_match_the_model():
    spec = get_model("tiny")
    with pytest.raises(MoesimError, match="4 MoE layers"):
        synthetic_trace(spec, SyntheticParams(layer_reuse=(0.1, 0.2)))
    with pytest.raises(MoesimError, match="16 experts"):
        synthetic_trace(spec, SyntheticParams(popularity=((1.0, 1.0),) * 4))
    with pytest.raises(MoesimError, match="layer_hit"):
        SyntheticParams(layer_hit=(1.5,))


def test_rows_with_too_few_usable_draws_fall_back_to_exact_sampling():
    # Layer 0 can only ever route to experts {3, 7}; predictions there must exclude both
    # when missed, which leaves only zero-popularity experts: the Gumbel-top-k fallback.
    spec = get_model("tiny")
    pop = [[0.0] * 16 for _ in range(4)]
    for row in pop:
        row[3] = row[7] = 1.0
        row[11] = 1e-9
    t = synthetic_trace(spec, SyntheticParams(tokens=50, batch=2, popularity=tuple(map(tuple, pop)),
                                              layer_hit=(0.0,) * 4, layer_reuse=(0.0,) * 4))
    assert set(np.unique(t.true_ids)) <= {3, 7, 11}
    validate(t, "fallback")
    p = np.sort(t.pred_ids[:, 1:], -1)
    assert (p[..., 1:] != p[..., :-1]).all() and p.min() >= 0


# ---------------------------------------------------------------------------------------
# Lookahead and draw_seed
# ---------------------------------------------------------------------------------------


def test_lookahead_predicts_n_layers_ahead_with_the_hit_rate_to_the_n():
    spec = get_model("olmoe-1b-7b")  # 16 MoE layers
    for n in (1, 3):
        t = synthetic_trace(spec, SyntheticParams(tokens=1500, hit_rate=0.9, early_layers=0, lookahead=n, seed=2))
        validate(t, "ahead")
        assert (t.pred_ids[:, :n] == -1).all() and (t.pred_ids[:, n:] >= 0).all()
        assert (t.pred_gates == t.true_gates).all()  # stored once (format.repeated_members)
        hit = (t.pred_ids[..., :, None] == t.true_ids[..., None, :]).any(-2).mean((0, 2, 3))
        np.testing.assert_allclose(hit[n:], 0.9 ** n, atol=0.02)
        assert t.meta.lookahead == n and t.header["generator"]["lookahead"] == n
        assert ("lookahead" in t.header) == (n != 1)  # the top-level key only when it is not 1
    with pytest.raises(MoesimError, match="--lookahead 16 must be less than"):
        synthetic_trace(spec, SyntheticParams(lookahead=16))
    with pytest.raises(MoesimError, match="lookahead must be an integer >= 1"):
        SyntheticParams(lookahead=0)


def test_read_trace_refuses_a_lookahead_the_model_cannot_have(tmp_path):
    from moesim.traces.format import read_trace, write_trace

    t = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=4, lookahead=2))  # tiny: 4 MoE layers
    assert read_trace(write_trace(t, tmp_path / "ok.npz")).meta.lookahead == 2
    for bad in (0, 4, 9):
        t.header["lookahead"] = bad
        with pytest.raises(MoesimError, match=f"lookahead {bad} must be >= 1 and less than tiny's 4 MoE layers"):
            write_trace(t, tmp_path / "bad.npz")  # the writer validates as the reader does
    t.header["lookahead"] = 2
    path = write_trace(t, tmp_path / "bad.npz")
    with np.load(path) as z:  # the file, edited behind the writer's back
        arrays = {k: z[k] for k in z.files}
    import json

    header = json.loads(bytes(arrays["header"]).decode())
    header["lookahead"] = 5
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(MoesimError, match=r"bad\.npz: trace header lookahead 5 must be"):
        read_trace(path)


def test_synth_like_keeps_the_like_traces_lookahead_unless_given():
    from moesim.sim.stats import fit_synthetic, synth_like

    spec = get_model("olmoe-1b-7b")
    real = synthetic_trace(spec, SyntheticParams(tokens=600, hit_rate=0.9, early_layers=0, lookahead=2, seed=1))
    fit = fit_synthetic(real)
    assert fit.lookahead == 2 and fit.layer_hit[5] == pytest.approx(0.9, abs=0.03)  # the distance-1 rate
    like = synth_like(real, 600)
    assert like.meta.lookahead == 2 and (like.pred_ids[:, :2] == -1).all()
    rec = (like.pred_ids[..., :, None] == like.true_ids[..., None, :]).any(-2).mean((0, 2, 3))
    assert rec[2:].mean() == pytest.approx(0.81, abs=0.03)  # the like-trace's recall at distance 2
    assert synth_like(real, 50, lookahead=1).meta.lookahead == 1


def test_draw_seed_keeps_the_popularity_and_redraws_the_routing():
    spec = get_model("qwen3-30b-a3b")
    base = SyntheticParams(tokens=400, seed=11)
    a = synthetic_trace(spec, base)
    b = synthetic_trace(spec, SyntheticParams(tokens=400, seed=11, draw_seed=12))
    c = synthetic_trace(spec, SyntheticParams(tokens=400, seed=12))
    assert not np.array_equal(a.true_ids, b.true_ids)

    def counts(t):
        return np.stack([np.bincount(t.true_ids[:, j].ravel(), minlength=spec.n_experts) for j in range(48)])

    ca, cb, cc = counts(a), counts(b), counts(c)
    corr = [np.corrcoef(ca[j], cb[j])[0, 1] for j in range(48)]
    assert min(corr) > 0.85  # the same hot experts, layer by layer
    assert np.mean([np.corrcoef(ca[j], cc[j])[0, 1] for j in range(48)]) < 0.3  # a new seed: a new ranking
    assert b.header["generator"]["draw_seed"] == 12 and a.header["generator"]["draw_seed"] is None
    # draw_seed=None draws from seed: identical to draw_seed=seed, array for array
    same = synthetic_trace(spec, SyntheticParams(tokens=400, seed=11, draw_seed=11))
    for k in ("true_ids", "true_gates", "pred_ids", "pred_gates", "exec_ids", "token_ids", "prompt_ids"):
        np.testing.assert_array_equal(getattr(a, k), getattr(same, k))


def test_default_traces_are_pinned_bit_for_bit():
    """A change to what a seed draws shows here (and in every committed synthetic figure)."""
    import hashlib

    t = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=20, batch=2, seed=7))
    digest = hashlib.sha256(t.true_ids.tobytes() + t.pred_ids.tobytes() + t.token_ids.tobytes()).hexdigest()
    assert digest[:16] == "079cd107e7ed91a6"


# ---------------------------------------------------------------------------------------
# The compiled generator draws what the numpy one did (its routing kept here as the reference)
# ---------------------------------------------------------------------------------------


def _reference_routing(spec, params):
    """true_ids and pred_ids as the numpy generator before the compiled one drew them:
    the same laws (its popularity ranking is the same seed's), other random numbers."""
    from moesim.traces.synthetic import _log_popularity

    seeds = np.random.SeedSequence(params.seed).spawn(5)
    r_pop, r_route, _, r_pred, _ = (np.random.default_rng(s) for s in seeds)
    t, m, b, k = params.tokens, spec.n_moe_layers, params.batch, spec.top_k
    logp = _log_popularity(spec, params, r_pop)
    reuse = params.layer_reuse_rates(m)[:, None, None]
    hit = params.layer_hit_rates(m)[:, None, None]

    def fill(forced, exclude, rng):  # exact sequential sampling: Gumbel-top-k over the allowed experts
        keys = logp[None, :, None, :] + rng.gumbel(size=(*forced.shape[:-1], spec.n_experts))
        rows = np.indices(exclude.shape)
        ex = exclude >= 0
        keys[rows[0][ex], rows[1][ex], rows[2][ex], exclude[ex]] = -np.inf
        order = np.argsort(-keys, -1)[..., :k]
        out = forced.copy()
        for idx in np.ndindex(forced.shape[:-1]):
            got = [x for x in forced[idx] if x >= 0]
            got += [x for x in order[idx] if x not in got][: k - len(got)]
            out[idx] = got
        return out

    true = np.empty((t, m, b, k), np.int64)
    prev = None
    for s in range(t):
        keep = np.where(r_route.random((m, b, k)) < reuse, prev, -1) if prev is not None else np.full((m, b, k), -1)
        prev = fill(keep[None], keep[None], r_route)[0]
        true[s] = prev
    kept = np.where(r_pred.random((t, m, b, k)) < hit[None], true, -1)
    pred = fill(kept, true, r_pred)
    pred[:, 0] = -1
    return true, pred


def test_the_compiled_generator_draws_the_laws_of_the_reference():
    spec = get_model("olmoe-1b-7b")
    p = SyntheticParams(tokens=400, batch=2, skew=1.2, reuse=0.4, hit_rate=0.8, seed=3)
    fast = synthetic_trace(spec, p)
    ref_true, ref_pred = _reference_routing(spec, p)
    n = p.tokens * p.batch * spec.top_k
    for layer in (0, 7, 15):
        fa = np.bincount(fast.true_ids[:, layer].ravel(), minlength=64) / n
        fr = np.bincount(ref_true[:, layer].ravel(), minlength=64) / n
        assert np.abs(fa - fr).max() < 0.03 and np.corrcoef(fa, fr)[0, 1] > 0.97  # one popularity, one law

    def reuse(true):
        return (true[1:, ..., :, None] == true[:-1, ..., None, :]).any(-1).mean()

    def recall(true, pred):
        return (pred[:, 1:, ..., :, None] == true[:, 1:, ..., None, :]).any(-2).mean()

    assert reuse(fast.true_ids) == pytest.approx(reuse(ref_true), abs=0.02)
    assert recall(fast.true_ids, fast.pred_ids) == pytest.approx(recall(ref_true, ref_pred), abs=0.02)
    forced = fast.true_ids[1:, :, :, 0] == fast.true_ids[:-1, :, :, 0]  # forced experts come first, in order
    ref_forced = ref_true[1:, :, :, 0] == ref_true[:-1, :, :, 0]
    assert forced.mean() == pytest.approx(ref_forced.mean(), abs=0.02)
    g = fast.true_gates
    assert (np.diff(g, axis=-1) <= 0).all() and np.allclose(g.sum(-1), 1, atol=1e-5)
    z = -np.sort(-np.random.default_rng(0).normal(size=(20000, spec.top_k)), -1)  # the reference's gates
    ref_g = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    np.testing.assert_allclose(g.reshape(-1, spec.top_k).mean(0), ref_g.mean(0), atol=0.01)
