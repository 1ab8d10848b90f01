"""Compute times: from a hardware profile (roofline) or from a trace's measurements.

Every result says which source it used. The roofline charges each block the larger of
its device-memory time (bytes / achievable bandwidth) and its math time (FLOPs /
achievable FLOP rate), plus a kernel-launch cost per kernel and the profile's fixed
per-layer overhead (zero unless calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile
from moesim.models import ModelSpec

#: Kernels an eager decoder launches per attention block (norm, q/k/v, rope, attention,
#: output projection, residual, norm, router, top-k) and per expert (gate-up, act, down).
KERNELS_ATTENTION = 10
KERNELS_EXPERT = 3
KERNELS_HEAD = 3  # final norm, LM head, sampling


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
    ctx = prompt_len + np.arange(tokens)
    attn = np.empty((tokens, spec.n_layers))
    for layer in range(spec.n_layers):
        resident = spec.layer_resident_bytes(layer)
        kv = batch * ctx * spec.kv_bytes_per_token_layer
        flops = batch * (np.array([spec.attention_flops(int(c)) for c in ctx]) + spec.dense_flops_per_token(layer))
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
