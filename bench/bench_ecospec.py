"""EcoSpec at scale: the synthetic speculative what-if for Qwen3-235B-A22B, gpt-oss-120b and
DeepSeek-V3.1 (the three models of the EcoSpec paper), resident on 8 H200 (TP and EP) and
offloaded on one, over gamma, score and lambda, with a sensitivity table over tree shape
and acceptance. Simulated on synthetic trees: deterministic for a seed, no timing of this
machine enters it.

Run: python bench/bench_ecospec.py [--out reports/ecospec] [--steps 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from moesim.reports.ecospec import DEPLOYMENTS, GAMMAS, MODELS, ecospec_report
from moesim.sim.ecospec import Selection
from moesim.traces.synthetic_speculative import SpecSynthParams

SELECTIONS = (Selection("confidence"), Selection("ecospec", "ratio"), Selection("ecospec", "lagrangian", 0.5),
              Selection("ecospec", "lagrangian", 2.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("reports/ecospec"))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--variant-steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    params = SpecSynthParams(steps=args.steps, seed=args.seed)
    small = replace(params, steps=args.variant_steps)
    variants = (
        replace(small, branch=3, depth=3),
        replace(small, branch=4, depth=2),
        replace(small, branch=2, depth=6, accept=(0.75, 0.65, 0.6, 0.55, 0.5, 0.45)),
        replace(small, accept=(0.9, 0.85, 0.8, 0.75)),  # a well-aligned draft
        replace(small, accept=(0.5, 0.4, 0.35, 0.3)),  # a poorly aligned draft
        replace(small, overlap_concentration=0.5),  # candidates differ more in their experts
    )
    t0 = time.time()
    res = ecospec_report(args.out, MODELS, DEPLOYMENTS, GAMMAS, params, SELECTIONS, variants=variants)
    for f in res["latency_fits"]:
        print(f"{f['model']:>16} {f['deployment']:>15}: {f['slope_ms_per_expert'] * 1e3:8.3f} us/expert fitted, "
              f"{f['analytic_ms_per_expert'] * 1e3:8.3f} us analytic, r2 {f['r2']:.4f}")
    print(f"report: {res['report']} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
