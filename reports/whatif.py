"""The report of ``moesim whatif --out DIR``."""

from __future__ import annotations

import html
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from moesim import fmt
from moesim.atomic import atomic_write_text
from moesim.fmt import duration_ms
from moesim.reports.render import breakdown_png, heatmap_png, pyplot, save_figure, write_csv, write_html
from moesim.setting import Setting
from moesim.sim.answer import AXES, Timed, crossovers, deployment_answer, describe_change, format_answer
from moesim.sim.intervals import NOMINAL, range_text
from moesim.sim.pool import start_aside
from moesim.sim.simulate import PerTrace, simulate
from moesim.sim.sweep import BOUND, GOALS, Sweep

COLS = ["model", "hw", "host", "policy", "family", "expert_dtype", "batch", "prompt_len", "link_gbps", "cache_gib",
        "cpu_layers", "resident_experts", "copy_queue", "prefetch_top", "fits", "tpot_ms", "tpot_ms_low", "tpot_ms_high",
        "tpot_p99_ms", "compute_ms",
        "copy_ms", "stall_ms", "cpu_ms", "gb_moved_per_token", "cache_hit_rate", "ttft_ms", "bound", "note"]
FAMILY_STYLE = {"prefetching": ("#DD8452", "o-"), "cpu-static": ("#66A61E", "s-"), "hot-experts": ("#7570B3", "^-"),
                "cpu-on-miss": ("#E7298A", "D-"), "all-resident": ("#4C72B0", "v-"), "oracle (bound)": ("#999999", "x--")}
METRIC = {"tpot_ms": "best TPOT, ms", "ttft_ms": "best TTFT, ms"}


PROMPT_LENGTHS = (128, 512, 2048, 8192, 32768)


def _range_words(row: dict) -> str:
    """The winner's range, as the terminal says it (moesim.sim.intervals)."""
    if row.get("tpot_ms_low") is None:
        return ""
    return (f" Measurements of such deployments fall within {range_text(row, 'tpot_ms')} ms per token "
            f"({NOMINAL:.0%} range; {row['range_basis']}).")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def prompt_png(sweep: Sweep, winner: dict[str, Any], path: Path) -> Path:
    """TPOT and TTFT against prompt length for each copy policy, at the winner's hardware,
    link and cache (a quick look when the sweep itself has one prompt length)."""
    plt = pyplot()


    hw = next(h for h in sweep.hws if h.name == winner["hw"])
    trace = next(t for t in sweep.traces.values() if t.model.name == winner["base_model"])
    base = trace.head(min(32, trace.n_tokens))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    shared = PerTrace()  # the winner's machine priced once (one cost model) for every policy and prompt length
    gpu = hw.gpus[0].with_figure("h2d_pinned_gbs", winner["link_gbps"])  # at the winner's link, made once
    for policy in [p for p in sweep.policies if not sweep.resolved[p].uses_host]:
        tpot, ttft = [], []
        for p in PROMPT_LENGTHS:
            tr = replace(base, header={**base.header, "prompt_len": p})
            r = simulate(tr, gpu, sweep.resolved[policy], Setting(cache_gib=winner["cache_gib"], sim="fast",
                                                                   engine=sweep.engine_profile,
                                                                   cache_per_layer=sweep.cache_per_layer), shared=shared)
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
    fig.suptitle(f"{winner['base_model']} on {hw.name} (simulated)", fontsize=10)
    return save_figure(fig, path)


