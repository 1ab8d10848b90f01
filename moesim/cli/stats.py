"""``moesim stats TRACE``. Python: ``moesim.reports.stats.stats_report(trace, out, hw, sizes, policy)``
(the numbers alone: ``moesim.sim.stats.routing_stats``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, ints, out, print_json
from moesim.cli.options import given_options, holding
from moesim.cli.running import writing_report
from moesim.errors import MoesimError
from moesim.outputs import check_output_dir
from moesim.policy import get_policy  # light: the CLI imports it anyway (the cost model's policies)
from moesim.reports.stats import stats_report
from moesim.sim.stats import summary_lines


@app.command()
def stats(
    ctx: typer.Context,
    trace_path: Annotated[Path, typer.Argument(metavar="TRACE", help="A trace file (.npz).")],
    hw_name: Annotated[str | None, typer.Option("--hw", help="Also simulate TPOT against cache size on this profile "
                                                             "and find the knee.")] = None,
    sizes: Annotated[str | None, typer.Option(help="Cache sizes in experts (default: a spread up to all).")] = None,
    policy: Annotated[str, typer.Option(help="Policy for the TPOT-against-cache curve.")] = "on-demand",
    out_dir: Annotated[Path | None, typer.Option("--out", help="Report folder: HTML, PNGs, stats.json.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every statistic as JSON.")] = False,
) -> None:
    """Routing statistics, the questions users of offloading engines ask: which experts are
    hot (popularity and skew per layer), how often and how soon experts are reused,
    adjacent-layer overlap against chance, each predictor's recall, the cache hit rate
    against cache size (LRU, LFU and Belady's offline optimum), and with `--hw` how many
    experts to keep on the GPU (TPOT against cache size and the knee).

    Example: `moesim synth --model olmoe-1b-7b --tokens 64 --out olmoe.npz`, then
    `moesim stats olmoe.npz --hw a6000 --out olmoe-stats`
    """

    if hw_name is None and "--policy" in given_options(ctx):
        err.print("note: --policy sets the TPOT-against-cache curve, which only --hw draws: changed nothing",
                  markup=False, soft_wrap=True)
    if hw_name is not None and not get_policy(policy).caches:  # its TPOT is flat in the cache size: no knee
        raise MoesimError(f"--policy {policy} keeps no expert cache, so its TPOT does not change with the cache size; "
                          "the curve needs a copy policy (on-demand, prefetch-fom, ...) or cpu-on-miss")
    if out_dir is not None:
        check_output_dir(out_dir)  # before its lock file is made
    with holding(out_dir, "--out"), writing_report(out_dir):  # a second run on the folder: refused
        res = stats_report(trace_path, out_dir, hw=hw_name,  # whole numbers of experts: never nan, inf or 1.5 cut to 1
                           sizes=ints(sizes, "--sizes") if sizes is not None else None, policy=policy)
    if as_json:
        print_json(res)
        return
    for line in summary_lines(res):
        out.print(line, highlight=False, markup=False)
    if out_dir is not None:
        err.print(f"report: {out_dir / 'report.html'}")
