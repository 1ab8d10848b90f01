"""The report of ``moesim replay --out DIR``."""

from __future__ import annotations

import json
from pathlib import Path

from moesim.atomic import atomic_write_text
from moesim.fmt import plural
from moesim.hardware import HardwareProfile
from moesim.policy import get_policy
from moesim.reports.render import breakdown_png, chrome_trace, timeline_png, write_csv, write_html
from moesim.setting import Setting
from moesim.sim.simulate import SimResult, simulate
from moesim.traces.format import Trace

COLS = ["policy", "cache_gib", "tpot_ms", "tpot_p99_ms", "tokens_per_s", "tokens_per_s_low", "tokens_per_s_high",
        "range_basis", "compute_ms", "copy_ms", "stall_ms",
        "overlap_bound_ms", "serial_bound_ms", "gb_moved_per_token", "cache_hit_rate", "prefetch_hit_rate", "ttft_ms"]
CHROME_STEPS = 32  # steps written to the Chrome trace (a whole trace can be millions of spans)


def write_replay_report(trace: Trace, trace_path: Path, hw: HardwareProfile, results: list[SimResult],
                        out: Path, step: int, rows: list[dict] | None = None) -> Path:
    """The replay's report folder; ``rows`` are the replay's own (with their ranges: Replay.rows),
    else each result's summary."""
    out = Path(out)
    rows = rows if rows is not None else [r.summary() for r in results]
    kind = "synthetic" if trace.synthetic else "recorded"
    what = (f"simulated on the {hw.name} profile from a {kind} trace ({trace_path.name}, {trace.model.name}, "
            f"{plural(trace.n_tokens, 'step')}, batch {trace.batch}); compute times: {rows[0]['timing']}")
    atomic_write_text(out / "summary.json", json.dumps(rows, indent=2))
    write_csv(rows, out / "summary.csv")
    breakdown_png(rows, [r["policy"] for r in rows], out / "breakdown.png", f"TPOT breakdown, {trace.model.name} on {hw.name}")

    # The timeline comes from the SimPy reference with every interval recorded; it shows the
    # first policy that offloads (an all-resident timeline has no copies to look at).

    # The timeline is the copy engine (and the CPU's lane) beside the compute stream: the first
    # policy that offloads and is played step by step (a static layout has no copy engine to draw;
    # hot-experts' play needs its calibrated placement, which the SimPy reference does not take).
    first = next((r for r in results if get_policy(r.config["policy"]).offload
                  and not get_policy(r.config["policy"]).places_hot_set and r.config.get("sim") != "static"), None)
    cfg = first.config if first is not None else {"sim": "static"}
    sections = [
        {"heading": "Summary", "text": "Means per output token; bounds are serial (copy + compute) and ideal "
                                       "overlap (max of the two).", "rows": rows, "cols": COLS},
        {"heading": "TPOT breakdown", "image": out / "breakdown.png",
         "caption": "Each bar is the policy's TPOT split into GPU compute, the wait on the CPU, the stall waiting "
                    f"for copies and activations between devices; copy-engine time and the ideal-overlap bound "
                    f"marked. {what}."},
    ]
    if first is None:  # static layouts, hot experts, all-resident: no copy engine to draw
        sections[0]["text"] += (" No timeline: none of these policies is played step by step with a copy engine "
                                "(they place their weights once: moesim.sim.static, or hot experts by a calibration "
                                "trace), so no copy engine runs beside the compute stream.")
        return write_html(out / "report.html", f"moesim replay: {trace.model.name} on {hw.name}", what + ".", sections)
    recorded = simulate(trace.head(min(trace.n_tokens, max(step + 1, CHROME_STEPS))), hw, cfg["policy"], Setting(cache_experts=cfg["cache_experts"], eviction=cfg["eviction"] if cfg["cache_experts"] else "lru", sim="simpy", link_gbps=cfg["link_gbps"]), record=True)
    timeline_png(recorded.spans, step, out / "timeline.png",
                 f"step {step}, {cfg['policy']}: compute stream and copy engine (simulated)")
    chrome_trace(recorded.spans, out / "simulated.trace.json", f"moesim simulated: {cfg['policy']} on {hw.name}")
    sections += [
        {"heading": f"Timeline of step {step}", "image": out / "timeline.png",
         "caption": f"Compute stream and copy engine side by side for policy {cfg['policy']}; {what}. "
                    "The whole run as a Chrome/Perfetto trace: simulated.trace.json."},
    ]
    return write_html(out / "report.html", f"moesim replay: {trace.model.name} on {hw.name}", what + ".", sections)
