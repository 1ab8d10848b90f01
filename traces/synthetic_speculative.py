"""Synthetic speculative-decoding traces for any catalogue model (marked synthetic).

EcoSpec's gain depends on how the experts of the candidate tokens overlap: a verification
pass loads, per MoE layer, the union of the experts of every verified row, so candidates
that share experts with their parent, their siblings or the step's root are cheap and
candidates that scatter are expensive. A recorded tree exists only for the shipped tiny
model; this generator draws one for any model from parameters that each stand for one
physical property (see :class:`SpecSynthParams`), or fits those parameters to a recorded
trace (:func:`fit_params`, ``like=``).

Every step's whole draft tree is "verified" in the written trace (``sd_chosen`` covers
every node, confidence order) and the target's greedy path through the tree is drawn up
front, so a what-if that re-runs any selection on it knows the true experts and the
acceptance of every node exactly (no approximation, unlike a recorded trace). The header
says ``synthetic: true``; verification timings are zero (nothing was measured).

Routing of a node at a layer: Gumbel-top-k over the layer's Zipf(``skew``) popularity,
with each expert of the node's parent forced in with probability ``parent_overlap``, each
expert of its highest-ranked sibling with ``sibling_overlap``, and for a step's root each
expert of the previous step's last accepted row with ``step_overlap``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import numpy as np

from moesim import __version__, budget
from moesim.budget import Estimate
from moesim.errors import MoesimError
from moesim.models import ModelSpec, get_model
from moesim.selection import SCORES, SELECTIONS, Tree, pack_experts, select_bits
from moesim.traces.format import Trace, read_trace, write_trace
from moesim.traces.header import make_header
from moesim.traces.records import SDStep, sd_arrays, sd_steps
from moesim.traces.sd_ids import PAD, ids_to_mask, mask_to_ids

#: A written trace's sd_node_pred mask may not exceed this many bytes (write fewer steps,
#: or keep the steps in memory: the what-if never needs the masks).
MAX_MASK_BYTES = 256 << 20

# What drawing and writing steps costs, per unit (measured on a shared 2-core Xeon, Python
# 3.11, numpy 2.4, with moesim's own timing of generate(): central figures, so an estimate
# lands within 3x of the real time on this kind of machine; tests/test_ecospec_scale.py).
GEN_S_PER_KEY = 6.5e-8  # one Gumbel key: (1 + nodes) x MoE layers x experts, routing and prediction
GEN_S_PER_ROW = 5e-6  # Python bookkeeping per node
GEN_S_PER_STEP = 2.5e-3  # per step: Dirichlet draws, the path, per-level calls
GEN_KEY_BYTES = 16  # transient bytes per key (float32 keys, int64 partition indices)
WRITE_S_PER_MASK_BYTE = 6e-8  # expanding ids to the v2 mask and compressing it
TO_TRACE_S_PER_ROW = 2e-5  # confidence order and records per node


@dataclass(frozen=True)
class SpecSynthParams:
    """What each knob means physically (docs/speculative.md has the long form)."""

    steps: int = 256  # verification steps to draw
    branch: int = 2  # children the draft proposes per node (top-branch of its distribution)
    depth: int = 4  # levels of the draft tree (tokens ahead of the root)
    #: 0: a full tree (every node of a level has ``branch`` children). N > 0: a dynamic
    #: tree as EAGLE-2 grows it (Li et al., "EAGLE-2: Faster Inference of Language Models
    #: with Dynamic Draft Trees", arXiv:2406.16858): at each level only the N candidates of
    #: highest cumulative draft probability get children.
    expand: int = 0
    #: Per depth d = 1, 2, ...: the chance that the target's greedy token at depth d is one
    #: of the drafted children, given the path above was accepted (the last value repeats).
    #: Acceptance, ranks, draft confidence and recall are assumptions, not fitted: the shipped
    #: tiny draft agrees with its target 70-98% a depth, which says nothing of a large
    #: model's draft.
    accept: tuple[float, ...] = (0.75, 0.65, 0.6, 0.55)
    #: Given acceptance, which child (by draft rank) the target's token is (normalised).
    rank_share: tuple[float, ...] = (0.85, 0.15)
    #: Mean conditional draft probability of the rank-r child (the draft's confidence).
    child_prob: tuple[float, ...] = (0.6, 0.15)
    prob_concentration: float = 8.0  # Dirichlet concentration: high = every node near the means
    # Routing. The defaults are fitted (fit_params) to real trees: three recordings of the
    # shipped moe-stdlib target and draft, every node of every tree verified, so every
    # candidate's real routing is known (`python bench/bench_ecospec.py --calibrate` records
    # them and prints each fit; docs/speculative.md, "Calibration"). Each default is the mean
    # of the three fits, rounded; the range is the three fits'.
    skew: float = 1.0  # Zipf exponent of expert popularity per layer (0 = uniform); only when load_ratio = 0
    #: > 0: set the skew per model so that two unrelated tokens share ``load_ratio`` times the
    #: experts uniform routing would give them (1 + CV^2 of the experts' load; 1 = perfectly
    #: balanced), a property that carries across expert counts where a Zipf exponent does not.
    #: Fitted: 1.4 (1.32-1.51), the recorded roots' overlap 8+ steps apart over k / n_experts.
    load_ratio: float = 1.4
    #: Chance each expert of the parent (previous position) is forced to recur: the lift of a
    #: candidate's overlap with its parent over chance. Fitted: 0.06 (0.05-0.07).
    parent_overlap: float = 0.06
    #: Chance each expert of the top-ranked sibling (same position) recurs. Fitted: 0.24 (0.19-0.29).
    sibling_overlap: float = 0.24
    #: Chance each expert of the last accepted row recurs in the next root. Fitted: 0.22 (0.08-0.45).
    step_overlap: float = 0.22
    #: How much the overlap rates vary between nodes: each node draws its own rates from a
    #: Beta with the means above and this concentration, the same rate in every layer (a
    #: candidate that continues its parent's word shares experts everywhere; one that jumps
    #: topic shares few). Low = nodes differ a lot (what EcoSpec exploits); high = all alike.
    #: Fitted to the spread of the per-node parent overlap: 1.2 (0.8-1.5).
    overlap_concentration: float = 1.2
    recall: float = 0.7  # the expert predictor's recall@k per node and layer
    prompt_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.branch < 1 or self.depth < 0 or self.prompt_len < 0 or self.expand < 0:
            raise MoesimError("synthetic speculative trace: steps >= 1, branch >= 1, depth >= 0, expand >= 0, "
                              "prompt_len >= 0")
        for name in ("parent_overlap", "sibling_overlap", "step_overlap", "recall"):
            if not 0 <= getattr(self, name) <= 1:
                raise MoesimError(f"synthetic speculative trace: {name} must be in [0, 1]")
        if not self.accept or any(not 0 <= a <= 1 for a in self.accept):
            raise MoesimError("synthetic speculative trace: accept rates must be in [0, 1]")
        for name in ("rank_share", "child_prob"):
            v = getattr(self, name)
            if not v or any(x < 0 for x in v) or sum(v) <= 0:
                raise MoesimError(f"synthetic speculative trace: {name} must be non-negative, not all zero")
        if sum(self.child_prob[: self.branch]) >= 1:
            raise MoesimError("synthetic speculative trace: child_prob of the drafted children must sum below 1")
        if self.load_ratio and self.load_ratio < 1:
            raise MoesimError("synthetic speculative trace: load_ratio is >= 1 (1 = balanced load), or 0 to use skew")
        if self.skew < 0 or self.prob_concentration <= 0 or self.overlap_concentration <= 0:
            raise MoesimError("synthetic speculative trace: skew >= 0, prob_concentration and "
                              "overlap_concentration > 0")

    def skew_for(self, spec: ModelSpec) -> float:
        """The Zipf exponent this model's popularity gets: ``skew``, or the one that gives
        ``load_ratio`` on its expert count and top-k (:func:`skew_for_load_ratio`)."""
        return skew_for_load_ratio(spec.n_experts, spec.top_k, self.load_ratio) if self.load_ratio else self.skew

    def rates(self, rng: np.random.Generator, mean: float, n: int) -> np.ndarray:
        """Per-node overlap rates: Beta(mean, overlap_concentration), one per node."""
        if mean <= 0 or mean >= 1:
            return np.full(n, mean)
        c = self.overlap_concentration
        return rng.beta(c * mean, c * (1 - mean), n)

    @property
    def level_sizes(self) -> list[int]:
        """Candidates at depth 1 .. depth (a full tree: branch ** d; a dynamic one: the
        ``expand`` best of the level above, ``branch`` children each)."""
        sizes, n = [], 1
        for _ in range(self.depth):
            n = (min(n, self.expand) if self.expand else n) * self.branch
            sizes.append(n)
        return sizes

    @property
    def nodes(self) -> int:
        return sum(self.level_sizes)

    def accept_at(self, d: int) -> float:
        return self.accept[min(d, len(self.accept)) - 1]

    def _per_rank(self, v: tuple[float, ...]) -> np.ndarray:
        """``v`` for ranks 0 .. branch-1; ranks past its end continue it geometrically (the
        ratio of its last two values, else halving)."""
        ratio = v[-1] / v[-2] if len(v) > 1 and v[-2] > 0 else 0.5
        out = [v[r] if r < len(v) else v[-1] * min(ratio, 0.9) ** (r - len(v) + 1) for r in range(self.branch)]
        return np.array(out, float)


@dataclass
class SynthStep:
    """One drawn verification step, kept compact (ids, not masks). Row 0 is the root,
    row 1 + i candidate i (breadth-first, children of a node by falling draft probability)."""

    root_token: int
    tokens: list[int]
    parents: list[int]  # -1: child of the root
    prob: list[float]  # cumulative draft probability
    path: list[int]  # the target's greedy path through the tree (candidate indices)
    bonus: int  # the target's token after the path (the next step's root)
    true_ids: np.ndarray  # int16 [1 + nodes, moe_layers, k]
    pred_ids: np.ndarray  # int16 [1 + nodes, moe_layers, k]
    _tree: Tree | None = field(default=None, repr=False, compare=False)
    _bits: np.ndarray | None = field(default=None, repr=False, compare=False)

    def tree(self) -> Tree:
        """The candidate tree with predicted expert sets (built once; selection only reads it)."""
        if self._tree is None:
            pred = [[set(r[r != PAD].tolist()) for r in self.pred_ids[1 + i]] for i in range(len(self.tokens))]
            self._tree = Tree(list(self.tokens), list(self.parents), list(self.prob), pred)
        return self._tree

    def root_pred(self) -> list[set[int]]:
        return [set(r[r != PAD].tolist()) for r in self.pred_ids[0]]

    def pred_bits(self, n_experts: int) -> np.ndarray:
        """The predicted experts of every row as bit masks [1 + nodes, layers, words] (built
        once), for :func:`moesim.selection.select_bits`."""
        if self._bits is None:
            self._bits = pack_experts(self.pred_ids, n_experts)
        return self._bits

    def order(self, gamma: int, strategy: str, score: str = "ratio", lam: float = 0.1, n_experts: int = 0) -> list[int]:
        """The nodes a selection verifies at budget ``gamma``, in the order it chooses them
        (the same decision as :func:`moesim.selection.select`, on bit masks)."""
        bits = self.pred_bits(n_experts or int(self.pred_ids.max()) + 1) if strategy == "ecospec" else None
        return select_bits(self.parents, self.prob, gamma, strategy, None if bits is None else bits[1:],
                           None if bits is None else bits[0], score, lam)


@dataclass
class SynthSpec:
    spec: ModelSpec
    params: SpecSynthParams
    steps: list[SynthStep] = field(default_factory=list)
    fitted_from: str = ""


def _popularity(rng: np.random.Generator, m: int, e: int, skew: float) -> np.ndarray:
    ranks = np.argsort(rng.random((m, e)), axis=1) + 1.0
    logp = -skew * np.log(ranks)
    return logp - np.log(np.exp(logp).sum(1, keepdims=True))


_LOAD_ROWS = 8192  # draws behind one load-ratio estimate (fixed seed: the same answer every run)


def load_ratio_of_skew(n_experts: int, top_k: int, skew: float) -> float:
    """E x sum(pi^2) / k^2 for the inclusion probabilities pi of top-k routing over a Zipf
    (``skew``) popularity: how many times more experts two unrelated tokens share than
    under uniform routing (1 + the squared coefficient of variation of the experts' load).
    Estimated from a fixed-seed sample (unbiased pair count), so it is deterministic."""
    rng = np.random.default_rng(12345)
    logp = -skew * np.log(np.arange(1, n_experts + 1, dtype=float))
    top = _top(_gumbel_keys(rng, (logp - np.log(np.exp(logp).sum()))[None], _LOAD_ROWS), top_k)
    c = np.bincount(top.ravel(), minlength=n_experts).astype(float)
    pairs = (c * (c - 1)).sum() / (_LOAD_ROWS * (_LOAD_ROWS - 1))
    return float(n_experts * pairs / top_k**2)


@lru_cache(maxsize=64)
def skew_for_load_ratio(n_experts: int, top_k: int, ratio: float) -> float:
    """The Zipf exponent whose load ratio (:func:`load_ratio_of_skew`) is ``ratio`` on this
    expert count and top-k (bisection; 0 for a ratio at or below that of uniform routing)."""
    if top_k >= n_experts or ratio <= load_ratio_of_skew(n_experts, top_k, 0.0):
        return 0.0
    lo, hi = 0.0, 4.0
    if load_ratio_of_skew(n_experts, top_k, hi) < ratio:
        return hi
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if load_ratio_of_skew(n_experts, top_k, mid) < ratio else (lo, mid)
    return round((lo + hi) / 2, 4)


#: Added to the key of a forced expert: above every Gumbel key (float32 keeps it exact enough).
_FORCE = np.float32(1e3)


def _gumbel_keys(rng: np.random.Generator, logp: np.ndarray, n: int) -> np.ndarray:
    """``logp`` plus independent Gumbel(0, 1) noise, [n, M, E] float32 (Gumbel = -log Exp(1))."""
    keys = rng.standard_exponential(size=(n, *logp.shape), dtype=np.float32)
    np.log(np.maximum(keys, np.float32(1e-30), out=keys), out=keys)  # a draw of exactly 0 would be log(0)
    np.subtract(logp[None].astype(np.float32), keys, out=keys)
    return keys


def _top(keys: np.ndarray, k: int) -> np.ndarray:
    """The k largest keys' indices per row and layer, largest first."""
    e = keys.shape[-1]
    idx = np.argpartition(keys, e - k, axis=-1)[..., e - k:]
    order = np.argsort(-np.take_along_axis(keys, idx, -1), axis=-1)
    return np.take_along_axis(idx, order, -1)


def _route(rng: np.random.Generator, logp: np.ndarray, k: int, forced: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Top-k per row and layer: Gumbel keys over the popularity (Gumbel-top-k draws k
    experts without replacement in proportion to popularity), with each id of every
    (ids [n, M, k], per-row probability [n]) source forced in with that probability.
    -> int16 [n, M, k]."""
    n = forced[0][0].shape[0] if forced else 1
    keys = _gumbel_keys(rng, logp, n)
    if forced:
        bump = np.zeros(keys.shape, bool)
        for ids, p in forced:
            hit = rng.random(ids.shape, dtype=np.float32) < np.asarray(p, np.float32)[:, None, None]
            at = ids.astype(np.intp)
            np.put_along_axis(bump, at, np.take_along_axis(bump, at, -1) | hit, axis=-1)
        keys += bump * _FORCE
    return _top(keys, k).astype(np.int16)


def _predict(rng: np.random.Generator, logp: np.ndarray, true: np.ndarray, recall: float) -> np.ndarray:
    """k predicted experts per row and layer: each true one kept with ``recall``, the rest
    drawn from the popularity among experts that are not true."""
    keys = _gumbel_keys(rng, logp, true.shape[0])
    kept = rng.random(true.shape, dtype=np.float32) < recall
    np.put_along_axis(keys, true.astype(np.intp), np.where(kept, np.float32(np.inf), np.float32(-np.inf)), axis=-1)
    k, e = true.shape[-1], keys.shape[-1]
    idx = np.argpartition(keys, e - k, axis=-1)[..., e - k:]
    return np.sort(idx, -1).astype(np.int16)


def generate(spec: ModelSpec, params: SpecSynthParams = SpecSynthParams()) -> SynthSpec:
    """Draw ``params.steps`` verification steps for ``spec`` (same seed, same steps)."""
    rng = np.random.default_rng(params.seed)
    m, e, k, b = spec.n_moe_layers, spec.n_experts, spec.top_k, params.branch
    if b > spec.vocab - 1:
        raise MoesimError(f"branch {b} exceeds the vocabulary of {spec.name}")
    logp = _popularity(rng, m, e, params.skew_for(spec))
    drafted = params._per_rank(params.child_prob)
    drafted *= min(1.0, 0.99 / drafted.sum())  # the drafted children leave some mass to the rest
    mean = np.append(drafted, 1 - drafted.sum())
    alpha = np.maximum(params.prob_concentration * mean, 1e-3)
    share = params._per_rank(params.rank_share)
    share = share / share.sum() if share.sum() > 0 else np.full(b, 1 / b)
    out = SynthSpec(spec, params)
    prev_last: np.ndarray | None = None  # true ids [1, M, k] of the previous step's last accepted row
    root_token = int(rng.integers(spec.vocab))
    for _ in range(params.steps):
        forced = [(prev_last, params.rates(rng, params.step_overlap, 1))] if prev_last is not None else []
        root = _route(rng, logp, k, forced) if forced else _route(rng, logp, k, [])
        tokens: list[int] = []
        parents: list[int] = []
        prob: list[float] = []
        rows = [root[0]]
        frontier = [-1]
        for _level in range(params.depth):
            parent_ids = np.stack([rows[0] if f == -1 else rows[1 + f] for f in frontier])  # [n, M, k]
            cond = np.sort(rng.dirichlet(alpha, size=len(frontier))[:, :b], axis=1)[:, ::-1]
            nf = len(frontier)
            first = _route(rng, logp, k, [(parent_ids, params.rates(rng, params.parent_overlap, nf))])
            level_rows = [first]
            if b > 1:
                rep = np.repeat(parent_ids, b - 1, axis=0)
                sib = np.repeat(first, b - 1, axis=0)
                no = nf * (b - 1)
                others = _route(rng, logp, k, [(rep, params.rates(rng, params.parent_overlap, no)),
                                               (sib, params.rates(rng, params.sibling_overlap, no))])
                level_rows.append(others.reshape(len(frontier), b - 1, m, k))
            new_frontier = []
            for j, f in enumerate(frontier):
                base = 1.0 if f == -1 else prob[f]
                toks = rng.choice(spec.vocab, size=b, replace=False).tolist()
                for r in range(b):
                    tokens.append(int(toks[r]))
                    parents.append(f)
                    prob.append(float(np.float32(base * cond[j, r])))  # as the trace stores it
                    rows.append(first[j] if r == 0 else level_rows[1][j, r - 1])
                    new_frontier.append(len(tokens) - 1)
            if params.expand and len(new_frontier) > params.expand:  # a dynamic tree: grow the best only
                frontier = sorted(sorted(new_frontier, key=lambda i: (-prob[i], i))[: params.expand])
            else:
                frontier = new_frontier
        true = np.stack(rows).astype(np.int16)
        pred = _predict(rng, logp, true, params.recall)
        # The target's greedy path: at each depth, one of the children with the depth's rate.
        path, node = [], -1
        for d in range(1, params.depth + 1):
            if rng.random() >= params.accept_at(d):
                break
            children = [i for i, p in enumerate(parents) if p == node]
            if not children:  # a dynamic tree did not grow this node: the target's token is not drafted
                break
            node = children[int(rng.choice(b, p=share))]
            path.append(node)
        children = {tokens[i] for i, p in enumerate(parents) if p == node}
        bonus = int(rng.integers(spec.vocab))
        while bonus in children:  # a rejection: the target's token is none of the drafted ones
            bonus = int(rng.integers(spec.vocab))
        out.steps.append(SynthStep(root_token, tokens, parents, prob, path, bonus, true, pred))
        prev_last = true[[1 + path[-1] if path else 0]]
        root_token = bonus
    return out


# --------------------------------------------------------------------------------------
# Writing a version-2 trace
# --------------------------------------------------------------------------------------


def to_trace(synth: SynthSpec) -> Trace:
    """The steps as a version-2 speculative trace: every node verified (``sd_chosen`` in
    confidence order), the accepted rows as the main routing arrays, zero timings."""
    spec, params, steps = synth.spec, synth.params, synth.steps
    m, e, k = spec.n_moe_layers, spec.n_experts, spec.top_k
    s, n = len(steps), max(1, params.nodes)
    if s * n * m * e > MAX_MASK_BYTES:
        raise MoesimError(f"a version-2 trace of {s} steps x {count(n)} nodes for {spec.name} needs a "
                          f"{s * n * m * e / 2**20:.0f} MiB expert mask; write fewer steps (the what-if does not "
                          "need the file)")
    encoded, accepted_rows, accepted_tokens = [], [], []
    for st in steps:
        c = len(st.tokens)
        prob = np.asarray(st.prob, np.float32)  # as stored: the file keeps float32 probabilities
        order = select_bits(st.parents, prob.astype(float), c, "confidence")  # = select(...) (tested), O(nodes)
        encoded.append(SDStep(tokens=list(st.tokens), parents=list(st.parents), prob=prob.tolist(), chosen=order,
                              accepted=1 + len(st.path), node_pred=ids_to_mask(st.pred_ids[1:], e),
                              root_pred=ids_to_mask(st.pred_ids[0], e),
                              row_true=np.concatenate([st.true_ids[:1], st.true_ids[1 + np.array(order, int)]])
                              if order else st.true_ids[:1]))
        accepted_rows += [st.true_ids[0]] + [st.true_ids[1 + p] for p in st.path]
        accepted_tokens += [st.root_token] + [st.tokens[p] for p in st.path]
    true_ids = np.stack(accepted_rows)[:, :, None, :].astype(np.int16)
    z1, zl, zm = np.zeros(s), np.zeros((s, spec.n_layers)), np.zeros((s, m))
    timings = {**sd_arrays(encoded, m, e, k), "sd_draft_s": z1, "sd_verify_s": z1.copy(),
               "sd_attn_s": zl, "sd_expert_s": zm, "sd_stall_s": zm.copy()}
    header = make_header(
        spec, policy="none", prompt_len=params.prompt_len, n_tokens=int(true_ids.shape[0]), batch=1,
        seed=params.seed, synthetic=True,
        recorded={"tool": f"moesim {__version__}", "how": "synthetic speculative routing, no timings"},
        generator={"name": "moesim.synthetic_speculative", **asdict(params), "fitted_from": synth.fitted_from},
        speculative={"gamma": n, "branch": params.branch, "depth": params.depth, "strategy": "confidence",
                        "score": "ratio", "lambda": 0.0, "draft": "synthetic",
                        "note": "synthetic: every node verified, so a re-selection knows every node's true experts "
                                "and acceptance; sd_*_s timings are zero (nothing measured)"},
    )
    rng = np.random.default_rng(params.seed + 1)
    prompt = rng.integers(0, spec.vocab, (1, params.prompt_len), dtype=np.int32)
    gates = np.full(true_ids.shape, 1.0 / k, np.float32)
    return Trace(header, prompt, np.array([accepted_tokens], np.int32), true_ids, gates,
                 np.full(true_ids.shape, -1, np.int16), np.zeros_like(gates), true_ids.copy(), timings)


def generate_cost(spec: ModelSpec, params: SpecSynthParams) -> tuple[float, float]:
    """(seconds, peak bytes) :func:`generate` needs for ``params`` on ``spec``, before it runs."""
    rows = 1.0 + params.nodes
    keys = rows * spec.n_moe_layers * spec.n_experts
    seconds = params.steps * (keys * GEN_S_PER_KEY + rows * GEN_S_PER_ROW + GEN_S_PER_STEP)
    kept = rows * (spec.n_moe_layers * spec.top_k * 2 * 2 + 120)  # true and predicted ids, tokens, parents, probs
    return seconds, params.steps * kept + keys * GEN_KEY_BYTES


def mask_bytes(spec: ModelSpec, params: SpecSynthParams) -> float:
    """Bytes of the sd_node_pred mask a written version-2 trace needs."""
    return float(params.steps) * max(1, params.nodes) * spec.n_moe_layers * spec.n_experts


def synth_estimate(spec: ModelSpec, params: SpecSynthParams, write: bool = True, fit_rounds: int = 0,
                   fit_spec: ModelSpec | None = None, fit_params_: SpecSynthParams | None = None):
    """What ``moesim synth --speculative`` will take (a :class:`moesim.budget.Estimate`):
    drawing ``params.steps`` trees, writing them, and with ``--like`` the fit's rounds."""
    seconds, peak = generate_cost(spec, params)
    if write:
        mask = mask_bytes(spec, params)
        seconds += mask * WRITE_S_PER_MASK_BYTE + params.steps * (1 + params.nodes) * TO_TRACE_S_PER_ROW
        peak += 2 * mask
    if fit_rounds and fit_spec is not None and fit_params_ is not None:
        f_s, f_b = generate_cost(fit_spec, fit_params_)
        seconds += (fit_rounds + 1) * f_s * 1.5  # each round generates, then measures (statistics)
        peak = max(peak, f_b)
    shape = f"{params.branch}-ary, depth {params.depth}" + (f", the best {params.expand} grown" if params.expand else "")
    return Estimate(f"{params.steps} synthetic verification steps of {spec.name} ({count(params.nodes)} candidates "
                    f"a tree: {shape})", peak, seconds)


def count(n: int) -> str:
    """A count for a message: 1,110 or, past a billion, 1.11e+40."""
    return f"{n:,}" if n < 10**9 else f"{float(n):.3g}"


def synthetic_sd_trace(spec: ModelSpec, params: SpecSynthParams = SpecSynthParams()) -> Trace:
    """One call for ``moesim synth --speculative``: draw and encode as a version-2 trace."""
    return to_trace(generate(spec, params))


# --------------------------------------------------------------------------------------
# Statistics (the same code measures a recorded trace and a synthetic one) and fitting
# --------------------------------------------------------------------------------------


@dataclass
class StepView:
    """What one verification step shows: the full draft tree, the verified nodes, their
    true experts, predictions, and the target's tokens after the root as far as known."""

    parents: list[int]
    prob: list[float]
    tokens: list[int]
    chosen: list[int]
    true: dict[int, np.ndarray]  # node (-1 = root) -> ids [M, k], verified nodes only
    pred: dict[int, np.ndarray]  # node (-1 = root) -> ids [M, k']
    accepted_path: list[int]  # accepted candidates in order
    known_next: list[int]  # the target's tokens after the root: accepted ones, then the bonus


def recorded_views(trace: Trace) -> list[StepView]:
    tm = trace.timings
    if "sd_accepted" not in tm:
        raise MoesimError("not a speculative-decoding trace (no sd_* records)")
    acc = tm["sd_accepted"].astype(int)
    starts = np.concatenate([[0], np.cumsum(acc)])
    toks = trace.token_ids[0]
    views = []
    for s, step in enumerate(sd_steps(tm)):
        chosen = step.chosen
        true = {-1: step.row_true[0]} | {c: step.row_true[1 + j] for j, c in enumerate(chosen)}
        pred = {-1: mask_to_ids(step.root_pred)} | {c: mask_to_ids(step.node_pred[c]) for c in chosen}
        parents, tokens = step.parents, step.tokens
        known = toks[starts[s] + 1: starts[s] + acc[s]].tolist()
        path, node = [], -1
        for t in known:
            node = next(c for c in chosen if parents[c] == node and tokens[c] == t)
            path.append(node)
        if s + 1 < len(acc):
            known.append(int(toks[starts[s + 1]]))
        views.append(StepView(parents, step.prob, tokens, chosen, true, pred, path, known))
    return views


def reselect(step: SynthStep, gamma: int, strategy: str, score: str = "ratio", lam: float = 0.1) -> tuple[list[int], int]:
    """(chosen nodes, tokens produced) of one synthetic step under a selection: the exact
    answer, since every node's truth is known."""
    chosen = step.order(gamma, strategy, score, lam)
    on = set(chosen)
    produced = 1
    for p in step.path:
        if p not in on:
            break
        produced += 1
    return chosen, produced


def synthetic_views(synth: SynthSpec, gamma: int, strategy: str, score: str = "ratio", lam: float = 0.1) -> list[StepView]:
    """The synthetic steps as a recording with this selection would have seen them."""
    views = []
    for st in synth.steps:
        chosen, produced = reselect(st, gamma, strategy, score, lam)
        path = st.path[: produced - 1]
        known = [st.tokens[p] for p in path]
        # The target's token after the last accepted row: the next path node's token when
        # the path went on (but was not verified), else the step's bonus.
        known.append(st.tokens[st.path[len(path)]] if len(path) < len(st.path) else st.bonus)
        true = {-1: st.true_ids[0]} | {c: st.true_ids[1 + c] for c in chosen}
        pred = {-1: st.pred_ids[0]} | {c: st.pred_ids[1 + c] for c in chosen}
        views.append(StepView(st.parents, st.prob, st.tokens, chosen, true, pred, path, known))
    return views


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over layers of |a & b| / k (ids, PAD ignored)."""
    return float(np.mean([len(set(x[x != PAD].tolist()) & set(y[y != PAD].tolist())) / x.shape[-1]
                          for x, y in zip(a, b, strict=True)]))


def statistics(views: list[StepView], depth: int, branch: int) -> dict[str, object]:
    """Acceptance and expert-overlap statistics of a sequence of verification steps."""
    trials, wins = np.zeros(depth + 1), np.zeros(depth + 1)
    ranks = np.zeros(branch)
    cond: list[list[float]] = [[] for _ in range(branch)]
    parent_ov, sib_ov, step_ov, recall, distinct = [], [], [], [], []
    by_rank: list[list[float]] = [[] for _ in range(branch)]
    prev_last = None
    for v in views:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(v.parents):
            kids.setdefault(p, []).append(i)
        for p, cs in kids.items():
            base = 1.0 if p == -1 else v.prob[p]
            for r, c in enumerate(sorted(cs, key=lambda c: -v.prob[c])[:branch]):
                cond[r].append(v.prob[c] / base if base > 0 else 0.0)
        verified = set(v.chosen)
        node = -1
        for d, t in enumerate(v.known_next, start=1):
            if d > depth:
                break
            trials[d] += 1
            cs = sorted(kids.get(node, []), key=lambda c: -v.prob[c])
            hit = next((c for c in cs if v.tokens[c] == t), None)
            if hit is None:
                break
            wins[d] += 1
            if cs.index(hit) < branch:
                ranks[cs.index(hit)] += 1
            if hit not in verified:
                break
            node = hit
        for c in v.chosen:
            parent_ov.append(_overlap(v.true[c], v.true[v.parents[c]]))
            rank = sorted(kids[v.parents[c]], key=lambda i: -v.prob[i]).index(c)
            if rank < branch:
                by_rank[rank].append(parent_ov[-1])
            sibs = [s for s in kids[v.parents[c]] if s in verified and s > c]
            sib_ov += [_overlap(v.true[c], v.true[s]) for s in sibs]
        for node_, ids in v.true.items():
            if node_ in v.pred and (v.pred[node_] != PAD).any():
                recall.append(_overlap(ids, v.pred[node_]))
        if prev_last is not None:
            step_ov.append(_overlap(v.true[-1], prev_last))
        prev_last = v.true[v.accepted_path[-1]] if v.accepted_path else v.true[-1]
        distinct.append(sum(len(set(np.concatenate([ids[layer] for ids in v.true.values()]).tolist()) - {PAD})
                            for layer in range(v.true[-1].shape[0])))
    mean = (lambda x: float(np.mean(x)) if len(x) else float("nan"))  # noqa: E731
    chance = chance_overlap(views)
    lift = (lambda x: (x - chance) / (1 - chance) if x == x and chance == chance and chance < 1  # noqa: E731
            else float("nan"))
    return {
        "steps": len(views),
        "tokens_per_step": mean([1 + len(v.accepted_path) for v in views]),
        "rows_per_step": mean([1 + len(v.chosen) for v in views]),
        "distinct_experts_per_step": mean(distinct),
        "accept_by_depth": [float(wins[d] / trials[d]) if trials[d] else float("nan") for d in range(1, depth + 1)],
        "accept_trials": trials[1:].astype(int).tolist(),
        "rank_share": (ranks / ranks.sum()).tolist() if ranks.sum() else [1.0] + [0.0] * (branch - 1),
        "child_prob": [mean(c) for c in cond],
        "child_prob_var": [float(np.var(c)) if len(c) > 1 else float("nan") for c in cond],
        "parent_overlap": mean(parent_ov), "parent_overlap_sd": float(np.std(parent_ov)) if parent_ov else float("nan"),
        "sibling_overlap": mean(sib_ov), "step_overlap": mean(step_ov),
        "parent_overlap_by_rank": [mean(x) for x in by_rank],
        "chance_overlap": chance, "parent_lift": lift(mean(parent_ov)), "sibling_lift": lift(mean(sib_ov)),
        "step_lift": lift(mean(step_ov)),
        "recall": mean(recall),
    }


def expert_burden(views: list[StepView], gammas: list[int], n_experts: int, top_k: int) -> list[dict[str, float]]:
    """Distinct experts per MoE layer a verification loads against the budget, when the
    root and the ``gamma`` verified nodes of highest cumulative draft probability are
    verified (confidence order; a view must have verified that many), and that count over
    what independent uniform routing of as many rows gives (``n_experts (1 - (1 - k/E)^rows)``):
    below 1, the rows share experts beyond chance (popularity and correlation)."""
    out = []
    for g in gammas:
        per_layer = []
        for v in views:
            order = [c for c in select_bits(v.parents, v.prob, len(v.parents), "confidence") if c in v.true][:g]
            if len(order) < g:
                continue
            rows = np.stack([v.true[-1]] + [v.true[c] for c in order])  # [rows, M, k]
            bits = np.bitwise_or.reduce(pack_experts(rows, n_experts), axis=0)  # [M, words]
            per_layer.append(float(np.bitwise_count(bits).sum(-1).mean()))
        if per_layer:
            uniform = n_experts * (1 - (1 - top_k / n_experts) ** (g + 1))
            d = float(np.mean(per_layer))
            out.append({"gamma": g, "distinct_per_layer": d, "uniform_independent": uniform, "ratio": d / uniform,
                        "steps": len(per_layer)})
    return out


def chance_overlap(views: list[StepView], gap: int = 8) -> float:
    """Mean overlap (|a & b| / k, layer by layer) of the roots of steps at least ``gap``
    apart: what two tokens with nothing in common but the model's expert popularity share.
    Against ``k / n_experts`` (uniform routing) it is the load ratio, 1 + CV^2 of the
    experts' load (:func:`load_ratio_of_skew`). Overlaps above it are lift."""
    roots = [v.true[-1] for v in views]
    if len(roots) <= gap:
        return float("nan")
    ids = np.stack(roots)  # [S, M, k]
    k = ids.shape[-1]
    bits = pack_experts(ids, int(ids.max()) + 1)
    total, n = 0.0, 0
    for i in range(len(roots) - gap):
        shared = np.bitwise_count(bits[i + gap:] & bits[i]).sum(-1)  # [S', M]
        total += float(shared.sum()) / k
        n += shared.size
    return total / n


def _fit_skew(trace: Trace) -> float:
    """Zipf exponent from the recorded rows' expert frequencies (log-frequency against
    log-rank, averaged over layers)."""
    rows = trace.timings["sd_row_true"]
    slopes = []
    for layer in range(rows.shape[2]):
        ids = rows[:, :, layer].ravel()
        counts = np.sort(np.bincount(ids[ids >= 0], minlength=trace.model.n_experts))[::-1].astype(float)
        counts = counts[counts > 0]
        if len(counts) > 2:
            slopes.append(-np.polyfit(np.log(np.arange(1, len(counts) + 1)), np.log(counts), 1)[0])
    return float(np.clip(np.mean(slopes), 0, 3)) if slopes else 1.0


def fit_params(trace: Trace, steps: int | None = None, seed: int = 0, rounds: int = 5) -> SpecSynthParams:
    """Parameters that reproduce a recorded speculative trace's acceptance and overlap
    statistics (``like=``). Acceptance, ranks, draft probabilities and recall are read off
    directly; so is the popularity, as the load ratio (:func:`chance_overlap` of roots far
    apart against uniform routing), which fixes the skew on any model. The three overlap
    knobs and their spread across nodes are then calibrated by a few fixed-point rounds
    (generate, select as the recording did, measure, correct), since popularity alone
    already makes experts recur. Distinct experts per step is not fitted: it is the check."""
    sp = trace.header.get("speculative", {})
    depth, branch = int(sp.get("depth", 3)), int(sp.get("branch", 2))
    gamma, strategy = int(sp.get("gamma", 4)), sp.get("strategy", "confidence")
    score, lam = sp.get("score", "ratio"), float(sp.get("lambda", 0.1))
    spec = trace.model
    target = statistics(recorded_views(trace), depth, branch)
    acc = [a if a == a else 0.5 for a in target["accept_by_depth"]]
    cp = [min(max(p, 1e-3), 0.99) if p == p else 0.1 for p in target["child_prob"]]
    if sum(cp) >= 0.999:
        cp = [p * 0.99 / sum(cp) for p in cp]
    m0, v0 = cp[0], target["child_prob_var"][0]
    conc = float(np.clip(m0 * (1 - m0) / v0 - 1, 0.5, 200)) if v0 == v0 and v0 > 0 else 8.0
    n_steps = steps or len(trace.timings["sd_accepted"])
    chance = target["chance_overlap"]
    load = float(chance * spec.n_experts / spec.top_k) if chance == chance else 0.0
    params = SpecSynthParams(
        steps=max(n_steps, 64), branch=branch, depth=depth, accept=tuple(acc), rank_share=tuple(target["rank_share"]),
        child_prob=tuple(cp), prob_concentration=conc, skew=_fit_skew(trace), load_ratio=max(load, 1.0) if load else 0.0,
        parent_overlap=0.3, sibling_overlap=0.2, step_overlap=0.3, overlap_concentration=2.0,  # fixed start
        recall=float(np.clip(target["recall"], 0, 1)) if target["recall"] == target["recall"] else 0.7,
        prompt_len=trace.prompt_len, seed=seed + 1000)
    knobs = ("parent_overlap", "sibling_overlap", "step_overlap")
    for _ in range(rounds):
        got = statistics(synthetic_views(generate(spec, params), gamma, strategy, score, lam), depth, branch)
        upd = {}
        for kn in knobs:
            want, have = target[kn], got[kn]
            if want == want and have == have:
                upd[kn] = float(np.clip(getattr(params, kn) + (want - have), 0, 1))
        want_sd, have_sd = target["parent_overlap_sd"], got["parent_overlap_sd"]
        if want_sd == want_sd and have_sd == have_sd and want_sd > 0 and have_sd > 0:
            upd["overlap_concentration"] = float(np.clip(params.overlap_concentration * (have_sd / want_sd) ** 2,
                                                         0.1, 1000))
        params = replace(params, **upd)
    return replace(params, steps=n_steps, seed=seed)


def check_selection(strategy: str, score: str) -> None:
    if strategy not in SELECTIONS:
        raise MoesimError(f"unknown selection {strategy!r}; known: {', '.join(SELECTIONS)}")
    if score not in SCORES:
        raise MoesimError(f"unknown score {score!r}; known: {', '.join(SCORES)}")


def synth_speculative(model: str | ModelSpec, out, params: SpecSynthParams | None = None, like=None,
                      **overrides) -> tuple[Trace, SpecSynthParams]:
    """The one call behind ``moesim synth --speculative``: parameters from ``params`` (or
    the defaults), or fitted to the recorded speculative trace at ``like``, then
    ``overrides`` (any :class:`SpecSynthParams` field), drawn for ``model`` and written
    atomically to ``out``. Returns the trace and the parameters used."""
    spec = get_model(model) if isinstance(model, str) else model
    fitted_from = ""
    if like is not None:
        rec = read_trace(like)
        if not rec.speculative:
            raise MoesimError(f"{like}: not a speculative-decoding trace (record one with moesim speculate)")
        sp = rec.header.get("speculative", {})
        shape = SpecSynthParams(steps=max(len(rec.timings["sd_accepted"]), 64), branch=int(sp.get("branch", 2)),
                                depth=int(sp.get("depth", 3)))
        est = synth_estimate(spec, replace(shape, steps=overrides.get("steps", shape.steps)), fit_rounds=5,
                             fit_spec=rec.model, fit_params_=shape)
        budget.check(replace(est, what=est.what + f", fitted to {like}"))
        params = fit_params(rec, steps=overrides.get("steps"), seed=overrides.get("seed", 0))
        fitted_from = str(like)
    unknown = set(overrides) - set(SpecSynthParams.__dataclass_fields__)
    if unknown:
        raise MoesimError(f"unknown synthetic speculative parameter(s): {', '.join(sorted(unknown))}")
    params = replace(params or SpecSynthParams(), **overrides)
    budget.check(synth_estimate(spec, params))  # before drawing anything
    if mask_bytes(spec, params) > MAX_MASK_BYTES:
        raise MoesimError(f"a version-2 trace of {params.steps} steps x {count(params.nodes)} nodes for {spec.name} "
                          f"needs a {mask_bytes(spec, params) / 2**20:,.0f} MiB expert mask (at most "
                          f"{MAX_MASK_BYTES >> 20} MiB); write fewer steps or a smaller tree (the what-if, moesim "
                          "ecospec, does not need the file)")
    synth = generate(spec, params)
    synth.fitted_from = fitted_from
    trace = to_trace(synth)
    write_trace(trace, out)
    return trace, params
