"""``moesim speculate``. Python: ``moesim.executor.runs.record_speculative(SpeculateRequest(...), out)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import err
from moesim.cli.options import command_of, holding, torch_threads
from moesim.cli.running import keeps_finished_work, progress_bar
from moesim.executor.defaults import DECODE_THREADS, DRAFT_MODEL, SHIPPED_MODEL
from moesim.fmt import number
from moesim.hardware import DEFAULT_PROFILE


@dataclass
class SpeculateArgs:
    """``moesim speculate``'s options as typed."""

    model: Annotated[str, typer.Option(help="Target checkpoint, or 'moe-stdlib'.")] = SHIPPED_MODEL
    draft: Annotated[str, typer.Option(help="Draft checkpoint (with its expert predictor), or 'moe-stdlib-draft'.")] = DRAFT_MODEL
    policy: Annotated[str, typer.Option(help="An exact policy for the target: all-resident, on-demand, prefetch-fom "
                                             "(prefetches the predicted union of each next layer).")] = "on-demand"
    selection: Annotated[str, typer.Option(help="confidence or ecospec.")] = "ecospec"
    score: Annotated[str, typer.Option(help="EcoSpec score: ratio (p / delta) or lagrangian (p - lambda * delta).")] = "ratio"
    lam: Annotated[float, typer.Option("--lambda", help="lambda of the Lagrangian score.")] = 0.05
    gamma: Annotated[int, typer.Option(help="Candidates verified per step (besides the root).")] = 4
    branch: Annotated[int, typer.Option(help="Children per node in the draft tree.")] = 2
    depth: Annotated[int, typer.Option(help="Depth of the draft tree.")] = 3
    tokens: Annotated[int, typer.Option(help="Tokens to produce.")] = 64
    hw_name: Annotated[str, typer.Option("--hw", help="Profile whose link the emulated link imitates.")] = DEFAULT_PROFILE
    link_gbps: Annotated[float | None, typer.Option(help="Override the profile's host-to-device GB/s.")] = None
    cache_experts: Annotated[int, typer.Option(help="Cross-token expert cache, in experts.")] = 0
    prompt: Annotated[str | None, typer.Option(help="Prompt text (default: a Python snippet).")] = None
    threads: Annotated[int, typer.Option(help="torch threads for compute (the emulated link uses its own thread).",
                                         callback=torch_threads)] = DECODE_THREADS
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (format version 3).")] = Path("speculate.npz")


@command_of(SpeculateArgs)
@keeps_finished_work
def speculate(a: SpeculateArgs) -> None:
    """Speculative decoding (greedy, lossless) with a draft tree on the offload engine,
    selecting the verified nodes by confidence or by EcoSpec's cost-aware score; records
    a trace with one record per verification step.

    Example: `moesim speculate --selection ecospec --gamma 2 --tokens 8 --link-gbps 0.5 --out sd.npz`,
    then `moesim replay sd.npz` replays it.
    """
    from moesim.executor.runs import SpeculateRequest, record_speculative  # torch: loaded when the command runs

    req = SpeculateRequest(a.model, a.draft, a.policy, a.selection, a.score, a.lam, a.gamma, a.branch, a.depth, a.tokens, a.hw_name, a.link_gbps,
                           a.cache_experts, a.prompt, a.threads)
    with holding(a.out_path, "--out"), progress_bar("speculating", "tokens") as update:  # a second run: refused
        rec, s = record_speculative(req, a.out_path, update)
    meta = rec.trace.meta
    err.print(f"wrote {rec.path}: {s.tokens} tokens in {s.steps} verification steps "
              f"({s.tokens_per_step:.2f} a step; the first token is the prefill's), {number(s.ms_per_token)} ms a token, "
              f"{s.distinct_experts_per_step:.1f} distinct experts a step; link: {meta.hw_profile} "
              f"at {number(meta.link_gbps)} GB/s")
