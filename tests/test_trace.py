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


# --------------------------------------------------------------------------------------
# The typed header, the record codec and the plausibility limits
# --------------------------------------------------------------------------------------


def _measured(trace, **over):
    """``trace`` with self-consistent measured timings (tpot = the sum of its parts)."""
    spec, t = trace.model, trace.n_tokens
    tm = {"attn_s": np.full((t, spec.n_layers), 1e-4), "expert_s": np.full((t, spec.n_moe_layers), 2e-4),
          "stall_s": np.zeros((t, spec.n_moe_layers)), "predict_s": np.zeros((t, spec.n_layers)),
          "other_s": np.full(t, 5e-5)}
    tm["tpot_s"] = tm["attn_s"].sum(1) + tm["expert_s"].sum(1) + tm["other_s"]
    tm.update(over)
    trace.timings = tm
    return trace


def test_typed_header_reads_what_the_one_writer_wrote(tmp_path, tiny_trace):
    from moesim.traces.header import make_header

    spec = tiny_trace.model
    tiny_trace.header = make_header(
        spec, policy="prefetch-fom", params={"predictor": "quasi", "cache_experts": 7, "eviction": "lfu"},
        prompt_len=8, n_tokens=24, batch=1, seed=5, synthetic=False, prefill_s=0.25,
        recorded={"hw_profile": "a6000", "link_gbps": 12.5, "latency_us": 9.0, "device": "cpu", "transport": "x"})
    back = read_trace(write_trace(_measured(tiny_trace), tmp_path / "m.npz"))
    m = back.meta
    assert (m.policy, m.cache_experts, m.eviction, m.predictor) == ("prefetch-fom", 7, "lfu", "quasi")
    assert (m.hw_profile, m.link_gbps, m.latency_us, m.prefill_s, m.synthetic) == ("a6000", 12.5, 9.0, 0.25, False)
    assert m.recorded_policy.prefetch and m.replay_policy == "prefetch-fom" and m.model == spec
    # A synthetic trace records policy "none": replays fall back to on-demand, said in one place.
    assert synthetic_trace(spec, SyntheticParams(tokens=2)).meta.replay_policy == "on-demand"


@pytest.mark.parametrize("header, message", [
    ({"recorded": "a6000"}, "'recorded' must be an object"),
    ({"recorded": {"link_gbps": "fast"}}, "link_gbps"),
    ({"policy": {"name": "on-demand", "params": {"cache_experts": 1.5}}}, "cache_experts"),
])
def test_a_header_section_of_the_wrong_type_is_one_line(tmp_path, tiny_trace, header, message):
    with pytest.raises(MoesimError, match=message) as e:
        read_trace(_rewrite(tmp_path, tiny_trace, header=header))
    assert "\n" not in str(e.value)


def test_copy_records_are_encoded_beside_the_reader():
    from types import SimpleNamespace

    from moesim.traces.records import COPY_FIELDS, copy_arrays

    c = SimpleNamespace(layer=2, expert=5, nbytes=192, kind=1, issue=0.5, start=0.4, end=0.45)
    a = copy_arrays([(3, c)])
    assert set(a) == set(COPY_FIELDS)
    # A start read a hair before its issue is clamped: issue <= start <= end.
    assert (a["copy_issue_s"][0], a["copy_start_s"][0], a["copy_end_s"][0]) == (0.5, 0.5, 0.5)
    assert a["copy_token"].dtype == np.int32 and a["copy_expert"][0] == 5


def test_speculative_records_round_trip_with_named_sentinels():
    from moesim.traces.records import NOT_CHOSEN, PAD_EXPERT, PAD_PARENT, ROOT_PARENT, SDStep, sd_arrays, sd_steps

    layers, experts, k = 2, 4, 2
    node_pred = np.zeros((3, layers, experts), bool)
    node_pred[1, 0, 3] = True
    big = SDStep(tokens=[7, 8, 9], parents=[ROOT_PARENT, 0, ROOT_PARENT], prob=[0.5, 0.25, 0.125], chosen=[2, 0],
                 accepted=2, node_pred=node_pred, root_pred=np.eye(layers, experts, dtype=bool),
                 row_true=np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]], np.int16))
    small = SDStep(tokens=[4], parents=[ROOT_PARENT], prob=[0.9], chosen=[], accepted=1,
                   node_pred=np.zeros((1, layers, experts), bool), root_pred=np.zeros((layers, experts), bool),
                   row_true=np.array([[[0, 1], [2, 3]]], np.int16))
    arrays = sd_arrays([big, small], layers, experts, k)
    assert arrays["sd_tree_parents"][1].tolist() == [ROOT_PARENT, PAD_PARENT, PAD_PARENT]
    assert arrays["sd_chosen"][0].tolist() == [1, NOT_CHOSEN, 0]  # node 2 chosen first, node 0 second
    assert (arrays["sd_row_true"][1, 1:] == PAD_EXPERT).all()
    back = sd_steps(arrays)
    assert [b.chosen for b in back] == [[2, 0], []] and [b.tokens for b in back] == [[7, 8, 9], [4]]
    assert back[0].parents == big.parents and back[1].accepted == 1
    np.testing.assert_array_equal(back[0].node_pred, node_pred)


def test_impossible_measured_times_are_rejected_with_one_line(tmp_path, tiny_trace):
    t = _measured(tiny_trace)
    attn = t.timings["attn_s"].copy()
    attn[3, 1] = 1e30  # would replay to a TPOT of ~1e31 ms without a word
    for bad, message in [({"attn_s": attn}, "attn_s holds 1e[+]30 s"),
                         ({"tpot_s": t.timings["tpot_s"] * 1000}, "step 0: tpot_s = 1.25 s but its parts .*more than 100x apart")]:
        path = _rewrite(tmp_path, t, **{**t.timings, **bad})
        with pytest.raises(MoesimError, match=message) as e:
            read_trace(path)
        assert "\n" not in str(e.value)
    with pytest.raises(MoesimError, match="prefill_s"):
        read_trace(_rewrite(tmp_path, t, **t.timings, header={"prefill_s": 7200.0}))
    ok = read_trace(_rewrite(tmp_path, t, **t.timings))  # a consistent measurement passes
    assert ok.measured


def test_every_shipped_trace_is_plausible():
    """The limits reject corrupt values, never a real run: every recorded trace passes."""
    from pathlib import Path

    shipped = sorted(Path(__file__).parent.parent.glob("reports/**/*.npz"))
    assert shipped
    for p in shipped[:: max(1, len(shipped) // 8)]:
        read_trace(p)
