"""How ``moesim replay`` prints its table, a speculative-decoding replay and a ``--validate`` comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moesim.cli.app import err, floats, ints, out, print_csv, print_json, results_table, split, table
from moesim.cli.lists import policies
from moesim.cli.options import given_options
from moesim.cli.replay_args import REPLAY_POLICIES, ReplayArgs
from moesim.fmt import number, plural
from moesim.hardware import get_profile
from moesim.reports.validation import write_single_validation
from moesim.sim.analysis import why
from moesim.sim.intervals import NOMINAL, range_text
from moesim.sim.speculative import TreeCut, speculative_whatif
from moesim.sim.validate import recorded_profile, validate_trace

SUMMARY_COLS = (("policy", "policy"), ("tpot_ms", "TPOT ms"), ("tpot_p99_ms", "p99 ms"), ("tokens_per_s", "tok/s"),
                ("range", f"{NOMINAL:.0%} range tok/s"), ("compute_ms", "compute ms"), ("copy_ms", "copy ms"), ("stall_ms", "stall ms"),
                ("overlap_bound_ms", "overlap bound ms"), ("serial_bound_ms", "serial bound ms"),
                ("experts_loaded_per_token", "loads/token"), ("gb_moved_per_token", "GB/token"),
                ("cache_hit_rate", "cache hit"), ("prefetch_hit_rate", "prefetched"), ("pred_recall", "pred recall"),
                ("ttft_ms", "TTFT ms"))


def cache_text(row: dict, source: str) -> str:
    if not row.get("cache_experts"):
        return "no expert cache" + (" (as recorded)" if source.startswith("recorded") else "")
    return f"{row['cache_experts']}-expert {row['eviction'].upper()} cache ({source})"


def print_replay(rep, trace, sim: str) -> None:
    """The replay's table, titled with the profile, link, cache, trace and compute source it
    used, and one line per policy on what bounds it."""

    rows = rep.rows
    src = ("measured run, synthetic routing" if trace.measured else "synthetic trace") if trace.synthetic else "trace"
    link = (f"link {number(rows[0]['link_gbps'])} GB/s ({rep.link_source})" if rows[0].get("link_gbps") is not None
            else "no GPU link")
    queues = "".join(f"; copy queue {q}" for q in {r["copy_queue"] for r in rows if "copy_queue" in r})
    shown = [{**r, "range": range_text(r)} for r in rows]
    out.print(results_table(shown, f"{trace.model.name} on {rep.profile.name} ({rep.profile_source}), {link}, "
                                  f"{cache_text(rows[0], rep.cache_source)}, {plural(trace.n_tokens, 'step')} ({src}; compute: "
                                  f"{rows[0]['timing']}; simulator: {sim}{queues})", SUMMARY_COLS))
    for r in rows:
        out.print(f"[bold]{r['policy']}[/bold]: {why(r)}")
    bases: dict[str, list[str]] = {}
    for r in rows:
        if r.get("range_basis") not in (None, "-"):
            bases.setdefault(r["range_basis"], []).append(r["policy"])
    for basis, pols in bases.items():
        out.print(f"{NOMINAL:.0%} range of {', '.join(pols)}: where measurements of such deployments fell against "
                  f"moesim's predictions ({basis})", markup=False, highlight=False, soft_wrap=True)


def signed_ms(x: float) -> str:
    """``+ 1.2 ms`` / ``- 4.57 ms``: an intercept added to a term, never ``+ -4.57``."""
    return f"{'-' if x < 0 else '+'} {number(abs(x))} ms"


#: The what-if options of a speculative replay, each used only with ``--gamma`` (the re-selection).
SD_WHATIF_OPTIONS = ("--selection", "--score", "--lambda", "--depth", "--branch", "--acceptance")


def unused_sd_options(given: set[str], gammas: list[int] | None, selections: tuple[str, ...],
                      score: str) -> list[str]:
    """A note for each speculative what-if option given that changes no row: every one without
    ``--gamma`` (no re-selection runs), ``--score`` without the ecospec selection, ``--lambda``
    without the Lagrangian EcoSpec score."""
    if not gammas:
        named = [o for o in SD_WHATIF_OPTIONS if o in given]
        return [f"{', '.join(named)} {'shape' if len(named) > 1 else 'shapes'} the --gamma what-if rows, and no "
                "--gamma was given: changed nothing"] if named else []
    notes = []
    if "--score" in given and "ecospec" not in selections:
        notes.append("--score is the ecospec selection's, which --selection leaves out: changed nothing")
    if "--lambda" in given and not ("ecospec" in selections and score == "lagrangian"):
        notes.append("--lambda is the Lagrangian EcoSpec score's (--selection ecospec --score lagrangian): "
                     "changed nothing")
    return notes


def speculative_replay(trace, a: ReplayArgs) -> None:
    """``moesim replay`` of a speculative-decoding trace, with the command's options ``a``."""

    gammas = ints(a.gamma, "--gamma") if a.gamma is not None else None  # whole numbers: 1.5 was cut to 1, nan a traceback
    selections = tuple(split(a.selection, "--selection"))
    policy = policies(a.policy) if a.policy != REPLAY_POLICIES else None
    res = speculative_whatif(trace, get_profile(a.hw_name) if a.hw_name else None, policy, gammas, selections, a.score,
                             tuple(floats(a.lam, "--lambda")), a.link_gbps, a.timing,
                             TreeCut(a.depth, a.branch, a.acceptance))
    print_json(res) if a.as_json else print_csv(res["rows"]) if a.as_csv else print_speculative(res, a.trace_path)
    for note in unused_sd_options(given_options(a.ctx), gammas, selections, a.score):
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def print_speculative(res: dict[str, Any], trace_path: Path) -> None:
    m, rows = res["measured"], res["rows"]
    if m is None:
        out.print(f"no measured times in this trace (synthetic, or routing recorded without timings); simulated as "
                  f"recorded ({res['error_policy']}): {number(res['error_tpot_ms'])} ms a token on {rows[0]['hw']}, "
                  f"link {number(rows[0]['link_gbps'])} GB/s")
    else:
        out.print(f"measured: {number(m['tpot_ms'])} ms a token, {m['accepted_per_step']:.2f} tokens and "
                  f"{m['distinct_experts_per_step']:.1f} distinct experts a step; verification "
                  f"{number(m['verify_ms_per_distinct_expert'])} ms per distinct expert "
                  f"{signed_ms(m['verify_ms_intercept'])} (linear fit, R^2 {m['verify_vs_experts_r2']:.2f}); "
                  f"simulated as recorded ({res['error_policy']}): {number(res['error_tpot_ms'])} ms ({res['error']:+.1%}) "
                  f"on {rows[0]['hw']}, link {number(rows[0]['link_gbps'])} GB/s")
    out.print(table(f"{trace_path.name}: speculative decoding, simulated ({rows[0]['timing']}); what-if rows re-select "
                    "on the recorded trees (unverified nodes use predicted experts)",
                    ("case", "policy", "hw", "TPOT ms", "tokens/step", "rows/step", "distinct experts/step", "step ms"),
                    [[r["case"], r["policy"], r["hw"], f"{number(r['tpot_ms'])}", f"{r['accepted_per_step']:.2f}",
                      f"{r['rows_per_step']:.1f}", f"{r['distinct_experts_per_step']:.1f}", f"{number(r['step_ms'])}"]
                     for r in rows], "right"))


