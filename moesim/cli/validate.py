"""``moesim validate``. Python: ``moesim.reports.validation.validation_suite(out, tokens, model, repeats,
cpu_policies, copy_queues)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, out, print_csv, print_json, table
from moesim.cli.options import given_options
from moesim.cli.running import keeps_finished_work, need_executor, progress_bar
from moesim.errors import MoesimError
from moesim.executor.validation_plan import check_suite_model
from moesim.reports.validation import validation_suite
from moesim.sim import published as pub
from moesim.sim.calibrate import published_calibration
from moesim.sim.engine_fit import leave_one_source_out
from moesim.sim.intervals import MOVED, NOMINAL, RESIDUALS_FILE, coverage, moved

CASE_SHORT = {"same-policy": "same", "transfer from on-demand": "transfer"}


@app.command()
@keeps_finished_work
def validate(
    ctx: typer.Context,
    out_dir: Annotated[Path, typer.Option("--out", help="Report folder: error table, scatter, timelines, traces.")] = Path("moesim-validation"),
    tokens: Annotated[int, typer.Option(help="Decode steps per run (the learned model runs 4x as many: its steps "
                                              "are ~10x shorter).")] = 32,
    model: Annotated[str | None, typer.Option(help="Only this suite model (moe-stdlib or the synthetic one).")] = None,
    cpu_policies: Annotated[bool, typer.Option("--cpu-policies/--no-cpu-policies", help="Also run the CPU-compute "
                                               "policies and int8 experts (synthetic geometry).")] = True,
    copy_queues: Annotated[bool, typer.Option("--copy-queues/--no-copy-queues", help="Also run prefetch-fom under each "
                                              "copy queue (fifo, demand-first, cancel-unstarted; synthetic geometry).")] = True,
    repeats: Annotated[int, typer.Option(help="Rounds of every case (the policies interleaved in each); a case scores "
                                               "as the median over rounds, with its spread.")] = 3,
    published: Annotated[bool, typer.Option("--published", help="Instead: predict the published measurements of "
                                                                "real engines (hwprofiles/published), each with engine "
                                                                "figures fitted without its own source, and score "
                                                                "them.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --published: rows and summary as JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="With --published: every row as CSV.")] = False,
) -> None:
    """Run the validation suite: the simulator against the executor on this machine (CPU,
    emulated link): 2 models x 3 link bandwidths x 4 policies, same-policy replay and
    policy transfer (predicted from the on-demand trace alone), with an error table; then
    the CPU-compute policies and the copy queues (which wins, measured and predicted).

    With `--published`, it instead predicts every published batch-1 decode measurement of
    a real engine that moesim can express (llama.cpp, ik_llama.cpp, KTransformers, vLLM, SGLang,
    MoE-Infinity, mixtral-offloading; hwprofiles/published), leaving one source out: each
    measurement is predicted with engine figures fitted on the measurements of every other
    source (an issue thread, an article), and scored overall, by deployment kind and by
    engine. Its sources' folds run on every core (about 2 minutes on 2 cores).

    Examples: `moesim validate --out validation-report` (long-running), `moesim validate --published`,
    `moesim validate --published --json`
    """
    if published:
        executor_only = ("--out", "--tokens", "--model", "--cpu-policies", "--copy-queues", "--repeats")
        if unused := [o for o in executor_only if o in given_options(ctx)]:
            err.print(f"note: {', '.join(unused)}: for the executor suite, not --published (which runs no executor): "
                      "changed nothing", markup=False, soft_wrap=True)
        _published(as_json, as_csv)
        return
    if as_json or as_csv:

        raise MoesimError("--json and --csv print the published suite (--published); the executor suite writes its "
                          "tables to --out")
    check_suite_model(model)  # before torch loads
    need_executor()

    with progress_bar("validating", "runs") as update:
        rows, cpu_rows, (queue_rows, winners), summary, machine, page = validation_suite(
            out_dir, tokens, model, repeats, lambda doing, done, total: update(done, total, doing), cpu_policies,
            copy_queues)
    out.print(table(f"simulated vs measured mean TPOT ({machine})",
                    ("model", "GB/s", "policy", "case", "measured ms", "simulated ms", "error", "error range"),
                    [[r["model"][:12], f"{r['link_gbps']:g}", r["policy"], CASE_SHORT[r["case"]], f"{r['measured_ms']:.3g}",
                      f"{r['predicted_ms']:.3g}", f"{r['error']:+.1%}", f"{r['error_min']:+.1%}..{r['error_max']:+.1%}"]
                     for r in rows], "right"))
    if cpu_rows:
        out.print(table("CPU-compute policies and int8 experts (synthetic geometry; each case its median-TPOT run)",
                        ("policy", "case", "measured ms", "simulated ms", "error"),
                        [[r["policy"], CASE_SHORT[r["case"]], f"{r['measured_ms']:.3g}", f"{r['predicted_ms']:.3g}",
                          f"{r['error']:+.1%}"] for r in cpu_rows], "right"))
    if queue_rows:
        out.print(table("copy queues, prefetch-fom (synthetic geometry; measured: median of runs)",
                        ("GB/s", "predictor", "queue", "measured ms", "range ms", "same-policy", "from FIFO"),
                        [[f"{r['link_gbps']:g}", r["predictor"], r["queue"], f"{r['measured_ms']:.3g}",
                          f"{r['measured_min_ms']:.3g}..{r['measured_max_ms']:.3g}", f"{r['same_policy_error']:+.1%}",
                          f"{r['from_fifo_ms']:.3g} ({r['from_fifo_error']:+.1%})"] for r in queue_rows], "right"))
        for w in winners:
            out.print(f"{w['link_gbps']:g} GB/s, {w['predictor']}: measured winner {w['measured_winner']} "
                      f"(+{w['margin']:.1%} to the next, {_verdict(w)}); "
                      f"predicted from FIFO: {w['predicted_winner']}")
    out.print("case: same = replay of the run's own trace; transfer = predicted from the on-demand trace. "
              "error: median over rounds; range: over rounds.")
    for k, v in summary.items():
        out.print(f"[bold]{k}[/bold]: {v}")
    err.print(f"report: {page}")


def _corr(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _verdict(w: dict) -> str:
    if w["runs"] < 2:
        return "one run: no spread to judge it by"
    return "clear" if w["clear"] else "inside the runs’ spread: a tie"


def _published(as_json: bool, as_csv: bool) -> None:

    with progress_bar("leave one source out", "sources") as update:
        rows = leave_one_source_out(progress=update)
    shipped_rows = pub.run_published()
    summary, shipped = pub.summarise(rows), pub.summarise(shipped_rows)
    cover = coverage(rows)
    moves = {"leave_one_source_out": moved(rows), "shipped_figures": moved(shipped_rows, "shipped_ln_error")}
    with progress_bar("calibrating each source on its first row", "sources") as update:
        cal = published_calibration(rows, update)
    if as_json:
        print_json({"summary": summary, "shipped_figures": shipped, "interval_coverage": cover,
                    "calibrated": cal["calibrated"], "ordering": cal["ordering"], "moved": moves,
                    "target": {"within_25": pub.TARGET_WITHIN, "median_abs_ln": pub.TARGET_MEDIAN_LN,
                               "within_25_per_kind": pub.TARGET_WITHIN_PER_KIND},
                    "rows": rows, "excluded": pub.excluded()})
        return
    if as_csv:
        print_csv([{k: v for k, v in r.items() if k != "fitted_figures"} for r in rows])
        return
    out.print(table("published measurements, leave one source out: measured vs predicted decode tokens/s "
                    "(synthetic traces; each row's engine figures fitted on the other sources only)",
                    ("id", "engine", "kind", "hw", "measured", "predicted", "ratio", "fitted on"),
                    [[r["id"], r["engine"], r["kind"], r["hw"] + ("" if r["host"] == "-" else " + " + r["host"]),
                      f"{r['measured_tps']:.3g}", f"{r['predicted_tps']:.3g}", f"{r['ratio']:.2f}",
                      f"{r['fitted_on_sources']} sources" if r["fitted_on_sources"] else "unfitted"]
                     for r in rows], "right"))
    for title, groups in (("deployment kind", summary["by_kind"]), ("engine", summary["by_engine"])):
        out.print(table(f"leave one source out, by {title}",
                        (title, "entries", "sources", "within +-25%", "median |ln|", "worst |ln|", "optimistic"),
                        [[k, str(g["entries"]), str(g["sources"]), f"{g['within_25']:.0%}",
                          f"{g['median_abs_ln']:.3f}", f"{g['worst_abs_ln']:.2f}", str(g["optimistic"])]
                         for k, g in groups.items()], "right"))
    s, f = summary["overall"], shipped["overall"]
    out.print(f"[bold]leave one source out[/bold]: {s['entries']} entries from {s['sources']} sources, "
              f"{s['within_25']:.0%} within +-25% (target {pub.TARGET_WITHIN:.0%}, and "
              f"{pub.TARGET_WITHIN_PER_KIND:.0%} in every kind), median |ln(predicted / measured)| {s['median_abs_ln']:.3f} (target <= "
              f"{pub.TARGET_MEDIAN_LN}), worst {s['worst_abs_ln']:.2f}, {s['optimistic']} optimistic: target "
              f"{'met' if summary['meets_target'] else 'NOT met'}")
    out.print(f"with the shipped engine figures (fitted on some of these very rows, so not a claim): "
              f"{f['within_25']:.0%} within +-25%, median |ln| {f['median_abs_ln']:.3f}")
    c = cover["overall"]
    if c["coverage"] is None:
        out.print(f"[bold]ranges[/bold]: too few entries from other sources for any {NOMINAL:.0%} range")
    else:
        out.print(f"[bold]ranges[/bold]: the {NOMINAL:.0%} range of each entry, from the other sources' residuals of its "
                  f"class, holds {c['covered']} of {c['entries']} measurements ({c['coverage']:.0%}; target 70-90%"
                  + "".join(f"; {k} {v['coverage']:.0%} of {v['entries']}" for k, v in cover["by_kind"].items())
                  + f"): {'met' if cover['meets_target'] else 'NOT met'}; median width x{c['median_width']:.2f}"
                  + (f"; {cover['without_range']} entries without one" if cover["without_range"] else ""))
    k, o = cal["calibrated"], cal["ordering"]
    if k["entries"]:
        out.print(f"[bold]calibrated on one row[/bold]: {k['entries']} entries of {k['sources']} sources with at least "
                  f"3 on one machine, each predicted after calibrating on the source's first row there: "
                  f"{k['within_15']:.0%} within +-15% (target {k['target']:.0%}: "
                  f"{'met' if k['meets_target'] else 'NOT met'}; {k['uncalibrated_within_15']:.0%} before calibrating)")
    if o["n"]:
        out.print(f"[bold]decisions[/bold]: over {o['n']} sources' settings of one machine, the measured best is "
                  f"predicted best in {o['best_uncalibrated']:.0%} uncalibrated, {o['best_calibrated']:.0%} calibrated "
                  f"on one row (target {o['target']:.0%}); median rank correlation "
                  f"{_corr(o['median_spearman_uncalibrated'])} and {_corr(o['median_spearman_calibrated'])}")
    for what, rows_moved in moves.items():
        words = what.replace("_", " ")
        if not rows_moved:
            out.print(f"no prediction ({words}) moved by more than {MOVED - 1:.0%} against "
                      f"hwprofiles/published/{RESIDUALS_FILE}", markup=False)
        for m in rows_moved:
            out.print(f"moved ({words}): {m['id']} " + (f"predicted/measured {m['was']:.3g} -> {m['now']:.3g} "
                                                       f"(x{m['change']:.3g})" if m["was"] is not None
                                                       else "new: no committed prediction"), markup=False)
    out.print(f"{len(pub.excluded())} more measurements are not expressed (hwprofiles/published/settings.toml says "
              "why); sources: hwprofiles/published/README.md")
