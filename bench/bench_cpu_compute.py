"""Speed of the CPU-compute policies' step model on this machine: layer-steps per second of
the SimPy reference and the fast recurrence (sim/fastpath_cpu.py), per policy.

Run: python bench/bench_cpu_compute.py [--tokens 500]
Prints rates, never asserts: speed is measured, not tested. The trace is synthetic.
"""

from __future__ import annotations

import argparse
import os
import platform

from moesim.costmodel import CostModel
from moesim.hardware import get_host, get_profile
from moesim.models import get_model
from moesim.policy.placement import HostPlanner, make_placement
from moesim.sim.cpu_compute import build_work, expert_times
from moesim.sim.engine import run_simpy_cpu
from moesim.sim.fastpath_cpu import run_fast_cpu
from moesim.sim.workload import Link
from moesim.timing import best_time
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=500)
    args = ap.parse_args()
    spec, hw = get_model("qwen3-30b-a3b"), get_profile("rtx4090")
    host = get_host(None, hw)
    trace = synthetic_trace(spec, SyntheticParams(tokens=args.tokens))
    calib = synthetic_trace(spec, SyntheticParams(tokens=64, seed=1)).true_ids
    steps = args.tokens * spec.n_layers
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; synthetic "
          f"{spec.name} trace, {args.tokens} tokens x {spec.n_layers} layers = {steps} layer-steps; {hw.name} + {host.name}")
    link = Link.of(CostModel(spec, hw))
    work = build_work(trace, hw, expert_times(spec, hw, host))
    context = trace.prompt_len + trace.n_tokens
    for policy, cache in (("cpu-static", 0), ("hot-experts", 0), ("cpu-on-miss", 1024)):
        placement = make_placement(policy, spec, hw["device_memory_gb"] * 1e9, context=context, calibration=calib)

        def planner(p=policy, pl=placement, c=cache):
            return HostPlanner(p, spec, pl, c)

        simpy_s = best_time(lambda: run_simpy_cpu(work, planner(), link), 1, warmup=False)
        fast_s = best_time(lambda: run_fast_cpu(work, planner()), 3, warmup=False)
        print(f"{policy:12s} simpy {steps / simpy_s:12,.0f} layer-steps/s   fast {steps / fast_s:12,.0f} layer-steps/s"
              f"   ({simpy_s / fast_s:.1f}x)")


if __name__ == "__main__":
    main()
