"""The built-in validation suite: the simulator against the executor on this machine.

For each model and emulated link bandwidth, the executor decodes under four policies and
records traces. Two kinds of case are scored:

- **same-policy**: replay a run's own trace (its measured compute times, its link) and
  compare the predicted mean TPOT with the measured one;
- **policy transfer**: from the *on-demand* trace alone, predict the other policies'
  TPOT, then compare with what the executor measured running them.

Models: the shipped learned-routing model (``moe-stdlib``) and a synthetic geometry
whose experts are large enough for millisecond-scale copies on a CPU.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.model import ExecConfig, MoEModel, load_checkpoint, random_model
from moesim.executor.profile import ProfileSettings, build_trace, calibrate, generate, load_default_vectors
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, get_profile
from moesim.models import Attention, ModelSpec
from moesim.sim.simulate import simulate
from moesim.sim.validate import error_stats, recorded_profile, validate_trace
from moesim.sim.workload import Link
from moesim.traces.format import Trace, write_trace

POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle")
SYNTHETIC_SPEC = ModelSpec("synthetic-1024x512", n_layers=6, n_experts=16, top_k=4, hidden=1024, expert_inter=512,
                           vocab=1024, attention=Attention("gqa", 8, 4, 128, qk_norm=True),
                           source="moesim validation geometry with seeded random weights (synthetic)")
PROMPT = b"import os\nimport sys\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"


def suite_models(shipped: Path) -> list[tuple[str, Callable[[], tuple[MoEModel, torch.Tensor, bool]], list[float], int]]:
    """(name, loader, link bandwidths in GB/s, steps per run relative to ``--tokens``):
    bandwidths put copies and compute of each model on the same order on a CPU core; the
    learned model's steps are ~10x shorter, so it runs 4x as many to average out noise."""

    def learned():
        m = load_checkpoint(shipped)
        dv = load_default_vectors(shipped)
        if dv is None:
            raise FileNotFoundError(f"{shipped} has no default vectors; run moesim calibrate")
        return m, dv, False

    def synthetic():
        m = random_model(ExecConfig(SYNTHETIC_SPEC, rope_theta=1e4), seed=0)
        dv = calibrate(m, torch.randint(0, SYNTHETIC_SPEC.vocab, (512,), generator=torch.Generator().manual_seed(1)))
        return m, dv, True

    return [("moe-stdlib", learned, [0.25, 0.5, 1.0], 4), (SYNTHETIC_SPEC.name, synthetic, [2.0, 4.0, 8.0], 1)]


