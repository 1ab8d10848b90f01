"""``moesim replay``'s options as one typed object (:class:`ReplayArgs`): the command and its
speculative-decoding view read them from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim.cli import options as opt
from moesim.cli.app import AsCsv, AsJson, auto_or, floats
from moesim.cli.options import CachePerLayer, Engine, GpuLayers, Host, OffloadGib, one
from moesim.hardware import DEFAULT_PROFILE
from moesim.setting import Setting
from moesim.sim.replay import TraceChanges, replay_setting

REPLAY_POLICIES = "on-demand,prefetch-fom,prefetch-spec,oracle"
SD = "Speculative traces, with --gamma: "


@dataclass
class ReplayArgs(opt.HostOptions):
    """``moesim replay``'s options as typed; :meth:`setting` and :meth:`changes` parse them
    into the replay's :class:`~moesim.setting.Setting` and
    :class:`~moesim.sim.replay.TraceChanges`."""

    ctx: typer.Context
    trace_path: Annotated[Path, typer.Argument(metavar="TRACE", help="A trace file (.npz, format version 1, 2 or 3).")]
    hw_name: Annotated[str | None, typer.Option("--hw", help="The machine: a GPU profile name or .toml path, NxPROFILE "
                                                         "or A+B for several GPUs, none for no GPU (default: the "
                                                         f"profile the trace was recorded on, else {DEFAULT_PROFILE}).")] = None
    policy: Annotated[str, typer.Option(help="Comma-separated policies: all-resident, on-demand, prefetch-spec, "
                                              "prefetch-fom (alias prefetch), oracle.")] = REPLAY_POLICIES
    cache_gib: Annotated[float | None, typer.Option(help="Cross-token expert cache on the device, GiB (0 = none; "
                                                         "default: the cache the trace was recorded with).")] = None
    cache_experts: Annotated[int | None, typer.Option(help="The same cache sized in experts instead.")] = None
    cache_per_layer: CachePerLayer = False
    gpu_expert_gib: Annotated[float | None, typer.Option(help="GiB of the hottest experts (by --placement-from, or "
                                                              "--calibrate-on-replay) kept on the GPU: hot-experts' "
                                                              "budget (default: all that fit), or a copy policy's "
                                                              "pinned hot set.")] = None
    eviction: Annotated[str | None, typer.Option(help="Cache eviction: lru or lfu (default: the recorded one, "
                                                      "else lru).")] = None
    link_gbps: Annotated[float | None, typer.Option(help="Host-to-device GB/s (default: the link the trace "
                                                                      "recorded, on its own profile; else the profile's).")] = None
    sim: Annotated[str, typer.Option(help="The simulator: simpy (the reference) or fast (the recurrence).")] = "simpy"
    engine: Engine = None
    gpu_layers: GpuLayers = "auto"
    offload_gib: OffloadGib = "auto"
    split_mode: opt.SplitMode = "layer"
    tensor_split: opt.TensorSplit = None
    lookahead: Annotated[int | None, typer.Option(help="Prefetch the experts predicted this many MoE layers ahead "
                                                       "(default: the trace's; 1 = the next layer).")] = None
    timing: Annotated[str, typer.Option(help="Compute times: auto (measured if the trace has them for this hw), "
                                              "profile (roofline) or measured.")] = "auto"
    model: Annotated[str | None, typer.Option(help="Check the trace against this model (errors on mismatch).")] = None
    step: Annotated[int | None, typer.Option(help="Which decode step the report's timeline shows (from 0; "
                                                  "default 1, or 0 on a one-step trace).")] = None
    validate: Annotated[bool, typer.Option("--validate", help="Compare with the trace's measured TPOT: replay its recorded "
                                                              "policy on its recorded profile and link, with its measured compute.")] = False
    gamma: Annotated[str | None, typer.Option(help="Speculative traces: what-if over these verification budgets "
                                                   "(re-selecting on the recorded trees).")] = None
    selection: Annotated[str, typer.Option(help=SD + "confidence,ecospec.")] = "confidence,ecospec"
    score: Annotated[str, typer.Option(help=SD + "EcoSpec score, ratio or lagrangian.")] = "ratio"
    lam: Annotated[str, typer.Option("--lambda", help=SD + "lambda values (lagrangian).")] = "0.05"
    depth: Annotated[int | None, typer.Option(help=SD + "cut the recorded trees to this depth.")] = None
    branch: Annotated[int | None, typer.Option(help=SD + "keep this many children a node.")] = None
    acceptance: Annotated[float | None, typer.Option(help=SD + "expected acceptance = this x a node's draft "
                                                          "probability, instead of the recorded path.")] = None
    host: Host = None
    cpu_layers: Annotated[str, typer.Option(help="cpu-static: MoE layers whose experts run on the CPU, or auto "
                                                 "(the fewest that fit device memory): llama.cpp's --n-cpu-moe (or "
                                                 "-ot ...=CPU).")] = "auto"
    placement_from: Annotated[Path | None, typer.Option(help="hot-experts: calibration trace whose routing picks "
                                                             "the GPU-resident experts.")] = None
    calibrate_on_replay: Annotated[bool, typer.Option("--calibrate-on-replay", help="hot-experts: place from the "
                                                      "replayed trace itself (an optimistic bound).")] = False
    expert_dtype: Annotated[str | None, typer.Option(help="Store the routed experts in this format: bf16, fp8-block128, int8, "
                                                          "int4-g32, int4-g128, q8_0, q4_k, q5_k, q6_k, ...")] = None
    copy_queue: Annotated[str | None, typer.Option(help="Copy queue (simpy engine): fifo, demand-first or "
                                                        "cancel-unstarted (default: the trace's, else fifo).")] = None
    prefetch_top: Annotated[int | None, typer.Option(help="Prefetch only each token's M most confident predicted "
                                                          "experts.")] = None
    as_json: AsJson = False
    as_csv: AsCsv = False
    out_dir: Annotated[Path | None, typer.Option("--out", help="Write a report here: HTML, PNGs, CSV, Chrome trace.")] = None

    def setting(self) -> Setting:
        """The knobs given; the cache, eviction and copy queue left out stay as recorded."""
        return replay_setting(
            sim=self.sim, timing=self.timing, engine=self.engine, **self.host_knobs(), link_gbps=self.link_gbps,
            cache_gib=self.cache_gib, cache_experts=self.cache_experts, eviction=self.eviction,
            cache_per_layer=self.cache_per_layer, copy_queue=self.copy_queue, lookahead=self.lookahead,
            gpu_expert_gib=self.gpu_expert_gib, calibrate_on_replay=self.calibrate_on_replay, host=self.host,
            cpu_layers=int(self.cpu_layers) if self.cpu_layers.isdigit() else self.cpu_layers,
            gpu_layers=int(self.gpu_layers) if self.gpu_layers.isdigit() else self.gpu_layers,
            offload_gib=one(auto_or(self.offload_gib, "--offload-gib", float), "--offload-gib"), split=self.split_mode,
            ratios=floats(self.tensor_split, "--tensor-split", repeats=True) if self.tensor_split is not None else None)

    def changes(self) -> TraceChanges:
        return TraceChanges(self.expert_dtype, self.prefetch_top, self.placement_from)
