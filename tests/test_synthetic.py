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
