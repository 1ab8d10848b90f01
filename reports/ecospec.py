"""The EcoSpec-at-scale report: synthetic speculative what-if for large MoE models.

:func:`ecospec_report` is the one library call behind the report (bench/bench_ecospec.py,
and the future ``moesim whatif --speculative``): for each model it draws synthetic
verification steps, runs the what-if on every deployment, fits verification latency
against distinct experts, and writes ``report.html`` with its PNGs, ``ecospec.csv`` and
``ecospec.json``. Everything in it is simulated on synthetic trees (deterministic for a
seed) and says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.models import get_model  # noqa: E402
from moesim.reports.render import save_figure, write_csv, write_html  # noqa: E402
from moesim.sim.deployment import get_deployment  # noqa: E402
from moesim.sim.draft import DraftProfile  # noqa: E402
from moesim.sim.ecospec import (  # noqa: E402
    DEFAULT_DRAFT,
    DEFAULT_PARAMS,
    SELECTIONS_DEFAULT,
    Selection,
    ecospec_whatif,
    latency_fit,
)
from moesim.traces.synthetic_speculative import SpecSynthParams, generate  # noqa: E402

MODELS = ("qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3")
RESIDENT = "8xh200-tp"  # fits all three models (DeepSeek-V3 does not fit 8 x 80 GB)
DEPLOYMENTS = ("8xh200-tp", "8xh200-ep", "1xh200-offload")
GAMMAS = (1, 2, 4, 8, 12, 16)
COLS = ["model", "deployment", "selection", "gamma", "tokens_per_step", "rows_per_step", "distinct_experts_per_step",
        "verify_ms", "draft_ms", "tpot_ms", "speedup_vs_none", "speedup_vs_confidence"]
SYNTHETIC = ("synthetic verification steps (moesim.traces.synthetic_speculative, seed {seed}); "
             "timed with the roofline deployment model (moesim.sim.deployment); no measurement")


def _distinct_png(rows: list[dict[str, Any]], models: tuple[str, ...], dep: str, path: Path) -> Path:
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model and r["deployment"] == dep and r["gamma"] > 0]
        for label in dict.fromkeys(r["selection"] for r in mine):
            pts = sorted((r["gamma"], r["distinct_experts_per_step"]) for r in mine if r["selection"] == label)
            ax.plot(*zip(*pts, strict=True), "o-", ms=3, label=label)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("gamma (candidates verified)")
        ax.set_ylabel("distinct experts a verification")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("expert dispersion: confidence-only vs EcoSpec selection (synthetic)", fontsize=10)
    return save_figure(fig, path)


def _latency_png(fits: list[dict[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(fits), figsize=(4.2 * len(fits), 3.6), squeeze=False)
    for ax, f in zip(axes[0], fits, strict=True):
        ax.scatter(f["x"], np.asarray(f["y"]) * 1e3, s=4, alpha=0.4)
        xs = np.linspace(min(f["x"]), max(f["x"]), 10)
        ax.plot(xs, f["slope_ms_per_expert"] * xs + f["intercept_ms"], "k-", lw=1,
                label=f"fit {f['slope_ms_per_expert'] * 1e3:.3g} us/expert")
        ax.plot(xs, f["analytic_ms_per_expert"] * (xs - xs[0]) + f["slope_ms_per_expert"] * xs[0] + f["intercept_ms"],
                "r:", lw=1, label=f"expert bytes / HBM: {f['analytic_ms_per_expert'] * 1e3:.3g} us")
        ax.set_title(f"{f['model']} on {f['deployment']}", fontsize=9)
        ax.set_xlabel("distinct experts in the verification (all layers)")
        ax.set_ylabel("verification latency, ms")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("verification latency grows linearly with distinct experts (synthetic steps, simulated)", fontsize=10)
    return save_figure(fig, path)


def _offload_png(rows: list[dict[str, Any]], models: tuple[str, ...], deps: tuple[str, ...], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for dep in deps:
            for label, ls in (("confidence", "--"), ("ecospec ratio", "-")):
                pts = sorted((r["gamma"], r["speedup_vs_none"]) for r in rows
                             if r["model"] == model and r["deployment"] == dep and r["selection"] in (label, "none"))
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls, marker="o", ms=3, label=f"{dep} {label}")
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("gamma")
        ax.set_ylabel("speed-up over no speculation")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("resident vs offloaded: a miss costs a PCIe copy instead of an HBM read (synthetic)", fontsize=10)
    return save_figure(fig, path)


def ecospec_report(out: Path, models: tuple[str, ...] = MODELS, deployments: tuple[str, ...] = DEPLOYMENTS,
                   gammas: tuple[int, ...] = GAMMAS, params: SpecSynthParams = DEFAULT_PARAMS,
                   selections: tuple[Selection, ...] = SELECTIONS_DEFAULT, draft: DraftProfile = DEFAULT_DRAFT,
                   resident: str = RESIDENT, context: int = 1024,
                   variants: tuple[SpecSynthParams, ...] = ()) -> dict[str, Any]:
    """Run the what-if for every model and write the report into ``out``; returns the rows
    and latency fits (what the report shows). ``variants`` (other tree shapes or acceptance
    models) are swept on the resident deployment into a sensitivity table."""
    from moesim.outputs import check_output_dir

    out = check_output_dir(out)  # before the sweep, not after
    rows: list[dict[str, Any]] = []
    fits: list[dict[str, Any]] = []
    for model in models:
        spec = get_model(model)
        synth = generate(spec, params)
        rows += ecospec_whatif(spec, list(deployments), list(gammas), selections, params, draft, context, synth)
        for dep in dict.fromkeys((resident, *[d for d in deployments if get_deployment(d).offload])):
            fits.append(latency_fit(spec, dep, synth, list(gammas), selections, context))
    sens: list[dict[str, Any]] = []
    for model in models if variants else ():
        for v in variants:
            vrows = ecospec_whatif(model, [resident], list(gammas), selections, v, draft, context)
            for label in dict.fromkeys(r["selection"] for r in vrows if r["gamma"] > 0):
                b = max((r for r in vrows if r["selection"] == label), key=lambda r: r["speedup_vs_none"])
                sens.append({k: b[k] for k in ("model", "branch", "depth", "accept", "selection", "gamma",
                                               "tokens_per_step", "distinct_experts_per_step", "tpot_ms",
                                               "speedup_vs_none", "speedup_vs_confidence")})
    fit_rows = [{k: v for k, v in f.items() if k not in ("x", "y")} for f in fits]
    for f in fit_rows:
        f["fit_over_analytic"] = f["slope_ms_per_expert"] / f["analytic_ms_per_expert"]
    write_csv(rows, out / "ecospec.csv")
    meta = {"synthetic": True, "params": asdict(params), "draft": asdict(draft), "context": context,
            "deployments": {d: asdict(get_deployment(d)) for d in deployments}}
    atomic_write_text(out / "ecospec.json", json.dumps({"meta": meta, "rows": rows, "latency_fits": fit_rows,
                                                        "sensitivity": sens},
                                                       indent=2, default=float))
    _distinct_png(rows, models, resident, out / "distinct_vs_gamma.png")
    _latency_png([f for f in fits if f["deployment"] == resident], out / "latency_vs_distinct.png")
    offload = [f for f in fits if f["deployment"] != resident]
    if offload:
        _latency_png(offload, out / "latency_vs_distinct_offloaded.png")
    _offload_png(rows, models, deployments, out / "speedup_resident_vs_offloaded.png")
    what = SYNTHETIC.format(seed=params.seed)
    best = []
    for model in models:
        for dep in deployments:
            mine = [r for r in rows if r["model"] == model and r["deployment"] == dep and r["gamma"] > 0]
            if mine:
                b = max(mine, key=lambda r: r["speedup_vs_none"])
                best.append({k: b[k] for k in COLS})
    sections = [
        {"heading": "Best configuration per model and deployment", "rows": best, "cols": COLS,
         "text": f"Draft: {draft.label}; tree branch {params.branch}, depth {params.depth}; per-depth acceptance "
                 f"{', '.join(f'{a:g}' for a in params.accept)}; predictor recall {params.recall:g}; overlaps parent "
                 f"{params.parent_overlap:g}, sibling {params.sibling_overlap:g}, step {params.step_overlap:g} "
                 f"(concentration {params.overlap_concentration:g}). All synthetic."},
        {"heading": "Distinct experts per verification against gamma", "image": out / "distinct_vs_gamma.png",
         "caption": f"{resident}; {what}."},
        {"heading": "Verification latency against distinct experts", "image": out / "latency_vs_distinct.png",
         "caption": f"Every step of every selection and gamma on {resident}; the fitted slope next to one expert's "
                    f"bytes over the aggregate HBM bandwidth. {what}.",
         "rows": fit_rows, "cols": ["model", "deployment", "slope_ms_per_expert", "analytic_ms_per_expert",
                                    "fit_over_analytic", "intercept_ms", "r2"]},
    ]
    if offload:
        sections.append({"heading": "Offloaded: latency against distinct experts",
                         "image": out / "latency_vs_distinct_offloaded.png",
                         "caption": f"One GPU, experts in host memory: each distinct expert not cached is a "
                                    f"host-to-device copy. {what}."})
    sections += [
        {"heading": "Speed-up over no speculation, resident and offloaded",
         "image": out / "speedup_resident_vs_offloaded.png", "caption": what + "."},
        {"heading": "Every configuration", "rows": rows, "cols": COLS},
    ]
    if sens:
        sections.insert(-1, {"heading": f"Tree shape and acceptance (best gamma per selection, {resident})",
                             "rows": sens, "cols": list(sens[0]), "text": what + "."})
    write_html(out / "report.html", "moesim: EcoSpec at scale (synthetic)",
               "Speculative decoding with confidence-only and EcoSpec (cost-aware) tree selection on large MoE models, "
               "resident across 8 GPUs and offloaded on one. " + what + ". Modelled and not modelled: "
               "docs/speculative.md.", sections)
    return {"rows": rows, "latency_fits": fit_rows, "sensitivity": sens, "report": out / "report.html"}


def shape_sweep(params: SpecSynthParams, shapes: list[tuple[int, int]]) -> list[SpecSynthParams]:
    """Tree-shape variants (branch, depth) of one parameter set."""
    return [replace(params, branch=b, depth=d) for b, d in shapes]
