"""Time to first token: the prefill of the prompt, layer by layer (roofline).

Prefill routes (nearly) every expert of every layer, so an offloading policy copies whole
layers, double-buffered: layer l+1's copy overlaps layer l's compute and may start once
layer l-1 has finished with the slot set it reuses. When some experts live on the CPU
(the CPU-compute policies), a layer's CPU-held experts either run on the CPU or are
copied and run on the device, whichever ends first: llama.cpp copies such weights for
large batches (its op offload), so long prompts are not CPU-bound. Every piece is a
:class:`moesim.costmodel.CostModel` time; this module only orders them.
"""

from __future__ import annotations

import numpy as np

from moesim.costmodel import CostModel, ExpertTimes
from moesim.layout import CPU


def prefill_time(cm: CostModel, prompt_len: int, offload: bool, batch: int = 1) -> float:
    """Time to first token of a copy policy (``offload``) or of an all-resident model."""
    spec = cm.spec
    n = batch * prompt_len
    if n == 0:
        return 0.0
    per = cm.copy_expert()
    compute_end = copy_end = 0.0
    prev_compute_end = 0.0  # end of layer l-1: frees the slot set layer l+1 copies into
    for layer in range(spec.n_layers):
        moe = layer not in spec.dense_layers
        compute = cm.prefill_layer(layer, n, prompt_len, spec.layer_expert_bytes if moe else 0.0,
                                   n * spec.top_k if moe else 0.0)
        ready = 0.0
        if moe and offload:
            copy_end = max(copy_end, prev_compute_end) + spec.n_experts * per
            ready = copy_end
        prev_compute_end = compute_end
        compute_end = max(compute_end, ready) + compute
    return compute_end + cm.head(batch)


def prefill_time_cpu_compute(cm: CostModel, times: ExpertTimes, resident: np.ndarray | None, prompt_len: int,
                        batch: int = 1) -> float:
    """Time to first token when some experts live on the CPU (``resident[m, e]``: on the
    device). Tokens are assumed spread evenly over a layer's experts; the device runs
    attention and its resident experts as one block (equal to :func:`prefill_time` of an
    all-resident model when nothing is on the CPU). Copies are not overlapped with compute
    here (conservative)."""
    spec = cm.spec
    n = batch * prompt_len
    if n == 0:
        return 0.0
    e, k = spec.n_experts, spec.top_k
    total, m = 0.0, 0
    for layer in range(spec.n_layers):
        if layer in spec.dense_layers:
            total += cm.prefill_layer(layer, n, prompt_len)
            continue
        on_dev = int(resident[m].sum()) if resident is not None else 0
        m += 1
        on_cpu, pairs = e - on_dev, n * k
        dev_pairs = pairs * on_dev // e
        device = cm.prefill_layer(layer, n, prompt_len, on_dev * spec.expert_bytes, dev_pairs)
        if not on_cpu:
            total += device
            continue
        # The CPU's round trip carries the prompt's n activations, not one step's batch.
        cpu = cm.prefill_layer(layer, n, prompt_len) + times.cpu(on_cpu, pairs - dev_pairs) - times.roundtrip
        cpu += cm.roundtrip(n)
        copy = on_cpu * times.copy + cm.prefill_layer(layer, n, prompt_len, spec.layer_expert_bytes, pairs)
        total += min(max(device, cpu), copy)
    return total + cm.head(batch)


def prefill_time_static(cms: list[CostModel], cpu_cm: CostModel, layout, prompt_len: int, batch: int = 1,
                        stream_cms: list[CostModel] | None = None) -> float:
    """Time to first token of a static :class:`moesim.layout.Layout`: each layer on its
    processor; a GPU layer's CPU experts run on the CPU or are copied to it, whichever ends
    first (as :func:`prefill_time_cpu_compute`); a CPU layer runs wholly on the CPU; a streamed
    layer's weights cross the link once (``stream_cms``, as in decoding)."""
    spec = cpu_cm.spec
    n = batch * prompt_len
    if n == 0:
        return 0.0
    e, k = spec.n_experts, spec.top_k
    moe = {layer: m for m, layer in enumerate(spec.moe_layers)}
    total = 0.0
    for layer in range(spec.n_layers):
        d = int(layout.layer_device[layer])
        m = moe.get(layer)
        if d == CPU:
            exp = (spec.layer_expert_bytes, n * k) if m is not None else (0.0, 0.0)
            total += cpu_cm.prefill_layer(layer, n, prompt_len, *exp, on="cpu")
            continue
        cm = stream_cms[d] if layout.streamed is not None and layout.streamed[layer] else cms[d]
        if m is None:
            total += cm.prefill_layer(layer, n, prompt_len)
            continue
        on_dev = int((layout.expert_device[m] == d).sum())
        on_cpu, pairs = e - on_dev, n * k
        dev_pairs = pairs * on_dev // e
        device = cm.prefill_layer(layer, n, prompt_len, on_dev * spec.expert_bytes, dev_pairs)
        if not on_cpu:
            total += device
            continue
        times = cm.expert_times(batch)
        cpu = cm.prefill_layer(layer, n, prompt_len) + times.cpu(on_cpu, pairs - dev_pairs) - times.roundtrip
        cpu += cm.roundtrip(n)
        copy = on_cpu * times.copy + cm.prefill_layer(layer, n, prompt_len, spec.layer_expert_bytes, pairs)
        total += min(max(device, cpu), copy)
    head = layout.head_device
    return total + (cpu_cm.head(batch, on="cpu") if head == CPU else cms[head].head(batch))
