"""The cost model: every time moesim predicts, from one description of the deployment.

One object, :class:`CostModel`, answers "how long does this piece of work take here?"
for the model (:class:`moesim.models.ModelSpec`: bytes and FLOPs), the GPU
(:class:`moesim.hardware.HardwareProfile`), the host (:class:`moesim.hardware.HostProfile`)
and the engine that runs them (:class:`Engine`: kernels, launches, overheads). Its shape
follows Vidur's execution-time predictor (Agrawal et al., "Vidur: A Large-Scale
Simulation Framework for LLM Inference", MLSys 2024, arXiv:2405.05465): the planner
decides what happens, the timing engines (SimPy, the compiled fast path) order it in
time, and every piece of work is priced here and nowhere else:

=====================  ==========================================================
piece                  method
=====================  ==========================================================
attention block        :meth:`CostModel.attention` (attention at a context, router,
                       dense FFN or shared experts, per-layer overhead)
routed experts         :meth:`CostModel.experts_device`, :meth:`CostModel.experts_cpu`
                       (by weight format; :meth:`CostModel.expert_times` bundles
                       the figures the CPU policies decide with)
LM head                :meth:`CostModel.head`
next-layer prediction  :meth:`CostModel.prediction`
a copy of N bytes      :meth:`CostModel.copy`, :meth:`CostModel.copy_expert`
a layer's prefill      :meth:`CostModel.prefill_layer`
a draft forward        :meth:`CostModel.draft_forward`
a collective           :meth:`CostModel.collective`
=====================  ==========================================================

Every block on a processor is a roofline: the larger of its memory time (bytes / the
bandwidth the engine reaches) and its math time (FLOPs / the achievable rate), plus the
engine's fixed costs (kernel launches, dispatch, per-layer overhead). A new cost term
joins here, as a method or as a figure of the engine or a profile, and every command
picks it up (docs/policies.md, "The cost model").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, HostProfile
from moesim.models import ModelSpec


@dataclass(frozen=True)
class Engine:
    """What the software running the model adds to the hardware's figures.

    The default, ``eager``, is a framework that launches every kernel from Python
    (PyTorch eager, the reference executor): per attention block norm, q/k/v, rope,
    attention, output projection, residual, norm, router and top-k; per expert gate-up,
    activation and down; per step final norm, LM head and sampling; per prediction the
    quasi-hidden state's norm, the next layer's router and top-k. ``graph`` replays a
    captured CUDA graph with fused MoE kernels (vLLM, SGLang): one launch per layer's
    experts at a graph's per-kernel cost.
    """

    name: str = "eager"
    attention_kernels: int = 10
    expert_kernels: int = 3  # per expert; per layer when ``fused_experts``
    head_kernels: int = 3
    predict_kernels: int = 3
    fused_experts: bool = False
    kernel_launch_us: float | None = None  # None: the GPU profile's kernel_launch_us

    def __post_init__(self) -> None:
        if min(self.attention_kernels, self.expert_kernels, self.head_kernels, self.predict_kernels) < 0 or (
                self.kernel_launch_us is not None and not self.kernel_launch_us > 0):
            raise MoesimError(f"engine {self.name!r}: kernel counts must be >= 0 and kernel_launch_us > 0")


EAGER = Engine()
#: Serving engines replay one captured CUDA graph per decode step, where a kernel costs a
#: microsecond or two (estimate: NVIDIA's CUDA Graphs documentation and vLLM's
#: ``--enforce-eager`` comparisons show launch overhead falling from ~5 us to ~1-2 us).
GRAPH = Engine("graph", fused_experts=True, expert_kernels=1, kernel_launch_us=2.0)


def device_expert_seconds(n: np.ndarray | float, assign: np.ndarray | float, per_expert: np.ndarray | float,
                          per_pair: np.ndarray | float) -> np.ndarray | float:
    """Seconds ``n`` experts serving ``assign`` token-expert pairs take on one processor
    that reads each expert's weights once (``per_expert`` seconds, launches included) and
    multiplies every pair (``per_pair``): memory-bound at small batch, math-bound at large
    batch (one grouped GEMM). The one rule both the device and the CPU experts follow."""
    return np.maximum(n * per_expert, assign * per_pair)


@dataclass(frozen=True, kw_only=True)
class ExpertTimes:
    """Seconds the two places to run an expert cost (a :class:`CostModel`'s figures at one
    batch size), as the CPU-compute policies decide and are timed with.

    A set of ``n`` experts serving ``a`` token-expert pairs takes, on the device,
    ``max(n * (mem + launches), a * tok)`` and on the CPU
    ``max(n * mem, a * tok) + n * dispatch + roundtrip``: the weights are read once per
    expert, the math grows with the tokens. The CPU pays the activation ``roundtrip``
    once per layer (hidden states down, expert outputs back up).
    """

    gpu_mem: float  # one expert's weights read from device memory
    gpu_tok: float  # one token-expert pair's math on the device
    gpu_fixed: float  # kernel launches of one expert
    cpu_mem: float  # one expert's weights read from host memory
    cpu_tok: float  # one token-expert pair's math on the CPU
    cpu_fixed: float  # CPU dispatch of one expert
    roundtrip: float  # activations device -> host -> device, once per layer with CPU work
    copy: float  # one expert's host-to-device copy on the link

    def gpu(self, n, assign):
        """Device seconds (:func:`device_expert_seconds`); works on scalars and arrays."""
        return device_expert_seconds(n, assign, self.gpu_mem + self.gpu_fixed, self.gpu_tok)

    def cpu(self, n, assign):
        """CPU seconds, 0 where no expert runs there; works on scalars and arrays."""
        t = device_expert_seconds(n, assign, self.cpu_mem, self.cpu_tok) + n * self.cpu_fixed + self.roundtrip
        return np.where(np.asarray(n) > 0, t, 0.0) if isinstance(n, np.ndarray) else (t if n else 0.0)


class CostModel:
    """Seconds of every piece of decode and prefill work for one deployment.

    ``gpu`` is the device profile (its figures as given: a what-if's link override is a
    profile with that figure replaced); ``host`` the CPU that holds offloaded experts and,
    under the CPU-compute policies, multiplies them (None: no CPU work can be priced);
    ``engine`` the software (:data:`EAGER` by default); ``shards`` splits the dense
    weights (and under tensor parallelism the experts) over that many devices; ``amx``
    lets the host's AMX matrix units run expert math where it has them.
    """

    def __init__(self, spec: ModelSpec, gpu: HardwareProfile, host: HostProfile | None = None,
                 engine: Engine = EAGER, *, shards: int = 1, amx: bool = True) -> None:
        if shards < 1:
            raise MoesimError(f"shards must be >= 1, got {shards}")
        self.spec, self.gpu, self.host, self.engine, self.shards, self.amx = spec, gpu, host, engine, shards, amx
        self.launch = gpu.launch if engine.kernel_launch_us is None else engine.kernel_launch_us * 1e-6
        self.layer_overhead = gpu.layer_overhead

    # -- the roofline: the one place bytes and rates become seconds ----------------------
    def _device(self, nbytes, flops, dtype: str, kernels: float = 0.0):
        """A block on the device: ``max(bytes / bandwidth, FLOPs / rate) + kernels x launch``."""
        return np.maximum(nbytes / self.gpu.mem_bw, flops / self.gpu.flops(dtype)) + kernels * self.launch

    def _host(self) -> HostProfile:
        if self.host is None:
            raise MoesimError("this cost needs a host (CPU) profile: pick one with --host (`moesim hw --hosts`)")
        return self.host

    # -- device work ---------------------------------------------------------------------
    def attention(self, layer: int, context, rows: float = 1, sequences: float | None = None):
        """One model layer's block before its routed experts: attention over ``context``
        past tokens (a number or an array of them) for ``rows`` new tokens of ``sequences``
        sequences (each reads its own KV cache; default: one sequence a row), the router
        and shared experts of an MoE layer or the dense FFN of a dense layer, the engine's
        launches and the per-layer overhead."""
        s, sh = self.spec, self.shards
        seqs = rows if sequences is None else sequences
        ctx = np.asarray(context, float)
        base = s.attention_flops(0)
        attn_flops = base + (s.attention_flops(1) - base) * ctx  # affine in the context
        kv = seqs * ctx * s.kv_bytes_per_token_layer
        flops = rows * (attn_flops + s.dense_flops_per_token(layer))
        t = self._device((s.layer_resident_bytes(layer) + kv) / sh, flops / sh, s.dense_dtype,
                         self.engine.attention_kernels) + self.layer_overhead
        return t if t.ndim else float(t)

    def head(self, rows: float = 1) -> float:
        """The final norm and the LM head (:attr:`ModelSpec.lm_head_bytes`), sampling included."""
        s = self.spec
        return float(self._device(s.lm_head_bytes / self.shards, rows * s.lm_head_flops / self.shards, "bf16",
                                  self.engine.head_kernels))

    def prediction(self, rows: float = 1) -> float:
        """Predicting a later MoE layer's experts at a router: the quasi-hidden state's
        RMSNorm (``hidden`` bf16 weights) and that layer's ``n_experts x hidden`` router,
        ``2 x n_experts x hidden`` FLOPs a token, and the top-k."""
        s = self.spec
        return float(self._device(2 * s.hidden + s.router_bytes, rows * 2 * s.n_experts * s.hidden, "bf16",
                                  self.engine.predict_kernels))

    def expert_read(self) -> float:
        """Seconds one routed expert's weights take to read on the device, with its launches
        (per expert under an eager engine; a fused engine pays them once a layer)."""
        e = self.engine
        per = 0.0 if e.fused_experts else e.expert_kernels
        return float(self._device(self.spec.expert_bytes / self.shards, 0.0, self.spec.expert_dtype, per))

    def expert_pair(self) -> float:
        """Seconds of one token-expert pair's math on the device."""
        return float(self.spec.expert_flops(1) / self.shards / self.gpu.flops(self.spec.expert_dtype))

    def experts_device(self, n, assign):
        """``n`` distinct routed experts serving ``assign`` token-expert pairs on the device
        (:func:`device_expert_seconds`; a fused engine adds its launches once a layer)."""
        t = device_expert_seconds(n, assign, self.expert_read(), self.expert_pair())
        if self.engine.fused_experts:
            t = t + np.where(np.asarray(n) > 0, self.engine.expert_kernels * self.launch, 0.0)
        return t

    # -- the CPU -------------------------------------------------------------------------
    def roundtrip(self, rows: float = 1) -> float:
        """One layer's activation round trip for CPU experts: the host profile's fixed
        latency plus ``rows`` hidden states down and expert outputs up (bf16) over the link."""
        return self._host().roundtrip + self.copy(2 * 2 * rows * self.spec.hidden, transfers=0)

    def expert_times(self, batch: int = 1) -> ExpertTimes:
        """The figures of one expert on the device and on the CPU and one copy over the link,
        at ``batch`` sequences: what the CPU-compute policies are timed and decided with
        (the simulator and the executor's cpu-on-miss alike)."""
        s, h = self.spec, self._host()
        e = self.engine
        return ExpertTimes(
            gpu_mem=float(self._device(s.expert_bytes, 0.0, s.expert_dtype)), gpu_tok=self.expert_pair(),
            gpu_fixed=e.expert_kernels * self.launch,
            cpu_mem=s.expert_bytes / h.mem_bw, cpu_tok=s.expert_flops(1) / h.flops(s.expert_dtype, self.amx),
            cpu_fixed=h.dispatch, roundtrip=self.roundtrip(batch), copy=self.copy_expert(),
        )

    def experts_cpu(self, n, assign, rows: float = 1):
        """``n`` experts serving ``assign`` pairs on the CPU, the round trip included (0 if none)."""
        return self.expert_times(int(rows)).cpu(n, assign)

    # -- the link ------------------------------------------------------------------------
    def copy(self, nbytes, transfers: float = 1):
        """``transfers`` host-to-device copies moving ``nbytes`` in all, from pinned memory:
        each pays the transfer latency, the bytes share the link's bandwidth."""
        return transfers * self.gpu.transfer_latency + nbytes / self.gpu.link_bw

    def copy_expert(self) -> float:
        """One routed expert's copy (one contiguous buffer): the link model's unit."""
        return float(self.copy(self.spec.expert_bytes))

    # -- several devices -----------------------------------------------------------------
    def collective(self, nbytes, allreduce: bool, n_gpus: int, link_gbs: float, latency_us: float):
        """A ring all-reduce (``2 (n-1)/n`` of the bytes cross each link) or an all-to-all
        (``(n-1)/n``) of ``nbytes`` over ``n_gpus`` devices joined by ``link_gbs`` GB/s."""
        factor = 2 * (n_gpus - 1) / n_gpus if allreduce else (n_gpus - 1) / n_gpus
        return latency_us * 1e-6 + factor * nbytes / (link_gbs * 1e9)

    # -- prefill and drafting --------------------------------------------------------------
    def prefill_layer(self, layer: int, tokens: int, prompt_len: int, expert_bytes: float = 0.0,
                      pairs: float = 0.0) -> float:
        """One layer's prefill of ``tokens`` prompt tokens (batch x prompt length) attending
        to ``prompt_len / 2`` past tokens on average, reading ``expert_bytes`` of routed
        experts and multiplying ``pairs`` token-expert pairs on the device."""
        s = self.spec
        flops = tokens * (s.attention_flops(prompt_len // 2) + s.dense_flops_per_token(layer))
        flops += pairs * s.expert_flops(1)
        mem = s.layer_resident_bytes(layer) + tokens * s.kv_bytes_per_token_layer + expert_bytes
        return float(self._device(mem, flops, s.dense_dtype, self.engine.attention_kernels))

    def draft_forward(self, weight_bytes: float, params: float, rows: float, kernels: float, dtype: str) -> float:
        """One forward of a draft that reads ``weight_bytes`` (``params`` weights) for
        ``rows`` tokens, with ``kernels`` launches."""
        return float(self._device(weight_bytes, 2 * params * rows, dtype, kernels))

    def read(self, nbytes: float, kernels: float = 1.0) -> float:
        """A pure weight read of ``nbytes`` on the device (an expert predictor's weights)."""
        return float(self._device(nbytes, 0.0, "bf16", kernels))
