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
routed experts         :meth:`CostModel.experts_device` on the GPU;
                       :meth:`CostModel.expert_times` one expert on the GPU and on the
                       CPU by weight format (what the CPU policies time and decide with)
LM head                :meth:`CostModel.head`
next-layer prediction  :meth:`CostModel.prediction`
a copy of N bytes      :meth:`CostModel.copy`, :meth:`CostModel.copy_expert`
a layer's prefill      :meth:`CostModel.prefill_layer`
a draft forward        :meth:`CostModel.draft_forward`
a collective           :meth:`CostModel.collective`
GPU to GPU             :meth:`CostModel.peer_copy`
=====================  ==========================================================

Every block on a processor is a roofline: the larger of its memory time (bytes / the
bandwidth the engine's kernels reach on that weight format) and its math time (FLOPs /
the achievable rate), plus the engine's fixed costs (kernel launches, dispatch,
per-layer overhead). On the CPU the bandwidth and the rate are those of the threads
the deployment uses (``threads``, spread over the host's sockets, each further socket
adding the engine's ``numa_efficiency`` of its bandwidth), and weights that do not fit
in host RAM are read from disk as they are touched (engines that memory-map their
file) or refused. A new cost term joins here, as a method or as a figure of the engine
(:mod:`moesim.engines`) or a profile (:mod:`moesim.hardware`), and every command picks it
up (docs/policies.md, "The cost model").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moesim.engines import EngineProfile, get_engine
from moesim.errors import DoesNotFit, MoesimError
from moesim.hardware import HardwareProfile, HostProfile
from moesim.models import ModelSpec
from moesim.setting import Setting


def with_launches(work, launches, overlap: bool):
    """A block's seconds given its ``work`` (memory or math) and its kernels' ``launches``:
    ``work + launches`` when the host launches them one after another between the
    kernels (eager), ``max(work, launches)`` when the launches overlap the kernels'
    execution (a replayed CUDA graph: each kernel then costs at least its launch)."""
    return np.maximum(work, launches) if overlap else work + launches


def with_layer_launches(t, n, fixed: float, serial: float, overlap: bool):
    """``t``, the seconds of a layer's experts on the device, with a fused engine's launches
    once a layer where any expert ran (``n > 0``): ``fixed`` for the kernels that read the
    experts (:func:`with_launches`), ``serial`` for its kernels that read no weights (each
    its launch after the work). The one rule the cost model, its :class:`ExpertTimes` and the
    simulator's per-step costs share; works on scalars and arrays."""
    if not (fixed or serial):
        return t
    if isinstance(n, np.ndarray):
        some = n > 0
        return with_launches(t, np.where(some, fixed, 0.0), overlap) + np.where(some, serial, 0.0)
    return with_launches(t, fixed, overlap) + serial if n else t


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
    roundtrip: float  # activations device -> host -> device (and the engine's CPU layer cost), once a layer
    copy: float  # one expert's host-to-device copy on the link
    gpu_layer: float = 0.0  # a fused engine's launches of the kernels that read the experts, once a layer
    gpu_layer_serial: float = 0.0  # its other kernels' launches (GLU, weighting, sum), once a layer
    overlap: bool = False  # launches overlap the kernels (:func:`with_launches`)

    def gpu(self, n, assign):
        """Device seconds (:func:`device_expert_seconds`, with a fused engine's launches once
        a layer); works on scalars and arrays."""
        per = with_launches(self.gpu_mem, self.gpu_fixed, self.overlap)
        t = device_expert_seconds(n, assign, per, self.gpu_tok)
        return with_layer_launches(t, n, self.gpu_layer, self.gpu_layer_serial, self.overlap)

    def cpu(self, n, assign):
        """CPU seconds, 0 where no expert runs there; works on scalars and arrays."""
        t = device_expert_seconds(n, assign, self.cpu_mem, self.cpu_tok) + n * self.cpu_fixed + self.roundtrip
        return np.where(np.asarray(n) > 0, t, 0.0) if isinstance(n, np.ndarray) else (t if n else 0.0)


#: Host memory the operating system and the engine's own buffers keep from the page cache
#: (an estimate: a desktop or server OS with an engine's activations and KV cache in RAM).
HOST_RESERVE_BYTES = 4 * 10**9


@dataclass(frozen=True)
class Residence:
    """Where a static layout keeps the model, as the cost model prices it: ``host_weights``
    the weight bytes kept in host memory and ``host_other`` the rest of what host RAM must
    hold (a KV cache there): what paging is judged on, when the host profile gives its RAM.
    ``weights_over_link``: the device reads its weights from host memory over the link as its
    kernels run (vLLM's ``--cpu-offload-gb``, zero-copy pinned memory), its KV cache still
    from device memory. ``cpu_part``: some of the model runs on the CPU (partial offload),
    where an engine that gives ``partial_offload_launch_us`` launches its GPU kernels one by
    one at that cost instead of replaying a CUDA graph; ``layer_split``: its layers are split
    over several GPUs, where an engine whose ``layer_split_graph_replay`` is 0 does the same."""

    host_weights: float = 0.0
    host_other: float = 0.0
    weights_over_link: bool = False
    cpu_part: bool = False
    layer_split: bool = False  # the model's layers are split over several GPUs


ON_DEVICE = Residence()  # every weight in device memory: nothing paged, nothing read over the link


class CostModel:
    """Seconds of every piece of decode and prefill work for one deployment.

    ``gpu`` is the device profile (its figures as given: a what-if's link override is a
    profile with that figure replaced), or None for a machine without a GPU (everything on
    the CPU); ``host`` the CPU that holds offloaded experts and, under the CPU-compute
    policies, multiplies them (None: no CPU work can be priced); ``engine`` the software
    (a name, a path or an :class:`~moesim.engines.EngineProfile`; default PyTorch eager);
    ``shards`` splits the dense weights (and under tensor parallelism the experts) over
    that many devices; ``amx`` lets the host's AMX matrix units run expert math where it
    has them; ``threads`` the CPU threads the engine uses (default: every core of every
    socket); ``residence`` where a static layout keeps the weights (:class:`Residence`).
    """

    @classmethod
    def of(cls, spec: ModelSpec, gpu: HardwareProfile | None, s: Setting, host: HostProfile | None = None,
           **kw: Any) -> CostModel:
        """The cost model of ``gpu`` (and ``host``, resolved by the caller) set up as ``s``: the one
        place a :class:`~moesim.setting.Setting`'s knobs become cost-model arguments (its engine,
        AMX and threads; a knob that reaches the cost model joins here). ``kw``: what the
        deployment's layout decides (shards, residence)."""
        return cls(spec, gpu, host, s.engine, **cls.host_knobs(s, host), **kw)

    @staticmethod
    def host_knobs(s: Setting, host: HostProfile | None) -> dict[str, Any]:
        """The knobs of ``s`` that set up the host's CPU (:class:`~moesim.setting.HostKnobs`, by
        name): none without a host (a deployment that prices no CPU work, which a ``--threads``
        meant for another of the run's policies must not refuse)."""
        return s.host_knobs() if host is not None else {}

    def __init__(self, spec: ModelSpec, gpu: HardwareProfile | None, host: HostProfile | None = None,
                 engine: str | EngineProfile | None = None, *, shards: int = 1, amx: bool = True,
                 threads: int | None = None, residence: Residence = ON_DEVICE) -> None:
        if shards < 1:
            raise MoesimError(f"shards must be >= 1, got {shards}")
        if gpu is None and host is None:
            raise MoesimError("a deployment needs a GPU profile or a host profile")
        self.spec, self.gpu, self.host, self.shards, self.amx = spec, gpu, host, shards, amx
        self.weights_over_link = residence.weights_over_link
        self.engine = e = engine if isinstance(engine, EngineProfile) else get_engine(engine)  # resolved once, above
        if gpu is None and "cpu" not in e.runs_on:
            raise MoesimError(f"{e.name} computes on GPUs only (its profile's runs_on); a deployment without a GPU "
                              "cannot run on it")
        if gpu is not None and "gpu" not in e.runs_on:
            raise MoesimError(f"{e.name} computes on CPUs only (its profile's runs_on); give --hw none")
        # A replayed CUDA graph overlaps its launches with the kernels, unless a layer kind of the
        # model keeps the engine from capturing one (its ``graph_replay``).
        self.overlap = e.replays_graph({self.mixer_kind(layer) for layer in range(spec.n_layers)})
        if gpu is not None:
            self.launch = gpu.launch if e.kernel_launch_us is None else e.kernel_launch_us * 1e-6
            self.layer_overhead = gpu.layer_overhead if e.layer_overhead_us is None else e.layer_overhead_us * 1e-6
            no_split_graph = residence.layer_split and not e.get("layer_split_graph_replay", 1.0)
            eager = residence.cpu_part or no_split_graph or (e.get("launch_overlap") and not self.overlap)
            if eager and "partial_offload_launch_us" in e.figures:  # launched one by one, no graph: they add up
                self.overlap = False
                self.launch = e["partial_offload_launch_us"] * 1e-6
        if host is not None:
            self._host_setup(threads, residence.host_weights, residence.host_other)
        elif threads is not None:
            raise MoesimError("--threads sets the host's CPU threads: give a host profile")

    def _host_setup(self, threads: int | None, host_weights: float, host_other: float) -> None:
        h, e = self.host, self.engine
        total = h.cores * h.sockets
        threads = total if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4 * total:
            raise MoesimError(f"--threads {threads!r}: a count from 1 to {4 * total} ({h.name} has {total} cores)")
        self.threads = threads
        used = min(h.sockets, -(-threads // h.cores))  # sockets the threads spread over
        per_socket = min(h.cores, threads / used)
        scale = 1.0 + (used - 1) * e.get("numa_efficiency")
        self.host_bw = h.socket_bw(per_socket) * scale
        self.host_compute = (per_socket / h.cores) * used  # share of one socket's peak rates the threads reach
        self.cpu_layer = e.get("cpu_layer_overhead_us") * 1e-6
        self.cpu_dispatch = e["cpu_expert_dispatch_us"] * 1e-6 if "cpu_expert_dispatch_us" in e.figures else h.dispatch
        self.cpu_roundtrip = e["activation_roundtrip_us"] * 1e-6 if "activation_roundtrip_us" in e.figures \
            else h.roundtrip
        self.page_miss = self._page_miss(host_weights, host_other)

    def _page_miss(self, host_weights: float, host_other: float = 0.0) -> float:
        """Share of host-held weight bytes that must come from disk when they are touched:
        0 when they fit in RAM; else, for an engine that memory-maps its weights, the share
        the page cache cannot hold (touched uniformly, the cache keeps ``cache / weights`` of
        them); an engine that must load them refuses in one line."""
        ram = self.host.ram_bytes
        if ram is None or host_weights <= 0:
            return 0.0
        cache = max(ram - HOST_RESERVE_BYTES - host_other, 0.0)
        if host_weights <= cache:
            return 0.0
        need = f"{host_weights / 1e9:.1f} GB of weights in host memory, {ram / 1e9:g} GB of RAM ({self.host.name})"
        if not self.engine.pages_from_disk:
            raise DoesNotFit(f"does not fit: {need}; {self.engine.name} loads its weights into RAM (an engine that "
                              "memory-maps them, such as llama.cpp, pages them from disk instead)")
        return 1.0 - cache / host_weights

    # -- the roofline: the one place bytes and rates become seconds ----------------------
    def _gpu(self) -> HardwareProfile:
        if self.gpu is None:
            raise MoesimError("this cost needs a GPU; the deployment has none (--hw none)")
        return self.gpu

    def _device_mem(self, nbytes, dtype: str):
        """Seconds the device takes to read ``nbytes`` of ``dtype`` weights (over the link when
        they stay in host memory, ``weights_over_link``)."""
        gpu = self._gpu()
        if self.weights_over_link:
            return nbytes / (gpu.link_bw * self.engine.get("link_efficiency", 1.0))
        return nbytes / (gpu.mem_bw * self.engine.weight_efficiency("gpu", dtype))

    def _device_kv(self, nbytes):
        """Seconds the device takes to read ``nbytes`` of KV cache (or recurrent state): at
        :attr:`kv_efficiency` of its memory bandwidth."""
        return nbytes / (self._gpu().mem_bw * self.kv_efficiency)

    def _device(self, nbytes, flops, dtype: str, kernels: float = 0.0, extra_mem=0.0, weightless: float = 0.0):
        """A block on the device: ``max(bytes / bandwidth + extra, FLOPs / rate)`` and its
        kernels' launches (:func:`with_launches`: added, or overlapped under a graph).
        ``weightless`` of the ``kernels`` read no weights (norms, activations, residuals): a
        kernel's time is its own, so under a graph each of those still takes its launch after
        the weight-reading kernels' work, instead of hiding under it."""
        gpu = self._gpu()
        work = np.maximum(self._device_mem(nbytes, dtype) + extra_mem, flops / gpu.flops(dtype))
        return with_launches(work, (kernels - weightless) * self.launch, self.overlap) + weightless * self.launch

    def _host(self) -> HostProfile:
        if self.host is None:
            raise MoesimError("this cost needs a host (CPU) profile: pick one with --host (`moesim hw --hosts`)")
        return self.host

    def _cpu_mem(self, nbytes, dtype: str):
        """Seconds the CPU threads take to read ``nbytes`` of ``dtype`` weights (and fault in
        the share that pages from disk)."""
        h = self._host()
        t = nbytes / (self.host_bw * self.engine.weight_efficiency("cpu", dtype))
        if self.page_miss:
            t = t + nbytes * self.page_miss / h.disk_bw
        return t

    def _cpu_kv(self, nbytes):
        """Seconds the CPU threads take to read ``nbytes`` of KV cache (a bf16 cache in RAM, at
        the threads' bandwidth)."""
        self._host()
        return nbytes / self.host_bw

    def cpu_rate(self, dtype: str) -> float:
        """Multiply-adds x 2 a second the deployment's CPU threads reach on ``dtype`` weights: the
        host's GEMM rate for their share of the cores, and no more than the engine's kernels
        reach a thread (``cpu_kernel_gmacs``, where it gives one) times the threads, up to one
        a core (a second hardware thread shares its core's vector units)."""
        h = self._host()
        rate = h.flops(dtype, self.amx) * self.host_compute
        kernel = self.engine.cpu_kernel_flops(dtype)
        if kernel is not None:
            rate = min(rate, kernel * min(self.threads, h.cores * h.sockets))
        return rate

    def _cpu(self, nbytes, flops, dtype: str, extra_mem=0.0):
        """A block on the CPU: ``max(bytes / bandwidth + extra, FLOPs / rate) + the engine's per-layer cost``."""
        return np.maximum(self._cpu_mem(nbytes, dtype) + extra_mem, flops / self.cpu_rate(dtype)) + self.cpu_layer

    def _on_cpu(self, on: str | None) -> bool:
        where = on or ("gpu" if self.gpu is not None else "cpu")
        if where not in ("gpu", "cpu"):
            raise MoesimError(f"unknown processor {where!r}: gpu or cpu")
        return where == "cpu"

    # -- dense work (the GPU, or the CPU for layers it holds) -----------------------------
    def attention(self, layer: int, context, rows: float = 1, sequences: float | None = None, on: str | None = None):
        """One model layer's block before its routed experts: attention over ``context``
        past tokens (a number or an array of them) for ``rows`` new tokens of ``sequences``
        sequences (each reads its own KV cache; default: one sequence a row), the router
        and shared experts of an MoE layer or the dense FFN of a dense layer, the engine's
        launches and the per-layer overhead; ``on`` the CPU for a layer the CPU holds
        (default: the GPU, or the CPU when there is none)."""
        s, sh = self.spec, self.shards
        seqs = rows if sequences is None else sequences
        ctx = np.asarray(context, float)
        # The layer's own kind: a sliding or chunked layer reads only its window of the KV
        # cache, a linear (state-space) layer its recurrent state instead (ModelSpec.kv_tokens).
        attn_flops = np.asarray(s.layer_attention_flops(layer, ctx.astype(np.int64)), float)
        # A state is read and written back each token, more often by an engine that updates it
        # in several unfused kernels (its ``state_passes``).
        kv = seqs * (np.asarray(s.kv_tokens(layer, ctx.astype(np.int64)), float) * s.kv_bytes_per_token(layer)
                     + self.engine.get("state_passes", 2.0) * s.state_bytes(layer))
        # The engine's maturity on this kind of token mixer (moesim.engines.LAYER_TABLES): its
        # weights, its KV cache or state and its math take 1 / efficiency of their roofline.
        slow = 1.0 / self.engine.mixer_efficiency(self.mixer_kind(layer))
        if slow != 1.0:
            kv = kv * slow
            attn_flops = attn_flops * slow
        flops = rows * (attn_flops + s.dense_flops_per_token(layer))
        weights = s.layer_resident_bytes(layer) + (slow - 1.0) * s.layer_attention_bytes(layer)
        if self._on_cpu(on):
            # Two kernels one after the other: the layer's matrices (its weights' format), then
            # attention over the KV cache (a bf16 cache, at the kernels' rate on bf16), so that a
            # long context slows CPU decoding by its math, not only by the bytes it reads.
            ctx_flops = rows * (attn_flops - slow * s.layer_attention_flops(layer, 0))  # scores and weighted sum
            t = self._cpu(weights, flops - ctx_flops, s.dense_dtype) \
                + np.maximum(self._cpu_kv(kv), ctx_flops / self.cpu_rate("bf16"))
        else:
            # A kernel's time is its own: the kernel that reads the KV cache (or the state) takes
            # the larger of its launch and its read, the block's other kernels theirs, so a long
            # context shows under a replayed graph instead of hiding under the others' launches.
            kernels = self.engine.kernels_before_experts(self.mixer_kind(layer))
            rest = max(kernels - 1, 0)
            t = self._device(weights / sh, flops / sh, s.dense_dtype, rest, weightless=max(rest - self.matrices(layer), 0)) \
                + with_launches(self._device_kv(kv / sh), self.launch * min(kernels, 1), self.overlap) \
                + self.layer_overhead
        return t if t.ndim else float(t)

    def matrices(self, layer: int) -> int:
        """Weight matrices layer ``layer``'s block before its routed experts multiplies by (each
        its own kernel): the mixer's projections (q, k, v, o; a latent attention's five; a
        linear mixer's input, gate and output), the router and the shared experts of an MoE
        layer, or the dense FFN."""
        s = self.spec
        mixer = {"linear": 3, "mla": 5}.get(self.mixer_kind(layer), 4)
        if layer in s.dense_layers:
            return mixer + 3
        return mixer + 1 + (3 if s.n_shared else 0)

    @property
    def kv_efficiency(self) -> float:
        """Share of the device's bandwidth attention reaches reading the KV cache: the engine's
        ``kv_read_efficiency`` where its profile gives one, else what its kernels reach on
        bf16 weights (the cache's format): the bytes actually read, through the same memory
        system, not a figure fitted to whatever else slows long contexts."""
        e = self.engine
        return e["kv_read_efficiency"] if "kv_read_efficiency" in e.figures else e.weight_efficiency("gpu", "bf16")

    def mixer_kind(self, layer: int) -> str:
        """The kind of layer ``layer``'s token mixer as engines' ``layer_efficiency`` names it:
        the layer's kind (``full``, ``sliding``, ``chunked``, ``linear``), ``mla`` for the full
        attention of a latent-attention model."""
        kind = self.spec.layer_kind(layer)
        attn = self.spec.attention
        return "mla" if kind == "full" and attn is not None and attn.kind == "mla" else kind

    def attention_by_layer(self, context: np.ndarray, rows: float = 1) -> np.ndarray:
        """:meth:`attention` of every layer at each of ``context``'s contexts, ``[contexts,
        n_layers]``, on the device: computed once per :meth:`ModelSpec.layer_signature` (a
        model's 48 alike layers cost one call, not 48, on a 100,000-token trace)."""
        done: dict[tuple, np.ndarray] = {}
        cols = []
        for layer in range(self.spec.n_layers):
            key = self.spec.layer_signature(layer)
            if key not in done:
                done[key] = np.broadcast_to(self.attention(layer, context, rows=rows), np.shape(context))
            cols.append(done[key])
        return np.stack(cols, axis=1) if cols else np.empty((len(context), 0))

    def head(self, rows: float = 1, on: str | None = None) -> float:
        """The final norm and the LM head (:attr:`ModelSpec.lm_head_bytes`), sampling included."""
        s = self.spec
        if self._on_cpu(on):
            return float(self._cpu(s.lm_head_bytes, rows * s.lm_head_flops, "bf16"))
        k = self.engine.head_kernels
        return float(self._device(s.lm_head_bytes / self.shards, rows * s.lm_head_flops / self.shards, "bf16", k,
                                  weightless=max(k - 1, 0)))

    def prediction(self, rows: float = 1) -> float:
        """Predicting a later MoE layer's experts at a router: the quasi-hidden state's
        RMSNorm (``hidden`` bf16 weights) and that layer's ``n_experts x hidden`` router,
        ``2 x n_experts x hidden`` FLOPs a token, and the top-k."""
        s = self.spec
        return float(self._device(2 * s.hidden + s.router_bytes, rows * 2 * s.n_experts * s.hidden, "bf16",
                                  self.engine.predict_kernels))

    # -- routed experts on the device ----------------------------------------------------
    def expert_read(self) -> float:
        """Seconds one routed expert's weights take to read on the device, with its launches
        (per expert under an eager engine; a fused engine pays them once a layer)."""
        e = self.engine
        per = 0.0 if e.fused_experts else e.expert_kernels
        return float(self._device(self.spec.expert_bytes / self.shards, 0.0, self.spec.expert_dtype, per))

    def expert_pair(self) -> float:
        """Seconds of one token-expert pair's math on the device."""
        return float(self.spec.expert_flops(1) / self.shards / self._gpu().flops(self.spec.expert_dtype))

    @property
    def layer_expert_launches(self) -> float:
        """A fused engine's launches for one layer's experts that read their weights (0 under an
        eager engine, which pays them per expert)."""
        e = self.engine
        return min(e.expert_kernels, self._expert_matrices) * self.launch if e.fused_experts else 0.0

    @property
    def layer_expert_serial(self) -> float:
        """A fused engine's other launches for one layer's experts (the activation, the gate
        weighting, the sum over the top-k): each takes its launch after the expert work."""
        e = self.engine
        return max(e.expert_kernels - self._expert_matrices, 0) * self.launch if e.fused_experts else 0.0

    @property
    def _expert_matrices(self) -> int:
        return 3 if self.spec.expert_gated else 2  # gate, up and down (grouped over the layer's experts)

    def experts_device(self, n, assign):
        """``n`` distinct routed experts serving ``assign`` token-expert pairs on the device
        (:func:`device_expert_seconds`; a fused engine adds its launches once a layer)."""
        t = device_expert_seconds(n, assign, self.expert_read(), self.expert_pair())
        return with_layer_launches(t, np.asarray(n), self.layer_expert_launches, self.layer_expert_serial,
                                   self.overlap)

    # -- routed experts on the CPU -------------------------------------------------------
    def roundtrip(self, rows: float = 1) -> float:
        """One layer's activation round trip for CPU experts: the fixed latency (engine,
        else host profile) plus ``rows`` hidden states down and expert outputs up (bf16)
        over the link, and the engine's per-layer CPU cost."""
        self._host()
        moved = self.copy(2 * 2 * rows * self.spec.hidden, transfers=0) if self.gpu is not None else 0.0
        return self.cpu_roundtrip + moved + self.cpu_layer

    def expert_times(self, batch: int = 1) -> ExpertTimes:
        """The figures of one expert on the device and on the CPU and one copy over the link,
        at ``batch`` sequences: what the CPU-compute policies are timed and decided with
        (the simulator and the executor's cpu-on-miss alike)."""
        s = self.spec
        e = self.engine
        gpu = self.gpu is not None
        return ExpertTimes(
            gpu_mem=float(self._device_mem(s.expert_bytes / self.shards, s.expert_dtype)) if gpu else np.inf,
            gpu_tok=self.expert_pair() if gpu else np.inf,
            gpu_fixed=(0.0 if e.fused_experts else e.expert_kernels * self.launch) if gpu else 0.0,
            cpu_mem=float(self._cpu_mem(s.expert_bytes, s.expert_dtype)),
            cpu_tok=s.expert_flops(1) / self.cpu_rate(s.expert_dtype),
            cpu_fixed=self.cpu_dispatch, roundtrip=self.roundtrip(batch),
            copy=self.copy_expert() if gpu else np.inf, gpu_layer=self.layer_expert_launches if gpu else 0.0,
            gpu_layer_serial=self.layer_expert_serial if gpu else 0.0,
            overlap=self.overlap,
        )

    # -- the link ------------------------------------------------------------------------
    def copy(self, nbytes, transfers: float = 1):
        """``transfers`` host-to-device copies moving ``nbytes`` in all: each pays the transfer
        latency, the bytes share the link's bandwidth (pinned, times the engine's
        ``link_efficiency``)."""
        gpu = self._gpu()
        return transfers * gpu.transfer_latency + nbytes / (gpu.link_bw * self.engine.get("link_efficiency", 1.0))

    def copy_expert(self) -> float:
        """One routed expert's copy (one contiguous buffer): the link model's unit; with the
        engine's ``evicted_copy_back``, the evicted expert's copy back to the host before it, in
        turn on the same stream (PCIe carries both directions at once, one stream does not)."""
        return float(self.copy(self.spec.expert_bytes)) * (1 + self.engine.get("evicted_copy_back", 0))

    # -- several devices -----------------------------------------------------------------
    def peer_copy(self, nbytes, other: HardwareProfile) -> float:
        """``nbytes`` from this GPU to ``other`` (the hidden states between two GPUs' layers):
        over NVLink where both profiles give ``peer_gbs``, else through the host's PCIe at
        the slower link; the larger transfer latency of the two."""
        me = self._gpu()
        nvlink = "peer_gbs" in me.figures and "peer_gbs" in other.figures
        bw = min(me.peer_bw, other.peer_bw) if nvlink else min(me.link_bw, other.link_bw)
        return max(me.transfer_latency, other.transfer_latency) + nbytes / bw

    def collective(self, nbytes, allreduce: bool, n_gpus: int, link_gbs: float, latency_us: float):
        """A ring all-reduce (``2 (n-1)/n`` of the bytes cross each link) or an all-to-all
        (``(n-1)/n``) of ``nbytes`` over ``n_gpus`` devices joined by ``link_gbs`` GB/s."""
        factor = 2 * (n_gpus - 1) / n_gpus if allreduce else (n_gpus - 1) / n_gpus
        return latency_us * 1e-6 + factor * nbytes / (link_gbs * 1e9)

    # -- prefill and drafting --------------------------------------------------------------
    def prefill_layer(self, layer: int, tokens: int, prompt_len: int, expert_bytes: float = 0.0,
                      pairs: float = 0.0, on: str | None = None) -> float:
        """One layer's prefill of ``tokens`` prompt tokens (batch x prompt length) attending
        to ``prompt_len / 2`` past tokens on average, reading ``expert_bytes`` of routed
        experts and multiplying ``pairs`` token-expert pairs, on the device (or ``on`` the CPU)."""
        s = self.spec
        flops = tokens * (s.layer_attention_flops(layer, prompt_len // 2) + s.dense_flops_per_token(layer))
        flops += pairs * s.expert_flops(1)
        mem = s.layer_resident_bytes(layer) + tokens * s.kv_bytes_per_token(layer) + expert_bytes
        if self._on_cpu(on):
            return float(self._cpu(mem, flops, s.dense_dtype))
        return float(self._device(mem, flops, s.dense_dtype, self.engine.attention_kernels))

    def draft_forward(self, weight_bytes: float, params: float, rows: float, kernels: float, dtype: str) -> float:
        """One forward of a draft that reads ``weight_bytes`` (``params`` weights) for
        ``rows`` tokens, with ``kernels`` launches."""
        return float(self._device(weight_bytes, 2 * params * rows, dtype, kernels))

    def read(self, nbytes: float, kernels: float = 1.0) -> float:
        """A pure weight read of ``nbytes`` on the device (an expert predictor's weights)."""
        return float(self._device(nbytes, 0.0, "bf16", kernels))


class CostModels:
    """Cost models built once each and shared by every configuration that prices the same
    deployment: a replay's policies, a sweep's cache sizes and policies on one machine, a
    report's prompt lengths. A cost model depends only on what it is built from (the model,
    the GPU and host profiles, the engine, AMX, threads, shards, residence), none of which a
    policy or a cache changes. Profiles and engines are keyed by identity (a sweep hands the
    same objects to every group; the memo holds them, so an id stays theirs), the rest
    (numbers, names, a :class:`Residence`) by value."""

    def __init__(self) -> None:
        self._built: dict[tuple, tuple[Any, CostModel]] = {}

    def get(self, spec: ModelSpec, gpu: HardwareProfile | None, host: HostProfile | None = None,
            engine: str | EngineProfile | None = None, **kw: Any) -> CostModel:
        """The cost model ``CostModel(spec, gpu, host, engine, **kw)``, built on first ask."""
        def key(x: Any) -> Any:
            return x if x is None or isinstance(x, (bool, int, float, str, Residence)) else id(x)

        k = (spec, key(gpu), key(host), key(engine), *((n, key(v)) for n, v in sorted(kw.items())))
        if k not in self._built:
            self._built[k] = ((gpu, host, engine, kw), CostModel(spec, gpu, host, engine, **kw))
        return self._built[k][1]

    def of(self, spec: ModelSpec, gpu: HardwareProfile | None, s: Setting, host: HostProfile | None = None,
           **kw: Any) -> CostModel:
        """:meth:`CostModel.of`, built on first ask."""
        return self.get(spec, gpu, host, s.engine, **CostModel.host_knobs(s, host), **kw)

    def clear(self) -> None:
        self._built.clear()
