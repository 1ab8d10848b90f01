"""The simulator judged against measurements: error statistics and an equivalence test.

A prediction is compared per token (``predicted[t] / measured[t] - 1``) and overall
(ratio of means). Equivalence uses TOST (two one-sided t-tests) on the per-token
relative errors against a margin (default +-5%): "equivalent" means both one-sided
nulls (mean error <= -margin, mean error >= +margin) are rejected at ``alpha``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, get_profile
from moesim.policy import POLICIES
from moesim.setting import Setting
from moesim.sim.cpu_compute import load_calibration
from moesim.sim.prefetch_top import keep_top_predictions
from moesim.sim.simulate import SimResult, simulate
from moesim.traces.format import Trace


def error_stats(measured: np.ndarray, predicted: np.ndarray, margin: float = 0.05, alpha: float = 0.05) -> dict[str, Any]:
    measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
    if measured.shape != predicted.shape or measured.size == 0:
        raise MoesimError("measured and predicted need the same, non-empty shape")
    err = predicted / measured - 1
    out = {
        "tokens": int(err.size),
        "measured_ms": float(measured.mean() * 1e3),
        "predicted_ms": float(predicted.mean() * 1e3),
        "error": float(predicted.mean() / measured.mean() - 1),  # error of the mean TPOT
        "mape": float(np.abs(err).mean()),  # per-token mean absolute percentage error
        "bias": float(err.mean()),
        "p50_abs_error": float(np.percentile(np.abs(err), 50)),
        "p90_abs_error": float(np.percentile(np.abs(err), 90)),
        "tost_margin": margin,
    }
    if err.size >= 3 and err.std() > 0:
        # scipy.stats costs ~0.55 s to import: every `moesim replay` imports this module (its
        # --validate view), and only a validation scores a measured run.
        from scipy import stats

        lower = stats.ttest_1samp(err, -margin, alternative="greater").pvalue
        upper = stats.ttest_1samp(err, margin, alternative="less").pvalue
        out["tost_p"] = float(max(lower, upper))
        out["equivalent"] = bool(out["tost_p"] < alpha)
    else:
        out["tost_p"] = float("nan")
        out["equivalent"] = bool(abs(out["error"]) < margin)
    return out


def recorded_profile(trace: Trace, hw: HardwareProfile | None = None) -> HardwareProfile:
    """The profile the trace was recorded against, with its link as the trace measured it:
    the recorded per-transfer latency, and the bandwidth that the mean measured copy
    duration implies (a link can run slower than its setting: a host thread that copies
    late, a busy bus)."""
    meta = trace.meta
    if hw is None:
        if not meta.hw_profile:
            raise MoesimError("the trace does not say which hardware profile recorded it; pass --hw")
        hw = get_profile(meta.hw_profile)
    if meta.link_gbps is not None:
        hw = hw.with_figure("h2d_pinned_gbs", meta.link_gbps, "measured", "the trace's recorded link")
    if meta.latency_us is not None:
        hw = hw.with_figure("transfer_latency_us", meta.latency_us, "measured", "the trace's recorded link")
    tm = trace.timings
    if "copy_bytes" in tm and tm["copy_bytes"].size:
        busy = float((tm["copy_end_s"] - tm["copy_start_s"]).sum()) - tm["copy_bytes"].size * hw.transfer_latency
        if busy > 0:
            gbs = float(tm["copy_bytes"].sum()) / busy / 1e9
            hw = hw.with_figure("h2d_pinned_gbs", gbs, "measured", "mean copy duration measured in the trace")
    return hw


def recorded_cpu_setup(trace: Trace, hw: HardwareProfile) -> tuple[HardwareProfile, dict[str, Any]]:
    """A CPU-compute recording's own setup: its host profile, cpu-static layer count, the
    calibration trace that placed its experts and the device memory the placement filled."""
    meta = trace.meta
    kw: dict[str, Any] = {"host": meta.host_profile,
                          "cpu_layers": meta.cpu_layers if meta.cpu_layers is not None else "auto"}
    if meta.placement_from:
        kw["calibration"] = load_calibration(meta.placement_from, trace.model)
    if meta.device_memory_gb is not None:
        hw = hw.with_figure("device_memory_gb", meta.device_memory_gb, "measured", "the trace's recorded placement")
    return hw, kw


def validate_trace(trace: Trace, hw: HardwareProfile | None = None, policy: str | None = None,
                   sim: str = "simpy", skip: int = 1, **kw) -> tuple[dict[str, Any], SimResult]:
    """Replay a measured trace on the profile that recorded it (same policy unless
    ``policy``) on the ``sim`` simulator and compare per token. ``skip`` first steps are
    warm-up and not scored. ``kw``: :class:`~moesim.setting.Setting` fields that replace
    the recorded run's (its cache, eviction, copy queue and CPU-compute setup)."""
    if not trace.measured:
        raise MoesimError("the trace has no measured timings to validate against (record one with moesim profile)")
    meta = trace.meta
    policy = policy or meta.replay_policy
    if trace.header.get("prefetch_top_m"):  # the run prefetched only its top-m predictions

        trace = keep_top_predictions(trace, int(trace.header["prefetch_top_m"]))
    kw.setdefault("cache_experts", meta.cache_experts)
    kw.setdefault("eviction", meta.eviction)
    if policy == meta.policy:  # the run's queue discipline (moesim profile --copy-queue), else FIFO
        kw.setdefault("copy_queue", None)
    profile = recorded_profile(trace, hw)
    if policy == meta.policy and POLICIES[policy].uses_host:  # the recorded CPU-compute setup (executor/runs.py)
        profile, more = recorded_cpu_setup(trace, profile)
        kw = {**more, **kw}
    as_recorded = kw.pop("as_recorded", policy == meta.replay_policy)  # the measured run's predictor time stays in
    result = simulate(trace, profile, policy, Setting(sim=sim, timing="measured", **kw), as_recorded=as_recorded)
    skip = min(skip, trace.n_tokens - 1)
    stats_ = error_stats(trace.timings["tpot_s"][skip:], result.tpot[skip:])
    cfg = result.config
    return {"policy": cfg["policy"], "recorded_policy": meta.policy, "copy_queue": cfg.get("copy_queue", "fifo"),
            "hw": cfg["hw"], "link_gbps": cfg["link_gbps"],
            "link_source": "achieved by the trace's copies", "link_set_gbps": meta.link_gbps, "timing": cfg["timing"],
            **stats_}, result
