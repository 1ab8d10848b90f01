"""Fit engine figures on the FIT half of the published measurements, never the holdout half.

    python bench/fit_engines.py            # fit and report both halves, write nothing
    python bench/fit_engines.py --write    # also write the fitted figures into hwprofiles/engines/*.toml

For each engine, the figures in :data:`FIT` are chosen to minimise a robust loss (Cauchy,
scale 0.2, the best of several starts) of ln(predicted / measured) over that engine's entries of the fit half of
``hwprofiles/published`` (``moesim.sim.published``: the same prediction
``moesim validate --published`` makes). A figure no fit entry can inform is not fitted
(it keeps its estimate), except ik_llama.cpp's CPU efficiency, which takes llama.cpp's
fitted one (the same CPU graph lineage; ik_llama.cpp has no CPU entry in the fit half) and
says so. Every written figure is marked ``fitted`` with the entries it was fitted on.
``bench/fit_engines.json`` records both halves before and after.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.engines import builtin_engines, get_engine  # noqa: E402
from moesim.sim.published import entries, run_published, summarise  # noqa: E402

#: engine -> [(figure, lower bound, upper bound)]: what the fit may change, per engine.
FIT: dict[str, list[tuple[str, float, float]]] = {
    "ktransformers": [("cpu_weight_efficiency.default", 0.05, 1.0), ("kv_read_efficiency", 0.002, 1.0),
                      ("numa_efficiency", 0.0, 1.0)],
    "llama.cpp": [("cpu_weight_efficiency.default", 0.05, 1.0), ("cpu_weight_efficiency.iq1_s", 0.02, 1.0),
                  ("kernel_launch_us", 0.1, 10.0), ("kv_read_efficiency", 0.002, 1.0)],
    "ik_llama.cpp": [("kernel_launch_us", 0.1, 10.0)],
    "mixtral-offloading": [("link_efficiency", 0.02, 1.0)],
    "moe-infinity": [("link_efficiency", 0.02, 1.0)],
    "vllm": [("gpu_weight_efficiency.default", 0.05, 1.0), ("kv_read_efficiency", 0.002, 1.0)],
}
#: engine -> (figure, the engine whose fitted figure it takes)
INHERIT = {"ik_llama.cpp": ("cpu_weight_efficiency.default", "llama.cpp")}
LOSS_SCALE = 0.2


def _current(engine, key: str) -> float:
    """A figure's value now (a start for the fit): its own, or the cost model's default."""
    table, _, fig = key.rpartition(".")
    if table:
        return engine.weight_efficiency(table.split("_")[0], fig)
    defaults = {"kernel_launch_us": 2.0, "kv_read_efficiency": 1.0, "numa_efficiency": 0.0, "link_efficiency": 1.0}
    return engine.get(fig, defaults.get(fig, 1.0))


def _with(engine, names, values, source):
    for n, v in zip(names, values):
        engine = engine.with_figure(n, float(v), "fitted", source)
    return engine


def fit() -> dict:
    fit_entries = [e for e in entries() if e.split == "fit"]
    fitted: dict[str, dict] = {}
    engines = {}
    for name, figures in FIT.items():
        mine = [e for e in fit_entries if e.setting["engine"] == name]
        if not mine:
            continue
        base = get_engine(name)
        keys = [f for f, _, _ in figures]
        ids = [e.id for e in mine]
        source = (f"fitted by bench/fit_engines.py on the fit half of hwprofiles/published ({len(ids)} entries: "
                  f"{', '.join(ids)}); robust least squares on ln(predicted / measured)")
        def residuals(x, keys=keys, base=base, mine=mine, name=name, source=source):
            eng = _with(base, keys, x, source)
            return np.array([r["ln_error"] for r in run_published({name: eng}, mine)])

        # A robust loss has local minima (it may "explain" the well-fitted points by calling
        # the rest outliers): start from the estimate and from a grid, keep the best.
        lo, hi = np.array([f[1] for f in figures]), np.array([f[2] for f in figures])
        starts = [np.clip([_current(base, k) for k in keys], lo + 1e-6, hi - 1e-6)]
        starts += [lo + (hi - lo) * q for q in (0.1, 0.3, 0.6, 0.9)]
        fits = [least_squares(residuals, x0, bounds=(lo, hi), loss="cauchy", f_scale=LOSS_SCALE, diff_step=1e-3)
                for x0 in starts]
        res = min(fits, key=lambda r: r.cost)
        engines[name] = _with(base, keys, res.x, source)
        fitted[name] = {"figures": dict(zip(keys, map(float, res.x))), "entries": ids, "source": source,
                        "cost": float(res.cost)}
    for name, (figure, donor) in INHERIT.items():
        if donor in fitted and figure in fitted[donor]["figures"]:
            value = fitted[donor]["figures"][figure]
            src = (f"fitted: {donor}'s figure (bench/fit_engines.py; the same CPU graph lineage, and {name} has no "
                   f"CPU entry in the fit half of hwprofiles/published)")
            engines[name] = (engines.get(name) or get_engine(name)).with_figure(figure, value, "fitted", src)
            fitted.setdefault(name, {"figures": {}, "entries": [], "source": src})["figures"][figure] = value
    return {"fitted": fitted, "engines": engines}


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
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "fit_engines.json")
    args = ap.parse_args(argv)
    before = run_published()
    result = fit()
    after = run_published(result["engines"])
    report = {"before": summarise(before), "after": summarise(after), "fitted": result["fitted"],
              "rows": [{k: r[k] for k in ("id", "split", "engine", "measured_tps", "predicted_tps", "ratio")}
                       for r in after]}
    for name, info in result["fitted"].items():
        print(f"{name}: " + ", ".join(f"{k} = {v:.4g}" for k, v in info["figures"].items())
              + (f"  (on {len(info['entries'])} fit entries)" if info["entries"] else "  (inherited)"))
    for label, s in (("before", report["before"]), ("after", report["after"])):
        for split, v in s.items():
            print(f"{label:6} {split:7}: {v['entries']} entries, {v['within_25']:.0%} within +-25%, median |ln| "
                  f"{v['median_abs_ln']:.3f}, worst {v['worst_abs_ln']:.2f}, optimistic {v['optimistic']}")
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    if args.write:
        for p in write(result["fitted"]):
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