def machine_profile() -> HardwareProfile:
    """What the simulator knows of this machine beyond each trace's recorded link, measured
    here (executor/hwbench.py): how much compute slows while the emulated link copies, and
    how long a thread that waited on a copy takes to run again."""
    from moesim.executor.hwbench import cpu_interference, cpu_wakeup
    from moesim.timing import best_time

    big = torch.zeros(16 * 2**20 // 4)
    dst = torch.zeros_like(big)
    copy_gbs = big.numel() * 4 / best_time(lambda: dst.copy_(big)) / 1e9  # what the link thread's memcpy reaches
    alpha = cpu_interference(copy_gbs)
    src = "measured by moesim validate on this machine (executor/hwbench.py)"
    return (get_profile(DEFAULT_PROFILE).with_figure("copy_interference", alpha, "measured", src)
            .with_figure("copy_interference_gbs", copy_gbs, "measured", src)
            .with_figure("wait_wakeup_us", cpu_wakeup() * 1e6, "measured", src))


def run_suite(out: Path, shipped: Path, tokens: int = 32, models: list[str] | None = None,
              progress: Callable[[str], None] | None = None,
              repeats: int = 3) -> tuple[list[dict[str, Any]], dict[str, Trace], dict]:
    """Run and score every case. Ctrl-C stops after the last finished case (its trace is
    written as it finishes); the cases finished so far are scored and returned."""
    torch.set_num_threads(1)
    if progress:
        progress("measuring copy/compute interference")
    machine_hw = machine_profile()
    rows: list[dict[str, Any]] = []
    traces: dict[str, Trace] = {}
    with stop_on_interrupt():
        for name, load, links, scale in suite_models(shipped):
            if models and name not in models:
                continue
            model, dv, synthetic = load()
            prompt = torch.tensor([b % model.spec.vocab for b in PROMPT]).view(1, -1)
            for gbps in links:
                hw = get_profile(DEFAULT_PROFILE).with_figure("h2d_pinned_gbs", gbps, "estimate", "validation suite link")
                runs: dict[str, Trace] = {}
                for policy in POLICIES:
                    if progress:
                        progress(f"{name}, {gbps:g} GB/s, {policy}")
                    tr = _run_case(model, dv, prompt, policy, tokens * scale, hw, repeats, synthetic, name)
                    if tr is None:  # Ctrl-C: this case did not finish
                        break
                    key = f"{name}-{gbps:g}gbps-{policy}"
                    write_trace(tr, out / "traces" / f"{key}.npz")
                    runs[policy] = traces[key] = tr
                rows += _score(name, gbps, hw, runs, model, machine_hw)
                if stop_requested():
                    break
            if stop_requested():
                break
        summary = summarise(rows)
        if stop_requested():
            summary["interrupted"] = f"Ctrl-C: {len(traces)} finished cases kept and scored; the rest did not run"
    summary["machine figures (measured)"] = (
        f"{machine_hw['copy_interference']:.1%} compute slowdown at {machine_hw['copy_interference_gbs']:.1f} GB/s "
        f"of back-to-back copying, scaled by each link's rate; {machine_hw['wait_wakeup_us']:.0f} us from a copy "
        "landing to the waiting thread running")
    return rows, traces, summary


def _run_case(model: MoEModel, dv, prompt: torch.Tensor, policy: str, tokens: int, hw: HardwareProfile, repeats: int,
              synthetic: bool, name: str) -> Trace | None:
    """One case: a warm-up, then ``repeats`` runs; the run with the median TPOT (a single run
    on a shared machine can come out slow as a whole). None if Ctrl-C cut any run short."""
    st = ProfileSettings(policy=policy, predictor="quasi", tokens=tokens)
    candidates = []
    try:
        generate(model, prompt, ProfileSettings(policy=policy, tokens=2), hw, dv)  # warm-up
        for _ in range(repeats):
            prefill, records, out_tokens = generate(model, prompt, st, hw, dv)
            if len(records) < tokens:
                return None
            candidates.append(build_trace(model, prompt, st, hw, prefill, records, out_tokens, "cpu", synthetic, name))
    except Interrupted:
        return None
    candidates.sort(key=lambda c: float(c.timings["tpot_s"][1:].mean()))
    return candidates[len(candidates) // 2]


def _score(name: str, gbps: float, hw: HardwareProfile, runs: dict[str, Trace], model: MoEModel,
           machine_hw: HardwareProfile) -> list[dict[str, Any]]:
    """Same-policy replay of every finished run; transfer from the on-demand run when it finished."""
    rows = []
    base = runs.get("on-demand")
    for policy, tr in runs.items():
        tm = tr.timings
        measured = {"measured_compute_ms": float((tm["attn_s"].sum(1) + tm["expert_s"].sum(1) + tm["other_s"])[1:].mean() * 1e3),
                    "measured_copy_ms": float(Link.from_profile(hw, model.spec).copy_time(len(tm["copy_bytes"])
                                                                                          / tr.n_tokens) * 1e3)}
        same, _ = validate_trace(tr, machine_hw)
        rows.append({"model": name, "link_gbps": gbps, "policy": policy, "case": "same-policy", **measured,
                     **_short(same)})
        if policy != "on-demand" and base is not None:
            pred = simulate(base, recorded_profile(base, machine_hw), policy, timing="measured").tpot[1:]
            stats_ = error_stats(tr.timings["tpot_s"][1:], pred[: tr.n_tokens - 1])
            rows.append({"model": name, "link_gbps": gbps, "policy": policy, "case": "transfer from on-demand",
                         **measured, **_short(stats_)})
    return rows


def _short(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("measured_ms", "predicted_ms", "error", "mape", "bias", "tost_p", "equivalent")}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for case, target in (("same-policy", 0.03), ("transfer from on-demand", 0.05)):
        errs = np.array([abs(r["error"]) for r in rows if r["case"] == case])
        if errs.size:
            out[f"{case}: mean |error|"] = f"{errs.mean():.2%} over {errs.size} cases (target <= {target:.0%}), " \
                                           f"max {errs.max():.2%}"
    return out


def machine() -> str:
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__} (1 compute thread + link thread)"
