"""Train the small learned-routing MoE that tests and validation use for real routing.

Random weights route meaninglessly, so prediction hit rates measured on them mean
nothing. This trains a Qwen3-MoE-style model (byte-level vocabulary, load-balancing
loss) on a corpus every machine has offline: the Python standard library's own source.
The checkpoint is written in the Hugging Face layout with ``training.json`` (command,
data, loss curve) and ``loss.png`` beside it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moesim import budget
from moesim.atomic import atomic_write_text
from moesim.executor.corpus import split_index, stdlib_corpus  # noqa: F401 (stdlib_corpus re-exported)
from moesim.executor.defaults import STDLIB_SOURCE, stdlib_spec  # noqa: F401 (re-exported)
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.model import ExecConfig, Hooks, MoEModel, ResidentExperts, count_params, save_checkpoint
from moesim.models import ModelSpec
from moesim.outputs import check_output_dir


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
        yield chunk[:, :-1], chunk[:, 1:]


def forward_train(model: MoEModel, experts: list[torch.nn.Parameter], tokens: torch.Tensor):
    """Differentiable forward: (logits, load-balancing loss summed over layers)."""
    s = model.spec
    aux: list[torch.Tensor] = []

    def balance(layer, x, logits, resid, ids, gates) -> None:  # Switch-Transformer balance loss, per layer
        frac = torch.bincount(ids.reshape(-1), minlength=s.n_experts).float() / ids.numel()
        aux.append(s.n_experts * (frac * logits.float().softmax(-1).mean(0)).sum())

    logits = model(tokens, hooks=Hooks(ResidentExperts(model, experts, on_route=balance)))  # [b, t, vocab]
    return logits, torch.stack(aux).sum()


STDLIB_SPEC = stdlib_spec()  # the shipped learned-routing model


@dataclass(frozen=True)
class TrainConfig:
    """One training run's schedule (``moesim train``'s options): ``steps`` of AdamW at peak
    ``lr`` (100 steps of warm-up, then a cosine), ``batch`` windows of ``seq`` bytes, the
    load-balancing loss at ``aux_coef``, ``seed`` for the weights and the batches, a
    checkpoint every ``save_every`` steps, ``threads`` torch threads."""

    steps: int = 3000
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    aux_coef: float = 0.01
    seed: int = 0
    threads: int = 1
    save_every: int = 500


DEFAULT_TRAINING = TrainConfig()  # the shipped checkpoint's schedule


def train(out: Path, cfg: TrainConfig = DEFAULT_TRAINING, spec: ModelSpec = STDLIB_SPEC, progress=None) -> dict:
    """Train ``spec`` as ``cfg`` says and write the checkpoint to ``out``: every
    ``cfg.save_every`` steps (with a held-out evaluation), at the end, and on Ctrl-C (whatever
    step it reached), each file atomically, so an interrupted run keeps a loadable checkpoint
    and an honest training.json. ``progress(step, steps, loss)`` after each step."""
    steps, batch, seq, lr, aux_coef = cfg.steps, cfg.batch, cfg.seq, cfg.lr, cfg.aux_coef
    seed, threads, save_every = cfg.seed, cfg.threads, cfg.save_every
    check_output_dir(out)  # before minutes of training, not after
    budget.check(budget.train_estimate(spec, steps, batch, seq))
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    data, desc = stdlib_corpus()
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = split_index(ids.numel())
    train_ids, eval_ids = ids[:split], ids[split:]
    exec_cfg = ExecConfig(spec, rope_theta=1e4, rms_eps=1e-6, max_seq_len=1024)
    model = MoEModel(exec_cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    s = exec_cfg.spec
    experts = [torch.nn.Parameter(torch.randn(s.n_experts, s.expert_weights) * 0.02) for _ in range(s.n_layers)]
    params = list(model.parameters()) + experts
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    it = batches(train_ids, batch, seq, gen)
    curve, evals = [], []
    t0 = time.time()

    def evaluate() -> float:
        eg = torch.Generator().manual_seed(1234)
        ev = batches(eval_ids, 8, seq, eg)
        with torch.no_grad():
            losses = [F.cross_entropy(forward_train(model, experts, x)[0].reshape(-1, 256), y.reshape(-1)).item()
                      for x, y in (next(ev) for _ in range(8))]
        return sum(losses) / len(losses)

    def save(done: int, status: str | None) -> dict:
        """Checkpoint, training.json and loss.png as of ``done`` steps, each written atomically."""
        model.experts = [[w.detach().clone() for w in layer] for layer in experts]
        record = {
            "command": f"moesim train --out {out} --steps {steps} --batch {batch} --seq {seq} --lr {lr} "
                       f"--aux-coef {aux_coef} --seed {seed} --threads {threads}"
                       + ("" if spec == STDLIB_SPEC else f" --layers {spec.n_layers} --experts {spec.n_experts} "
                          f"--top-k {spec.top_k} --hidden {spec.hidden} --inter {spec.expert_inter} "
                          f"--heads {spec.attention.n_heads} --name {spec.name}"),
            "data": {**desc, "train_bytes": split, "eval_bytes": ids.numel() - split, "vocabulary": "bytes (256)"},
            "model": s.to_dict(), "parameters": count_params(model), "steps": done, "tokens_seen": done * batch * seq,
            "wall_seconds": round(time.time() - t0, 1), "threads": threads, "machine": _machine(),
            "final_eval_loss_nats_per_byte": evals[-1]["eval_loss"] if evals else None, "curve": curve, "evals": evals,
            **({"status": status} if status else {}),
        }
        save_checkpoint(model, out, extra_config={"moesim_synthetic": False})
        atomic_write_text(out / "training.json", json.dumps(record, indent=2) + "\n")
        _plot(record, out / "loss.png")
        return record

    done, record = 0, None
    with stop_on_interrupt():
        try:
            for step in range(1, steps + 1):
                if stop_requested():
                    break
                warm = min(1.0, step / 100)
                for g in opt.param_groups:
                    g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
                x, y = next(it)
                logits, aux = forward_train(model, experts, x)
                loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                (loss + aux_coef * aux).backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                done = step
                if step % 25 == 0 or step == 1:
                    curve.append({"step": step, "loss": round(loss.item(), 4), "aux": round(aux.item() / s.n_layers, 4),
                                  "seconds": round(time.time() - t0, 1)})
                if step % save_every == 0 or step == steps:
                    evals.append({"step": step, "eval_loss": round(evaluate(), 4)})
                    partial = f"periodic checkpoint after {step} of {steps} steps (training went on)"
                    record = save(step, partial if step < steps else None)  # Ctrl-C keeps the latest
                if progress:
                    progress(step, steps, loss.item())
        except KeyboardInterrupt:  # a second Ctrl-C: the last periodic checkpoint stays
            if record is None:
                raise Interrupted("interrupted before the first checkpoint: nothing written") from None
            return record
        if done < steps and done > 0 and (record is None or record["steps"] < done):
            if not evals or evals[-1]["step"] != done:
                evals.append({"step": done, "eval_loss": round(evaluate(), 4)})
            record = save(done, f"stopped by Ctrl-C after {done} of {steps} steps (the learning-rate "
                                f"schedule was planned for {steps})")
    if record is None:
        raise Interrupted("interrupted before the first training step finished: nothing written")
    return record


def _machine() -> str:
    return f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, torch {torch.__version__}".strip()


def _plot(record: dict, path: Path) -> None:
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen (heavy, plots only)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([c["step"] for c in record["curve"]], [c["loss"] for c in record["curve"]], label="train (batch)")
    ax.plot([e["step"] for e in record["evals"]], [e["eval_loss"] for e in record["evals"]], "o-", label="held-out 5%")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy, nats per byte")
    ax.set_title(f"{record['model']['name']}: {record['parameters'] / 1e6:.2f}M parameters, Python stdlib bytes", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
