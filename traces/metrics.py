"""Prediction quality over routing arrays: the one definition the executor (recording a
trace), the recorder of real models and the routing statistics share.

Arrays are ``[tokens, moe_layers, batch, top_k]`` expert ids, -1 where nothing was
predicted (always at the first MoE layer, which has no earlier router to predict from).
"""

from __future__ import annotations

import numpy as np


def routing_metrics(true_ids: np.ndarray, pred_ids: np.ndarray) -> dict[str, list[float]]:
    """Per MoE layer: recall@k (the share of true experts that were predicted) and rank
    alignment (the share of rows whose largest-gate true expert was predicted); NaN for a
    layer with no prediction."""
    has = (pred_ids >= 0).any(-1)  # [T, M, B]
    hit = (pred_ids[..., :, None] == true_ids[..., None, :]).any(-2)  # [T, M, B, k], per true expert
    recall, align = [], []
    for m in range(true_ids.shape[1]):
        sel = has[:, m]
        recall.append(float(hit[:, m][sel].mean()) if sel.any() else float("nan"))
        align.append(float(hit[:, m, :, 0][sel].mean()) if sel.any() else float("nan"))
    return {"recall_at_k": recall, "rank_alignment": align}


def recall_per_layer(true_ids: np.ndarray, pred_ids: np.ndarray) -> np.ndarray:
    """Recall@k per MoE layer (NaN where no prediction), as an array."""
    return np.array(routing_metrics(true_ids, pred_ids)["recall_at_k"])
