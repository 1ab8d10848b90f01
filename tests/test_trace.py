import json
import re

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
    arrays = {k: a for k, a in arrays.items() if a is not None}  # None: the member left out
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = tmp_path / "bad.npz"
    np.savez_compressed(path, **arrays)
    return path


@pytest.mark.parametrize("change, message", [
    ({"header": {"version": 5}}, "version 5"),
    ({"header": {"same_as": {"exec_ids": "true_ids"}}}, "'true_ids' must be stored and 'exec_ids' not"),
    ({"header": {"same_as": {"true_ids": "exec_ids"}}, "true_ids": None}, "not an earlier routing array"),
    ({"header": {"same_as": {"pred_gates": "true_ids"}}, "pred_gates": None}, "not an earlier routing array of its"),
    ({"header": {"same_as": {"exec_ids": "pred_ids", "pred_ids": "true_ids"}}, "exec_ids": None, "pred_ids": None},
     "not an earlier"),
    ({"header": {"same_as": {"exec_ids": "nope"}}, "exec_ids": None}, "'nope' is not an earlier"),
    ({"header": {"same_as": ["exec_ids"]}}, "same_as must be an object .* got list"),
    ({"header": {"same_as": {"exec_ids": "true_ids"}, "version": 2}, "exec_ids": None},
     "same_as .repeated arrays. needs format version 3; the header says version 2"),
    ({"header": {"version": True}}, "version True"),  # True == 1: was read as version 1
    ({"header": {"version": 3.0}}, "version 3.0"),
    ({"header": {"format": "other"}}, "not a moesim trace"),
    ({"header": {"n_tokens": 99}}, "truncated"),
    ({"header": {"n_tokens": "24"}}, "n_tokens '24' must be a whole number"),  # was "says 24 tokens but ... 24"
    ({"true_ids": np.ones((24, 4, 1, 2), np.uint8)}, "dtype uint8, expected a signed integer"),
    ({"true_ids": np.full((24, 4, 1, 2), 16, np.int16)}, "true_ids outside"),
    ({"true_ids": np.zeros((24, 4, 1, 2), np.int16)}, "repeats an expert"),
    ({"pred_ids": np.zeros((24, 3, 1, 2), np.int16)}, "pred_ids has shape"),
    ({"true_gates": np.full((24, 4, 1, 2), np.nan, np.float32)}, "true_gates must be finite"),
    ({"token_ids": np.full((1, 24), 999, np.int32)}, "outside the vocabulary"),
    ({"header": {"prompt_len": 10**12}}, "prompt_len 1000000000000 is not the"),  # was a TTFT of 5.5e15 ms
    ({"header": {"prompt_len": -5}}, "prompt_len -5 is not the"),
    ({"header": {"batch": 2}}, "says batch 2 but the arrays hold 1"),  # was ignored
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


@pytest.mark.parametrize("model, message", [
    ({"attention": {"n_heads": 0}}, "n_heads >= 1"),
    ({"attention": {"n_kv_heads": 3}}, "n_kv_heads 3 must divide n_heads 4"),
    ({"n_shared": -1}, "n_shared must be >= 0"),
    ({"sliding_window": -5}, "sliding_window must be >= 0"),
    # round 6: replayed at 3e28 ms a token, 6e9 ms, or read as 1
    ({"hidden": 1e30}, "hidden must be a whole number"),
    ({"hidden": 10**30}, "hidden 1000000000000000000000000000000 is beyond any model's .262,144 at most."),
    ({"expert_inter": 10**12}, "expert_inter .* is beyond any model's"),
    ({"vocab": 10**15}, "vocab .* is beyond any model's"),
    ({"hidden": True}, "hidden must be a whole number .got True."),
    ({"hidden": 2048.5}, "hidden must be a whole number .got 2048.5."),
])
def test_a_header_model_of_impossible_geometry_is_one_line(tmp_path, tiny_trace, model, message):
    """A stranger edited these into a header and got a replay (a faster one, for n_shared -1)."""
    spec = json.loads(json.dumps(tiny_trace.header["model"]))
    for k, v in model.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) else v
    with pytest.raises(MoesimError, match=message) as e:
        read_trace(_rewrite(tmp_path, tiny_trace, header={"model": spec}))
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


# --------------------------------------------------------------------------------------
# The stored layout: large members uncompressed, aligned and mapped on read
# --------------------------------------------------------------------------------------


def _stored_everywhere(monkeypatch):
    """Every member counts as large: the tiny trace takes the path a 100k-token one does."""
    from moesim.traces import format as fmt

    monkeypatch.setattr(fmt, "STORE_MIN_BYTES", 0)


def _mapped(a: np.ndarray) -> bool:
    import mmap

    while a is not None and not isinstance(a, mmap.mmap):
        a = a.obj if isinstance(a, memoryview) else a.base
    return a is not None


def test_large_members_are_stored_aligned_and_read_by_numpy(tmp_path, tiny_trace, monkeypatch):
    import zipfile

    from moesim.traces.format import ALIGN

    _stored_everywhere(monkeypatch)
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    with zipfile.ZipFile(path) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:  # each member's array data starts on an ALIGN boundary
        for info in z.infolist():
            name_len, extra_len = np.frombuffer(raw[info.header_offset + 26:info.header_offset + 30], "<u2")
            start = info.header_offset + 30 + int(name_len) + int(extra_len)
            header_len = int(np.frombuffer(raw[start + 8:start + 10], "<u2")[0])
            assert (start + 10 + header_len) % ALIGN == 0, info.filename
    with np.load(path, allow_pickle=False) as z:  # still a plain .npz to numpy
        np.testing.assert_array_equal(z["true_ids"], tiny_trace.true_ids)
        np.testing.assert_array_equal(z["true_gates"], tiny_trace.true_gates)


def test_stored_round_trip_maps_the_routing_and_never_changes_the_file(tmp_path, tiny_trace, monkeypatch):
    import hashlib

    from moesim.traces.format import ROUTING

    _stored_everywhere(monkeypatch)
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    back = read_trace(path)
    assert back.header == tiny_trace.header
    for k in (*ROUTING, "token_ids", "prompt_ids"):
        np.testing.assert_array_equal(getattr(back, k), getattr(tiny_trace, k))
        # ids are stored in the narrowest exact dtype (int8: tiny has 16 experts), the rest as they were
        assert getattr(back, k).dtype == (np.int8 if k.endswith("_ids") and k in ROUTING else getattr(tiny_trace, k).dtype)
    assert all(_mapped(getattr(back, k)) for k in ROUTING)
    assert back.true_ids.flags.writeable and back.true_ids.flags.aligned
    back.true_ids[0, 0, 0, 0] += 1  # copy-on-write: the array changes, the file does not
    back.true_gates[:] = 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    again = read_trace(path)
    np.testing.assert_array_equal(again.true_ids, tiny_trace.true_ids)
    # A trace read from the file can be written over that same file (atomic rename).
    write_trace(again.head(10), path)
    assert read_trace(path).n_tokens == 10


def test_small_traces_stay_compressed(tmp_path, tiny_trace):
    import zipfile

    path = write_trace(tiny_trace, tmp_path / "t.npz")
    with zipfile.ZipFile(path) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}


