"""``moesim whatif``. Python: ``moesim.sim.whatif.whatif(WhatifOptions(models=..., hws=..., policies=...))``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import AsCsv, AsJson, auto_or, floats, ints, split
from moesim.cli.lists import policy_objects
from moesim.cli.options import (
    CachePerLayer,
    EngineAxis,
    GpuLayers,
    Host,
    HostOptions,
    OffloadGib,
    SplitMode,
    TensorSplit,
    command_of,
    ends_on_interrupt,
    holding,
)
from moesim.cli.running import progress_bar
from moesim.cli.whatif_views import show_whatif
from moesim.errors import MoesimError
from moesim.outputs import check_output_dir
from moesim.policy import WHATIF_POLICIES as DEFAULT_POLICIES
from moesim.sim.answer import CONTEXT_CAP
from moesim.sim.whatif import WhatifOptions, whatif_engines
from moesim.sim.whatif import whatif as run_whatif


@dataclass
class WhatifArgs(HostOptions):
    """``moesim whatif``'s options as typed (comma-separated lists as strings);
    :meth:`options` parses them into the sweep's :class:`~moesim.sim.whatif.WhatifOptions`."""

    trace_path: Annotated[Path | None, typer.Option("--trace", help="Sweep over this trace (else a synthetic one per model).")] = None
    model: Annotated[str, typer.Option(help="Comma-separated models (ignored with --trace: the trace's model).")] = "qwen3-30b-a3b"
    hw_names: Annotated[str, typer.Option("--hw", help="Comma-separated machines: a GPU profile or .toml path, "
                                                       "NxPROFILE or A+B for several GPUs, none for no GPU.")] = "a6000,h100-sxm,gh200"
    policy: Annotated[str | None, typer.Option(help="Comma-separated policies (default: "
                                                    f"{','.join(DEFAULT_POLICIES)}; with --engine, those it runs).")] = None
    link_gbps: Annotated[str | None, typer.Option(help="Comma-separated host-to-device GB/s (default: each profile's own).")] = None
    cache_gib: Annotated[str, typer.Option(help="Comma-separated cross-token cache sizes, GiB.")] = "0,8,16"
    eviction: Annotated[str, typer.Option(help="Cache eviction: lru or lfu.")] = "lru"
    cache_per_layer: CachePerLayer = False
    tokens: Annotated[int, typer.Option(help="Decode steps of the synthetic trace.")] = 256
    prompt_len: Annotated[str, typer.Option(help="Comma-separated prompt lengths of the synthetic traces (an axis).")] = "128"
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes of the synthetic traces (an axis).")] = "1"
    expert_dtype: Annotated[str | None, typer.Option(help="Comma-separated expert formats (an axis): bf16, fp8-block128, int8, "
                                                          "int4-g128, q4_k, ... (default: the model's own).")] = None
    host: Host = None
    cpu_layers: Annotated[str | None, typer.Option(help="cpu-static: comma-separated MoE-layer counts on the CPU or "
                                                        "auto (default: auto and 1/4, 1/2, all of them): llama.cpp's "
                                                        "--n-cpu-moe (or -ot ...=CPU).")] = None
    gpu_layers: GpuLayers = "auto"
    offload_gib: OffloadGib = "auto"
    gpu_expert_gib: Annotated[str, typer.Option(help="hot-experts: comma-separated GiB of experts kept on the GPU, "
                                                     "or auto (all that fit): KTransformers' --kt-num-gpu-experts "
                                                     "(per layer).")] = "auto"
    copy_queue: Annotated[str, typer.Option(help="Prefetching policies: comma-separated copy queues: fifo, "
                                                 "demand-first, cancel-unstarted (non-fifo rows run on SimPy).")] = "fifo"
    prefetch_top: Annotated[str | None, typer.Option(help="Prefetching policies: comma-separated M, prefetch only "
                                                          "the M most confident predicted experts.")] = None
    placement_from: Annotated[Path | None, typer.Option(help="With --trace: calibration trace whose routing places "
                                                             "hot-experts (and warms cpu-on-miss).")] = None
    calibrate_on_replay: Annotated[bool, typer.Option("--calibrate-on-replay", help="hot-experts: place from the "
                                                      "swept trace itself (rows marked optimistic).")] = False
    goal: Annotated[str, typer.Option(help="What 'best' means: tpot, p99, ttft or bytes.")] = "tpot"
    engine: EngineAxis = None
    split_mode: SplitMode = "layer"
    tensor_split: TensorSplit = None
    host_ram_gb: Annotated[float | None, typer.Option(help="The host's RAM, GB (default: the host profile's, if it "
                                                           "gives one): weights beyond it page from disk or do not "
                                                           "fit.")] = None
    lookahead: Annotated[str | None, typer.Option(help="Prefetching: comma-separated MoE layers ahead the "
                                                       "predictions are made (an axis of the synthetic traces; "
                                                       "default 1).")] = None
    sim: Annotated[str, typer.Option(help="The simulator: fast (default for sweeps) or simpy.")] = "fast"
    jobs: Annotated[int, typer.Option(help="Worker processes (0 = all cores; local backend).")] = 0
    backend: Annotated[str, typer.Option(help="local (process pool on this machine) or ray (a Ray cluster: "
                                              "docs/cluster.md).")] = "local"
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: RAY_ADDRESS, else a new local "
                                                     "Ray).")] = None
    rows_csv: Annotated[Path | None, typer.Option("--rows", help="Stream every row to this CSV as it finishes; run "
                                                                 "the same sweep again to resume from it.")] = None
    ctx: Annotated[int | None, typer.Option("--ctx", help="The context you will serve, tokens: the printed engine "
                                                          "commands' -c / --max-model-len and the memory it needs "
                                                          "(default: the engine's own).")] = None
    top: Annotated[int, typer.Option(help="Rows to print (all go to the CSV).")] = 15
    as_json: AsJson = False
    as_csv: AsCsv = False
    out_dir: Annotated[Path | None, typer.Option("--out", help="Report folder: HTML, PNG heatmaps and breakdown, CSV.")] = Path("moesim-whatif")

    def options(self) -> WhatifOptions:
        """The sweep these options ask for, each list parsed (a bad item: one line naming its option)."""
        return WhatifOptions(
            self.trace_path, split(self.model, "--model"), split(self.hw_names, "--hw"),
            policy_objects(self.policy) if self.policy is not None else None,
            floats(self.link_gbps, "--link-gbps") if self.link_gbps is not None else None,
            floats(self.cache_gib, "--cache-gib"), self.eviction, self.tokens, ints(self.prompt_len, "--prompt-len"),
            ints(self.batch, "--batch"), self.goal, self.sim, self.jobs or None, backend=self.backend,
            address=self.address, rows_csv=self.rows_csv,
            expert_dtypes=split(self.expert_dtype, "--expert-dtype") if self.expert_dtype is not None else None,
            hosts=split(self.host, "--host") if self.host is not None else None,
            cpu_layers=auto_or(self.cpu_layers, "--cpu-layers", int) if self.cpu_layers is not None else None,
            gpu_expert_gib=auto_or(self.gpu_expert_gib, "--gpu-expert-gib", float),
            copy_queues=split(self.copy_queue, "--copy-queue"),
            prefetch_top=ints(self.prefetch_top, "--prefetch-top") if self.prefetch_top is not None else None,
            placement_from=self.placement_from, calibrate_on_replay=self.calibrate_on_replay, engine=self.engine,
            **self.host_knobs(), gpu_layers=auto_or(self.gpu_layers, "--gpu-layers", int),
            lookaheads=ints(self.lookahead, "--lookahead") if self.lookahead is not None else None,
            host_ram_gb=self.host_ram_gb, cache_per_layer=self.cache_per_layer,
            offload_gib=auto_or(self.offload_gib, "--offload-gib", float), split=self.split_mode,
            ratios=floats(self.tensor_split, "--tensor-split", repeats=True) if self.tensor_split is not None else None)


