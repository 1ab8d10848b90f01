"""Prefetch only the top-m predicted experts: fewer, surer copies ahead.

A predictor lists its experts most confident first (the executor records the top-k of
its logits in order; the synthetic generator likewise). Keeping the first ``m`` of each
sequence's prediction and dropping the rest (``-1``, "not predicted") makes every
prefetching policy copy at most ``m`` experts a sequence ahead; what it no longer
prefetches and needs is copied on demand (fetch-on-miss) as before. Done on the trace,
so the planner, both engines and every policy see the same decision.
"""

from __future__ import annotations

from dataclasses import replace

from moesim.errors import MoesimError
from moesim.traces.format import Trace


def keep_top_predictions(trace: Trace, m: int) -> Trace:
    """``trace`` with each sequence's prediction cut to its first ``m`` experts."""
    k = trace.pred_ids.shape[-1]
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= k:
        raise MoesimError(f"prefetch top-m must be an integer from 1 to top_k ({k}), got {m!r}")
    if m == k:
        return trace
    pred, gates = trace.pred_ids.copy(), trace.pred_gates.copy()
    pred[..., m:] = -1
    gates[..., m:] = 0
    header = {**trace.header, "prefetch_top_m": m}
    return replace(trace, header=header, pred_ids=pred, pred_gates=gates)
