"""Expert ids stored in the narrowest exact dtype (issue 40): int8 for a model of at most 128
experts (format version 4), int16 above (version 3, as before). Every test here writes a real
file and reads it back: the member's dtype and bytes in the zip, and every reader's results
on the narrow trace equal to those on the same routing held as the old wide dtypes."""

from __future__ import annotations

import json
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from numpy.lib import format as npf

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.traces.format import ID_ARRAYS, ROUTING, Streamed, id_dtype, read_trace, write_trace, write_trace_streamed
from moesim.traces.header import BYTE_IDS_VERSION, READABLE
from moesim.traces.synthetic import SyntheticParams, synthetic_trace, write_synthetic_trace


def member_dtypes(path) -> dict[str, np.dtype]:
    """Each .npy member's dtype as the file declares it (its own header, not the reader's)."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            with z.open(name) as f:
                npf.read_magic(f)
                out[name[:-4]] = npf.read_array_header_1_0(f)[2]
    return out


def widened(trace, dtype):
    """The same trace with every id array held as ``dtype`` (what traces before version 4 held)."""
    return replace(trace, **{a: np.asarray(getattr(trace, a)).astype(dtype) for a in ID_ARRAYS})


def test_id_dtype_is_the_narrowest_that_holds_every_id_and_minus_one():
    assert [id_dtype(e) for e in (1, 8, 127, 128)] == [np.dtype(np.int8)] * 4
    assert [id_dtype(e) for e in (129, 256, 32768)] == [np.dtype(np.int16)] * 3
    assert id_dtype(32769) == np.dtype(np.int32)
    for e in (128, 256, 32768):
        info = np.iinfo(id_dtype(e))
        assert info.min <= -1 and info.max >= e - 1


@pytest.mark.parametrize("model, dtype, version", [("qwen3-30b-a3b", np.int8, BYTE_IDS_VERSION),
                                                   ("deepseek-v3", np.int16, 3)])
@pytest.mark.parametrize("wide", [np.int16, np.int32, np.int64])
def test_write_trace_stores_ids_narrow_and_they_read_back_equal(tmp_path, model, dtype, version, wide):
    trace = synthetic_trace(get_model(model), SyntheticParams(tokens=40, seed=5))
    old = widened(trace, wide)
    path = write_trace(old, tmp_path / "t.npz")
    stored = member_dtypes(path)
    assert {stored[a] for a in ID_ARRAYS if a in stored} == {np.dtype(dtype)}
    assert stored["true_gates"] == np.dtype(np.float32)  # gates stay exact
    back = read_trace(path)
    assert back.header["version"] == version and version in READABLE
    for a in ROUTING:
        got = getattr(back, a)
        assert np.array_equal(got, getattr(trace, a)), a
        assert got.dtype == (np.dtype(dtype) if a in ID_ARRAYS else np.float32), a
    assert back.header["same_as"] == {"exec_ids": "true_ids", "pred_gates": "true_gates"}  # found after the cast
    if model == "qwen3-30b-a3b":
        assert back.true_ids.max() == 127 and (back.pred_ids == -1).any()  # both ends of int8 in use


def test_a_128_expert_trace_costs_a_byte_an_id_slot(tmp_path):
    spec = get_model("qwen3-30b-a3b")
    params = SyntheticParams(tokens=4000, seed=2)  # members above STORE_MIN_BYTES: stored, mapped
    write_synthetic_trace(spec, params, tmp_path / "narrow.npz")
    slots = params.tokens * spec.n_moe_layers * spec.top_k
    with zipfile.ZipFile(tmp_path / "narrow.npz") as z:
        sizes = {i.filename[:-4]: i.file_size for i in z.infolist()}
    assert slots <= sizes["true_ids"] < slots + 256 and slots <= sizes["pred_ids"] < slots + 256
    assert sizes["true_gates"] >= 4 * slots
    wide = widened(read_trace(tmp_path / "narrow.npz"), np.int16)
    np.savez(tmp_path / "wide.npz", header=np.frombuffer(json.dumps({**wide.header, "version": 3}).encode(), np.uint8),
             prompt_ids=wide.prompt_ids, token_ids=wide.token_ids,
             **{a: getattr(wide, a) for a in ("true_ids", "true_gates", "pred_ids")})
    assert (tmp_path / "narrow.npz").stat().st_size < 0.8 * (tmp_path / "wide.npz").stat().st_size


def test_the_streamed_writer_casts_wide_blocks_to_the_same_file(tmp_path):
    """A streamed writer handed int16 blocks writes the bytes write_trace writes (int8 ids)."""
    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=30, seed=4))
    wide = widened(trace, np.int16)
    shape = trace.true_ids.shape
    members = {"true_ids": (shape, np.dtype(np.int16)), "true_gates": (shape, np.dtype(np.float32)),
               "pred_ids": (shape, np.dtype(np.int16))}

    def blocks():
        for s in range(0, shape[0], 7):
            yield wide.true_ids[s:s + 7], wide.true_gates[s:s + 7], wide.pred_ids[s:s + 7]

    write_trace_streamed(trace.header, trace.prompt_ids, trace.token_ids, Streamed(members, blocks),
                         {"pred_gates": "true_gates", "exec_ids": "true_ids"}, tmp_path / "s.npz")
    write_trace(trace, tmp_path / "w.npz")
    assert (tmp_path / "s.npz").read_bytes() == (tmp_path / "w.npz").read_bytes()
    assert member_dtypes(tmp_path / "s.npz")["true_ids"] == np.dtype(np.int8)


def test_a_version_4_header_needs_a_reader_of_version_4(tmp_path):
    """Version 5 is refused in one line naming the versions read (4 among them)."""
    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6, seed=1))
    path = write_trace(trace, tmp_path / "t.npz")
    assert read_trace(path).header["version"] == 4
    arrays = dict(np.load(path))
    header = {**json.loads(bytes(arrays["header"]).decode()), "version": 5}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(tmp_path / "v5.npz", **arrays)
    with pytest.raises(MoesimError, match="version 5; this moesim reads versions 1, 2, 3, 4$"):
        read_trace(tmp_path / "v5.npz")


def _old_file(trace, path, dtype, version):
    """``trace`` as a moesim before version 4 wrote it: every member, ids as ``dtype``."""
    arrays = {a: np.asarray(getattr(trace, a)) for a in ROUTING}
    arrays.update({a: arrays[a].astype(dtype) for a in ID_ARRAYS})
    header = {k: v for k, v in trace.header.items() if k != "same_as"} | {"version": version}
    np.savez_compressed(path, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
                        prompt_ids=trace.prompt_ids, token_ids=trace.token_ids, **arrays)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One Qwen3-30B-A3B trace (128 experts: ids up to 127, the top of int8) as written now
    (int8 ids, version 4) and as a version 2 file with int32 ids."""
    d = tmp_path_factory.mktemp("pair")
    trace = synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=300, seed=11, reuse=0.4))
    narrow = read_trace(write_trace(trace, d / "narrow.npz"))
    old = read_trace(_old_file(trace, d / "old.npz", np.int32, 2))
    assert narrow.true_ids.dtype == np.int8 and old.true_ids.dtype == np.int32
    assert narrow.true_ids.max() == 127
    return narrow, old


