"""The synthetic generator written straight to a file (issue 25): ``write_synthetic_trace``
writes the very bytes of ``write_trace(synthetic_trace(...))`` whatever the chunking, the
threads and the page dropping, in memory of a few chunks, and a trace that fails the checks
(or a run stopped midway) leaves no file. Speed itself is measured by bench/bench_sim.py."""

from __future__ import annotations

import tracemalloc
import zipfile
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.traces import format as fmt
from moesim.traces import synthetic
from moesim.traces.format import Streamed, read_trace, write_trace, write_trace_streamed
from moesim.traces.synthetic import SyntheticParams, synthetic_trace, write_synthetic_trace


@contextmanager
def patched(module, **values):
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["tiny", "olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v2-lite"]), st.integers(1, 700),
       st.integers(1, 3), st.integers(1, 3), st.sampled_from([700, 5000, 1 << 22]), st.booleans(),
       st.integers(0, 9))
def test_the_streamed_file_is_write_traces_file(tmp_path_factory, model, tokens, batch, threads, scratch, drop, seed):
    spec = get_model(model)
    params = SyntheticParams(tokens=tokens, batch=batch, seed=seed, lookahead=2 if spec.n_moe_layers > 2 else 1)
    d = tmp_path_factory.mktemp("t")
    write_trace(synthetic_trace(spec, params), d / "memory.npz")
    small = {"STORE_MIN_BYTES": 1 << 12} if drop else {}  # members stored (streamed), not gathered and deflated
    with patched(synthetic, SCRATCH=scratch, PARALLEL_MIN=0, _threads=lambda: threads), \
            patched(fmt, DROP_BEHIND_BYTES=1 << 16 if drop else fmt.DROP_BEHIND_BYTES, **small):
        write_synthetic_trace(spec, params, d / "streamed.npz")
        if drop:
            write_trace(synthetic_trace(spec, params), d / "memory.npz")  # the same layout rules
    assert (d / "streamed.npz").read_bytes() == (d / "memory.npz").read_bytes()
    back = read_trace(d / "streamed.npz")
    assert zipfile.ZipFile(d / "streamed.npz").testzip() is None
    np.testing.assert_array_equal(np.load(d / "streamed.npz")["true_ids"], back.true_ids)


def test_memory_is_a_few_chunks_not_the_trace(tmp_path):
    spec = get_model("qwen3-30b-a3b")  # 48 MoE layers, top-8: 3,000 tokens = 9.2 MB of routing
    params = SyntheticParams(tokens=3000)
    with patched(synthetic, SCRATCH=1 << 14):
        tracemalloc.start()
        write_synthetic_trace(spec, params, tmp_path / "t.npz")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    chunk = (1 << 14) * (2 + 4 + 2)  # one chunk of ids, gates and predictions
    assert peak < 6 * chunk + (1 << 20) < 3000 * 48 * 8 * 8 / 4, peak
    assert read_trace(tmp_path / "t.npz").n_tokens == 3000


def _stream(blocks, tokens=4, shape=(4, 2, 1, 2)):
    members = {"true_ids": (shape, np.dtype(np.int16)), "true_gates": (shape, np.dtype(np.float32)),
               "pred_ids": (shape, np.dtype(np.int16))}
    return Streamed(members, blocks)


def _tiny_header(tokens=4):
    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=tokens))
    return trace, trace.header


def test_a_trace_that_fails_the_checks_is_never_written(tmp_path):
    trace, header = _tiny_header()
    ids = trace.true_ids.copy()
    ids[2, 1, 0, 0] = 99  # tiny has 16 experts

    def blocks():
        yield ids, trace.true_gates, trace.pred_ids

    with patched(fmt, STORE_MIN_BYTES=0), pytest.raises(MoesimError, match=r"true_ids outside \[0, 16\)"):
        write_trace_streamed(header, trace.prompt_ids, trace.token_ids, _stream(blocks, shape=ids.shape),
                             {"pred_gates": "true_gates", "exec_ids": "true_ids"}, tmp_path / "bad.npz")
    assert list(tmp_path.iterdir()) == []


def test_a_run_stopped_midway_leaves_no_file(tmp_path):
    trace, header = _tiny_header(40)

    def blocks():
        yield trace.true_ids[:20], trace.true_gates[:20], trace.pred_ids[:20]
        raise KeyboardInterrupt

    with patched(fmt, STORE_MIN_BYTES=0), pytest.raises(KeyboardInterrupt):
        write_trace_streamed(header, trace.prompt_ids, trace.token_ids, _stream(blocks, shape=trace.true_ids.shape),
                             {"pred_gates": "true_gates", "exec_ids": "true_ids"}, tmp_path / "cut.npz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cut", ["short", "long", "dtype"])
def test_blocks_that_do_not_make_up_the_member_are_refused(tmp_path, cut):
    trace, header = _tiny_header(10)
    t, g, p = trace.true_ids, trace.true_gates, trace.pred_ids

    def blocks():
        if cut == "short":
            yield t[:9], g[:9], p[:9]
        elif cut == "long":
            yield t, g, p
            yield t[:1], g[:1], p[:1]
        else:
            yield t.astype(np.int32), g, p

    with patched(fmt, STORE_MIN_BYTES=0), pytest.raises(ValueError):
        write_trace_streamed(header, trace.prompt_ids, trace.token_ids, _stream(blocks, shape=t.shape),
                             {"pred_gates": "true_gates", "exec_ids": "true_ids"}, tmp_path / "x.npz")
    assert list(tmp_path.iterdir()) == []


def test_every_routing_member_is_stored_or_named_a_repeat(tmp_path):
    trace, header = _tiny_header()
    with pytest.raises(ValueError, match="need each of"):
        write_trace_streamed(header, trace.prompt_ids, trace.token_ids, _stream(lambda: iter(())),
                             {"pred_gates": "true_gates"}, tmp_path / "x.npz")
