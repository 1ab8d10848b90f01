"""Reports that put measurements next to predictions: one trace (``replay --validate``)
and the validation suite (``moesim validate``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np  # noqa: E402

from moesim import budget
from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.errors import MoesimError
from moesim.executor.validation_plan import check_suite_model
from moesim.hardware import HardwareProfile  # noqa: E402
from moesim.models import get_model
from moesim.outputs import check_output_dir
from moesim.policy import QUEUES
from moesim.reports.render import COLORS, breakdown_png, pyplot, save_figure, write_csv, write_html  # noqa: E402
from moesim.setting import Setting
from moesim.sim.engine import Span  # noqa: E402
from moesim.sim.simulate import SimResult, simulate  # noqa: E402
from moesim.sim.validate import recorded_profile
from moesim.traces.format import COPY_KINDS, Trace  # noqa: E402


def measured_spans(trace: Trace, step: int) -> list[Span]:
    """One step's measured timeline: compute intervals laid end to end from the per-layer
    durations (attention, stall, experts), copies from their recorded start and end."""
    tm = trace.timings
    spans, t = [], 0.0
    moe = list(trace.model.moe_layers)
    for layer in range(trace.model.n_layers):
        a = float(tm["attn_s"][step, layer])
        spans.append(Span("compute", f"attn L{layer}", t, t + a, step, layer))
        t += a
        if layer in moe:
            m = moe.index(layer)
            t += float(tm["stall_s"][step, m])
            g = float(tm["expert_s"][step, m])
            spans.append(Span("compute", f"experts L{layer}", t, t + g, step, layer))
            t += g
    sel = tm["copy_token"] == step
    for layer, kind, start, end in zip(tm["copy_layer"][sel], tm["copy_kind"][sel], tm["copy_start_s"][sel],
                                       tm["copy_end_s"][sel], strict=True):
        spans.append(Span("copy", f"{COPY_KINDS[int(kind)]} L{int(layer)}", float(start), float(end), step, int(layer)))
    return spans


def timeline_pair_png(measured: list[Span], simulated: list[Span], path: Path, title: str) -> Path:
    """Measured (top pair of lanes) and simulated (bottom pair) timelines of the same step."""
    step = measured[0].step
    simulated = [s for s in simulated if s.step == step]
    fig, ax = pyplot().subplots(figsize=(11, 3.4))
    t0_sim = min(s.start for s in simulated)
    lanes = {("measured", "compute"): 3, ("measured", "copy"): 2, ("simulated", "compute"): 1, ("simulated", "copy"): 0}
    for source, spans, t0 in (("measured", measured, 0.0), ("simulated", simulated, t0_sim)):
        for s in spans:
            color = (COLORS["copy"] if not s.name.startswith("prefetch") else "#E6AB02") if s.lane == "copy" else \
                ("#8DA0CB" if s.name.startswith("attn") else COLORS["compute"])
            ax.broken_barh([((s.start - t0) * 1e3, max(s.end - s.start, 1e-9) * 1e3)],
                           (lanes[(source, s.lane)] - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(4), ["simulated copy", "simulated compute", "measured copy", "measured compute"])
    ax.set_xlabel("ms since the step started")
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def scatter_png(points: list[dict[str, Any]], path: Path, title: str, key: str = "kind") -> Path:
    """Predicted against measured TPOT with the identity line and +-5% band."""
    fig, ax = pyplot().subplots(figsize=(5.2, 4.6))
    kinds = sorted({p[key] for p in points})
    for kind, marker in zip(kinds, "os^Dv<>", strict=False):
        pts = [p for p in points if p[key] == kind]
        ax.scatter([p["measured_ms"] for p in pts], [p["predicted_ms"] for p in pts], marker=marker, label=kind, alpha=0.8)
    lo = min(min(p["measured_ms"], p["predicted_ms"]) for p in points) * 0.9
    hi = max(max(p["measured_ms"], p["predicted_ms"]) for p in points) * 1.1
    xs = np.linspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=1, label="identity")
    ax.fill_between(xs, xs * 0.95, xs * 1.05, color="grey", alpha=0.15, label="+-5%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured TPOT, ms")
    ax.set_ylabel("simulated TPOT, ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return save_figure(fig, path)


def per_token_png(measured: np.ndarray, predicted: np.ndarray, path: Path, title: str) -> Path:
    fig, ax = pyplot().subplots(figsize=(8, 3))
    ax.plot(measured * 1e3, label="measured", lw=1.2)
    ax.plot(predicted * 1e3, label="simulated", lw=1.2, ls="--")
    ax.set_xlabel("decode step")
    ax.set_ylabel("TPOT, ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def hit_rate_png(traces: dict[str, Trace], path: Path, title: str) -> Path:
    """Per-layer prediction recall@k and rank alignment, from the traces' metrics."""
    fig, ax = pyplot().subplots(figsize=(7, 3.4))
    for label, tr in traces.items():
        met = tr.meta.metrics
        rec, al = met.get("recall_at_k"), met.get("rank_alignment")
        if rec:
            ax.plot(range(len(rec)), rec, "o-", label=f"{label}: recall@k")
            ax.plot(range(len(al)), al, "s--", label=f"{label}: rank alignment")
    ax.set_xlabel("MoE layer (predicted)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def chrome_pair(measured: list[Span], simulated: list[Span], path: Path) -> Path:
    """Measured and simulated timelines as two processes of one Chrome/Perfetto trace."""
    events: list[dict[str, Any]] = []
    for pid, (name, spans) in enumerate((("measured", measured), ("simulated", simulated)), start=1):
        t0 = min(s.start for s in spans) if spans else 0.0
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"moesim {name}"}})
        for tid, lane in ((1, "compute"), (2, "copy")):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": "compute stream" if lane == "compute" else "copy engine (H2D)"}})
        for s in spans:
            events.append({"ph": "X", "pid": pid, "tid": 1 if s.lane == "compute" else 2, "name": s.name,
                           "ts": (s.start - t0) * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": {"step": s.step, "layer": s.layer}})
    return atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_single_validation(trace: Trace, trace_path: Path, hw: HardwareProfile, stats_: dict[str, Any],
                            result: SimResult, out: Path) -> Path:
    out = Path(out)
    step = min(1, trace.n_tokens - 1)
    atomic_write_text(out / "validation.json", json.dumps(stats_, indent=2))
    per_token_png(trace.timings["tpot_s"], result.tpot, out / "per_token.png",
                  f"{trace.model.name}, {stats_['policy']}: measured vs simulated per step")
    cfg = result.config
    sim = simulate(trace.head(step + 1), hw, cfg["policy"], Setting(cache_experts=cfg["cache_experts"], eviction=cfg["eviction"] if cfg["cache_experts"] else "lru", timing="measured"), record=True)
    meas = measured_spans(trace, step)
    timeline_pair_png(meas, sim.spans, out / "timeline.png", f"step {step}: measured and simulated")
    chrome_pair(meas, [s for s in sim.spans if s.step == step], out / "timelines.trace.json")
    what = (f"measured by the executor ({trace.meta.transport or '?'}, "
            f"{trace.meta.device or '?'}); simulated by the SimPy model from the trace's "
            f"measured compute times and the recorded link ({hw['h2d_pinned_gbs']:g} GB/s, "
            f"{hw['transfer_latency_us']:g} us a transfer)")
    sections = [
        {"heading": "Error", "rows": [stats_], "cols": ["policy", "tokens", "measured_ms", "predicted_ms", "error", "mape",
                                                        "bias", "p50_abs_error", "p90_abs_error", "tost_p", "equivalent"]},
        {"heading": "Per step", "image": out / "per_token.png", "caption": f"TPOT per decode step; {what}."},
        {"heading": "Timeline", "image": out / "timeline.png",
         "caption": f"One step, compute stream and copy engine; measured compute intervals are laid end to end from "
                    f"per-layer durations; {what}. Both as a Chrome/Perfetto trace: timelines.trace.json."},
    ]
    return write_html(out / "report.html", f"moesim validation: {trace_path.name}", what + ".", sections)


def queues_png(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Per (link, predictor): each copy queue's measured TPOT (median, bar; runs' range,
    whisker) with the simulator's prediction from the FIFO run (marker)."""
    settings = list(dict.fromkeys((r["link_gbps"], r["predictor"]) for r in rows))
    queues = list(dict.fromkeys(r["queue"] for r in rows))
    fig, ax = pyplot().subplots(figsize=(max(5.0, 1.6 * len(settings) + 2), 3.8))
    width = 0.8 / len(queues)
    for i, q in enumerate(queues):
        sel = [next(r for r in rows if (r["link_gbps"], r["predictor"], r["queue"]) == (*s, q)) for s in settings]
        x = np.arange(len(settings)) + (i - (len(queues) - 1) / 2) * width
        med = np.array([r["measured_ms"] for r in sel])
        err = np.array([[m - r["measured_min_ms"] for m, r in zip(med, sel)],
                        [r["measured_max_ms"] - m for m, r in zip(med, sel)]])
        ax.bar(x, med, width * 0.9, yerr=err, capsize=2, label=f"{q} (measured)", color=f"C{i}", alpha=0.8)
        ax.scatter(x, [r["from_fifo_ms"] for r in sel], marker="D", s=18, color="black", zorder=3,
                   label="predicted from the FIFO run" if i == 0 else None)
    ax.set_xticks(range(len(settings)), [f"{g:g} GB/s\n{p} predictor" for g, p in settings], fontsize=8)
    ax.set_ylabel("ms per output token")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def write_suite_report(rows: list[dict[str, Any]], traces: dict[str, Trace], summary: dict[str, Any], out: Path,
                       example: tuple[Trace, HardwareProfile] | None, machine: str,
                       cpu_rows: list[dict[str, Any]] | None = None,
                       queues: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None) -> Path:
    out = Path(out)
    cpu_rows = cpu_rows or []
    queue_rows, winners = queues or ([], [])
    write_csv(rows, out / "errors.csv")
    if cpu_rows:
        write_csv(cpu_rows, out / "cpu-errors.csv")
    if queue_rows:
        write_csv(queue_rows, out / "queues.csv")
    atomic_write_text(out / "summary.json", json.dumps({"summary": summary, "rows": rows, "cpu_rows": cpu_rows,
                                                        "queue_rows": queue_rows, "queue_winners": winners}, indent=2))
    points = [{**r, "kind": r["case"]} for r in rows]
    scatter_png(points, out / "scatter.png", f"simulated vs measured mean TPOT, {len(rows)} cases ({machine})")
    same = [r for r in rows if r["case"] == "same-policy"]
    breakdown_rows = [{"tpot_ms": r["measured_ms"], "compute_ms": r["measured_compute_ms"],
                       "stall_ms": r["measured_ms"] - r["measured_compute_ms"],
                       "copy_ms": r["measured_copy_ms"], "overlap_bound_ms": max(r["measured_compute_ms"], r["measured_copy_ms"])}
                      for r in same]
    breakdown_png(breakdown_rows, [f"{r['model']}\n{r['link_gbps']:g} GB/s {r['policy']}" for r in same],
                  out / "breakdown.png", "measured TPOT breakdown per policy (executor, CPU, emulated link)")
    # Routing does not depend on the link, so one learned-model run per predictor is enough.
    learned = {k: v for k, v in traces.items() if "prefetch-fom" in k and not v.synthetic}
    learned = dict(list(learned.items())[:1])
    sections = [
        {"heading": "Summary", "text": " ".join(f"{k}: {v}." for k, v in summary.items())},
        {"heading": "Predicted against measured", "image": out / "scatter.png",
         "caption": f"Each point is one case: the executor's measured mean TPOT (x) and the SimPy model's prediction (y). "
                    f"same-policy: replay of the run's own trace; transfer: predicted from the on-demand trace of the same "
                    f"model and link, then measured by running that policy. All on {machine}, CPU with the emulated link."},
        {"heading": "Measured breakdown", "image": out / "breakdown.png",
         "caption": "Measured compute plus stall equals measured TPOT; the copy-engine time and max(compute, copy) are marked. "
                    "Executor measurements, CPU, emulated link."},
    ]
    if learned:
        hit_rate_png(learned, out / "hit_rate.png", "per-layer prediction recall@k and rank alignment (learned-routing model)")
        sections.append({"heading": "Prediction quality", "image": out / "hit_rate.png",
                         "caption": "Measured on the learned-routing model moe-stdlib by the executor (quasi-hidden-state "
                                    "predictor), per MoE layer; layer 0 has no prediction."})
    if example is not None:
        tr, hw = example
        step = min(1, tr.n_tokens - 1)
        sim = simulate(tr.head(step + 1), hw, tr.meta.replay_policy, Setting(timing="measured"), record=True)
        meas = measured_spans(tr, step)
        timeline_pair_png(meas, sim.spans, out / "timeline.png", f"{tr.model.name}, {tr.meta.policy}, step {step}")
        chrome_pair(meas, [s for s in sim.spans if s.step == step], out / "timelines.trace.json")
        sections.append({"heading": "One step, measured and simulated", "image": out / "timeline.png",
                         "caption": "Compute stream and copy engine, measured by the executor (compute intervals laid end to "
                                    "end from per-layer durations) and simulated by the SimPy model from that trace. "
                                    "Chrome/Perfetto trace: timelines.trace.json."})
    sections.append({"heading": "All cases", "rows": rows, "cols": [
        "model", "link_gbps", "policy", "case", "measured_ms", "predicted_ms", "error", "error_min", "error_max", "runs", "mape",
        "equivalent"]})
    if cpu_rows:
        sections.append({"heading": "CPU-compute policies and int8 experts", "text":
                         "The executor running cpu-static (half the MoE layers' experts on the CPU), hot-experts (half "
                         "the experts resident, placed from a separate calibration run), cpu-on-miss (a quarter of "
                         "the experts cached) and int8 experts, on the synthetic geometry (seeded random weights: "
                         "synthetic routing), at one emulated link. CPU experts run on a thread pool of this same "
                         "machine, whose host figures are measured before the runs (summary above). same-policy: "
                         "replay of the run's own trace; transfer: predicted from the on-demand trace of the same "
                         "expert format. Each case is the run with the median TPOT.",
                         "rows": cpu_rows, "cols": ["policy", "case", "measured_ms", "predicted_ms", "error", "mape"]})
    if queue_rows:
        queues_png(queue_rows, out / "queues.png", f"copy queues under prefetch-fom, {queue_rows[0]['model']} ({machine})")
        sections.append({"heading": "Copy queues: which wins, when", "image": out / "queues.png", "text":
                         "The executor running prefetch-fom with each copy queue on the synthetic geometry (seeded "
                         "random weights: synthetic routing): fifo (a layer waits for its whole prefetch), "
                         "demand-first (a miss overtakes queued prefetch copies, one expert at a time; a layer waits "
                         "only for the prefetched experts it runs) and cancel-unstarted (also drops a prefetch's "
                         "unstarted tail past the last expert the layer runs), with a real (stale) and a perfect "
                         "(oracle) predictor at two emulated links. Bars: "
                         "measured median TPOT, whiskers the runs' range; markers: the simulator's prediction from "
                         "the FIFO run's trace. A win inside the runs' spread is a tie (clear = no).",
                         "rows": winners, "cols": ["link_gbps", "predictor", "measured_winner", "margin", "clear",
                                                   "predicted_winner", "predicted_margin"]})
        sections.append({"heading": "Copy queues: every case", "rows": queue_rows, "cols": [
            "link_gbps", "predictor", "queue", "measured_ms", "measured_min_ms", "measured_max_ms",
            "prefetch_copies_per_token", "same_policy_ms", "same_policy_error", "from_fifo_ms", "from_fifo_error"]})
    return write_html(out / "report.html", "moesim validation suite", f"Simulator against executor on {machine}.", sections)


def _check_budget(tokens: int, repeats: int, model: str | None) -> None:
    """Refuse, before any run, a suite that cannot fit in memory or would take more than a
    day (``moesim.budget``): the largest run's memory, and every run's time added up. The
    synthetic model's runs are checked first, alone: its geometry is known without reading
    a config (the learned model's needs transformers, seconds of imports), so a suite whose
    synthetic part is already too long is refused at once."""
    from moesim.executor.validation_plan import POLICIES, PROMPT, SUITE, SYNTHETIC_SPEC  # torch-free: refused at once

    peak, seconds = 0.0, 0.0
    order = sorted(SUITE, key=lambda row: row[0] != SYNTHETIC_SPEC.name)
    for name, links, scale in order:
        if model and name != model:
            continue
        spec = SYNTHETIC_SPEC if name == SYNTHETIC_SPEC.name else get_model(name)
        for gbps in links:
            est = budget.decode_estimate(spec, tokens * scale, 1, 4, gbps, 0, True, len(PROMPT))
            peak = max(peak, est.bytes)
            seconds += est.seconds * (len(POLICIES) + 1) * repeats  # + the warm-up runs
        if name == SYNTHETIC_SPEC.name and len(order) > 1 and not model:
            budget.check(budget.Estimate(f"the validation suite's synthetic model alone ({tokens} tokens, "
                                         f"{repeats} rounds)", peak, seconds), warn=None)
    budget.check(budget.Estimate(f"the validation suite ({tokens} tokens, {repeats} rounds)", peak, seconds))


def validation_suite(out: Path, tokens: int = 32, model: str | None = None, repeats: int = 3,
                     progress: Callable[[str, int, int], None] | None = None,
                     cpu_policies: bool = True, copy_queues: bool = True) -> tuple[
                         list[dict[str, Any]], list[dict[str, Any]], tuple[list, list], dict[str, Any], str, Path]:
    """``moesim validate``: run the suite (moesim.executor.validation) and write its report
    to ``out``; returns (rows, the CPU-compute policies' rows, the copy queues' (rows,
    winners), summary, the machine, the report page). The CPU-compute policies
    (``run_cpu_suite``, on the synthetic geometry) run after the copy policies unless
    ``cpu_policies`` is False or ``model`` names the learned model; the copy queues
    (``moesim.executor.validation_queues``, on the synthetic geometry too) last unless
    ``copy_queues`` is False or ``model`` names the learned model. Lives in the reports layer because it joins the executor's runs with
    the simulator's replays."""
    check_suite_model(model)
    if tokens < 3 or repeats < 1:
        raise MoesimError("--tokens must be >= 3 (the first step is warm-up) and --repeats >= 1")
    _check_budget(tokens, repeats, model)
    from moesim.executor.loading import shipped_model  # the executor needs torch: only the suite imports it
    from moesim.executor.validation import (  # torch
        CPU_CASES,
        SYNTHETIC_SPEC,
        machine,
        machine_facts,
        run_cpu_suite,
        run_suite,
    )

    check_output_dir(out)
    # torch, as above (interrupt itself does not import it, but belongs to the suite's run)
    from moesim.executor.interrupt import stop_on_interrupt, stop_requested
    from moesim.executor.validation_queues import QUEUE_LINKS, QUEUE_PREDICTORS, run_queue_suite  # torch

    cpu_policies = cpu_policies and model in (None, SYNTHETIC_SPEC.name)
    copy_queues = copy_queues and model in (None, SYNTHETIC_SPEC.name)
    n_queue = len(QUEUE_LINKS) * len(QUEUE_PREDICTORS) * len(QUEUES) * repeats if copy_queues else 0
    n_cpu = (len(CPU_CASES) + 2 if cpu_policies else 0) + n_queue  # CPU: the cases and their two on-demand bases
    main_total, cpu_done = [0], [0]

    def main_progress(doing: str, done: int, total: int) -> None:
        main_total[0] = total
        if progress:
            progress(doing, done, total + n_cpu)

    def extra_progress(doing: str) -> None:  # the parts after the main suite, counted on from its runs
        if progress:
            progress(doing, main_total[0] + cpu_done[0], main_total[0] + n_cpu)
        cpu_done[0] += 1

    cpu_rows: list[dict[str, Any]] = []
    queues: tuple[list, list] = ([], [])
    with stop_on_interrupt():  # Ctrl-C: report the finished cases
        rows, traces, summary = run_suite(out, shipped_model(), tokens, [model] if model else None, main_progress,
                                          repeats)
        if not rows:
            raise MoesimError(f"no suite model called {model!r}")
        if cpu_policies and not stop_requested():
            cpu_rows, _, cpu_summary = run_cpu_suite(out, max(3, tokens // 2), repeats=repeats, progress=lambda doing: extra_progress(f"CPU-compute policies: {doing}"))
            summary.update(cpu_summary)
        if copy_queues and not stop_requested():
            queue_rows, winners, queue_summary = run_queue_suite(out, shipped_model(), max(3, tokens // 2), repeats,
                                                                 lambda doing: extra_progress(f"copy queues: {doing}"))
            queues = (queue_rows, winners)
            summary.update(queue_summary)
    summary["machine"] = machine_facts()  # what the runs ran on, for comparing machines
    example = next((tr for k, tr in traces.items() if k.endswith("prefetch-fom")), None)
    page = write_suite_report(rows, traces, summary, out,
                              (example, recorded_profile(example)) if example is not None else None, machine(),
                              cpu_rows, queues)
    return rows, cpu_rows, queues, summary, machine(), page
