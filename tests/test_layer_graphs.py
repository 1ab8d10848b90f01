"""An engine's graph per layer kind and per build (issue 50, items 1 and 5): a layer kind's own
kernel count (``[layer_kernels]``), whether the engine can replay a CUDA graph for a model with
that kind (``[graph_replay]``), passes over a recurrent state (``state_passes``), the figures an
older build had (``[[before]]``, ``--engine NAME@YYYY-MM-DD``), and a kernel's time being its
own (the KV read of a long context no longer hides under the other kernels' launches)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moesim.costmodel import CostModel
from moesim.engines import get_engine, parse_engine
from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.quant_recipes import apply_recipe

FIGS = {k: {"value": 1, "kind": "estimate", "source": "x"}
        for k in ("attention_kernels", "expert_kernels", "fused_experts", "head_kernels", "predict_kernels")}


def _fig(v):
    return {"value": v, "kind": "estimate", "source": "x"}


def test_a_build_gets_the_figures_of_every_change_made_after_it_the_oldest_winning():
    e = get_engine("llama.cpp")
    old, mid, new = e.at("2026-02-05"), e.at("2026-02-12"), e.at("2026-03-01")
    assert (old.kernels_before_experts("linear"), old.get("state_passes", 2), old.graph_replay["linear"].value) \
        == (50, 18, 0)
    assert (mid.kernels_before_experts("linear"), mid.get("state_passes", 2), mid.graph_replay["linear"].value) \
        == (38, 2, 0)
    assert (new.kernels_before_experts("linear"), new.get("state_passes", 2), new.graph_replay) == (38, 2, {})
    assert e.at(None) is e and "2026-02-05" in old.description and old.name == "llama.cpp"
    # A full-attention layer keeps the engine's attention_kernels at every build.
    assert old.kernels_before_experts("full") == new.kernels_before_experts("full") == e.attention_kernels
    assert get_engine("llama.cpp@2026-02-05") == old and get_engine("llama.cpp@2026-02") == e.at("2026-02-01")


def test_graph_replay_stops_only_for_a_model_with_the_kind():
    gpu = get_profile("a100-pcie")
    hybrid = apply_recipe(get_model("qwen3-next-80b-a3b"), "q4_k_m")
    plain = apply_recipe(get_model("qwen3-30b-a3b"), "q4_k_m")
    old, new = get_engine("llama.cpp@2026-02-05"), get_engine("llama.cpp")
    eager = old["partial_offload_launch_us"] * 1e-6
    cm_old, cm_new = CostModel(hybrid, gpu, engine=old), CostModel(hybrid, gpu, engine=new)
    assert not cm_old.overlap and cm_old.launch == pytest.approx(eager)
    assert cm_new.overlap and cm_new.launch == pytest.approx(new.kernel_launch_us * 1e-6)
    # Qwen3-30B has no delta-net layer: the same old build replays its graph.
    assert CostModel(plain, gpu, engine=old).overlap
    # The old build's delta-net layer costs more: more kernels, launched one by one, 9x the state traffic.
    linear = next(i for i in range(hybrid.n_layers) if hybrid.layer_kind(i) == "linear")
    assert cm_old.attention(linear, 1000) > 2 * cm_new.attention(linear, 1000)


def test_a_long_context_is_seen_under_a_replayed_graph():
    """Qwen3-30B Q4_K_M on an RTX 4090 under llama.cpp priced 128 and 4,096 tokens of context
    equal in every digit: the KV read hid under the other kernels' launches."""
    spec = apply_recipe(get_model("qwen3-30b-a3b"), "q4_k_m")
    cm = CostModel(spec, get_profile("rtx4090"), engine="llama.cpp")
    assert cm.overlap
    ctx = np.array([128, 1024, 4096, 16384, 32768])
    t = cm.attention(0, ctx)
    assert np.all(np.diff(t) > 0), t
    assert t[2] > t[0] * 1.05  # 4K of context: at least 5% on the attention block


def test_under_eager_launches_a_block_costs_what_it_did():
    """An engine without graph replay adds launches and work: splitting the KV kernel from the
    rest changes nothing there (memory-bound decode)."""
    spec = get_model("olmoe-1b-7b")
    cm = CostModel(spec, get_profile("a6000"), engine="pytorch-eager")
    e = cm.engine
    weights = spec.layer_resident_bytes(0)
    kv = 2000 * spec.kv_bytes_per_token(0)
    expected = weights / (cm.gpu.mem_bw * e.weight_efficiency("gpu", spec.dense_dtype)) \
        + kv / (cm.gpu.mem_bw * cm.kv_efficiency) + e.attention_kernels * cm.launch + cm.layer_overhead
    assert cm.attention(0, 2000) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("before,message", [
    ([{"graph_replay": {"linear": _fig(0)}}], "a date"),
    ([{"date": "2026-02-30", "graph_replay": {"linear": _fig(0)}}], "YYYY-MM-DD"),
    ([{"date": "2026-02-01"}], "at least one of"),
    ([{"date": "2026-02-01", "graph_replay": {"linear": _fig(2)}}], "0 or 1"),
    ([{"date": "2026-02-01", "layer_kernels": {"linear": _fig(2.5)}}], "whole number"),
    ([{"date": "2026-02-01", "launch": {}}], "unknown: launch"),
    ([{"date": "2026-02-01", "figures": {"state_passes": _fig(4)}},
      {"date": "2026-02-01", "figures": {"state_passes": _fig(6)}}], "one date"),
    ("2026-02-01", "are tables"),
])
def test_a_bad_before_entry_is_one_line(before, message):
    with pytest.raises(MoesimError, match=message):
        parse_engine({"name": "e", "runs_on": ["gpu"], "figures": FIGS, "before": before}, "e.toml")


