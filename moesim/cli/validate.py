"""``moesim validate``. Python: ``moesim.reports.validation.validation_suite(out, tokens, model, repeats,
cpu_policies, copy_queues)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, out, table
from moesim.cli.options import given_options
from moesim.cli.running import keeps_finished_work, need_executor, progress_bar
from moesim.cli.validate_published import show_published
from moesim.errors import MoesimError
from moesim.executor.validation_plan import check_suite_model
from moesim.fmt import number
from moesim.reports.validation import validation_suite

CASE_SHORT = {"same-policy": "same", "transfer from on-demand": "transfer"}


@app.command()
@keeps_finished_work
def validate(
    ctx: typer.Context,
    out_dir: Annotated[Path, typer.Option("--out", help="Report folder: error table, scatter, timelines, traces.")] = Path("moesim-validation"),
    tokens: Annotated[int, typer.Option(help="Decode steps per run (the learned model runs 4x as many: its steps "
                                              "are ~10x shorter).")] = 32,
    model: Annotated[str | None, typer.Option(help="Only this suite model (moe-stdlib or the synthetic one).")] = None,
    cpu_policies: Annotated[bool, typer.Option("--cpu-policies/--no-cpu-policies", help="Also run the CPU-compute "
                                               "policies and int8 experts (synthetic geometry).")] = True,
    copy_queues: Annotated[bool, typer.Option("--copy-queues/--no-copy-queues", help="Also run prefetch-fom under each "
                                              "copy queue (fifo, demand-first, cancel-unstarted; synthetic geometry).")] = True,
    repeats: Annotated[int, typer.Option(help="Rounds of every case (the policies interleaved in each); a case scores "
                                               "as the median over rounds, with its spread.")] = 3,
    published: Annotated[bool, typer.Option("--published", help="Instead: predict the published measurements of "
                                                                "real engines (hwprofiles/published), each with engine "
                                                                "figures fitted without its own source, and score "
                                                                "them.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --published: rows and summary as JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="With --published: every row as CSV.")] = False,
) -> None:
    """Run the validation suite: the simulator against the executor on this machine (CPU,
    emulated link): 2 models x 3 link bandwidths x 4 policies, same-policy replay and
    policy transfer (predicted from the on-demand trace alone), with an error table; then
    the CPU-compute policies and the copy queues (which wins, measured and predicted).

    With `--published`, it instead predicts every published batch-1 decode measurement of
    a real engine that moesim can express (llama.cpp, ik_llama.cpp, KTransformers, vLLM, SGLang,
    MoE-Infinity, mixtral-offloading; hwprofiles/published), leaving one source out: each
    measurement is predicted with engine figures fitted on the measurements of every other
    source (an issue thread, an article), and scored overall, by deployment kind and by
    engine. Its sources' folds run on every core (about 2 minutes on 2 cores).

    Examples: `moesim validate --out validation-report` (long-running), `moesim validate --published`
    (long-running: 2-4 minutes on 2 cores), `moesim validate --published --json` (long-running)
    """
    if published:
        executor_only = ("--out", "--tokens", "--model", "--cpu-policies", "--copy-queues", "--repeats")
        if unused := [o for o in executor_only if o in given_options(ctx)]:
            err.print(f"note: {', '.join(unused)}: for the executor suite, not --published (which runs no executor): "
                      "changed nothing", markup=False, soft_wrap=True)
        show_published(as_json, as_csv)
        return
    if as_json or as_csv:

        raise MoesimError("--json and --csv print the published suite (--published); the executor suite writes its "
                          "tables to --out")
    check_suite_model(model)  # before torch loads
    need_executor()

    with progress_bar("validating", "runs") as update:
        rows, cpu_rows, (queue_rows, winners), summary, machine, page = validation_suite(
            out_dir, tokens, model, repeats, lambda doing, done, total: update(done, total, doing), cpu_policies,
            copy_queues)
    out.print(table(f"simulated vs measured mean TPOT ({machine})",
                    ("model", "GB/s", "policy", "case", "measured ms", "simulated ms", "error", "error range"),
                    [[r["model"][:12], f"{r['link_gbps']:g}", r["policy"], CASE_SHORT[r["case"]], f"{number(r['measured_ms'])}",
                      f"{number(r['predicted_ms'])}", f"{r['error']:+.1%}", f"{r['error_min']:+.1%}..{r['error_max']:+.1%}"]
                     for r in rows], "right"))
    if cpu_rows:
        out.print(table("CPU-compute policies and int8 experts (synthetic geometry; each case its median-TPOT run)",
                        ("policy", "case", "measured ms", "simulated ms", "error"),
                        [[r["policy"], CASE_SHORT[r["case"]], f"{number(r['measured_ms'])}", f"{number(r['predicted_ms'])}",
                          f"{r['error']:+.1%}"] for r in cpu_rows], "right"))
    if queue_rows:
        out.print(table("copy queues, prefetch-fom (synthetic geometry; measured: median of runs)",
                        ("GB/s", "predictor", "queue", "measured ms", "range ms", "same-policy", "from FIFO"),
                        [[f"{r['link_gbps']:g}", r["predictor"], r["queue"], f"{number(r['measured_ms'])}",
                          f"{number(r['measured_min_ms'])}..{number(r['measured_max_ms'])}", f"{r['same_policy_error']:+.1%}",
                          f"{number(r['from_fifo_ms'])} ({r['from_fifo_error']:+.1%})"] for r in queue_rows], "right"))
        for w in winners:
            out.print(f"{w['link_gbps']:g} GB/s, {w['predictor']}: measured winner {w['measured_winner']} "
                      f"(+{w['margin']:.1%} to the next, {_verdict(w)}); "
                      f"predicted from FIFO: {w['predicted_winner']}")
    out.print("case: same = replay of the run's own trace; transfer = predicted from the on-demand trace. "
              "error: median over rounds; range: over rounds.")
    for k, v in summary.items():
        out.print(f"[bold]{k}[/bold]: {v}")
    err.print(f"report: {page}")


def _verdict(w: dict) -> str:
    if w["runs"] < 2:
        return "one run: no spread to judge it by"
    return "clear" if w["clear"] else "inside the runs’ spread: a tie"

