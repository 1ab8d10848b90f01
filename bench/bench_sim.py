"""Simulator speed on this machine: long traces, engines, planning and sweeps (issues 11, 25).

One command (run it on an idle machine; numbers taken under contention mean nothing, so
the 1-minute load average is recorded at the start and the end of the run):

    python bench/bench_sim.py                 # ~4-5 minutes on 2 idle cores (writes bench/bench_sim.json, .png)
    python bench/bench_sim.py --readme        # the README's speed table from bench/bench_sim.json
    python bench/bench_sim.py --large         # adds the ~100,000-configuration sweep (minutes)
    python bench/bench_sim.py --only-long     # the long-trace commands alone (writes bench/bench_long.json)
    python bench/bench_sim.py --quick         # small sizes: checks the script runs
    python bench/bench_sim.py --only-start    # the first answer, cold and warm (writes bench/bench_start.json)

It measures, each as min / median / max over ``--repeat`` runs (after one untimed warm-up
run, so numba's compiled kernels are in its cache, as after any first use):

- the long-trace commands on a ``--long-tokens`` (100,000) synthetic trace, each as the
  real CLI in a subprocess (wall time and peak RSS from ``os.wait4``) and, in process,
  its parts:
  - ``moesim synth`` for Qwen3-30B-A3B and the catalogue model with the most expert slots
    a token: the CLI (Python, moesim and numba starting included; Qwen3-30B-A3B's held to
    the target, <= 15 reference loops) and ``write_synthetic_trace`` in process (what the CLI
    runs: drawn a chunk at a time into the file) beside it, with the file's size;
  - ``moesim stats T --json``: the CLI (target <= 30 loops); ``read_trace`` and ``routing_stats``;
  - ``moesim replay T --hw a6000 --policy on-demand,prefetch-fom,prefetch-spec,oracle
    --sim fast --json``: the CLI (target <= 20 loops and < 0.5 GB peak RSS); in process, the
    calls ``simulate_policies`` makes: read, compute times and recall, plan, time, summarise;
- SimPy and fast-path layer-steps/s on a ``--tokens`` Qwen3-30B-A3B trace (two policies);
- planning: the policy decisions of the long trace under four policies, without a cache
  and with an LRU and an LFU cache of 256 experts (targets < 10 s and < 30 s);
- the 1,000-configuration sweep over a ``--tokens`` trace, plans included (< 1.5 s);
- with ``--only-start``, the first answer: ``moesim whatif`` (the README's quick start) in
  a fresh process, **cold** (an empty numba cache, as on a fresh install: every kernel it
  uses is compiled) and **warm** (the cache that cold run wrote), ``--repeat`` pairs (target:
  cold < 6 s on 2 cores);

and the machine (CPU model, cores, Python, numpy and numba versions). Every time is also
given as a ratio to a fixed pure-Python reference loop timed in the same run, so runs on
other machines compare. Writes JSON (``--out``) and a plot (``--plot``) of sweep time
against configurations and against trace length, and of the long-trace commands against
their targets; the JSON's ``targets`` lists every target with its min / median / max, the
target, whether the median meets it, peak RSS and reference-loop ratio, and ``--readme``
renders them with the machine and load as the README's table. Prints and never asserts:
speed is measured, not tested.

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
from moesim.policy import get_policy
from moesim.setting import Setting
from moesim.sim.costs import roofline_costs
from moesim.sim.engine import run_simpy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import build_plan
from moesim.sim.simulate import PerTrace, pick_costs, prediction_recall, time_plan
from moesim.sim.sweep import Sweep, run_sweep
from moesim.sim.workload import Link, make_workload
from moesim.traces.format import Trace, read_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace, write_synthetic_trace

MODEL = "qwen3-30b-a3b"
HW = "a6000"
POLICIES = ["on-demand", "prefetch-fom", "prefetch-spec", "oracle"]
TARGETS_S = {"plan_no_cache": 10.0, "plan_lru": 30.0, "plan_lfu": 30.0, "sweep_1000": 1.5, "sweep_large": 300.0}
#: The long-trace commands' targets (issue 40) in reference loops: the command's median wall time
#: (the CLI, Python's start included) over the reference loop's fastest run in the same session,
#: so that a target means the same on any machine. The synth target is Qwen3-30B-A3B's.
TARGET_LOOPS = {"synth": 15.0, "replay": 20.0, "stats": 30.0}
TARGET_REPLAY_RSS_MB = 500.0
TARGET_COLD_START_S = 6.0  # the first `moesim whatif` on a fresh install, 2 cores (issue 40)


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


def timed_parts(parts: list[tuple[str, Callable[[], Any]]], repeat: int) -> dict[str, dict[str, float]]:
    """Each part's min / median / max seconds and their sum's (``"total"``) over ``repeat``
    runs of the parts in order (after one untimed warm-up run of them all): one pass
    measures a command and its parts, so the parts add up to what is compared with the target."""
    for _, fn in parts:
        fn()
    times: dict[str, list[float]] = {name: [] for name, _ in parts}
    totals = []
    for _ in range(repeat):
        total = 0.0
        for name, fn in parts:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            total += dt
        totals.append(total)

    def stats(v: list[float]) -> dict[str, float]:
        return {"min_s": min(v), "median_s": statistics.median(v), "max_s": max(v)}

    return {"total": stats(totals), **{name: stats(v) for name, v in times.items()}}


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
    A failing run stops the benchmark. The child caches bytecode as Python does by default
    (a ``PYTHONDONTWRITEBYTECODE`` of this shell is dropped for it; an installed package
    ships compiled): the warm-up run writes the caches, the timed runs read them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times, rss = [], []
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        for i in range(repeat + 1):
            peak_file.unlink(missing_ok=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, str(peak_file), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, errors="replace", env=env)
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
            "numba": numba.__version__, "platform": platform.platform(),
            "cli_bytecode": "cached (Python's default; this shell's PYTHONDONTWRITEBYTECODE "
                            f"{'dropped' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'unset'} for the CLI runs)"}


def git_commit() -> str | None:
    """The checkout's commit (with ``+`` when files differ from it), or None outside git."""
    try:
        here = Path(__file__).resolve().parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


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