def test_before_entries_survive_the_toml_round_trip(tmp_path):
    e = get_engine("llama.cpp")
    p = tmp_path / "copy.toml"
    p.write_text(e.to_toml())
    back = get_engine(str(p))
    assert back.before == e.before and back.layer_kernels == e.layer_kernels
    assert back.at("2026-01-01").graph_replay == e.at("2026-01-01").graph_replay


@pytest.mark.parametrize("name", ["llama.cpp@2026-13-01", "llama.cpp@yesterday", "nosuch@2026-01-01"])
def test_a_bad_engine_build_is_one_line_exit_2(name):
    proc = subprocess.run([sys.executable, "-m", "moesim", "whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090",
                           "--engine", name, "--policies", "all-resident"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("engine,replays", [("llama.cpp", True), ("llama.cpp@2025-01-27", False),
                                            ("ik_llama.cpp", False)])
def test_layers_split_over_gpus_replay_a_graph_only_where_the_engine_can(engine, replays):
    """llama.cpp's pipeline-parallel copies kept CUDA graphs off over several GPUs until
    ggml-org/llama.cpp#13814 (2025-05-27); one GPU is never affected."""
    from moesim.costmodel import Residence

    spec, gpu = apply_recipe(get_model("qwen3-30b-a3b"), "q4_k_m"), get_profile("rtx3090")
    e = get_engine(engine)
    split = CostModel(spec, gpu, engine=e, residence=Residence(layer_split=True))
    assert split.overlap is replays
    assert CostModel(spec, gpu, engine=e).overlap
    if not replays:
        assert split.launch == pytest.approx(e["partial_offload_launch_us"] * 1e-6)


def test_a_two_gpu_layer_split_is_priced_as_the_old_build_ran_it():
    from moesim.setting import Setting
    from moesim.sim.static import simulate_static
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    spec = apply_recipe(get_model("qwen3-30b-a3b"), "q4_k_m")
    trace = synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=64, seed=0))

    def tpot(engine):
        return float(simulate_static(trace, "2xrtx3090", "all-resident", Setting(engine=engine)).tpot.mean())

    assert tpot("llama.cpp@2025-01-27") > 1.3 * tpot("llama.cpp")


@pytest.mark.parametrize("before,message", [
    ([{"date": "2026-02-01", "figures": {"launch_overlap": _fig(2)}}], "launch_overlap is 0 or 1"),
    ([{"date": "2026-02-01", "figures": {"layer_split_graph_replay": _fig(5)}}], "0 or 1"),
    ([{"date": "2026-02-01", "layer_efficiency": {"linear": _fig(1e-9)}}], "at least 0.001"),
    ([{"date": "2026-02-01", "figures": {}}], "hold no figure"),
    ([{"date": "2026-02-01", "graph_replay": {}}], "hold no figure"),
])
def test_a_before_entry_is_checked_as_the_profile_is(before, message):
    """The stranger run found these accepted in a [[before]] entry while refused at the top level
    (a layer efficiency of 1e-9 priced 642 million ms a token)."""
    with pytest.raises(MoesimError, match=message):
        parse_engine({"name": "e", "runs_on": ["gpu"], "figures": FIGS, "before": before}, "e.toml")


@pytest.mark.parametrize("name,message", [("llama.cpp@2026-02-05@2025-01-01", "one build date"),
                                          ("@2026-01-01", "one engine and one build date"),
                                          ("pytorch-eager@2020-01-01", "holds no earlier builds")])
def test_a_build_date_that_cannot_be_priced_is_refused(name, message):
    with pytest.raises(MoesimError, match=message):
        get_engine(name)


def test_a_build_is_named_where_it_was_priced_and_fixed_once_written(tmp_path):
    """A build's figures carry its date into the answer; a profile written from it is that build
    (no earlier builds left to choose, so a second date cannot apply its changes twice)."""
    spec = apply_recipe(get_model("qwen3-next-80b-a3b"), "q4_k_m")
    old = get_engine("llama.cpp@2026-02-05")
    assert old.label == "llama.cpp@2026-02-05" and old.before == () and get_engine("llama.cpp").label == "llama.cpp"
    from moesim.sim.costs import roofline_costs

    assert "llama.cpp@2026-02-05" in roofline_costs(CostModel(spec, get_profile("a100-pcie"), engine=old), 4, 64).source
    p = tmp_path / "old.toml"
    p.write_text(old.to_toml())
    assert get_engine(str(p)).graph_replay["linear"].value == 0
    with pytest.raises(MoesimError, match="holds no earlier builds"):
        get_engine(f"{p}@2026-03-01")


def test_partial_offload_and_a_layer_split_without_graphs_are_priced_alike():
    """Both launch every kernel one by one (the stranger run found the first priced as overlapping)."""
    from moesim.costmodel import Residence

    spec, gpu, e = apply_recipe(get_model("qwen3-30b-a3b"), "q4_k_m"), get_profile("rtx3090"), get_engine("llama.cpp")
    part = CostModel(spec, gpu, engine=e, residence=Residence(cpu_part=True))
    split = CostModel(spec, gpu, engine=e.at("2025-01-01"), residence=Residence(layer_split=True))
    assert (part.overlap, part.launch) == (split.overlap, split.launch) == (False, pytest.approx(4e-6))
