"""From what a user names to what the executor runs: checkpoints, models, prompts, inputs.

A model argument is one of: the name of a shipped checkpoint (``moe-stdlib``, the
learned-routing model, or ``moe-stdlib-draft``, its draft), a checkpoint directory, or a
catalogue name, which gets seeded random weights (its routing is **synthetic**). The
shipped checkpoints live inside the installed package; :func:`is_shipped` is the one test
every writer uses before it may touch them (only with ``force``), because overwriting
them would silently change what every later run of the tool measures.
"""

from __future__ import annotations

import filecmp
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from moesim.errors import MoesimError
from moesim.executor.default_vectors import calibrate, load_default_vectors
from moesim.executor.defaults import DECODE_THREADS, DRAFT_MODEL, OFFLINE_THREADS, SHIPPED_MODEL  # noqa: F401
from moesim.executor.estimator import load_estimator
from moesim.executor.families import hf_spec
from moesim.executor.model import ExecConfig, MoEModel, load_checkpoint, random_model
from moesim.executor.runtime import predictor_inputs
from moesim.inputs import check_name
from moesim.models import CATALOGUE, ModelSpec, get_model
from moesim.outputs import check_output_dir
from moesim.policy import get_policy

CHECKPOINTS = Path(__file__).parent / "checkpoints"  # package data: moesim.models.shipped_checkpoint finds it by name
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shipped_model(name: str = SHIPPED_MODEL) -> Path:
    """A checkpoint that ships with moesim (inside the package: read, never write)."""
    return CHECKPOINTS / name


def is_shipped(path: str | Path) -> bool:
    """Whether ``path`` is, or lies inside, the shipped checkpoints."""
    root = CHECKPOINTS.resolve()
    p = Path(path).expanduser().resolve()
    return p == root or root in p.parents


def refuse_shipped(path: str | Path, force: bool) -> None:
    """One-line error, before any work, if ``path`` would write into a shipped checkpoint."""
    if is_shipped(path) and not force:
        raise MoesimError(f"{path} is a shipped checkpoint folder: refusing to overwrite it "
                          "(choose another --out, or pass --force to overwrite on purpose)")


def checkpoint_dir(name: str | Path) -> Path:
    """A shipped checkpoint's name, or a checkpoint directory (a Hugging Face cache folder
    ``models--ORG--NAME`` resolves to its one snapshot, :func:`resolve_snapshot`)."""
    path = shipped_model(str(name)) if str(name) in (SHIPPED_MODEL, DRAFT_MODEL) else check_name(Path(name), "checkpoint")
    if not path.is_dir():
        raise MoesimError(f"{name} is not a checkpoint directory")
    return resolve_snapshot(path)


def resolve_snapshot(path: Path) -> Path:
    """``path`` itself, or, for a Hugging Face cache folder (``models--ORG--NAME`` with
    ``snapshots/<hash>/config.json`` and no config.json of its own), its snapshot: the one
    there is, or the one ``refs/main`` names; several without a ref is one line."""
    path = Path(path)
    snaps = path / "snapshots"
    if (path / "config.json").is_file() or not snaps.is_dir():
        return path
    found = sorted(p for p in snaps.iterdir() if (p / "config.json").is_file())
    ref = path / "refs" / "main"
    if ref.is_file() and (snaps / ref.read_text().strip() / "config.json").is_file():
        return snaps / ref.read_text().strip()
    if len(found) == 1:
        return found[0]
    if not found:
        raise MoesimError(f"{path}: a Hugging Face cache folder with no snapshot holding a config.json")
    raise MoesimError(f"{path}: {len(found)} snapshots ({', '.join(p.name[:12] for p in found)}) and no refs/main; "
                      "pass the snapshot folder itself")


def check_derived_out(source: Path, out: Path, force: bool) -> None:
    """Errors, before any work, for an ``out`` that :func:`derived_checkpoint` must not write:
    a shipped checkpoint, or a folder holding something other than a copy of ``source``
    (both allowed with ``force``)."""
    refuse_shipped(out, force)
    check_output_dir(out)
    if force or out.resolve() == source.resolve() or not out.exists():
        return
    config = out / "config.json"
    if not out.is_dir() or (any(out.iterdir()) and not (
            config.exists() and filecmp.cmp(config, source / "config.json", shallow=False))):
        raise MoesimError(f"{out} exists and does not hold a copy of {source}; choose a new --out (or --force)")


def derived_checkpoint(source: Path, out: Path, force: bool) -> Path:
    """A checkpoint folder ``out`` to write files derived from ``source`` into.

    ``out`` is ``source`` itself (write beside the model), or a folder that first receives
    a copy of the checkpoint's files it lacks, so that ``out`` alone is a complete model to pass as
    ``--model`` (the checkpoints here are a few MB, and a copy leaves every reader as it is;
    a pointer to the source would make every loader follow it)."""
    check_derived_out(source, out, force)
    if out.resolve() == source.resolve():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and not (out / f.name).exists():  # a copy made earlier keeps what was derived in it
            tmp = out / f".{f.name}.tmp"
            shutil.copyfile(f, tmp)
            tmp.replace(out / f.name)
    return out


