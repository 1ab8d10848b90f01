import json

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.traces.format import read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def test_round_trip(tmp_path, tiny_trace):
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    back = read_trace(path)
    assert back.header == tiny_trace.header
    for k in ("true_ids", "true_gates", "pred_ids", "pred_gates", "exec_ids", "token_ids", "prompt_ids"):
        np.testing.assert_array_equal(getattr(back, k), getattr(tiny_trace, k))
    assert back.model == get_model("tiny")


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, tiny_trace):
    write_trace(tiny_trace, tmp_path / "t.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]


def test_truncated_file_is_rejected(tmp_path, tiny_trace):
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(MoesimError, match="corrupt or truncated"):
        read_trace(cut)


def test_garbage_file_is_rejected(tmp_path):
    p = tmp_path / "junk.npz"
    p.write_bytes(b"hello, not a trace")
    with pytest.raises(MoesimError, match="not a readable moesim trace"):
        read_trace(p)


def _rewrite(tmp_path, trace, **changes):
    """Write a trace whose arrays or header were changed behind the writer's back."""
    arrays = {k: getattr(trace, k) for k in ("prompt_ids", "token_ids", "true_ids", "true_gates", "pred_ids",
                                              "pred_gates", "exec_ids")}
    header = dict(trace.header)
    header.update(changes.pop("header", {}))
    arrays.update(changes)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = tmp_path / "bad.npz"
    np.savez_compressed(path, **arrays)
    return path


@pytest.mark.parametrize("change, message", [
    ({"header": {"version": 3}}, "version 3"),
    ({"header": {"format": "other"}}, "not a moesim trace"),
    ({"header": {"n_tokens": 99}}, "truncated"),
    ({"true_ids": np.full((24, 4, 1, 2), 16, np.int16)}, "true_ids outside"),
    ({"true_ids": np.zeros((24, 4, 1, 2), np.int16)}, "repeats an expert"),
    ({"pred_ids": np.zeros((24, 3, 1, 2), np.int16)}, "pred_ids has shape"),
    ({"true_gates": np.full((24, 4, 1, 2), np.nan, np.float32)}, "true_gates must be finite"),
    ({"token_ids": np.full((1, 24), 999, np.int32)}, "outside the vocabulary"),
])
def test_inconsistent_traces_are_rejected(tmp_path, tiny_trace, change, message):
    with pytest.raises(MoesimError, match=message) as e:
        read_trace(_rewrite(tmp_path, tiny_trace, **change))
    assert "\n" not in str(e.value)


def test_trace_for_another_model_is_rejected(tmp_path, tiny_trace):
    path = _rewrite(tmp_path, tiny_trace, header={"model": get_model("olmoe-1b-7b").to_dict()})
    with pytest.raises(MoesimError, match="does not match model"):
        read_trace(path)


def test_unknown_arrays_are_rejected(tmp_path, tiny_trace):
    with pytest.raises(MoesimError, match="unknown array"):
        read_trace(_rewrite(tmp_path, tiny_trace, mystery=np.zeros(1)))


def test_head_keeps_a_valid_prefix(tmp_path, tiny_trace):
    short = tiny_trace.head(5)
    back = read_trace(write_trace(short, tmp_path / "s.npz"))
    assert back.n_tokens == 5


def test_synthetic_trace_is_marked_seeded_and_hits_its_hit_rate():
    spec = get_model("olmoe-1b-7b")
    params = SyntheticParams(tokens=400, hit_rate=0.8, early_hit_rate=0.4, early_layers=3, seed=7)
    a, b = synthetic_trace(spec, params), synthetic_trace(spec, params)
    assert a.synthetic and a.header["generator"]["hit_rate"] == 0.8
    np.testing.assert_array_equal(a.true_ids, b.true_ids)
    assert (a.pred_ids[:, 0] == -1).all()  # the first MoE layer has no prediction
    recall = [np.mean([len(set(p) & set(t)) / spec.top_k for p, t in
                       zip(a.pred_ids[:, m, 0], a.true_ids[:, m, 0], strict=True)]) for m in range(1, spec.n_moe_layers)]
    assert np.mean(recall[:2]) == pytest.approx(0.4, abs=0.05)
    assert np.mean(recall[3:]) == pytest.approx(0.8, abs=0.03)
    gates = a.true_gates.sum(-1)
    np.testing.assert_allclose(gates, 1, rtol=1e-5)


def test_synthetic_reuse_and_skew_shape_routing():
    spec = get_model("olmoe-1b-7b")

    def overlap(trace):
        t = trace.true_ids[:, :, 0]
        return np.mean([len(set(x) & set(y)) for x, y in zip(t[1:].reshape(-1, 8), t[:-1].reshape(-1, 8), strict=True)])

    low = synthetic_trace(spec, SyntheticParams(tokens=200, reuse=0.0, skew=0.0))
    high = synthetic_trace(spec, SyntheticParams(tokens=200, reuse=0.8, skew=0.0))
    assert overlap(high) > overlap(low) + 4  # 0.8 * 8 experts forced back in
    counts = np.bincount(synthetic_trace(spec, SyntheticParams(tokens=200, skew=1.5)).true_ids[:, 3].ravel(),
                         minlength=64)
    assert counts.max() > 5 * np.median(counts)


def test_bad_synthetic_parameters():
    with pytest.raises(MoesimError, match="hit_rate"):
        SyntheticParams(hit_rate=1.5)
    with pytest.raises(MoesimError, match="tokens"):
        SyntheticParams(tokens=0)
