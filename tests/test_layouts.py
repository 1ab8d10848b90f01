"""The deployments people run, as static layouts: what each one holds where, how its time
moves with its knob, and the engine arguments that spell it.

Each test states a physical fact (bytes are conserved, a streamed byte crosses the link,
more layers on the GPU never slow a memory-bound decode, a host too small for the model
pages or refuses) rather than a number the code produced."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moesim.engine_args import invocation
from moesim.errors import DoesNotFit, MoesimError
from moesim.hardware import Machine, get_machine, get_profile
from moesim.layout import CPU, layer_weight_bytes, make_layout, stream_layers
from moesim.memory import WORKSPACE_BYTES, kv_bytes, layout_bytes
from moesim.models import get_model
from moesim.setting import Setting
from moesim.sim.simulate import simulate
from moesim.sim.static import simulate_static
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

MODEL = "qwen3-30b-a3b"


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(get_model(MODEL), SyntheticParams(tokens=4, prompt_len=64, seed=3))


def _tpot(res) -> float:
    return float(res.tpot.mean())


def layer_bytes(spec, layers) -> int:
    return sum(layer_weight_bytes(spec, x) for x in layers)


def _layouts(spec):
    base = make_layout(spec, 1)
    return {
        "all on one GPU": base,
        "12 MoE layers' experts on the CPU": make_layout(spec, 1, cpu_moe_layers=12),
        "last 20 layers on the GPU": make_layout(spec, 1, gpu_layers=20),
        "two GPUs, 3:1": make_layout(spec, 2, ratios=[3, 1]),
        "two GPUs, experts of 8 layers on the CPU": make_layout(spec, 2, cpu_moe_layers=8),
        "no GPU": make_layout(spec, 0),
        "10 GiB streamed": stream_layers(spec, base, 10.0),
    }


@pytest.mark.parametrize("name", list(_layouts(get_model(MODEL))))
def test_every_layout_holds_every_byte_once(name):
    """GPU bytes less workspaces, plus host bytes, are the model's weights and KV cache."""
    spec = get_model(MODEL)
    lay = _layouts(spec)[name]
    b, ctx = 2, 512
    need = layout_bytes(spec, lay, b, ctx)
    held = sum(need.gpu) - WORKSPACE_BYTES * len(need.gpu) + need.host_weights + need.host_kv
    assert held == spec.non_expert_bytes + spec.all_expert_bytes + kv_bytes(spec, b, ctx)


def test_streaming_nothing_is_all_resident(trace):
    resident = simulate_static(trace, "h100-sxm", "all-resident")
    none = simulate(trace, "h100-sxm", "weight-streaming", Setting(offload_gib=0))
    assert _tpot(none) == pytest.approx(_tpot(resident), rel=1e-12)
    assert none.config["offload_gib"] == 0.0 and float(none.copy.mean()) == 0.0


def test_every_streamed_byte_crosses_the_link(trace):
    """More GiB streamed: slower, and the added time is the link's (copy), never less than
    the routed bytes of the streamed layers at the link's bandwidth less the device's."""
    spec = trace.model
    gpu = get_profile("h100-sxm")
    prev = None
    for gib in (2.0, 8.0, 20.0):
        r = simulate(trace, gpu, "weight-streaming", Setting(offload_gib=gib))
        assert r.config["offload_gib"] >= gib
        if prev is not None:
            assert _tpot(r) > _tpot(prev) and float(r.copy.mean()) > float(prev.copy.mean())
        prev = r
    streamed = np.flatnonzero(r.placement.streamed)
    moe = [spec.moe_layers.index(x) for x in streamed if x in spec.moe_layers]
    routed = (r.run.n_gpu[:, moe]).sum(1).mean() * spec.expert_bytes  # experts the streamed layers ran
    floor = routed * (1 / gpu.link_bw - 1 / gpu.mem_bw)
    assert float(r.copy.mean()) >= floor
    assert r.summary()["tpot_ms"] == pytest.approx(r.summary()["compute_ms"] + r.summary()["stall_ms"], rel=1e-9)


def test_auto_streams_the_least_that_fits(trace):
    spec = trace.model
    r = simulate(trace, "rtx4090", "weight-streaming")
    assert r.config["fits"]
    n = int(r.placement.streamed.sum())
    assert n > 0 and r.placement.streamed[:n].all()  # the first layers, in module order
    fewer = r.placement.streamed.copy()
    fewer[n - 1] = False
    need = layout_bytes(spec, replace(r.placement, streamed=fewer), 1, trace.prompt_len + trace.n_tokens)
    assert need.gpu[0] > get_profile("rtx4090")["device_memory_gb"] * 1e9


