"""A linear-attention / state-space mixer kind is one class (moesim.spec.LinearMixer) and its
line in LINEAR_MIXERS: what a layer of it weighs, the state a sequence keeps and how it is read
from config.json are the class's. Shown by adding one here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moesim import spec as spec_module
from moesim.models import get_model
from moesim.spec import LINEAR_MIXERS, LinearAttention, LinearMixer


class RetNet(LinearMixer):
    """A planted kind: q, k, v and output projections of ``n_heads x head_v_dim``, a state of
    ``head_k_dim x head_v_dim`` a head, no convolution."""

    name, model_types = "retnet-test", ("retnet_moe_test",)

    def matrices(self, la, h):
        inner = la.n_heads * la.head_v_dim
        return [(3 * inner, h), (h, inner)]

    def small_params(self, la, h):
        return la.n_heads

    def state_elements(self, la):
        return la.n_heads * la.head_k_dim * la.head_v_dim

    def from_config(self, cfg, path, hidden):
        return LinearAttention(self.name, n_heads=cfg["retention_heads"], head_k_dim=cfg["retention_key_dim"],
                               head_v_dim=hidden // cfg["retention_heads"])


@pytest.fixture
def retnet(monkeypatch):
    monkeypatch.setitem(LINEAR_MIXERS, RetNet.name, RetNet())
    monkeypatch.setattr(spec_module, "LINEAR_KINDS", tuple(LINEAR_MIXERS))
    return LINEAR_MIXERS[RetNet.name]


def test_a_new_kind_is_one_class_and_a_registry_line(retnet):
    base = get_model("qwen3-next-80b-a3b")
    la = LinearAttention(RetNet.name, n_heads=16, head_k_dim=128, head_v_dim=128)
    m = replace(base, linear=la)
    inner = 16 * 128
    assert la.params(m.hidden) == 3 * inner * m.hidden + m.hidden * inner + 16
    assert la.state_elements == 16 * 128 * 128 and la.conv_elements == 0
    assert m.linear_attention_bytes > 0 and m.linear_attention_params == la.params(m.hidden) + 2 * m._norm_params


def test_the_shipped_kinds_keep_their_sizes():
    """Each shipped kind, through its class, sizes its model as before the classes (the
    figures of the catalogue's models, which the golden outputs and published predictions
    rest on)."""
    got = {n: (get_model(n).linear_attention_bytes, get_model(n).linear.state_elements, get_model(n).linear.conv_elements)
           for n in ("qwen3-next-80b-a3b", "jamba-1.5-mini")}
    assert got == {"qwen3-next-80b-a3b": (67445120, 524288, 24576), "jamba-1.5-mini": (210633280, 131072, 24576)}
    assert set(LINEAR_MIXERS) == {"gated_deltanet", "mamba", "mamba2", "lightning"}


def test_a_config_is_read_by_its_kinds_class(tmp_path, retnet):
    """hf_config hands a config.json's linear layers to the kind whose model types hold its
    model_type (the planted kind here; Jamba's reads as before)."""
    from moesim import hf_config

    cfg = {"retention_heads": 8, "retention_key_dim": 64}
    assert hf_config._linear(cfg, tmp_path / "config.json", "retnet_moe_test", 2048) == LinearAttention(
        RetNet.name, n_heads=8, head_k_dim=64, head_v_dim=256)
    assert hf_config._linear({}, tmp_path / "config.json", "jamba", 4096) == LinearAttention(
        "mamba", d_inner=8192, d_state=16, dt_rank=256, conv_kernel=4)
    assert hf_config._linear({}, tmp_path / "config.json", "mixtral", 4096) is None
