"""``moesim calibrate``. Python: ``moesim.executor.derive.calibrate_checkpoint(model, out, text, tokens)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err
from moesim.cli.options import holding, torch_threads
from moesim.cli.running import progress_bar
from moesim.executor.defaults import OFFLINE_THREADS, SHIPPED_MODEL, check_calibrate_tokens


@app.command()
def calibrate(
    model: Annotated[str, typer.Option(help="Checkpoint directory, or 'moe-stdlib'.")] = SHIPPED_MODEL,
    text: Annotated[Path | None, typer.Option(help="Calibration text file (byte-level models); default: the start of "
                                                   "the training split of the Python standard library corpus (the "
                                                   "held-out tail stays unseen for evaluation).")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens of calibration text to run.")] = 32768,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Checkpoint folder to write: the model's own folder, or "
                                                               "a new one that gets a copy of the model (default: "
                                                               "./MODEL-calibrated).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Allow --out to be a shipped checkpoint, or a folder holding "
                                                        "another model.")] = False,
    threads: Annotated[int, typer.Option(help="torch threads.", callback=torch_threads)] = OFFLINE_THREADS,
) -> None:
    """Compute the default vectors (per layer and expert, the mean expert output) that the
    quasi-hidden predictor needs, and store them with what was used in a checkpoint folder
    that `--model` then accepts.

    Example: `moesim calibrate --model moe-stdlib --tokens 512` (writes ./moe-stdlib-calibrated/)
    """
    check_calibrate_tokens(tokens)  # before torch loads
    from moesim.executor.derive import calibrate_checkpoint  # torch: loaded when the command runs

    with holding(out_dir, "--out"), progress_bar("calibrating", "tokens") as update:  # given: a second run refused
        path, n, what = calibrate_checkpoint(model, out_dir, text, tokens, force, threads, update)
    err.print(f"wrote {path / 'default_vectors.safetensors'} from {n} tokens of {what}; use it with --model {path}")
