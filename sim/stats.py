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
- **cache hit rate against cache size**, over all layers and per layer, for LRU and LFU
  (exactly the simulator's :class:`moesim.policy.ExpertCache` under the planner's
  protocol, so the curve equals what ``simulate`` charges) and Belady's offline optimum
  (evict the expert used again farthest in the future; Belady 1966, "A study of
  replacement algorithms for a virtual-storage computer"), the ceiling no online eviction
  reaches, with the device memory each size needs;
- with a hardware profile, **TPOT against cache size** through the simulator and the
  **knee**: the smallest cache whose TPOT is within :data:`KNEE_TOLERANCE` (5%) of the best
  TPOT over the sizes tried -- "how many experts should stay on the GPU".

How it is computed (``tests/test_stats_fast.py`` holds every figure equal to the plain
Python definitions it replaced, on random traces with ties, every eviction and sizes from
none to more than the model):

- popularity, reuse, overlap and recall: one compiled pass over the routing;
- LRU at every size at once: the cache's protocol (a layer's experts hit if resident
  before it runs, then are admitted without evicting each other) keeps, whenever the
  cache holds at least a layer's distinct experts, exactly the most recently used keys,
  so an access hits iff fewer than ``size`` distinct keys were used since its key's last
  use: Mattson's stack algorithm (Mattson et al. 1970, "Evaluation techniques for storage
  hierarchies", IBM Syst. J. 9(2)) on one recency list cut into segments at the sizes
  (O(segments an access crosses)). Sizes below a layer's distinct experts replay the
  cache itself;
- LFU: one compiled replay per size (in-cache counts make it no stack algorithm): keys
  used once since admission wait in a queue in tick order, the rest in a binary heap on
  (use count, last use), ExpertCache's order, its entries brought up to date only when
  they reach the root; O(1) a use, O(log size) a key's second use and a heap eviction
  (half the time of the linked list in eviction order it replaced);
- Belady: also a stack algorithm, so one compiled pass serves every size: segments of
  keys between consecutive sizes, each a max-heap on precomputed next-use times
  (O(log size) a segment a miss crosses). Hits do not depend on how ties between equal
  next uses are broken: both tied keys are used again in the same layer.

Sizes at which nothing is ever evicted (0, or at least every key the trace uses) need
no replay. The passes run side by side on the machine's cores (threads: the kernels
release the GIL). Memory: one int32 next-use time per access (Belady) beyond the trace;
never a copy of the trace per size.

