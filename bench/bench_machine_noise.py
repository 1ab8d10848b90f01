"""Is this machine steady enough to validate on? The machine's own slowdowns, without moesim's link.

Run: python bench/bench_machine_noise.py [--runs 24]

Decodes the shipped learned model all-resident (no emulated link, no copies: nothing of
moesim's own that could slow it) ``--runs`` times back to back, 128 tokens each, and
times the validation suite's reference matmul (``moesim.executor.steady``) after each
run. Prints, per run, the seconds since the start, the mean ms a token and the probe's
time over its best; then the spread of both. On a steady machine both stay within a few
percent; a shared VM shows windows of seconds where both are 1.3-2x slower together,
which is what a validation run caught in one measures. Prints and never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sim import machine  # noqa: E402

from moesim.executor.loading import shipped_model  # noqa: E402
from moesim.executor.profile import ProfileSettings, generate  # noqa: E402
from moesim.executor.steady import SteadyMachine  # noqa: E402
from moesim.executor.validation import PROMPT, suite_models  # noqa: E402
from moesim.hardware import DEFAULT_PROFILE, get_profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=24)
    a = ap.parse_args()
    torch.set_num_threads(1)
    _, load, _, _ = suite_models(shipped_model())[0]
    model, dv, _ = load()
    prompt = torch.tensor([b % model.spec.vocab for b in PROMPT]).view(1, -1)
    hw = get_profile(DEFAULT_PROFILE)
    steady = SteadyMachine()
    print(f"machine: {machine()}")
    t0, tokens, probes = time.perf_counter(), [], []
    for _ in range(a.runs):
        _, records, _ = generate(model, prompt, ProfileSettings(policy="all-resident", tokens=128), hw, dv)
        ms = 1e3 * statistics.mean(r.tpot_s for r in records[1:])
        probe = steady.probe()
        tokens.append(ms)
        probes.append(probe)
        print(f"{time.perf_counter() - t0:6.1f} s  {ms:6.2f} ms a token  probe {probe / min(steady.probes):4.2f}x its best so far")
    best = min(tokens)
    print(f"ms a token: best {best:.2f}, median {statistics.median(tokens):.2f}, max {max(tokens):.2f} "
          f"({max(tokens) / best:.2f}x the best); probe: {steady.summary()}")


if __name__ == "__main__":
    main()