def _same(a, b):
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_stats_are_equal_on_narrow_and_wide_ids(pair):
    from moesim.hardware import get_profile
    from moesim.sim.stats import fit_synthetic, routing_stats

    narrow, old = pair
    hw = get_profile("a6000")
    _same(routing_stats(narrow, hw, sizes=[0, 3, 8, 50, 700, 6144]), routing_stats(old, hw, sizes=[0, 3, 8, 50, 700,
                                                                                                    6144]))
    _same(routing_stats(narrow), routing_stats(old))
    _same(fit_synthetic(narrow), fit_synthetic(old))


def test_recall_is_equal_on_narrow_and_wide_ids(pair):
    from moesim.sim.simulate import _prediction_recall_numpy, prediction_recall
    from moesim.sim.stats_kernels import recall_counts
    from moesim.traces.metrics import routing_metrics

    narrow, old = pair
    assert recall_counts(narrow.true_ids, narrow.pred_ids, 128) == recall_counts(old.true_ids, old.pred_ids, 128)
    assert _prediction_recall_numpy(narrow) == _prediction_recall_numpy(old) == prediction_recall(old)
    _same(routing_metrics(narrow.true_ids, narrow.pred_ids), routing_metrics(old.true_ids, old.pred_ids))


@pytest.mark.parametrize("cache", [0, 40])
def test_every_policy_simulates_equal_on_narrow_and_wide_ids(pair, cache):
    """Every registered policy (copy policies: the compiled planner; CPU-compute ones: their
    token counts and placements), with and without a cross-token cache, on a 128-expert trace."""
    from moesim.hardware import get_profile
    from moesim.policy import POLICIES
    from moesim.setting import Setting
    from moesim.sim.plan import build_plan
    from moesim.sim.simulate import simulate

    narrow, old = pair
    hw = get_profile("a6000")
    for policy in sorted(POLICIES):
        if POLICIES[policy].cpu == "miss" and not cache:
            continue  # it needs a device cache: the case with one runs it
        placed = POLICIES[policy].cpu in ("hot", "miss")  # placed on a calibration trace's counts: its own
        got = [simulate(t, hw, policy, Setting(sim="fast", cache_experts=cache, calibration=t.true_ids if placed else None))
               for t in (narrow, old)]
        _same(*[g.summary() for g in got])
        assert np.array_equal(np.asarray(got[0].tpot), np.asarray(got[1].tpot)), policy
        if not POLICIES[policy].offload or POLICIES[policy].cpu:
            continue  # planned by the copy planner only where it copies
        plans = [build_plan(t, policy, cache, "lfu") for t in (narrow, old)]
        for name in vars(plans[0]):
            a, b = getattr(plans[0], name), getattr(plans[1], name)
            assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), (policy, name)


