"""Simulator speed on this machine: long traces, engines, planning and sweeps (issues 11, 25).

One command (run it on an idle machine; numbers taken under contention mean nothing, so
the 1-minute load average is recorded at the start and the end of the run):

    python bench/bench_sim.py                 # ~6-8 minutes on 2 cores
    python bench/bench_sim.py --large         # adds the ~100,000-configuration sweep (minutes)
    python bench/bench_sim.py --quick         # small sizes: checks the script runs

It measures, each as min / median / max over ``--repeat`` runs (after one untimed warm-up
run, so numba's compiled kernels are in its cache, as after any first use):

- the long-trace commands on a ``--long-tokens`` (100,000) synthetic trace, each as the
  real CLI in a subprocess (wall time and peak RSS from ``os.wait4``) and, in process,
  its parts:
  - ``moesim synth`` for Qwen3-30B-A3B and the catalogue model with the most expert slots
    a token: generation, ``write_trace`` and the two together (target < 3 s);
  - ``moesim stats T --json``: ``read_trace`` and ``routing_stats`` (target < 10 s);
  - ``moesim replay T --hw a6000 --policy on-demand,prefetch-fom,prefetch-spec,oracle
    --sim fast --json``: read, plan, time, summarise (target < 4 s and < 1 GB peak RSS);
- SimPy and fast-path layer-steps/s on a ``--tokens`` Qwen3-30B-A3B trace (two policies);
- planning: the policy decisions of the long trace under four policies, without a cache
  and with an LRU and an LFU cache of 256 experts (targets < 10 s and < 30 s);
- the 1,000-configuration sweep over a ``--tokens`` trace, plans included (< 1.5 s);

and the machine (CPU model, cores, Python, numpy and numba versions). Every time is also
given as a ratio to a fixed pure-Python reference loop timed in the same run, so runs on
other machines compare. Writes JSON (``--out``) and a plot (``--plot``) of sweep time
against configurations and against trace length, and of the long-trace commands against
their targets. Prints and never asserts: speed is measured, not tested.

All traces are **synthetic** (moesim.traces.synthetic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moesim.costmodel import CostModel
from moesim.hardware import builtin_profiles, get_profile
from moesim.models import CATALOGUE, get_model
from moesim.sim.costs import roofline_costs
from moesim.sim.engine import run_simpy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import build_plan
from moesim.sim.simulate import simulate_policies
from moesim.sim.whatif import Sweep, run_sweep
from moesim.sim.workload import Link, make_workload
from moesim.traces.format import Trace, read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

MODEL = "qwen3-30b-a3b"
HW = "a6000"
POLICIES = ["on-demand", "prefetch-fom", "prefetch-spec", "oracle"]
TARGETS_S = {"plan_no_cache": 10.0, "plan_lru": 30.0, "plan_lfu": 30.0, "replay": 4.0, "sweep_1000": 1.5,
             "sweep_large": 300.0, "synth": 3.0, "stats": 10.0}
TARGET_REPLAY_RSS_MB = 1000.0


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


#: Runs the CLI in a child Python and writes its peak RSS (VmHWM, KiB) to the file named
#: first: the child's own figure. (``ru_maxrss`` from ``wait4`` is not: Linux keeps the
#: high-water mark across exec, so a child forked from this process, which holds the long
#: traces, would report this process's size.)
PEAK_WRAPPER = """
import atexit, sys
out = sys.argv.pop(1)
def peak():
    try:
        with open('/proc/self/status') as f:
            kib = next(line.split()[1] for line in f if line.startswith('VmHWM:'))
        with open(out, 'w') as f:
            f.write(kib)
    except (OSError, StopIteration):
        pass
