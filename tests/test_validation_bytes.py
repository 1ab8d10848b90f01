"""The executor-simulator agreement holds on any machine (issue 51): a trace says the bytes
that crossed the link. The shipped checkpoint is stored in bf16; the executor runs it in
fp32 by default, and its trace kept the checkpoint's bf16 byte counts, so every replay priced
half the copies (on-demand at 0.25 GB/s: measured 10.45 ms a token, replayed 7.25, -30.7% on a
2-core EPYC; with the bytes the run moved: -0.97%)."""

from __future__ import annotations

import numpy as np
import pytest
from cli_run import in_process

from moesim.traces.format import read_trace


@pytest.mark.parametrize("dtype, per_weight", [("fp32", 4), ("bf16", 2)])
def test_the_trace_prices_the_bytes_its_copies_moved(tmp_path, dtype, per_weight):
    r = in_process("profile", "--model", "moe-stdlib", "--policy", "on-demand", "--link-gbps", "4", "--tokens", "3",
                   "--dtype", dtype, "--out", "run.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    t = read_trace(tmp_path / "run.npz")
    s = t.model
    copied = np.asarray(t.timings["copy_bytes"])
    assert copied.size and (copied == s.expert_bytes).all(), (s.expert_dtype, s.expert_bytes, set(copied.tolist()))
    assert s.expert_bytes == per_weight * 3 * s.hidden * s.expert_inter  # gate, up, down in the run's own dtype
    assert s.expert_dtype == dtype
