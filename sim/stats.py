"""Routing statistics of a trace: what decides whether caching and prefetching can pay.

:func:`routing_stats` answers, per MoE layer and for the whole trace:

- **popularity and skew**: how often each expert is used, against uniform routing:
  normalised entropy (1 = uniform), the share of activations taken by the hottest 10% of
  experts (0.1 = uniform), and the Gini coefficient (0 = uniform);
- **reuse**: the share of a token's experts the previous token of the same sequence also
  used at that layer, and the distribution of reuse distances (steps since the expert was
  last used at that layer by that sequence);
- **adjacent-layer overlap**: how many expert *ids* layer ``l`` and ``l+1`` share for a
  token, against two random k-subsets of E (``k^2/E``). Ids of different layers are
  different experts, so overlap above chance only means the model's ids are aligned
  (e.g. by upcycling); reported because some engines key predictors on it;
- **predictor recall@k** per layer for the trace's main prediction and any recorded in
  ``header['metrics']['predictors']``;
- **cache hit rate against cache size** for LRU and LFU (the simulator's own
  :class:`moesim.policy.ExpertCache`, so the curve equals what ``simulate`` charges) and
  Belady's offline optimum (evict the expert used again farthest in the future; Belady
  1966, "A study of replacement algorithms for a virtual-storage computer"), the ceiling
  no online eviction reaches, with the device memory each size needs;
- with a hardware profile, **TPOT against cache size** through the simulator and the
  **knee**: the smallest cache whose TPOT is within :data:`KNEE_TOLERANCE` (5%) of the best
  TPOT over the sizes tried -- "how many experts should stay on the GPU".

:func:`fit_synthetic` fits the synthetic generator's per-layer parameters to a trace so a
short recording stretches to any length or batch (``moesim synth --like``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile
from moesim.policy import ExpertCache
from moesim.traces.format import Trace
from moesim.traces.metrics import recall_per_layer

#: Knee rule: the smallest cache whose simulated TPOT is within this fraction of the best.
KNEE_TOLERANCE = 0.05
#: Default cache sizes, as fractions of all routed experts of all MoE layers.
SIZE_FRACTIONS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
#: Reuse distances reported one by one up to this many steps; longer ones are pooled.
MAX_DISTANCE = 64


# ---------------------------------------------------------------------------------------
# Popularity and skew
# ---------------------------------------------------------------------------------------


def expert_counts(trace: Trace) -> np.ndarray:
    """[moe_layers, experts] activations of each routed expert over steps, sequences and slots."""
    t, m, b, k = trace.true_ids.shape
    e = trace.model.n_experts
    flat = trace.true_ids.transpose(1, 0, 2, 3).reshape(m, -1).astype(np.int64)
    return np.stack([np.bincount(row, minlength=e) for row in flat])


def skew_metrics(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of ``counts``: normalised entropy, top-10% share and Gini coefficient."""
    counts = np.asarray(counts, float)
    e = counts.shape[-1]
    p = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0).sum(-1) / np.log(e)
    top = max(1, int(np.ceil(0.1 * e)))
    srt = np.sort(p, -1)
    top_share = srt[..., -top:].sum(-1)
    # Gini from the sorted shares: 1 - 2 * area under the Lorenz curve.
    lorenz = np.cumsum(srt, -1)
    gini = 1 - (2 * lorenz.sum(-1) - 1) / e
    return {"norm_entropy": ent, "top10_share": top_share, "gini": gini}


# ---------------------------------------------------------------------------------------
# Reuse across tokens and overlap across layers
# ---------------------------------------------------------------------------------------


def reuse_stats(trace: Trace) -> dict[str, Any]:
    """Token-to-token reuse per layer and the reuse-distance histogram (all layers).

    Distance d >= 1: the expert was last used by the same sequence at the same layer d
    steps earlier; ``never``: first use in the trace. One pass over steps.
    """
    ids = trace.true_ids.astype(np.intp)  # [t, m, b, k]
    t, m, b, k = ids.shape
    e = trace.model.n_experts
    last = np.full((m, b, e), -1, np.int64)
    hist = np.zeros(MAX_DISTANCE + 2, np.int64)  # [0] unused, 1..MAX, MAX+1 = longer
    never = 0
    overlap = np.zeros(m)
    for s in range(t):
        row = ids[s]
        prev = np.take_along_axis(last, row, -1)
        seen = prev >= 0
        never += int((~seen).sum())
        d = np.minimum(s - prev[seen], MAX_DISTANCE + 1)
        hist += np.bincount(d, minlength=MAX_DISTANCE + 2)
        if s:
            overlap += (prev == s - 1).sum((1, 2))
        np.put_along_axis(last, row, s, -1)
    pairs = max(t - 1, 1) * b * k
    total = hist.sum()
    cdf = np.cumsum(hist[1:]) / max(total, 1)
    median = int(np.searchsorted(cdf, 0.5) + 1) if total else None
    return {
        "reuse_prev_token": overlap / pairs,  # per layer: share of experts the previous token also used
        "distance_hist": hist[1:].tolist(),  # counts for d = 1..MAX_DISTANCE, then > MAX_DISTANCE
        "first_uses": never,
        "median_distance": median if median is not None and median <= MAX_DISTANCE else None,
    }


