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


@pytest.mark.slow
@pytest.mark.parametrize("policy, link", [("on-demand", "0.25"), ("prefetch-fom", "0.5")])
def test_a_same_policy_replay_of_a_fresh_run_stays_within_ten_percent(tmp_path, policy, link):
    """A reduced cross-validation that CI reruns whenever the executor, the cost model or the
    simulator changes (issue 51, item 4): the link-bound cases that missed by 20-30% when the
    bytes were wrong. Its own measured compute and link are replayed, so the bound is loose
    (10%) against a noisy CI machine and tight against a mechanism that is missing."""
    from moesim.sim.validate import validate_trace

    r = in_process("profile", "--model", "moe-stdlib", "--policy", policy, "--link-gbps", link, "--tokens", "16",
                   "--out", "run.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    score, _ = validate_trace(read_trace(tmp_path / "run.npz"))
    assert abs(score["error"]) <= 0.10, score