@command_of(WhatifArgs)
def whatif(a: WhatifArgs) -> None:
    """Answer the deployment question: each policy family's best configuration, the winner and why.

    Sweeps models x hardware x policies x link bandwidth x cache size, and each family's
    own knobs (layers on CPU, hot-expert budget, copy queue, prefetch top-M, expert format,
    host), at each batch size and prompt length. Without `--trace` each model gets a
    **synthetic** trace (see `moesim synth`). Configurations that do not fit in device
    memory are marked and never chosen as best. The report (--out) plots where the winner
    changes along batch size, prompt length and link bandwidth.

    Example: `moesim whatif --model olmoe-1b-7b --hw a6000,gh200 --policy on-demand,prefetch,oracle,cpu-static
    --link-gbps 16,32 --cache-gib 0,1 --tokens 32 --jobs 1`
    """

    if a.top < 1:
        raise MoesimError(f"--top {a.top}: print at least one row")
    if a.ctx is not None and not 1 <= a.ctx <= CONTEXT_CAP:
        raise MoesimError(f"--ctx {a.ctx}: a context is 1 to {CONTEXT_CAP:,} tokens")
    if a.out_dir is not None:
        check_output_dir(a.out_dir)
    with holding(a.out_dir, "--out"):  # two runs on one report folder: the second refused in one line
        with progress_bar("simulating", "configurations", disable=a.as_json or a.as_csv) as update, ends_on_interrupt():
            engines = split(a.engine, "--engine") if a.engine is not None else [None]
            res = run_whatif(a.options(), update) if len(engines) == 1 else whatif_engines(a.options(), engines, update)
        if a.ctx is not None and a.engine is None:  # the context sizes printed commands, which need an engine
            res.notes.append("--ctx was given, but without --engine no command is printed: it changed nothing")
        show_whatif(res, a.goal, a.engine, a.top, a.as_json, a.as_csv, a.out_dir, a.ctx)
