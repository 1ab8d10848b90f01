"""``moesim profile``. Python: ``moesim.executor.runs.record_decode(DecodeRequest(...), out)``;
``--hardware``: ``moesim.executor.hwbench.measure_to_file(device, name, out, threads, step)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moesim.cli.app import err, out, table
from moesim.cli.options import command_of, given_options, holding, torch_threads
from moesim.cli.running import keeps_finished_work, progress_bar
from moesim.executor.defaults import DECODE_THREADS, SHIPPED_MODEL
from moesim.fmt import number
from moesim.hardware import DEFAULT_PROFILE, FIGURES
from moesim.outputs import check_output_file
from moesim.policy import check_eviction
from moesim.sim.whatif import profile_notes


@dataclass
class ProfileArgs:
    """``moesim profile``'s options as typed."""

    ctx: typer.Context
    model: Annotated[str, typer.Option(help="A checkpoint directory, 'moe-stdlib' (the shipped learned-routing model) "
                                            "or a catalogue name (seeded random weights: synthetic).")] = SHIPPED_MODEL
    policy: Annotated[str, typer.Option(help="all-resident, on-demand, prefetch-spec, prefetch-fom (alias prefetch), oracle; "
                                             "CPU-compute: cpu-static, hot-experts, cpu-on-miss.")] = "prefetch-fom"
    predictor: Annotated[str, typer.Option(help="For prefetch policies: quasi (quasi-hidden state with default vectors) "
                                                "stale (this layer's router input), oracle (true ids from an exact pre-pass), "
                                                "estimator (the trained neural estimator) or hybrid (per layer, the better "
                                                "of quasi and estimator on held-out text).")] = "quasi"
    device: Annotated[str, typer.Option(help="cpu (emulated link) or cuda.")] = "cpu"
    hw_name: Annotated[str, typer.Option("--hw", help="Profile whose link the CPU emulated link imitates (and recorded in the trace).")] = DEFAULT_PROFILE
    link_gbps: Annotated[float | None, typer.Option(help="Override the profile's host-to-device GB/s.")] = None
    tokens: Annotated[int, typer.Option(help="Decode steps.")] = 64
    batch: Annotated[int, typer.Option(help="Sequences decoded together.")] = 1
    prompt: Annotated[str | None, typer.Option(help="Prompt text (byte-level models; default: a Python snippet); "
                                                    "other models get --prompt-len random ids.")] = None
    prompt_len: Annotated[int, typer.Option(help="Prompt length for non-byte models.")] = 32
    prompt_ids: Annotated[str | None, typer.Option(help="Token ids instead of text, e.g. 1,2,3 (each in [0, vocab)); "
                                                        "with --batch every row gets them.")] = None
    cache_gib: Annotated[float, typer.Option(help="Cross-token expert cache, GiB.")] = 0.0
    cache_experts: Annotated[int, typer.Option(help="The same cache in experts.")] = 0
    eviction: Annotated[str, typer.Option(help="lru or lfu.")] = "lru"
    layers: Annotated[int | None, typer.Option(help="Keep only the first N layers of a catalogue model (to fit memory).")] = None
    dtype: Annotated[str, typer.Option(help="fp32 or bf16.")] = "fp32"
    temperature: Annotated[float, typer.Option(help="0 = greedy; else sampling temperature.")] = 0.0
    seed: Annotated[int, typer.Option(help="Seed for weights of synthetic models, prompts and sampling.")] = 0
    fidelity_tokens: Annotated[int, typer.Option(help="For speculative policies: tokens of the fixed evaluation text "
                                                      "over which agreement and KL are measured (0 = skip).")] = 128
    threads: Annotated[int, typer.Option(help="torch threads for compute (the emulated link uses its own thread).",
                                         callback=torch_threads)] = DECODE_THREADS
    host: Annotated[str | None, typer.Option(help="CPU-compute policies: host profile name or .toml whose figures "
                                                  "cpu-on-miss decides with (default: the --hw profile's host).")] = None
    cpu_layers: Annotated[str | None, typer.Option(help="cpu-static: MoE layers (the first ones) whose experts run "
                                                        "on the CPU, or auto (the fewest that fit the --hw device).")] = None
    placement_from: Annotated[Path | None, typer.Option(help="hot-experts (required) / cpu-on-miss (warms the cache): "
                                                             "calibration trace whose routing picks the hot experts.")] = None
    gpu_experts: Annotated[int | None, typer.Option(help="hot-experts: routed experts resident on the device (default: "
                                                         "as many as the --hw device memory holds).")] = None
    prefetch_top: Annotated[int | None, typer.Option(help="prefetch-fom, oracle: prefetch only each sequence's M most "
                                                          "confident predicted experts.")] = None
    lookahead: Annotated[int, typer.Option(help="prefetch-fom, prefetch-spec, oracle: MoE layer m's router predicts "
                                                "and prefetches MoE layer m+N (N from 1 to the MoE layers - 1).")] = 1
    copy_queue: Annotated[str, typer.Option(help="Emulated link's queue: fifo, demand-first (demand copies overtake "
                                                 "queued prefetch copies) or cancel-unstarted (also drops a "
                                                 "prefetch's unneeded unstarted tail).")] = "fifo"
    expert_dtype: Annotated[str | None, typer.Option(help="Quantise the routed experts (weight-only): int8, int4-g32 "
                                                          "or int4-g128; copies, device and CPU experts use them.")] = None
    out_path: Annotated[Path | None, typer.Option("--out", help="Trace file to write (default ./profile.npz; "
                                                               "with --hardware, ./NAME.toml).")] = None
    hardware: Annotated[bool, typer.Option("--hardware", help="Instead of decoding: microbenchmark this machine "
                                                              "(--device) and write a hardware profile.")] = False
    name: Annotated[str | None, typer.Option(help="With --hardware: the profile's name.")] = None


