"""The executor's tiny random model with routing that means something (tests only).

Default initialisation makes every router logit nearly equal, so routing is a tie and
experts barely change the output; the tests that compare policies need routing decided by
the weights and experts whose output matters. One builder, so the executor, copy-queue,
speculative and estimator tests run on the same kind of model.
"""

from __future__ import annotations

import torch

from moesim.executor.model import ExecConfig, MoEModel, random_model
from moesim.models import ModelSpec, get_model


def sharp_tiny(seed: int = 1, spec: ModelSpec | None = None, expert_scale: float = 15.0) -> MoEModel:
    """``tiny`` (or ``spec``) with N(0, 0.3) matrices and experts scaled by ``expert_scale``."""
    model = random_model(ExecConfig(spec or get_model("tiny"), rope_theta=1e4), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    if expert_scale != 1:
        model.experts = [[w * expert_scale for w in row] for row in model.experts]
    return model
