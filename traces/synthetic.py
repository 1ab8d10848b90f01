"""Synthetic routing traces, so every policy can be simulated before a real trace exists.

Three knobs shape a synthetic trace, each a stand-in for a property of real routing:

- ``skew``: each MoE layer's expert popularity is Zipf(``skew``) over a random order of
  its experts (0 = uniform);
- ``reuse``: the chance that an expert a token used at a layer is used again by the
  next token at that layer (temporal locality, what a cross-token cache exploits);
- ``hit_rate``: per layer, the chance that each true expert is in the predicted set;
  the first ``early_layers`` MoE layers get ``early_hit_rate`` (router-based prediction
  is worse where the residual stream drifts).

Each knob can instead be given per MoE layer (``popularity``, ``layer_reuse``,
``layer_hit``): :func:`moesim.sim.stats.fit_synthetic` fits them to a real trace so a
short recording stretches to any length and batch (``like`` names the source).

Memory is proportional to tokens x layers x batch x top-k (the output) plus a fixed
scratch of at most :data:`SCRATCH` draws, never x experts: tokens are drawn in chunks;
top-k without replacement is sequential sampling (draw with replacement from the layer's
CDF, keep first occurrences), the same distribution as Gumbel-top-k (Kool et al. 2019,
"Stochastic Beams and Where to Find Them", arXiv:1903.06059), which is the fallback for
rows whose draws hold too few distinct experts.

The header says ``synthetic: true`` and carries these parameters; no timing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from moesim import __version__, budget
from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.traces.format import Trace
from moesim.traces.header import make_header

#: Most expert draws held at once (int64, 32 MiB); a chunk of tokens is sized to fit.
SCRATCH = 1 << 22


@dataclass(frozen=True)
class SyntheticParams:
    tokens: int = 256
    batch: int = 1
    prompt_len: int = 128
    skew: float = 1.0
    reuse: float = 0.3
    hit_rate: float = 0.85
    early_hit_rate: float = 0.5
    early_layers: int = 2
    seed: int = 0
    #: Per MoE layer, each expert's probability (rows sum to 1); overrides ``skew``.
    popularity: tuple[tuple[float, ...], ...] = ()
    #: Per MoE layer forced-reuse probability; overrides ``reuse``.
    layer_reuse: tuple[float, ...] = ()
    #: Per MoE layer prediction hit rate (recall@k); overrides ``hit_rate``/``early_*``.
    layer_hit: tuple[float, ...] = ()
    #: Where fitted per-layer parameters came from (a trace's name); empty when not fitted.
    like: str = ""

    def __post_init__(self) -> None:
        for name in ("tokens", "batch"):
            if getattr(self, name) < 1:
                raise MoesimError(f"synthetic trace: {name} must be >= 1")
        if self.prompt_len < 0 or self.early_layers < 0 or self.skew < 0:
            raise MoesimError("synthetic trace: prompt_len, early_layers and skew must be >= 0")
        for name in ("reuse", "hit_rate", "early_hit_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise MoesimError(f"synthetic trace: {name} must be in [0, 1]")
        for name in ("layer_reuse", "layer_hit"):
            if any(not 0 <= v <= 1 for v in getattr(self, name)):
                raise MoesimError(f"synthetic trace: every {name} value must be in [0, 1]")
        for row in self.popularity:
            if any(not np.isfinite(p) or p < 0 for p in row) or not sum(row) > 0:
                raise MoesimError("synthetic trace: popularity rows must be non-negative with a positive sum")

    def layer_hit_rates(self, n_moe: int) -> np.ndarray:
        if self.layer_hit:
            return np.asarray(self.layer_hit, float)
        rates = np.full(n_moe, self.hit_rate)
        rates[: self.early_layers] = self.early_hit_rate
        return rates

    def layer_reuse_rates(self, n_moe: int) -> np.ndarray:
        return np.asarray(self.layer_reuse, float) if self.layer_reuse else np.full(n_moe, self.reuse)

    def check(self, spec: ModelSpec) -> None:
        """Per-layer parameters must match the model's MoE layers and experts (one line if not)."""
        m, e = spec.n_moe_layers, spec.n_experts
        if self.tokens < 1 or self.batch < 1 or self.prompt_len < 0 or self.early_layers < 0:
            raise MoesimError("synthetic trace: --tokens and --batch must be >= 1, --prompt-len and --early-layers >= 0")
        if not 0 <= self.skew < 1e3:
            raise MoesimError(f"synthetic trace: --skew {self.skew} must be a number in [0, 1000)")
        for name in ("reuse", "hit_rate", "early_hit_rate"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise MoesimError(f"synthetic trace: --{name.replace('_', '-')} {v} must be in [0, 1]")
        for name in ("popularity", "layer_reuse", "layer_hit"):
            v = getattr(self, name)
            if v and len(v) != m:
                raise MoesimError(f"synthetic trace: {name} has {len(v)} layers; {spec.name} has {m} MoE layers")
        if self.popularity and any(len(r) != e for r in self.popularity):
            raise MoesimError(f"synthetic trace: popularity rows must have {e} experts ({spec.name})")
        if self.popularity and any(np.count_nonzero(r) < spec.top_k for r in self.popularity):
            raise MoesimError(f"synthetic trace: every popularity row needs >= top_k={spec.top_k} non-zero experts")


def _topk_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest keys along the last axis, largest first."""
    idx = np.argpartition(-keys, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(keys, idx, -1), axis=-1)
    return np.take_along_axis(idx, order, -1)


def _log_popularity(spec: ModelSpec, params: SyntheticParams, rng: np.random.Generator) -> np.ndarray:
    """[moe_layers, experts] log-probabilities: fitted rows, else Zipf over a random order."""
    m, e = spec.n_moe_layers, spec.n_experts
    if params.popularity:
        p = np.asarray(params.popularity, float)
        p = p / p.sum(1, keepdims=True)
        with np.errstate(divide="ignore"):
            return np.log(p)  # -inf: never drawn
    ranks = np.argsort(rng.random((m, e)), axis=1) + 1.0
    logp = -params.skew * np.log(ranks)
    return logp - np.log(np.exp(logp).sum(1, keepdims=True))


def _alias_tables(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker/Vose alias tables per row of ``p`` [rows, n] (Vose 1991, IEEE TSE 17(9)):
    draw column j uniformly, keep it with probability prob[j], else take alias[j]."""
    rows, n = p.shape
    prob = np.ones((rows, n))
    alias = np.tile(np.arange(n), (rows, 1))
    for r in range(rows):
        q = p[r] * n / p[r].sum()
        small = [j for j in range(n) if q[j] < 1.0]
        large = [j for j in range(n) if q[j] >= 1.0]
        while small and large:
            s, g = small.pop(), large.pop()
            prob[r, s], alias[r, s] = q[s], g
            q[g] -= 1.0 - q[s]
            (small if q[g] < 1.0 else large).append(g)
    return prob, alias


class _Sampler:
    """Top-k without replacement from each layer's popularity, without a per-token
    [experts] array: draw ``3k + 8`` experts with replacement (Walker's alias method), keep the
    first distinct ones in draw order -- exactly sequential sampling without replacement,
    the same law as Gumbel-top-k. A row whose draws hold too few usable experts (a very
    skewed popularity) is redrawn by Gumbel-top-k over all experts."""

    def __init__(self, logp: np.ndarray, k: int) -> None:
        self.logp, self.k = logp, k
        self.prob, self.alias = _alias_tables(np.exp(logp))
        self.draws = 3 * k + 8

    def distinct(self, rng: np.random.Generator, n: int, b: int) -> np.ndarray:
        """[n, m, b, 2k] first distinct draws per row in draw order, -1 padded."""
        m, c, want = self.logp.shape[0], self.draws, 2 * self.k
        e = self.logp.shape[1]
        col = rng.integers(0, e, (n, m, b, c))
        layer = np.arange(m)[None, :, None, None]
        cand = np.where(rng.random((n, m, b, c)) < self.prob[layer, col], col, self.alias[layer, col])
        order = np.argsort(cand, axis=-1, kind="stable")
        srt = np.take_along_axis(cand, order, -1)
        first_sorted = np.ones_like(srt, bool)
        first_sorted[..., 1:] = srt[..., 1:] != srt[..., :-1]
        first = np.empty_like(first_sorted)
        np.put_along_axis(first, order, first_sorted, -1)
        pos = np.cumsum(first, -1) - 1
        sel = first & (pos < want)
        out = np.full((n, m, b, want), -1, np.int64)
        idx = np.nonzero(sel)
        out[(*idx[:3], pos[idx])] = cand[idx]
        return out

    def fill(self, forced: np.ndarray, exclude: np.ndarray, drawn: np.ndarray, rng: np.random.Generator,
             layer_axis: int) -> np.ndarray:
        """Rows of k experts: the ``forced`` ones (>= 0) first, then the first ``drawn`` ones
        not in ``exclude``. Shapes [..., k], [..., k], [..., 2k]; ``layer_axis`` indexes layers."""
        k = self.k
        bad = (drawn[..., :, None] == exclude[..., None, :]).any(-1) | (drawn < 0)
        comb = np.concatenate([forced, np.where(bad, -1, drawn)], -1)
        keep = comb >= 0
        order = np.argsort(~keep, axis=-1, kind="stable")[..., :k]
        out = np.take_along_axis(comb, order, -1)
        short = keep.sum(-1) < k
        if short.any():  # rare: redraw these rows exactly by Gumbel-top-k over the experts
            where = np.nonzero(short)
            layers = where[layer_axis]
            keys = self.logp[layers] + rng.gumbel(size=(layers.size, self.logp.shape[1]))
            rows = np.arange(layers.size)[:, None]
            ex, fo = exclude[where], forced[where]
            keys[np.broadcast_to(rows, ex.shape)[ex >= 0], ex[ex >= 0]] = -np.inf
            keys[np.broadcast_to(rows, fo.shape)[fo >= 0], fo[fo >= 0]] = np.inf
            out[where] = _topk_keys(keys, k)
        return out


def _chunks(t: int, per_token: int):
    n = max(1, SCRATCH // max(per_token, 1))
    for s in range(0, t, n):
        yield s, min(t, s + n)


def synthetic_trace(spec: ModelSpec, params: SyntheticParams = SyntheticParams(),
                    progress: Callable[[int, int], None] | None = None) -> Trace:
    """Generate a trace for ``spec``, in chunks of tokens (memory ~ the output's size);
    ``progress(done, total)`` counts tokens, for a progress bar on long traces."""
    params.check(spec)
    budget.check(budget.synth_estimate(spec, params.tokens, params.batch))
    # Independent streams per quantity, so chunk sizes never change what is drawn where.
    seeds = np.random.SeedSequence(params.seed).spawn(5)
    r_pop, r_route, r_gate, r_pred, r_tok = (np.random.default_rng(s) for s in seeds)
    t, m, b, k = params.tokens, spec.n_moe_layers, params.batch, spec.top_k
    sampler = _Sampler(_log_popularity(spec, params, r_pop), k)
    reuse = params.layer_reuse_rates(m)[:, None, None]  # [m, 1, 1]
    hit = params.layer_hit_rates(m)[None, :, None, None]  # [1, m, 1, 1]

    true = np.empty((t, m, b, k), np.int16)
    gates = np.empty((t, m, b, k), np.float32)
    pred = np.empty((t, m, b, k), np.int16)
    prev = None
    none = np.full((m, b, k), -1, np.int64)
    for s0, s1 in _chunks(t, m * b * sampler.draws):
        n = s1 - s0
        # True top-k from the layer's popularity; each expert of the previous token forced
        # back in (first) with the layer's reuse probability.
        drawn = sampler.distinct(r_route, n, b)
        forced = r_route.random((n, m, b, k)) < reuse[None]
        for i in range(n):
            keep = np.where(forced[i], prev, -1) if prev is not None else none
            prev = sampler.fill(keep, keep, drawn[i], r_route, 0)
            true[s0 + i] = prev
            if progress is not None and i % 256 == 0:
                progress(s0 + i, t)

        # Gates: softmax of sorted normal logits over the top-k (largest gate first).
        logits = -np.sort(-r_gate.normal(0, 1, (n, m, b, k)), axis=-1)
        g = np.exp(logits)
        gates[s0:s1] = g / g.sum(-1, keepdims=True)

        # Predictions: each true expert kept with its layer's hit rate; the rest filled from
        # the layer's popularity among experts that are not true.
        tr = true[s0:s1].astype(np.int64)
        kept = r_pred.random((n, m, b, k)) < hit
        pred[s0:s1] = sampler.fill(np.where(kept, tr, -1), tr, sampler.distinct(r_pred, n, b), r_pred, 1)
    if progress is not None:
        progress(t, t)
    pred_gates = gates.copy()
    pred[:, 0] = -1  # the first MoE layer has no earlier layer to predict from
    pred_gates[:, 0] = 0

    gen = asdict(params)  # as JSON would read it back: lists, fitted values rounded
    gen["popularity"] = [[round(float(p), 6) for p in row] for row in params.popularity]
    gen["layer_reuse"] = [round(float(v), 6) for v in params.layer_reuse]
    gen["layer_hit"] = [round(float(v), 6) for v in params.layer_hit]
    header = make_header(
        spec, policy="none", prompt_len=params.prompt_len, n_tokens=t, batch=b, seed=params.seed, synthetic=True,
        recorded={"tool": f"moesim {__version__}", "how": "synthetic routing, no timings"
                  + (f" (parameters fitted to {params.like})" if params.like else "")},
        generator={"name": "moesim.synthetic", **gen},
    )
    prompt = r_tok.integers(0, spec.vocab, (b, params.prompt_len), dtype=np.int32)
    tokens = r_tok.integers(0, spec.vocab, (b, t), dtype=np.int32)
    return Trace(header, prompt, tokens, true, gates, pred, pred_gates, true.copy())