def test_vllm_arguments_offload_at_least_the_streamed_layers(trace):
    """--cpu-offload-gb (GiB per GPU) covers every streamed layer, and less than one more:
    vLLM offloads parameters in module order until it holds that many, so it keeps the
    modelled layers in host memory and at most part of the next."""
    spec = trace.model
    for machine in ("rtx4090", "2xrtx4090"):
        lay = simulate(trace, machine, "weight-streaming", Setting(split="tensor")).placement
        inv = invocation("vllm", spec, lay, context=4096)
        g = get_machine(machine).n_gpus
        assert inv.args[inv.args.index("--tensor-parallel-size") + 1] == str(g)
        total = float(inv.args[inv.args.index("--cpu-offload-gb") + 1]) * g * 2**30
        n = int(lay.streamed.sum())
        assert layer_bytes(spec, range(n)) <= total < layer_bytes(spec, range(n + 1))


def test_vllm_refuses_cpu_experts():
    spec = get_model(MODEL)
    with pytest.raises(MoesimError, match="cannot run experts on the CPU"):
        invocation("vllm", spec, make_layout(spec, 1, cpu_moe_layers=4))


def test_more_gpu_layers_never_slow_a_decode(trace):
    kw = dict(host="ryzen-7950x", engine="llama.cpp")
    times = [_tpot(simulate(trace, "a6000", "gpu-layers", Setting(gpu_layers=n, **kw))) for n in (0, 12, 24, 36, 48)]
    assert all(a > b for a, b in zip(times, times[1:]))


def test_no_gpu_layers_is_the_machine_without_a_gpu(trace):
    """-ngl 0 runs every layer and the head on the CPU: the machine without a GPU's time."""
    kw = dict(host="ryzen-7950x", engine="llama.cpp", threads=16)
    ngl0 = simulate(trace, "a6000", "gpu-layers", Setting(gpu_layers=0, **kw))
    none = simulate(trace, "none", "all-resident", Setting(**kw))
    assert _tpot(ngl0) == pytest.approx(_tpot(none), rel=1e-12)


def test_llama_cpp_arguments_spell_the_layout():
    spec = get_model(MODEL)
    inv = invocation("llama.cpp", spec, make_layout(spec, 1, gpu_layers=20), threads=8, context=4096)
    a = inv.args
    assert a[a.index("-ngl") + 1] == "20" and a[a.index("-t") + 1] == "8" and a[a.index("-c") + 1] == "4096"
    inv = invocation("llama.cpp", spec, make_layout(spec, 2, cpu_moe_layers=8, ratios=[3, 1]))
    a = inv.args
    assert a[a.index("-ngl") + 1] == "99" and a[a.index("--n-cpu-moe") + 1] == "8"
    assert a[a.index("--tensor-split") + 1] == "36,12"  # layers per GPU, 3:1 of 48
    blocks = re.search(r"blk\\\.\(([0-9|]+)\)", inv.note).group(1).split("|")
    assert blocks == [str(x) for x in range(8)]  # -ot names the same 8 layers' experts
    inv = invocation("llama.cpp", spec, make_layout(spec, 2, split="tensor"))
    a = inv.args
    assert a[a.index("--split-mode") + 1] == "row" and a[a.index("--tensor-split") + 1] == "1,1"  # each layer halved


def test_tensor_split_shares_weights_and_pays_collectives():
    """Splitting every layer over two GPUs halves each GPU's weight reads and adds two
    all-reduces a layer: on Mixtral (13B active parameters a token) the halving wins over
    NVLink, and the all-reduces cost more over PCIe than over NVLink."""
    mixtral = synthetic_trace(get_model("mixtral-8x7b"), SyntheticParams(tokens=4, prompt_len=64, seed=3))
    layer = simulate(mixtral, "2xh100-sxm", "all-resident", Setting(split="layer"))
    tensor = simulate(mixtral, "2xh100-sxm", "all-resident", Setting(split="tensor"))
    assert _tpot(tensor) < 0.75 * _tpot(layer)
    one = simulate(mixtral, "h100-sxm", "all-resident")
    assert _tpot(layer) == pytest.approx(_tpot(one), rel=0.05)  # layer split: the GPUs take turns
    pcie = get_profile("h100-sxm")
    pcie = replace(pcie, figures={k: v for k, v in pcie.figures.items() if k != "peer_gbs"})
    over_pcie = simulate(mixtral, Machine((pcie, pcie), "2xh100-over-pcie"), "all-resident", Setting(split="tensor"))
    assert _tpot(over_pcie) > _tpot(tensor)


def test_host_ram_smaller_than_the_model_pages_or_refuses(trace):
    from moesim.hardware import get_host

    host = get_host("ryzen-7950x")
    small = host.with_figure("ram_gb", 32)  # qwen3-30b-a3b in bf16 is ~61 GB; the disk: the default NVMe
    big = host.with_figure("ram_gb", 128)
    roomy = simulate(trace, "none", "all-resident", Setting(host=big, engine="llama.cpp"))
    paged = simulate(trace, "none", "all-resident", Setting(host=small, engine="llama.cpp"))
    assert roomy.config["page_miss"] == 0 and 0 < paged.config["page_miss"] < 1
    assert _tpot(paged) > 2 * _tpot(roomy)  # a disk is far slower than DRAM
    with pytest.raises(DoesNotFit, match="loads its weights into RAM"):
        simulate(trace, "none", "all-resident", Setting(host=small, engine="ktransformers"))


