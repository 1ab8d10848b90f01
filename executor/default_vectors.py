"""Default vectors: per layer and expert, the mean output of the expert (the quasi-hidden
predictor's ``d_{l,e}``), calibrated on tokens and stored beside a checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from moesim.atomic import atomic_write, atomic_write_text
from moesim.executor.model import Hooks, MoEModel, ResidentExperts

DEFAULT_VECTORS = "default_vectors.safetensors"


@torch.no_grad()
def calibrate(model: MoEModel, tokens: torch.Tensor, chunk: int = 256,
              progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Per layer and expert, the mean output of the expert over the tokens routed to it
    (zero for an expert never chosen): the default vectors ``d_{l,e}``. [L, E, hidden], fp32.
    ``progress(done, total)`` counts tokens."""
    s = model.spec
    sums = torch.zeros(s.n_layers, s.n_experts, s.hidden)
    counts = torch.zeros(s.n_layers, s.n_experts)

    def accumulate(layer: int, e: int, rows: torch.Tensor, y: torch.Tensor) -> None:  # y [rows, hidden], ungated
        sums[layer, e] += y.float().sum(0).cpu()
        counts[layer, e] += rows.numel()

    hooks = Hooks(ResidentExperts(model, each=accumulate), logits="none")  # no LM head: only the experts matter
    for i in range(0, tokens.numel() - 1, chunk):
        model(tokens[i:i + chunk].view(1, -1).to(model.embed_tokens.weight.device), hooks=hooks)
        if progress is not None:
            progress(min(i + chunk, tokens.numel() - 1), tokens.numel() - 1)
    return sums / counts.clamp(min=1)[..., None]


def save_default_vectors(model_dir: Path, dv: torch.Tensor, description: dict) -> None:
    data = save({"default_vectors": dv.contiguous()})
    atomic_write(model_dir / DEFAULT_VECTORS, lambda f: f.write(data))
    atomic_write_text(model_dir / "calibration.json", json.dumps(description, indent=2) + "\n")


def load_default_vectors(model_dir: Path) -> torch.Tensor | None:
    path = Path(model_dir) / DEFAULT_VECTORS
    if not path.exists():
        return None
    return load_file(str(path))["default_vectors"]
