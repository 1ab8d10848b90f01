"""What one measured row buys: bench/bench_llamacpp.py's llama-bench rows, calibrated on one.

    python bench/calibrate_llamacpp.py                 # writes bench/calibrate_llamacpp.json, prints the table
    python bench/calibrate_llamacpp.py --rows 1 2      # calibrate on rows 1 and 2 (1-based, the JSON's order)

The rows are the committed measurements of ``bench/llamacpp.json`` (llama-bench on the pinned
llama.cpp build, tiny **synthetic** Qwen3-MoE GGUF files with Qwen3-30B-A3B's layer geometry,
1 and 2 threads, depth 0 and 1024, this machine's CPU); the host is the profile that run
measured (``host_profiles.before``, written back as a host TOML). Each row becomes the
deployment ``moesim fit --measured`` makes of it (:func:`moesim.sim.calibrate.calibrate`: the
GGUF file read for its tensor types, ``--hw none``, the row's threads and depth), the engine
profile is calibrated on the chosen rows only, and every other row is predicted with it. The
calibration row is chosen by a fixed rule, the first the benchmark lists; the table also
gives every other one-row choice, so the figure is not the luck of one row.

The GGUF files come from bench/bench_llamacpp.py's work dir (``--work``; it builds them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llamacpp import DEFAULT_WORK, gguf_path  # noqa: E402

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.engines import get_engine  # noqa: E402
from moesim.hardware import HOST_FIGURES, Figure, HostProfile  # noqa: E402
from moesim.measured import MeasuredRow  # noqa: E402
from moesim.sim.calibrate import Given, _ln_errors, calibrate_entries, deployment  # noqa: E402

WITHIN = 0.15


def host_file(result: dict, out: Path) -> Path:
    """The host profile the benchmark measured before its rows, as a host TOML."""
    h = result["host_profiles"]["before"]
    figs = {k: Figure(float(v), "measured", f"moesim profile --hardware on this machine, {h['when']} "
                                              "(bench/llamacpp.json host_profiles.before)")
            for k, v in h["figures"].items() if k in HOST_FIGURES}
    prof = HostProfile("bench-llamacpp-host", "the 2-core EPYC VM of bench/llamacpp.json", figs, str(out))
    atomic_write_text(out, prof.to_toml())
    return out


def measured_rows(result: dict, work: Path) -> list[MeasuredRow]:
    rows = []
    for i, r in enumerate(result["rows"], 1):
        path = gguf_path(work, r["layers"], r["format"])
        if not path.exists():
            raise SystemExit(f"{path} missing: python bench/bench_llamacpp.py --skip-build builds it")
        rows.append(MeasuredRow(where=f"llamacpp.json row {i} ({r['model']} -t {r['threads']} -d {r['depth']})",
                                engine="llama.cpp", test="decode", tokens_per_s=float(r["measured_tok_s"]),
                                n_gen=int(r["n_gen"]), depth=int(r["depth"]), model_file=str(path),
                                threads=int(r["threads"]), n_gpu_layers=0))
    return rows


def score(entries, engine, held: list[int]) -> dict:
    ln = _ln_errors([entries[i] for i in held], engine)
    return {"rows": len(held), "within_15": int(sum(abs(math.expm1(x)) <= WITHIN for x in ln)),
            "median_abs_ln": float(statistics.median(abs(x) for x in ln)), "worst_abs_ln": float(max(abs(x) for x in ln)),
            "ratios": [round(math.exp(x), 3) for x in ln]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "llamacpp.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="1-based rows to calibrate on (default: the first)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "calibrate_llamacpp.json")
    ap.add_argument("--no-every", action="store_true", help="skip the table of every one-row choice")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    host = host_file(result, args.work / "results" / "bench-llamacpp-host.toml")
    rows = measured_rows(result, args.work)
    given = Given("none", str(host), "llama.cpp")
    entries = [deployment(r, given) for r in rows]
    base = get_engine("llama.cpp")
    every = list(range(len(entries)))
    chosen = [k - 1 for k in args.rows]
    held = [i for i in every if i not in chosen]
    cal = calibrate_entries([entries[i] for i in chosen], base, f"rows {args.rows} of bench/llamacpp.json", loro=False)
    report = {"calibrated_on": [rows[i].where for i in chosen], "fitted": cal.figures,
              "uncalibrated": score(entries, base, held), "calibrated": score(entries, cal.engine, held)}
    print(f"calibrated on {', '.join(report['calibrated_on'])}: fitted {cal.figures}")
    for k in ("uncalibrated", "calibrated"):
        s = report[k]
        print(f"  {k}: {s['within_15']} of {s['rows']} other rows within +-15%, median |ln| {s['median_abs_ln']:.3f}, "
              f"worst {s['worst_abs_ln']:.2f}")
    if not args.no_every and len(chosen) == 1:
        report["every_one_row_choice"] = []
        for i in every:
            c = calibrate_entries([entries[i]], base, f"row {i + 1}", loro=False)
            s = score(entries, c.engine, [j for j in every if j != i])
            report["every_one_row_choice"].append({"row": rows[i].where, "fitted": c.figures, **s})
            print(f"  on {rows[i].where}: {s['within_15']} of {s['rows']} within +-15%")
        counts = [c["within_15"] for c in report["every_one_row_choice"]]
        print(f"  over every one-row choice: median {statistics.median(counts)} of {len(every) - 1}, "
              f"range {min(counts)}-{max(counts)}")
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
