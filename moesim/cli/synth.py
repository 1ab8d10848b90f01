"""``moesim synth``: a synthetic trace. Python: ``moesim.traces.synthetic.write_synthetic_trace(spec, params, path)``
(or ``synthetic_trace(spec, params)`` for the trace in memory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import err, floats
from moesim.cli.options import command_of, given_options, holding
from moesim.cli.running import progress_bar
from moesim.errors import MoesimError
from moesim.fmt import plural
from moesim.models import get_model
from moesim.outputs import check_output_file
from moesim.sim.stats import synth_like_file
from moesim.traces.format import read_trace
from moesim.traces.synthetic import SyntheticParams, write_synthetic_trace
from moesim.traces.synthetic_speculative import synth_speculative


@dataclass
class SynthArgs:
    """``moesim synth``'s options as typed."""

    ctx: typer.Context
    model: Annotated[str, typer.Option(help="Catalogue name or model directory.")] = "qwen3-30b-a3b"
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("synthetic.npz")
    tokens: Annotated[int, typer.Option(help="Decode steps.")] = 256
    batch: Annotated[int, typer.Option(help="Sequences decoded together.")] = 1
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens before decoding (sets KV-cache length and TTFT).")] = 128
    skew: Annotated[float, typer.Option(help="Zipf exponent of each layer's expert popularity (0 = uniform).")] = 1.0
    reuse: Annotated[float, typer.Option(help="Chance a token's expert is used again by the next token at that layer.")] = 0.3
    hit_rate: Annotated[float, typer.Option(help="Per-expert prediction hit rate on most layers.")] = 0.85
    early_hit_rate: Annotated[float, typer.Option(help="Hit rate on the first --early-layers MoE layers.")] = 0.5
    early_layers: Annotated[int, typer.Option(help="How many early MoE layers predict poorly.")] = 2
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same trace).")] = 0
    lookahead: Annotated[int | None, typer.Option(help="Predictions are made this many MoE layers ahead (hit rate: "
                                                        "the per-layer rate to this power; default 1, with --like "
                                                        "the trace's).")] = None
    draw_seed: Annotated[int | None, typer.Option(help="Seed of the routing draws only; the expert popularity stays "
                                                       "--seed's (a calibration twin: same hot experts, other "
                                                       "routing).")] = None
    like: Annotated[Path | None, typer.Option(help="Fit the generator to this (real) trace and stretch it to --tokens "
                                                   "and --batch (the model is the trace's).")] = None
    speculative: Annotated[bool, typer.Option("--speculative", help="A speculative-decoding trace (draft trees, "
                                                                    "acceptance, per-node routing): docs/speculative.md."
                                              )] = False
    branch: Annotated[int, typer.Option(help="--speculative: children per draft-tree node.")] = 2
    depth: Annotated[int, typer.Option(help="--speculative: levels of the draft tree.")] = 4
    accept: Annotated[str, typer.Option(help="--speculative: acceptance rate per depth (the last repeats).")] = "0.75,0.65,0.6,0.55"
    recall: Annotated[float, typer.Option(help="--speculative: the expert predictor's recall@k.")] = 0.7
    parent_overlap: Annotated[float | None, typer.Option(help="--speculative: chance a parent's expert recurs in its "
                                                              "child (default: the calibrated 0.06).")] = None
    sibling_overlap: Annotated[float | None, typer.Option(help="--speculative: chance a sibling's expert recurs "
                                                               "(default: the calibrated 0.24).")] = None


