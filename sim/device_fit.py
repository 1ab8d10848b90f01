"""Calibrate the cost model's device figures from an executor trace.

Unknowns: achievable memory bandwidth ``bw``, kernel-launch cost ``launch`` and the fixed
per-layer overhead ``overhead``. At batch 1 every block is memory-bound, so the cost
model's times (:class:`moesim.costmodel.CostModel`, eager engine: the executor's) are
linear in them (non-negative least squares over every layer of every step):

- attention block of layer l at context c: ``(resident_l + kv * c) / bw + attention kernels * launch + overhead``
- one routed expert: ``expert_bytes / bw + expert kernels * launch``
- LM head: ``head_bytes / bw + head kernels * launch``

The fit is reported with R^2 and the mean absolute error of the fitted block times,
and of TPOT when the trace is replayed with the fitted profile instead of its own times.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from moesim.engines import get_engine
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile
from moesim.setting import Setting
from moesim.sim.plan import build_plan
from moesim.sim.simulate import simulate
from moesim.traces.format import Trace


def fit_profile(trace: Trace, base: HardwareProfile, name: str | None = None) -> tuple[HardwareProfile, dict[str, Any]]:
    if not trace.measured:
        raise MoesimError("the trace has no measured timings to fit (record one with moesim profile)")
    if trace.batch != 1:
        raise MoesimError("fitting uses batch-1 traces (every block memory-bound)")
    from scipy.optimize import nnls  # scipy.optimize takes 0.4 s to import: only a fit pays it

    spec = trace.model
    tm = trace.timings
    eager = get_engine()  # the executor's engine: PyTorch eager
    rows, y = [], []
    ctx0 = trace.prompt_len
    for t in range(trace.n_tokens):
        for layer in range(spec.n_layers):
            nbytes = spec.layer_resident_bytes(layer) + spec.kv_bytes_per_token(layer) * spec.kv_tokens(layer, ctx0 + t)
            rows.append((nbytes, eager.attention_kernels, 1.0))
            y.append(tm["attn_s"][t, layer])
    meta = trace.meta
    n_exec = build_plan(trace, meta.replay_policy).execute
    for t in range(trace.n_tokens):
        for m in range(spec.n_moe_layers):
            n = int(n_exec[t, m])
            rows.append((n * spec.expert_bytes, n * eager.expert_kernels, 0.0))
            y.append(tm["expert_s"][t, m])
    for t in range(trace.n_tokens):
        rows.append((spec.lm_head_bytes, eager.head_kernels, 0.0))
        y.append(tm["other_s"][t])
    a, y = np.array(rows, float), np.array(y, float)
    scale = a.max(0)
    scale[scale == 0] = 1
    coef, _ = nnls(a / scale, y)
    inv_bw, launch, overhead = coef / scale
    # A fitted bandwidth above 10x the base profile's peak is no measurement: the times do
    # not grow with bytes (blocks too small for the noise, e.g. a tiny model on a busy
    # machine). Then keep the base profile's bandwidth, fit the fixed costs only, and say so,
    # rather than refusing or inventing an (almost) infinite bandwidth.
    bandwidth_fitted = inv_bw * base["mem_bw_peak_gbs"] * 1e9 > 0.1
    if not bandwidth_fitted:
        inv_bw = 1 / base.mem_bw
        fixed, _ = nnls(a[:, 1:] / scale[1:], y - a[:, 0] * inv_bw)
        launch, overhead = fixed / scale[1:]
    fitted = a @ np.array([inv_bw, launch, overhead])
    r2 = 1 - ((y - fitted) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    src = f"moesim fit of {meta.device or 'a trace'}"
    bw_gbs = 1 / inv_bw / 1e9
    prof = base.with_figure("mem_bw_achievable_gbs", bw_gbs, "fitted", src) if bandwidth_fitted else base
    if bw_gbs > prof["mem_bw_peak_gbs"]:
        prof = prof.with_figure("mem_bw_peak_gbs", bw_gbs, "fitted", src + " (exceeded the base profile's peak)")
    prof = prof.with_figure("kernel_launch_us", max(launch * 1e6, 1e-3), "fitted", src)
    prof = prof.with_figure("layer_overhead_us", overhead * 1e6, "fitted", src)
    from dataclasses import replace

    name = name or fitted_name(trace, base)
    prof = replace(prof, name=name, description=f"{base.description}; compute model fitted to a trace of "
                                                 f"{meta.device or 'an unnamed machine'}")
    replay = simulate(trace, prof, meta.replay_policy, Setting(timing="profile", cache_experts=meta.cache_experts, link_gbps=meta.link_gbps))
    measured = tm["tpot_s"][1:]
    quality = {
        "blocks": int(y.size), "r2": float(r2),
        "block_mae_us": float(np.abs(y - fitted).mean() * 1e6),
        "block_mape": float(np.abs((y - fitted) / np.maximum(y, 1e-12)).mean()),
        "tpot_error_with_fitted_profile": float(replay.tpot[1:].mean() / measured.mean() - 1),
        "mem_bw_achievable_gbs": bw_gbs, "kernel_launch_us": launch * 1e6, "layer_overhead_us": overhead * 1e6,
        "bandwidth_fitted": bool(bandwidth_fitted),
    }
    quality["warnings"] = fit_warnings(quality)
    return prof, quality


# A fit below these explains too little of the measured times to predict from it.
MIN_R2 = 0.9
MAX_TPOT_ERROR = 0.10


def fit_warnings(quality: dict[str, Any]) -> list[str]:
    """Why a fitted profile should not be trusted, one sentence each (empty: the fit is fine)."""

    w = []
    if not quality["r2"] >= MIN_R2:
        w.append(f"poor fit: R^2 {quality['r2']:.3f} < {MIN_R2} (the model explains little of the measured block times)")
    e = quality["tpot_error_with_fitted_profile"]
    if not abs(e) <= MAX_TPOT_ERROR:
        w.append(f"poor fit: replaying the trace with the fitted profile misses its TPOT by {e:+.1%} "
                 f"(more than {MAX_TPOT_ERROR:.0%})")
    return w


def fitted_name(trace: Trace, base: HardwareProfile) -> str:
    """A name that cannot be confused with the base profile: ``MACHINE-fit-BASE``."""
    machine = re.sub(r"[^a-z0-9]+", "-", (trace.meta.device or "machine").lower()).strip("-")[:32] or "machine"
    return f"{machine}-fit-{base.name}"
