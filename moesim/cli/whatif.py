"""``moesim whatif``. Python: ``moesim.sim.sweep.whatif(trace, models, hws, policies, ...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, floats, out, print_csv, print_json, results_table, split
from moesim.cli.running import progress_bar
from moesim.errors import MoesimError

WHATIF_COLS = (("model", "model"), ("hw", "hw"), ("policy", "policy"), ("link_gbps", "link GB/s"),
               ("cache_gib", "cache GiB"), ("fits", "fits"), ("tpot_ms", "TPOT ms"), ("tokens_per_s", "tok/s"),
               ("compute_ms", "compute"), ("copy_ms", "copy"), ("stall_ms", "stall"),
               ("gb_moved_per_token", "GB/token"), ("ttft_ms", "TTFT ms"), ("bound", "bound"), ("timing", "compute from"))


@app.command()
def whatif(
    trace_path: Annotated[Path | None, typer.Option("--trace", help="Sweep over this trace (else a synthetic one per model).")] = None,
    model: Annotated[str, typer.Option(help="Comma-separated models (ignored with --trace: the trace's model).")] = "qwen3-30b-a3b",
    hw_names: Annotated[str, typer.Option("--hw", help="Comma-separated hardware profiles or .toml paths.")] = "a6000,h100-sxm,gh200",
    policy: Annotated[str, typer.Option(help="Comma-separated policies.")] = "on-demand,prefetch-fom,prefetch-spec,oracle,all-resident",
    link_gbps: Annotated[str | None, typer.Option(help="Comma-separated host-to-device GB/s (default: each profile's own).")] = None,
    cache_gib: Annotated[str, typer.Option(help="Comma-separated cross-token cache sizes, GiB.")] = "0,8,16",
    eviction: Annotated[str, typer.Option(help="Cache eviction: lru or lfu.")] = "lru",
    tokens: Annotated[int, typer.Option(help="Decode steps of the synthetic trace.")] = 256,
    prompt_len: Annotated[int, typer.Option(help="Prompt length of the synthetic trace.")] = 128,
    batch: Annotated[int, typer.Option(help="Batch size of the synthetic trace.")] = 1,
    goal: Annotated[str, typer.Option(help="What 'best' means: tpot, p99, ttft or bytes.")] = "tpot",
    engine: Annotated[str, typer.Option(help="fast (default for sweeps) or simpy.")] = "fast",
    jobs: Annotated[int, typer.Option(help="Worker processes (0 = all cores; local backend).")] = 0,
    backend: Annotated[str, typer.Option(help="local (process pool on this machine) or ray (a Ray cluster: "
                                              "docs/cluster.md).")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: RAY_ADDRESS, else a new local "
                                                     "Ray).")] = None,
    rows_csv: Annotated[Path | None, typer.Option("--rows", help="Stream every row to this CSV as it finishes; run "
                                                                 "the same sweep again to resume from it.")] = None,
    top: Annotated[int, typer.Option(help="Rows to print (all go to the CSV).")] = 15,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV (every field) instead of a table.")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Report folder: HTML, PNG heatmaps and breakdown, CSV.")] = Path("moesim-whatif"),
) -> None:
    """Sweep models x hardware x policies x link bandwidth x cache size; find the best.

    Without `--trace` each model gets a **synthetic** trace (see `moesim synth`).
    Configurations that do not fit in device memory are marked and never chosen as best.

    Example: `moesim whatif --model olmoe-1b-7b --hw a6000,gh200 --policy on-demand,prefetch,oracle
    --link-gbps 16,32 --cache-gib 0,1 --tokens 32 --jobs 1`
    """
    from moesim.sim.analysis import why
    from moesim.sim.sweep import whatif as run_whatif
    from moesim.sim.whatif import GOALS

    if top < 1:
        raise MoesimError(f"--top {top}: print at least one row")
    if out_dir is not None:
        from moesim.outputs import check_output_dir

        check_output_dir(out_dir)

    with progress_bar("simulating", "configurations", disable=as_json or as_csv) as update:
        res = run_whatif(trace_path, split(model, "--model"), split(hw_names, "--hw"), split(policy, "--policy"),
                         floats(link_gbps, "--link-gbps") if link_gbps else None, floats(cache_gib, "--cache-gib"),
                         eviction, tokens, prompt_len, batch, goal, engine, jobs or None,
                         update,
                         backend=backend, address=address, rows_csv=rows_csv)
    rows, winner = res.rows, res.winner
    if as_json or as_csv:
        print_json({"goal": goal, "best": winner, "rows": rows}) if as_json else print_csv(rows)
    else:
        out.print(results_table(res.ranked()[:top], f"what-if: {res.sweep.size} configurations, best "
                                f"{min(top, len(rows))} by {goal}{' (synthetic traces)' if res.synthetic else ''}",
                                WHATIF_COLS))
        for h in res.sweep.hws:
            b = res.best_by_hw[h.name]
            if b is not None:
                out.print(f"on {h.name}: best is {b['policy']} (link {b['link_gbps']:g} GB/s, cache {b['cache_gib']:g} GiB)"
                          f" at {b['tpot_ms']:.3g} ms/token; {why(b)}")
            else:
                out.print(f"on {h.name}: no configuration fits in {h['device_memory_gb']:g} GB of device memory")
        if winner:
            out.print(f"[bold green]best for {GOALS[goal][1]}:[/bold green] {winner['model']} on {winner['hw']}, "
                      f"{winner['policy']}, link {winner['link_gbps']:g} GB/s, cache {winner['cache_gib']:g} GiB: "
                      f"{winner['tpot_ms']:.3g} ms/token ({winner['tokens_per_s']:.3g} tok/s); compute: {winner['timing']}")
            out.print(f"why: {why(winner)}")
        else:
            out.print("[bold red]no configuration fits in device memory[/bold red]")
    if out_dir is not None:
        from moesim.reports.whatif import write_whatif_report

        page = write_whatif_report(rows, winner, goal, res.sweep, out_dir)
        err.print(f"report: {page}")