atexit.register(peak)
sys.argv[0] = 'moesim'
from moesim.__main__ import run
run()
"""


def cli_timed(args: list[str], repeat: int) -> dict[str, Any]:
    """The real CLI (``moesim ARGS`` in a child Python, output discarded): min / median /
    max wall seconds and the peak RSS of ``repeat`` runs after one untimed warm-up run.
    A failing run stops the benchmark."""
    times, rss = [], []
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        for i in range(repeat + 1):
            peak_file.unlink(missing_ok=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, str(peak_file), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, errors="replace")
            wall = time.perf_counter() - t0
            if r.returncode:
                raise SystemExit(f"moesim {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
            if i:
                times.append(wall)
                if peak_file.exists():
                    rss.append(int(peak_file.read_text()) / 1024)
    out: dict[str, Any] = {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times),
                           "command": "moesim " + " ".join(args)}
    if rss:
        out["peak_rss_mb"] = max(rss)
    return out


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


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (all processes; /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def own_cpu_s() -> float:
    """CPU seconds this process and its finished children used."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def rate_entry(t: dict[str, Any], work: float, unit: str, ref_s: float, target_s: float | None = None) -> dict:
    """Times, the rate at the median, and each time in reference-loop units."""
    out = {**t, unit: work / t["median_s"],
           "ratio_to_reference": {k[:-2]: t[k] / ref_s for k in ("min_s", "median_s", "max_s")}}
    if target_s is not None:
        out["target_s"] = target_s
        out["meets_target"] = t["median_s"] < target_s
    return out


def sweep_of(traces: dict[str, Trace], n_hw: int, policies: list[str], n_links: int, caches: list[float]) -> Sweep:
    hws = [get_profile(h) for h in sorted(builtin_profiles())[:n_hw]]
    links = [float(g) for g in np.geomspace(4, 400, n_links).round(2)]
    return Sweep(traces, hws, policies, links, caches)


