"""``moesim validate``. Python: ``moesim.reports.validation.validation_suite(out, tokens, model, repeats)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, out, table
from moesim.cli.running import keeps_finished_work


@app.command()
@keeps_finished_work
def validate(
    out_dir: Annotated[Path, typer.Option("--out", help="Report folder: error table, scatter, timelines, traces.")] = Path("moesim-validation"),
    tokens: Annotated[int, typer.Option(help="Decode steps per run (the learned model runs 4x as many: its steps "
                                              "are ~10x shorter).")] = 32,
    model: Annotated[str | None, typer.Option(help="Only this suite model (moe-stdlib or the synthetic one).")] = None,
    repeats: Annotated[int, typer.Option(help="Runs of each case; the one with the median TPOT is scored.")] = 3,
) -> None:
    """Run the validation suite: the simulator against the executor on this machine (CPU,
    emulated link): 2 models x 3 link bandwidths x 4 policies, same-policy replay and
    policy transfer (predicted from the on-demand trace alone), with an error table.

    Example: `moesim validate --out validation-report` (long-running)
    """
    from moesim.reports.validation import validation_suite

    with err.status("validating") as status:
        rows, summary, machine, page = validation_suite(out_dir, tokens, model, repeats,
                                                        lambda what: status.update(f"validating: {what}"))
    out.print(table(f"simulated vs measured mean TPOT ({machine})",
                    ("model", "link GB/s", "policy", "case", "measured ms", "simulated ms", "error", "per-token MAPE",
                     "TOST +-5%"),
                    [[r["model"], f"{r['link_gbps']:g}", r["policy"], r["case"], f"{r['measured_ms']:.3g}",
                      f"{r['predicted_ms']:.3g}", f"{r['error']:+.2%}", f"{r['mape']:.2%}",
                      "equivalent" if r["equivalent"] else "not shown"] for r in rows], "right"))
    for k, v in summary.items():
        out.print(f"[bold]{k}[/bold]: {v}")
    err.print(f"report: {page}")
