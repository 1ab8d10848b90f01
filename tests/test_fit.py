"""`moesim fit`: the roofline's unknowns recovered from a trace whose times we made from
known values (so the answer is known), and its quality figures honest under noise."""

from __future__ import annotations

import numpy as np
import pytest

from moesim.engines import get_engine
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.sim.device_fit import fit_profile
from moesim.sim.plan import build_plan
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

TRUE_BW, TRUE_LAUNCH, TRUE_OVERHEAD = 40e9, 6e-6, 25e-6  # B/s, s, s: what the fit must find


def measured_trace(noise: float, seed: int = 0):
    """A synthetic on-demand trace given measured times from known machine figures."""
    spec = get_model("olmoe-1b-7b").with_layers(4)
    trace = synthetic_trace(spec, SyntheticParams(tokens=40, prompt_len=16, seed=seed))
    rng = np.random.default_rng(seed)
    jitter = (lambda shape: 1 + noise * rng.standard_normal(shape)) if noise else (lambda shape: 1.0)
    t, L, M = trace.n_tokens, spec.n_layers, spec.n_moe_layers
    ctx = trace.prompt_len + np.arange(t)
    attn = np.stack([(spec.layer_resident_bytes(layer) + spec.kv_bytes_per_token_layer * ctx) / TRUE_BW
                     + get_engine().attention_kernels * TRUE_LAUNCH + TRUE_OVERHEAD for layer in range(L)], 1)
    n_exec = build_plan(trace, "on-demand").execute
    expert = n_exec * (spec.expert_bytes / TRUE_BW + get_engine().expert_kernels * TRUE_LAUNCH)
    head = spec.lm_head_bytes / TRUE_BW + get_engine().head_kernels * TRUE_LAUNCH
    other = np.full(t, head)
    attn, expert, other = attn * jitter(attn.shape), expert * jitter(expert.shape), other * jitter(other.shape)
    trace.timings.update({"attn_s": attn, "expert_s": expert, "stall_s": np.zeros((t, M)),
                          "other_s": other, "tpot_s": attn.sum(1) + expert.sum(1) + other})
    trace.header["policy"] = {"name": "on-demand", "params": {}}
    trace.header["recorded"] = {"hw_profile": "a6000", "device": "made by tests/test_fit.py"}
    return trace


def test_fit_recovers_known_machine_figures():
    prof, q = fit_profile(measured_trace(noise=0.0), get_profile("a6000"), "fitted-box")
    assert q["mem_bw_achievable_gbs"] == pytest.approx(TRUE_BW / 1e9, rel=1e-6)
    assert q["kernel_launch_us"] == pytest.approx(TRUE_LAUNCH * 1e6, rel=1e-5)
    assert q["layer_overhead_us"] == pytest.approx(TRUE_OVERHEAD * 1e6, rel=1e-5)
    assert q["r2"] == pytest.approx(1.0, abs=1e-9)
    assert prof.name == "fitted-box"
    assert prof.figures["mem_bw_achievable_gbs"].kind == "fitted"


def test_fit_under_noise_stays_close_and_says_the_fit_is_imperfect():
    _, q = fit_profile(measured_trace(noise=0.05, seed=1), get_profile("a6000"))
    assert q["mem_bw_achievable_gbs"] == pytest.approx(TRUE_BW / 1e9, rel=0.05)
    assert 0.5 < q["r2"] < 0.9999  # noise shows in the quality figure
    assert q["block_mape"] > 0.01


def test_fit_refuses_a_trace_without_measurements(tiny_trace):
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError, match="no measured timings"):
        fit_profile(tiny_trace, get_profile("a6000"))


def test_times_that_do_not_grow_with_bytes_keep_the_base_bandwidth_and_say_so():
    trace = measured_trace(noise=0.0)
    t = trace.timings
    t["attn_s"] = np.full_like(t["attn_s"], 100e-6)  # the blocks that read least take longest:
    t["expert_s"] = np.full_like(t["expert_s"], 1e-6)  # nothing here grows with bytes
    t["other_s"] = np.full_like(t["other_s"], 1e-6)
    base = get_profile("a6000")
    prof, q = fit_profile(trace, base)
    assert q["bandwidth_fitted"] is False
    assert prof["mem_bw_achievable_gbs"] == base["mem_bw_achievable_gbs"]
    assert prof.figures["mem_bw_achievable_gbs"].kind != "fitted"
