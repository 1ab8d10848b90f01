"""Synthetic routing traces, so every policy can be simulated before a real trace exists.

Three knobs shape a synthetic trace, each a stand-in for a property of real routing:

- ``skew``: each MoE layer's expert popularity is Zipf(``skew``) over a random order of
  its experts (0 = uniform);
- ``reuse``: the chance that an expert a token used at a layer is used again by the
  next token at that layer (temporal locality, what a cross-token cache exploits);
- ``hit_rate``: per layer, the chance that each true expert is in the predicted set;
  the first ``early_layers`` MoE layers get ``early_hit_rate`` (router-based prediction
  is worse where the residual stream drifts).

The header says ``synthetic: true`` and carries these parameters; no timing is recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from moesim import __version__
from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.traces.format import FORMAT, VERSION, Trace


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

    def __post_init__(self) -> None:
        for name in ("tokens", "batch"):
            if getattr(self, name) < 1:
                raise MoesimError(f"synthetic trace: {name} must be >= 1")
        if self.prompt_len < 0 or self.early_layers < 0 or self.skew < 0:
            raise MoesimError("synthetic trace: prompt_len, early_layers and skew must be >= 0")
        for name in ("reuse", "hit_rate", "early_hit_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise MoesimError(f"synthetic trace: {name} must be in [0, 1]")

    def layer_hit_rates(self, n_moe: int) -> np.ndarray:
        rates = np.full(n_moe, self.hit_rate)
        rates[: self.early_layers] = self.early_hit_rate
        return rates


def _topk_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest keys along the last axis, largest first."""
    idx = np.argpartition(-keys, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(keys, idx, -1), axis=-1)
    return np.take_along_axis(idx, order, -1)


def synthetic_trace(spec: ModelSpec, params: SyntheticParams = SyntheticParams()) -> Trace:
    """Generate a trace for ``spec`` (vectorised: one numpy pass per decode step)."""
    rng = np.random.default_rng(params.seed)
    t, m, b, k, e = params.tokens, spec.n_moe_layers, params.batch, spec.top_k, spec.n_experts

    # Per-layer popularity: Zipf weights over a random permutation of the experts.
    ranks = np.argsort(rng.random((m, e)), axis=1) + 1.0
    logp = -params.skew * np.log(ranks)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))

    # True top-k: Gumbel-top-k sampling without replacement; reused experts forced in.
    true = np.empty((t, m, b, k), np.int16)
    prev = None
    for step in range(t):
        keys = logp[:, None, :] + rng.gumbel(size=(m, b, e))
        if prev is not None and params.reuse > 0:
            keep = rng.random(prev.shape) < params.reuse
            rows = np.broadcast_to(np.arange(m)[:, None, None], prev.shape)
            cols = np.broadcast_to(np.arange(b)[None, :, None], prev.shape)
            keys[rows[keep], cols[keep], prev[keep]] = np.inf
        true[step] = _topk_keys(keys, k)
        prev = true[step]

    # Gates: softmax of sorted normal logits over the top-k (largest gate first).
    logits = -np.sort(-rng.normal(0, 1, (t, m, b, k)), axis=-1)
    gates = np.exp(logits)
    gates = (gates / gates.sum(-1, keepdims=True)).astype(np.float32)

    # Predictions: each true expert kept with its layer's hit rate; the rest filled from
    # the layer's popularity among experts that are not true.
    hit = params.layer_hit_rates(m)[None, :, None, None]
    kept = rng.random((t, m, b, k)) < hit
    keys = logp[None, :, None, :] + rng.gumbel(size=(t, m, b, e))
    np.put_along_axis(keys, true.astype(np.int64), np.where(kept, np.inf, -np.inf), axis=-1)
    pred = _topk_keys(keys, k).astype(np.int16)
    pred_gates = gates.copy()
    pred[:, 0] = -1  # the first MoE layer has no earlier layer to predict from
    pred_gates[:, 0] = 0

    header = {
        "format": FORMAT, "version": VERSION, "model": spec.to_dict(),
        "policy": {"name": "none", "params": {}}, "prompt_len": params.prompt_len,
        "n_tokens": t, "batch": b, "seed": params.seed, "synthetic": True,
        "generator": {"name": "moesim.synthetic", **asdict(params)},
        "recorded": {"tool": f"moesim {__version__}", "how": "synthetic routing, no timings"},
    }
    prompt = rng.integers(0, spec.vocab, (b, params.prompt_len), dtype=np.int32)
    tokens = rng.integers(0, spec.vocab, (b, t), dtype=np.int32)
    return Trace(header, prompt, tokens, true, gates, pred, pred_gates, true.copy())
