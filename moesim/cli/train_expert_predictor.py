"""``moesim train-expert-predictor``. Python: ``moesim.executor.derive.train_predictor_into(draft, model, out, ...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err, out
from moesim.cli.options import holding, torch_threads
from moesim.cli.running import progress_bar
from moesim.executor.defaults import DRAFT_MODEL, OFFLINE_THREADS, SHIPPED_MODEL, check_predictor_counts


@app.command("train-expert-predictor")
def train_expert_predictor(
    draft: Annotated[str, typer.Option(help="Draft checkpoint directory, or 'moe-stdlib-draft'.")] = DRAFT_MODEL,
    model: Annotated[str, typer.Option(help="Target checkpoint directory, or 'moe-stdlib'.")] = SHIPPED_MODEL,
    tokens: Annotated[int, typer.Option(help="Training tokens (start of the corpus's training split).")] = 32768,
    eval_tokens: Annotated[int, typer.Option(help="Held-out tokens for the reported recall.")] = 8192,
    epochs: Annotated[int, typer.Option(help="Passes over the training tokens.")] = 20,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Draft checkpoint folder to write: the draft's own folder, "
                                                               "or a new one that gets a copy of the draft (default: "
                                                               "./DRAFT-predictor).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Allow --out to be a shipped checkpoint, or a folder holding "
                                                        "another model.")] = False,
    threads: Annotated[int, typer.Option(help="torch threads.", callback=torch_threads)] = OFFLINE_THREADS,
) -> None:
    """Train EcoSpec's expert predictor: per target layer, a linear probe from the draft's
    hidden state of a candidate token to the target router's logits (distilled with KL).
    Stored in a draft checkpoint folder (--out) with its held-out recall.
    Example: `moesim train-expert-predictor --tokens 512 --eval-tokens 256 --epochs 1`
    """
    check_predictor_counts(tokens, eval_tokens, epochs)  # before torch loads
    from moesim.executor.derive import train_predictor_into  # torch: loaded when the command runs

    with holding(out_dir, "--out"), progress_bar("training the expert predictor", "chunks and batches") as update:
        path, rec, k = train_predictor_into(draft, model, out_dir, tokens, eval_tokens, epochs, force, threads, update)
    out.print(f"held-out recall@{k} per target layer: " + ", ".join(f"{x:.3f}" for x in rec["recall_at_k"])
              + f" ({rec['parameters']} parameters, {rec['seconds']} s)")
    err.print(f"wrote {path}; use it with --draft {path}")
