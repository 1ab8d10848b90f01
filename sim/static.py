"""Timing a static layout: every weight stays where the layout puts it, nothing is copied.

A decode step walks the model layers in order. Layer l runs on its processor p (a GPU,
or the CPU; :class:`moesim.layout.Layout`): its attention block there, then its routed
experts, the ones on p's GPU and the ones on the CPU at the same time (the layer ends
when the later finishes; CPU experts of a GPU layer pay the activation round trip).
When consecutive layers sit on different processors, the hidden states cross between
them (a copy on the link of the GPU involved). The step ends with the LM head on its
processor. Nothing depends on the link's past, so every layer of every step is priced
at once, from the trace's token counts, by the cost model (:class:`moesim.costmodel.CostModel`).

This is the step model of the static CPU-compute policies (llama.cpp ``--n-cpu-moe``,
KTransformers) and of every deployment that places whole layers: several GPUs (layer or
tensor split), llama.cpp ``-ngl``, no GPU at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moesim.costmodel import CostModel, Residence, device_expert_seconds
from moesim.engines import EngineProfile, get_engine
from moesim.errors import MoesimError
from moesim.hardware import HardwareProfile, HostProfile, Machine, get_host, get_machine
from moesim.layout import CPU, Layout, make_layout
from moesim.memory import layout_bytes
from moesim.models import ModelSpec
from moesim.policy import Policy, as_policy
from moesim.policy.placement import make_placement
from moesim.setting import DEFAULT_SETTING, Setting
from moesim.sim.cpu_run import CpuResult, CpuRun, token_counts
from moesim.sim.plan import Plan
from moesim.sim.prefill import prefill_time_static
from moesim.traces.format import Trace


@dataclass
class StaticRun:
    """Per step: TPOT and its parts; per (step, MoE layer): where the experts ran."""

    tpot: np.ndarray
    device: np.ndarray  # GPU work per step (attention, GPU experts, head, transfers)
    cpu_busy: np.ndarray  # CPU work per step (CPU layers, CPU experts with their round trips)
    cpu_wait: np.ndarray  # per step, how long GPU layers waited on their CPU experts
    transfer: np.ndarray  # per step, hidden states crossing between processors
    streamed: np.ndarray  # per step, what reading streamed layers' weights over the link adds to the GPU's work
    streamed_bytes: np.ndarray  # per step, the weights read over the link (streamed layers' dense and routed experts)
    n_gpu: np.ndarray  # [t, m] experts a GPU ran
    n_cpu: np.ndarray  # [t, m] experts the CPU ran


def _cm_for(cms: list[CostModel], cpu_cm: CostModel, d: int) -> CostModel:
    return cpu_cm if d == CPU else cms[d]


def time_static(spec: ModelSpec, layout: Layout, counts: np.ndarray, ctx: np.ndarray, batch: int,
                cms: list[CostModel], cpu_cm: CostModel, stream_cms: list[CostModel] | None = None) -> StaticRun:
    """Time every step of a static layout. ``counts[t, m, e]``: tokens routed to each
    expert; ``ctx[t]``: the context at each step; ``cms[g]`` the cost model of GPU g
    (with the host, for CPU experts and round trips), ``cpu_cm`` the one that prices CPU
    layers (the first GPU's, or the host's alone on a machine without GPUs);
    ``stream_cms[g]`` GPU g's for the layers whose weights it reads over the link
    (``layout.streamed``)."""
    T = counts.shape[0]
    moe_index = {layer: m for m, layer in enumerate(spec.moe_layers)}
    streamed = layout.streamed if layout.streamed is not None else np.zeros(spec.n_layers, bool)
    if streamed.any() and stream_cms is None:
        raise MoesimError("a layout with streamed layers needs their cost models (stream_cms)")
    times = {d: _cm_for(cms, cpu_cm, d).expert_times(batch) for d in {*layout.layer_device.tolist(), CPU}
             if d != CPU or cpu_cm.host is not None}
    stream_times = {d: stream_cms[d].expert_times(batch) for d in set(layout.layer_device[streamed].tolist())}
    total = np.zeros(T)
    device = np.zeros(T)
    cpu_busy = np.zeros(T)
    cpu_wait = np.zeros(T)
    transfer = np.zeros(T)
    streamed_s = np.zeros(T)
    streamed_b = np.zeros(T)
    n_gpu = np.zeros(counts.shape[:2], np.int32)
    n_cpu = np.zeros(counts.shape[:2], np.int32)
    hidden_bytes = 2 * batch * spec.hidden
    # Between GPUs the slowest pair sets the pace (a mixed machine's peers meet over PCIe).
    peer_gbs = min((c.gpu.peer_bw for c in cms), default=0.0) / 1e9
    peer_us = max((c.gpu.collective_latency for c in cms), default=0.0) * 1e6
    # The embedding row (a few KB read on the host) reaches the first layer's processor with
    # the step's tokens: not charged, as the input ids are not.
    prev = int(layout.layer_device[0])
    for layer in range(spec.n_layers):
        d = int(layout.layer_device[layer])
        cm = stream_cms[d] if streamed[layer] else _cm_for(cms, cpu_cm, d)
        if d != prev:
            transfer += _crossing(cms, prev, d, hidden_bytes)
        prev = d
        attn = cm.attention(layer, ctx, rows=batch, on="cpu" if d == CPU else "gpu")
        if streamed[layer]:
            streamed_s += attn - cms[d].attention(layer, ctx, rows=batch, on="gpu")
            streamed_b += spec.layer_resident_bytes(layer)
        if layout.split == "tensor" and d != CPU and len(cms) > 1:
            attn = attn + 2 * cm.collective(hidden_bytes, True, len(cms), peer_gbs, peer_us)
        total += attn
        (cpu_busy if d == CPU else device).__iadd__(attn)
        m = moe_index.get(layer)
        if m is None:
            continue
        c = counts[:, m, :]  # [t, E]
        routed = c > 0
        on_cpu = layout.expert_device[m] == CPU
        nc, ac = (routed & on_cpu).sum(-1), np.where(on_cpu, c, 0).sum(-1)
        n_cpu[:, m] = nc
        if d == CPU:
            t = times[CPU]
            cpu = device_expert_seconds(nc, ac, t.cpu_mem, t.cpu_tok) + nc * t.cpu_fixed + cpu_cm.cpu_layer
            total += cpu
            cpu_busy += cpu
            continue
        on_dev = layout.expert_device[m] == d
        nd, ad = (routed & on_dev).sum(-1), np.where(on_dev, c, 0).sum(-1)
        n_gpu[:, m] = nd
        t = stream_times[d] if streamed[layer] else times[d]
        gpu = t.gpu(nd, ad)
        cpu = t.cpu(nc, ac)
        if streamed[layer]:
            streamed_s += gpu - times[d].gpu(nd, ad)
            streamed_b += nd * spec.moe_expert_bytes(m)  # the routed experts only: the kernels read what they use
        total += np.maximum(gpu, cpu)  # the layer ends when the later of the two does
        device += gpu
        cpu_busy += cpu
        cpu_wait += np.maximum(cpu - gpu, 0.0)
    head = layout.head_device
    if head != prev:
        transfer += _crossing(cms, prev, head, hidden_bytes)
    h = _cm_for(cms, cpu_cm, head).head(batch, on="cpu" if head == CPU else "gpu")
    total += h + transfer
    (cpu_busy if head == CPU else device).__iadd__(h)
    return StaticRun(total, device, cpu_busy, cpu_wait, transfer, streamed_s, streamed_b, n_gpu, n_cpu)


def _crossing(cms: list[CostModel], a: int, b: int, nbytes: float) -> float:
    """Seconds the hidden states take from processor ``a`` to ``b``: a copy on the link of
    the GPU involved; GPU to GPU over the slower GPU's peer link (NVLink where both
    profiles give it, else the host's PCIe)."""
    if a != CPU and b != CPU and cms:
        return cms[a].peer_copy(nbytes, cms[b].gpu)
    gpu = a if a != CPU else b
    return float(cms[gpu].copy(nbytes)) if gpu != CPU and cms else 0.0


