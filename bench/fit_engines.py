"""Fit the shipped engine figures on every published measurement, and report the claim.

    python bench/fit_engines.py            # fit and report, write nothing
    python bench/fit_engines.py --write    # also write the fitted figures into hwprofiles/engines/*.toml
    python bench/fit_engines.py --write-residuals   # only the leave-one-source-out residuals

The fit is :func:`moesim.sim.engine_fit.fit` on every entry of ``hwprofiles/published``
(the figures of :data:`moesim.sim.engine_fit.FIT`, per engine, robust least squares on
ln(predicted / measured), the best of several starts). Those shipped figures are judged by
nothing here: the accuracy claim is leave-one-source-out
(:func:`moesim.sim.engine_fit.leave_one_source_out`, ``moesim validate --published``), which
this script reports beside the in-sample score. ``bench/fit_engines.json`` records both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.engines import builtin_engines  # noqa: E402
from moesim.sim.calibrate import published_calibration  # noqa: E402
from moesim.sim.engine_fit import fit, leave_one_source_out  # noqa: E402
from moesim.sim.intervals import NOMINAL, RESIDUALS_FILE, coverage, residuals_toml  # noqa: E402
from moesim.sim.published import entries, run_published, summarise  # noqa: E402


def _line(key: str, value: float, source: str) -> str:
    return f'{key} = {{ value = {value:.4g}, kind = "fitted", source = "{source}" }}'


def write(fitted: dict) -> list[Path]:
    """Replace (or add) each fitted figure's line in its engine's TOML, comments kept."""
    paths = []
    for name, info in fitted.items():
        path = builtin_engines()[name]
        text = path.read_text(encoding="utf-8")
        for key, value in info["figures"].items():
            table, _, fig = key.rpartition(".")
            line = _line(fig, value, info["source"].replace('"', "'"))
            pattern = re.compile(rf"^{re.escape(fig)} = \{{.*\}}$", re.M)
            section = f"[{table}]" if table else "[figures]"
            start = text.find(section)
            if start < 0:
                text = text.rstrip("\n") + f"\n\n{section}\n{line}\n"
                continue
            nxt = text.find("\n[", start + 1)
            body = text[start: nxt if nxt >= 0 else len(text)]
            if pattern.search(body):
                body = pattern.sub(line.replace("\\", "\\\\"), body, count=1)
            else:
                body = body.rstrip("\n") + f"\n{line}\n"
            text = text[:start] + body + (text[nxt:] if nxt >= 0 else "")
        atomic_write_text(path, text)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the fitted figures into hwprofiles/engines/*.toml")
    ap.add_argument("--write-residuals", action="store_true",
                    help=f"write the leave-one-source-out residuals (hwprofiles/published/{RESIDUALS_FILE}, the "
                         "ranges every answer carries); --write writes them too")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "fit_engines.json")
    args = ap.parse_args(argv)
    fitted = fit(entries())
    in_sample = run_published({n: f.engine for n, f in fitted.items()})
    loso = leave_one_source_out()
    report = {"in_sample": summarise(in_sample), "leave_one_source_out": summarise(loso),
              "fitted": {n: {"figures": f.figures, "entries": list(f.entries), "uninformed": list(f.uninformed)}
                         for n, f in fitted.items()},
              "rows": [{k: r[k] for k in ("id", "source_id", "kind", "engine", "measured_tps", "predicted_tps",
                                          "ratio", "fitted_on_sources")} for r in loso],
              "interval_coverage": coverage(loso)}
    cal = published_calibration(loso)
    report["calibrated"] = {k: v for k, v in cal["calibrated"].items() if k != "rows"}
    report["ordering"] = {k: v for k, v in cal["ordering"].items() if k != "sweeps"}
    for name, f in fitted.items():
        print(f"{name}: " + (", ".join(f"{k} = {v:.4g}" for k, v in f.figures.items()) or "nothing fitted")
              + f"  (on {len(f.entries)} entries)")
    for label, s in (("in-sample (every source)", report["in_sample"]),
                     ("leave one source out", report["leave_one_source_out"])):
        o = s["overall"]
        print(f"{label}: {o['entries']} entries, {o['within_25']:.0%} within +-25%, median |ln| "
              f"{o['median_abs_ln']:.3f}, worst {o['worst_abs_ln']:.2f}, optimistic {o['optimistic']}")
    c = report["interval_coverage"]["overall"]
    print(f"{NOMINAL:.0%} intervals, each from the other sources' residuals: {c['coverage']:.0%} of "
          f"{c['entries']} measurements inside")
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    if args.write or args.write_residuals:
        path = ROOT / "hwprofiles" / "published" / RESIDUALS_FILE
        shipped = in_sample if args.write else run_published()  # the predictions with the figures on disk then
        atomic_write_text(path, residuals_toml(loso, cal["calibrated"]["rows"],
                                               "python bench/fit_engines.py --write-residuals", shipped))
        print(f"wrote {path.relative_to(ROOT)}")
    if args.write:
        sources = {n: f.engine for n, f in fitted.items()}
        for p in write({n: {"figures": f.figures, "source": _source(sources[n], f)} for n, f in fitted.items()
                        if f.figures}):
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


def _source(engine, f) -> str:
    """The source line a written figure carries (the first fitted figure's own)."""
    return next(fig.source for key, fig in engine.sources() if fig.kind == "fitted")


if __name__ == "__main__":
    sys.exit(main())
