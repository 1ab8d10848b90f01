"""Where every layer and every routed expert lives on one machine: a GPU or the CPU.

A :class:`Layout` is the static answer to "which processor holds this": each model
layer's attention and dense weights (``layer_device``), each (MoE layer, expert) pair
(``expert_device``) and the LM head sit on one of the machine's GPUs (0, 1, ...) or in
host memory, computed by the CPU (:data:`CPU`). It is what the engines' placement
arguments say, so every deployment people run is one:

- all on one GPU, or spread over several by whole layers (llama.cpp's default
  ``--split-mode layer``, ``--tensor-split`` proportions) or split inside every layer
  (``--split-mode row``, vLLM's tensor parallelism: ``split="tensor"``);
- the experts of the first N MoE layers on the CPU (llama.cpp ``--n-cpu-moe N``; all of
  them: ``--cpu-moe`` / ``-ot exps=CPU``, KTransformers' default rule);
- the hottest experts on the GPU, the rest on the CPU (KTransformers' GPU experts, as a
  device budget or a count per layer);
- the last N layers on the GPU(s) and the rest wholly on the CPU (llama.cpp ``-ngl N``,
  Ollama), or no GPU at all;
- the first layers' weights left in host memory and read by the GPU over the link every
  step (vLLM ``--cpu-offload-gb``: ``streamed``).

Data in, data out: the simulator times a layout (``moesim.sim.static``), the memory-fit
test sizes it (:func:`moesim.memory.layout_bytes`), ``moesim plan`` prints the engine
arguments that build it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moesim.bounds import check_shares
from moesim.errors import MoesimError
from moesim.models import ModelSpec

#: The processor index of the host CPU (GPUs are 0, 1, ...).
CPU = -1
SPLITS = ("layer", "tensor")


@dataclass(frozen=True)
class Layout:
    """Processors of every layer and expert (see the module docstring)."""

    n_gpus: int
    layer_device: np.ndarray  # [n_layers] int: the GPU holding the layer's attention and dense weights, or CPU
    expert_device: np.ndarray  # [moe layers, experts] int: the GPU holding the expert, or CPU
    head_device: int
    split: str = "layer"  # "tensor": every GPU layer is split over all the GPUs
    source: str = ""  # how it was chosen, for reports
    optimistic: bool = False  # placed from the replayed trace itself: an upper bound
    # [n_layers] bool: a GPU layer whose weights stay in host memory, read over the link at
    # every step (vLLM's --cpu-offload-gb); None: none is
    streamed: np.ndarray | None = None

    def streamed_gib(self, spec: ModelSpec) -> float:
        """GiB of weights streamed over the link, on all GPUs together."""
        if self.streamed is None:
            return 0.0
        return sum(layer_weight_bytes(spec, int(x)) for x in np.flatnonzero(self.streamed)) / 2**30

    @property
    def layers_per_gpu(self) -> list[int]:
        """Model layers each GPU holds (what llama.cpp's ``--tensor-split`` proportions say)."""
        return [int((self.layer_device == g).sum()) for g in range(self.n_gpus)]

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise MoesimError(f"split {self.split!r}: one of {', '.join(SPLITS)}")
        devices = np.concatenate([self.layer_device.ravel(), self.expert_device.ravel(), [self.head_device]])
        if devices.min() < CPU or devices.max() >= self.n_gpus:
            raise MoesimError(f"a layout names a processor the machine does not have ({self.n_gpus} GPUs)")

    @property
    def resident(self) -> np.ndarray:
        """``[m, E]`` bool: the expert sits on the GPU of its layer (the CPU policies' view)."""
        moe_dev = self.expert_device
        return moe_dev >= 0

    @property
    def n_resident(self) -> int:
        return int(self.resident.sum())

    def cpu_moe_layers(self) -> int:
        """MoE layers whose experts are all on the CPU."""
        return int((self.expert_device == CPU).all(1).sum())

    def gpu_layers(self) -> int:
        """Model layers whose attention runs on a GPU."""
        return int((self.layer_device >= 0).sum())


def check_ratios(ratios, gpu_counts) -> None:
    """``--tensor-split`` shares checked before any work: non-negative numbers with a positive
    sum, one a GPU of every machine of several GPUs in ``gpu_counts``."""
    r = np.asarray(check_shares(ratios), float)  # moesim.bounds: 1e308,1e308 overflows the sum
    for n in gpu_counts:
        if n != r.size:
            raise MoesimError(f"--tensor-split has {r.size} shares for {n} GPUs")


def layer_shares(n_layers: int, ratios: list[float]) -> np.ndarray:
    """GPU index of each of ``n_layers`` consecutive layers split in proportion to
    ``ratios`` (llama.cpp's ``--tensor-split``: cumulative shares, each layer to the GPU
    whose share its index falls in)."""
    check_ratios(ratios, ())
    r = np.asarray(ratios, float)
    bounds = np.cumsum(r) / r.sum()
    return np.minimum(np.searchsorted(bounds, (np.arange(n_layers) + 0.5) / n_layers), r.size - 1).astype(np.int64)


def _balanced(weights: np.ndarray, capacities: list[float]) -> np.ndarray:
    """GPU index of consecutive layers of ``weights`` bytes, cut so that each GPU's share of
    the bytes follows its share of ``capacities`` (what llama.cpp's ``--fit`` and a hand-
    tuned ``--tensor-split`` aim for)."""
    cap = np.asarray(capacities, float)
    bounds = np.cumsum(cap) / cap.sum() * weights.sum()
    mid = np.cumsum(weights) - weights / 2  # each layer goes where its middle byte falls
    return np.minimum(np.searchsorted(bounds, mid), cap.size - 1).astype(np.int64)


def make_layout(spec: ModelSpec, n_gpus: int, *, gpu_layers: int | None = None, cpu_moe_layers: int = 0,
                hot: np.ndarray | None = None, split: str = "layer", ratios: list[float] | None = None,
                source: str = "", optimistic: bool = False, capacities: list[float] | None = None) -> Layout:
    """A layout in the engines' own terms.

    ``gpu_layers`` (llama.cpp ``-ngl``; None: all) keeps the LAST that many model layers on
    the GPUs (as llama.cpp counts: the head joins them when every layer does) and the rest
    wholly on the CPU; the GPU layers are spread over ``n_gpus`` in proportion to
    ``ratios`` (default: equal). ``cpu_moe_layers`` (``--n-cpu-moe``) moves the experts of
    the first that many MoE layers to the CPU; ``hot`` (``[m, E]`` bool, True = on the GPU)
    instead names each GPU layer's resident experts. ``n_gpus == 0``: everything on the CPU.
    """
    L, M, E = spec.n_layers, spec.n_moe_layers, spec.n_experts
    if n_gpus < 0:
        raise MoesimError("a machine has 0 or more GPUs")
    g = L if gpu_layers is None else gpu_layers
    if not n_gpus:
        g = 0
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or not 0 <= g <= L:
        raise MoesimError(f"--gpu-layers {gpu_layers!r}: a count of model layers from 0 to {L} ({spec.name})")
    if (isinstance(cpu_moe_layers, bool) or not isinstance(cpu_moe_layers, (int, np.integer))
            or not 0 <= cpu_moe_layers <= M):  # replay passes what is not a digit string as given ('-1', '1.5')
        raise MoesimError(f"--cpu-layers {cpu_moe_layers}: auto or a count of MoE layers from 0 to {M} ({spec.name})")
    layer_device = np.full(L, CPU, np.int64)
    if g:
        if ratios is not None and len(ratios) != n_gpus:
            raise MoesimError(f"--tensor-split has {len(ratios)} shares for {n_gpus} GPUs")
        if split != "layer":
            shares = np.zeros(g, np.int64)
        elif ratios is None and capacities is not None and n_gpus > 1:
            moe_of = {layer: m for m, layer in enumerate(spec.moe_layers)}
            weights = np.array([spec.layer_resident_bytes(layer) + (
                spec.layer_expert_bytes if layer in moe_of and moe_of[layer] >= cpu_moe_layers else 0)
                for layer in range(L - g, L)], float)
            weights[-1] += spec.lm_head_bytes if g == L else 0.0
            shares = _balanced(weights, capacities)
        else:
            shares = layer_shares(g, ratios or [1.0] * n_gpus)
        layer_device[L - g:] = shares
    moe = np.asarray(spec.moe_layers)
    expert_device = np.repeat(layer_device[moe][:, None], E, axis=1)
    expert_device[:cpu_moe_layers] = CPU
    if hot is not None:
        if hot.shape != (M, E):
            raise MoesimError(f"a hot-expert placement of {hot.shape} for {spec.name}'s {M} x {E} experts")
        expert_device = np.where(hot & (expert_device >= 0), expert_device, CPU)
    head = int(layer_device[-1]) if g == L else CPU
    return Layout(n_gpus, layer_device, expert_device, head, split, source, optimistic)


def layer_weight_bytes(spec: ModelSpec, layer: int) -> int:
    """Every weight byte of model layer ``layer``: attention, dense, router, all its experts."""
    moe = {x: m for m, x in enumerate(spec.moe_layers)}
    m = moe.get(layer)
    return spec.layer_resident_bytes(layer) + (spec.n_experts * spec.moe_expert_bytes(m) if m is not None else 0)


def first_layers_gib(spec: ModelSpec, n: int) -> float:
    """GiB of weights in the first ``n`` model layers (what ``--cpu-offload-gb`` streams)."""
    return sum(layer_weight_bytes(spec, x) for x in range(n)) / 2**30


def stream_layers(spec: ModelSpec, layout: Layout, offload_gib: float) -> Layout:
    """``layout`` with the first layers' weights left in host memory, read by their GPU over
    the link at every step, until at least ``offload_gib`` GiB are, on all GPUs together
    (vLLM's ``--cpu-offload-gb``, GiB per GPU, offloads parameters in module order; whole
    layers here, so the figure is rounded up to a layer)."""
    if not 0 <= offload_gib < float("inf"):
        raise MoesimError(f"--offload-gib {offload_gib!r}: GiB of weights to keep in host memory, >= 0")
    streamed = np.zeros(spec.n_layers, bool)
    total = 0.0
    for layer in range(spec.n_layers):
        if total >= offload_gib * 2**30 or layout.layer_device[layer] == CPU:
            break
        streamed[layer] = True
        total += layer_weight_bytes(spec, layer)
    src = f"{layout.source}; the first {int(streamed.sum())} layers' weights ({total / 2**30:.1f} GiB) read over the link"
    return Layout(layout.n_gpus, layout.layer_device, layout.expert_device, layout.head_device, layout.split, src,
                  layout.optimistic, streamed)
