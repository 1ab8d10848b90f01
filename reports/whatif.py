"""The report of ``moesim whatif --out DIR``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from moesim.atomic import atomic_write_text
from moesim.fmt import duration_ms
from moesim.reports.render import breakdown_png, heatmap_png, write_csv, write_html
from moesim.sim.whatif import GOALS, Sweep

COLS = ["model", "hw", "policy", "link_gbps", "cache_gib", "fits", "tpot_ms", "tpot_p99_ms", "compute_ms", "copy_ms",
        "stall_ms", "gb_moved_per_token", "cache_hit_rate", "ttft_ms", "bound"]


PROMPT_LENGTHS = (128, 512, 2048, 8192, 32768)


def prompt_png(sweep: Sweep, winner: dict[str, Any], path: Path) -> Path:
    """TPOT and TTFT against prompt length for each policy, at the winner's settings."""
    import matplotlib.pyplot as plt

    from moesim.reports.render import save_figure
    from moesim.sim.simulate import simulate

    hw = next(h for h in sweep.hws if h.name == winner["hw"])
    base = sweep.traces[winner["model"]].head(min(32, sweep.traces[winner["model"]].n_tokens))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy in sweep.policies:
        tpot, ttft = [], []
        for p in PROMPT_LENGTHS:
            tr = replace(base, header={**base.header, "prompt_len": p})
            r = simulate(tr, hw, policy, cache_gib=winner["cache_gib"], link_gbps=winner["link_gbps"], engine="fast")
            tpot.append(r.tpot.mean() * 1e3)
            ttft.append(r.ttft * 1e3)
        a1.plot(PROMPT_LENGTHS, tpot, "o-", label=policy)
        a2.plot(PROMPT_LENGTHS, ttft, "o-", label=policy)
    for ax, what in ((a1, "TPOT, ms"), (a2, "TTFT, ms")):
        ax.set_xscale("log")
        ax.set_xlabel("prompt length, tokens")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle(f"{winner['model']} on {hw.name} (simulated)", fontsize=10)
    return save_figure(fig, path)


def write_whatif_report(rows: list[dict[str, Any]], winner: dict[str, Any] | None, goal: str, sweep: Sweep,
                        out: Path) -> Path:
    out = Path(out)
    key = GOALS[goal][0]
    synthetic = any(t.synthetic for t in sweep.traces.values())
    src = "synthetic traces" if synthetic else "recorded traces"
    what = (f"All figures simulated ({sweep.engine} engine) from {src} of {', '.join(sweep.traces)}; "
            f"hardware figures from the profiles ({', '.join(h.name for h in sweep.hws)}); nothing here was measured")
    write_csv(rows, out / "whatif.csv")
    atomic_write_text(out / "whatif.json", json.dumps({"goal": goal, "best": winner, "rows": rows}, indent=2))
    # Per (model, hw, policy): its best row, for the breakdown figure.
    bests: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = (r["model"], r["hw"], r["policy"])
        if k not in bests or r[key] < bests[k][key]:
            bests[k] = r
    shown = sorted(bests.values(), key=lambda r: (r["model"], r["hw"], r["policy"]))[:24]
    breakdown_png(shown, [f"{r['hw']}\n{r['policy']}" for r in shown], out / "breakdown.png",
                  "TPOT breakdown, best link/cache setting per hardware and policy (simulated)")
    sections = []
    if winner:
        sections.append({"heading": "Best configuration",
                         "text": f"For {GOALS[goal][1]}: {winner['model']} on {winner['hw']}, {winner['policy']}, "
                                 f"link {winner['link_gbps']:g} GB/s, cache {winner['cache_gib']:g} GiB: "
                                 f"{duration_ms(winner['tpot_ms'])} per token, {duration_ms(winner['ttft_ms'])} to first "
                                 "token."})
    sections.append({"heading": "TPOT breakdown", "image": out / "breakdown.png",
                     "caption": f"Compute plus stall equals TPOT. {what}."})
    offloaded = [r for r in rows if r["policy"] != "all-resident"]
    if offloaded and len({r["link_gbps"] for r in offloaded}) * len({r["cache_gib"] for r in offloaded}) > 1:
        heatmap_png(offloaded, out / "heatmap.png", f"{key} over link bandwidth x cache size (simulated)", key, winner)
        sections.append({"heading": "Link bandwidth x cache size", "image": out / "heatmap.png",
                         "caption": f"{key} per cell; a gold star marks the best configuration (oracle is a bound, never chosen). {what}."})
    if winner:
        prompt_png(sweep, winner, out / "prompt_length.png")
        sections.append({"heading": "TPOT and TTFT against prompt length", "image": out / "prompt_length.png",
                         "caption": f"Simulated for every policy on {winner['hw']} (link {winner['link_gbps']:g} GB/s, cache "
                                    f"{winner['cache_gib']:g} GiB): attention reads a KV cache that grows with the prompt; "
                                    f"prefill copies whole layers. {what}."})
    sections.append({"heading": "All configurations", "rows": sorted(rows, key=lambda r: (not r["fits"], r[key])),
                     "cols": COLS})
    return write_html(out / "report.html", "moesim what-if", what + ".", sections)
