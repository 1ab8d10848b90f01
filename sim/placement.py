"""Where a model lives and what a verification step costs there: resident across the GPUs
of one node (tensor or expert parallel), or on one GPU with the experts offloaded to host
memory (the setting the rest of moesim models).

A :class:`Deployment` is a small typed description: the GPU (a hardware profile name), how
many, how the model is split, and the NVLink figures for the collectives. NVLink 4 on
H100/H200 SXM moves 900 GB/s per GPU, both directions together (NVIDIA H100 Tensor Core
GPU datasheet; NVIDIA H200 Tensor Core GPU datasheet), so 450 GB/s each way; the fixed
cost of one collective is an estimate (NCCL small-message latency inside one NVLink node
is some microseconds to tens of microseconds; calibrate against a measurement).

Verification of ``rows`` rows at one layer (per GPU, roofline like :mod:`moesim.sim.costs`):

- attention block (attention, router, shared expert / dense FFN): its weights and the KV
  cache read once, FLOPs per row, split over the GPUs (``ep`` means tensor-parallel
  attention with expert-parallel MoE layers, as vLLM's expert-parallel mode runs);
- routed experts: the union of the rows' experts is read once (a fused MoE kernel, one
  grouped GEMM per layer, as serving engines do: no per-expert launch). TP: every GPU reads
  1/n of each distinct expert; EP: each GPU reads its own experts whole (experts placed in
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

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, get_profile
from moesim.models import ModelSpec
from moesim.policy import Planner, get_policy
from moesim.sim.costs import KERNELS_ATTENTION, KERNELS_EXPERT, KERNELS_HEAD
from moesim.sim.fastpath import run_fast
from moesim.sim.speculative import Step
from moesim.sim.workload import Link, Workload

PARALLEL = ("single", "tp", "ep")
NVLINK4_GBS = 450.0  # per GPU, per direction (900 GB/s bidirectional: NVIDIA H100 / H200 SXM datasheets)
COLLECTIVE_LATENCY_US = 10.0  # estimate: one small-message collective inside an NVLink node
GRAPH_LAUNCH_US = 2.0  # estimate: one kernel of a replayed CUDA graph (resident deployments)


@dataclass(frozen=True)
class Deployment:
    name: str
    gpu: str  # hardware profile name or path
    n_gpus: int = 1
    parallel: str = "single"
    offload: bool = False  # experts in host memory (one GPU); misses cost a host-to-device copy
    policy: str = "on-demand"  # offloaded: on-demand or prefetch-fom (prefetch the predicted union)
    cache_experts: int = 0  # offloaded: experts the device keeps across steps
    nvlink_gbs: float = NVLINK4_GBS
    collective_latency_us: float = COLLECTIVE_LATENCY_US
    usable_memory: float = 0.9  # share of device memory weights may take (the rest: KV cache, activations)
    #: Per-kernel launch cost; None = the profile's (eager) figure. Serving engines replay a
    #: captured CUDA graph per decode step, where a kernel costs a microsecond or two (estimate).
    kernel_launch_us: float | None = None

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL:
            raise MoesimError(f"deployment {self.name}: parallel {self.parallel!r} not in {', '.join(PARALLEL)}")
        if self.n_gpus < 1 or (self.parallel == "single") != (self.n_gpus == 1):
            raise MoesimError(f"deployment {self.name}: one GPU is 'single'; tp and ep need n_gpus > 1")
        if self.offload and self.n_gpus != 1:
            raise MoesimError(f"deployment {self.name}: offloading is modelled on one GPU only")
        if self.offload and get_policy(self.policy).name not in ("on-demand", "prefetch-fom"):
            raise MoesimError(f"deployment {self.name}: offloaded verification is exact: on-demand or prefetch-fom")
        if self.nvlink_gbs <= 0 or self.collective_latency_us < 0 or not 0 < self.usable_memory <= 1 or (
                self.kernel_launch_us is not None and self.kernel_launch_us <= 0):
            raise MoesimError(f"deployment {self.name}: nvlink_gbs > 0, latency >= 0, usable_memory in (0, 1], "
                              "kernel_launch_us > 0")

    @property
    def shards(self) -> int:
        """Ways attention and the other dense weights are split (TP attention under both tp and ep)."""
        return self.n_gpus

    @property
    def hw(self) -> HardwareProfile:
        hw = get_profile(self.gpu)
        if self.kernel_launch_us is not None:
            hw = hw.with_figure("kernel_launch_us", self.kernel_launch_us, "estimate",
                                f"deployment {self.name}: kernels replayed from a CUDA graph")
        return hw

    def describe(self) -> str:
        if self.offload:
            return f"1 x {self.gpu}, experts offloaded to host ({self.policy}, cache {self.cache_experts})"
        if self.parallel == "single":
            return f"1 x {self.gpu}, resident"
        return f"{self.n_gpus} x {self.gpu}, {self.parallel.upper()}, NVLink {self.nvlink_gbs:g} GB/s"


DEPLOYMENTS: dict[str, Deployment] = {d.name: d for d in [
    Deployment("8xh100-tp", "h100-sxm", 8, "tp", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("8xh100-ep", "h100-sxm", 8, "ep", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("8xh200-tp", "h200", 8, "tp", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("8xh200-ep", "h200", 8, "ep", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("1xh100-resident", "h100-sxm", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("1xh200-resident", "h200", kernel_launch_us=GRAPH_LAUNCH_US),
    Deployment("1xh200-offload", "h200", offload=True),
    Deployment("1xh200-offload-prefetch", "h200", offload=True, policy="prefetch-fom"),
]}


def get_deployment(name: str | Deployment) -> Deployment:
    if isinstance(name, Deployment):
        return name
    if name not in DEPLOYMENTS:
        raise MoesimError(f"unknown deployment {name!r}; known: {', '.join(DEPLOYMENTS)}")
    return DEPLOYMENTS[name]


def memory_per_gpu(spec: ModelSpec, dep: Deployment) -> float:
    """Weight bytes each GPU holds."""
    if dep.offload:
        return spec.non_expert_bytes + dep.cache_experts * spec.expert_bytes
    return (spec.non_expert_bytes + spec.all_expert_bytes) / dep.n_gpus


def check_fits(spec: ModelSpec, dep: Deployment) -> dict[str, float]:
    """Weights per GPU against usable device memory; a one-line error if they do not fit."""
    need = memory_per_gpu(spec, dep) / 1e9
    have = dep.hw["device_memory_gb"] * dep.usable_memory
    if need > have:
        raise MoesimError(f"{spec.name} does not fit {dep.name}: {need:.0f} GB of weights per GPU, "
                          f"{have:.0f} GB usable ({dep.usable_memory:.0%} of {dep.hw['device_memory_gb']:g} GB)")
    return {"weights_gb_per_gpu": need, "usable_gb_per_gpu": have}


def seconds_per_distinct_expert(spec: ModelSpec, dep: Deployment) -> float:
    """The analytic slope of verification latency against distinct experts: one expert's
    bytes over the bandwidth that serves it (aggregate HBM when split, the host link when
    every expert is copied on demand)."""
    hw = dep.hw
    if dep.offload:
        return spec.expert_bytes / hw.link_bw + hw.transfer_latency
    return spec.expert_bytes / (dep.n_gpus * hw.mem_bw)


def _collective(dep: Deployment, nbytes: np.ndarray, allreduce: bool) -> np.ndarray:
    n = dep.n_gpus
    factor = 2 * (n - 1) / n if allreduce else (n - 1) / n
    return dep.collective_latency_us * 1e-6 + factor * nbytes / (dep.nvlink_gbs * 1e9)


def time_steps(spec: ModelSpec, steps: list[Step], dep: Deployment, draft_s: np.ndarray | float = 0.0,
               context: int = 1024) -> dict[str, Any]:
    """Time verification steps on a deployment; ``draft_s`` (per step or one figure) runs
    before each verification. Returns per-step arrays and the summary."""
    check_fits(spec, dep)
    hw = dep.hw
    n, sh = dep.n_gpus, dep.shards
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

    # Attention blocks (+ collectives) per model layer.
    attn = np.empty((s_n, n_layers))
    f_dense = hw.flops(spec.dense_dtype)
    for layer in range(n_layers):
        resident = spec.layer_resident_bytes(layer)
        kv = ctx * spec.kv_bytes_per_token_layer
        ffn_flops = 2 * (resident - spec.attention_bytes)
        flops = rows * (np.array([spec.attention_flops(int(c)) for c in ctx]) + ffn_flops)
        attn[:, layer] = (np.maximum((resident + kv) / sh / hw.mem_bw, flops / sh / f_dense)
                          + KERNELS_ATTENTION * hw.launch + hw.layer_overhead)
    if dep.parallel != "single":
        allreduce = _collective(dep, rows * spec.hidden * 2, True)[:, None]
        attn += allreduce  # after attention
        after_ffn = np.tile(allreduce, (1, n_layers))
        if dep.parallel == "ep":
            after_ffn[:, moe] = 2 * _collective(dep, rows * spec.top_k * spec.hidden * 2, False)[:, None]
        attn += after_ffn

    # Routed experts per MoE layer.
    eb, f_exp = spec.expert_bytes, hw.flops(spec.expert_dtype)
    math = rows[:, None] * spec.top_k * spec.expert_flops(1) / f_exp  # [S, 1]
    demand = np.zeros((s_n, n_layers), np.int32)
    prefetch_next = np.zeros((s_n, n_layers), np.int32)
    experts = np.zeros((s_n, n_layers))
    if dep.parallel == "ep":
        per_gpu = -(-spec.n_experts // n)
        busiest = np.array([[max(np.bincount(np.fromiter(u, int, len(u)) // per_gpu, minlength=n)) if u else 0
                             for u in st.true_union] for st in steps], float)
        experts[:, moe] = np.maximum(busiest * eb / hw.mem_bw, math * busiest / np.maximum(distinct, 1))
    else:
        experts[:, moe] = np.maximum(distinct * eb / sh / hw.mem_bw, math / sh)
    experts[:, moe] += KERNELS_EXPERT * hw.launch
    if dep.offload:
        pol = get_policy(dep.policy)
        planner = Planner(pol, dep.cache_experts, "lru")
        for s_, st in enumerate(steps):
            for m in range(n_moe):
                plan = planner.route(m, sorted(st.true_union[m]), sorted(st.pred_union[m]) if m and pol.prefetch else None)
                if m + 1 < n_moe and pol.prefetch:
                    prefetch_next[s_, moe[m + 1] - 1] = len(planner.prefetch(m + 1, sorted(st.pred_union[m + 1])))
                planner.finish(m, plan)
                demand[s_, moe[m]] = len(plan.demand)

    head_flops = rows * 2 * spec.vocab * spec.hidden
    head = (np.maximum(spec.vocab * spec.hidden * 2 / sh / hw.mem_bw, head_flops / sh / hw.flops("bf16"))
            + KERNELS_HEAD * hw.launch)
    draft = np.broadcast_to(np.asarray(draft_s, float), (s_n,))
    work = Workload(attn, experts, demand, prefetch_next, head + draft, f"roofline ({dep.name})")
    ends, copy, stall = run_fast(work, Link.from_profile(hw, spec))
    step_s = np.diff(ends, prepend=0.0)
    verify_s = step_s - draft
    return {
        "step_s": step_s, "verify_s": verify_s, "draft_s": np.array(draft), "distinct": distinct.sum(1),
        "rows": rows, "produced": produced, "copy_s": copy, "stall_s": stall,
        "tpot_ms": float(step_s.sum() / produced.sum() * 1e3),
    }
