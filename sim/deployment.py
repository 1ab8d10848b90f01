"""Where a model lives across one node's GPUs and what a verification step costs there:
resident across the GPUs (tensor or expert parallel), or on one GPU with the experts
offloaded to host memory (the setting the rest of moesim models).

A :class:`Deployment` is a small typed description: the GPU (a hardware profile name or a
profile), how many, how the model is split, the engine that runs it
(:mod:`moesim.engines`: serving engines replay a CUDA graph with fused MoE kernels) and the NVLink figures for the collectives. NVLink 4 on H100/H200 SXM moves
900 GB/s per GPU, both directions together (NVIDIA H100 Tensor Core GPU datasheet;
NVIDIA H200 Tensor Core GPU datasheet), so 450 GB/s each way; the fixed cost of one
collective is an estimate (NCCL small-message latency inside one NVLink node is some
microseconds to tens of microseconds; calibrate against a measurement).

Verification of ``rows`` rows at one layer, every time from the one cost model
(:class:`moesim.costmodel.CostModel` with ``shards`` = the GPUs):

- attention block (attention, router, shared expert / dense FFN): its weights and the
  sequence's KV cache read once, FLOPs per row, split over the GPUs (``ep`` means
  tensor-parallel attention with expert-parallel MoE layers, as vLLM's expert-parallel
  mode runs);
- routed experts: the union of the rows' experts is read once. TP: every GPU reads 1/n of
  each distinct expert; EP: each GPU reads its own experts whole (experts placed in
  contiguous blocks), the layer waits for the busiest GPU (load imbalance is modelled);
  offloaded: experts not on the device are copied over the host link (the policy's
  Planner decides, the fast path times copies and stalls);
- collectives: an all-reduce after attention, ring cost 2 (n-1)/n x rows x hidden bf16
  / NVLink + latency; after the FFN another all-reduce (TP, and dense layers under EP) or,
  for an EP MoE layer, a dispatch and a combine all-to-all of rows x k x hidden bf16,
  (n-1)/n x bytes / NVLink + latency each.

Not modelled: pipeline parallelism, overlap of collectives with compute, NVLink SHARP,
KV-cache growth beyond the given context, prefill, batching several requests, MLA's
latent cache being replicated under TP (it is charged split), the draft's own collectives
(its weights are charged split over the GPUs like the target's attention), and the
collectives' order within a layer (they are charged with the attention block; on a
resident deployment only their sum matters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moesim.costmodel import CostModel
from moesim.engines import DEFAULT_ENGINE
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, get_profile
from moesim.memory import WORKSPACE_BYTES, device_bytes
from moesim.models import ModelSpec
from moesim.policy import get_policy
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import Step, plan_sets
from moesim.sim.workload import Link, lay_out

PARALLEL = ("single", "tp", "ep")


@dataclass(frozen=True)
class Deployment:
    name: str
    gpu: str | HardwareProfile  # hardware profile name, path or profile
    n_gpus: int = 1
    parallel: str = "single"
    offload: bool = False  # experts in host memory (one GPU); misses cost a host-to-device copy
    policy: str = "on-demand"  # offloaded: on-demand or prefetch-fom (prefetch the predicted union)
    cache_experts: int = 0  # offloaded: experts the device keeps across steps
    # Between the GPUs: None takes the GPU profile's peer_gbs / collective_latency_us
    # (NVLink on the SXM parts; moesim.hardware.HardwareProfile.peer_bw).
    nvlink_gbs: float | None = None
    collective_latency_us: float | None = None
    engine: str = DEFAULT_ENGINE  # the software (moesim.engines): resident serving deployments run vllm

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL:
            raise MoesimError(f"deployment {self.name}: parallel {self.parallel!r} not in {', '.join(PARALLEL)}")
        if self.n_gpus < 1 or (self.parallel == "single") != (self.n_gpus == 1):
            raise MoesimError(f"deployment {self.name}: one GPU is 'single'; tp and ep need n_gpus > 1")
        if self.offload and self.n_gpus != 1:
            raise MoesimError(f"deployment {self.name}: offloading is modelled on one GPU only")
        if self.offload and get_policy(self.policy).name not in ("on-demand", "prefetch-fom"):
            raise MoesimError(f"deployment {self.name}: offloaded verification is exact: on-demand or prefetch-fom")
        if self.nvlink_gbs is not None and not self.nvlink_gbs > 0 or \
                self.collective_latency_us is not None and not self.collective_latency_us >= 0:
            raise MoesimError(f"deployment {self.name}: nvlink_gbs > 0, collective latency >= 0")

    @property
    def peer_gbs(self) -> float:
        """GB/s per direction between two of its GPUs."""
        return self.nvlink_gbs if self.nvlink_gbs is not None else self.hw.peer_bw / 1e9

    @property
    def latency_us(self) -> float:
        """Fixed cost of one of its collectives, microseconds."""
        return self.collective_latency_us if self.collective_latency_us is not None \
            else self.hw.collective_latency * 1e6

    @property
    def shards(self) -> int:
        """Ways attention and the other dense weights are split (TP attention under both tp and ep)."""
        return self.n_gpus

    @property
    def hw(self) -> HardwareProfile:
        return self.gpu if isinstance(self.gpu, HardwareProfile) else get_profile(self.gpu)

    @property
    def gpu_name(self) -> str:
        return self.gpu.name if isinstance(self.gpu, HardwareProfile) else self.gpu

    def cost_model(self, spec: ModelSpec, shards: int | None = None) -> CostModel:
        return CostModel(spec, self.hw, engine=self.engine, shards=self.shards if shards is None else shards)

    def describe(self) -> str:
        if self.offload:
            return f"1 x {self.gpu_name}, experts offloaded to host ({self.policy}, cache {self.cache_experts})"
        if self.parallel == "single":
            return f"1 x {self.gpu_name}, resident"
        return f"{self.n_gpus} x {self.gpu_name}, {self.parallel.upper()}, {self.peer_gbs:g} GB/s between GPUs"


DEPLOYMENTS: dict[str, Deployment] = {d.name: d for d in [
    Deployment("8xh100-tp", "h100-sxm", 8, "tp", engine="vllm"),
    Deployment("8xh100-ep", "h100-sxm", 8, "ep", engine="vllm"),
    Deployment("8xh200-tp", "h200", 8, "tp", engine="vllm"),
    Deployment("8xh200-ep", "h200", 8, "ep", engine="vllm"),
    Deployment("1xh100-resident", "h100-sxm", engine="vllm"),
    Deployment("1xh200-resident", "h200", engine="vllm"),
    Deployment("1xh200-offload", "h200", offload=True),
    Deployment("1xh200-offload-prefetch", "h200", offload=True, policy="prefetch-fom"),
]}


def get_deployment(name: str | Deployment) -> Deployment:
    if isinstance(name, Deployment):
        return name
    if name not in DEPLOYMENTS:
        raise MoesimError(f"unknown deployment {name!r}; known: {', '.join(DEPLOYMENTS)}")
    return DEPLOYMENTS[name]


def check_fits(spec: ModelSpec, dep: Deployment, context: int = 0) -> dict[str, float]:
    """The memory-fit test (:func:`moesim.memory.device_bytes`) per GPU; one line if it fails."""
    policy = dep.policy if dep.offload else "all-resident"
    need = device_bytes(spec, policy, cache_experts=dep.cache_experts, context=context, shards=dep.n_gpus) / 1e9
    have = dep.hw["device_memory_gb"]
    if need > have:
        raise MoesimError(f"{spec.name} does not fit {dep.name}: {need:.0f} GB per GPU (weights, KV cache and a "
                          f"{WORKSPACE_BYTES / 2**30:g} GiB workspace), {have:g} GB on each")
    return {"gb_per_gpu": need, "device_gb": have}


def seconds_per_distinct_expert(spec: ModelSpec, dep: Deployment) -> float:
    """The analytic slope of verification latency against distinct experts: one expert's
    copy over the host link when every expert is copied on demand, else its bytes read at
    the aggregate HBM bandwidth of the GPUs that share it."""
    cm = dep.cost_model(spec, shards=1)
    if dep.offload:
        return cm.copy_expert()
    return cm.read(spec.expert_bytes / dep.n_gpus, kernels=0)


def time_steps(spec: ModelSpec, steps: list[Step], dep: Deployment, draft_s: np.ndarray | float = 0.0,
               context: int = 1024, check: bool = True) -> dict[str, Any]:
    """Time verification steps on a deployment; ``draft_s`` (per step or one figure) runs
    before each verification. Returns per-step arrays and the summary. ``check``: refuse a
    model that does not fit (replaying a recorded trace on its own machine passes False)."""
    if check:
        check_fits(spec, dep, context)
    n = dep.n_gpus
    cm = dep.cost_model(spec)
    moe = list(spec.moe_layers)
    s_n, n_layers, n_moe = len(steps), spec.n_layers, spec.n_moe_layers
    if not s_n:
        raise MoesimError("no verification steps to time")
    if any(len(st.true_union) != n_moe for st in steps):
        raise MoesimError(f"steps hold expert sets for another model than {spec.name} ({n_moe} MoE layers)")
    rows = np.array([st.rows for st in steps], float)
    produced = np.array([st.produced for st in steps], float)
    ctx = context + np.concatenate([[0.0], np.cumsum(produced)[:-1]])
    distinct = np.array([[len(u) for u in st.true_union] for st in steps], float)  # [S, M]

    # Attention blocks (+ collectives) per model layer: the rows of one sequence share its KV cache.
    attn = np.stack([cm.attention(layer, ctx, rows=rows, sequences=1) for layer in range(n_layers)], axis=1)
    if dep.parallel != "single":
        allreduce = cm.collective(rows * spec.hidden * 2, True, n, dep.peer_gbs, dep.latency_us)
        attn += allreduce[:, None]  # after attention
        after_ffn = np.tile(allreduce[:, None], (1, n_layers))
        if dep.parallel == "ep":
            after_ffn[:, moe] = 2 * cm.collective(rows * spec.top_k * spec.hidden * 2, False, n, dep.peer_gbs,
                                                  dep.latency_us)[:, None]
        attn += after_ffn

    # Routed experts per MoE layer: who reads which, the cost model times it.
    pairs = rows[:, None] * spec.top_k  # [S, 1] token-expert pairs a layer
    experts = np.zeros((s_n, n_layers))
    if dep.parallel == "ep":
        per_gpu = -(-spec.n_experts // n)
        busiest = np.array([[max(np.bincount(np.fromiter(u, int, len(u)) // per_gpu, minlength=n)) if u else 0
                             for u in st.true_union] for st in steps], float)
        experts[:, moe] = dep.cost_model(spec, shards=1).experts_device(busiest, pairs * busiest / np.maximum(distinct, 1))
    else:
        experts[:, moe] = cm.experts_device(distinct, pairs)
    pol = get_policy(dep.policy if dep.offload else "all-resident")
    plan = plan_sets([st.true_union for st in steps], [st.pred_union for st in steps], pol, dep.cache_experts)
    draft = np.broadcast_to(np.asarray(draft_s, float), (s_n,))
    head = np.array([cm.head(r) for r in rows])
    work = lay_out(spec, plan, attn, experts[:, moe], head + draft, f"roofline ({dep.name})")
    ends, copy, stall = run_fast(work, Link.of(cm))
    step_s = np.diff(ends, prepend=0.0)
    verify_s = step_s - draft
    return {
        "step_s": step_s, "verify_s": verify_s, "draft_s": np.array(draft), "distinct": distinct.sum(1),
        "rows": rows, "produced": produced, "copy_s": copy, "stall_s": stall,
        "tpot_ms": float(step_s.sum() / produced.sum() * 1e3),
    }