def test_old_compressed_and_numpy_written_traces_still_read(tmp_path, tiny_trace):
    """Traces written before the stored layout (np.savez_compressed), and .npz files that
    numpy's own np.savez wrote (stored, not aligned: copied instead of mapped)."""
    arrays = {k: getattr(tiny_trace, k) for k in ("prompt_ids", "token_ids", "true_ids", "true_gates", "pred_ids",
                                                   "pred_gates", "exec_ids")}
    arrays["header"] = np.frombuffer(json.dumps(tiny_trace.header).encode(), np.uint8)
    for save in (np.savez_compressed, np.savez):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, **arrays)
        back = read_trace(path)
        for k, a in arrays.items():
            if k != "header":
                np.testing.assert_array_equal(getattr(back, k), a)


def _member_span(path, name):
    """(start of the array data, its length) of member ``name`` of a stored .npz."""
    import zipfile

    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{name}.npy")
    name_len, extra_len = np.frombuffer(raw[info.header_offset + 26:info.header_offset + 30], "<u2")
    start = info.header_offset + 30 + int(name_len) + int(extra_len)
    header_len = int(np.frombuffer(raw[start + 8:start + 10], "<u2")[0])
    return start + 10 + header_len, info.file_size - 10 - header_len


@pytest.mark.parametrize("name", ["true_ids", "true_gates", "pred_ids", "token_ids"])
def test_a_flipped_byte_in_stored_data_is_one_line(tmp_path, tiny_trace, monkeypatch, name):
    """A stored array has no zlib stream to fail: its CRC-32 catches what its values do not
    (a gate still in [0, 1], an id still in range)."""
    _stored_everywhere(monkeypatch)
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    start, n = _member_span(path, name)
    raw = bytearray(path.read_bytes())
    raw[start + n // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(MoesimError, match="corrupt or truncated.*CRC") as e:
        read_trace(path)
    assert "\n" not in str(e.value)


def test_hostile_stored_members_are_one_line(tmp_path, tiny_trace, monkeypatch):
    import zipfile

    _stored_everywhere(monkeypatch)
    path = write_trace(tiny_trace, tmp_path / "t.npz")
    raw = path.read_bytes()
    cases = {"cut": raw[: len(raw) * 2 // 3]}
    # A header that claims more rows than the member holds.
    start, _ = _member_span(path, "true_ids")
    head = raw[start - 128:start]
    grown = bytes(raw).replace(b"(24, 4, 1, 2)", b"(99, 4, 1, 2)", 1)
    assert grown != raw and head
    cases["grown"] = grown
    # An object array (a pickle) stored under a routing name, and a member named twice.
    obj = tmp_path / "obj.npz"
    with zipfile.ZipFile(obj, "w") as z, z.open("true_ids.npy", "w") as f:
        np.lib.format.write_array(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cases["object"] = obj.read_bytes()
    twice = tmp_path / "twice.npz"
    with zipfile.ZipFile(twice, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        for _ in range(2):
            with z.open("true_ids.npy", "w") as f:
                np.lib.format.write_array(f, tiny_trace.true_ids)
    cases["twice"] = twice.read_bytes()
    # A member flagged encrypted (zipfile: "password required"), in the default layout.
    small = bytearray(write_trace(tiny_trace.head(3), tmp_path / "small.npz").read_bytes())
    central = small.index(b"PK\x01\x02")
    small[central + 8] |= 1
    cases["encrypted"] = bytes(small)
    for label, data in cases.items():
        p = tmp_path / f"{label}.npz"
        p.write_bytes(data)
        with pytest.raises(MoesimError, match="corrupt or truncated") as e:
            read_trace(p)
        assert "\n" not in str(e.value), label


def test_stored_checks_give_the_same_errors(tmp_path, tiny_trace, monkeypatch):
    """Range, repeat and finiteness checks read mapped arrays from the file: same messages."""
    _stored_everywhere(monkeypatch)
    for change, message in [({"true_ids": np.full((24, 4, 1, 2), 16, np.int16)}, "true_ids outside"),
                            ({"true_ids": np.zeros((24, 4, 1, 2), np.int16)}, "repeats an expert"),
                            ({"exec_ids": np.full((24, 4, 1, 2), -2, np.int16)}, "exec_ids outside"),
                            ({"true_gates": np.full((24, 4, 1, 2), np.inf, np.float32)}, "true_gates must be finite")]:
        t = tiny_trace.head(24)
        for k, v in change.items():
            setattr(t, k, v)
        arrays = {k: getattr(t, k) for k in ("prompt_ids", "token_ids", "true_ids", "true_gates", "pred_ids",
                                              "pred_gates", "exec_ids")}
        arrays["header"] = np.frombuffer(json.dumps(t.header).encode(), np.uint8)
        from moesim.traces.format import _write_npz

        path = tmp_path / "bad.npz"
        with open(path, "wb") as f:
            _write_npz(f, arrays)
        with pytest.raises(MoesimError, match=message) as e:
            read_trace(path)
        assert "\n" not in str(e.value)


def test_row_repeats_are_found_at_any_width():
    from moesim.traces.format import _has_repeat

    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 8, 16, 17, 40):
        rows = np.stack([rng.permutation(64)[:k] for _ in range(50)]).astype(np.int16)
        assert not _has_repeat(rows)
        if k > 1:
            rows[17, k - 1] = rows[17, 0]
            assert _has_repeat(rows)


def test_a_repeated_routing_array_is_stored_once_and_read_back_as_it_was(tmp_path):
    """exec_ids equal to true_ids (a synthetic trace, a run that executed the true experts)
    is written once, the header naming the repeat (version 3; 4 here, tiny's ids being one byte); it reads back
    equal, read-only,
    and a trace whose arrays all differ stores all five."""
    import zipfile

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=30, seed=3))
    path = write_trace(trace, tmp_path / "t.npz")
    names = zipfile.ZipFile(path).namelist()
    assert "exec_ids.npy" not in names and "pred_gates.npy" not in names
    back = read_trace(path)
    assert back.header["same_as"] == {"exec_ids": "true_ids", "pred_gates": "true_gates"}
    assert back.header["version"] == 4
    assert np.array_equal(back.exec_ids, trace.true_ids) and back.exec_ids.dtype == back.true_ids.dtype == np.int8
    assert np.array_equal(back.pred_gates, trace.true_gates)
    with pytest.raises(ValueError):
        back.exec_ids[0, 0, 0, 0] = 1
    changed = np.array(back.exec_ids)
    changed[0, 0, 0, 0] = -1  # the run skipped one expert
    back.exec_ids = changed
    back.pred_gates = np.where(back.pred_ids >= 0, back.true_gates, 0).astype(np.float32)  # as a recorded run's
    again = read_trace(write_trace(back, tmp_path / "u.npz"))
    assert "same_as" not in again.header and np.array_equal(again.exec_ids, changed)
    assert {"exec_ids.npy", "pred_gates.npy"} <= set(zipfile.ZipFile(tmp_path / "u.npz").namelist())


def test_a_deflated_member_the_header_contradicts_is_refused_before_it_is_unpacked(tmp_path):
    """The stranger's round 5: a true_ids member of zeros deflates ~1000:1, so a small file unpacked
    gigabytes (15 s) before its shape was refused. Now its .npy header is checked against the
    trace header's shape first (the message names both; the full checks' would say 'arrays hold')."""
    import io
    import json
    import zipfile

    from numpy.lib import format as npf

    from moesim.traces.format import EARLY_SHAPE_BYTES, ROUTING

    t = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=4, seed=1))
    header = {**t.header, "n_tokens": 4, "batch": 1, "version": 2}
    header.pop("same_as", None)
    rows = EARLY_SHAPE_BYTES // (16 * 8 * 2) + 1  # just past the early check's size
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        def put(name, a):
            buf = io.BytesIO()
            npf.write_array(buf, a)
            z.writestr(f"{name}.npy", buf.getvalue())
        put("header", np.frombuffer(json.dumps(header).encode(), np.uint8))
        put("prompt_ids", t.prompt_ids)
        put("token_ids", t.token_ids)
        with z.open("true_ids.npy", "w", force_zip64=True) as f:
            head = io.BytesIO()
            npf.write_array_header_1_0(head, {"descr": "<i2", "fortran_order": False, "shape": (rows, 16, 1, 8)})
            f.write(head.getvalue())
            f.write(bytes(rows * 16 * 8 * 2))
        for name in ROUTING[1:]:
            put(name, np.asarray(getattr(t, name)))
    assert path.stat().st_size < EARLY_SHAPE_BYTES // 100
    with pytest.raises(MoesimError, match=re.escape(f"true_ids has shape ({rows}, 16, 1, 8), expected (4, 16, 1, 8) "
                                                    "(the header's tokens")):
        read_trace(path)
