"""``moesim synth``: a synthetic trace. Python: ``moesim.traces.synthetic.synthetic_trace(spec, params)``
then ``moesim.traces.format.write_trace``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err


@app.command()
def synth(
    model: Annotated[str, typer.Option(help="Catalogue name or model directory.")] = "qwen3-30b-a3b",
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("synthetic.npz"),
    tokens: Annotated[int, typer.Option(help="Decode steps.")] = 256,
    batch: Annotated[int, typer.Option(help="Sequences decoded together.")] = 1,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens before decoding (sets KV-cache length and TTFT).")] = 128,
    skew: Annotated[float, typer.Option(help="Zipf exponent of each layer's expert popularity (0 = uniform).")] = 1.0,
    reuse: Annotated[float, typer.Option(help="Chance a token's expert is used again by the next token at that layer.")] = 0.3,
    hit_rate: Annotated[float, typer.Option(help="Per-expert prediction hit rate on most layers.")] = 0.85,
    early_hit_rate: Annotated[float, typer.Option(help="Hit rate on the first --early-layers MoE layers.")] = 0.5,
    early_layers: Annotated[int, typer.Option(help="How many early MoE layers predict poorly.")] = 2,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same trace).")] = 0,
) -> None:
    """Write a **synthetic** routing trace (marked synthetic in its header).

    Skewed per-layer popularity, token-to-token reuse and a per-layer prediction hit
    rate stand in for real routing, so every policy can be simulated before a real
    trace exists. The trace records no hardware: replaying it without `--hw` uses the
    default profile (moesim.hardware.DEFAULT_PROFILE), and says so.
    Example: `moesim synth --model olmoe-1b-7b --tokens 64 --out olmoe.npz`.
    """
    from moesim.models import get_model
    from moesim.outputs import check_output_file
    from moesim.traces.format import write_trace
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    check_output_file(out_path)
    params = SyntheticParams(tokens, batch, prompt_len, skew, reuse, hit_rate, early_hit_rate, early_layers, seed)
    trace = synthetic_trace(get_model(model), params)
    path = write_trace(trace, out_path)
    err.print(f"wrote synthetic trace {path} ({tokens} steps of {trace.model.name}, batch {batch})")
