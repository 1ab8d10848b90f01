"""An engine's maturity per layer kind (``[layer_efficiency]`` of an engine profile): a token
mixer of a kind the engine runs with unfused kernels takes 1 / efficiency of its roofline,
and nothing else changes (issue "Predictions that hold where nothing was fitted")."""

from __future__ import annotations

import pytest

from moesim.costmodel import CostModel
from moesim.engines import get_engine, parse_engine
from moesim.errors import MoesimError
from moesim.hardware import get_host, get_profile
from moesim.models import get_model


def _engine(**table):
    base = get_engine("llama.cpp")
    for kind, v in table.items():
        base = base.with_figure(f"layer_efficiency.{kind}", v, "estimate", "not optimised in version X (test)")
    return base


@pytest.mark.parametrize("on", ["gpu", "cpu"])
def test_a_linear_mixer_at_a_quarter_of_the_roofline_costs_its_mixer_four_times(on):
    spec = get_model("qwen3-next-80b-a3b")
    gpu, host = get_profile("h100-sxm"), get_host("epyc-9654")
    plain, slow = CostModel(spec, gpu, host, _engine()), CostModel(spec, gpu, host, _engine(linear=0.25))
    linear = next(i for i in range(spec.n_layers) if spec.layer_kind(i) == "linear")
    full = next(i for i in range(spec.n_layers) if spec.layer_kind(i) == "full")
    assert slow.mixer_kind(linear) == "linear" and slow.mixer_kind(full) == "full"
    assert slow.attention(full, 4096, on=on) == plain.attention(full, 4096, on=on)  # another kind: unchanged
    t0, t1 = plain.attention(linear, 4096, on=on), slow.attention(linear, 4096, on=on)
    assert t1 > t0 * 1.5
    # Only the mixer is slowed: the layer's router and shared expert keep their time.
    nothing = CostModel(spec, gpu, host, _engine(linear=1.0))
    assert nothing.attention(linear, 4096, on=on) == t0


def test_latent_attention_is_its_own_kind():
    spec = get_model("deepseek-v3")
    cm = CostModel(spec, get_profile("h100-sxm"), None, _engine(mla=0.5))
    assert cm.mixer_kind(0) == "mla"
    assert cm.attention(0, 1024) > CostModel(spec, get_profile("h100-sxm"), None, _engine()).attention(0, 1024)


@pytest.mark.parametrize("table,message", [({"linear": {"value": 1.5, "kind": "estimate", "source": "x"}}, "at most 1"),
                                           ({"delta": {"value": 0.5, "kind": "estimate", "source": "x"}}, "delta")])
def test_a_bad_layer_efficiency_is_one_line(table, message):
    raw = {"name": "e", "runs_on": ["gpu"], "figures": {k: {"value": 1, "kind": "estimate", "source": "x"} for k in
           ("attention_kernels", "expert_kernels", "fused_experts", "head_kernels", "predict_kernels")},
           "layer_efficiency": table}
    with pytest.raises(MoesimError, match=message):
        parse_engine(raw, "e.toml")


def test_a_vanishing_layer_efficiency_and_an_empty_policy_list_are_refused():
    raw = {"name": "e", "runs_on": ["gpu"], "figures": {k: {"value": 1, "kind": "estimate", "source": "x"} for k in
           ("attention_kernels", "expert_kernels", "fused_experts", "head_kernels", "predict_kernels")}}
    with pytest.raises(MoesimError, match="at least 0.001"):
        parse_engine({**raw, "layer_efficiency": {"full": {"value": 1e-300, "kind": "estimate", "source": "x"}}}, "e")
    with pytest.raises(MoesimError, match="at least one policy"):
        parse_engine({**raw, "policies": []}, "e.toml")


def test_a_cpu_only_engine_is_refused_on_a_gpu():
    raw = {"name": "cpuonly", "runs_on": ["cpu"], "figures": {k: {"value": 1, "kind": "estimate", "source": "x"} for k
           in ("attention_kernels", "expert_kernels", "fused_experts", "head_kernels", "predict_kernels")}}
    with pytest.raises(MoesimError, match="computes on CPUs only"):
        CostModel(get_model("olmoe-1b-7b"), get_profile("a6000"), None, parse_engine(raw, "e.toml"))


def test_a_cost_on_a_processor_the_deployment_lacks_is_one_line():
    """attention(on="gpu") with no GPU read the GPU's bandwidth past the cost model's own
    helpers (a raw AttributeError); on="cpu" with no host likewise: both say what is missing."""
    spec = get_model("olmoe-1b-7b")
    no_gpu = CostModel(spec, None, host=get_host("epyc-7742"))
    assert no_gpu.attention(0, 100, on="cpu") > 0
    with pytest.raises(MoesimError, match="needs a GPU"):
        no_gpu.attention(0, 100, on="gpu")
    no_host = CostModel(spec, get_profile("a6000"))
    assert no_host.attention(0, 100, on="gpu") > 0
    with pytest.raises(MoesimError, match="needs a host"):
        no_host.attention(0, 100, on="cpu")