def test_a_committed_version_2_trace_reads_and_rewrites_to_one_byte_ids_with_equal_stats(tmp_path):
    """traces/examples/moe-stdlib-routing.npz (version 2, int16 ids, recorded from a real model)
    still reads; written again it stores int8 ids (version 4) and every statistic is unchanged."""
    from pathlib import Path

    from moesim.sim.stats import routing_stats

    old = read_trace(Path(__file__).parent.parent / "traces" / "examples" / "moe-stdlib-routing.npz")
    assert old.header["version"] == 2 and old.true_ids.dtype == np.int16
    new = read_trace(write_trace(old, tmp_path / "again.npz"))
    assert new.header["version"] == BYTE_IDS_VERSION and new.true_ids.dtype == np.int8
    for a in ROUTING:
        assert np.array_equal(getattr(new, a), getattr(old, a)), a
    _same(routing_stats(new), routing_stats(old))


@pytest.mark.parametrize("streamed", [False, True])
def test_an_id_out_of_range_is_refused_before_it_is_narrowed(tmp_path, streamed):
    """255 in an int16 pred_ids of a 128-expert model would be -1 ("no prediction") as int8:
    it is refused in one line, from the value as given, and no file is written."""
    trace = synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=8, seed=2))
    pred = np.asarray(trace.pred_ids).astype(np.int16)
    pred[3, 5, 0, 1] = 255
    path = tmp_path / "bad.npz"
    with pytest.raises(MoesimError, match=r"pred_ids outside \[-1, 128\)$"):
        if streamed:
            shape = trace.true_ids.shape
            members = {"true_ids": (shape, np.dtype(np.int16)), "true_gates": (shape, np.dtype(np.float32)),
                       "pred_ids": (shape, np.dtype(np.int16))}
            blocks = lambda: iter([(trace.true_ids.astype(np.int16), trace.true_gates, pred)])  # noqa: E731
            write_trace_streamed(trace.header, trace.prompt_ids, trace.token_ids, Streamed(members, blocks),
                                 {"pred_gates": "true_gates", "exec_ids": "true_ids"}, path)
        else:
            write_trace(replace(trace, pred_ids=pred), path)
    assert not path.exists() and list(tmp_path.iterdir()) == []
