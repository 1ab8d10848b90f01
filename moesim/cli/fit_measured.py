"""How ``moesim fit --measured`` calibrates and what it prints. Python:
``moesim.sim.calibrate.calibrate(moesim.measured.read_measured(path, fmt, **reader), Given(...), what)``."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

import typer

from moesim.atomic import atomic_write_text
from moesim.cli.app import err, out, table
from moesim.cli.options import holding
from moesim.cli.running import progress_bar
from moesim.engines import get_engine
from moesim.fmt import number, plural
from moesim.hardware import get_host
from moesim.measured import read_measured
from moesim.outputs import check_output_dir
from moesim.sim.calibrate import Given, calibrate, verdict
from moesim.sim.intervals import calibrated


def calibrate_and_show(path: Path, fmt: str | None, given: Given, reader: dict, folder: Path,
                       keep: bool = False) -> None:
    """Calibrate on ``path``'s rows, print what was fitted and how well, write the profiles: only
    a fit that explains its rows (:func:`moesim.sim.calibrate.verdict`), unless ``keep``; a kept
    fit that does not is written without a range of its own, so no answer narrows because of it."""
    check_output_dir(folder)
    host = get_host(given.host) if given.host else None  # an unknown host: one line before any work
    if given.engine:
        get_engine(given.engine)  # a bad --engine (or build date) too, never blamed on a row of the file
    rows = read_measured(path, fmt, **{k: v for k, v in reader.items() if v is not None})
    with holding(folder, "--out"):
        with progress_bar("leave one row out", "rows") as update:  # on a terminal only: seconds for tens of rows
            cal = calibrate(rows, given, path.name, update)
        _show(cal, path)
        doubt = verdict(cal)
        if doubt and not keep:
            err.print(f"error: not written: {doubt}; the shipped figures stay in use. Check that reading of the "
                      "rows, or write it anyway with --keep (its answers then keep the uncalibrated range)",
                      markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        engine = replace(cal.engine, calibration=None,
                         description=f"{cal.engine.description} (kept with --keep: {doubt})") if doubt else cal.engine
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / "engine.toml"]
        atomic_write_text(written[0], f"# {engine.description}\n" + engine.to_toml())
        host_file = folder / "host.toml"
        if host is not None:  # the host the rows ran on, as one file beside it (`--host this`: what was detected)
            atomic_write_text(host_file, f"# {host.description}\n" + host.to_toml())
            written.append(host_file)
        elif host_file.exists():  # an earlier run's host is not this calibration's: the folder is one set
            host_file.unlink()
    if doubt:
        err.print(f"warning: kept with --keep although {doubt}; its answers carry the uncalibrated range",
                  markup=False, highlight=False, soft_wrap=True)
    else:
        iv = calibrated(cal.engine.calibration)
        out.print(f"answers with this profile carry the {iv.words()}", markup=False, highlight=False, soft_wrap=True)
    err.print("wrote " + ", ".join(str(p) for p in written) + "; use them with "
              + " ".join(f"{o} {p}" for o, p in zip(("--engine", "--host"), written)), markup=False, highlight=False,
              soft_wrap=True)


def _show(cal, path: Path) -> None:
    """The calibration's table: each row measured, before and after, and what was fitted."""
    out.print(table(f"calibration on {path.name}: measured vs predicted decode tokens/s "
                    f"(synthetic traces; {cal.engine.name} figures before and after)",
                    ("row", "measured", "before", "after", "after/measured", "bound"),
                    [[r["where"], f"{number(r['measured_tps'], 4)}", f"{number(r['before_tps'], 4)}", f"{number(r['after_tps'], 4)}",
                      f"{r['after_tps'] / r['measured_tps']:.3f}", r["bound"]] for r in cal.rows],
                    "right"))
    for r in cal.rows:
        out.print(f"{r['where']}: {r['deployment']}", markup=False, highlight=False, soft_wrap=True)
    for where, why in cal.unused:
        out.print(f"not calibrated on {where}: {why}", markup=False, highlight=False, soft_wrap=True)
    if cal.figures:
        out.print("fitted: " + ", ".join(f"{k} = {number(v, 4)}" + (" (at the end of its range: the rows ask for more "
                                                            "than it can give)" if k in cal.at_bound else "")
                                         for k, v in cal.figures.items())
                  + f" (on {plural(len(cal.rows), 'row')}; every other figure as shipped)", markup=False, highlight=False,
                  soft_wrap=True)
    else:
        out.print("fitted nothing: no row is bound by a figure moesim calibrates", markup=False)
    if cal.loro:
        within = sum(abs(math.expm1(x)) <= 0.15 for x in cal.loro)
        out.print(f"leave one row out: {within} of {len(cal.loro)} rows within +-15% of measured when predicted "
                  f"from the others (median |ln| {statistics.median(abs(x) for x in cal.loro):.3f})", markup=False)
