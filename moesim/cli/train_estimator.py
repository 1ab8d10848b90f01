"""``moesim train-estimator``. Python: ``moesim.executor.derive.train_estimator_into(model, out, tokens, eval_tokens,
EstimatorTraining(epochs, width, lr, seed=...))``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moesim.cli.app import app, err, out, table
from moesim.cli.options import holding, torch_threads
from moesim.cli.running import keeps_finished_work
from moesim.executor.defaults import OFFLINE_THREADS, SHIPPED_MODEL, check_estimator_counts


@app.command("train-estimator")
@keeps_finished_work
def train_estimator(
    model: Annotated[str, typer.Option(help="Checkpoint directory with default vectors, or 'moe-stdlib'.")] = SHIPPED_MODEL,
    tokens: Annotated[int, typer.Option(help="Training tokens of the corpus (each gives one example per layer).")] = 65536,
    eval_tokens: Annotated[int, typer.Option(help="Held-out tokens for evaluation and the hybrid choice.")] = 16384,
    epochs: Annotated[int, typer.Option(help="Passes over the training examples (a checkpoint after each).")] = 6,
    width: Annotated[int, typer.Option(help="Hidden width of the estimator.")] = 256,
    lr: Annotated[float, typer.Option(help="Learning rate (AdamW).")] = 3e-3,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Checkpoint folder to write: the model's own folder, or "
                                                               "a new one that gets a copy of the model (default: "
                                                               "./MODEL-estimator).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Allow --out to be a shipped checkpoint, or a folder holding "
                                                        "another model.")] = False,
    threads: Annotated[int, typer.Option(help="torch threads.", callback=torch_threads)] = OFFLINE_THREADS,
) -> None:
    """Train the neural expert estimator by distillation and choose the hybrid predictor.

    The estimator maps the quasi-hidden state of layer l (plus a learned per-layer
    embedding) to layer l+1's router logits, trained with KL divergence to the true
    router's distribution on the model's own activations over the Python standard
    library's source (the training split); held-out text decides, per layer, whether
    the hybrid predictor uses the estimator or the router. Writes estimator.safetensors
    and estimator.json (record, per-layer recall, curve) into --out.

    Example: `moesim train-estimator --model moe-stdlib --tokens 512 --eval-tokens 256 --epochs 1 --width 16`
    """
    check_estimator_counts(tokens, eval_tokens, epochs, width, lr)  # before torch loads

    from moesim.executor.derive import EstimatorTraining, train_estimator_into  # torch: loaded when the command runs

    bar = Progress(TextColumn("training estimator"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[kl]}"),
                   TimeRemainingColumn(), console=err, disable=not err.is_terminal)
    task = bar.add_task("est", total=None, kl="")

    def progress(i: int, n: int, loss: float) -> None:
        bar.start()  # on the first epoch: a refused run prints nothing but its error
        bar.update(task, completed=i, total=n, kl=f"KL {loss:.3f}")

    try:
        with holding(out_dir, "--out"):  # given: a second run on the folder refused
            cfg = EstimatorTraining(epochs, width, lr, seed=seed)
            path, rec, k = train_estimator_into(model, out_dir, tokens, eval_tokens, cfg, force=force,
                                                threads=threads, progress=progress)
    finally:
        bar.stop()
    out.print(table(f"held-out recall@{k} predicting layer l+1 ({rec['parameters']} estimator parameters, "
                    f"{rec['train_seconds']} s training)", ("from layer", "router (quasi-hidden)", "estimator", "hybrid uses"),
                    [[str(i), f"{r:.3f}", f"{e:.3f}", h] for i, (r, e, h) in enumerate(zip(
                        rec["router_recall_at_k"], rec["estimator_recall_at_k"], rec["hybrid"], strict=True))], "right"))
    err.print(f"wrote {path}; use it with --model {path}")
