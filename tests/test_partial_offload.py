"""llama.cpp and ik_llama.cpp stop replaying CUDA graphs when part of the model runs on the CPU
(ik_llama.cpp PR #1040): their GPU kernels then cost ``partial_offload_launch_us`` each, a
fully offloaded model keeps the graph's ``kernel_launch_us``."""

from __future__ import annotations

import pytest

from moesim.costmodel import CostModel, Residence
from moesim.engines import get_engine
from moesim.hardware import get_host, get_machine, get_profile
from moesim.models import get_model
from moesim.policy import get_policy
from moesim.setting import Setting
from moesim.sim.static import simulate_static
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


@pytest.mark.parametrize("engine", ["llama.cpp", "ik_llama.cpp"])
def test_a_cpu_part_launches_at_the_engines_partial_offload_cost(engine):
    spec, gpu, host = get_model("olmoe-1b-7b"), get_profile("rtx4090"), get_host("ryzen-7950x")
    e = get_engine(engine)
    full = CostModel(spec, gpu, host, engine)
    part = CostModel(spec, gpu, host, engine, residence=Residence(cpu_part=True))
    assert full.launch == pytest.approx(e["kernel_launch_us"] * 1e-6)
    assert part.launch == pytest.approx(e["partial_offload_launch_us"] * 1e-6) and part.launch > full.launch
    # A small block is launch-bound (a replayed graph overlaps launches with the work): it slows.
    assert part.attention(0, 1) > full.attention(0, 1)


def test_an_engine_without_the_figure_keeps_its_graph_launches():
    spec, gpu = get_model("qwen3-30b-a3b"), get_profile("rtx4090")
    assert CostModel(spec, gpu, None, "vllm", residence=Residence(cpu_part=True)).launch == CostModel(spec, gpu, None, "vllm").launch


def test_the_static_planner_says_when_part_of_the_model_is_on_the_cpu(monkeypatch):
    seen = []
    real = CostModel.__init__

    def spy(self, *a, **kw):
        seen.append(kw["residence"].cpu_part)
        real(self, *a, **kw)

    monkeypatch.setattr(CostModel, "__init__", spy)
    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=4))
    machine, host = get_machine("rtx4090"), get_host("ryzen-7950x")
    simulate_static(trace, machine, get_policy("cpu-static"), Setting(cpu_layers=4, host=host, engine="llama.cpp"), ttft=False)
    assert seen and all(seen)
    seen.clear()
    simulate_static(trace, machine, get_policy("cpu-static"), Setting(cpu_layers=0, host=host, engine="llama.cpp"), ttft=False)
    assert seen and not any(seen)
