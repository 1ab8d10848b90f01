"""``moesim replay TRACE``. Python: ``moesim.sim.replay.replay(trace, hw, policies, ...)``;
``--validate``: ``moesim.sim.validate.validate_trace``; speculative traces:
``moesim.sim.speculative.speculative_whatif``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli import options as opt
from moesim.cli.app import app, auto_or, err, floats, print_csv, print_json
from moesim.cli.lists import policies
from moesim.cli.options import CachePerLayer, Engine, GpuLayers, Host, OffloadGib, Threads, given_options, holding, one
from moesim.cli.replay_views import SD_WHATIF_OPTIONS, print_replay, print_validation, speculative_replay
from moesim.cli.running import progress_bar, writing_report
from moesim.engines import get_engine  # imported with the CLI anyway (moesim.policy's cost model)
from moesim.errors import MoesimError
from moesim.hardware import DEFAULT_PROFILE
from moesim.outputs import check_output_dir  # light (2 ms to import): checked before the lock
from moesim.reports.replay import write_replay_report
from moesim.sim.replay import replay as run_replay
from moesim.traces.format import read_trace

REPLAY_POLICIES = "on-demand,prefetch-fom,prefetch-spec,oracle"
SD = "Speculative traces, with --gamma: "


@app.command()
def replay(
    ctx: typer.Context,
    trace_path: Annotated[Path, typer.Argument(metavar="TRACE", help="A trace file (.npz, format version 1, 2 or 3).")],
    hw_name: Annotated[str | None, typer.Option("--hw", help="The machine: a GPU profile name or .toml path, NxPROFILE "
                                                         "or A+B for several GPUs, none for no GPU (default: the "
                                                         f"profile the trace was recorded on, else {DEFAULT_PROFILE}).")] = None,
    policy: Annotated[str, typer.Option(help="Comma-separated policies: all-resident, on-demand, prefetch-spec, "
                                              "prefetch-fom (alias prefetch), oracle.")] = REPLAY_POLICIES,
    cache_gib: Annotated[float | None, typer.Option(help="Cross-token expert cache on the device, GiB (0 = none; "
                                                         "default: the cache the trace was recorded with).")] = None,
    cache_experts: Annotated[int | None, typer.Option(help="The same cache sized in experts instead.")] = None,
    cache_per_layer: CachePerLayer = False,
    gpu_expert_gib: Annotated[float | None, typer.Option(help="GiB of the hottest experts (by --placement-from, or "
                                                              "--calibrate-on-replay) kept on the GPU: hot-experts' "
                                                              "budget (default: all that fit), or a copy policy's "
                                                              "pinned hot set.")] = None,
    eviction: Annotated[str | None, typer.Option(help="Cache eviction: lru or lfu (default: the recorded one, "
                                                      "else lru).")] = None,
    link_gbps: Annotated[float | None, typer.Option(help="Host-to-device GB/s (default: the link the trace "
                                                                      "recorded, on its own profile; else the profile's).")] = None,
    sim: Annotated[str, typer.Option(help="The simulator: simpy (the reference) or fast (the recurrence).")] = "simpy",
    engine: Engine = None,
    threads: Threads = None,
    gpu_layers: GpuLayers = "auto",
    offload_gib: OffloadGib = "auto",
    split_mode: opt.SplitMode = "layer",
    tensor_split: opt.TensorSplit = None,
    lookahead: Annotated[int | None, typer.Option(help="Prefetch the experts predicted this many MoE layers ahead "
                                                       "(default: the trace's; 1 = the next layer).")] = None,
    timing: Annotated[str, typer.Option(help="Compute times: auto (measured if the trace has them for this hw), "
                                              "profile (roofline) or measured.")] = "auto",
    model: Annotated[str | None, typer.Option(help="Check the trace against this model (errors on mismatch).")] = None,
    step: Annotated[int | None, typer.Option(help="Which decode step the report's timeline shows (from 0; "
                                                  "default 1, or 0 on a one-step trace).")] = None,
    validate: Annotated[bool, typer.Option("--validate", help="Compare with the trace's measured TPOT: replay its recorded "
                                                              "policy on its recorded profile and link, with its measured compute.")] = False,
    gamma: Annotated[str | None, typer.Option(help="Speculative traces: what-if over these verification budgets "
                                                   "(re-selecting on the recorded trees).")] = None,
    selection: Annotated[str, typer.Option(help=SD + "confidence,ecospec.")] = "confidence,ecospec",
    score: Annotated[str, typer.Option(help=SD + "EcoSpec score, ratio or lagrangian.")] = "ratio",
    lam: Annotated[str, typer.Option("--lambda", help=SD + "lambda values (lagrangian).")] = "0.05",
    depth: Annotated[int | None, typer.Option(help=SD + "cut the recorded trees to this depth.")] = None,
    branch: Annotated[int | None, typer.Option(help=SD + "keep this many children a node.")] = None,
    acceptance: Annotated[float | None, typer.Option(help=SD + "expected acceptance = this x a node's draft "
                                                          "probability, instead of the recorded path.")] = None,
    host: Host = None,
    cpu_layers: Annotated[str, typer.Option(help="cpu-static: MoE layers whose experts run on the CPU, or auto "
                                                 "(the fewest that fit device memory): llama.cpp's --n-cpu-moe (or "
                                                 "-ot ...=CPU).")] = "auto",
    placement_from: Annotated[Path | None, typer.Option(help="hot-experts: calibration trace whose routing picks "
                                                             "the GPU-resident experts.")] = None,
    calibrate_on_replay: Annotated[bool, typer.Option("--calibrate-on-replay", help="hot-experts: place from the "
                                                      "replayed trace itself (an optimistic bound).")] = False,
    amx: Annotated[bool, typer.Option("--amx/--no-amx", help="CPU-compute policies: use the host's AMX matrix rate "
                                                             "where it has one.")] = True,
    expert_dtype: Annotated[str | None, typer.Option(help="Store the routed experts in this format: bf16, fp8-block128, int8, "
                                                          "int4-g32, int4-g128, q8_0, q4_k, q5_k, q6_k, ...")] = None,
    copy_queue: Annotated[str | None, typer.Option(help="Copy queue (simpy engine): fifo, demand-first or "
                                                        "cancel-unstarted (default: the trace's, else fifo).")] = None,
    prefetch_top: Annotated[int | None, typer.Option(help="Prefetch only each token's M most confident predicted "
                                                          "experts.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV (every field) instead of a table.")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Write a report here: HTML, PNGs, CSV, Chrome trace.")] = None,
) -> None:
    """Replay a trace under one or more policies on a hardware profile.

    Prints TPOT (mean, p99, tokens/s), its compute / copy / stall breakdown, the bounds
    (serial copy+compute; ideal overlap), bytes moved, hit rates and TTFT, and names the
    profile, link and compute times it used.

    Example: `moesim replay run.npz --hw h100-sxm --policy on-demand,prefetch --cache-gib 8 --out run-report`
    """

    if out_dir is not None:
        check_output_dir(out_dir)  # before its lock file is made
    with holding(out_dir, "--out"):  # two runs on one report folder: the second refused (their files mixed)
        trace = read_trace(trace_path)
        if trace.speculative:
            return speculative_replay(trace, trace_path, hw_name, policies(policy) if policy != REPLAY_POLICIES else None,
                                      gamma, selection, score, lam, link_gbps, timing, (depth, branch, acceptance),
                                      as_json, as_csv, given_options(ctx))
        if sd := [o for o in ("--gamma", *SD_WHATIF_OPTIONS) if o in given_options(ctx)]:
            raise MoesimError(f"{', '.join(sd)}: for speculative-decoding traces (moesim speculate); this one is not")
        if validate:
            print_validation(trace, trace_path, hw_name, sim, as_json, out_dir, as_csv, copy_queue)
            return
        pols = policies(policy)
        if engine is not None and policy == REPLAY_POLICIES:  # none chosen: the defaults the engine runs (as whatif)
            pols = get_engine(engine).default_policies(pols)
        with progress_bar("replaying", "layer-steps", disable=as_json) as update:
            rep = run_replay(trace, hw_name, pols, model=model, step=step, where=trace_path,
                             cache_gib=cache_gib, cache_experts=cache_experts, eviction=eviction, sim=sim, engine=engine,
                             timing=timing, link_gbps=link_gbps, progress=update, expert_dtype=expert_dtype,
                             prefetch_top=prefetch_top, placement_from=placement_from, host=host,
                             cpu_layers=int(cpu_layers) if cpu_layers.isdigit() else cpu_layers,
                             calibrate_on_replay=calibrate_on_replay, amx=amx, copy_queue=copy_queue, threads=threads,
                             gpu_layers=int(gpu_layers) if gpu_layers.isdigit() else gpu_layers, split=split_mode,
                             offload_gib=one(auto_or(offload_gib, "--offload-gib", float), "--offload-gib"),
                             ratios=floats(tensor_split, "--tensor-split", repeats=True) if tensor_split is not None else None,
                             lookahead=lookahead, cache_per_layer=cache_per_layer, gpu_expert_gib=gpu_expert_gib)
        note = rep.note
        if as_json or as_csv:
            print_json(rep.rows) if as_json else print_csv(rep.rows)
        else:
            print_replay(rep, trace, sim)
        if out_dir is not None:

            with writing_report(out_dir):
                page = write_replay_report(trace, trace_path, rep.profile, rep.results, out_dir, rep.step)
            err.print(f"report: {page}")
        if note:
            err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)

