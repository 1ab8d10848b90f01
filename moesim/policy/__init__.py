"""The policy families and the decisions they make, shared by the simulator and the executor.

- :mod:`moesim.policy.families`: each family a class that owns its knobs and answers the
  questions the rest of moesim asks of a policy; the registry of policies by name.
- :mod:`moesim.policy.planner`: the copy family's per-layer decisions (what to copy, what
  to execute, what the cache keeps) and their compiled twin over a whole trace
  (:mod:`moesim.policy.kernel`, numba); cpu-on-miss's CPU-or-copy choice.

Everything a caller needs is importable from here (``from moesim.policy import get_policy``).
"""

from moesim.policy.families import (
    ALIASES,
    EVICTIONS,
    POLICIES,
    WHATIF_POLICIES,
    CopyExperts,
    CpuLayers,
    CpuOnMiss,
    GpuLayers,
    HotExperts,
    Policy,
    Resident,
    WeightStreaming,
    WithHost,
    as_policy,
    check_eviction,
    check_lookahead,
    default_policies,
    engine_policies,
    expert_slots,
    family_range_kind,
    get_policy,
    of_row,
    register,
    runs_on,
)
from moesim.policy.planner import (
    PLAN_CHUNK,
    QUEUES,
    ExpertCache,
    Key,
    LayerCaches,
    LayerPlan,
    Planner,
    cpu_or_copy,
)

__all__ = ["ALIASES", "EVICTIONS", "PLAN_CHUNK", "POLICIES", "QUEUES", "WHATIF_POLICIES", "CopyExperts", "CpuLayers",
           "CpuOnMiss", "ExpertCache", "GpuLayers", "HotExperts", "Key", "LayerCaches", "LayerPlan", "Planner", "Policy",
           "Resident", "WeightStreaming", "WithHost", "as_policy", "check_eviction", "check_lookahead", "cpu_or_copy",
           "default_policies", "engine_policies", "expert_slots", "family_range_kind", "get_policy", "of_row", "register", "runs_on"]