def rate_entry(t: dict[str, Any], work: float, unit: str, ref_s: float, target_s: float | None = None,
               target_loops: float | None = None) -> dict:
    """Times, the rate at the median, and each time in reference-loop units; a target in
    seconds, or in loops (then ``target_s`` is what it comes to on this machine)."""
    out = {**t, unit: work / t["median_s"],
           "ratio_to_reference": {k[:-2]: t[k] / ref_s for k in ("min_s", "median_s", "max_s")}}
    if target_loops is not None:
        out["target_loops"] = target_loops
        out["target_s"] = target_loops * ref_s
        out["meets_target"] = t["median_s"] / ref_s <= target_loops
    elif target_s is not None:
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
    loops = t.get("ratio_to_reference")
    if loops:
        goal += f"; {loops['min']:.1f} / {loops['median']:.1f} / {loops['max']:.1f} loops"
    if t.get("target_loops") is not None:
        goal += f", target <= {t['target_loops']:g} loops: {'met' if t['meets_target'] else 'NOT met'}"
    print(f"{name}: {t['min_s']:.2f} / {t['median_s']:.2f} / {t['max_s']:.2f} s min / median / max{goal}{rss}",
          flush=True)


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
    ap.add_argument("--only-start", action="store_true",
                    help="time the first answer alone, cold and warm (default --out bench/bench_start.json)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default bench/bench_sim.json)")
    ap.add_argument("--plot", type=Path, default=Path("bench/bench_sim.png"))
    ap.add_argument("--readme", action="store_true",
                    help="print the README's speed table (markdown) from the JSON of --out, and time nothing")
    args = ap.parse_args()
    # --only-long and --only-start write their own files: the full run's JSON keeps its other sections.
    args.out = args.out or Path("bench/bench_start.json" if args.only_start else
                                "bench/bench_long.json" if args.only_long else "bench/bench_sim.json")
    if args.readme:
        print(readme_table(json.loads(args.out.read_text())), end="")
        return
    if args.quick:
        args.tokens, args.long_tokens, args.repeat = 100, 2000, 1
    jobs = args.jobs or os.cpu_count() or 1
    spec, hw = get_model(MODEL), get_profile(HW)
    report: dict[str, Any] = {"machine": machine(), "load_average_start": load_average(), "model": MODEL,
                              "synthetic_traces": True, "repeat": args.repeat, "jobs": jobs,
                              "command": " ".join(["python bench/bench_sim.py", *sys.argv[1:]]),
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit()}
    wall0, busy0, own0 = time.perf_counter(), busy_cpu_s(), own_cpu_s()
    ref = timed(reference_loop, max(3, args.repeat))
    ref_s = ref["min_s"]
    report["reference_loop"] = {**ref, "what": "pure-Python loop of 2,000,000 float multiply-adds"}
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, Python "
          f"{report['machine']['python']}, numpy {report['machine']['numpy']}; reference loop {ref_s:.3f} s; "
          f"load average {report['load_average_start']}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if args.only_start:
            start_times(report, args, ref_s, Path(tmp))
            return finish(report, args, wall0, busy0, own0)
        long_trace = long_commands(report, args, ref_s, Path(tmp))
        if not args.only_long:
            engines_and_planning(report, args, ref_s, long_trace, spec, hw)
            series = sweeps(report, args, ref_s, spec, jobs)
    finish(report, args, wall0, busy0, own0)
    if not args.only_long:
        plot(report, series, args.plot)
        print(f"wrote {args.plot}")


