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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np  # noqa: E402

from moesim import budget  # noqa: E402
from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.budget import Estimate  # noqa: E402
from moesim.models import get_model  # noqa: E402
from moesim.outputs import check_output_dir
from moesim.reports.render import pyplot, save_figure, write_csv, write_html  # noqa: E402
from moesim.sim.deployment import get_deployment  # noqa: E402
from moesim.sim.draft import DraftProfile  # noqa: E402
from moesim.sim.ecospec import (  # noqa: E402
    BASELINES,
    DEFAULT_DRAFT,
    DEFAULT_PARAMS,
    SELECTIONS_DEFAULT,
    Selection,
    ecospec_whatif,
    latency_fit,
    whatif_estimate,
)
from moesim.traces.synthetic_speculative import SpecSynthParams, generate  # noqa: E402

MODELS = ("qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3")
RESIDENT = "8xh200-tp"  # fits all three models (DeepSeek-V3 does not fit 8 x 80 GB)
DEPLOYMENTS = ("8xh200-tp", "8xh200-ep", "1xh200-offload")
GAMMAS = (1, 2, 4, 8, 12, 16)
COLS = ["model", "deployment", "selection", "gamma", "tokens_per_step", "rows_per_step", "distinct_experts_per_step",
        "verify_ms", "draft_ms", "tpot_ms", "speedup_vs_none", "speedup_vs_confidence", "speedup_vs_best_confidence",
        "speedup_vs_sd"]
REPORT_FIXED_S = 8.0  # figures and the page
SYNTHETIC = ("synthetic verification steps (moesim.traces.synthetic_speculative, seed {seed}); "
             "timed with the roofline deployment model (moesim.sim.deployment); no measurement")


def _distinct_png(rows: list[dict[str, Any]], models: tuple[str, ...], dep: str, path: Path) -> Path:
    fig, axes = pyplot().subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
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
    fig, axes = pyplot().subplots(1, len(fits), figsize=(4.2 * len(fits), 3.6), squeeze=False)
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
    fig, axes = pyplot().subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
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


