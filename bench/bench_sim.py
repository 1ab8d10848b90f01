"""Simulator speed on this machine: layer-steps per second and a 1,000-configuration sweep.

Run: python bench/bench_sim.py [--tokens 1000] [--jobs 0]
Targets on 2 cores (issue 2): SimPy >= 150k layer-steps/s, fast path >= 3M layer-steps/s,
the sweep under 60 s. Prints rates and ratios, never asserts: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.sim.costs import roofline_costs
from moesim.sim.engine import run_simpy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import build_plan
from moesim.sim.whatif import Sweep, run_sweep
from moesim.sim.workload import Link, make_workload
from moesim.timing import best_time
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=0, help="sweep worker processes (0 = all cores)")
    args = ap.parse_args()
    spec, hw = get_model("qwen3-30b-a3b"), get_profile("a6000")
    trace = synthetic_trace(spec, SyntheticParams(tokens=args.tokens))
    steps = args.tokens * spec.n_layers
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"synthetic {spec.name} trace, {args.tokens} tokens x {spec.n_layers} layers = {steps} layer-steps")
    for policy in ("on-demand", "prefetch-fom"):
        plan_s = best_time(lambda p=policy: build_plan(trace, p), 1, warmup=False)
        plan = build_plan(trace, policy)
        work = make_workload(spec, plan, roofline_costs(spec, hw, args.tokens, trace.prompt_len))
        link = Link.from_profile(hw, spec)
        simpy_rate = steps / best_time(lambda w=work, k=link: run_simpy(w, k))
        fast_rate = steps / best_time(lambda w=work, k=link: run_fast(w, k))
        print(f"{policy:13s} SimPy {simpy_rate / 1e3:8.0f}k layer-steps/s (target 150k: {simpy_rate / 150e3:4.2f}x)   "
              f"fast path {fast_rate / 1e6:5.2f}M layer-steps/s (target 3M: {fast_rate / 3e6:4.2f}x)   "
              f"plan {plan_s:.2f} s")
    sweep = Sweep({spec.name: trace}, [get_profile(h) for h in ("a6000", "a100-pcie", "h100-pcie", "h200", "rtx4090")],
                  ["on-demand", "prefetch-fom", "prefetch-spec", "oracle"],
                  [8, 16, 24, 32, 48, 64, 96, 128, 256, 400], [0, 2, 4, 8, 16])
    t0 = time.perf_counter()
    rows = run_sweep(sweep, args.jobs or None)
    wall = time.perf_counter() - t0
    print(f"what-if: {len(rows)} configurations over the {args.tokens}-token trace in {wall:.1f} s "
          f"(target 60 s: {60 / wall:.2f}x headroom)")


if __name__ == "__main__":
    main()