@dataclass
class LoadedModel:
    model: MoEModel
    synthetic: bool  # seeded random weights: routing is not learned
    source: str  # where it came from, recorded in traces
    path: Path | None  # the checkpoint directory, if any


def load_model(model: str, layers: int | None = None, dtype: str = "fp32", device: str = "cpu",
               seed: int = 0) -> LoadedModel:
    """A checkpoint directory, a shipped checkpoint, or a catalogue geometry with seeded
    random weights (optionally its first ``layers`` layers)."""
    dt = DTYPES.get(dtype)
    if dt is None:
        raise MoesimError(f"unknown dtype {dtype!r}; use fp32 or bf16")
    dev = torch.device(device)
    pin = dev.type == "cuda"
    path = shipped_model(model) if model in (SHIPPED_MODEL, DRAFT_MODEL) else check_name(Path(model), "model")
    if path.is_dir():
        path = resolve_snapshot(path)
        m = load_checkpoint(path, dt, pin=pin).to(dev)
        if layers:
            raise MoesimError("--layers applies to catalogue models, not checkpoints")
        return LoadedModel(m, False, str(path), path)
    if model.lower() not in CATALOGUE:
        get_model(model)  # raises the standard unknown-model error
    spec = get_model(model)
    if layers:
        spec = spec.with_layers(layers)
    m = random_model(ExecConfig(spec, rope_theta=1e6), seed=seed, dtype=dt, pin=pin)
    return LoadedModel(m.to(dev), True, f"catalogue {model} with seeded random weights (synthetic)", None)


def model_spec(model: str, layers: int | None = None) -> ModelSpec:
    """The spec :func:`load_model` will run, without loading weights (a checkpoint folder's
    as its family adapter reads it, a shipped checkpoint's, or a catalogue geometry's)."""
    path = shipped_model(model) if model in (SHIPPED_MODEL, DRAFT_MODEL) else check_name(Path(model), "model")
    spec = hf_spec(resolve_snapshot(path))[0] if path.is_dir() else get_model(str(model))
    return spec.with_layers(layers) if layers is not None else spec


def parse_prompt_ids(text: str | list[int] | None, vocab: int | None = None, option: str = "--prompt-ids") -> list[int] | None:
    """Token ids from ``1,2,3`` (or a list): non-empty integers in ``[0, vocab)``, else one line."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    if "" in parts and len(parts) > 1:  # "1,2,,3" ran as 1,2,3: an empty item is refused, as every list option does
        raise MoesimError(f"{option} {text!r}: an empty item; comma-separated token ids, e.g. 1,2,3")
    try:
        ids = [int(p) if isinstance(p, str) else p for p in parts if p != ""]
    except ValueError:
        raise MoesimError(f"{option} {text!r}: comma-separated token ids (integers), e.g. 1,2,3") from None
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise MoesimError(f"{option} {text!r}: at least one token id, integers only, e.g. 1,2,3")
    if vocab is not None and not all(0 <= i < vocab for i in ids):
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise MoesimError(f"{option}: token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def prompt_ids(model: MoEModel, text: str, prompt_len: int, batch: int, seed: int,
               ids: list[int] | None = None) -> torch.Tensor:
    """[batch, n] prompt: ``ids`` when given (checked against the vocabulary), else the
    text's bytes for byte-level models, else ``prompt_len`` seeded random ids."""
    if ids is not None:
        prompt = torch.tensor(parse_prompt_ids(ids, model.spec.vocab), dtype=torch.long)
    elif model.spec.vocab == 256:
        prompt = torch.tensor(list(text.encode()), dtype=torch.long)
    else:
        prompt = torch.randint(0, model.spec.vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    if prompt.numel() == 0:
        raise MoesimError("empty prompt")
    return prompt.view(1, -1).repeat(batch, 1)


def predictor_files(loaded: LoadedModel, name: str, policy: str, predictor: str, seed: int,
                    device: torch.device) -> tuple[torch.Tensor | None, tuple | None]:
    """(default vectors, estimator) that ``predictor`` reads under ``policy``
    (:func:`moesim.executor.runtime.predictor_inputs` says which). A synthetic model gets
    default vectors calibrated on seeded random ids; a missing file is an error only where
    the run needs it (the estimator whenever chosen; default vectors when prefetching)."""
    uses_dv, uses_est = predictor_inputs(policy, predictor)
    dv, est = None, None
    if uses_est:
        est = None if loaded.path is None else load_estimator(loaded.path)
        if est is None:
            raise MoesimError(f"{name} has no trained estimator; run `moesim train-estimator --model {name}` first")
        est = (est[0].to(device), est[1])
    if uses_dv:
        m = loaded.model
        if loaded.synthetic:
            dv = calibrate(m, torch.randint(0, m.spec.vocab, (1024,), generator=torch.Generator().manual_seed(seed)))
        else:
            dv = load_default_vectors(loaded.path)
        if dv is None and get_policy(policy).prefetches:
            raise MoesimError(f"{loaded.source} has no default vectors; run `moesim calibrate --model {name}` first")
        dv = dv.to(device) if dv is not None else None
    return dv, est
