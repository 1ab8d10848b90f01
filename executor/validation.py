"""The built-in validation suite: the simulator against the executor on this machine.

For each model and emulated link bandwidth, the executor decodes under four policies,
interleaved, for several rounds, and records traces. Two kinds of case are scored, each
as the median over the rounds with its spread:

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
              progress: Callable[[str, int, int], None] | None = None,
              repeats: int = 3) -> tuple[list[dict[str, Any]], dict[str, Trace], dict]:
    """Run and score every case. Ctrl-C stops after the last finished run (each case's
    trace is written as its runs finish); the runs finished so far are scored and returned.
    ``progress(doing, runs done, runs in all)`` before each run."""
    torch.set_num_threads(1)
    chosen = [s for s in suite_models(shipped) if not models or s[0] in models]
    total = sum(len(links) * len(POLICIES) * repeats for _, _, links, _ in chosen)
    started = [0]

    def counted(doing: str) -> None:  # called as each run starts: the runs before it are done
        if progress:
            progress(doing, started[0], total)
        started[0] += 1

    if progress:
        progress("measuring copy/compute interference", 0, total)
    machine_hw = machine_profile()
    rows: list[dict[str, Any]] = []
    traces: dict[str, Trace] = {}
    with stop_on_interrupt():
        for name, load, links, scale in chosen:
            model, dv, synthetic = load()
            prompt = torch.tensor([b % model.spec.vocab for b in PROMPT]).view(1, -1)
            for gbps in links:
                hw = get_profile(DEFAULT_PROFILE).with_figure("h2d_pinned_gbs", gbps, "estimate", "validation suite link")
                runs = _run_link(model, dv, prompt, tokens * scale, hw, repeats, synthetic, name, gbps, out, traces,
                                 counted)
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


def _run_link(model: MoEModel, dv, prompt: torch.Tensor, tokens: int, hw: HardwareProfile, repeats: int,
              synthetic: bool, name: str, gbps: float, out: Path, traces: dict[str, Trace],
              progress: Callable[[str], None]) -> dict[str, list[Trace]]:
    """Every policy on one link, ``repeats`` rounds, the policies interleaved within a round.

    Why interleaved: on a shared or throttling machine the speed of the CPU drifts over
    seconds to minutes. Running all of one policy's repeats before the next policy's puts
    that drift between the on-demand run a transfer is predicted from and the run it is
    judged against; interleaving keeps each round's runs seconds apart, and scoring pairs
    them round by round (:func:`_score`). Each case's trace file holds its median-TPOT run
    so far, rewritten (atomically) as runs finish, so Ctrl-C keeps it."""
    runs: dict[str, list[Trace]] = {p: [] for p in POLICIES}
    for r in range(repeats):
        for policy in POLICIES:
            progress(f"{name}, {gbps:g} GB/s, {policy}" + (f", run {r + 1}/{repeats}" if repeats > 1 else ""))
            st = ProfileSettings(policy=policy, predictor="quasi", tokens=tokens)
            try:
                if r == 0:
                    generate(model, prompt, ProfileSettings(policy=policy, tokens=2), hw, dv)  # warm-up
                prefill, records, out_tokens = generate(model, prompt, st, hw, dv)
            except Interrupted:
                return runs
            if len(records) < tokens:  # Ctrl-C cut the run short
                return runs
            runs[policy].append(build_trace(model, prompt, st, hw, prefill, records, out_tokens, "cpu", synthetic, name))
            key = f"{name}-{gbps:g}gbps-{policy}"
            traces[key] = _median_run(runs[policy])
            write_trace(traces[key], out / "traces" / f"{key}.npz")
            if stop_requested():
                return runs
    return runs


def _median_run(runs: list[Trace]) -> Trace:
    return sorted(runs, key=lambda c: float(c.timings["tpot_s"][1:].mean()))[(len(runs) - 1) // 2]


def _score(name: str, gbps: float, hw: HardwareProfile, runs: dict[str, list[Trace]], model: MoEModel,
           machine_hw: HardwareProfile) -> list[dict[str, Any]]:
    """Same-policy replay of every finished run, and transfer from the on-demand run of the
    same round; each case is the run with the median error, with the spread over runs."""
    rows = []
    base = runs.get("on-demand", [])
    for policy, trs in runs.items():
        if not trs:
            continue
        same = [(validate_trace(tr, machine_hw)[0], tr) for tr in trs]
        rows.append(_case_row(name, gbps, policy, "same-policy", same, hw, model))
        if policy == "on-demand" or not base:
            continue
        moved = []
        for b, tr in zip(base, trs, strict=False):
            pred = simulate(b, recorded_profile(b, machine_hw), policy, timing="measured").tpot[1:]
            moved.append((error_stats(tr.timings["tpot_s"][1:], pred[: tr.n_tokens - 1]), tr))
        if moved:
            rows.append(_case_row(name, gbps, policy, "transfer from on-demand", moved, hw, model))
    return rows


def _case_row(name: str, gbps: float, policy: str, case: str, scored: list[tuple[dict[str, Any], Trace]],
              hw: HardwareProfile, model: MoEModel) -> dict[str, Any]:
    """One case from its scored runs: the run with the median error, and the spread of the
    error over all runs (min and max), so that one slow run shows as spread, not as the case."""
    scored = sorted(scored, key=lambda s: s[0]["error"])
    stats_, tr = scored[(len(scored) - 1) // 2]
    tm = tr.timings
    measured = {"measured_compute_ms": float((tm["attn_s"].sum(1) + tm["expert_s"].sum(1) + tm["other_s"])[1:].mean() * 1e3),
                "measured_copy_ms": float(Link.from_profile(hw, model.spec).copy_time(len(tm["copy_bytes"])
                                                                                      / tr.n_tokens) * 1e3)}
    return {"model": name, "link_gbps": gbps, "policy": policy, "case": case, **measured, **_short(stats_),
            "runs": len(scored), "error_min": scored[0][0]["error"], "error_max": scored[-1][0]["error"]}


def _short(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("measured_ms", "predicted_ms", "error", "mape", "bias", "tost_p", "equivalent")}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of case: the mean and max of the cases' |median error|, and the widest
    spread of a case's error over its runs (how far one run can be from its median)."""
    out = {}
    for case, target in (("same-policy", 0.03), ("transfer from on-demand", 0.05)):
        sel = [r for r in rows if r["case"] == case]
        if sel:
            errs = np.array([abs(r["error"]) for r in sel])
            spread = max(r["error_max"] - r["error_min"] for r in sel)
            out[f"{case}: mean |error|"] = (f"{errs.mean():.2%} over {errs.size} cases (target <= {target:.0%}), "
                                            f"max {errs.max():.2%}; each case the median of {sel[0]['runs']} runs, "
                                            f"widest spread over runs {spread:.2%}")
    return out


def machine() -> str:
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__} (1 compute thread + link thread)"