def finish(report: dict[str, Any], args: argparse.Namespace, wall0: float, busy0: float | None, own0: float) -> None:
    """The load during the run, the targets, and the JSON written."""
    report["load_average_end"] = load_average()
    busy1, wall = busy_cpu_s(), time.perf_counter() - wall0
    if busy0 is not None and busy1 is not None:
        # The load that was not this benchmark's: what other processes kept busy, in cores,
        # averaged over the run (0 on an idle machine; the load average counts this run too).
        report["others_cores_busy"] = round(max(0.0, (busy1 - busy0) - (own_cpu_s() - own0)) / wall, 3)
    report["wall_s"] = round(wall, 1)
    report["targets"] = target_rows(report)
    print(f"load average at the end {report['load_average_end']}; other processes kept "
          f"{report.get('others_cores_busy', float('nan')):.2f} cores busy on average during the run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from moesim.atomic import atomic_write_text

    atomic_write_text(args.out, json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def start_times(report: dict[str, Any], args: argparse.Namespace, ref_s: float, tmp: Path) -> None:
    """``moesim whatif`` in a fresh process, cold (an empty numba cache folder,
    ``MOESIM_CACHE_DIR``) then warm (the same folder, now filled), ``--repeat`` pairs."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "NUMBA_CACHE_DIR")}
    runs: dict[str, list[float]] = {"cold": [], "warm": []}
    for i in range(args.repeat):
        for kind in runs:
            cmd = [sys.executable, "-m", "moesim", "whatif", "--out", str(tmp / f"whatif-{i}-{kind}")]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, env={**env, "MOESIM_CACHE_DIR": str(tmp / f"cache-{i}")}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, errors="replace")
            runs[kind].append(time.perf_counter() - t0)
            if r.returncode:
                raise SystemExit(f"moesim whatif failed ({r.returncode}): {r.stderr[-2000:]}")
    report["start"] = {kind: {"min_s": min(t), "median_s": statistics.median(t), "max_s": max(t),
                              "ratio_to_reference": statistics.median(t) / ref_s, "runs": len(t),
                              "command": "moesim whatif" + (" (empty numba cache)" if kind == "cold" else "")}
                       for kind, t in runs.items()}
    for kind, v in report["start"].items():
        print(f"{kind} start, moesim whatif: {v['min_s']:.2f} / {v['median_s']:.2f} / {v['max_s']:.2f} s "
              f"(min / median / max), {v['ratio_to_reference']:.0f} reference loops", flush=True)


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
        parts = timed_parts([("write_synthetic_trace", lambda s=spec, p=params, o=path: write_synthetic_trace(s, p, o))],
                            args.repeat)
        cli = {**cli_timed(["synth", "--model", name, "--tokens", str(tokens), "--out", str(path)], args.repeat),
               "command": f"moesim synth --model {name} --tokens {tokens} --out T"}
        goal = TARGET_LOOPS["synth"] if name == MODEL else None  # the target is Qwen3-30B-A3B's
        report["synth"][name] = {
            **rate_entry(parts["total"], slots, "expert_slots_per_s", ref_s), "tokens": tokens,
            "what": "write_synthetic_trace (drawn a chunk at a time into the file, atomically, fsync included), "
                    "in process",
            "file_mb": path.stat().st_size / 1e6,
            "cli": rate_entry(cli, slots, "expert_slots_per_s", ref_s, target_loops=goal)}
        show(f"synth {name}, {tokens} tokens ({slots / 1e6:.1f}M expert slots), CLI ({cli['command']}; Python, "
             "moesim and numba starting included)", report["synth"][name]["cli"])
        show(f"  write_synthetic_trace in process (file {path.stat().st_size / 1e6:.0f} MB)", report["synth"][name])

    path = tmp / f"{MODEL}.npz"
    trace = read_trace(path)
    accesses = trace.true_ids.size
    held: dict[str, Any] = {}
    parts = timed_parts([("read_trace", lambda: held.update(trace=read_trace(path))),
                         ("routing_stats", lambda: routing_stats(held["trace"]))], args.repeat)
    cli = {**cli_timed(["stats", str(path), "--json"], args.repeat), "command": "moesim stats T --json"}
    report["stats"] = {**rate_entry(cli, accesses, "accesses_per_s", ref_s, target_loops=TARGET_LOOPS["stats"]),
                       "tokens": tokens, "model": MODEL, "trace_mb": path.stat().st_size / 1e6,
                       "what": "the CLI end to end: read, statistics at the default sizes, JSON",
                       "read_trace": rate_entry(parts["read_trace"], accesses, "accesses_per_s", ref_s),
                       "routing_stats": rate_entry(parts["routing_stats"], accesses, "accesses_per_s", ref_s),
                       "in_process": {**rate_entry(parts["total"], accesses, "accesses_per_s", ref_s),
                                      "what": "read_trace + routing_stats"}}
    show(f"stats {MODEL}, {tokens} tokens ({accesses / 1e6:.1f}M accesses), CLI", report["stats"])
    show("  read_trace", report["stats"]["read_trace"])
    show("  routing_stats", report["stats"]["routing_stats"])

    steps = tokens * get_model(MODEL).n_moe_layers * len(POLICIES)
    hw = get_profile(HW)
    pols = [get_policy(p) for p in POLICIES]

    # The parts of simulate_policies for the copy policies, each the function it calls.
    def setup() -> None:
        tr = held["trace"]
        held["costs"] = pick_costs(tr, CostModel(tr.model, hw), "auto")
        held["recall"] = prediction_recall(tr)

    def plan() -> None:
        held["plans"] = [build_plan(held["trace"], p, 0, "lru") for p in pols]

    def time_them() -> None:
        held["results"] = [time_plan(held["trace"], p, pl, held["costs"], [hw], Setting(sim="fast"),
                                     shared=PerTrace(pred_recall=held["recall"]))[0]
                           for p, pl in zip(pols, held.pop("plans"))]

    parts = timed_parts([("read_trace", lambda: held.update(trace=read_trace(path))),
                         ("costs_and_recall", setup), ("plan", plan), ("time", time_them),
                         ("summarise", lambda: [r.summary() for r in held.pop("results")])], args.repeat)
    held.clear()
    cli = {**cli_timed(["replay", str(path), "--hw", HW, "--policy", ",".join(POLICIES), "--sim", "fast", "--json"],
                       args.repeat),
           "command": f"moesim replay T --hw {HW} --policy {','.join(POLICIES)} --sim fast --json"}
    report["replay"] = {**rate_entry(cli, steps, "layer_steps_per_s", ref_s, target_loops=TARGET_LOOPS["replay"]),
                        "target_peak_rss_mb": TARGET_REPLAY_RSS_MB,
                        "meets_rss_target": cli.get("peak_rss_mb", float("inf")) < TARGET_REPLAY_RSS_MB,
                        "tokens": tokens, "policies": POLICIES, "trace_mb": path.stat().st_size / 1e6,
                        "what": "the CLI end to end: read, plan, time, summarise, JSON",
                        "in_process": {**rate_entry(parts["total"], steps, "layer_steps_per_s", ref_s),
                                       "what": "read_trace, compute times (pick_costs) and prediction_recall, "
                                               "build_plan, time_plan (workload and fast path), summaries: the calls "
                                               "simulate_policies makes",
                                       "parts": {k: rate_entry(v, steps, "layer_steps_per_s", ref_s)
                                                 for k, v in parts.items() if k != "total"}}}
    show(f"replay {len(POLICIES)} policies x {tokens} tokens, CLI (peak RSS target < {TARGET_REPLAY_RSS_MB:g} MB: "
         f"{'met' if report['replay']['meets_rss_target'] else 'NOT met'})", report["replay"])
    show("  in process", report["replay"]["in_process"])
    for k, v in report["replay"]["in_process"]["parts"].items():
        show(f"    {k}", v)
    long_summary(report, ref_s)
    return trace


def long_summary(report: dict[str, Any], ref_s: float) -> None:
    """The long-trace commands against issue 40's targets, in one block with the machine."""
    m = report["machine"]
    print(f"\nlong traces on {m['cpu']}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']}, numba "
          f"{m['numba']}; reference loop {ref_s:.3f} s; load average {load_average()} now, "
          f"{report['load_average_start']} at the start", flush=True)
    rows = [(f"synth {name} (CLI)", e["cli"]) for name, e in report["synth"].items()]
    rows += [("stats (CLI)", report["stats"]), ("replay, 4 policies (CLI)", report["replay"])]
    for name, e in rows:
        r = e["ratio_to_reference"]
        goal = (f"target <= {e['target_loops']:g} loops: {'met' if e['meets_target'] else 'NOT met'}"
                if e.get("target_loops") is not None else "no target")
        rss = f", peak RSS {e['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in e else ""
        print(f"  {name}: {e['min_s']:.2f} / {e['median_s']:.2f} / {e['max_s']:.2f} s, {r['min']:.1f} / "
              f"{r['median']:.1f} / {r['max']:.1f} loops (min / median / max); {goal}{rss}", flush=True)


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


def target_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per timed target of the run in ``report`` (issue 25's and issue 11's): what
    was timed, how, its min / median / max, the target, whether the median meets it, the
    peak RSS where measured and the median in reference-loop units."""
    rows = []

    def add(name: str, how: str, e: dict[str, Any], rss_target: float | None = None) -> None:
        row = {"name": name, "how": how, "min_s": e["min_s"], "median_s": e["median_s"], "max_s": e["max_s"],
               "target_s": e.get("target_s"), "meets_target": e.get("meets_target"),
               "ratio_to_reference": e["ratio_to_reference"]["median"]}
        if e.get("target_loops") is not None:
            row["target_loops"] = e["target_loops"]
        if "peak_rss_mb" in e:
            row["peak_rss_mb"] = e["peak_rss_mb"]
            if rss_target is not None:
                row["target_peak_rss_mb"] = rss_target
                row["meets_target"] = bool(row["meets_target"]) and e["peak_rss_mb"] < rss_target
        rows.append(row)

    for model, e in report.get("synth", {}).items():
        add(f"synth {model}, {e['tokens']:,} tokens", "write_synthetic_trace in process", e)
        add(f"synth {model}, {e['tokens']:,} tokens", f"CLI: {e['cli']['command']}", e["cli"])
    if "stats" in report:
        add(f"stats, {report['stats']['tokens']:,} tokens", f"CLI: {report['stats'].get('command', 'moesim stats')}",
            report["stats"])
    if "replay" in report:
        e = report["replay"]
        add(f"replay, {e['tokens']:,} tokens x {len(e['policies'])} policies",
            f"CLI: {e['command']}" if "command" in e else "simulate_policies in process", e,
            e.get("target_peak_rss_mb"))
    for key, e in report.get("planning", {}).items():
        evict = e.get("eviction", key.rsplit("_", 1)[-1]).upper()
        cache = f"{evict} cache of {e['cache_experts']}" if e.get("cache_experts") else "no cache"
        add(f"planning, {e.get('tokens', '?'):,} tokens x {len(e.get('policies', POLICIES))} policies, {cache}",
            "build_plan in process", e)
    if "sweep_1000" in report:
        e = report["sweep_1000"]
        add(f"what-if, {e['configurations']:,} configurations over {e['tokens']:,} tokens",
            f"run_sweep in process, {report.get('jobs', '?')} workers, plans included", e)
    if "sweep_large" in report:
        e = report["sweep_large"]
        rows.append({"name": f"what-if, {e['configurations']:,} configurations", "how": "run_sweep, once",
                     "min_s": e["seconds"], "median_s": e["seconds"], "max_s": e["seconds"],
                     "target_s": e["target_s"], "meets_target": e["meets_target"],
                     "ratio_to_reference": e["ratio_to_reference"]})
    for kind, e in report.get("start", {}).items():
        target = TARGET_COLD_START_S if kind == "cold" else None
        rows.append({"name": f"first answer, {kind}", "how": f"CLI in a fresh process: {e['command']}",
                     "min_s": e["min_s"], "median_s": e["median_s"], "max_s": e["max_s"], "target_s": target,
                     "meets_target": None if target is None else e["median_s"] < target,
                     "ratio_to_reference": e["ratio_to_reference"]})
    return rows


def readme_table(report: dict[str, Any]) -> str:
    """The README's speed table (markdown) from a run's JSON: every target with its min /
    median / max, target, peak RSS and reference-loop ratio, and the machine and load the
    run had, so a number is never quoted without them."""
    m = report["machine"]
    ref = report["reference_loop"]["min_s"]
    load0, load1 = report.get("load_average_start", []), report.get("load_average_end", [])
    busy = report.get("others_cores_busy")
    idle = busy is not None and busy < 0.1
    lines = [
        f"Measured by `{report.get('command', 'python bench/bench_sim.py')}`"
        + (f" at {report['git_commit'][:7]}" if report.get("git_commit") else "")
        + (f" on {report['date_utc'][:10]}" if report.get("date_utc") else "")
        + f": {m['cpu']}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']}, numba {m['numba']}; "
        + (f"load average {load0[0]:g} at the start and {load1[0] if load1 else '?'} at the end" if load0
           else "load average not recorded")
        + (f", other processes kept {busy:.2f} cores busy on average ({'idle' if idle else 'NOT idle'})"
           if busy is not None else "")
        + f"; the reference loop (2M pure-Python multiply-adds) took {ref:.3f} s. "
        f"{report.get('repeat', '?')} repeats after a warm-up; synthetic traces.",
        "",
        "| what | how | min / median / max (s) | target | meets | peak RSS | median / reference loop |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in target_rows(report):
        target = (f"<= {r['target_loops']:g} loops ({r['target_s']:.2f} s here)" if r.get("target_loops") is not None
                  else f"< {r['target_s']:g} s" if r.get("target_s") is not None else "")
        if r.get("target_peak_rss_mb") is not None:
            target += f", < {r['target_peak_rss_mb'] / 1000:g} GB"
        meets = {True: "yes", False: "**no**", None: ""}[r.get("meets_target")]
        rss = f"{r['peak_rss_mb'] / 1000:.2f} GB" if "peak_rss_mb" in r else ""
        lines.append(f"| {r['name']} | {r['how']} | {r['min_s']:.2f} / {r['median_s']:.2f} / {r['max_s']:.2f} | "
                     f"{target} | {meets} | {rss} | {r['ratio_to_reference']:.1f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], series: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moesim.reports.render import save_figure

    mach = report["machine"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1, 1.8]})
    n, s = zip(*series["by_configurations"])
    a1.plot(n, s, "o-")
    a1.set_xlabel("configurations")
    a1.set_ylabel("what-if sweep wall time, s")
    tok, _, s2 = zip(*series["by_tokens"])
    a2.plot(tok, s2, "o-")
    a2.set_xlabel(f"trace tokens ({series['by_tokens'][0][1]} configurations)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    cases = []
    for name, e in report["synth"].items():
        short = name.split("-")[1] if name.count("-") else name
        cases += [(f"synth\n{short}\nin process", e), (f"synth\n{short}\nCLI", e["cli"])]
    cases += [("stats\n\nCLI", report["stats"]), ("replay\n4 policies\nCLI", report["replay"])]
    labels = [c for c, _ in cases]
    med = np.array([e["median_s"] for _, e in cases])
    err = np.array([[e["median_s"] - e["min_s"] for _, e in cases], [e["max_s"] - e["median_s"] for _, e in cases]])
    x = np.arange(len(cases))
    a3.bar(x, med, yerr=err, capsize=3, color="tab:blue", alpha=0.8, label="median (min-max)")
    a3.scatter(x, [e.get("target_s", np.nan) for _, e in cases], marker="_", s=600, color="tab:red", zorder=3,
               label="target (loops x this run's reference loop)")
    a3.set_xticks(x, labels, fontsize=7)
    a3.set_ylabel("seconds")
    a3.set_title(f"{report['synth'][MODEL]['tokens']:,}-token traces (synth: generate + write; CLI: the "
                 "command, Python start-up included)", fontsize=8)
    a3.legend(fontsize=7)
    a3.grid(alpha=0.3, axis="y")
    busy = report.get("others_cores_busy")
    fig.suptitle(f"synthetic traces; {mach['cpu']}, {mach['cores']} cores; load average "
                 f"{report['load_average_start'][:1]} at start"
                 + (f", other processes {busy:.2f} cores busy on average" if busy is not None else ""), fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