def adjacent_layer_overlap(trace: Trace) -> dict[str, Any]:
    """Mean number of expert ids a token shares between MoE layers l and l+1, and chance."""
    ids = trace.true_ids
    t, m, b, k = ids.shape
    e = trace.model.n_experts
    if m < 2:
        return {"per_layer": [], "mean": float("nan"), "chance": k * k / e}
    shared = (ids[:, :-1, :, :, None] == ids[:, 1:, :, None, :]).any(-1).sum(-1)  # [t, m-1, b]
    per = shared.mean((0, 2))
    return {"per_layer": per.tolist(), "mean": float(per.mean()), "chance": k * k / e}


def predictor_recalls(trace: Trace) -> dict[str, list[float]]:
    """Recall@k per layer of the main prediction (named by the header) and recorded others."""
    metrics = trace.header.get("metrics", {}) or {}
    main = trace.meta.predictor or "main"
    out = {}
    main_recall = recall_per_layer(trace.true_ids, trace.pred_ids)
    if not np.isnan(main_recall).all():
        out[str(main)] = main_recall.tolist()
    for name, rec in (metrics.get("predictors") or {}).items():
        out.setdefault(name, [float(x) for x in rec])
    return out


# ---------------------------------------------------------------------------------------
# Cache hit rate against cache size
# ---------------------------------------------------------------------------------------


def access_groups(trace: Trace) -> list[list[int]]:
    """The cache's access stream: per (step, MoE layer) the distinct experts the batch used,
    as keys ``layer * E + expert``, in the order the simulator's planner sees them."""
    t, m, b, k = trace.true_ids.shape
    e = trace.model.n_experts
    flat = (trace.true_ids.reshape(t, m, b * k).astype(np.int64) + (np.arange(m) * e)[None, :, None]).tolist()
    return [list(dict.fromkeys(row)) for step in flat for row in step]


def online_hits(groups: Sequence[Sequence[int]], capacity: int, eviction: str) -> int:
    """Hits of the simulator's cross-token cache (LRU or LFU) over ``groups``: a group's
    experts hit if resident before it runs; afterwards they are admitted, never evicting
    each other (the protocol of :meth:`moesim.policy.Planner.finish`)."""
    if capacity <= 0:
        return 0
    cache = ExpertCache(capacity, eviction)
    hits = 0
    for g in groups:
        keys = [(0, x) for x in g]
        present = [key in cache for key in keys]
        hits += sum(present)
        new = len(keys) - sum(present)
        cache.evict_for(new, set(keys))
        room = capacity - len(cache)
        for key, was in zip(keys, present, strict=True):
            if was:
                cache.use(key)
            elif room > 0:
                cache.use(key)
                room -= 1
    return hits


def belady_hits(groups: Sequence[Sequence[int]], capacity: int) -> int:
    """Hits of Belady's offline optimum: after each group keep the ``capacity`` experts
    (resident or just used) whose next use comes soonest; the rest are dropped."""
    if capacity <= 0:
        return 0
    n = len(groups)
    nxt: list[list[int]] = [[] for _ in range(n)]
    upcoming: dict[int, int] = {}
    for gi in range(n - 1, -1, -1):
        nxt[gi] = [upcoming.get(x, n + 1) for x in groups[gi]]
        for x in groups[gi]:
            upcoming[x] = gi
    cached: dict[int, int] = {}  # key -> its next use (the heap's current entry)
    heap: list[tuple[int, int]] = []  # (-next use, key), lazily cleaned
    hits = 0
    for gi, g in enumerate(groups):
        for x, nu in zip(g, nxt[gi], strict=True):
            if x in cached:
                hits += 1
            cached[x] = nu
            heapq.heappush(heap, (-nu, x))
        while len(cached) > capacity:
            neg, x = heapq.heappop(heap)
            if cached.get(x) == -neg:
                del cached[x]
    return hits


def default_sizes(n_total: int) -> list[int]:
    return sorted({int(round(f * n_total)) for f in SIZE_FRACTIONS})