def crossover_png(crosses: list, path: Path) -> Path:
    """One panel per (model, GPU, host, axis, metric): each family's best value against the
    axis with its 80% range shaded (TPOT), the oracle dashed as the bound, and a red line where
    the winning family changes."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter  # matplotlib is imported on first use (pyplot)


    ncol = min(3, len(crosses))
    nrow = -(-len(crosses) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.3 * nrow), squeeze=False, layout="constrained")
    for ax in axes.flat[len(crosses):]:
        ax.set_visible(False)
    for ax, c in zip(axes.flat, crosses):
        for fam, ys in c.curves.items():
            color, style = FAMILY_STYLE.get(fam, ("black", "o-"))
            pts = [(x, y) for x, y in zip(c.xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=fam, markersize=4, linewidth=1.2)
            band = [(x, b) for x, b in zip(c.xs, c.bands.get(fam, ())) if b is not None]
            if len(band) > 1 and fam != BOUND:  # the 80% range of measurements like it (a bound has none)
                ax.fill_between([x for x, _ in band], [b[0] for _, b in band], [b[1] for _, b in band], color=color,
                                alpha=0.12, linewidth=0)
        for ch in c.changes:
            at = ch["near"] if ch["near"] is not None else (ch["after"] * ch["by"]) ** 0.5
            ax.axvline(at, color="red", linestyle=":", linewidth=1)
            ax.annotate(f"{ch['from']} -> {ch['to']}", (at, 0.97), xycoords=("data", "axes fraction"), fontsize=6,
                        color="red", rotation=90, ha="right", va="top")
        if min(c.xs) > 0 and max(c.xs) / min(c.xs) >= 8:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(c.xs, [f"{x:g}" for x in c.xs])  # the swept values, not log-scale minor labels
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(AXES[c.axis], fontsize=8)
        ax.set_ylabel(METRIC.get(c.metric, c.metric), fontsize=8)
        host = "" if c.host == "-" else f" + {c.host}"
        ax.set_title(f"{c.model} on {c.hw}{host}\n{'TTFT' if c.metric == 'ttft_ms' else 'TPOT'} against "
                     f"{AXES[c.axis].split(',')[0]}", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.tick_params(labelsize=7)
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=len(handles), fontsize=7)
    fig.suptitle("Best configuration of each family along each swept axis (simulated; red: the winner changes)",
                 fontsize=9)
    return save_figure(fig, path)


def _best_per(rows: list[dict[str, Any]], key: str, by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per value of ``by``, the row with the best ``key``: a fitting one if any fits."""
    bests: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if not _number(r[key]):
            continue
        k = tuple(r[b] for b in by)
        if k not in bests or (not r["fits"], r[key]) < (not bests[k]["fits"], bests[k][key]):
            bests[k] = r
    return list(bests.values())


#: Bars the breakdown figure draws at most (the caption names what it leaves out).
MAX_BARS = 24


#: The report's figures that only some sweeps draw (several values of an axis; copy policies
#: on one GPU), removed from a folder reused for a sweep that draws none.
OPTIONAL_FIGURES = ("crossovers.png", "prompt_length.png")


