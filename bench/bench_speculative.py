"""Speculative decoding on the learned-routing model: EcoSpec against confidence-only
selection and against no speculation, offloaded (CPU emulated link) and resident, over
several gamma and lambda; each measurement next to the simulator's replay of its trace.

Run: python bench/bench_speculative.py [--out reports/speculative] [--tokens 192] [--link-gbps 0.5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.executor.model import load_checkpoint  # noqa: E402
from moesim.executor.profile import DEFAULT_PROMPT, Origin, ProfileSettings, build_trace, generate, shipped_model  # noqa: E402
from moesim.executor.runtime import OffloadedDecoder, make_transport  # noqa: E402
from moesim.executor.speculative import SpecSettings, build_sd_trace, load_expert_predictor, speculative_generate  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.reports.render import save_figure, write_html  # noqa: E402
from moesim.sim.speculative import replay_sd  # noqa: E402
from moesim.sim.validate import recorded_profile, validate_trace  # noqa: E402
from moesim.traces.format import write_trace  # noqa: E402

CONFIGS = [("confidence", "ratio", 0.0), ("ecospec", "ratio", 0.0), ("ecospec", "lagrangian", 0.02),
           ("ecospec", "lagrangian", 0.1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("reports/speculative"))
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--link-gbps", type=float, default=0.5)
    ap.add_argument("--gammas", default="2,4,8")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tpath = shipped_model()
    dpath = tpath.parent / "moe-stdlib-draft"
    target, draft, predictor = load_checkpoint(tpath), load_checkpoint(dpath), load_expert_predictor(dpath)
    hw = get_profile("a6000").with_figure("h2d_pinned_gbs", args.link_gbps)
    prompt = torch.tensor(list(DEFAULT_PROMPT.encode())).view(1, -1)
    rows, scatter = [], []
    for policy in ("on-demand", "all-resident"):
        # No speculation: the baseline, measured and replayed the same way.
        st = ProfileSettings(policy=policy, predictor="stale", tokens=args.tokens)
        generate(target, prompt, ProfileSettings(policy=policy, predictor="stale", tokens=2), hw)
        pre, recs, out = generate(target, prompt, st, hw)
        base = build_trace(target, prompt, st, hw, pre, recs, out, Origin("cpu", False, str(tpath)))
        write_trace(base, args.out / "traces" / f"{policy}-no-speculation.npz")
        val, _ = validate_trace(base)
        base_ms = val["measured_ms"]
        rows.append({"policy": policy, "selection": "none", "gamma": 0, "score": "-", "lambda": 0.0,
                     "accepted_per_step": 1.0, "distinct_experts_per_step": float("nan"), "tpot_ms": base_ms,
                     "simulated_tpot_ms": val["predicted_ms"], "sim_error": val["error"], "speedup_vs_none": 1.0,
                     "speedup_vs_confidence": float("nan")})
        for gamma in [int(g) for g in args.gammas.split(",")]:
            conf_ms = None
            for strategy, score, lam in CONFIGS:
                spec = SpecSettings(gamma, 2, 4, strategy, score, lam, args.tokens)
                dec = OffloadedDecoder(target, policy, make_transport(torch.device("cpu"), hw.link_bw, hw.transfer_latency),
                                       predictor="stale")
                pre, recs, out = speculative_generate(dec, draft, predictor, prompt, spec)
                tr = build_sd_trace(target, prompt, recs, pre, hw, spec, policy, 0, Origin("cpu", False, str(tpath), str(dpath)))
                name = f"{policy}-g{gamma}-{strategy}-{score}-{lam:g}"
                write_trace(tr, args.out / "traces" / f"{name}.npz")
                r = replay_sd(tr, recorded_profile(tr))
                m = r["measured"]
                conf_ms = m["tpot_ms"] if strategy == "confidence" else conf_ms
                rows.append({"policy": policy, "selection": strategy, "gamma": gamma, "score": score, "lambda": lam,
                             "accepted_per_step": m["accepted_per_step"],
                             "distinct_experts_per_step": m["distinct_experts_per_step"], "tpot_ms": m["tpot_ms"],
                             "simulated_tpot_ms": r["simulated"]["tpot_ms"], "sim_error": r["error"],
                             "speedup_vs_none": base_ms / m["tpot_ms"], "speedup_vs_confidence": conf_ms / m["tpot_ms"],
                             "verify_ms_per_distinct_expert": m["verify_ms_per_distinct_expert"],
                             "verify_vs_experts_r2": m["verify_vs_experts_r2"]})
                steps = tr.timings
                from moesim.sim.speculative import recorded_steps

                scatter += [(policy, sum(len(u) for u in st_.true_union), v * 1e3)
                            for st_, v in zip(recorded_steps(tr), steps["sd_verify_s"], strict=True)]
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
    atomic_write_text(args.out / "speculative.json", json.dumps({"rows": rows, "link_gbps": args.link_gbps,
                                                                 "tokens": args.tokens}, indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, marker in (("on-demand", "o"), ("all-resident", "s")):
        pts = np.array([(d, v) for p, d, v in scatter if p == policy])
        ax.scatter(pts[:, 0], pts[:, 1], marker=marker, s=12, alpha=0.6, label=f"{policy} (measured)")
        k, b = np.polyfit(pts[:, 0], pts[:, 1], 1)
        xs = np.linspace(pts[:, 0].min(), pts[:, 0].max(), 10)
        ax.plot(xs, k * xs + b, lw=1, label=f"fit: {k:.3f} ms per expert + {b:.2f} ms")
    ax.set_xlabel("distinct experts in the step (summed over layers)")
    ax.set_ylabel("verification latency, ms")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title("verification cost grows with expert dispersion (moe-stdlib, CPU)", fontsize=9)
    save_figure(fig, args.out / "latency_vs_experts.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, policy in zip(axes, ("on-demand", "all-resident"), strict=True):
        for strategy, score, lam in CONFIGS:
            pts = [(r["gamma"], r["tpot_ms"]) for r in rows if r["policy"] == policy and r["selection"] == strategy
                   and r["score"] == score and r["lambda"] == lam]
            ax.plot(*zip(*pts, strict=True), "o-", label=f"{strategy} {score}{'' if score == 'ratio' else f' {lam:g}'}")
        none = next(r["tpot_ms"] for r in rows if r["policy"] == policy and r["selection"] == "none")
        ax.axhline(none, color="k", ls=":", label="no speculation")
        ax.set_title(f"{policy} (measured)", fontsize=9)
        ax.set_xlabel("gamma (candidates verified)")
        ax.set_ylabel("TPOT, ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, args.out / "tpot_vs_gamma.png")
    what = (f"measured by the executor on moe-stdlib (target) with moe-stdlib-draft, greedy, {args.tokens} tokens, "
            f"CPU; offloaded = on-demand over the emulated link at {args.link_gbps:g} GB/s; simulated = the SimPy fast "
            f"path replaying each trace")
    cols = ["policy", "selection", "gamma", "score", "lambda", "accepted_per_step", "distinct_experts_per_step", "tpot_ms",
            "simulated_tpot_ms", "sim_error", "speedup_vs_none", "speedup_vs_confidence"]
    write_html(args.out / "report.html", "moesim speculative decoding: EcoSpec vs confidence", what + ".", [
        {"heading": "Every run", "rows": rows, "cols": cols},
        {"heading": "TPOT against gamma", "image": args.out / "tpot_vs_gamma.png", "caption": what + "."},
        {"heading": "Verification latency and distinct experts", "image": args.out / "latency_vs_experts.png",
         "caption": "Each point is one verification step (all runs above), measured; the line is a least-squares fit."},
    ])
    print(f"report: {args.out / 'report.html'}")


if __name__ == "__main__":
    main()
