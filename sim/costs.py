"""Compute times over a trace's steps and layers: from the cost model or from a trace's
measurements. Every result says which source it used.

The roofline times come from :class:`moesim.costmodel.CostModel` (the one place bytes and
rates become seconds); measured times are the trace's own. Both are laid out the same
way, so the workload builder and the timing engines never know which they got.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moesim.costmodel import CostModel, device_expert_seconds, with_layer_launches
from moesim.engines import DEFAULT_ENGINE
from moesim.errors import MoesimError


@dataclass(frozen=True)
class Costs:
    """Per-step compute times in seconds.

    ``attn[t, l]`` covers layer l's attention and router (and its dense FFN or shared
    experts); ``per_expert[t, m]`` is one routed expert at MoE layer m; ``other[t]`` the
    embedding, final norm and LM head.
    """

    attn: np.ndarray
    per_expert: np.ndarray
    other: np.ndarray
    source: str
    expert_math_s: float = 0.0  # math time of one expert-token pair (roofline only; batch > 1)
    layer_fixed_s: float = 0.0  # a fused engine's launches, once per layer that runs experts
    layer_serial_s: float = 0.0  # its weightless kernels' launches, after the expert work (a kernel's time is its own)
    overlap: bool = False  # those launches overlap the kernels (moesim.costmodel.with_launches)

    def expert_compute(self, n_exec: np.ndarray, n_assign: np.ndarray) -> np.ndarray:
        """Time of a layer's routed experts: ``n_exec`` distinct experts serving ``n_assign``
        token-expert pairs (:func:`moesim.costmodel.device_expert_seconds`). Where all three
        are one number everywhere (a roofline's rate, and a plan whose every step executes
        the same count: batch 1), it is priced once and filled in, the same float64 values
        (a 100,000-token Qwen3-30B-A3B replay priced 4.8M cells 4 times, 0.1 s each)."""
        one = [_one_value(x) for x in (n_exec, n_assign, self.per_expert)]
        if all(v is not None for v in one):
            n, a, per = one
            g = with_layer_launches(device_expert_seconds(n, a, per, self.expert_math_s), n, self.layer_fixed_s,
                                    self.layer_serial_s, self.overlap)
            return np.full(np.broadcast_shapes(np.shape(n_exec), np.shape(n_assign), self.per_expert.shape), g)
        g = device_expert_seconds(n_exec, n_assign, self.per_expert, self.expert_math_s)
        return with_layer_launches(g, np.asarray(n_exec), self.layer_fixed_s, self.layer_serial_s, self.overlap)


def _one_value(a: np.ndarray) -> np.generic | None:
    """The one value of an array that is a broadcast of one (every stride 0), else None: the
    check costs nothing, where finding that a full array holds one value reads all of it."""
    a = np.asarray(a)
    return a.flat[0] if a.size and not any(a.strides) else None


def roofline_costs(cm: CostModel, tokens: int, prompt_len: int, batch: int = 1) -> Costs:
    """Compute times the cost model predicts for ``tokens`` decode steps after a prompt of
    ``prompt_len`` tokens, ``batch`` sequences a step."""
    spec = cm.spec
    ctx = prompt_len + np.arange(tokens, dtype=np.int64)
    attn = cm.attention_by_layer(ctx, rows=batch)
    m = spec.n_moe_layers
    # One rate at every step and layer: a read-only broadcast (Costs.expert_compute prices it once).
    return Costs(attn, np.broadcast_to(np.float64(cm.expert_read()), (tokens, m)), np.full(tokens, cm.head(batch)),
                 f"roofline ({cm.gpu.name}{'' if cm.engine.name == DEFAULT_ENGINE else ', ' + cm.engine.label})",
                 cm.expert_pair(), cm.layer_expert_launches, cm.layer_expert_serial, cm.overlap)


def measured_costs(timings: dict[str, np.ndarray], recorded_exec: np.ndarray) -> Costs:
    """Compute times a trace measured; ``recorded_exec[t, m]`` = experts the run executed,
    so a different policy's expert count can be charged at the measured per-expert rate."""
    missing = [k for k in ("attn_s", "expert_s", "other_s") if k not in timings]
    if missing:
        raise MoesimError(f"trace has no measured {', '.join(missing)}; use the profile's roofline instead")
    per_expert = timings["expert_s"] / np.maximum(recorded_exec, 1)
    return Costs(timings["attn_s"].astype(float), per_expert, timings["other_s"].astype(float), "measured (trace)")


def prediction_seconds(cm: CostModel, lookahead: int = 1, batch: int = 1) -> np.ndarray:
    """Time of the predictions a prefetching policy makes, ``[n_layers]``: at each MoE
    layer's router that issues a prefetch (the one ``lookahead`` MoE layers ahead), one
    :meth:`CostModel.prediction`; 0 elsewhere."""
    moe = cm.spec.moe_layers
    out = np.zeros(cm.spec.n_layers)
    one = cm.prediction(batch)
    for m in range(len(moe) - lookahead):
        out[moe[m]] = one  # issued where the workload issues layer m + lookahead's prefetch
    return out


def charge_prediction(costs: Costs, cm: CostModel, predicts: bool, batch: int = 1,
                      measured: np.ndarray | None = None, lookahead: int = 1) -> Costs:
    """Costs with the predictor's time charged to the policies that run one.

    Roofline costs leave prediction out, so a predicting policy gets
    :func:`prediction_seconds` added to each issuing layer's attention block. Measured
    costs already contain it in ``attn_s`` (the recording run's ``predict_s`` is part of
    it), so a policy that predicts nothing gets ``measured`` (``predict_s``) taken back out.
    The oracle's prediction is free by definition: callers pass ``predicts=False``.
    """
    if costs.source.startswith("measured"):
        if predicts or measured is None:
            return costs
        return replace(costs, attn=np.maximum(costs.attn - measured, 0.0))
    if not predicts:
        return costs
    return replace(costs, attn=costs.attn + prediction_seconds(cm, lookahead, batch)[None, :],
                   source=costs.source + " + predictor")
