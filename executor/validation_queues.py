"""The copy-queue disciplines executed and predicted: which one wins, when, and does the
simulator say so? The validation suite's third part (``moesim validate``).

On the suite's synthetic geometry (seeded random weights: **synthetic** routing; top-4 of
16 experts, ms-scale copies, so a queue's effect stands well above run-to-run noise), at
two link-bound emulated links (copies ~2.8x and ~1.4x a step's compute), with a real predictor (``stale``: the layer's
own router input, about half its prefetches wrong) and a perfect one (``oracle``), the
executor decodes under prefetch-fom with each queue of :data:`moesim.policy.QUEUES`, the
queues interleaved in each of ``repeats`` rounds (as the main suite interleaves policies,
for the same reason: the machine's speed drifts). Per case:

- **measured**: the median of the runs' mean TPOT, with the runs' min and max;
- **same-policy**: the simulator replaying the median run's own trace with its queue;
- **from FIFO**: the simulator predicting the queue from the FIFO runs' traces (median
  over them): what a user who recorded one FIFO run is told about the others.

Per (link, predictor): the queue that wins, measured and predicted from FIFO. A measured
win whose margin over the runner-up is inside the runs' spread (or rests on one run) is
called a tie: the machine cannot tell the two apart, and the table says so rather than
crown one. The learned model is not used here: its top-2 routing leaves a prefetch at
most one wrong expert to drop, an effect below its run-to-run noise (measured: every
queue within ~10% of the others on single runs, in no consistent order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.profile import Origin, ProfileSettings, build_trace, generate
from moesim.executor.steady import SteadyMachine
from moesim.executor.validation import PROMPT, Bench, _median_run, machine_profile, suite_models
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, get_profile
from moesim.policy import QUEUES
from moesim.setting import Setting
from moesim.sim.simulate import simulate
from moesim.sim.validate import recorded_profile, validate_trace
from moesim.traces.format import Trace, write_trace

SUITE_MODEL = 1  # executor.validation.suite_models: the synthetic geometry
QUEUE_LINKS = (2.0, 4.0)  # GB/s: prefetch-fom's copies ~2.8x and ~1.4x the synthetic geometry's compute a step
QUEUE_PREDICTORS = ("stale", "oracle")
POLICY = "prefetch-fom"  # fetch-on-miss: the policy whose wrong prefetches a demand copy waits behind


def run_queue_suite(out: Path, shipped: Path, tokens: int = 16, repeats: int = 3,
                    progress: Callable[[str], None] | None = None,
                    machine_hw: HardwareProfile | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict]:
    """Run and score every case; returns (rows, winners per setting, summary). Ctrl-C keeps
    the settings whose runs all finished. Median traces go to ``out/traces``."""
    torch.set_num_threads(1)
    name, load, _, _ = suite_models(shipped)[SUITE_MODEL]
    model, dv, synthetic = load()
    prompt = torch.tensor([b % model.spec.vocab for b in PROMPT]).view(1, -1)
    if machine_hw is None:
        machine_hw = machine_profile()
    rows: list[dict[str, Any]] = []
    steady = SteadyMachine()
    with stop_on_interrupt():
        for gbps in QUEUE_LINKS:
            hw = get_profile(DEFAULT_PROFILE).with_figure("h2d_pinned_gbs", gbps, "estimate", "validation suite link")
            for predictor in QUEUE_PREDICTORS:
                bench = Bench(model, dv, prompt, tokens, hw, repeats, synthetic, name, steady)
                runs = _run_setting(bench, predictor, progress)
                if runs is None:
                    break
                for q, trs in runs.items():
                    write_trace(_median_run(trs), out / "traces" / f"queues-{gbps:g}gbps-{predictor}-{q}.npz")
                rows += _score(name, gbps, predictor, runs, machine_hw)
            if stop_requested():
                break
    winners = pick_winners(rows)
    summary = summarise_queues(rows, winners)
    if rows:
        summary["copy queues, steady machine"] = steady.summary()
    return rows, winners, summary


def _run_setting(b: Bench, predictor: str, progress: Callable[[str], None] | None) -> dict[str, list[Trace]] | None:
    """Every queue at one link and predictor, ``repeats`` interleaved rounds; None if Ctrl-C
    cut it (a setting is scored whole or not at all: its winner needs every queue)."""
    runs: dict[str, list[Trace]] = {q: [] for q in QUEUES}
    gbps = b.hw["h2d_pinned_gbs"]
    for r in range(b.repeats):
        for q in QUEUES:
            if progress:
                progress(f"{b.name}, {gbps:g} GB/s, {predictor} predictor, {q}, run {r + 1}/{b.repeats}")
            st = ProfileSettings(policy=POLICY, predictor=predictor, tokens=b.tokens, copy_queue=q)
            try:
                if r == 0:
                    generate(b.model, b.prompt, ProfileSettings(policy=POLICY, predictor=predictor, tokens=2, copy_queue=q),
                             b.hw, b.dv)  # warm-up
                prefill, records, out_tokens = b.steady.run(lambda st=st: generate(b.model, b.prompt, st, b.hw, b.dv))
            except Interrupted:
                return None
            if len(records) < b.tokens or stop_requested():
                return None
            runs[q].append(build_trace(b.model, b.prompt, st, b.hw, prefill, records, out_tokens, Origin("cpu", b.synthetic, b.name)))
    return runs


def _mean_tpot(tr: Trace) -> float:
    return float(tr.timings["tpot_s"][1:].mean())  # the first step is warm-up


def _score(name: str, gbps: float, predictor: str, runs: dict[str, list[Trace]],
           machine_hw: HardwareProfile) -> list[dict[str, Any]]:
    rows = []
    for q, trs in runs.items():
        measured = sorted(_mean_tpot(t) for t in trs)
        median = measured[(len(measured) - 1) // 2]
        same, _ = validate_trace(_median_run(trs), machine_hw)
        preds = sorted(float(simulate(b, recorded_profile(b, machine_hw), POLICY, Setting(timing="measured", copy_queue=q), as_recorded=True).tpot[1:].mean()) for b in runs["fifo"])
        from_fifo = preds[(len(preds) - 1) // 2]
        copies = np.mean([(t.timings["copy_kind"] == 0).sum() / t.n_tokens for t in trs])
        rows.append({"model": name, "link_gbps": gbps, "predictor": predictor, "queue": q, "runs": len(trs),
                     "measured_ms": median * 1e3, "measured_min_ms": measured[0] * 1e3,
                     "measured_max_ms": measured[-1] * 1e3, "prefetch_copies_per_token": float(copies),
                     "same_policy_ms": same["predicted_ms"], "same_policy_error": same["error"],
                     "from_fifo_ms": from_fifo * 1e3, "from_fifo_error": from_fifo / median - 1})
    return rows


def pick_winners(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, link, predictor): the measured and the predicted (from FIFO) winner. The
    measured win is ``clear`` when the winner's slowest run beats the runner-up's fastest
    (never on one run: no spread to judge by). The predicted winner is ``tie`` when the
    best two predictions are equal."""
    out = []
    for key in dict.fromkeys((r["model"], r["link_gbps"], r["predictor"]) for r in rows):
        sel = sorted((r for r in rows if (r["model"], r["link_gbps"], r["predictor"]) == key),
                     key=lambda r: r["measured_ms"])
        best, second = sel[0], sel[1]
        predicted = min(sel, key=lambda r: r["from_fifo_ms"])
        predicted_margin = sorted(r["from_fifo_ms"] for r in sel)[1] / predicted["from_fifo_ms"] - 1
        out.append({"model": key[0], "link_gbps": key[1], "predictor": key[2], "runs": best["runs"],
                    "measured_winner": best["queue"],
                    "margin": second["measured_ms"] / best["measured_ms"] - 1,
                    "clear": best["runs"] > 1 and best["measured_max_ms"] < second["measured_min_ms"],
                    # the simulator is deterministic: equal predictions are a predicted tie, not a pick
                    "predicted_winner": predicted["queue"] if predicted_margin > 1e-6 else "tie",
                    "predicted_margin": predicted_margin})
    return out


def summarise_queues(rows: list[dict[str, Any]], winners: list[dict[str, Any]]) -> dict[str, str]:
    if not rows:
        return {}
    same = np.array([abs(r["same_policy_error"]) for r in rows])
    fifo = np.array([abs(r["from_fifo_error"]) for r in rows if r["queue"] != "fifo"])
    clear = [w for w in winners if w["clear"]]
    agree = sum(w["measured_winner"] == w["predicted_winner"] for w in clear)
    text = (f"same-policy mean |error| {same.mean():.2%} (max {same.max():.2%}) over {same.size} cases; "
            f"predicted from the FIFO run: {fifo.mean():.2%} (max {fifo.max():.2%}) over {fifo.size}; "
            f"{len(clear)} of {len(winners)} settings have a clear measured winner, "
            f"and the prediction from FIFO names it in {agree} of them")
    return {"copy queues (executed)": text}
