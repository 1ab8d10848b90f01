"""A compact encoding of per-node predicted experts: ids instead of masks (proposed format v3).

Version 2 stores ``sd_node_pred`` as a bool mask [steps, nodes, moe_layers, experts]. For
DeepSeek-V3 (58 MoE layers x 256 experts) x 30 nodes x 1000 steps that is 445 MB in
memory (on disk the compressed mask is far smaller). The same information as expert ids
[steps, nodes, moe_layers, k] int16, -1 padded, is 256 / (2 x 8) = 16x smaller for
DeepSeek-V3 (k = 8 predicted experts a layer). These two functions are the whole codec;
the synthetic generator (:mod:`moesim.traces.synthetic_speculative`) keeps its steps in
this form and only expands masks when a version-2 file is written.
"""

from __future__ import annotations

import numpy as np

PAD = -1  # an unused id slot


def mask_to_ids(mask: np.ndarray, width: int | None = None) -> np.ndarray:
    """bool [..., experts] -> int16 [..., width] ids in increasing order, ``PAD`` after the
    last one; ``width`` defaults to the most experts any row holds."""
    mask = np.asarray(mask, bool)
    counts = mask.sum(-1)
    width = int(counts.max(initial=0)) if width is None else width
    if counts.size and counts.max(initial=0) > width:
        raise ValueError(f"a row holds {int(counts.max())} experts; width {width} is too small")
    # Stable argsort of ~mask puts the set experts first, in increasing id order.
    order = np.argsort(~mask, axis=-1, kind="stable")[..., :width]
    ids = order.astype(np.int16)
    ids[np.arange(width) >= counts[..., None]] = PAD
    return ids


def ids_to_mask(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """int [..., width] ids (``PAD`` = none) -> bool [..., n_experts]."""
    ids = np.asarray(ids)
    mask = np.zeros((*ids.shape[:-1], n_experts + 1), bool)  # the extra column swallows PAD
    np.put_along_axis(mask, np.where(ids == PAD, n_experts, ids).astype(np.int64), True, axis=-1)
    return mask[..., :n_experts]
