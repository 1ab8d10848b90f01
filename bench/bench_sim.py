"""Simulator speed on this machine: engines, planning, replay and sweeps (issue 11).

One command (run it on an idle machine; numbers taken under contention mean nothing):

    python bench/bench_sim.py                 # ~2-4 minutes on 2 cores
    python bench/bench_sim.py --large         # adds the ~100,000-configuration sweep (minutes)
    python bench/bench_sim.py --quick         # small sizes: checks the script runs

It measures, each as min / median / max over ``--repeat`` runs:

- SimPy and fast-path layer-steps/s on a Qwen3-30B-A3B trace (two policies);
- planning: the policy decisions of a ``--replay-tokens`` trace under four policies,
  without a cache and with an LRU and an LFU cache (targets < 10 s and < 30 s);
- replay end to end: read the trace file, plan, time, summarise, four policies (< 20 s);
- the 1,000-configuration sweep over a 1,000-token trace, plans included (< 3 s);
- synthesis of a ``--synth-tokens`` (100,000) trace in memory, for Qwen3-30B-A3B and the
  catalogue model with the most expert slots a token (< 3 s each; writing the file,
  ``traces.format.write_trace``'s compression, is not included), and its routing
  statistics without a profile (``moesim.sim.stats.routing_stats``: < 10 s);

and the machine (CPU model, cores, Python and numpy versions). Every time is also given
as a ratio to a fixed pure-Python reference loop timed in the same run, so runs on other
machines compare. Writes JSON (``--out``) and a plot of sweep time against configurations
and against trace length (``--plot``). Prints and never asserts: speed is measured, not tested.

All traces are **synthetic** (moesim.traces.synthetic); the replay trace is a
synthetic trace of ``--base-tokens`` steps tiled to ``--replay-tokens`` (generating
100k distinct steps takes far longer than replaying them, and the tiling period is far
longer than any cache's reuse distance).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moesim.hardware import builtin_profiles, get_profile
from moesim.models import get_model
from moesim.sim.costs import roofline_costs
from moesim.sim.engine import run_simpy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import build_plan
from moesim.sim.simulate import simulate_policies
from moesim.sim.whatif import Sweep, run_sweep
from moesim.sim.workload import Link, make_workload
from moesim.traces.format import ROUTING, Trace, read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

MODEL = "qwen3-30b-a3b"
POLICIES = ["on-demand", "prefetch-fom", "prefetch-spec", "oracle"]
TARGETS_S = {"plan_no_cache": 10.0, "plan_lru": 30.0, "plan_lfu": 30.0, "replay": 20.0, "sweep_1000": 3.0,
             "sweep_large": 300.0, "synth": 3.0, "stats": 10.0}


def reference_loop() -> None:
    """A fixed amount of interpreter work: every ratio is a time in units of this loop."""
    acc = 0.0
    for i in range(2_000_000):
        acc += i * 0.5


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """min / median / max seconds of ``repeat`` calls (after one untimed warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times)}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "platform": platform.platform()}


