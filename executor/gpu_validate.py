"""The one script to run when a GPU machine is lent: every policy on the synthetic
Qwen3-30B-A3B geometry (all 48 layers, experts in pinned host memory), traces and a summary.

    python -m moesim.executor.gpu_validate --out reports/gpu-validation     # on a CUDA machine
    python -m moesim.executor.gpu_validate --smoke --out /tmp/gv           # tiny model, CPU: checks the script

Weights are seeded random (synthetic), so hit rates mean nothing here; what this measures
is the link, the copy/compute overlap and the executor's overhead on real hardware, and
each trace replays in the simulator for cross-validation. Budget: under 8 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moesim.atomic import atomic_write_text
from moesim.executor.model import ExecConfig, MoEModel, random_model
from moesim.executor.profile import Origin, ProfileSettings, build_trace, calibrate, generate
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.setting import Setting
from moesim.sim.simulate import simulate
from moesim.traces.format import write_trace

RUNS = [  # (policy, predictor, cache GiB)
    ("all-resident", "quasi", 0), ("on-demand", "quasi", 0), ("prefetch-fom", "quasi", 0),
    ("prefetch-fom", "stale", 0), ("prefetch-spec", "quasi", 0), ("oracle", "quasi", 0),
    ("on-demand", "quasi", 8), ("prefetch-fom", "quasi", 8),
]


def build_model(smoke: bool, device: torch.device) -> MoEModel:
    """Synthetic model; on CUDA experts are generated on the GPU and copied to pinned memory
    (random init of 58 GB on the CPU would take minutes)."""
    if smoke:
        return random_model(ExecConfig(get_model("tiny"), rope_theta=1e6), seed=0).to(device)
    spec = get_model("qwen3-30b-a3b")
    cfg = ExecConfig(spec, rope_theta=1e6).with_dtype(torch.bfloat16)
    model = MoEModel(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    model = model.to(device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    n = spec.expert_weights
    model.experts = []
    for _ in range(spec.n_layers):
        block = torch.randn(spec.n_experts, n, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        host = torch.empty((spec.n_experts, n), dtype=torch.bfloat16).pin_memory()
        host.copy_(block)
        model.experts.append(list(host.unbind(0)))  # each row is one contiguous pinned buffer
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("reports/gpu-validation"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hw", default="h200", help="the profile of this machine (for the simulator's replay)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, not the GPU")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on the CPU")
    t0 = time.time()
    model = build_model(args.smoke, device)
    hw = get_profile(args.hw)
    if args.smoke:
        hw = hw.with_figure("h2d_pinned_gbs", 0.5)
    prompt = torch.randint(0, model.spec.vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    dv = calibrate(model, torch.randint(0, model.spec.vocab, (512,), generator=torch.Generator().manual_seed(1)))
    dv = dv.to(device, model.embed_tokens.weight.dtype)
    print(f"built {model.spec.name} on {device} in {time.time() - t0:.0f} s", flush=True)
    summary = []
    for policy, predictor, cache_gib in RUNS:
        cache = int(cache_gib * 2**30 // model.spec.expert_bytes)
        st = ProfileSettings(policy=policy, predictor=predictor, cache_experts=cache, tokens=args.tokens)
        prefill, records, out = generate(model, prompt, st, hw, dv)
        trace = build_trace(model, prompt, st, hw, prefill, records, out, Origin(str(device), True, "synthetic qwen3-30b-a3b"))
        name = f"{policy}-{predictor}-cache{cache_gib:g}"
        write_trace(trace, args.out / f"{name}.npz")
        measured = float(trace.timings["tpot_s"][1:].mean())
        predicted = float(simulate(trace, hw, policy, Setting(cache_experts=cache, sim="fast", timing="measured")).tpot[1:].mean())
        row = {"run": name, "tpot_ms": measured * 1e3, "sim_tpot_ms": predicted * 1e3,
               "error": predicted / measured - 1, "ttft_ms": prefill * 1e3, "copies_per_token": len(trace.timings["copy_bytes"]) / trace.n_tokens}
        summary.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the all-resident run held 58 GB of experts
    atomic_write_text(args.out / "summary.json", json.dumps({"device": str(device), "hw": hw.name, "runs": summary,
                                                            "wall_s": time.time() - t0}, indent=2))
    print(f"done in {time.time() - t0:.0f} s; traces and summary.json in {args.out}")


if __name__ == "__main__":
    main()