def write_whatif_report(rows: list[dict[str, Any]], winner: dict[str, Any] | None, goal: str, sweep: Sweep,
                        out: Path, notes: list[str] | None = None) -> Path:
    out = Path(out)
    for name in OPTIONAL_FIGURES:  # drawn only for some sweeps: an earlier run's must not sit beside this report
        (out / name).unlink(missing_ok=True)
    key = GOALS[goal][0]
    synthetic = any(t.synthetic for t in sweep.traces.values())
    src = "synthetic traces" if synthetic else "recorded traces"
    models = sorted({t.model.name for t in sweep.traces.values()})
    what = (f"All figures simulated ({sweep.engine_profile.label} engine) from {src} of {', '.join(models)}; "
            f"hardware figures from the profiles ({', '.join(h.name for h in sweep.hws)}); nothing here was measured")
    answers = deployment_answer(rows, goal, engine=sweep.engine and sweep.engine_profile.name, timed=Timed.of(sweep))
    crosses = crossovers(rows)
    write_csv(rows, out / "whatif.csv")
    atomic_write_text(out / "whatif.json", json.dumps({"goal": goal, "best": winner, "notes": notes or [],
                                                       "deployment": [a.to_dict() for a in answers],
                                                       "crossovers": [c.__dict__ for c in crosses], "rows": rows},
                                                      indent=2, default=str))
    # Per (model, hw, policy): its best row, for the breakdown figure.
    timed = sorted(_best_per(rows, key, ("model", "hw", "policy")), key=lambda r: (r["model"], r["hw"], r["policy"]))
    shown = timed[:MAX_BARS]
    drawn = {(r["model"], r["hw"], r["policy"]) for r in timed}
    untimed = sorted({f"{r['policy']} on {r['hw']}" for r in rows if (r["model"], r["hw"], r["policy"]) not in drawn})
    left_out = ([f"the first {MAX_BARS} of {len(timed)} shown"] if len(timed) > MAX_BARS else []) + (
        [f"not drawn, as they did not run on the machine: {', '.join(untimed)}"] if untimed else [])
    if shown:
        breakdown_png(shown, [f"{r['hw']}\n{r['policy']}" for r in shown], out / "breakdown.png",
                      "TPOT breakdown, best setting per hardware and policy (simulated)")
    sections = []
    for a in answers:
        sections.append({"heading": f"Deployment answer: {a.model} on {a.hw}"
                                    f"{'' if a.host == '-' else ' + ' + a.host}",
                         "text": "<pre>" + html.escape(format_answer(a, 100)) + "</pre>"})
    if notes:
        sections.append({"heading": "Notes", "text": "<br>".join(html.escape(n) for n in notes)})
    if crosses:
        crossover_png(crosses, out / "crossovers.png")
        changes = [describe_change(c, ch) for c in crosses for ch in c.changes]
        listing = ("<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in changes) + "</ul>") if changes else \
            "<p>The winning family is the same at every swept point.</p>"
        sections.append({"heading": "Where the winner changes", "text": "Crossover points (the winning family at "
                         "consecutive swept values; the crossing itself interpolated between them):" + listing,
                         "image": out / "crossovers.png",
                         "caption": f"Best of each family at each swept value, the other axes at their first value; "
                                    f"the oracle (dashed) is a bound, never a winner. {what}."})
    else:
        sections.append({"heading": "Where the winner changes",
                         "text": "One batch size, prompt length and link bandwidth were swept, so there is no crossover "
                                 "to show: sweep e.g. <code>--batch 1,4,16 --prompt-len 128,2048 --link-gbps 8,32</code>."})
    if winner:
        sections.insert(0, {"heading": "Best configuration",
                            "text": f"For {GOALS[goal][1]}: {winner['model']} on {winner['hw']}, {winner['policy']}, "
                                    f"{fmt.link(winner['link_gbps'])}, cache {winner['cache_gib']:g} GiB: "
                                    f"{duration_ms(winner['tpot_ms'])} per token, {duration_ms(winner['ttft_ms'])} to "
                                    "first token." + _range_words(winner)})
    if shown:
        sections.append({"heading": "TPOT breakdown", "image": out / "breakdown.png",
                         "caption": "Each bar is the row's TPOT split into GPU compute, the wait on the CPU, the "
                                    "stall waiting for copies and activations between devices; a hatched bar does "
                                    f"not fit in memory{'; ' + '; '.join(left_out) if left_out else ''}. {what}."})
    copies = _best_per([r for r in rows if r["family"] in ("prefetching", "oracle (bound)")], key,
                       ("hw", "policy", "cache_gib", "link_gbps"))
    drawing = None  # the heatmap, drawn in another process
    if copies and len({r["link_gbps"] for r in copies}) * len({r["cache_gib"] for r in copies}) > 1:
        def draw_heatmap() -> None:
            heatmap_png(copies, out / "heatmap.png", f"{key} over link bandwidth x cache size (simulated)", key, winner)

        # The costliest figure (~1.2 s) drawn on the other core while this one draws the rest; each
        # figure is its own file, so drawing two at once changes no byte of either.
        drawing = start_aside(draw_heatmap)
        if drawing is None:
            draw_heatmap()
        sections.append({"heading": "Link bandwidth x cache size", "image": out / "heatmap.png",
                         "caption": f"{key} per cell, the best of the other settings; a gold star marks the best "
                                    f"configuration (oracle is a bound, never chosen). {what}."})
    copy_policies = [p for p in sweep.policies if not sweep.resolved[p].uses_host]
    one_gpu = winner and next(h for h in sweep.hws if h.name == winner["hw"]).n_gpus == 1  # copies go to one GPU
    if one_gpu and copy_policies and len({r["prompt_len"] for r in rows}) == 1:
        prompt_png(sweep, winner, out / "prompt_length.png")
        sections.append({"heading": "TPOT and TTFT against prompt length", "image": out / "prompt_length.png",
                         "caption": f"Simulated for every copy policy on {winner['hw']} ({fmt.link(winner['link_gbps'])}"
                                    f", cache {winner['cache_gib']:g} GiB) on the first 32 steps: attention reads a "
                                    f"KV cache that grows with the prompt; prefill copies whole layers. {what}."})
    if drawing is not None:  # the page embeds it: wait for it, and draw it here if it failed there
        drawing.join()
        if drawing.exitcode != 0:
            draw_heatmap()
    sections.append({"heading": "All configurations",
                     "rows": sorted(rows, key=lambda r: (not r["fits"], r[key] if _number(r[key]) else float("inf"))),
                     "cols": COLS})
    return write_html(out / "report.html", "moesim what-if", what + ".", sections)