def show(name: str, t: dict[str, Any], target: float | None = None) -> None:
    rss = f", peak RSS {t['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in t else ""
    goal = f"; target {target:g} s" if target is not None else ""
    print(f"{name}: {t['median_s']:.2f} s median ({t['min_s']:.2f}-{t['max_s']:.2f}{goal}){rss}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="trace length of the engine and sweep benchmarks")
    ap.add_argument("--long-tokens", type=int, default=100_000,
                    help="trace length of the synth, stats, replay and planning benchmarks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=0, help="sweep worker processes (0 = all cores)")
    ap.add_argument("--large", action="store_true", help="also time a ~100,000-configuration sweep")
    ap.add_argument("--only-long", action="store_true", help="time the long-trace commands (synth, stats, replay) alone")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: checks that the script runs")
    ap.add_argument("--out", type=Path, default=Path("bench/bench_sim.json"))
    ap.add_argument("--plot", type=Path, default=Path("bench/bench_sim.png"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.long_tokens, args.repeat = 100, 2000, 1
    jobs = args.jobs or os.cpu_count() or 1
    spec, hw = get_model(MODEL), get_profile(HW)
    report: dict[str, Any] = {"machine": machine(), "load_average_start": load_average(), "model": MODEL,
                              "synthetic_traces": True, "repeat": args.repeat, "jobs": jobs,
                              "command": "python bench/bench_sim.py " + " ".join(sys.argv[1:])}
    wall0, busy0, own0 = time.perf_counter(), busy_cpu_s(), own_cpu_s()
    ref = timed(reference_loop, max(3, args.repeat))
    ref_s = ref["min_s"]
    report["reference_loop"] = {**ref, "what": "pure-Python loop of 2,000,000 float multiply-adds"}
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, Python "
          f"{report['machine']['python']}, numpy {report['machine']['numpy']}; reference loop {ref_s:.3f} s; "
          f"load average {report['load_average_start']}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        long_trace = long_commands(report, args, ref_s, Path(tmp))
        if not args.only_long:
            engines_and_planning(report, args, ref_s, long_trace, spec, hw)
            series = sweeps(report, args, ref_s, spec, jobs)
    report["load_average_end"] = load_average()
    busy1, wall = busy_cpu_s(), time.perf_counter() - wall0
    if busy0 is not None and busy1 is not None:
        # The load that was not this benchmark's: what other processes kept busy, in cores,
        # averaged over the run (0 on an idle machine; the load average counts this run too).
        report["others_cores_busy"] = round(max(0.0, (busy1 - busy0) - (own_cpu_s() - own0)) / wall, 3)
    report["wall_s"] = round(wall, 1)
    print(f"load average at the end {report['load_average_end']}; other processes kept "
          f"{report.get('others_cores_busy', float('nan')):.2f} cores busy on average during the run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from moesim.atomic import atomic_write_text

    atomic_write_text(args.out, json.dumps(report, indent=2))
    if not args.only_long:
        plot(report, series, args.plot)
        print(f"wrote {args.out} and {args.plot}")
    else:
        print(f"wrote {args.out}")


def long_commands(report: dict[str, Any], args: argparse.Namespace, ref_s: float, tmp: Path) -> Trace:
    """synth (CLI and its parts) for two models, then stats and replay (CLI and parts) of
    the Qwen3-30B-A3B trace; returns that trace (for the planning cases)."""
    from moesim.sim.stats import routing_stats

    tokens = args.long_tokens
    biggest = max(CATALOGUE.values(), key=lambda m: (m.n_moe_layers * m.top_k, m.n_experts)).name
    report["synth"] = {}
    for name in dict.fromkeys([MODEL, biggest]):
        spec = get_model(name)
        params = SyntheticParams(tokens=tokens)
        slots = tokens * spec.n_moe_layers * spec.top_k
        path = tmp / f"{name}.npz"
        gen = timed(lambda s=spec, p=params: synthetic_trace(s, p), args.repeat)
        trace = synthetic_trace(spec, params)
        write = timed(lambda t=trace, p=path: write_trace(t, p), args.repeat)
        both = timed(lambda s=spec, p=params, o=path: write_trace(synthetic_trace(s, p), o), args.repeat)
        del trace
        cli = cli_timed(["synth", "--model", name, "--tokens", str(tokens), "--out", str(path)], args.repeat)
        report["synth"][name] = {
            **rate_entry(both, slots, "expert_slots_per_s", ref_s, TARGETS_S["synth"]), "tokens": tokens,
            "what": "synthetic_trace then write_trace (the file, atomically, fsync included)",
            "file_mb": path.stat().st_size / 1e6, "generate": rate_entry(gen, slots, "expert_slots_per_s", ref_s),
            "write": rate_entry(write, path.stat().st_size, "bytes_per_s", ref_s),
            "cli": rate_entry(cli, slots, "expert_slots_per_s", ref_s)}
        show(f"synth {name}, {tokens} tokens ({slots / 1e6:.1f}M expert slots): generate + write", both,
             TARGETS_S["synth"])
        show("  generate", gen)
        show("  write_trace", write)
        show(f"  CLI ({cli['command']})", cli)

    path = tmp / f"{MODEL}.npz"
    trace = read_trace(path)
    accesses = trace.true_ids.size
    read = timed(lambda: read_trace(path), args.repeat)
    in_proc = timed(lambda: routing_stats(read_trace(path)), args.repeat)
    cli = cli_timed(["stats", str(path), "--json"], args.repeat)
    report["stats"] = {**rate_entry(cli, accesses, "accesses_per_s", ref_s, TARGETS_S["stats"]), "tokens": tokens,
                       "model": MODEL, "what": "the CLI end to end: read, statistics at the default sizes, JSON",
                       "read_trace": rate_entry(read, accesses, "accesses_per_s", ref_s),
                       "in_process": {**rate_entry(in_proc, accesses, "accesses_per_s", ref_s),
                                      "what": "read_trace + routing_stats"}}
    show(f"stats {MODEL}, {tokens} tokens ({accesses / 1e6:.1f}M accesses), CLI", cli, TARGETS_S["stats"])
    show("  read_trace", read)
    show("  read_trace + routing_stats in process", in_proc)

    steps = tokens * get_model(MODEL).n_moe_layers * len(POLICIES)
    hw = get_profile(HW)

    def replay() -> None:
        for r in simulate_policies(read_trace(path), hw, POLICIES, sim="fast"):
            r.summary()

    in_proc = timed(replay, args.repeat)
    cli = cli_timed(["replay", str(path), "--hw", HW, "--policy", ",".join(POLICIES), "--sim", "fast", "--json"],
                    args.repeat)
    report["replay"] = {**rate_entry(cli, steps, "layer_steps_per_s", ref_s, TARGETS_S["replay"]),
                        "target_peak_rss_mb": TARGET_REPLAY_RSS_MB,
                        "meets_rss_target": cli.get("peak_rss_mb", float("inf")) < TARGET_REPLAY_RSS_MB,
                        "tokens": tokens, "policies": POLICIES,
                        "what": "the CLI end to end: read, plan, time, summarise, JSON",
                        "in_process": {**rate_entry(in_proc, steps, "layer_steps_per_s", ref_s),
                                       "what": "read_trace + simulate_policies + summaries"}}
    show(f"replay {len(POLICIES)} policies x {tokens} tokens, CLI", cli, TARGETS_S["replay"])
    show("  in process", in_proc)
    return trace


def engines_and_planning(report: dict[str, Any], args: argparse.Namespace, ref_s: float, big: Trace, spec,
                         hw) -> None:
    trace = synthetic_trace(spec, SyntheticParams(tokens=args.tokens))
    steps = args.tokens * spec.n_layers
    report["engines"] = {}
    for policy in ("on-demand", "prefetch-fom"):
        work = make_workload(spec, build_plan(trace, policy), roofline_costs(CostModel(spec, hw), args.tokens, trace.prompt_len))
        link = Link.from_profile(hw, spec)
        simpy_t = timed(lambda w=work, k=link: run_simpy(w, k), args.repeat)
        fast_t = timed(lambda w=work, k=link: run_fast(w, k), args.repeat)
        report["engines"][policy] = {"simpy": rate_entry(simpy_t, steps, "layer_steps_per_s", ref_s),
                                     "fast": rate_entry(fast_t, steps, "layer_steps_per_s", ref_s)}
        print(f"{policy:13s} SimPy {steps / simpy_t['median_s'] / 1e3:8.0f}k layer-steps/s   "
              f"fast path {steps / fast_t['median_s'] / 1e6:6.1f}M layer-steps/s", flush=True)
    big_steps = big.n_tokens * spec.n_moe_layers * len(POLICIES)
    report["planning"] = {}
    for name, cache, eviction in (("plan_no_cache", 0, "lru"), ("plan_lru", 256, "lru"), ("plan_lfu", 256, "lfu")):
        t = timed(lambda c=cache, e=eviction: [build_plan(big, p, c, e) for p in POLICIES], args.repeat)
        report["planning"][name] = {**rate_entry(t, big_steps, "layer_steps_per_s", ref_s, TARGETS_S[name]),
                                    "tokens": big.n_tokens, "policies": POLICIES, "cache_experts": cache,
                                    "eviction": eviction}
        show(f"planning, {len(POLICIES)} policies x {big.n_tokens} tokens, cache {cache} {eviction}", t,
             TARGETS_S[name])


def sweeps(report: dict[str, Any], args: argparse.Namespace, ref_s: float, spec, jobs: int) -> dict[str, list]:
    trace = synthetic_trace(spec, SyntheticParams(tokens=args.tokens))
    sweep = sweep_of({MODEL: trace}, 5, POLICIES, 10, [0, 2, 4, 8, 16])
    t = timed(lambda: run_sweep(sweep, jobs), args.repeat)
    report["sweep_1000"] = {**rate_entry(t, sweep.size, "configurations_per_s", ref_s, TARGETS_S["sweep_1000"]),
                            "configurations": sweep.size, "tokens": args.tokens}
    show(f"what-if: {sweep.size} configurations over the {args.tokens}-token trace", t, TARGETS_S["sweep_1000"])
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
    return series


def plot(report: dict[str, Any], series: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moesim.reports.render import save_figure

    mach = report["machine"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.6))
    n, s = zip(*series["by_configurations"])
    a1.plot(n, s, "o-")
    a1.set_xlabel("configurations")
    a1.set_ylabel("what-if sweep wall time, s")
    tok, _, s2 = zip(*series["by_tokens"])
    a2.plot(tok, s2, "o-")
    a2.set_xlabel(f"trace tokens ({series['by_tokens'][0][1]} configurations)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    cases = [(f"synth\n{name.split('-')[0]}-{name.split('-')[1]}", e) for name, e in report["synth"].items()]
    cases += [("stats", report["stats"]), ("replay\n4 policies", report["replay"])]
    labels = [c for c, _ in cases]
    med = np.array([e["median_s"] for _, e in cases])
    err = np.array([[e["median_s"] - e["min_s"] for _, e in cases], [e["max_s"] - e["median_s"] for _, e in cases]])
    x = np.arange(len(cases))
    a3.bar(x, med, yerr=err, capsize=3, color="tab:blue", alpha=0.8, label="median (min-max)")
    a3.scatter(x, [e["target_s"] for _, e in cases], marker="_", s=600, color="tab:red", zorder=3, label="target")
    a3.set_xticks(x, labels, fontsize=8)
    a3.set_ylabel("seconds")
    a3.set_title(f"{report['synth'][MODEL]['tokens']:,}-token traces (synth: generate + write; "
                 "stats, replay: CLI)", fontsize=8)
    a3.legend(fontsize=7)
    a3.grid(alpha=0.3, axis="y")
    fig.suptitle(f"synthetic {MODEL} traces; {mach['cpu']}, {mach['cores']} cores; load average "
                 f"{report['load_average_start'][:1]} at start", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
