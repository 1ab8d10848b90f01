"""Does a deployment fit? The one memory-fit test, shared by every policy family.

Device memory holds the non-expert weights (but the input embedding table: engines keep
it in host memory and read one row a token), the KV cache at the run's longest context,
a workspace for activations and the CUDA context (:data:`WORKSPACE_BYTES`), and the
routed experts the policy keeps there: all of them (all-resident), the slots of the
layers in flight plus the cross-token cache (the copy policies, ``moesim.policy.expert_slots``),
the placement's resident set (cpu-static, hot-experts) or the cache and one layer of
staging buffers (cpu-on-miss). Every family is compared on these same terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.errors import DoesNotFit
from moesim.layout import CPU
from moesim.models import ModelSpec
from moesim.policy import Policy, as_policy

#: Device memory held back for activations, workspace and the CUDA context (an estimate;
#: llama.cpp users leave about this much free, and vLLM's default gpu_memory_utilization
#: of 0.9 leaves 2-8 GB on 24-80 GB parts).
WORKSPACE_BYTES = 1 << 30


def kv_bytes(spec: ModelSpec, batch: int, context: int) -> int:
    """KV cache (and linear layers' state) of ``batch`` sequences at ``context`` tokens:
    a sliding or chunked layer holds only its window (:meth:`ModelSpec.kv_cache_bytes`)."""
    return spec.kv_cache_bytes(batch, context)


def device_bytes(spec: ModelSpec, policy: str | Policy, *, cache_experts: int = 0, resident_experts: int = 0,
                 batch: int = 1, context: int = 0, lookahead: int = 1, shards: int = 1) -> int:
    """Device bytes a configuration needs on each GPU (see the module docstring);
    ``resident_experts`` is a static CPU placement's resident set (or a copy policy's pinned
    hot set), ``cache_experts`` a cache's total capacity, ``shards`` the GPUs that split weights and KV cache evenly (each keeps
    its own workspace)."""
    experts = as_policy(policy).device_experts(spec, cache_experts, resident_experts, lookahead)
    return _with_experts(spec, experts, batch, context, shards)


def _with_experts(spec: ModelSpec, experts: int, batch: int, context: int, shards: int = 1) -> int:
    """Device bytes on each GPU of the non-expert weights, the KV cache, ``experts`` routed
    experts (all split over ``shards`` GPUs) and the workspace."""
    weights = spec.non_expert_bytes - spec.input_embedding_bytes  # the table stays in host memory
    split = weights + kv_bytes(spec, batch, context) + experts * spec.expert_bytes
    return -(-split // shards) + WORKSPACE_BYTES


def expert_budget(spec: ModelSpec, device_memory: float, batch: int, context: int) -> int:
    """Bytes of device memory left for routed experts: device memory less what
    :func:`device_bytes` holds besides experts (a static placement of none)."""
    fixed = _with_experts(spec, 0, batch, context)
    left = device_memory - fixed
    if left < 0:
        raise DoesNotFit(f"{spec.name}: the non-expert weights and KV cache alone need {fixed / 1e9:.1f} GB, more "
                         f"than the device's {device_memory / 1e9:.1f} GB")
    return int(left)


@dataclass(frozen=True)
class LayoutBytes:
    """Where a static layout's bytes sit: per GPU, and in host memory (weights, KV cache)."""

    gpu: list[int]  # each GPU: its weights, KV cache and WORKSPACE_BYTES
    host_weights: int  # weights kept in host memory (what may page from disk)
    host_kv: int  # KV cache of the CPU's layers


def layout_bytes(spec: ModelSpec, layout, batch: int = 1, context: int = 0) -> LayoutBytes:
    """The bytes of a static :class:`moesim.layout.Layout`: each GPU its layers' attention
    and dense weights, their KV cache, its experts, the LM head if it has it, and
    :data:`WORKSPACE_BYTES`; the host the rest of the weights, the input embedding table
    (engines keep it there and read one row a token) and its layers' KV cache. Under
    ``split="tensor"`` every GPU holds an equal share of what the GPU layers hold, and a
    workspace of its own. A streamed layer (``layout.streamed``, vLLM's ``--cpu-offload-gb``)
    keeps its weights in host memory and its KV cache on its GPU."""
    g = max(layout.n_gpus, 0)
    gpu = [0] * g
    host, host_kv = spec.input_embedding_bytes, 0
    moe = {layer: m for m, layer in enumerate(spec.moe_layers)}
    streamed = layout.streamed if layout.streamed is not None else np.zeros(spec.n_layers, bool)
    for layer in range(spec.n_layers):
        d = int(layout.layer_device[layer])
        m = moe.get(layer)
        kv_layer = batch * spec.layer_kv_bytes(layer, context)
        if streamed[layer]:  # the weights in host memory, the KV cache on the GPU
            host += spec.layer_resident_bytes(layer) + (spec.n_experts * spec.moe_expert_bytes(m) if m is not None else 0)
            gpu[d] += kv_layer
            continue
        if d == CPU:
            host += spec.layer_resident_bytes(layer)
            host_kv += kv_layer
        else:
            gpu[d] += spec.layer_resident_bytes(layer) + kv_layer
        if m is not None:
            devs = layout.expert_device[m]
            each = spec.moe_expert_bytes(m)  # a GGUF's layers may differ (Q4_K_M's Q6_K ffn_down)
            host += int((devs == CPU).sum()) * each
            for i in range(g):
                gpu[i] += int((devs == i).sum()) * each
    if layout.head_device == CPU:
        host += spec.lm_head_bytes
    else:
        gpu[layout.head_device] += spec.lm_head_bytes
    if layout.split == "tensor" and g > 1:
        gpu = [-(-sum(gpu) // g)] * g
    return LayoutBytes([b + WORKSPACE_BYTES for b in gpu], host, host_kv)
