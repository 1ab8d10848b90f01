"""``moesim train``. Python: ``moesim.executor.train.train(out, TrainConfig(steps, batch, seq, ...), stdlib_spec(...))``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moesim import budget
from moesim.cli.app import err
from moesim.cli.options import command_of, holding, torch_threads
from moesim.cli.running import keeps_finished_work
from moesim.errors import MoesimError
from moesim.executor.defaults import DECODE_THREADS, SHIPPED_MODEL, stdlib_spec
from moesim.outputs import check_output_dir


@dataclass
class TrainArgs:
    """``moesim train``'s options as typed."""

    out_dir: Annotated[Path | None, typer.Option("--out", help="Checkpoint folder to write (default: ./NAME-trained).")] = None
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 4000
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = 16
    seq: Annotated[int, typer.Option(help="Bytes per sequence.")] = 128
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay, 100 warm-up steps).")] = 3e-3
    aux_coef: Annotated[float, typer.Option(help="Weight of the load-balancing loss.")] = 0.01
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0
    threads: Annotated[int, typer.Option(help="CPU threads for torch.", callback=torch_threads)] = DECODE_THREADS
    name: Annotated[str, typer.Option(help="Model name.")] = SHIPPED_MODEL
    layers: Annotated[int, typer.Option(help="Layers.")] = 4
    experts: Annotated[int, typer.Option(help="Routed experts per layer.")] = 32
    top_k: Annotated[int, typer.Option(help="Experts per token.")] = 4
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128
    inter: Annotated[int, typer.Option(help="Expert intermediate size.")] = 64
    heads: Annotated[int, typer.Option(help="Attention heads (half as many KV heads).")] = 4
    force: Annotated[bool, typer.Option("--force", help="Allow --out to be a shipped checkpoint folder.")] = False


@command_of(TrainArgs)
@keeps_finished_work
def train(a: TrainArgs) -> None:
    """Train the small learned-routing MoE (default: 4 layers, 32 experts, top-4, bytes) on
    the Python standard library's source, on the CPU. Smaller geometries make drafts.

    Writes a Hugging Face style checkpoint plus training.json (this command, the data,
    the loss curve) and loss.png. The shipped checkpoint took 18 minutes on 2 cores (its
    training.json, wall_seconds).
    Example: `moesim train --steps 2 --batch 2 --seq 16 --out tiny-trained`
    """


    if min(a.steps, a.batch, a.seq, a.threads) < 1 or not 0 < a.lr < float("inf") or not 0 <= a.aux_coef < float("inf"):
        raise MoesimError("steps, batch, seq and threads must be >= 1, lr a positive number, aux-coef >= 0")
    if a.hidden % a.heads or a.heads < 2:
        raise MoesimError("--hidden must be a multiple of --heads (>= 2)")
    spec = stdlib_spec(a.name, a.layers, a.experts, a.top_k, a.hidden, a.inter, a.heads)
    budget.check(budget.train_estimate(spec, a.steps, a.batch, a.seq), warn=None)  # before torch loads (train warns)
    from moesim.executor import train as training  # torch: loaded when the command runs
    from moesim.executor.loading import refuse_shipped  # torch: loaded when the command runs

    out_dir = a.out_dir or Path(f"{a.name}-trained")
    refuse_shipped(out_dir, a.force)
    check_output_dir(out_dir)
    with holding(out_dir, "--out"), Progress(  # a second run on the folder: refused
            TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
            TimeRemainingColumn(), console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("train", total=a.steps, loss="")
        cfg = training.TrainConfig(a.steps, a.batch, a.seq, a.lr, a.aux_coef, a.seed, a.threads)
        record = training.train(out_dir, cfg, spec, lambda i, n, loss: bar.update(task, completed=i,
                                                                                   loss=f"loss {loss:.3f}"))
    err.print(f"wrote {out_dir}: held-out loss {record['final_eval_loss_nats_per_byte']} nats/byte "
              f"after {record['wall_seconds']} s")
