"""Figures (PNG, matplotlib), self-contained HTML pages and Chrome/Perfetto traces.

Every figure function takes plain rows or spans and a caption that says what was
simulated or measured, on what; pages embed their images, so one HTML file is the report.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moesim.atomic import atomic_write, atomic_write_text
from moesim.fmt import duration_ms, number
from moesim.sim.analysis import PARTS, tpot_parts

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported on first use: it takes about a second
    to import, and the commands that print JSON (``stats --json``, ``replay --json``) draw
    nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

COLORS = {"compute": "#4C72B0", "stall": "#C44E52", "copy": "#DD8452", "bound": "#55A868"}
CPU_COLOR = "#66A61E"


def save_figure(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt = pyplot()
    plt.close(fig)
    return atomic_write(path, lambda f: f.write(buf.getvalue()))


#: Each part of :func:`moesim.sim.analysis.tpot_parts` as a chart draws it.
PART_STYLE = {"GPU": (COLORS["compute"], "GPU compute"), "CPU": (CPU_COLOR, "waiting on the CPU"),
              "copies": (COLORS["stall"], "stall (waiting for copies)"),
              "other": ("#999999", "other (activations between devices)")}


def breakdown_png(rows: Sequence[dict[str, Any]], labels: Sequence[str], path: Path, title: str) -> Path:
    """Per configuration, its TPOT stacked from its parts (:func:`moesim.sim.analysis.tpot_parts`:
    the bar's height is the row's TPOT), with the copy-engine time and the ideal-overlap bound;
    a configuration that does not fit is hatched and says so; each bar with a range
    (``tpot_ms_low`` / ``tpot_ms_high``) carries it as an error bar. Rows without a TPOT (not
    run) are the caller's to leave out, and to say so."""

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 2), 3.8))
    x = list(range(len(rows)))
    parts = [tpot_parts(r) for r in rows]
    unfit = [r.get("fits") is False for r in rows]
    from matplotlib.patches import Patch

    bottom = [0.0] * len(rows)
    handles = []
    for part in PARTS:
        heights = [p[part] for p in parts]
        if not any(heights):
            continue
        color, label = PART_STYLE[part]
        for bar, u in zip(ax.bar(x, heights, bottom=bottom, color=color, edgecolor="white"), unfit):
            if u:
                bar.set_hatch("//")
        handles.append(Patch(facecolor=color, label=label))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i in (i for i, u in enumerate(unfit) if u):
        ax.annotate("does not fit", (i, bottom[i]), ha="center", va="bottom", fontsize=7, color=COLORS["stall"])
    if any(unfit):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="does not fit in memory"))
    if any(r.get("copy_ms") for r in rows):
        handles.append(ax.scatter(x, [r.get("copy_ms") or 0.0 for r in rows], marker="_", s=600, color=COLORS["copy"],
                                  zorder=3, label="copy-engine time"))
    handles.append(ax.scatter(x, [r.get("overlap_bound_ms") or 0.0 for r in rows], marker="v", color=COLORS["bound"],
                              zorder=3, label="ideal-overlap bound"))
    # Each bar's 80% range (moesim.sim.intervals): where measurements of such deployments fell
    # against the prediction, as a TPOT (a bar without one, none drawn).
    ranged = [i for i, r in enumerate(rows) if r.get("tpot_ms_low") is not None and r.get("tpot_ms_high") is not None
              and r.get("tpot_ms") is not None]
    if ranged:
        mid = [rows[i]["tpot_ms"] for i in ranged]
        err = [[m - rows[i]["tpot_ms_low"] for i, m in zip(ranged, mid)],
               [rows[i]["tpot_ms_high"] - m for i, m in zip(ranged, mid)]]
        handles.append(ax.errorbar(ranged, mid, yerr=err, fmt="none", ecolor="black", elinewidth=1, capsize=3,
                                   zorder=4, label="80% range of measurements"))
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per output token")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def timeline_png(spans: Sequence[Any], step: int, path: Path, title: str) -> Path:
    """One decode step as a profiler view: compute stream and copy engine side by side."""
    mine = [s for s in spans if s.step == step]
    if not mine:
        raise ValueError(f"no spans recorded for step {step}")
    t0 = min(s.start for s in mine)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 2.6))
    lanes = {"compute": 1, "copy": 0, "cpu": 2}  # cpu: experts the host computes (CPU-compute policies)
    for s in mine:
        kind = "copy" if s.lane == "copy" else ("compute" if s.name.startswith("attn") else "stall")
        color = {"copy": COLORS["copy"], "compute": "#8DA0CB", "stall": COLORS["compute"]}[kind]
        if s.name.startswith("prefetch"):
            color = "#E6AB02"
        if s.lane == "cpu":
            color = CPU_COLOR
        ax.broken_barh([((s.start - t0) * 1e3, (s.end - s.start) * 1e3)], (lanes[s.lane] - 0.4, 0.8),
                       facecolors=color, edgecolors="white", linewidth=0.3)
    if any(s.lane == "cpu" for s in mine):
        ax.set_yticks([0, 1, 2], ["copy engine", "compute stream", "CPU experts"])
    else:
        ax.set_yticks([0, 1], ["copy engine", "compute stream"])
    ax.set_xlabel("ms since the step started")
    ax.set_title(title, fontsize=10)
    from matplotlib.patches import Patch

    handles = [Patch(color="#8DA0CB", label="attention + router"), Patch(color=COLORS["compute"], label="experts"),
               Patch(color=COLORS["copy"], label="on-demand copy"), Patch(color="#E6AB02", label="prefetch copy")]
    if any(s.lane == "cpu" for s in mine):
        handles.append(Patch(color=CPU_COLOR, label="experts on the CPU (with the activation round trip)"))
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return save_figure(fig, path)