def test_threads_and_sockets(trace):
    """Fewer threads: slower on the CPU; a second socket adds less than its share (NUMA)."""
    kw = dict(engine="llama.cpp")
    few = simulate(trace, "none", "all-resident", Setting(host="xeon-8480", threads=8, **kw))
    all_ = simulate(trace, "none", "all-resident", Setting(host="xeon-8480", **kw))
    assert _tpot(few) > _tpot(all_)
    from moesim.hardware import get_host

    one = get_host("xeon-8480")
    two = one.with_figure("sockets", 2)
    t1 = _tpot(simulate(trace, "none", "all-resident", Setting(host=one, **kw)))
    t2 = _tpot(simulate(trace, "none", "all-resident", Setting(host=two, **kw)))
    assert t1 / 2 < t2 < t1


def test_a_kernel_rate_makes_threads_and_context_matter_where_one_thread_cannot_keep_up(trace, tmp_path):
    """An engine figure ``cpu_kernel_gmacs``: where one thread's kernels cannot keep up with
    the memory, a second thread nearly halves the step and a long context costs its math;
    far above the bandwidth's pace (or absent) it changes nothing; never above the host's GEMM
    rate (the measured llama.cpp rows behind it: bench/llamacpp.json)."""
    from moesim.costmodel import CostModel
    from moesim.engines import get_engine
    from moesim.hardware import get_host

    host, base = get_host("ryzen-7950x"), get_engine("llama.cpp")
    slow = base.with_figure("cpu_kernel_gmacs.default", 0.5, "estimate", "test")
    fast = base.with_figure("cpu_kernel_gmacs.default", 1e4, "estimate", "test")

    def tpot(engine, threads, prompt=64):
        tr = trace if prompt == 64 else synthetic_trace(trace.model, SyntheticParams(tokens=4, prompt_len=prompt))
        return _tpot(simulate(tr, "none", "all-resident", Setting(host=host, engine=engine, threads=threads)))

    assert 1.8 < tpot(slow, 1) / tpot(slow, 2) <= 2.0  # compute-bound: threads divide the math
    assert tpot(fast, 1) == pytest.approx(tpot(base, 1)) and tpot(fast, 2) == pytest.approx(tpot(base, 2))
    assert tpot(slow, 1, prompt=8192) / tpot(slow, 1) > tpot(base, 1, prompt=8192) / tpot(base, 1)
    cm = CostModel(trace.model, None, host, engine=fast, threads=16)
    assert cm.cpu_rate("bf16") == CostModel(trace.model, None, host, engine=base, threads=16).cpu_rate("bf16")
    assert CostModel(trace.model, None, host, engine=slow, threads=64).cpu_rate("q4_k") == pytest.approx(
        2 * 0.5e9 * 16)  # one thread a core: a second hardware thread shares its core's units
    toml = tmp_path / "mine.toml"  # the TOML table, as a user writes it
    toml.write_text(Path(base.path).read_text() + '\n[cpu_kernel_gmacs]\nbf16 = { value = 3.7, kind = "measured", '
                    'source = "test" }\n')
    mine = get_engine(str(toml))
    assert mine.cpu_kernel_flops("bf16") == pytest.approx(7.4e9) and mine.cpu_kernel_flops("q8_0") is None
    assert ("cpu_kernel_gmacs.bf16", mine.cpu_kernel_gmacs["bf16"]) in mine.sources()


def test_every_layout_refuses_what_does_not_fit(trace):
    with pytest.raises(MoesimError, match="--offload-gib"):
        simulate(trace, "a6000", "weight-streaming", Setting(offload_gib=-1.0))
    assert not simulate(trace, "rtx4090", "weight-streaming", Setting(offload_gib=1.0)).config["fits"]
    assert (make_layout(trace.model, 0).layer_device == CPU).all()


def test_a_warm_cache_needs_no_more_memory_than_a_cold_one(trace):
    """cpu-on-miss warms its cache with a calibration's hot set: the warm experts are the
    cache's, so the memory fit is the cold cache's (it once added the whole hot set)."""
    calib = synthetic_trace(trace.model, SyntheticParams(tokens=8, prompt_len=64, seed=3, draw_seed=9)).true_ids
    kw = dict(cache_gib=4.0, host="ryzen-7950x")
    cold = simulate(trace, "a6000", "cpu-on-miss", Setting(**kw))
    warm = simulate(trace, "a6000", "cpu-on-miss", Setting(calibration=calib, **kw))
    assert warm.config["resident_experts"] > 0
    assert warm.config["device_gb_needed"] == cold.config["device_gb_needed"]
    assert warm.config["fits"]