@command_of(SynthArgs)
def synth(a: SynthArgs) -> None:
    """Write a **synthetic** routing trace (marked synthetic in its header).

    Skewed per-layer popularity, token-to-token reuse and a per-layer prediction hit
    rate stand in for real routing, so every policy can be simulated before a real
    trace exists. The trace records no hardware: replaying it without `--hw` uses the
    default profile (moesim.hardware.DEFAULT_PROFILE), and says so.
    `--lookahead N` makes each prediction N MoE layers ahead (the first N layers have none).
    `--like TRACE` fits the generator to a real trace (per-layer popularity, reuse, hit
    rates, its lookahead) and stretches it to any length or batch; `--speculative` writes
    draft trees and per-node routing for the EcoSpec what-if (`--tokens` verification steps).
    Examples: `moesim synth --model olmoe-1b-7b --tokens 64 --out olmoe.npz`,
    `moesim synth --like olmoe.npz --tokens 128 --batch 2 --out stretched.npz`,
    `moesim synth --model olmoe-1b-7b --tokens 64 --lookahead 2 --out ahead.npz`,
    `moesim synth --speculative --model qwen3-235b-a22b --tokens 16 --out sd.npz`.
    """
    typed = given_options(a.ctx)
    spec_only = ["--branch", "--depth", "--accept", "--recall", "--parent-overlap", "--sibling-overlap"]
    plain_only = ["--batch", "--reuse", "--hit-rate", "--early-hit-rate", "--early-layers"]
    unused = [k for k in (plain_only if a.speculative else spec_only) if k in typed]
    if unused:
        err.print(f"note: {', '.join(unused)} {'apply' if len(unused) > 1 else 'applies'} to "
                  f"{'plain' if a.speculative else '--speculative'} synthetic traces: changed nothing", markup=False)
    if a.like is not None:  # the trace's model, popularity, reuse, hit rates and prompt length are used instead
        fitted = ["--model", "--prompt-len", "--skew", "--reuse", "--hit-rate", "--early-hit-rate", "--early-layers"]
        if given := [k for k in fitted if k in typed and k not in unused]:
            err.print(f"note: {', '.join(given)}: with --like these come from the trace: changed nothing",
                      markup=False, soft_wrap=True)
    if a.seed < 0:
        raise MoesimError(f"--seed {a.seed}: a whole number >= 0")
    if a.prompt_len < 1 and a.like is None:  # as whatif's: a decode starts from a prompt (TTFT 0.0 ms otherwise)
        raise MoesimError(f"--prompt-len {a.prompt_len}: a whole number >= 1")
    if a.speculative and (a.lookahead is not None or a.draw_seed is not None):
        raise MoesimError("--lookahead and --draw-seed apply to plain synthetic traces, not to --speculative")
    if a.like is not None and a.draw_seed is not None:
        raise MoesimError("--draw-seed: with --like the popularity is the trace's, so --seed alone sets the draws")
    check_output_file(a.out_path)  # before its lock: a path that cannot be written is that one line
    with holding(a.out_path, "--out"):  # two runs on one file: the second refused (its trace would replace the first's)
        if a.like is not None and a.speculative:  # acceptance, overlap and skew fitted to a speculative trace

            trace, _ = synth_speculative(read_trace(a.like).model, a.out_path, like=a.like, steps=a.tokens, seed=a.seed)
            err.print(f"wrote synthetic speculative trace {a.out_path} ({a.tokens} verification steps of {trace.model.name}, "
                      f"{trace.n_tokens} tokens accepted, parameters fitted to {a.like})")
            return
        if a.like is not None:

            spec = synth_like_file(a.like, a.out_path, a.tokens, a.batch, a.seed, lookahead=a.lookahead)
            err.print(f"wrote synthetic trace {a.out_path} ({plural(a.tokens, 'step')} of {spec.name}, batch {a.batch}, "
                      f"parameters fitted to {a.like})")
            return
        if a.speculative:

            # Routing defaults are the calibrated ones (docs/speculative.md); --skew other than its
            # default sets the Zipf exponent itself instead of the calibrated load ratio.
            given = {k: v for k, v in (("parent_overlap", a.parent_overlap), ("sibling_overlap", a.sibling_overlap))
                     if v is not None}
            if a.skew != 1.0:
                given |= {"skew": a.skew, "load_ratio": 0.0}
            trace, _ = synth_speculative(a.model, a.out_path, steps=a.tokens, branch=a.branch, depth=a.depth, seed=a.seed,
                                         accept=tuple(floats(a.accept, "--accept", repeats=True)), recall=a.recall, prompt_len=a.prompt_len,
                                         **given)
            err.print(f"wrote synthetic speculative trace {a.out_path} ({a.tokens} verification steps of {trace.model.name}, "
                      f"{trace.n_tokens} tokens accepted)")
            return

        params = SyntheticParams(a.tokens, a.batch, a.prompt_len, a.skew, a.reuse, a.hit_rate, a.early_hit_rate, a.early_layers, a.seed,
                                 lookahead=1 if a.lookahead is None else a.lookahead, draw_seed=a.draw_seed)
        spec = get_model(a.model)
        if a.early_layers > spec.n_moe_layers and "--early-layers" in typed:
            err.print(f"note: --early-layers {a.early_layers} is more than {spec.name}'s {spec.n_moe_layers} MoE layers: "
                      "every layer predicts at --early-hit-rate", markup=False, soft_wrap=True)
        with progress_bar("generating", "tokens") as update:  # drawn a chunk at a time into the file
            write_synthetic_trace(spec, params, a.out_path, progress=update)
        err.print(f"wrote synthetic trace {a.out_path} ({plural(a.tokens, 'step')} of {spec.name}, batch {a.batch})")