UNITS = {"tpot_ms": "ms", "tpot_p99_ms": "ms", "ttft_ms": "ms", "gb_moved_per_token": "GB"}


def heatmap_png(rows: Sequence[dict[str, Any]], path: Path, title: str, value: str = "tpot_ms",
                best: dict[str, Any] | None = None) -> Path:
    """``value`` over link bandwidth x cache size, one panel per (hardware, policy); the best
    configuration's cell is framed and starred, its value in its panel's title."""
    panels = sorted({(r["hw"], r["policy"]) for r in rows})[:16]
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    plt = pyplot()
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 2.9 * nrow), squeeze=False, layout="constrained")
    vmin, vmax = min(r[value] for r in rows), max(r[value] for r in rows)
    im = None
    for ax, (hw, pol) in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if (r["hw"], r["policy"]) == (hw, pol)]
        links = sorted({r["link_gbps"] for r in mine})
        caches = sorted({r["cache_gib"] for r in mine})
        grid = [[float("nan")] * len(links) for _ in caches]
        for r in mine:
            grid[caches.index(r["cache_gib"])][links.index(r["link_gbps"])] = r[value]
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis_r", vmin=vmin, vmax=vmax)
        ax.set_xticks(range(len(links)), [f"{g:g}" for g in links], fontsize=7)
        ax.set_yticks(range(len(caches)), [f"{c:g}" for c in caches], fontsize=7)
        ax.set_title(f"{hw} / {pol}", fontsize=8)
        ax.set_xlabel("link GB/s", fontsize=7)
        ax.set_ylabel("cache GiB", fontsize=7)
        for yi, row in enumerate(grid):
            for xi, v in enumerate(row):
                if v == v:  # not NaN
                    dark = (v - vmin) > 0.5 * (vmax - vmin)
                    ax.text(xi, yi, number(v), ha="center", va="center", fontsize=6.5,
                            color="white" if dark else "black")
        if best and (best["hw"], best["policy"]) == (hw, pol):
            bx, by = links.index(best["link_gbps"]), caches.index(best["cache_gib"])
            # The star sits in the cell's corner so the cell's value stays readable; the
            # value is repeated, bold, in the panel title.
            ax.scatter([bx - 0.32], [by + 0.28], marker="*", s=110, color="#FFD700", edgecolors="black", zorder=3)
            ax.add_patch(plt.Rectangle((bx - 0.5, by - 0.5), 1, 1, fill=False, edgecolor="#FFD700", linewidth=2.5,
                                       zorder=3))
            ax.set_title(f"{hw} / {pol}\nbest: {number(best[value])} {UNITS.get(value, '')}", fontsize=8,
                         fontweight="bold")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label=f"{LABELS.get(value, value)} ({UNITS.get(value, '')})")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def chrome_trace(spans: Sequence[Any], path: Path, name: str = "moesim simulated") -> Path:
    """Spans as Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing)."""
    tid = {"compute": 1, "copy": 2, "cpu": 3}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "compute stream"}},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "copy engine (H2D)"}},
    ]
    if any(s.lane == "cpu" for s in spans):
        events.append({"ph": "M", "pid": 1, "tid": 3, "name": "thread_name", "args": {"name": "CPU experts"}})
    for s in spans:
        events.append({"ph": "X", "pid": 1, "tid": tid[s.lane], "name": s.name, "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "args": {"step": s.step, "layer": s.layer}})
    return atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """``rows`` as CSV: every column any row has, in the order first seen, empty where a row has
    none (a CPU policy's row has columns a copy policy's lacks)."""
    buf = io.StringIO()
    cols = list(dict.fromkeys(k for r in rows for k in r))
    w = csv.DictWriter(buf, fieldnames=cols, restval="")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return atomic_write_text(path, buf.getvalue())


#: Report table headers: human words with units, for the result fields the reports show.
LABELS = {
    "model": "model", "hw": "hardware", "policy": "policy", "case": "case", "link_gbps": "link (GB/s)",
    "cache_gib": "cache (GiB)", "cache_experts": "cache (experts)", "fits": "fits in device memory",
    "tpot_ms": "time per output token", "tpot_p99_ms": "TPOT p99", "tokens_per_s": "tokens/s",
    "compute_ms": "compute per token", "copy_ms": "copy per token", "stall_ms": "stall per token",
    "overlap_bound_ms": "ideal-overlap bound", "serial_bound_ms": "serial bound",
    "gb_moved_per_token": "moved per token (GB)", "experts_loaded_per_token": "experts loaded per token",
    "cache_hit_rate": "cache hit rate", "prefetch_hit_rate": "prefetched share", "pred_recall": "prediction recall",
    "ttft_ms": "time to first token", "bound": "bound by", "measured_ms": "measured TPOT",
    "predicted_ms": "predicted TPOT", "error": "error of the mean", "mape": "per-token MAPE",
    "error_min": "lowest error over rounds", "error_max": "highest error over rounds", "runs": "rounds",
    "equivalent": "equivalent (TOST)",
}


def cell_text(key: str, v: Any) -> str:
    """A table cell: durations (``*_ms``) in ms or s with the unit, rates as percentages,
    other numbers without exponents (moesim.fmt)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return html.escape(str(v))
    if key.endswith("_ms"):
        return duration_ms(v)
    if key.endswith(("_rate", "recall", "mape")) or key in ("error", "error_min", "error_max", "prefetch_hit_rate"):
        return f"{v:.1%}" if v == v else "-"
    return number(v)


def _table_html(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(LABELS.get(c, c.replace('_', ' ')))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell_text(c, r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    # A wide table scrolls inside its box instead of overflowing the page.
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def write_html(path: Path, title: str, intro: str, sections: Sequence[dict[str, Any]]) -> Path:
    """A self-contained page. Each section: ``heading``, ``text``, and optionally ``image``
    (a PNG path, embedded as base64) with ``caption``, or ``rows`` + ``cols`` for a table."""
    parts = [f"<h1>{html.escape(title)}</h1><p>{intro}</p>"]
    for s in sections:
        parts.append(f"<h2>{html.escape(s['heading'])}</h2>")
        if s.get("text"):
            parts.append(f"<p>{s['text']}</p>")
        if s.get("image"):
            data = base64.b64encode(Path(s["image"]).read_bytes()).decode()
            alt = html.escape(s.get("caption", s["heading"]))
            parts.append(f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{html.escape(s.get('caption', ''))}</figcaption></figure>")
        if s.get("rows") is not None:
            parts.append(_table_html(s["rows"], s["cols"]))
    # A self-check a browser runs on load: how many images decoded (tests read it back).
    parts.append("<footer id='render-check'>images rendered: (needs JavaScript)</footer><script>"
                 "window.addEventListener('load',()=>{const im=[...document.images];"
                 "const ok=im.filter(i=>i.complete&&i.naturalWidth>0).length;"
                 "document.getElementById('render-check').textContent='images rendered: '+ok+'/'+im.length;});"
                 "</script>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
             "footer{font-size:11px;color:#888;margin-top:2em}"
             "table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;"
             "text-align:right}th{background:#f3f3f3}figure{margin:1em 0}img{max-width:100%}"
             "figcaption{font-size:13px;color:#555}.scroll{overflow-x:auto;max-width:100%}th{white-space:normal}"
             "td{white-space:nowrap}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return atomic_write_text(path, page)