:func:`fit_synthetic` fits the synthetic generator's per-layer parameters to a trace so a
short recording stretches to any length or batch (``moesim synth --like``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.fmt import number, plural
from moesim.hardware import HardwareProfile
from moesim.models import ModelSpec
from moesim.setting import Setting
from moesim.sim.simulate import PerTrace, prediction_recall, simulate
from moesim.sim.stats_kernels import _kernel, kernel_ids, recall_counts  # noqa: F401 (recall_counts: this module's API too)
from moesim.traces.format import Trace, read_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace, write_synthetic_trace

#: Knee rule: the smallest cache whose simulated TPOT is within this fraction of the best.
KNEE_TOLERANCE = 0.05
#: Default cache sizes, as fractions of all routed experts of all MoE layers.
SIZE_FRACTIONS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
#: Reuse distances reported one by one up to this many steps; longer ones are pooled.
MAX_DISTANCE = 64


# ---------------------------------------------------------------------------------------
# Popularity, reuse, overlap and recall (one pass)
# ---------------------------------------------------------------------------------------


def _routing_summary(trace: Trace) -> dict[str, Any]:
    """Everything :func:`_routing_pass` counts, for the functions below."""
    e = trace.model.n_experts
    true, pred = kernel_ids(trace.true_ids, e), kernel_ids(trace.pred_ids, e)
    t, m, b, k = true.shape
    counts = np.zeros((m, e), np.int64)
    hist = np.zeros(MAX_DISTANCE + 2, np.int64)  # [0] unused, 1..MAX, MAX+1 = longer
    overlap = np.zeros(m, np.int64)
    shared = np.zeros(max(m - 1, 0), np.int64)
    rec_hits, rec_rows = np.zeros(m, np.int64), np.zeros(m, np.int64)
    never = _kernel("_routing_pass")(true, pred, e, MAX_DISTANCE, counts, hist, overlap, shared, rec_hits, rec_rows)
    return {"shape": (t, m, b, k), "n_experts": e, "counts": counts, "hist": hist, "never": int(never),
            "overlap": overlap, "shared": shared, "rec_hits": rec_hits, "rec_rows": rec_rows}


def expert_counts(trace: Trace) -> np.ndarray:
    """[moe_layers, experts] activations of each routed expert over steps, sequences and slots."""
    e = trace.model.n_experts
    return np.stack([np.bincount(trace.true_ids[:, j].ravel(), minlength=e)
                     for j in range(trace.true_ids.shape[1])]).astype(np.int64)


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


def _reuse_from(summary: dict[str, Any]) -> dict[str, Any]:
    t, m, b, k = summary["shape"]
    hist = summary["hist"]
    pairs = max(t - 1, 1) * b * k
    total = hist.sum()
    cdf = np.cumsum(hist[1:]) / max(total, 1)
    median = int(np.searchsorted(cdf, 0.5) + 1) if total else None
    return {
        "reuse_prev_token": summary["overlap"].astype(float) / pairs,  # per layer: share the previous token also used
        "distance_hist": hist[1:].tolist(),  # counts for d = 1..MAX_DISTANCE, then > MAX_DISTANCE
        "first_uses": summary["never"],
        "median_distance": median if median is not None and median <= MAX_DISTANCE else None,
    }


def reuse_stats(trace: Trace) -> dict[str, Any]:
    """Token-to-token reuse per layer and the reuse-distance histogram (all layers).

    Distance d >= 1: the expert was last used by the same sequence at the same layer d
    steps earlier; ``never``: first use in the trace.
    """
    return _reuse_from(_routing_summary(trace))


def _overlap_from(summary: dict[str, Any]) -> dict[str, Any]:
    t, m, b, k = summary["shape"]
    chance = k * k / summary["n_experts"]
    if m < 2:
        return {"per_layer": [], "mean": float("nan"), "chance": chance}
    per = summary["shared"] / float(t * b)
    return {"per_layer": per.tolist(), "mean": float(per.mean()), "chance": chance}


def adjacent_layer_overlap(trace: Trace) -> dict[str, Any]:
    """Mean number of expert ids a token shares between MoE layers l and l+1, and chance."""
    return _overlap_from(_routing_summary(trace))


def _recall_from(summary: dict[str, Any]) -> np.ndarray:
    """Recall@k per layer (NaN where no row has a prediction), as traces.metrics defines it."""
    k = summary["shape"][3]
    rows = summary["rec_rows"]
    return np.array([float(h / (r * k)) if r else float("nan") for h, r in zip(summary["rec_hits"], rows,
                                                                                strict=True)])


def _recalls_from(trace: Trace, summary: dict[str, Any]) -> dict[str, list[float]]:
    metrics = trace.header.get("metrics", {}) or {}
    main = trace.meta.predictor or "main"
    out = {}
    main_recall = _recall_from(summary)
    if not np.isnan(main_recall).all():
        out[str(main)] = main_recall.tolist()
    for name, rec in (metrics.get("predictors") or {}).items():
        out.setdefault(name, [float(x) for x in rec])
    return out


def predictor_recalls(trace: Trace) -> dict[str, list[float]]:
    """Recall@k per layer of the main prediction (named by the header) and recorded others."""
    return _recalls_from(trace, _routing_summary(trace))




# ---------------------------------------------------------------------------------------
# Cache hit rate against cache size
# ---------------------------------------------------------------------------------------


def _stream(trace: Trace) -> tuple[np.ndarray, int]:
    """The cache's access stream as [steps, MoE layers, batch * top-k] ids (a view) and E:
    per (step, layer) the distinct experts the batch used, in the order the simulator's
    planner sees them, keyed ``layer * E + expert``."""
    t, m, b, k = trace.true_ids.shape
    e = trace.model.n_experts
    return kernel_ids(trace.true_ids, e).reshape(t, m, b * k), e


def _groups_stream(groups: Sequence[Sequence[int]]) -> tuple[np.ndarray, int]:
    """A list of groups of keys as a one-layer stream [groups, 1, widest] (-1 padded)."""
    width = max((len(g) for g in groups), default=0) or 1
    top = max((max(g) for g in groups if len(g)), default=0)
    ids = np.full((len(groups), 1, width), -1, np.int16 if top < 2**15 - 1 else np.int64)
    for i, g in enumerate(groups):
        ids[i, 0, : len(g)] = g
    return ids, top + 1


def _online_layer_hits(ids: np.ndarray, n_exp: int, capacity: int, eviction: str) -> np.ndarray:
    hits = np.zeros(ids.shape[1], np.int64)
    if capacity > 0:
        _kernel("_online")(ids, n_exp, int(capacity), eviction == "lfu", hits)
    return hits


def _belady_layer_hits(ids: np.ndarray, n_exp: int, capacities: Sequence[int]) -> np.ndarray:
    """[layers, len(capacities)] Belady hits at each capacity (any order, repeats allowed)."""
    caps = np.array(sorted({int(c) for c in capacities if c > 0}), np.int64)
    out = np.zeros((ids.shape[1], len(capacities)), np.int64)
    if caps.size:
        hits = np.zeros((ids.shape[1], caps.size), np.int64)
        _kernel("_belady")(ids, _next_use_times(ids, n_exp), n_exp, caps, hits)
        cum = np.cumsum(hits, 1)
        for i, c in enumerate(capacities):
            if c > 0:
                out[:, i] = cum[:, int(np.searchsorted(caps, c))]
    return out


def _next_use_times(ids: np.ndarray, n_exp: int) -> np.ndarray:
    nu = np.zeros(ids.shape, np.int32 if ids.shape[0] * ids.shape[1] < 2**31 - 2 else np.int64)
    _kernel("_next_uses")(ids, n_exp, nu)
    return nu


def online_hits(groups: Sequence[Sequence[int]], capacity: int, eviction: str) -> int:
    """Hits of the simulator's cross-token cache (LRU or LFU) over ``groups`` of distinct
    keys: a group's keys hit if resident before it runs; afterwards they are admitted,
    never evicting each other (the protocol of :meth:`moesim.policy.Planner.finish`)."""
    if eviction not in ("lru", "lfu"):
        raise MoesimError(f"unknown eviction policy {eviction!r}; known: lru, lfu")
    ids, n = _groups_stream(groups)
    return int(_online_layer_hits(ids, n, capacity, eviction).sum())


def belady_hits(groups: Sequence[Sequence[int]], capacity: int) -> int:
    """Hits of Belady's offline optimum: after each group keep the ``capacity`` keys
    (resident or just used) whose next use comes soonest; the rest are dropped."""
    ids, n = _groups_stream(groups)
    return int(_belady_layer_hits(ids, n, [capacity]).sum())


def _lru_layer_hits(ids: np.ndarray, n_exp: int, capacities: Sequence[int]) -> tuple[np.ndarray, np.ndarray,
                                                                                     np.ndarray]:
    """LRU hits [layers, len(capacities)] at sizes of at least a group's distinct keys, all
    in one pass (:func:`_lru_segments`), and each layer's accesses and first uses."""
    caps = np.array(sorted({int(c) for c in capacities if c > 0}), np.int64)
    m = ids.shape[1]
    hits = np.zeros((m, caps.size), np.int64)
    acc, first = np.zeros(m, np.int64), np.zeros(m, np.int64)
    _kernel("_lru_segments")(ids, n_exp, caps, hits, acc, first)
    cum = np.cumsum(hits, 1)
    out = np.zeros((m, len(capacities)), np.int64)
    for i, c in enumerate(capacities):
        if c > 0:
            out[:, i] = cum[:, int(np.searchsorted(caps, c))]
    return out, acc, first


def default_sizes(n_total: int) -> list[int]:
    return sorted({int(round(f * n_total)) for f in SIZE_FRACTIONS})


def _run_all(tasks: list[Callable[[], Any]]) -> list[Any]:
    """Run independent compiled passes on the machine's cores: the kernels release the GIL
    (``nogil``), so plain threads suffice (no numba threading layer, safe after a fork)."""
    workers = max(1, min(len(tasks), os.cpu_count() or 1))
    if workers == 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(workers) as pool:
        return [f.result() for f in [pool.submit(task) for task in tasks]]


def _curve(trace: Trace, sizes: Sequence[int] | None, summary: bool = False) -> tuple[dict[str, Any], Any]:
    """:func:`hit_rate_curve` (and, with ``summary``, :func:`_routing_summary` alongside)."""
    spec = trace.model
    total = spec.n_moe_layers * spec.n_experts
    sizes = [int(s) for s in sizes] if sizes is not None else default_sizes(total)
    if any(s < 0 for s in sizes):
        raise MoesimError("cache sizes must be >= 0 experts")
    over = sorted({s for s in sizes if s > total})
    notes = []
    if over:  # a cache cannot hold more experts than the model has: such a size is the whole model
        sizes = list(dict.fromkeys(min(s, total) for s in sizes))
        notes.append(f"cache size{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} above the {total} experts "
                     f"{spec.name} has ({spec.n_moe_layers} MoE layers x {spec.n_experts}): cut to {total}")
    ids, e = _stream(trace)
    b, k = trace.true_ids.shape[2:]
    group_max = min(b * k, e)  # a (step, layer) has at most this many distinct experts
    used = int(_kernel("_distinct")(ids, e))  # distinct keys the trace uses
    # Sizes that need a replay: not 0, and not so large that nothing is ever evicted;
    # LRU replays one by one only below a group's size (the stack pass serves the rest).
    replay = sorted({s for s in sizes if 0 < s < used})
    stack = [s for s in replay if s >= group_max]
    small = [s for s in replay if s < group_max]
    # Longest first (Belady's one pass is the longest, then the LRU stack, the summary, and the
    # LFU replays, larger caches replaying faster), so no long task starts last on a core.
    tasks: list[Callable[[], Any]] = [lambda: _belady_layer_hits(ids, e, replay),
                                      lambda: _lru_layer_hits(ids, e, stack)]
    if summary:
        tasks.append(lambda: _routing_summary(trace))
    tasks += [lambda s=s: _online_layer_hits(ids, e, s, "lfu") for s in replay]
    tasks += [lambda s=s: _online_layer_hits(ids, e, s, "lru") for s in small]
    out = _run_all(tasks)
    belady, (lru_stack, layer_acc, layer_cold) = out[0], out[1]
    routing = out[2] if summary else None
    first = 3 if summary else 2
    lfu = dict(zip(replay, out[first:first + len(replay)], strict=True))
    lru = {**dict(zip(stack, lru_stack.T, strict=True)),
           **dict(zip(small, out[first + len(replay):], strict=True))}
    accesses = int(layer_acc.sum())
    per: dict[str, list[np.ndarray]] = {"lru": [], "lfu": [], "belady": []}
    for s in sizes:
        if s <= 0:
            for name in per:
                per[name].append(np.zeros_like(layer_acc))
        elif s >= used:  # nothing is ever evicted: only first uses miss, whatever the policy
            for name in per:
                per[name].append(layer_acc - layer_cold)
        else:
            per["lru"].append(lru[s])
            per["lfu"].append(lfu[s])
            per["belady"].append(belady[:, replay.index(s)])
    curve: dict[str, Any] = {"sizes": sizes, "bytes": [s * spec.expert_bytes for s in sizes], "accesses": accesses,
                             "notes": notes}
    for name, rows in per.items():
        curve[name] = [int(h.sum()) / accesses for h in rows]
    with np.errstate(invalid="ignore", divide="ignore"):
        curve["per_layer"] = {"accesses": layer_acc.tolist(),
                              **{name: (np.stack(rows, 1) / layer_acc[:, None]).tolist() if rows else
                                 [[] for _ in layer_acc] for name, rows in per.items()}}
    return curve, routing


def hit_rate_curve(trace: Trace, sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Hit rate of LRU, LFU and Belady per cache size (in experts), with the bytes each
    needs; ``per_layer`` holds each layer's accesses and hit rates [layer][size]."""
    return _curve(trace, sizes)[0]


# ---------------------------------------------------------------------------------------
# TPOT against cache size and the knee
# ---------------------------------------------------------------------------------------


def tpot_curve(trace: Trace, hw: HardwareProfile, sizes: Sequence[int], policy: str = "on-demand",
               eviction: str = "lru", pred_recall: float | None = None) -> dict[str, Any]:
    """Simulated TPOT (fast engine, profile timing) per cache size, and the knee.
    ``pred_recall`` (the trace's, computed once) only saves each simulation recomputing it."""
    shared = PerTrace(pred_recall=prediction_recall(trace) if pred_recall is None else pred_recall)
    tpot = [simulate(trace, hw, policy, Setting(cache_experts=int(s), eviction=eviction, sim="fast", timing="profile"),
                     shared=shared).summary()["tpot_ms"] for s in sizes]
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
    curve, summary = _curve(trace, sizes, summary=True)
    counts = summary["counts"]
    skew = skew_metrics(counts)
    whole = skew_metrics(counts.reshape(1, -1))  # every (layer, expert) pair as one population
    reuse = _reuse_from(summary)
    recalls = _recalls_from(trace, summary)
    out: dict[str, Any] = {
        "model": spec.name, "tokens": trace.n_tokens, "batch": trace.batch, "synthetic": trace.synthetic,
        "source": trace.meta.how or "",
        "n_experts": spec.n_experts, "top_k": spec.top_k, "moe_layers": list(spec.moe_layers),
        "expert_bytes": spec.expert_bytes,
        "popularity": {"counts": counts.tolist(), **{k: v.tolist() for k, v in skew.items()},
                       "all_layers": {k: float(v[0]) for k, v in whole.items()}},
        "reuse": {**reuse, "reuse_prev_token": reuse["reuse_prev_token"].tolist()},
        "adjacent_layer_overlap": _overlap_from(summary),
        "predictor_recall": recalls,
        "hit_rate": curve,
    }
    if hw is not None:
        rows = int(summary["rec_rows"].sum())
        recall = float(summary["rec_hits"].sum()) / (rows * spec.top_k) if rows else float("nan")
        out["tpot"] = tpot_curve(trace, hw, curve["sizes"], policy, pred_recall=recall)
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
    - ``layer_hit``: the layer's recall@k of the main prediction (0 where none), as the
      distance-1 rate: a trace whose header says ``lookahead`` N > 1 predicted N layers
      ahead, so its recall r gives ``r ** (1 / N)`` (the generator raises it back to the N);
    - ``lookahead``: the trace's;
    - ``predicted``: False when the trace has no predictions (an imported vLLM dump): the
      synthetic trace then has none either, rather than predictions that are always wrong.

    What it does not model: reuse at distances > 1 beyond popularity, correlation between
    layers and between sequences of a batch, the gate distribution.
    """
    spec = trace.model
    summary = _routing_summary(trace)
    counts = summary["counts"].astype(float) + 0.5
    pop = counts / counts.sum(1, keepdims=True)
    target = _reuse_from(summary)["reuse_prev_token"]
    lookahead = trace.meta.lookahead
    measured_recall = _recall_from(summary)
    predicted = not np.isnan(measured_recall).all()  # a trace without predictions (pred_ids all -1): none
    recall = np.nan_to_num(measured_recall, nan=0.0) ** (1.0 / lookahead)
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
                           layer_hit=tuple(float(x) for x in recall), like=like or spec.name, lookahead=lookahead,
                           predicted=predicted)


def like_params(trace: Trace, tokens: int, batch: int = 1, seed: int = 0, like: str = "",
                lookahead: int | None = None) -> SyntheticParams:
    """:func:`fit_synthetic`'s parameters for ``tokens`` steps and ``batch`` sequences, predicting
    ``lookahead`` MoE layers ahead (None: as ``trace`` did)."""
    params = fit_synthetic(trace, seed=seed, like=like)
    return replace(params, tokens=tokens, batch=batch, lookahead=params.lookahead if lookahead is None else lookahead)


def synth_like(trace: Trace, tokens: int, batch: int = 1, seed: int = 0, like: str = "",
               lookahead: int | None = None) -> Trace:
    """A synthetic trace of ``tokens`` steps and ``batch`` sequences shaped like ``trace``
    (predicting ``lookahead`` MoE layers ahead; None: as ``trace`` did)."""
    return synthetic_trace(trace.model, like_params(trace, tokens, batch, seed, like, lookahead))


def synth_like_file(like: str | Path, out: str | Path, tokens: int, batch: int = 1, seed: int = 0,
                    lookahead: int | None = None) -> ModelSpec:
    """``moesim synth --like TRACE``: fit to the trace at ``like``, write a synthetic trace to ``out``
    a chunk at a time (``lookahead`` None: the like-trace's); returns the trace's model."""
    real = read_trace(like)
    write_synthetic_trace(real.model, like_params(real, tokens, batch, seed, Path(like).name, lookahead), out)
    return real.model


def summary_lines(res: dict[str, Any]) -> list[str]:
    """The answers of :func:`routing_stats` in a few short lines (what ``moesim stats`` prints)."""
    pop, reuse, ov, hr = res["popularity"], res["reuse"], res["adjacent_layer_overlap"], res["hit_rate"]
    kind = "synthetic" if res["synthetic"] else "recorded"
    median = reuse["median_distance"]
    lines = [f"{res['model']}: {plural(res['tokens'], 'step')}, batch {res['batch']} ({kind} routing)",
             f"hot experts: the top 10% of (layer, expert) pairs take {pop['all_layers']['top10_share']:.0%} of "
             f"uses (uniform: 10%); Gini {pop['all_layers']['gini']:.2f}",
             f"reuse: {np.mean(reuse['reuse_prev_token']):.0%} of a token's experts were used by the previous "
             f"token; " + ("no expert was used again" if not sum(reuse["distance_hist"]) else
                          f"median reuse distance more than {plural(MAX_DISTANCE, 'step')}" if median is None else
                          f"median reuse distance {plural(median, 'step')}"),
             f"adjacent layers share {ov['mean']:.2f} experts a token (chance: {ov['chance']:.2f})"]
    for name, rec in res["predictor_recall"].items():
        vals = [r for r in rec if r == r]
        if vals:
            lines.append(f"predictor {name}: recall@k {np.mean(vals):.3f} (layers {min(vals):.2f}-{max(vals):.2f})")
    lines += [f"note: {n}" for n in hr.get("notes", [])]
    lines.append("cache hit rate (experts in cache: LRU / LFU / Belady's optimum):")
    for s, a, b, c, nbytes in zip(hr["sizes"], hr["lru"], hr["lfu"], hr["belady"], hr["bytes"], strict=True):
        size = f"{nbytes / 2**30:7.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:7.1f} MiB"
        lines.append(f"  {s:6d} experts ({size}): {a:6.1%} / {b:6.1%} / {c:6.1%}")
    if "tpot" in res:
        tp = res["tpot"]
        lines.append(f"how many experts on the GPU ({tp['policy']}, {tp['hw']}): the knee is {tp['knee_experts']} "
                     f"experts at {number(tp['knee_tpot_ms'])} ms/token (best {number(tp['best_tpot_ms'])}; "
                     f"{tp['knee_rule']})")
    return lines