def baseline_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, deployment and tree: EcoSpec's best against each baseline
    (:data:`moesim.sim.ecospec.BASELINES`), so which baseline a speed-up is over is explicit."""
    out = []
    keys = dict.fromkeys((r["model"], r["deployment"], r.get("tree", "")) for r in rows)
    for model, dep, tree in keys:
        mine = [r for r in rows if (r["model"], r["deployment"], r.get("tree", "")) == (model, dep, tree)
                and r["gamma"] > 0]
        conf = [r for r in mine if r["strategy"] == "confidence"]
        eco = [r for r in mine if r["strategy"] == "ecospec"]
        if not conf or not eco:
            continue
        bc, be = max(conf, key=lambda r: r["speedup_vs_none"]), max(eco, key=lambda r: r["speedup_vs_none"])
        same = max(eco, key=lambda r: r["speedup_vs_confidence"])
        sd = be.get("sd_gamma")
        sd_row = next((r for r in conf if r["gamma"] == sd), None)
        out.append({
            "model": model, "deployment": dep, "tree": tree,
            "best confidence (gamma)": f"{bc['speedup_vs_none']:.3f} ({bc['gamma']})",
            "best EcoSpec (gamma, score)": f"{be['speedup_vs_none']:.3f} ({be['gamma']}, {be['selection'][8:]})",
            "EcoSpec best / confidence best": be["speedup_vs_best_confidence"],
            "EcoSpec / confidence, same gamma: max (gamma)": f"{same['speedup_vs_confidence']:.3f} ({same['gamma']})",
            "SD baseline: confidence at gamma": sd if sd_row else "",
            "SD baseline x no-spec": sd_row["speedup_vs_none"] if sd_row else float("nan"),
            "EcoSpec best / SD baseline": be["speedup_vs_sd"],
        })
    return out


@dataclass(frozen=True)
class Extras:
    """What a benchmark adds to the default report: ``variants`` (other tree shapes or
    acceptance models) swept on the resident deployment into a sensitivity table; ``trees``,
    more (label, params, gammas, SD-baseline gamma) tree settings run on every deployment,
    such as an EAGLE-sized dynamic tree; ``sections`` of text and tables of its own."""

    variants: tuple[SpecSynthParams, ...] = ()
    trees: tuple[tuple[str, SpecSynthParams, tuple[int, ...], int | None], ...] = ()
    sections: tuple[dict[str, Any], ...] = ()


NO_EXTRAS = Extras()


def ecospec_report(out: Path, models: tuple[str, ...] = MODELS, deployments: tuple[str, ...] = DEPLOYMENTS,
                   gammas: tuple[int, ...] = GAMMAS, params: SpecSynthParams = DEFAULT_PARAMS,
                   selections: tuple[Selection, ...] = SELECTIONS_DEFAULT, draft: DraftProfile = DEFAULT_DRAFT,
                   resident: str = RESIDENT, context: int = 1024, extras: Extras = NO_EXTRAS) -> dict[str, Any]:
    """Run the what-if for every model and write the report into ``out``; returns the rows
    and latency fits (what the report shows). The first tree is always ``params`` over
    ``gammas`` ("default"); ``extras`` adds a benchmark's (:class:`Extras`). Refused up front
    when this machine cannot do it (:mod:`moesim.budget`)."""
    variants, extra_sections = extras.variants, extras.sections
    out = check_output_dir(out)  # before the sweep, not after
    trees = (("default", params, tuple(gammas), None), *extras.trees)
    specs = [get_model(m) for m in models]
    fit_deps = list(dict.fromkeys((resident, *[d for d in deployments if get_deployment(d).offload])))
    est = [whatif_estimate(specs, len(deployments), list(g), selections, p) for _, p, g, _ in trees]
    est.append(whatif_estimate(specs, len(fit_deps), list(gammas), selections, params))  # the latency fits
    est += [whatif_estimate(specs, 1, list(gammas), selections, v) for v in variants]
    budget.check(Estimate(f"the EcoSpec report: {len(models)} model(s), {len(trees)} tree(s), {len(variants)} "
                          f"variant(s), {len(deployments)} deployment(s)", max(e.bytes for e in est),
                          sum(e.seconds for e in est) + REPORT_FIXED_S))
    rows: list[dict[str, Any]] = []
    fits: list[dict[str, Any]] = []
    for spec in specs:
        for label, tp, tg, sd in trees:
            synth = generate(spec, tp)
            for r in ecospec_whatif(spec, list(deployments), list(tg), selections, tp, draft, context, synth, sd):
                rows.append({"tree": label, **r})
            if label == "default":
                for dep in fit_deps:
                    fits.append(latency_fit(spec, dep, synth, list(gammas), selections, context))
    sens: list[dict[str, Any]] = []
    for model in models if variants else ():
        for v in variants:
            vrows = ecospec_whatif(model, [resident], list(gammas), selections, v, draft, context)
            for label in dict.fromkeys(r["selection"] for r in vrows if r["gamma"] > 0):
                b = max((r for r in vrows if r["selection"] == label), key=lambda r: r["speedup_vs_none"])
                sens.append({k: b[k] for k in ("model", "branch", "depth", "accept", "selection", "gamma",
                                               "tokens_per_step", "distinct_experts_per_step", "tpot_ms",
                                               "speedup_vs_none", "speedup_vs_confidence",
                                               "speedup_vs_best_confidence")})
    fit_rows = [{k: v for k, v in f.items() if k not in ("x", "y")} for f in fits]
    for f in fit_rows:
        f["fit_over_analytic"] = f["slope_ms_per_expert"] / f["analytic_ms_per_expert"]
    baselines = baseline_table(rows)
    write_csv(rows, out / "ecospec.csv")
    meta = {"synthetic": True, "params": asdict(params), "draft": asdict(draft), "context": context,
            "trees": [{"tree": label, "params": asdict(tp), "gammas": list(tg), "sd_gamma": sd}
                      for label, tp, tg, sd in trees],
            "baselines": BASELINES, "deployments": {d: asdict(get_deployment(d)) for d in deployments}}
    atomic_write_text(out / "ecospec.json", json.dumps({"meta": meta, "rows": rows, "latency_fits": fit_rows,
                                                        "baselines": baselines, "sensitivity": sens},
                                                       indent=2, default=float))
    default_rows = [r for r in rows if r["tree"] == "default"]
    _distinct_png(default_rows, models, resident, out / "distinct_vs_gamma.png")
    _latency_png([f for f in fits if f["deployment"] == resident], out / "latency_vs_distinct.png")
    offload = [f for f in fits if f["deployment"] != resident]
    if offload:
        _latency_png(offload, out / "latency_vs_distinct_offloaded.png")
    _offload_png(default_rows, models, deployments, out / "speedup_resident_vs_offloaded.png")
    for label, _, _, _ in trees[1:]:
        _distinct_png([r for r in rows if r["tree"] == label], models, resident, out / f"distinct_vs_gamma_{label}.png")
    what = SYNTHETIC.format(seed=params.seed)
    best = []
    for model in models:
        for label, *_ in trees:
            for dep in deployments:
                mine = [r for r in rows if r["model"] == model and r["deployment"] == dep and r["gamma"] > 0
                        and r["tree"] == label]
                if mine:
                    b = max(mine, key=lambda r: r["speedup_vs_none"])
                    best.append({"tree": label, **{k: b[k] for k in COLS}})

    def tree_text(label, tp, tg, sd) -> str:
        shape = f"branch {tp.branch}, depth {tp.depth}" + (f", the {tp.expand} best grown a level" if tp.expand else "")
        return (f"{label}: {shape} ({tp.nodes} candidates), gamma {', '.join(map(str, tg))}"
                + (f", SD baseline: confidence-only at gamma {sd}" if sd else ""))

    sections = [
        {"heading": "Best configuration per model, tree and deployment", "rows": best, "cols": ["tree", *COLS],
         "text": f"Draft: {draft.label}; trees: {'; '.join(tree_text(*t) for t in trees)}; per-depth acceptance "
                 f"{', '.join(f'{a:g}' for a in params.accept)}; predictor recall {params.recall:g}; routing "
                 f"load ratio {params.load_ratio:g} (skew {params.skew:g} when 0), overlaps parent "
                 f"{params.parent_overlap:g}, sibling {params.sibling_overlap:g}, step {params.step_overlap:g} "
                 f"(concentration {params.overlap_concentration:g}), fitted to recorded trees (docs/speculative.md). "
                 "All synthetic."},
        {"heading": "EcoSpec's speed-up against each baseline", "rows": baselines, "cols": list(baselines[0]) if baselines
         else [], "text": "Which baseline a speed-up is over decides the number: " + "; ".join(
             f"{k}: {v}" for k, v in BASELINES.items()) + ". " + what + "."},
        {"heading": "Distinct experts per verification against gamma", "image": out / "distinct_vs_gamma.png",
         "caption": f"{resident}, default tree; {what}."},
    ]
    for label, tp, tg, sd in trees[1:]:
        sections.append({"heading": f"Distinct experts against gamma, {label} tree",
                         "image": out / f"distinct_vs_gamma_{label}.png",
                         "caption": f"{resident}; {tree_text(label, tp, tg, sd)}; {what}."})
    sections.append(
        {"heading": "Verification latency against distinct experts", "image": out / "latency_vs_distinct.png",
         "caption": f"Every step of every selection and gamma on {resident}; the fitted slope next to one expert's "
                    f"bytes read at the rate the cost model gives the engine. {what}.",
         "rows": fit_rows, "cols": ["model", "deployment", "slope_ms_per_expert", "analytic_ms_per_expert",
                                    "fit_over_analytic", "intercept_ms", "r2"]})
    if offload:
        sections.append({"heading": "Offloaded: latency against distinct experts",
                         "image": out / "latency_vs_distinct_offloaded.png",
                         "caption": f"One GPU, experts in host memory: each distinct expert not cached is a "
                                    f"host-to-device copy. {what}."})
    sections += [
        {"heading": "Speed-up over no speculation, resident and offloaded",
         "image": out / "speedup_resident_vs_offloaded.png", "caption": what + " (default tree)."},
        *extra_sections,
        {"heading": "Every configuration", "rows": rows, "cols": ["tree", *COLS]},
    ]
    if sens:
        sections.insert(-1, {"heading": f"Tree shape, acceptance and routing variants (best gamma per selection, "
                                        f"{resident})", "rows": sens, "cols": list(sens[0]), "text": what + "."})
    write_html(out / "report.html", "moesim: EcoSpec at scale (synthetic)",
               "Speculative decoding with confidence-only and EcoSpec (cost-aware) tree selection on large MoE models, "
               "resident across 8 GPUs and offloaded on one. " + what + ". Modelled and not modelled: "
               "docs/speculative.md.", sections)
    return {"rows": rows, "latency_fits": fit_rows, "baselines": baselines, "sensitivity": sens,
            "report": out / "report.html"}


def shape_sweep(params: SpecSynthParams, shapes: list[tuple[int, int]]) -> list[SpecSynthParams]:
    """Tree-shape variants (branch, depth) of one parameter set."""
    return [replace(params, branch=b, depth=d) for b, d in shapes]