def print_validation(trace, trace_path: Path, hw_name: str | None, sim: str, as_json: bool,
                     out_dir: Path | None, as_csv: bool = False, copy_queue: str | None = None) -> None:

    hw_profile = get_profile(hw_name) if hw_name else None
    s, result = validate_trace(trace, hw_profile, sim=sim, **({"copy_queue": copy_queue} if copy_queue else {}))
    if as_json:
        print_json(s)
    elif as_csv:
        print_csv([s])
    else:
        out.print(table(f"{trace_path.name}: simulated against measured TPOT ({s['policy']}, "
                        f"{s['tokens']} tokens after 1 warm-up step)",
                        ("measured ms", "predicted ms", "error of mean", "per-token MAPE", "bias", "p50 |err|",
                         "p90 |err|", f"TOST +-{s['tost_margin']:.0%}"),
                        [[f"{s['measured_ms']:.3f}", f"{s['predicted_ms']:.3f}", f"{s['error']:+.2%}", f"{s['mape']:.2%}",
                          f"{s['bias']:+.2%}", f"{s['p50_abs_error']:.2%}", f"{s['p90_abs_error']:.2%}",
                          f"{'equivalent' if s['equivalent'] else 'not shown'} (p={number(s['tost_p'])})"]], "right"))
        cfg = result.config
        meta = trace.meta
        set_at = f" (set to {number(meta.link_gbps)} GB/s)" if meta.link_gbps is not None else ""
        how = "as recorded" if copy_queue is None else "--copy-queue"
        queue = f"; copy queue {cfg['copy_queue']} ({how})" if "copy_queue" in cfg else ""
        out.print(f"on {cfg['hw']}, link {number(cfg['link_gbps'])} GB/s: the rate the trace's copies achieved{set_at}; "
                  f"compute: {cfg['timing']}{queue}. A plain `moesim replay` uses the set link and predicts every policy, "
                  "so its numbers can differ from these.")
    if out_dir is not None:

        page = write_single_validation(trace, trace_path, recorded_profile(trace, hw_profile), s, result, out_dir)
        err.print(f"report: {page}")
