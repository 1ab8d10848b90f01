"""How ``moesim whatif`` prints its answer: the top rows, each machine's best, the
deployment answer per scenario, where the winner changes, the notes and the best."""

from __future__ import annotations

from moesim import fmt
from moesim.cli.app import err, out, print_csv, print_json, results_table
from moesim.cli.running import writing_report
from moesim.fmt import number
from moesim.policy import of_row
from moesim.reports.whatif import write_whatif_report
from moesim.sim.analysis import why
from moesim.sim.answer import (
    Timed,
    bound_words,
    configuration,
    crossovers,
    deployment_answer,
    describe_change,
    format_answer,
)
from moesim.sim.intervals import NOMINAL, how_sure, range_text
from moesim.sim.sweep import GOALS

WHATIF_COLS = (("model", "model"), ("hw", "hw"), ("host", "host"), ("policy", "policy"), ("setting", "setting"),
               ("fits", "fits"), ("tpot_ms", "TPOT ms"), ("tokens_per_s", "tok/s"),
               ("range", f"{NOMINAL:.0%} range tok/s"), ("bound", "bound"),
               ("link_gbps", "link GB/s"), ("cache_gib", "cache GiB"), ("compute_ms", "GPU ms"), ("cpu_ms", "CPU ms"),
               ("copy_ms", "copy ms"), ("stall_ms", "stall ms"), ("gb_moved_per_token", "GB/token"),
               ("ttft_ms", "TTFT ms"), ("timing", "compute from"))


def print_whatif(res, answers, crosses, goal: str, top: int) -> None:
    """The text answer; ``answers``: (engine, its deployment answers), one pair an engine."""

    rows, winner = res.rows, res.winner

    shown = [{**r, "setting": configuration(r), "range": range_text(r)} for r in res.ranked()[:top]]
    cols = WHATIF_COLS if not res.by_engine else (*WHATIF_COLS[:4], ("engine", "engine"), *WHATIF_COLS[4:])
    size = sum(each.sweep.size for each in res.by_engine) if res.by_engine else res.sweep.size
    out.print(results_table(shown, f"what-if: {size} configurations, top "
                            f"{min(top, len(rows))} by {goal} (oracle: a bound, never best)"
                            f"{' (synthetic traces)' if res.synthetic else ''}",
                            cols))
    for h in res.sweep.hws:
        b = res.best_by_hw[h.name]
        if b is not None:
            out.print(f"on {h.name}: best is {b['policy']} ({fmt.link(b['link_gbps'])}, cache {number(b['cache_gib'])} GiB)"
                      f" at {number(b['tpot_ms'])} ms/token; {bound_words(b)}")
        else:
            mem = "+".join(f"{g:g}" for g in h.device_memory_gb())
            notes = [r["note"] for r in rows if r["hw"] == h.name and r.get("note") not in (None, "", "-")]
            host = next((n for n in notes if "RAM" in n), None)  # the host's RAM, not the device, is short
            # The cause the rows give: the host's RAM, a family that cannot run here (no GPU), else the device
            out.print(f"on {h.name}: no configuration fits: {host}" if host else
                      f"on {h.name}: no configuration runs: {notes[0]}" if not mem and notes else
                      f"on {h.name}: no configuration fits in {mem} GB of device memory", markup=False,
                      highlight=False, soft_wrap=True)
    for label, group in answers:
        if res.by_engine:
            out.print(f"\n-- with {label} --", markup=False)
        for a in group:
            out.print()
            out.print(format_answer(a), markup=False, highlight=False, soft_wrap=True)  # wrapped already; commands never
    changes = [describe_change(c, ch) for c in crosses for ch in c.changes]
    if changes:
        out.print("\nwhere the winner changes:", markup=False)
        for line in changes:
            out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    for note in res.notes:
        out.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if winner:
        out.print(f"[bold green]best for {GOALS[goal][1]}:[/bold green] {winner['model']} on {winner['hw']}, "
                  f"{winner['policy']}{' with ' + winner['engine'] if res.by_engine else ''}, {fmt.link(winner['link_gbps'])}, cache {number(winner['cache_gib'])} GiB: "
                  f"{number(winner['tpot_ms'])} ms/token ({number(winner['tokens_per_s'])} tok/s); compute: {winner['timing']}")
        if sure := how_sure(winner):
            out.print(f"how sure: {sure}", markup=False, highlight=False, soft_wrap=True)
        cpu = of_row(winner).uses_host or winner["bound"] == "CPU compute"
        out.print(f"why: {bound_words(winner)}" if cpu else f"why: {why(winner)}")
    else:
        out.print("[bold red]no configuration fits or runs[/bold red] (each row's note says why: --json / --csv)")


def engine_answer(res, goal: str, engine: str | None, context: int | None):
    """One engine's deployment answer: each family's best and, where ``engine`` was named, the
    arguments of the engine its sweep ran (a user's file: the engine its runs_as names)."""
    eng = res.sweep.engine_profile
    return deployment_answer(res.rows, goal, engine=engine and (eng.runs_as or eng.name),
                             timed=Timed.of(res.sweep, context))


def show_whatif(res, goal: str, engine: str | None, top: int, as_json: bool, as_csv: bool, out_dir,
                context: int | None = None) -> None:
    """The answer as JSON, CSV or text, then the report folder (``out_dir``, unless None);
    ``context``: the context the user will serve (``--ctx``; None: the engine's default)."""

    rows, winner = res.rows, res.winner
    answers = [(each.sweep.engine_profile.label, engine_answer(each, goal, engine, context))
               for each in (res.by_engine or [res])]
    crosses = crossovers(rows)
    if as_json or as_csv:
        print_json({"goal": goal, "best": winner, "notes": res.notes, "deployment": [a.to_dict() for _, group in answers for a in group],
                    "crossovers": [c.__dict__ for c in crosses], "rows": rows}) if as_json else print_csv(rows)
    else:
        print_whatif(res, answers, crosses, goal, top)
    if out_dir is not None:

        with writing_report(out_dir):
            page = write_whatif_report(rows, winner, goal, res.sweep, out_dir, res.notes)
        err.print(f"report: {page}", soft_wrap=True)
