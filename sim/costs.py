"""Compute times: from a hardware profile (roofline) or from a trace's measurements.

Every result says which source it used. The roofline charges each block the larger of
its device-memory time (bytes / achievable bandwidth) and its math time (FLOPs /
achievable FLOP rate), plus a kernel-launch cost per kernel and the profile's fixed
per-layer overhead (zero unless calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moesim.errors import MoesimError
from moesim.hardware import (  # noqa: F401 (the kernel counts are defined there, once; re-exported)
    KERNELS_ATTENTION,
    KERNELS_EXPERT,
    KERNELS_HEAD,
    KERNELS_PREDICT,
    HardwareProfile,
)
from moesim.models import ModelSpec


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
    expert_math_s: float = 0.0  # math time of one expert-token (roofline only; batch > 1)

    def expert_compute(self, n_exec: np.ndarray, n_assign: np.ndarray) -> np.ndarray:
        """Time of a layer's routed experts: ``n_exec`` distinct experts serving ``n_assign``
        token-expert pairs. Memory-bound experts cost ``per_expert`` each; at large batch
        the layer becomes math-bound (one grouped GEMM)."""
        g = n_exec * self.per_expert
        if self.expert_math_s:
            g = np.maximum(g, n_assign * self.expert_math_s)
        return g


def _roofline(nbytes: float, flops: float, hw: HardwareProfile, kernels: int, dtype: str) -> float:
    return max(nbytes / hw.mem_bw, flops / hw.flops(dtype)) + kernels * hw.launch


def roofline_costs(spec: ModelSpec, hw: HardwareProfile, tokens: int, prompt_len: int, batch: int = 1) -> Costs:
    """Compute times predicted from the profile's bandwidth, FLOP rate and launch cost."""
    ctx = prompt_len + np.arange(tokens, dtype=np.int64)
    attn = np.empty((tokens, spec.n_layers))
    # attention_flops is affine in the context (weights + per-token score work): vectorised.
    base = spec.attention_flops(0)
    attn_flops = base + (spec.attention_flops(1) - base) * ctx
    kv = batch * ctx * spec.kv_bytes_per_token_layer
    for layer in range(spec.n_layers):
        resident = spec.layer_resident_bytes(layer)
        flops = batch * (attn_flops + spec.dense_flops_per_token(layer))
        mem = (resident + kv) / hw.mem_bw
        attn[:, layer] = np.maximum(mem, flops / hw.flops(spec.dense_dtype)) + KERNELS_ATTENTION * hw.launch + hw.layer_overhead
    per_expert = spec.expert_bytes / hw.mem_bw + KERNELS_EXPERT * hw.launch
    other = _roofline(spec.lm_head_bytes, batch * spec.lm_head_flops, hw, KERNELS_HEAD, "bf16")
    m = spec.n_moe_layers
    return Costs(attn, np.full((tokens, m), per_expert), np.full(tokens, other),
                 f"roofline ({hw.name})", spec.expert_flops(1) / hw.flops(spec.expert_dtype))


def measured_costs(timings: dict[str, np.ndarray], recorded_exec: np.ndarray) -> Costs:
    """Compute times a trace measured; ``recorded_exec[t, m]`` = experts the run executed,
    so a different policy's expert count can be charged at the measured per-expert rate."""
    missing = [k for k in ("attn_s", "expert_s", "other_s") if k not in timings]
    if missing:
        raise MoesimError(f"trace has no measured {', '.join(missing)}; use the profile's roofline instead")
    per_expert = timings["expert_s"] / np.maximum(recorded_exec, 1)
    return Costs(timings["attn_s"].astype(float), per_expert, timings["other_s"].astype(float), "measured (trace)")


def prediction_seconds(spec: ModelSpec, hw: HardwareProfile, batch: int = 1) -> np.ndarray:
    """Roofline time of predicting the next MoE layer's experts at the end of each model
    layer's router, ``[n_layers]`` (0 where no MoE layer follows).

    The predictor applies the next layer's post-attention RMSNorm and router to this
    layer's hidden state (a quasi-hidden state): it reads ``hidden`` norm weights and the
    ``n_experts x hidden`` router (bf16) and does ``2 x n_experts x hidden`` FLOPs a token.
    """
    out = np.zeros(spec.n_layers)
    one = _roofline(2 * spec.hidden + spec.router_bytes, batch * 2 * spec.n_experts * spec.hidden, hw,
                    KERNELS_PREDICT, "bf16")
    for nxt in spec.moe_layers[1:]:
        out[nxt - 1] = one  # issued where the workload issues that layer's prefetch
    return out


def charge_prediction(costs: Costs, spec: ModelSpec, hw: HardwareProfile, predicts: bool, batch: int = 1,
                      measured: np.ndarray | None = None) -> Costs:
    """Costs with the predictor's time charged to the policies that run one.

    Roofline costs leave prediction out, so a predicting policy gets
    :func:`prediction_seconds` added to each layer's attention block. Measured costs
    already contain it in ``attn_s`` (the recording run's ``predict_s`` is part of it), so
    a policy that predicts nothing gets ``measured`` (``predict_s``) taken back out.
    The oracle's prediction is free by definition: callers pass ``predicts=False``.
    """
    if costs.source.startswith("measured"):
        if predicts or measured is None:
            return costs
        return replace(costs, attn=np.maximum(costs.attn - measured, 0.0))
    if not predicts:
        return costs
    return replace(costs, attn=costs.attn + prediction_seconds(spec, hw, batch)[None, :],
                   source=costs.source + " + predictor")
