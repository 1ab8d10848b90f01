"""Predictors compared on the learned-routing model (moe-stdlib), measured by the executor.

For each predictor (stale gate, quasi-hidden state, neural estimator, hybrid) and each
prefetching policy (fetch-on-miss: exact; speculative execution: lossy), decode with the
executor on the CPU emulated link and report per-layer recall@k, rank alignment, the
prediction's own time, TPOT, and for speculative execution the output fidelity (next-token
agreement and KL against exact execution over a fixed text). Writes a report with the
estimator's recall against training tokens.

Run: python bench/bench_predictors.py [--out reports/predictors] [--tokens 64] [--link-gbps 0.5]
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
from moesim.executor.estimator import RECORD_FILE, load_estimator  # noqa: E402
from moesim.executor.model import load_checkpoint  # noqa: E402
from moesim.executor.profile import (  # noqa: E402
    DEFAULT_PROMPT,
    Origin,
    ProfileSettings,
    build_trace,
    eval_text,
    fidelity,
    generate,
    load_default_vectors,
    shipped_model,
)
from moesim.hardware import get_profile  # noqa: E402
from moesim.reports.render import save_figure, write_html  # noqa: E402
from moesim.sim.validate import validate_trace  # noqa: E402
from moesim.traces.format import write_trace  # noqa: E402

PREDICTORS = ("stale", "quasi", "estimator", "hybrid")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("reports/predictors"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--link-gbps", type=float, default=0.5)
    ap.add_argument("--fidelity-tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = shipped_model()
    model, dv, est = load_checkpoint(path), load_default_vectors(path), load_estimator(path)
    if dv is None or est is None:
        raise SystemExit("run `moesim calibrate` and `moesim train-estimator` first")
    record = json.loads((path / RECORD_FILE).read_text())
    hw = get_profile("a6000").with_figure("h2d_pinned_gbs", args.link_gbps)
    prompt = torch.tensor(list(DEFAULT_PROMPT.encode())).view(1, -1)
    text = eval_text(256, args.fidelity_tokens + 1, 0)
    rows, recalls = [], {}
    for predictor in PREDICTORS:
        for policy in ("prefetch-fom", "prefetch-spec"):
            st = ProfileSettings(policy=policy, predictor=predictor, tokens=args.tokens)
            generate(model, prompt, ProfileSettings(policy=policy, predictor=predictor, tokens=2), hw, dv, estimator=est)
            prefill, recs, out = generate(model, prompt, st, hw, dv, estimator=est)
            extra = {"fidelity": fidelity(model, st, hw, dv, text, est)} if policy == "prefetch-spec" else {}
            tr = build_trace(model, prompt, st, hw, prefill, recs, out, Origin("cpu", False, str(path)), extra)
            write_trace(tr, args.out / "traces" / f"{policy}-{predictor}.npz")
            met = tr.meta.metrics
            val, _ = validate_trace(tr)
            rec = [x for x in met["recall_at_k"] if x == x]
            al = [x for x in met["rank_alignment"] if x == x]
            row = {"predictor": predictor, "policy": policy, "recall_at_k": float(np.mean(rec)),
                   "rank_alignment": float(np.mean(al)), "predict_us_per_layer": float(tr.timings["predict_s"][:, :-1].mean() * 1e6),
                   "tpot_ms": float(tr.timings["tpot_s"][1:].mean() * 1e3), "simulated_tpot_ms": val["predicted_ms"],
                   "sim_error": val["error"]}
            if extra:
                row.update({"agreement": extra["fidelity"]["next_token_agreement"], "mean_kl": extra["fidelity"]["mean_kl"]})
            rows.append(row)
            if policy == "prefetch-fom":
                recalls[predictor] = met["recall_at_k"]
            print(json.dumps(row), flush=True)
    atomic_write_text(args.out / "predictors.json", json.dumps({"rows": rows, "recall_by_layer": recalls,
                                                                "link_gbps": args.link_gbps, "tokens": args.tokens}, indent=2))
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for predictor, rec in recalls.items():
        ax.plot(range(len(rec)), rec, "o-", label=predictor)
    ax.set_xlabel("MoE layer (predicted)")
    ax.set_ylabel("recall@k")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("per-layer prediction recall, measured while decoding (moe-stdlib)", fontsize=9)
    save_figure(fig, args.out / "recall_by_layer.png")
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    curve = record["curve"]
    for layer in range(len(curve[0]["recall_at_k"])):
        ax.plot([c["training_tokens"] for c in curve], [c["recall_at_k"][layer] for c in curve], "o-",
                label=f"predicting layer {layer + 1}")
        ax.axhline(record["router_recall_at_k"][layer], ls=":", color=f"C{layer}")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("held-out recall@k")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title(f"estimator ({record['parameters']} parameters) vs router baseline (dotted)", fontsize=9)
    save_figure(fig, args.out / "estimator_curve.png")
    what = (f"measured by the executor on {hw.name}'s profile with the CPU emulated link at {args.link_gbps:g} GB/s, "
            f"{args.tokens} tokens per run, moe-stdlib (learned routing)")
    write_html(args.out / "report.html", "moesim predictors: stale, quasi-hidden, estimator, hybrid", what + ".", [
        {"heading": "Per predictor and policy", "rows": rows, "cols": list(rows[-1])},
        {"heading": "Recall by layer", "image": args.out / "recall_by_layer.png",
         "caption": f"recall@k of each predictor while decoding; {what}."},
        {"heading": "Hybrid choice", "text": "Per source layer (predicting the next), the hybrid predictor uses: "
                                             + ", ".join(f"layer {i}: {c}" for i, c in enumerate(record["hybrid"]))
                                             + " (chosen by held-out recall, stored in estimator.json)."},
        {"heading": "Estimator training", "image": args.out / "estimator_curve.png",
         "caption": f"held-out recall@k of the estimator against training tokens (solid) and of the router applied to the "
                    f"quasi-hidden state (dotted), from estimator.json; {record['train_seconds']} s of training on the CPU."},
    ])
    print(f"report: {args.out / 'report.html'}")


if __name__ == "__main__":
    main()
