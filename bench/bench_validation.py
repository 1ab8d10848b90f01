"""Is the validation suite's accuracy reproducible? Run it several times in a row (issue 10).

One command (on an idle machine; under contention the executor's timings, and so the
errors, mean nothing):

    python bench/bench_validation.py --report reports/validation   # 3 consecutive suites, ~20-25 minutes on 2 cores
    python bench/bench_validation.py --quick      # 1 short suite of the learned model: checks the script runs

Each run is the real command, ``moesim validate --out DIR`` in a fresh process, exactly
what a user runs. From each run's ``summary.json`` it takes, per kind of case
(same-policy, transfer from on-demand), the mean and max of the cases' |median error|,
and the widest spread of a case over its rounds; then the median, min and max of those
over the runs. The target (issue 10): same-policy <= 3% and transfer <= 5% mean |error|
on *every* run. The copy-queue cases (prefetch-fom under each queue) are summarised the
same way: per case the median over the runs of the measured TPOT and of the error of the
prediction from the FIFO run, and each run's measured and predicted winner. Each run also
records how steady the machine was (``moesim.executor.steady``). Writes JSON (``--out``,
default ``bench/validation.json``) with the machine and every run's rows; prints and
never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sim import machine  # noqa: E402

from moesim.atomic import atomic_write_text  # noqa: E402

CASES = {"same-policy": 0.03, "transfer from on-demand": 0.05}


def one_suite(folder: Path, extra: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "moesim", "validate", "--out", str(folder), *extra],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"moesim validate failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    data = json.loads((folder / "summary.json").read_text())
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1), "machine_figures":
                           data["summary"].get("machine figures (measured)"),
                           "steady_machine": data["summary"].get("steady machine"),
                           "machine_facts": data["summary"].get("machine"), "rows": data["rows"]}
    for case in CASES:
        rows = [r for r in data["rows"] if r["case"] == case]
        errs = [abs(r["error"]) for r in rows]
        out[case] = {"cases": len(rows), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs),
                     "widest_spread": max(r["error_max"] - r["error_min"] for r in rows)}
        cpu = [abs(r["error"]) for r in data.get("cpu_rows", []) if r["case"] == case]
        out["queue_rows"], out["queue_winners"] = data.get("queue_rows", []), data.get("queue_winners", [])
        if cpu:
            out[f"CPU-compute policies, {case}"] = {"cases": len(cpu), "mean_abs_error": sum(cpu) / len(cpu),
                                                    "max_abs_error": max(cpu)}
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the runs: per kind of case the median, min and max of the runs' mean |error|,
    whether every run met the target, the largest case; prints one line each."""
    summary: dict[str, Any] = {}
    for case, target in CASES.items():
        means = [r[case]["mean_abs_error"] for r in results]
        summary[case] = {"target": target, "median_of_means": statistics.median(means), "min": min(means),
                         "max": max(means), "every_run_within_target": all(m <= target for m in means),
                         "max_case_error": max(r[case]["max_abs_error"] for r in results),
                         "widest_spread": max(r[case]["widest_spread"] for r in results)}
        s = summary[case]
        print(f"{case}: mean |error| median {s['median_of_means']:.2%} (runs {s['min']:.2%}..{s['max']:.2%}), "
              f"target {target:.0%} on every run: {'yes' if s['every_run_within_target'] else 'NO'}; "
              f"largest case {s['max_case_error']:.2%}")
        key = f"CPU-compute policies, {case}"
        cpu = [r[key] for r in results if key in r]
        if cpu:
            means = [c["mean_abs_error"] for c in cpu]
            summary[key] = {"median_of_means": statistics.median(means), "min": min(means), "max": max(means),
                            "max_case_error": max(c["max_abs_error"] for c in cpu)}
            print(f"{key}: mean |error| median {statistics.median(means):.2%} (runs {min(means):.2%}.."
                  f"{max(means):.2%}); largest case {summary[key]['max_case_error']:.2%}")
    queues = summarise_queues(results)
    if queues:
        summary["copy queues"] = queues
    return summary


def summarise_queues(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per copy-queue case (link, predictor, queue): the median over the runs of its measured
    TPOT and of its error predicted from the FIFO run, with their ranges; per setting, the
    measured winner of each run (a tie when inside that run's spread)."""
    rows = [r for res in results for r in res.get("queue_rows", [])]
    out = []
    for key in dict.fromkeys((r["link_gbps"], r["predictor"], r["queue"]) for r in rows):
        sel = [r for r in rows if (r["link_gbps"], r["predictor"], r["queue"]) == key]
        ms, err = [r["measured_ms"] for r in sel], [r["from_fifo_error"] for r in sel]
        winners = [w for res in results for w in res.get("queue_winners", [])
                   if (w["link_gbps"], w["predictor"]) == key[:2]]
        out.append({"link_gbps": key[0], "predictor": key[1], "queue": key[2], "runs": len(sel),
                    "measured_ms_median": statistics.median(ms), "measured_ms_min": min(ms), "measured_ms_max": max(ms),
                    "from_fifo_error_median": statistics.median(err), "from_fifo_error_min": min(err),
                    "from_fifo_error_max": max(err),
                    "measured_winners": [w["measured_winner"] + ("" if w["clear"] else " (tie)") for w in winners],
                    "predicted_winners": [w["predicted_winner"] for w in winners]})
        o = out[-1]
        print(f"copy queue {key[0]:g} GB/s {key[1]} {key[2]}: measured {o['measured_ms_median']:.3g} ms "
              f"({o['measured_ms_min']:.3g}..{o['measured_ms_max']:.3g}), predicted from FIFO "
              f"{o['from_fifo_error_median']:+.1%} ({o['from_fifo_error_min']:+.1%}..{o['from_fifo_error_max']:+.1%}); "
              f"winners measured {o['measured_winners']}, predicted {o['predicted_winners']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("validation.json"))
    ap.add_argument("--report", type=Path, help="Keep the last run's report folder here (e.g. reports/validation); "
                                                "the other runs' go to a temporary folder")
    a = ap.parse_args()
    extra = ["--model", "moe-stdlib", "--tokens", "4", "--repeats", "1"] if a.quick else []  # (no queues: synthetic)
    runs = 1 if a.quick else a.runs
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            last = a.report is not None and i == runs - 1
            res = one_suite(a.report if last else Path(tmp) / f"run{i}", extra)
            results.append(res)
            print(f"run {i + 1}/{runs} ({res['seconds']:.0f} s): " + "; ".join(
                f"{c}: mean |error| {res[c]['mean_abs_error']:.2%}, max {res[c]['max_abs_error']:.2%}" for c in CASES)
                + f"; machine: {res['steady_machine']}", flush=True)
    summary = summarise(results)
    atomic_write_text(a.out, json.dumps({"machine": machine(), "command": "python bench/bench_validation.py"
                                         + (" --quick" if a.quick else ""), "summary": summary, "runs": results},
                                        indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