def tiled(trace: Trace, tokens: int) -> Trace:
    """``trace`` repeated to ``tokens`` decode steps (synthetic, see the module docstring)."""
    reps = -(-tokens // trace.n_tokens)
    arrays = {a: np.concatenate([getattr(trace, a)] * reps)[:tokens] for a in ROUTING}
    token_ids = np.concatenate([trace.token_ids] * reps, axis=1)[:, :tokens]
    header = {**trace.header, "n_tokens": tokens, "tiled_from": trace.n_tokens}
    return replace(trace, header=header, token_ids=token_ids, timings={}, **arrays)


def rate_entry(t: dict[str, float], work: float, unit: str, ref_s: float, target_s: float | None = None) -> dict:
    """Times, the rate at the median, and each time in reference-loop units."""
    out = {**t, unit: work / t["median_s"], "ratio_to_reference": {k[:-2]: v / ref_s for k, v in t.items()}}
    if target_s is not None:
        out["target_s"] = target_s
        out["meets_target"] = t["median_s"] < target_s
    return out


def sweep_of(traces: dict[str, Trace], n_hw: int, policies: list[str], n_links: int, caches: list[float]) -> Sweep:
    hws = [get_profile(h) for h in sorted(builtin_profiles())[:n_hw]]
    links = [float(g) for g in np.geomspace(4, 400, n_links).round(2)]
    return Sweep(traces, hws, policies, links, caches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="trace length of the engine and sweep benchmarks")
    ap.add_argument("--replay-tokens", type=int, default=100_000, help="trace length of the planning/replay benchmarks")
    ap.add_argument("--base-tokens", type=int, default=5000, help="distinct synthetic steps the replay trace tiles")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=0, help="sweep worker processes (0 = all cores)")
    ap.add_argument("--large", action="store_true", help="also time a ~100,000-configuration sweep")
    ap.add_argument("--synth-tokens", type=int, default=100_000, help="trace length of the synth and stats cases")
    ap.add_argument("--only-synth-stats", action="store_true", help="time the synth and stats cases alone")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: checks that the script runs")
    ap.add_argument("--out", type=Path, default=Path("bench/bench_sim.json"))
    ap.add_argument("--plot", type=Path, default=Path("bench/bench_sim.png"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.replay_tokens, args.base_tokens, args.repeat = 100, 2000, 500, 1
        args.synth_tokens = 2000
    jobs = args.jobs or os.cpu_count() or 1
    spec, hw = get_model(MODEL), get_profile("a6000")
    report: dict[str, Any] = {"machine": machine(), "model": MODEL, "synthetic_traces": True, "repeat": args.repeat,
                              "jobs": jobs}
    ref = timed(reference_loop, max(3, args.repeat))
    ref_s = ref["min_s"]
    report["reference_loop"] = {**ref, "what": "pure-Python loop of 2,000,000 float multiply-adds"}
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, Python "
          f"{report['machine']['python']}, numpy {report['machine']['numpy']}; reference loop {ref_s:.3f} s")

    synth_and_stats(report, args, ref_s)
    if args.only_synth_stats:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        from moesim.atomic import atomic_write_text

        atomic_write_text(args.out, json.dumps(report, indent=2))
        print(f"wrote {args.out}")
        return

    # Engines ---------------------------------------------------------------------------
    trace = synthetic_trace(spec, SyntheticParams(tokens=args.tokens))
    steps = args.tokens * spec.n_layers
    report["engines"] = {}
    for policy in ("on-demand", "prefetch-fom"):
        work = make_workload(spec, build_plan(trace, policy), roofline_costs(spec, hw, args.tokens, trace.prompt_len))
        link = Link.from_profile(hw, spec)
        simpy_t = timed(lambda w=work, k=link: run_simpy(w, k), args.repeat)
        fast_t = timed(lambda w=work, k=link: run_fast(w, k), args.repeat)
        report["engines"][policy] = {"simpy": rate_entry(simpy_t, steps, "layer_steps_per_s", ref_s),
                                     "fast": rate_entry(fast_t, steps, "layer_steps_per_s", ref_s)}
        print(f"{policy:13s} SimPy {steps / simpy_t['median_s'] / 1e3:8.0f}k layer-steps/s   "
              f"fast path {steps / fast_t['median_s'] / 1e6:6.1f}M layer-steps/s")

    # Planning and replay of a long trace ---------------------------------------------------
    big = tiled(synthetic_trace(spec, SyntheticParams(tokens=min(args.base_tokens, args.replay_tokens))),
                args.replay_tokens)
    big_steps = args.replay_tokens * spec.n_moe_layers * len(POLICIES)
    report["planning"] = {}
    for name, cache, eviction in (("plan_no_cache", 0, "lru"), ("plan_lru", 256, "lru"), ("plan_lfu", 256, "lfu")):
        t = timed(lambda c=cache, e=eviction: [build_plan(big, p, c, e) for p in POLICIES], args.repeat)
        report["planning"][name] = {**rate_entry(t, big_steps, "layer_steps_per_s", ref_s, TARGETS_S[name]),
                                    "tokens": args.replay_tokens, "policies": POLICIES, "cache_experts": cache}
        print(f"planning, {len(POLICIES)} policies x {args.replay_tokens} tokens, cache {cache} {eviction}: "
              f"{t['median_s']:.2f} s (target {TARGETS_S[name]:g} s)")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(big, Path(tmp) / "replay.npz")

        def replay() -> None:
            tr = read_trace(path)
            for r in simulate_policies(tr, hw, POLICIES, engine="fast"):
                r.summary()

        t = timed(replay, args.repeat)
    report["replay"] = {**rate_entry(t, big_steps, "layer_steps_per_s", ref_s, TARGETS_S["replay"]),
                        "tokens": args.replay_tokens, "policies": POLICIES, "what": "read trace, plan, time, summarise"}
    print(f"replay end to end, {len(POLICIES)} policies x {args.replay_tokens} tokens: {t['median_s']:.2f} s "
          f"(target {TARGETS_S['replay']:g} s)")

    # Sweeps -----------------------------------------------------------------------------
    sweep = sweep_of({MODEL: trace}, 5, POLICIES, 10, [0, 2, 4, 8, 16])
    t = timed(lambda: run_sweep(sweep, jobs), args.repeat)
    report["sweep_1000"] = {**rate_entry(t, sweep.size, "configurations_per_s", ref_s, TARGETS_S["sweep_1000"]),
                            "configurations": sweep.size, "tokens": args.tokens}
    print(f"what-if: {sweep.size} configurations over the {args.tokens}-token trace: {t['median_s']:.2f} s "
          f"(target {TARGETS_S['sweep_1000']:g} s)")
    series: dict[str, list] = {"by_configurations": [], "by_tokens": []}
    for n_links, caches in ((2, [0]), (5, [0, 4]), (10, [0, 2, 4, 8, 16])):
        s = sweep_of({MODEL: trace}, 5, POLICIES, n_links, caches)
        series["by_configurations"].append((s.size, timed(lambda s=s: run_sweep(s, jobs), 1)["median_s"]))
    for tokens in sorted({max(50, args.tokens // 4), args.tokens, args.tokens * 4}):
        tr = synthetic_trace(spec, SyntheticParams(tokens=tokens))
        s = sweep_of({MODEL: tr}, 5, POLICIES, 5, [0, 4])
        series["by_tokens"].append((tokens, s.size, timed(lambda s=s: run_sweep(s, jobs), 1)["median_s"]))
    report["sweep_series"] = series
    if args.large:
        traces = {f"{MODEL}#seed{i}": synthetic_trace(spec, SyntheticParams(tokens=args.tokens, seed=i))
                  for i in range(10)}
        large = sweep_of(traces, 8, [*POLICIES, "all-resident"], 31, [0, 1, 2, 4, 6, 8, 12, 16, 24, 32])
        t0 = time.perf_counter()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.perf_counter() - t0
            if now - last[0] > 10 or done == total:
                last[0] = now
                eta = now * (total - done) / done if done else float("nan")
                print(f"  {done}/{total} configurations, {now:.0f} s, ~{eta:.0f} s left", file=sys.stderr)

        run_sweep(large, jobs, progress, keep_rows=False, out=Path(tempfile.mkdtemp()) / "large.csv")
        wall = time.perf_counter() - t0
        report["sweep_large"] = {"seconds": wall, "configurations": large.size,
                                 "configurations_per_s": large.size / wall, "ratio_to_reference": wall / ref_s,
                                 "target_s": TARGETS_S["sweep_large"], "meets_target": wall < TARGETS_S["sweep_large"],
                                 "shape": "10 traces x 8 profiles x 5 policies x 31 links x 10 caches (all-resident: 1 cache)"}
        print(f"what-if: {large.size} configurations in {wall:.0f} s (target {TARGETS_S['sweep_large']:g} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from moesim.atomic import atomic_write_text

    atomic_write_text(args.out, json.dumps(report, indent=2))
    plot(series, args.plot, report["machine"])
    print(f"wrote {args.out} and {args.plot}")


def synth_and_stats(report: dict[str, Any], args: argparse.Namespace, ref_s: float) -> None:
    """The synth and stats cases: ``synthetic_trace`` of ``--synth-tokens`` steps in memory
    for Qwen3-30B-A3B and the catalogue's model with the most expert slots a token, then
    ``routing_stats`` (no profile) of the Qwen3 trace."""
    from moesim.models import CATALOGUE
    from moesim.sim.stats import routing_stats

    tokens = args.synth_tokens
    biggest = max(CATALOGUE.values(), key=lambda m: (m.n_moe_layers * m.top_k, m.n_experts)).name
    report["synth"] = {}
    for name in dict.fromkeys([MODEL, biggest]):
        spec = get_model(name)
        params = SyntheticParams(tokens=tokens)
        t = timed(lambda s=spec, p=params: synthetic_trace(s, p), args.repeat)
        slots = tokens * spec.n_moe_layers * spec.top_k
        report["synth"][name] = {**rate_entry(t, slots, "expert_slots_per_s", ref_s, TARGETS_S["synth"]),
                                 "tokens": tokens, "what": "synthetic_trace in memory (no file written)"}
        print(f"synth {name}, {tokens} tokens ({slots / 1e6:.1f}M expert slots): {t['median_s']:.2f} s median "
              f"({t['min_s']:.2f}-{t['max_s']:.2f}; target {TARGETS_S['synth']:g} s)")
    trace = synthetic_trace(get_model(MODEL), SyntheticParams(tokens=tokens))
    t = timed(lambda: routing_stats(trace), args.repeat)
    accesses = trace.true_ids.size
    report["stats"] = {**rate_entry(t, accesses, "accesses_per_s", ref_s, TARGETS_S["stats"]), "tokens": tokens,
                       "model": MODEL, "what": "routing_stats at the default sizes, no profile (trace in memory)"}
    print(f"stats {MODEL}, {tokens} tokens ({accesses / 1e6:.1f}M accesses): {t['median_s']:.2f} s median "
          f"({t['min_s']:.2f}-{t['max_s']:.2f}; target {TARGETS_S['stats']:g} s)")


def plot(series: dict[str, list], path: Path, mach: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moesim.reports.render import save_figure

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    n, s = zip(*series["by_configurations"])
    a1.plot(n, s, "o-")
    a1.set_xlabel("configurations")
    a1.set_ylabel("sweep wall time, s")
    tok, _, s2 = zip(*series["by_tokens"])
    a2.plot(tok, s2, "o-")
    a2.set_xlabel(f"trace tokens ({series['by_tokens'][0][1]} configurations)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"what-if sweep time, synthetic {MODEL} traces; {mach['cpu']}, {mach['cores']} cores", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
