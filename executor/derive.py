"""Files derived from a checkpoint: default vectors, the neural estimator, the expert predictor.

``moesim calibrate``, ``moesim train-estimator`` and ``moesim train-expert-predictor`` as
one call each. They write into ``out``: by default a new folder in the current directory
(``<model>-calibrated``, ``<model>-estimator``, ``<draft>-predictor``) that receives a copy
of the checkpoint plus the new files, so the folder is what a user then passes as
``--model`` (or ``--draft``). Writing into a shipped checkpoint needs ``force``: the
shipped files define what every other run measures. Every check runs before any work.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moesim import budget
from moesim.errors import MoesimError
from moesim.executor.corpus import describe_training_split, splits
from moesim.executor.default_vectors import calibrate, load_default_vectors, save_default_vectors
from moesim.executor.defaults import (
    OFFLINE_THREADS,
    check_calibrate_tokens,
    check_estimator_counts,
    check_predictor_counts,
)
from moesim.executor.estimator import DEFAULT_ESTIMATOR_TRAINING, EstimatorTraining, train_estimator
from moesim.executor.loading import check_derived_out, checkpoint_dir, derived_checkpoint
from moesim.executor.model import load_checkpoint
from moesim.executor.speculative import train_expert_predictor
from moesim.inputs import TEXT_CAP, read_bytes
from moesim.models import get_model


def _check_time(what: str, paths: list[Path], tokens: int, epochs: int = 0) -> None:
    """Refuse, before the checkpoints load, a pass that would take more than a day; announce a
    long one (moesim.budget.offline_estimate; the layers from each config.json, nothing loaded)."""
    layers = sum(get_model(str(p)).n_layers for p in paths)
    budget.check(budget.offline_estimate(f"{what} on {tokens} tokens of {' and '.join(p.name for p in paths)}",
                                         layers, tokens, epochs))


def default_out(source: Path, suffix: str) -> Path:
    """``./<checkpoint folder name>-<suffix>`` in the current directory."""
    return Path(f"{source.name}-{suffix}")


def calibrate_checkpoint(model: str, out: Path | None = None, text: Path | None = None, tokens: int = 32768,
                         force: bool = False, threads: int = OFFLINE_THREADS,
                         progress: Callable[[int, int], None] | None = None) -> tuple[Path, int, str]:
    """Default vectors for the quasi-hidden predictor, from ``text`` (bytes) or the start of
    the corpus's training split; returns (folder written, tokens used, what the text was).
    ``progress(done, total)`` counts tokens."""
    path = checkpoint_dir(model)
    out = out or default_out(path, "calibrated")
    check_derived_out(path, out, force)
    check_calibrate_tokens(tokens)
    if text is not None:  # before the checkpoint loads: a device, a folder, a silent FIFO is one line (moesim.inputs)
        data, what = read_bytes(text, "calibration text", TEXT_CAP), str(text)
    else:
        data, _, desc = splits()
        what = describe_training_split(desc)
    if len(data[:tokens]) < 2:
        raise MoesimError(f"calibration text {what} holds {len(data)} byte(s): calibrate needs at least 2 tokens")
    _check_time("calibrating", [path], len(data[:tokens]))
    m = load_checkpoint(path)
    if m.spec.vocab != 256:
        raise MoesimError("calibrate reads text as bytes: it needs a byte-level (256-token) model")
    ids = torch.tensor(list(data[:tokens]), dtype=torch.long)
    torch.set_num_threads(threads)
    dv = calibrate(m, ids, progress=progress)
    out = derived_checkpoint(path, out, force)
    command = f"moesim calibrate --model {model}" + (f" --text {text}" if text else "") + f" --tokens {tokens}"
    save_default_vectors(out, dv, {"text": what, "tokens": int(ids.numel()), "command": command})
    return out, int(ids.numel()), what


def train_estimator_into(model: str, out: Path | None = None, tokens: int = 65536, eval_tokens: int = 16384,
                         cfg: EstimatorTraining = DEFAULT_ESTIMATOR_TRAINING, *, force: bool = False,
                         threads: int = OFFLINE_THREADS,
                         progress: Callable[[int, int, float], None] | None = None) -> tuple[Path, dict, int]:
    """Train the neural estimator (distillation on the training split of ``tokens``, held-out
    evaluation on ``eval_tokens``) as ``cfg`` says into ``out``; returns (folder, the record,
    the model's top-k)."""
    epochs, width, lr = cfg.epochs, cfg.width, cfg.lr
    path = checkpoint_dir(model)
    out = out or default_out(path, "estimator")
    check_estimator_counts(tokens, eval_tokens, epochs, width, lr)
    check_derived_out(path, out, force)
    train, held_out, _ = splits()
    _check_time("training the estimator", [path], min(tokens, len(train)) + min(eval_tokens, len(held_out)), epochs)
    m = load_checkpoint(path)
    dv = load_default_vectors(path)
    if dv is None:
        raise MoesimError(f"{model} has no default vectors; run `moesim calibrate --model {model} --out DIR` "
                          "and train with --model DIR")
    if m.spec.vocab != 256:
        raise MoesimError("train-estimator reads the corpus as bytes: it needs a byte-level (256-token) model")
    torch.set_num_threads(threads)
    train_ids = torch.tensor(list(train[:tokens]), dtype=torch.long)
    eval_ids = torch.tensor(list(held_out[:eval_tokens]), dtype=torch.long)
    out = derived_checkpoint(path, out, force)
    rec = train_estimator(m, dv, train_ids, eval_ids, out, cfg, progress=progress)
    return out, rec, m.spec.top_k


def train_predictor_into(draft: str, model: str, out: Path | None = None, tokens: int = 32768,
                         eval_tokens: int = 8192, epochs: int = 20, force: bool = False,
                         threads: int = OFFLINE_THREADS,
                         progress: Callable[[int, int], None] | None = None) -> tuple[Path, dict, int]:
    """Train EcoSpec's expert predictor (draft hidden state -> target router logits) into
    ``out``, a copy of the draft; returns (folder, the record, the target's top-k)."""
    check_predictor_counts(tokens, eval_tokens, epochs)
    dpath, tpath = checkpoint_dir(draft), checkpoint_dir(model)
    out = out or default_out(dpath, "predictor")
    check_derived_out(dpath, out, force)
    train, held_out, _ = splits()
    if min(tokens, eval_tokens) >= 1 and epochs >= 1:
        _check_time("training the expert predictor", [dpath, tpath],
                    min(tokens, len(train)) + min(eval_tokens, len(held_out)), epochs)
    d, t = load_checkpoint(dpath), load_checkpoint(tpath)
    if d.spec.vocab != t.spec.vocab:
        raise MoesimError("draft and target must share a vocabulary")
    torch.set_num_threads(threads)
    out = derived_checkpoint(dpath, out, force)
    rec = train_expert_predictor(d, t, torch.tensor(list(train[:tokens])), torch.tensor(list(held_out[:eval_tokens])),
                                 out, epochs, progress=progress)
    return out, rec, t.spec.top_k
