"""The report of ``moesim stats TRACE --out DIR``: routing statistics as JSON, PNG and one HTML page.

Figures: per-layer expert popularity (sorted, against uniform), the reuse-distance
histogram, predictor recall per layer, the cache hit-rate curves (LRU, LFU, Belady) with
the device memory each size needs, and, with a hardware profile, simulated TPOT against
cache size with the knee marked.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import atomic_write_text
from moesim.fmt import plural
from moesim.hardware import get_profile
from moesim.outputs import check_output_dir
from moesim.reports.render import COLORS, pyplot, save_figure, write_html
from moesim.sim.stats import routing_stats
from moesim.traces.format import read_trace


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def popularity_png(stats: dict[str, Any], path: Path, title: str) -> Path:
    counts = np.asarray(stats["popularity"]["counts"], float)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    e = counts.shape[1]
    for j, row in enumerate(counts):
        share = np.sort(row)[::-1] / max(row.sum(), 1)
        ax.plot(np.arange(1, e + 1), share, lw=1, alpha=0.7, label=f"layer {stats['moe_layers'][j]}" if j < 8 else None)
    ax.axhline(1 / e, color="black", ls="--", lw=1, label="uniform")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("expert rank (most used first)")
    ax.set_ylabel("share of the layer's activations")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def reuse_png(stats: dict[str, Any], path: Path, title: str) -> Path:
    hist = np.asarray(stats["reuse"]["distance_hist"], float)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    x = np.arange(1, hist.size + 1)
    ax.bar(x, hist / max(hist.sum(), 1), color=COLORS["compute"])
    ax.set_xlabel(f"reuse distance in steps (last bar: > {hist.size - 1})")
    ax.set_ylabel("share of reuses")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def recall_png(stats: dict[str, Any], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for name, rec in stats["predictor_recall"].items():
        ax.plot(stats["moe_layers"], [np.nan if v is None else v for v in rec], marker="o", ms=3, label=name)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("layer")
    ax.set_ylabel("recall@k")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def hit_rate_png(stats: dict[str, Any], path: Path, title: str) -> Path:
    c = stats["hit_rate"]
    gib = [b / 2**30 for b in c["bytes"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, style in (("belady", "-"), ("lru", "--"), ("lfu", ":")):
        ax.plot(c["sizes"], c[name], style, marker="o", ms=3, label={"belady": "Belady (offline optimum)"}.get(name, name.upper()))
    ax.set_xlabel("cache size (experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    top = ax.secondary_xaxis("top", functions=(lambda s: s * (gib[-1] / max(c["sizes"][-1], 1)),
                                               lambda g: g / max(gib[-1] / max(c["sizes"][-1], 1), 1e-30)))
    top.set_xlabel("device memory (GiB)", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def tpot_png(stats: dict[str, Any], path: Path, title: str) -> Path:
    t = stats["tpot"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(t["sizes"], t["tpot_ms"], marker="o", ms=3, color=COLORS["compute"])
    ax.axvline(t["knee_experts"], color=COLORS["stall"], ls="--", lw=1, label=f"knee: {t['knee_experts']} experts")
    ax.set_xlabel("cache size (experts)")
    ax.set_ylabel("ms per output token (simulated)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def write_stats_report(stats: dict[str, Any], out: Path, trace_name: str) -> Path:
    """Write stats.json, the figures and report.html into ``out``; returns the HTML path."""
    out = Path(out)
    kind = "synthetic" if stats["synthetic"] else "recorded"
    what = (f"{kind} trace {trace_name} of {stats['model']} ({plural(stats['tokens'], 'step')}, batch {stats['batch']}; "
            f"{stats['source']})")
    atomic_write_text(out / "stats.json", json.dumps(_nan_to_none(stats), indent=1))
    pop = stats["popularity"]
    rows = [{"layer": layer, "norm_entropy": pop["norm_entropy"][j], "top10_share": pop["top10_share"][j],
             "gini": pop["gini"][j], "reuse_prev_token": stats["reuse"]["reuse_prev_token"][j],
             **{f"recall_{n}": (r[j] if r[j] == r[j] else "-") for n, r in stats["predictor_recall"].items()}}
            for j, layer in enumerate(stats["moe_layers"])]
    ov = stats["adjacent_layer_overlap"]
    c = stats["hit_rate"]
    curve_rows = [{"experts": s, "GiB": b / 2**30, "lru": lru, "lfu": lfu, "belady": bel}
                  for s, b, lru, lfu, bel in zip(c["sizes"], c["bytes"], c["lru"], c["lfu"], c["belady"], strict=True)]
    sections = [
        {"heading": "Per layer", "text": "Skew against uniform routing (normalised entropy 1, top-10% share 0.1 and "
         "Gini 0 are uniform); share of a token's experts the previous token also used; predictor recall@k.",
         "rows": rows, "cols": list(rows[0])},
        {"heading": "Expert popularity", "image": popularity_png(stats, out / "popularity.png", "expert popularity"),
         "caption": f"Share of each layer's activations by expert rank, against uniform; {what}."},
        {"heading": "Reuse distance", "image": reuse_png(stats, out / "reuse.png", "reuse distance"),
         "caption": f"Steps since the same sequence last used the expert at that layer (median "
                    f"{stats['reuse']['median_distance']}); {what}.",
         "text": f"Adjacent-layer id overlap: {ov['mean']:.3g} shared experts per token against {ov['chance']:.3g} "
                 "for two random top-k sets (ids of different layers are different experts; above chance only "
                 "means aligned ids)."},
        {"heading": "Cache hit rate against cache size", "rows": curve_rows, "cols": list(curve_rows[0]),
         "image": hit_rate_png(stats, out / "hit_rate.png", "hit rate against cache size"),
         "caption": f"LRU and LFU are the simulator's cache; Belady's offline optimum is the ceiling; {what}."},
    ]
    if stats["predictor_recall"]:
        sections.insert(3, {"heading": "Predictor recall", "image": recall_png(stats, out / "recall.png",
                                                                               "predictor recall@k per layer"),
                            "caption": f"Share of the true experts each predictor named before the router ran; {what}."})
    if "tpot" in stats:
        t = stats["tpot"]
        sections.append({"heading": "How many experts on the GPU?",
                         "image": tpot_png(stats, out / "tpot.png", f"TPOT against cache size on {t['hw']}"),
                         "caption": f"Simulated ({t['policy']}, {t['eviction'].upper()} cache, fast engine, profile "
                                    f"roofline) on {t['hw']} from the {what}.",
                         "text": f"Knee: {t['knee_experts']} experts ({t['knee_tpot_ms']:.3g} ms against the best "
                                 f"{t['best_tpot_ms']:.3g} ms); rule: {t['knee_rule']}."})
    return write_html(out / "report.html", f"moesim stats: {stats['model']}", what + ".", sections)


def stats_report(trace_path: str | Path, out: str | Path | None = None, hw: str | None = None,
                 sizes: list[int] | None = None, policy: str = "on-demand") -> dict[str, Any]:
    """``moesim stats``: read a trace, compute :func:`moesim.sim.stats.routing_stats`
    (TPOT against cache size when ``hw`` names a profile), write the report to ``out``."""
    if out is not None:
        check_output_dir(out)
    trace = read_trace(trace_path)
    profile = get_profile(hw) if hw else None
    if profile is None:  # the statistics read the routing ids alone: let the gates go before the passes run
        empty = np.zeros((0,) + trace.true_ids.shape[1:], np.float32)
        trace = replace(trace, true_gates=empty, pred_gates=empty, exec_ids=empty.astype(np.int16))
    stats = routing_stats(trace, profile, sizes, policy)
    if out is not None:
        write_stats_report(stats, Path(out), Path(trace_path).name)
    return stats
