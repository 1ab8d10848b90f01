"""read_trace's threaded scan of mapped members (issue 25) against the one-thread scan:
the same arrays from a good file, the same one-line error from a bad one (a flipped
byte in any member, a cut file, out-of-range ids, a repeat, a non-finite gate), whatever
check would have failed first. Speed itself is measured by bench/bench_sim.py."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from test_trace import _member_span

from moesim.errors import MoesimError
from moesim.traces import format as fmt
from moesim.traces.format import ROUTING, _write_npz, read_trace, write_trace


@contextmanager
def scanning(threads: int, pread: bool = True):
    """Every member stored and mapped; scanned ahead on ``threads`` threads (1: by the
    checks), by positional reads or (``pread`` False) through the file's own position."""
    old = fmt.STORE_MIN_BYTES, fmt.PRESCAN_MIN, fmt._scan_threads, fmt._PREAD
    fmt.STORE_MIN_BYTES, fmt.PRESCAN_MIN, fmt._scan_threads = 0, 0, lambda: threads
    fmt._PREAD = pread and fmt._PREAD
    try:
        yield
    finally:
        fmt.STORE_MIN_BYTES, fmt.PRESCAN_MIN, fmt._scan_threads, fmt._PREAD = old


def outcome(path):
    try:
        t = read_trace(path)
    except MoesimError as e:
        return str(e)
    return {k: getattr(t, k).copy() for k in (*ROUTING, "token_ids")}


def same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def every_member_stored(trace):
    """``trace`` with exec_ids one expert short of true_ids and no predicted gates where
    nothing is predicted (as a recorded run's), so that the file stores all five routing
    arrays (a synthetic trace's exec_ids and pred_gates repeat true_ids and true_gates: each
    stored once, version 3)."""
    executed = np.array(trace.exec_ids)
    executed[0, 0, 0, 0] = -1
    pred_gates = np.where(trace.pred_ids >= 0, trace.true_gates, 0).astype(np.float32)
    return replace(trace, exec_ids=executed, pred_gates=pred_gates)


def test_threads_read_what_one_thread_reads(tmp_path, tiny_trace):
    with scanning(1):
        path = write_trace(every_member_stored(tiny_trace), tmp_path / "t.npz")
        files = {"good": path.read_bytes()}
    raw = files["good"]
    for name in (*ROUTING, "token_ids"):
        start, n = _member_span(path, name)
        for at in (0, n // 2, n - 1):
            flipped = bytearray(raw)
            flipped[start + at] ^= 0x01
            files[f"{name}@{at}"] = bytes(flipped)
    files["cut"] = raw[: len(raw) * 2 // 3]
    t = tiny_trace.head(24)
    shape = t.true_ids.shape
    bad = {"range": {"true_ids": np.full(shape, 16, np.int16)}, "repeat": {"true_ids": np.zeros(shape, np.int16)},
           "exec": {"exec_ids": np.full(shape, -2, np.int16)},
           "gates": {"true_gates": np.full(shape, np.inf, np.float32)},
           "two": {"true_ids": np.zeros(shape, np.int16), "pred_gates": np.full(shape, 2.0, np.float32)}}
    for label, change in bad.items():
        arrays = {k: getattr(t, k) for k in ("prompt_ids", "token_ids", *ROUTING)}
        arrays.update(change)
        arrays["header"] = np.frombuffer(json.dumps(t.header).encode(), np.uint8)
        p = tmp_path / "bad.npz"
        with scanning(1), open(p, "wb") as f:
            _write_npz(f, arrays)
        files[label] = p.read_bytes()
    for label, data in files.items():
        p = tmp_path / f"{label}.npz"
        p.write_bytes(data)
        with scanning(1, pread=False):
            one = outcome(p)
        for threads in (1, 2, 3, 8):
            with scanning(threads):
                assert same(outcome(p), one), (label, threads)
        if label != "good":
            assert isinstance(one, str) and "\n" not in one, label


@pytest.mark.parametrize("threads", [2, 4])
def test_threads_leave_no_member_unchecked(tmp_path, tiny_trace, threads):
    """After a threaded read every mapped member's CRC-32 was checked (a flipped byte in
    the last member is still caught)."""
    with scanning(threads):
        path = write_trace(every_member_stored(tiny_trace), tmp_path / "t.npz")
        start, n = _member_span(path, "exec_ids")
        raw = bytearray(path.read_bytes())
        raw[start + n - 1] ^= 0x10
        path.write_bytes(bytes(raw))
        with pytest.raises(MoesimError, match="CRC"):
            read_trace(path)