def layout_for(pol, spec, machine, s: Setting, *, batch: int, context: int, hot_placement=None) -> Layout:
    """The layout ``pol`` gives on ``machine`` with the counts and split of ``s``, choosing
    ``auto`` counts to fit its GPUs."""
    split, ratios = s.split, s.ratios
    g = machine.n_gpus
    mem = [x * 1e9 for x in machine.device_memory_gb()]

    def fits(lay: Layout) -> bool:
        return all(b <= m for b, m in zip(layout_bytes(spec, lay, batch, context).gpu, mem))

    def make(**kw) -> Layout:  # several GPUs: layers cut by their bytes, as llama.cpp users tune --tensor-split
        return make_layout(spec, g, split=split, ratios=ratios, capacities=mem, **kw)

    if g == 0:
        if pol.needs_gpu:
            raise MoesimError(f"--hw none: without a GPU every weight is in host memory and computed on the CPU; "
                              f"only all-resident applies, not {pol.name}")
        return make_layout(spec, 0, source="no GPU: every layer on the CPU")
    return pol.layout(spec, machine, make, fits, s, hot_placement)


def simulate_static(trace: Trace, machine: str | HardwareProfile | Machine, policy: str | Policy,
                    s: Setting = DEFAULT_SETTING, *, placement=None, ttft: bool = True) -> CpuResult:
    """Simulate ``trace`` under a static layout (all-resident, cpu-static, hot-experts,
    gpu-layers, weight-streaming) on a machine of zero, one or several GPUs
    (:func:`moesim.hardware.get_machine`) and ``host``, run by ``engine`` with ``threads``
    CPU threads (:func:`time_static`). ``split`` and ``ratios`` spread the GPU layers over
    several GPUs (llama.cpp's ``--split-mode`` and ``--tensor-split``); ``placement``
    replaces hot-experts' own; ``offload_gib`` is weight-streaming's GiB (vLLM's
    ``--cpu-offload-gb``; auto: the least that fits). ``ttft`` False leaves the prefill untimed
    (NaN): a fit that predicts decode speed thousands of times spends a third of its time there."""
    pol = as_policy(policy)
    machine = get_machine(machine)
    if s.link_gbps is not None:
        machine = machine.with_figure("h2d_pinned_gbs", s.link_gbps)
    spec = trace.model
    g = machine.n_gpus
    if s.host is None and g == 0:
        raise MoesimError("--hw none: name the host that runs everything (--host; `moesim hw --hosts`)")
    host = s.host if isinstance(s.host, HostProfile) else get_host(s.host, machine.gpus[0] if g else None)
    engine = s.engine if isinstance(s.engine, EngineProfile) else get_engine(s.engine)
    b, T = trace.batch, trace.n_tokens
    context = trace.prompt_len + T
    hot = None
    if pol.places_hot_set and g == 1:
        hot = placement or make_placement(pol, spec, machine.gpus[0]["device_memory_gb"] * 1e9, batch=b,
                                          context=context, calibration=s.calibration, replay_ids=trace.true_ids,
                                          calibrate_on_replay=s.calibrate_on_replay,
                                          strategy=engine.expert_placement)
    layout = layout_for(pol, spec, machine, s, batch=b, context=context, hot_placement=hot)
    need = layout_bytes(spec, layout, b, context)
    where = Residence(need.host_weights, need.host_kv,
                      cpu_part=bool((layout.layer_device == CPU).any() or (layout.expert_device == CPU).any()),
                      layer_split=layout.split != "tensor" and len(set(layout.layer_device.tolist()) - {CPU}) > 1)
    shards = g if s.split == "tensor" and g > 1 else 1
    priced = replace(s, engine=engine)  # resolved once, above
    cms = [CostModel.of(spec, gpu, priced, host, shards=shards, residence=where) for gpu in machine.gpus]
    cpu_cm = cms[0] if cms else CostModel.of(spec, None, priced, host, residence=where)
    streams = None
    if layout.streamed is not None and layout.streamed.any():
        over_link = replace(where, weights_over_link=True)
        streams = [CostModel.of(spec, gpu, priced, host, shards=shards, residence=over_link) for gpu in machine.gpus]
    ctx = trace.prompt_len + np.arange(T)
    counts = token_counts(trace.true_ids, spec.n_experts)
    r = time_static(spec, layout, counts, ctx, b, cms, cpu_cm, streams)
    zeros_m = np.zeros_like(r.n_gpu)
    # Streamed weights cross the link inside the GPU's kernels: that part of its work is the
    # link's (copy) and the GPU waits on it (stall); the rest is its own compute.
    run = CpuRun(np.cumsum(r.tpot), r.streamed, r.streamed.copy(), r.cpu_wait, r.cpu_busy, r.n_gpu, r.n_cpu,
                    zeros_m, r.n_gpu, device=r.device - r.streamed, transfer=r.transfer, moved=r.streamed_bytes)
    n_exec = r.n_gpu + r.n_cpu
    plan = Plan(pol, 0, "lru", 1, zeros_m, zeros_m, n_exec, np.full_like(n_exec, b * spec.top_k), r.n_gpu, zeros_m,
                zeros_m)
    ttft = prefill_time_static(cms, cpu_cm, layout, trace.prompt_len, b, streams) if ttft else float("nan")
    mem = machine.device_memory_gb()
    eng = cpu_cm.engine
    config = {
        "model": spec.name, "hw": machine.name, "host": host.name, "policy": pol.name, "cache_experts": 0,
        "eviction": "-", "link_gbps": machine.link_gbps(), "batch": b, "sim": "static", "engine": eng.name,
        "threads": cpu_cm.threads,
        "timing": f"roofline ({machine.name} + {host.name}, {eng.label}{'' if s.amx and host.has_amx else ', no AMX'})",
        "placement": layout.source, "optimistic_placement": layout.optimistic,
        "resident_experts": int((layout.expert_device >= 0).sum()), "gpu_layers": layout.gpu_layers(),
        "cpu_layers": layout.cpu_moe_layers(), "offload_gib": layout.streamed_gib(spec), "expert_bytes": spec.expert_bytes, "synthetic_trace": trace.synthetic,
        "device_gb_needed": max(need.gpu, default=0) / 1e9, "host_gb_needed": (need.host_weights + need.host_kv) / 1e9,
        "fits": all(x <= m * 1e9 for x, m in zip(need.gpu, mem)),
        "page_miss": cpu_cm.page_miss if cpu_cm.host is not None else 0.0,
    }
    return CpuResult(config, r.tpot, run, plan, ttft, layout)
