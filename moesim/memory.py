"""Does a deployment fit? The one memory-fit test, shared by every policy family.

Device memory holds the non-expert weights, the KV cache at the run's longest context,
a workspace for activations and the CUDA context (:data:`WORKSPACE_BYTES`), and the
routed experts the policy keeps there: all of them (all-resident), the slots of the
layers in flight plus the cross-token cache (the copy policies, ``moesim.policy.expert_slots``),
the placement's resident set (cpu-static, hot-experts) or the cache and one layer of
staging buffers (cpu-on-miss). Every family is compared on these same terms.
"""

from __future__ import annotations

from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.policy import Policy, expert_slots, get_policy

#: Device memory held back for activations, workspace and the CUDA context (an estimate;
#: llama.cpp users leave about this much free, and vLLM's default gpu_memory_utilization
#: of 0.9 leaves 2-8 GB on 24-80 GB parts).
WORKSPACE_BYTES = 1 << 30


def kv_bytes(spec: ModelSpec, batch: int, context: int) -> int:
    """KV cache of ``batch`` sequences at ``context`` tokens."""
    return batch * context * spec.n_layers * spec.kv_bytes_per_token_layer


def device_bytes(spec: ModelSpec, policy: str | Policy, *, cache_experts: int = 0, resident_experts: int = 0,
                 batch: int = 1, context: int = 0, lookahead: int = 1, shards: int = 1) -> int:
    """Device bytes a configuration needs on each GPU (see the module docstring);
    ``resident_experts`` is a static CPU placement's resident set, ``cache_experts`` a
    cache's capacity, ``shards`` the GPUs that split weights and KV cache evenly (each keeps
    its own workspace)."""
    pol = get_policy(policy)
    if not pol.offload:
        experts = spec.n_moe_layers * spec.n_experts
    elif pol.cpu and pol.cpu != "miss":
        experts = resident_experts
    else:
        experts = expert_slots(spec, pol, cache_experts, lookahead)
    split = spec.non_expert_bytes + kv_bytes(spec, batch, context) + experts * spec.expert_bytes
    return -(-split // shards) + WORKSPACE_BYTES


def expert_budget(spec: ModelSpec, device_bytes: float, batch: int, context: int) -> int:
    """Bytes of device memory left for routed experts: device memory less the resident
    non-expert weights, the KV cache at ``context`` and :data:`WORKSPACE_BYTES`."""
    left = device_bytes - spec.non_expert_bytes - kv_bytes(spec, batch, context) - WORKSPACE_BYTES
    if left < 0:
        raise MoesimError(f"{spec.name}: the non-expert weights and KV cache alone need "
                          f"{(device_bytes - left) / 1e9:.1f} GB, more than the device's {device_bytes / 1e9:.1f} GB")
    return int(left)
