"""How close each long command's estimate (moesim.budget) is to the time the work takes.

Issue 24 asks every long command to estimate its work before it starts (to refuse what this
machine cannot do, and to announce a long run) within 3x of the real time. For each kind of
estimate this runs the library call the command runs, in process, at two sizes, and records
every :class:`moesim.budget.Estimate` the call hands to ``budget.check`` (so the estimate is
the command's own, not a copy of its formula). It reports, per size, the estimate, the
measured seconds (min / median / max of ``--repeat`` runs after one warm-up, so imports and
numba's kernels are loaded) and their ratio, and the marginal ratio: the estimate's growth
between the two sizes over the measured growth, the per-unit constant alone without fixed
costs. A ratio in [1/3, 3] is within 3x.

    python bench/bench_estimates.py               # writes bench/estimates.json
    python bench/bench_estimates.py --repeat 1 --only synth,replay-fast

Cases (all traces **synthetic**, moesim.traces.synthetic):

- ``synth``: ``synthetic_trace`` then ``write_trace`` (what ``moesim synth`` does), Qwen3-30B-A3B;
- ``replay-fast`` / ``replay-simpy``: ``moesim.sim.replay.replay`` of Qwen3-30B-A3B under the
  four policies of the speed benchmark (bench/bench_sim.py) on the fast path, and under two on SimPy;
- ``whatif-fast`` / ``whatif-simpy``: a synthetic sweep of OLMoE (3 profiles x 4 links x 2 caches
  x the default policies), one worker: the sweep's estimate, and the synthesis checked before it;
- ``profile`` / ``profile-stdlib``: the reference executor (``moesim profile``'s ``record_decode``)
  decoding the tiny catalogue model under prefetch-fom, and the shipped moe-stdlib checkpoint
  under on-demand, over the emulated link.

The machine (CPU, cores, load average before and after) and a pure-Python reference loop timed
in the same run are recorded, as in bench/bench_sim.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_sim import git_commit, load_average, machine, reference_loop  # noqa: E402

from moesim import budget  # noqa: E402
from moesim.atomic import atomic_write_text  # noqa: E402

MODEL = "qwen3-30b-a3b"
POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle")  # bench_sim's replay
WITHIN = 3.0


def captured(fn: Callable[[], Any]) -> tuple[float, list[budget.Estimate]]:
    """(seconds ``fn()`` took, every Estimate it handed to ``budget.check``)."""
    seen: list[budget.Estimate] = []
    real = budget.check

    def spy(est: budget.Estimate, warn: Any = None) -> budget.Estimate:
        seen.append(est)
        return real(est, warn=None)

    budget.check = spy
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, seen
    finally:
        budget.check = real


def measure(make: Callable[[int], Callable[[], Any]], size: int, repeat: int) -> dict[str, Any]:
    run = make(size)
    run()  # warm-up: imports, numba kernels, caches
    times, estimates = [], []
    for _ in range(repeat):
        s, est = captured(run)
        times.append(s)
        estimates = est
    said = sum(e.seconds for e in estimates)
    med = statistics.median(times)
    return {"size": size, "estimate_s": said, "estimates": [e.describe() for e in estimates],
            "min_s": min(times), "median_s": med, "max_s": max(times), "ratio": said / med}


# ---------------------------------------------------------------------------------------
# The cases: size -> a call that does the command's work
# ---------------------------------------------------------------------------------------

def synth(tokens: int) -> Callable[[], Any]:
    from moesim.models import get_model
    from moesim.traces.format import write_trace
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    spec, out = get_model(MODEL), Path(tempfile.mkdtemp()) / "t.npz"
    return lambda: write_trace(synthetic_trace(spec, SyntheticParams(tokens=tokens)), out)


def _replay(sim: str, policies: tuple[str, ...]) -> Callable[[int], Callable[[], Any]]:
    def make(tokens: int) -> Callable[[], Any]:
        from moesim.models import get_model
        from moesim.sim.replay import replay, replay_setting
        from moesim.traces.synthetic import SyntheticParams, synthetic_trace

        trace = synthetic_trace(get_model(MODEL), SyntheticParams(tokens=tokens))
        return lambda: replay(trace, "a6000", list(policies), replay_setting(sim=sim))
    return make


def _whatif(sim: str) -> Callable[[int], Callable[[], Any]]:
    def make(tokens: int) -> Callable[[], Any]:
        from moesim.sim.whatif import WhatifOptions, whatif

        return lambda: whatif(WhatifOptions(models=["olmoe-1b-7b"], hws=["a6000", "h100-sxm", "gh200"], link_gbps=[8, 16, 32, 64],
                              cache_gib=[0, 1], tokens=tokens, sim=sim, jobs=1))
    return make


def _profile(model: str, policy: str) -> Callable[[int], Callable[[], Any]]:
    def make(tokens: int) -> Callable[[], Any]:
        from executor.runs import DecodeRequest, record_decode

        out = Path(tempfile.mkdtemp()) / "run.npz"
        req = DecodeRequest(model=model, policy=policy, tokens=tokens, fidelity_tokens=0)
        return lambda: record_decode(req, out)
    return make


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], tuple[int, int]]] = {
    "synth": (synth, (10_000, 40_000)),
    "replay-fast": (_replay("fast", POLICIES), (10_000, 40_000)),
    "replay-simpy": (_replay("simpy", POLICIES[:2]), (256, 1024)),
    "whatif-fast": (_whatif("fast"), (128, 512)),
    "whatif-simpy": (_whatif("simpy"), (32, 128)),
    "profile": (_profile("tiny", "prefetch-fom"), (16, 64)),
    "profile-stdlib": (_profile("moe-stdlib", "on-demand"), (16, 64)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "estimates.json")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    load_start = load_average()
    t0 = time.perf_counter()
    reference_loop()
    ref_s = time.perf_counter() - t0
    report: dict[str, Any] = {
        "machine": machine(), "git_commit": git_commit(), "synthetic_traces": True,
        "load_average_start": load_start, "reference_loop_s": ref_s, "repeat": args.repeat,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "within": WITHIN, "cases": {}}
    for name in names:
        make, (small, large) = CASES[name]
        a, b = measure(make, small, args.repeat), measure(make, large, args.repeat)
        grown_est, grown = b["estimate_s"] - a["estimate_s"], b["median_s"] - a["median_s"]
        marginal = grown_est / grown if grown > 0 else float("nan")
        ok = all(1 / WITHIN <= r <= WITHIN for r in (a["ratio"], b["ratio"]))
        report["cases"][name] = {"small": a, "large": b, "marginal_ratio": marginal, "within_3x": ok}
        print(f"{name:13s} {a['size']:>6} steps: estimate {a['estimate_s']:8.3f} s, took {a['median_s']:7.3f} s "
              f"(x{a['ratio']:.2f}); {b['size']:>6}: {b['estimate_s']:8.3f} s vs {b['median_s']:7.3f} s "
              f"(x{b['ratio']:.2f}); marginal x{marginal:.2f}{'' if ok else '  NOT within 3x'}", flush=True)
    report["load_average_end"] = load_average()
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
