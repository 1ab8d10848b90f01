"""The writer and reader side of the trace's record arrays: copies and speculative steps.

The executor records (``executor/profile.py``, ``executor/speculative.py``) and the
simulator replays (``sim/speculative.py``) through these functions, so the padding
sentinels of the format (``docs/trace-format.md``) are named and defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

COPY_FIELDS = ("copy_token", "copy_layer", "copy_expert", "copy_bytes", "copy_kind",
               "copy_issue_s", "copy_start_s", "copy_end_s")
COPY_KINDS = ("prefetch", "demand")  # copy_kind 0, 1

#: Speculative-decoding padding sentinels (version 2).
PAD_TOKEN = -1  # sd_tree_tokens beyond a step's candidates
ROOT_PARENT = -1  # sd_tree_parents of a child of the root
PAD_PARENT = -2  # sd_tree_parents beyond a step's candidates
NOT_CHOSEN = -1  # sd_chosen of a node not chosen for verification
PAD_EXPERT = -1  # sd_row_true beyond a step's verified rows


class CopyRecord(Protocol):
    """One host-to-device expert copy, as the executor's transport reports it."""

    layer: int
    expert: int
    nbytes: int
    kind: int  # index into COPY_KINDS
    issue: float
    start: float
    end: float


def copy_arrays(copies: Sequence[tuple[int, CopyRecord]]) -> dict[str, np.ndarray]:
    """The trace's copy records from (step, copy) pairs; times clamped to issue <= start <= end
    (a host thread's clock can read a start a hair before its issue)."""
    return {
        "copy_token": np.array([i for i, _ in copies], np.int32),
        "copy_layer": np.array([c.layer for _, c in copies], np.int16),
        "copy_expert": np.array([c.expert for _, c in copies], np.int16),
        "copy_bytes": np.array([c.nbytes for _, c in copies], np.int64),
        "copy_kind": np.array([c.kind for _, c in copies], np.uint8),
        "copy_issue_s": np.array([max(c.issue, 0.0) for _, c in copies], np.float64),
        "copy_start_s": np.array([max(c.start, c.issue, 0.0) for _, c in copies], np.float64),
        "copy_end_s": np.array([max(c.end, c.start, c.issue, 0.0) for _, c in copies], np.float64),
    }


@dataclass
class SDStep:
    """One verification step of speculative decoding, as recorded and as replayed.

    ``chosen`` lists candidate indices in the order chosen; ``node_pred[c][layer]`` and
    ``root_pred[layer]`` are predicted expert sets; ``row_true[r, layer]`` the true top-k
    of verified row r (the root first, then the chosen candidates), PAD_EXPERT padded.
    """

    tokens: list[int]
    parents: list[int]  # ROOT_PARENT for a child of the root
    prob: list[float]
    chosen: list[int]
    accepted: int  # rows accepted, the root included
    node_pred: np.ndarray  # bool [nodes, layers, experts]
    root_pred: np.ndarray  # bool [layers, experts]
    row_true: np.ndarray  # int [rows, layers, k]


def expert_mask(sets: Sequence[set[int]], n_experts: int) -> np.ndarray:
    """Per-layer expert sets as the bool [layers, experts] mask the ``sd_*_pred`` arrays hold."""
    mask = np.zeros((len(sets), n_experts), bool)
    for layer, es in enumerate(sets):
        mask[layer, sorted(es)] = True
    return mask


def sd_arrays(steps: Sequence[SDStep], n_layers: int, n_experts: int, top_k: int) -> dict[str, np.ndarray]:
    """Encode steps into the ``sd_*`` routing arrays (timings are added by the caller)."""
    n_steps = len(steps)
    n_nodes = max(1, max((len(s.tokens) for s in steps), default=1))
    n_rows = 1 + max(1, max((len(s.chosen) for s in steps), default=1))
    tokens = np.full((n_steps, n_nodes), PAD_TOKEN, np.int32)
    parents = np.full((n_steps, n_nodes), PAD_PARENT, np.int16)
    prob = np.zeros((n_steps, n_nodes), np.float32)
    chosen = np.full((n_steps, n_nodes), NOT_CHOSEN, np.int16)
    node_pred = np.zeros((n_steps, n_nodes, n_layers, n_experts), bool)
    root_pred = np.zeros((n_steps, n_layers, n_experts), bool)
    row_true = np.full((n_steps, n_rows, n_layers, top_k), PAD_EXPERT, np.int16)
    for i, s in enumerate(steps):
        n = len(s.tokens)
        tokens[i, :n], parents[i, :n], prob[i, :n] = s.tokens, s.parents, s.prob
        for order, c in enumerate(s.chosen):
            chosen[i, c] = order
        node_pred[i, :n] = s.node_pred
        root_pred[i] = s.root_pred
        row_true[i, : s.row_true.shape[0]] = s.row_true
    return {"sd_tree_tokens": tokens, "sd_tree_parents": parents, "sd_tree_prob": prob, "sd_chosen": chosen,
            "sd_accepted": np.array([s.accepted for s in steps], np.int16),
            "sd_node_pred": node_pred, "sd_root_pred": root_pred, "sd_row_true": row_true}


def sd_steps(timings: dict[str, Any]) -> list[SDStep]:
    """Decode the ``sd_*`` arrays of a trace back into steps (padding dropped)."""
    out = []
    for s in range(len(timings["sd_accepted"])):
        parents = timings["sd_tree_parents"][s]
        n = int((parents != PAD_PARENT).sum())
        order = timings["sd_chosen"][s][:n]
        chosen = [int(c) for c in np.flatnonzero(order != NOT_CHOSEN)[np.argsort(order[order != NOT_CHOSEN],
                                                                                   kind="stable")]]
        out.append(SDStep(
            tokens=timings["sd_tree_tokens"][s][:n].tolist(), parents=parents[:n].tolist(),
            prob=timings["sd_tree_prob"][s][:n].tolist(), chosen=chosen, accepted=int(timings["sd_accepted"][s]),
            node_pred=timings["sd_node_pred"][s][:n], root_pred=timings["sd_root_pred"][s],
            row_true=timings["sd_row_true"][s],
        ))
    return out
