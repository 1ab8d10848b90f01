"""How ``moesim validate --published`` scores the published measurements and prints them. Python:
``moesim.sim.engine_fit.leave_one_source_out()``, then ``moesim.sim.published.summarise``,
``moesim.sim.intervals.coverage``, ``moesim.sim.calibrate.published_calibration`` and
``moesim.sim.calibrate.round_trip`` of its rows."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from moesim.cli.app import out, print_csv, print_json, table
from moesim.cli.running import progress_bar
from moesim.executor.interrupt import stop_requested
from moesim.fmt import number
from moesim.sim import published as pub
from moesim.sim import targets
from moesim.sim.calibrate import published_calibration, round_trip
from moesim.sim.engine_fit import leave_one_source_out
from moesim.sim.intervals import MOVED, NOMINAL, RESIDUALS_FILE, coverage, moved


def _stoppable(update: Callable[..., None]) -> Callable[..., None]:
    """``update`` that ends the run at the next source once a Ctrl-C (or SIGTERM) asked it to
    stop: nothing of a scoring is worth keeping half done (the command keeps finished work,
    so the first signal only asks; without this it ran on for minutes)."""
    def check(*args: object) -> None:
        if stop_requested():
            raise KeyboardInterrupt
        update(*args)
    return check


def show_published(as_json: bool, as_csv: bool) -> None:

    with progress_bar("leave one source out", "sources", lines=True) as update:
        rows = leave_one_source_out(progress=_stoppable(update))
    shipped_rows = pub.run_published()
    summary, shipped = pub.summarise(rows), pub.summarise(shipped_rows)
    cover = coverage(rows)
    moves = {"leave_one_source_out": moved(rows), "shipped_figures": moved(shipped_rows, "shipped_ln_error")}
    with progress_bar("calibrating each source on its first row", "sources", lines=True) as update:
        cal = published_calibration(rows, _stoppable(update))
    with tempfile.TemporaryDirectory(prefix="moesim-round-trip-") as folder, \
            progress_bar("the same through fit --measured's files", "sources", lines=True) as update:
        trip = round_trip(rows, folder, _stoppable(update))
    if as_json:
        print_json({"summary": summary, "shipped_figures": shipped, "interval_coverage": cover,
                    "calibrated": cal["calibrated"], "round_trip": trip, "ordering": cal["ordering"], "moved": moves,
                    "target": {"within_25": targets.WITHIN_SHARE, "median_abs_ln": targets.MEDIAN_ABS_LN,
                               "floor_within_25": targets.FLOOR_SHARE, "floor_entries": targets.FLOOR_ENTRIES},
                    "rows": rows, "excluded": pub.excluded()})
        return
    if as_csv:
        print_csv([{k: v for k, v in r.items() if k != "fitted_figures"} for r in rows])
        return
    out.print(table("published measurements, leave one source out: measured vs predicted decode tokens/s "
                    "(synthetic traces; each row's engine figures fitted on the other sources only)",
                    ("id", "engine", "kind", "hw", "measured", "predicted", "ratio", "fitted on"),
                    [[r["id"], r["engine"], r["kind"], r["hw"] + ("" if r["host"] == "-" else " + " + r["host"]),
                      f"{number(r['measured_tps'])}", f"{number(r['predicted_tps'])}", f"{r['ratio']:.2f}",
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
              f"{s['within_25']:.0%} within +-25% (target {targets.WITHIN_SHARE:.0%}, and no kind or engine of "
              f"{targets.FLOOR_ENTRIES}+ entries under {targets.FLOOR_SHARE:.0%}), median |ln(predicted / measured)| "
              f"{s['median_abs_ln']:.3f} (target <= {targets.MEDIAN_ABS_LN}), worst {s['worst_abs_ln']:.2f}, {s['optimistic']} optimistic: target "
              f"{'met' if summary['meets_target'] else 'NOT met'}", soft_wrap=True)
    out.print(f"with the shipped engine figures (fitted on some of these very rows, so not a claim): "
              f"{f['within_25']:.0%} within +-25%, median |ln| {f['median_abs_ln']:.3f}")
    c = cover["overall"]
    if c["coverage"] is None:
        out.print(f"[bold]ranges[/bold]: too few entries from other sources for any {NOMINAL:.0%} range")
    else:
        out.print(f"[bold]ranges[/bold]: the {NOMINAL:.0%} range of each entry, from the other sources' residuals of its "
                  f"class, holds {c['covered']} of {c['entries']} measurements ({c['coverage']:.0%}; target "
                  f"{targets.COVERAGE[0]:.0%}-{targets.COVERAGE[1]:.0%}"
                  + "".join(f"; {k} {v['coverage']:.0%} of {v['entries']}" for k, v in cover["by_kind"].items())
                  + f"): {'met' if cover['meets_target'] else 'NOT met'}; median width x{c['median_width']:.2f}"
                  + (f"; {cover['without_range']} entries without one" if cover["without_range"] else ""), soft_wrap=True)
    k, o = cal["calibrated"], cal["ordering"]
    if k["entries"]:
        out.print(f"[bold]calibrated on one row[/bold]: {k['entries']} entries of {k['sources']} sources with at least "
                  f"3 on one machine, each predicted after calibrating on the source's first row there: "
                  f"{k['within_15']:.0%} within +-15% (target {k['target']:.0%}: "
                  f"{'met' if k['meets_target'] else 'NOT met'}; {k['uncalibrated_within_15']:.0%} before calibrating)",
                  soft_wrap=True)
    if trip["entries"]:
        out.print(table("round trip: each source's first row printed as its engine prints it (llama-bench markdown, "
                        "else the plain CSV), read and calibrated by fit --measured's path, the others predicted with "
                        "the profile it wrote (median |ln(predicted / measured)| of the others)",
                        ("source", "format", "profile", "rows", "before", "after"),
                        [[t["source_id"][:60], t["format"], t["status"], str(t["rows"]),
                          f"{t['median_abs_ln_before']:.3f}", f"{t['median_abs_ln_after']:.3f}"
                          + (" (worse)" if t["worse"] else "")] for t in trip["sources"]], "right"))
        out.print(f"round trip: {trip['within_15']:.0%} of {trip['entries']} rows within +-15% (target "
                  f"{trip['target']:.0%}, and no source worse: {trip['worse_sources']} worse; "
                  f"{'met' if trip['meets_target'] else 'NOT met'}; {trip['uncalibrated_within_15']:.0%} before "
                  "calibrating); a fit that does not explain its row is not written, as fit --measured does",
                  markup=False, highlight=False, soft_wrap=True)
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
            out.print(f"moved ({words}): {m['id']} " + (f"predicted/measured {number(m['was'])} -> {number(m['now'])} "
                                                       f"(x{number(m['change'])})" if m["was"] is not None
                                                       else "new: no committed prediction"), markup=False)
    out.print(f"{len(pub.excluded())} more measurements are not expressed (hwprofiles/published/settings.toml says "
              "why); sources: hwprofiles/published/README.md")


def _corr(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
