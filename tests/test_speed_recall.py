"""The simulator's prediction recall: the compiled pass long traces take (issue 25, the
one ``moesim stats`` reports) against the numpy definition short ones keep, on short
random traces; a prediction that names a true expert twice counts it once."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.sim import stats
from moesim.sim.simulate import RECALL_COMPILED_MIN, _prediction_recall_numpy, prediction_recall


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**31),
       st.floats(0, 1))
def test_prediction_recall_is_its_numpy_definition(tokens, layers, batch, top_k, seed, none):
    rng = np.random.default_rng(seed)
    e = top_k + int(rng.integers(0, 8))
    true = np.argsort(rng.random((tokens, layers, batch, e)), -1)[..., :top_k].astype(np.int16)
    pred = np.where(rng.random(true.shape) < 0.6, true, rng.integers(0, e, true.shape)).astype(np.int16)
    pred = np.where(rng.random(true.shape[:3] + (1,)) < none, -1, pred)  # rows without a prediction
    pred = np.where(rng.random(true.shape) < 0.1, -1, pred)  # and partial ones
    trace = SimpleNamespace(true_ids=true, pred_ids=pred, n_tokens=tokens, model=SimpleNamespace(n_experts=e))
    ref = _prediction_recall_numpy(trace)
    hits, rows = stats.recall_counts(true, pred, e)
    got = hits / top_k / rows if rows else float("nan")
    assert (np.isnan(ref) and np.isnan(got)) or got == pytest.approx(ref, rel=1e-12, abs=0)


def test_a_long_trace_takes_the_compiled_pass_and_gets_the_same_recall():
    rng = np.random.default_rng(1)
    t, m, b, e, k = RECALL_COMPILED_MIN // (16 * 8) + 1, 16, 1, 64, 8
    true = np.argsort(rng.random((t, m, b, e)).astype(np.float32), -1)[..., :k].astype(np.int16)
    pred = np.where(rng.random(true.shape) < 0.7, true, rng.integers(0, e, true.shape)).astype(np.int16)
    pred[:, 0] = -1
    trace = SimpleNamespace(true_ids=true, pred_ids=pred, n_tokens=t, model=SimpleNamespace(n_experts=e))
    assert prediction_recall(trace) == pytest.approx(_prediction_recall_numpy(trace), rel=1e-12, abs=0)


def test_a_repeated_prediction_counts_its_expert_once():
    """Predicting [1, 1] for true [1, 2] finds one of the two true experts: recall 0.5 (it
    was 1.0 when each predicted slot counted), in the simulator and in stats alike."""
    true = np.array([[[[1, 2]]]], np.int16)
    pred = np.array([[[[1, 1]]]], np.int16)
    trace = SimpleNamespace(true_ids=true, pred_ids=pred, n_tokens=1, model=SimpleNamespace(n_experts=4))
    assert prediction_recall(trace) == 0.5 and stats.recall_counts(true, pred, 4) == (1, 1)