@command_of(ProfileArgs)
@keeps_finished_work
def profile(a: ProfileArgs) -> None:
    """Decode with the reference executor under a policy and record a trace.

    Routing, predictions, executed experts, per-layer timings (attention and router,
    expert compute, stalls, every copy's bytes and issue/start/end), per-token TPOT, the
    machine, per-layer hit rate and rank alignment, and for speculative policies the
    output fidelity against exact execution. On CPU an emulated link, paced to the
    profile's bandwidth and latency, moves the experts. Ctrl-C keeps the finished tokens.

    With `--hardware` it measures the machine instead (CUDA: host-to-device bandwidth and
    latency, device bandwidth, bf16 GEMM, launch overhead, NVML facts; CPU: matmul, memory,
    op overhead, the emulated link's limits) and writes a profile marked measured.

    Examples: `moesim profile --model tiny --policy prefetch-fom --link-gbps 0.5 --tokens 4 --out run.npz`,
    then `moesim replay run.npz --validate`; `moesim profile --hardware --name mybox` (long-running) writes ./mybox.toml.
    """

    check_eviction(a.eviction)  # before torch loads, as sweeps check it
    for note in profile_notes(a.policy, a.eviction, given_options(a.ctx), a.cache_gib > 0 or a.cache_experts > 0, a.hardware):
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if a.hardware:
        from moesim.executor.hwbench import MEASURE_STEPS, measure_to_file  # torch: loaded when the command runs

        total, done = MEASURE_STEPS["cuda" if a.device.startswith("cuda") else "cpu"], [0]
        with progress_bar("measuring", "steps") as update:
            def step(what: str) -> None:
                update(done[0], total, what)
                done[0] += 1

            prof, path = measure_to_file(a.device, a.name, a.out_path, a.threads, step)
        out.print(table(f"{prof.name} ({prof.link}), written to {path}", ("figure", "value", "unit", "how"),
                        [[k, f"{f.value:g}", FIGURES[k][0], f.source.split(": ", 1)[-1]] for k, f in prof.figures.items()]))
        if a.device == "cpu":
            host_file = path.with_name(f"{path.stem}-host.toml")
            out.print(f"this machine as a host (for --host, e.g. --hw none --host {host_file}): {host_file}")
        return

    from moesim.executor.runs import DecodeRequest, record_decode  # torch: loaded when the command runs

    check_output_file(a.out_path or Path("profile.npz"))  # before the progress bar: an error is then one line

    req = DecodeRequest(a.model, a.policy, a.predictor, a.device, a.hw_name, a.link_gbps, a.tokens, a.batch, a.prompt, a.prompt_len,
                        a.cache_gib, a.cache_experts, a.eviction, a.layers, a.dtype, a.temperature, a.seed, a.fidelity_tokens, a.threads,
                        host=a.host, cpu_layers=a.cpu_layers, placement_from=a.placement_from, gpu_experts=a.gpu_experts,
                        expert_dtype=a.expert_dtype, prefetch_top=a.prefetch_top, copy_queue=a.copy_queue,
                        lookahead=a.lookahead, prompt_ids=a.prompt_ids)
    with holding(a.out_path or Path("profile.npz"), "--out"), Progress(  # a second run on one file: refused
            TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err,
            transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("decode", total=a.tokens)
        rec = record_decode(req, a.out_path or Path("profile.npz"), lambda i, n: bar.update(task, completed=i))
    t = rec.trace.timings["tpot_s"]
    note = "" if rec.steps == rec.asked else f" (interrupted: kept {rec.steps} of {rec.asked} steps)"
    recall = [x for x in rec.trace.header["metrics"]["recall_at_k"] if x == x]
    fid = rec.extra.get("fidelity")
    meta = rec.trace.meta
    err.print(f"wrote {rec.path}{note}: {rec.steps} steps, TPOT {number(t.mean() * 1e3)} ms mean "
              f"(p90 {number(np.percentile(t, 90) * 1e3)}), TTFT {number(meta.prefill_s * 1e3)} ms"
              + (f", prediction recall@k {sum(recall) / len(recall):.3f}" if recall else "")
              + (f", fidelity: agreement {fid['next_token_agreement']:.3f}, KL {fid['mean_kl']:.2e}" if fid else "")
              + f"; link: {meta.hw_profile} at {number(meta.link_gbps)} GB/s"
              + (f", copy queue {a.copy_queue}" if a.copy_queue != "fifo" else "")
              + (f", lookahead {a.lookahead}" if a.lookahead != 1 else ""))
