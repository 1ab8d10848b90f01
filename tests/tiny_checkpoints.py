"""Tiny random Hugging Face checkpoints for the recorder tests (tests only).

No weights can be downloaded, so the tests build their own with ``transformers``: seeded,
with the routers pushed far from ties so that the top-k is unambiguous and a recorded
routing can be compared exactly with one computed independently.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def save_random_checkpoint(cfg, path: Path, n_experts: int = 8) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] == n_experts:
                p.normal_(0, 1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3's sigmoid router: a bias that matters
                b.copy_(torch.linspace(-0.3, 0.3, b.numel()))
    model.save_pretrained(path)
    return path
