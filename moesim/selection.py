"""Speculative decoding's decisions as plain data: candidate trees, which nodes to verify
(confidence-only or EcoSpec's cost-aware greedy), and greedy acceptance.

The executor performs these decisions and the simulator's what-if re-runs them on
recorded trees; neither imports the other, and this module imports neither torch nor SimPy.

Selection strategies under a verification budget ``gamma``:

- ``confidence``: repeatedly take the candidate (child of a chosen node) with the highest
  cumulative draft probability;
- ``ecospec``: score each candidate by its cumulative probability ``p`` against its
  marginal expert cost ``delta`` = the number of its predicted experts, summed over layers,
  not yet in the step's expert buffer B (which starts with the root's predicted experts);
  score ``lagrangian`` = ``p - lam * delta`` or ``ratio`` = ``p / delta`` (a candidate that
  adds nothing scores above every one that does); take the best, add its experts to B.

Greedy selection is a prefix rule: the nodes chosen at budget gamma are the first gamma of
those chosen at any larger budget, so a what-if over several budgets selects once, at the
largest. :func:`select_bits` is the same decision on expert bit masks (numpy), for trees of
hundreds of candidates over a 94-layer model; a test holds it equal to :func:`select`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moesim.errors import MoesimError

SELECTIONS = ("confidence", "ecospec")
SCORES = ("lagrangian", "ratio")


def lambda_ok(lam: float) -> bool:
    """The Lagrangian score's lambda: a finite number >= 0 (NaN fails), wherever it is given."""
    return 0 <= lam < float("inf")


def check_lambda(lam: float) -> None:
    """One line for a lambda :func:`lambda_ok` refuses (replay's, speculate's and record's ``--lambda``)."""
    if not lambda_ok(lam):
        raise MoesimError(f"--lambda {lam:g}: the Lagrangian score's lambda must be a number >= 0"
                          + (" and finite" if lam == float("inf") else ""))


@dataclass
class Tree:
    """Candidates below the root: ``parents[i]`` is -1 (a child of the root) or an earlier index."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    prob: list[float] = field(default_factory=list)  # cumulative draft probability of the path
    experts: list[list[set[int]]] = field(default_factory=list)  # per node, per target layer: predicted experts

    def __len__(self) -> int:
        return len(self.tokens)


def score(p: float, delta: int, kind: str, lam: float) -> float:
    if kind == "lagrangian":
        return p - lam * delta
    if kind == "ratio":
        return p / delta if delta > 0 else 1e9 + p
    raise MoesimError(f"unknown score {kind!r}; known: {', '.join(SCORES)}")


def select(tree: Tree, gamma: int, strategy: str = "confidence", root_experts: list[set[int]] | None = None,
           kind: str = "ratio", lam: float = 0.1) -> list[int]:
    """Indices of up to ``gamma`` nodes, a tree (every parent chosen before its child),
    in the order chosen."""
    if strategy not in SELECTIONS:
        raise MoesimError(f"unknown selection {strategy!r}; known: {', '.join(SELECTIONS)}")
    chosen: list[int] = []
    buffer = [set(s) for s in root_experts] if root_experts else None
    open_ = {i for i, p in enumerate(tree.parents) if p == -1}
    while open_ and len(chosen) < gamma:
        if strategy == "confidence" or buffer is None:
            best = max(open_, key=lambda i: (tree.prob[i], -i))
        else:
            def cost(i: int) -> int:
                return sum(len(e - b) for e, b in zip(tree.experts[i], buffer, strict=True))

            best = max(open_, key=lambda i: (score(tree.prob[i], cost(i), kind, lam), -i))
            for b, e in zip(buffer, tree.experts[best], strict=True):
                b |= e
        chosen.append(best)
        open_.discard(best)
        open_ |= {i for i, p in enumerate(tree.parents) if p == best}
    return chosen


def accept(tree: Tree, chosen: list[int], target_next: list[int]) -> list[int]:
    """Greedy acceptance. ``target_next[j]`` is the target's argmax after input row j, where
    row 0 is the root and row 1 + n is ``chosen[n]``. Returns the accepted rows (0 first)."""
    row_of = {node: 1 + n for n, node in enumerate(chosen)}
    rows, node = [0], -1
    while True:
        want = target_next[rows[-1]]
        child = next((c for c in chosen if tree.parents[c] == node and tree.tokens[c] == want), None)
        if child is None:
            return rows
        rows.append(row_of[child])
        node = child


def pack_experts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Expert ids ``[..., k]`` (negative = padding) as bit masks ``[..., words]`` of uint64."""
    ids = np.asarray(ids)
    words = -(-n_experts // 64)
    out = np.zeros((*ids.shape[:-1], words), np.uint64)
    valid = ids >= 0
    safe = np.where(valid, ids, 0).astype(np.int64)
    bits = np.where(valid, np.left_shift(np.uint64(1), (safe % 64).astype(np.uint64)), np.uint64(0))
    for w in range(words):
        out[..., w] = np.bitwise_or.reduce(np.where(safe // 64 == w, bits, np.uint64(0)), axis=-1)
    return out


def _new_experts(node_bits: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    """Per node: its predicted experts not in ``buffer``, summed over layers (bit masks)."""
    return np.bitwise_count(node_bits & ~buffer).sum(axis=(-2, -1), dtype=np.int64)


def select_bits(parents, prob, gamma: int, strategy: str = "confidence", node_bits: np.ndarray | None = None,
                root_bits: np.ndarray | None = None, kind: str = "ratio", lam: float = 0.1) -> list[int]:
    """:func:`select` on bit masks: ``node_bits`` [nodes, layers, words] and ``root_bits``
    [layers, words] from :func:`pack_experts` (None: no predictions, confidence order).
    Same scores, same ties (the lowest index), same order."""
    if strategy not in SELECTIONS:
        raise MoesimError(f"unknown selection {strategy!r}; known: {', '.join(SELECTIONS)}")
    if kind not in SCORES:
        raise MoesimError(f"unknown score {kind!r}; known: {', '.join(SCORES)}")
    parents = np.asarray(parents, np.int64)
    prob = np.asarray(prob, np.float64)
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n + 1)]  # kids[p + 1]: children of node p (-1: the root)
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    is_open = np.zeros(n, bool)
    is_open[kids[0]] = True
    eco = strategy == "ecospec" and node_bits is not None and root_bits is not None
    if eco:
        buffer = np.array(root_bits, np.uint64, copy=True)
        cost = _new_experts(node_bits, buffer)
    chosen: list[int] = []
    while len(chosen) < gamma and is_open.any():
        idx = np.flatnonzero(is_open)
        if eco:
            p, d = prob[idx], cost[idx]
            s = p - lam * d if kind == "lagrangian" else np.where(d > 0, p / np.maximum(d, 1), 1e9 + p)
        else:
            s = prob[idx]
        best = int(idx[np.flatnonzero(s == s.max())[0]])
        if eco:
            new = node_bits[best] & ~buffer
            if new.any():
                buffer |= new
                cost -= np.bitwise_count(node_bits & new).sum(axis=(-2, -1), dtype=np.int64)
        chosen.append(best)
        is_open[best] = False
        is_open[kids[best + 1]] = True
    return chosen