def hit_rate_curve(trace: Trace, sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Hit rate of LRU, LFU and Belady per cache size (in experts), with the bytes each needs."""
    spec = trace.model
    total = spec.n_moe_layers * spec.n_experts
    sizes = list(sizes) if sizes is not None else default_sizes(total)
    if any(s < 0 for s in sizes):
        raise MoesimError("cache sizes must be >= 0 experts")
    groups = access_groups(trace)
    accesses = sum(len(g) for g in groups)
    curve = {"sizes": sizes, "bytes": [s * spec.expert_bytes for s in sizes], "accesses": accesses}
    for name in ("lru", "lfu"):
        curve[name] = [online_hits(groups, s, name) / accesses for s in sizes]
    curve["belady"] = [belady_hits(groups, s) / accesses for s in sizes]
    return curve


# ---------------------------------------------------------------------------------------
# TPOT against cache size and the knee
# ---------------------------------------------------------------------------------------


def tpot_curve(trace: Trace, hw: HardwareProfile, sizes: Sequence[int], policy: str = "on-demand",
               eviction: str = "lru") -> dict[str, Any]:
    """Simulated TPOT (fast engine, profile timing) per cache size, and the knee."""
    from moesim.sim.simulate import simulate

    tpot = [simulate(trace, hw, policy, cache_experts=int(s), eviction=eviction, engine="fast",
                     timing="profile").summary()["tpot_ms"] for s in sizes]
    return {"policy": policy, "eviction": eviction, "hw": hw.name, "sizes": list(sizes), "tpot_ms": tpot,
            **knee(sizes, tpot)}


def knee(sizes: Sequence[int], tpot_ms: Sequence[float], tolerance: float = KNEE_TOLERANCE) -> dict[str, Any]:
    """The smallest size whose TPOT is within ``tolerance`` of the best TPOT tried."""
    best = min(tpot_ms)
    for s, tp in sorted(zip(sizes, tpot_ms, strict=True)):
        if tp <= best * (1 + tolerance):
            return {"knee_experts": int(s), "knee_tpot_ms": float(tp), "best_tpot_ms": float(best),
                    "knee_rule": f"smallest cache with TPOT <= {1 + tolerance:g} x the best over the sizes tried"}
    raise AssertionError("unreachable: the best size satisfies the rule")


# ---------------------------------------------------------------------------------------
# Everything
# ---------------------------------------------------------------------------------------


def routing_stats(trace: Trace, hw: HardwareProfile | None = None, sizes: Sequence[int] | None = None,
                  policy: str = "on-demand") -> dict[str, Any]:
    """All routing statistics of ``trace`` as plain JSON-able data (see the module docstring)."""
    spec = trace.model
    counts = expert_counts(trace)
    skew = skew_metrics(counts)
    whole = skew_metrics(counts.reshape(1, -1))  # every (layer, expert) pair as one population
    reuse = reuse_stats(trace)
    curve = hit_rate_curve(trace, sizes)
    out: dict[str, Any] = {
        "model": spec.name, "tokens": trace.n_tokens, "batch": trace.batch, "synthetic": trace.synthetic,
        "source": trace.meta.how or "",
        "n_experts": spec.n_experts, "top_k": spec.top_k, "moe_layers": list(spec.moe_layers),
        "expert_bytes": spec.expert_bytes,
        "popularity": {"counts": counts.tolist(), **{k: v.tolist() for k, v in skew.items()},
                       "all_layers": {k: float(v[0]) for k, v in whole.items()}},
        "reuse": {**reuse, "reuse_prev_token": reuse["reuse_prev_token"].tolist()},
        "adjacent_layer_overlap": adjacent_layer_overlap(trace),
        "predictor_recall": predictor_recalls(trace),
        "hit_rate": curve,
    }
    if hw is not None:
        out["tpot"] = tpot_curve(trace, hw, curve["sizes"], policy)
    return out


# ---------------------------------------------------------------------------------------
# Fit the synthetic generator to a trace
# ---------------------------------------------------------------------------------------


def fit_synthetic(trace: Trace, tokens: int | None = None, batch: int | None = None, seed: int = 0,
                  like: str = "") -> Any:
    """Synthetic-generator parameters fitted to ``trace``, per MoE layer:

    - ``popularity``: the layer's expert frequencies, plus half a count per expert so an
      expert the short trace never used keeps a small chance;
    - ``layer_reuse``: the forced-reuse probability whose synthetic routing reproduces the
      layer's measured previous-token reuse (calibrated on a short synthetic run per grid
      value, interpolated; reuse rises monotonically with the knob);
    - ``layer_hit``: the layer's recall@k of the main prediction (0 where none).

    What it does not model: reuse at distances > 1 beyond popularity, correlation between
    layers and between sequences of a batch, the gate distribution.
    """
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    spec = trace.model
    counts = expert_counts(trace).astype(float) + 0.5
    pop = counts / counts.sum(1, keepdims=True)
    target = reuse_stats(trace)["reuse_prev_token"]
    recall = np.nan_to_num(recall_per_layer(trace.true_ids, trace.pred_ids), nan=0.0)
    popularity = tuple(tuple(float(p) for p in row) for row in pop)
    grid = np.linspace(0, 1, 11)
    calib_tokens = max(64, min(512, 4096 // max(spec.top_k, 1)))
    measured = []
    for r in grid:
        p = SyntheticParams(tokens=calib_tokens, batch=1, prompt_len=0, seed=seed + 1, popularity=popularity,
                            layer_reuse=(float(r),) * spec.n_moe_layers, layer_hit=(0.0,) * spec.n_moe_layers)
        measured.append(reuse_stats(synthetic_trace(spec, p))["reuse_prev_token"])
    measured = np.maximum.accumulate(np.array(measured), axis=0)  # [grid, m], monotone for interpolation
    layer_reuse = tuple(float(np.clip(np.interp(target[m], measured[:, m], grid), 0, 1))
                        for m in range(spec.n_moe_layers))
    return SyntheticParams(tokens=tokens or trace.n_tokens, batch=batch or trace.batch, prompt_len=trace.prompt_len,
                           seed=seed, popularity=popularity, layer_reuse=layer_reuse,
                           layer_hit=tuple(float(x) for x in recall), like=like or spec.name)


def synth_like(trace: Trace, tokens: int, batch: int = 1, seed: int = 0, like: str = "") -> Trace:
    """A synthetic trace of ``tokens`` steps and ``batch`` sequences shaped like ``trace``."""
    from moesim.traces.synthetic import synthetic_trace

    params = replace(fit_synthetic(trace, seed=seed, like=like), tokens=tokens, batch=batch)
    return synthetic_trace(trace.model, params)


def synth_like_file(like: str | Path, out: str | Path, tokens: int, batch: int = 1, seed: int = 0) -> Trace:
    """``moesim synth --like TRACE``: fit to the trace at ``like``, write a synthetic trace to ``out``."""
    from moesim.traces.format import read_trace, write_trace

    trace = synth_like(read_trace(like), tokens, batch, seed, like=Path(like).name)
    write_trace(trace, out)
    return trace


def summary_lines(res: dict[str, Any]) -> list[str]:
    """The answers of :func:`routing_stats` in a few short lines (what ``moesim stats`` prints)."""
    pop, reuse, ov, hr = res["popularity"], res["reuse"], res["adjacent_layer_overlap"], res["hit_rate"]
    kind = "synthetic" if res["synthetic"] else "recorded"
    lines = [f"{res['model']}: {res['tokens']} steps, batch {res['batch']} ({kind} routing)",
             f"hot experts: the top 10% of (layer, expert) pairs take {pop['all_layers']['top10_share']:.0%} of "
             f"uses (uniform: 10%); Gini {pop['all_layers']['gini']:.2f}",
             f"reuse: {np.mean(reuse['reuse_prev_token']):.0%} of a token's experts were used by the previous "
             f"token; median reuse distance {reuse['median_distance']} steps",
             f"adjacent layers share {ov['mean']:.2f} experts a token (chance: {ov['chance']:.2f})"]
    for name, rec in res["predictor_recall"].items():
        vals = [r for r in rec if r == r]
        if vals:
            lines.append(f"predictor {name}: recall@k {np.mean(vals):.3f} (layers {min(vals):.2f}-{max(vals):.2f})")
    lines.append("cache hit rate (experts in cache: LRU / LFU / Belady's optimum):")
    for s, a, b, c, nbytes in zip(hr["sizes"], hr["lru"], hr["lfu"], hr["belady"], hr["bytes"], strict=True):
        size = f"{nbytes / 2**30:7.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:7.1f} MiB"
        lines.append(f"  {s:6d} experts ({size}): {a:6.1%} / {b:6.1%} / {c:6.1%}")
    if "tpot" in res:
        tp = res["tpot"]
        lines.append(f"how many experts on the GPU ({tp['policy']}, {tp['hw']}): the knee is {tp['knee_experts']} "
                     f"experts at {tp['knee_tpot_ms']:.3g} ms/token (best {tp['best_tpot_ms']:.3g}; "
                     f"{tp['knee_rule']})")
    return lines
