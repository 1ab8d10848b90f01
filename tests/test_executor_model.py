"""The executor's model equals the Hugging Face reference classes (float32 tolerance)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor.model import ExecConfig, load_checkpoint, random_model, save_checkpoint  # noqa: E402
from moesim.models import get_model  # noqa: E402
from moesim.setting import Setting  # noqa: E402

# YaRN with factor 4 = max_position_embeddings 32 / 8; pass copies (transformers' configs edit the dict).
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True, **COMMON)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, **COMMON)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        num_experts=8, num_experts_per_tok=2, intermediate_size=16, norm_topk_prob=False, **COMMON)),
    # A shared expert with a sigmoid gate, attention biases, and layer 1 dense (mlp_only_layers).
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(_qwen2_config(mlp_only_layers=[1])),
    # MLA without query compression, a leading dense layer, two shared experts, group-limited
    # top-k (one group of two: both experts from the best group) with a gate scale; then
    # query compression, attention biases and plain top-k.
    "deepseek_v2": lambda: transformers.DeepseekV2ForCausalLM(_deepseek_config(
        q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=2.5)),
    "deepseek_v2_qlora": lambda: transformers.DeepseekV2ForCausalLM(_deepseek_config(
        q_lora_rank=12, attention_bias=True, topk_method="greedy", routed_scaling_factor=1.0)),
    # YaRN RoPE (as DeepSeek-V2's released checkpoints): one frequency kept, one interpolated,
    # cos/sin and MLA's softmax scale corrected; then the same on grouped-query attention.
    "deepseek_v2_yarn": lambda: transformers.DeepseekV2ForCausalLM(_deepseek_config(
        q_lora_rank=None, rope_parameters=dict(YARN), max_position_embeddings=32)),
    "qwen3_moe_yarn": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True,
        rope_parameters=dict(YARN), max_position_embeddings=32, **COMMON)),
    # Sigmoid router with a selection bias (randomised below), two groups of four of which one
    # competes, renormalised and scaled gates; RoPE on half of each head, q/k norms, q/k/v biases.
    "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40, head_dim=8,
        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, **COMMON)),
}


def _deepseek_config(**kw):
    common = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}  # MLA: every head has its K/V
    return transformers.DeepseekV2Config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         intermediate_size=40, first_k_dense_replace=1, n_shared_experts=2,
                                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                         **common, **kw)


def _qwen2_config(**kw):
    return transformers.Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=24, intermediate_size=40,
                                       norm_topk_prob=False, **COMMON, **kw)


@torch.no_grad()
def _randomise(ref) -> None:
    """Larger random weights than the default init, so routing is not a tie; GLM's router
    selection bias (a buffer, zero at init) too."""
    for p in ref.parameters():
        p.normal_(0, 0.2)
    for name, b in ref.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.2)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = FAMILIES[request.param]().eval()
    _randomise(ref)
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return ref, load_checkpoint(d)


def test_logits_equal_the_reference_for_prefill_and_decode(pair):
    ref, ours = pair
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    cache = ours.new_cache(2, 16)
    got = [ours(tokens[:, :5], cache, 0)]  # prefill of 5 tokens
    for i in range(5, 9):  # then 4 decode steps, one token at a time
        got.append(ours(tokens[:, i:i + 1], cache, i))
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-4)


def test_synthetic_model_round_trips_through_a_checkpoint(tmp_path):
    cfg = ExecConfig(get_model("tiny"))
    model = random_model(cfg, seed=3)
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    back = load_checkpoint(tmp_path)
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(back(tokens, back.new_cache(1, 8), 0), model(tokens, model.new_cache(1, 8), 0))


@pytest.mark.parametrize("change, error", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}, "RoPE type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "original_max_position_embeddings"),
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ({"n_group": 3, "topk_group": 1}, "do not fit"),
])
def test_deepseek_configs_it_cannot_run_exactly_are_refused(tmp_path, change, error):
    import json

    config = {**_deepseek_config(q_lora_rank=None).to_dict(), "topk_method": "group_limited_greedy",
              "n_group": 4, "topk_group": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ExecConfig.from_hf(tmp_path).router.n_group == 4  # the unchanged config runs
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(MoesimError, match=error):
        ExecConfig.from_hf(tmp_path)


def test_unsupported_and_broken_checkpoints(tmp_path):
    with pytest.raises(MoesimError, match="not one"):
        ExecConfig(get_model("deepseek-v3"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_hidden_layers": 1, '
                                           '"num_experts": 2, "num_experts_per_tok": 1, "hidden_size": 8, '
                                           '"moe_intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, '
                                           '"vocab_size": 8}')
    with pytest.raises(MoesimError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MoesimError, match="cannot read checkpoint|not a safetensors file"):  # moesim.models reads headers first
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "glm4_moe"])
def test_offloaded_decoding_equals_the_reference(tmp_path, family):
    """Shared experts (resident), dense layers (resident) and DeepSeek's MLA and router join
    the offloaded runtime through the one block: exact policies decode the reference's logits."""
    from moesim.executor.runtime import Offload, OffloadedDecoder
    from moesim.executor.transport import EmulatedLink

    torch.manual_seed(0)
    ref = FAMILIES[family]().eval()
    _randomise(ref)
    ref.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    if family == "qwen2_moe":
        assert ours.spec.n_shared == 1 and ours.spec.shared_inter == 24 and ours.spec.attention.bias
    assert ours.spec.dense_layers and ours.spec.n_moe_layers == 2
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(tokens).logits
    for policy in ("all-resident", "on-demand", "prefetch-fom"):
        dec = OffloadedDecoder(ours, policy, EmulatedLink(1e9, 0), Offload(4), predictor="stale")
        cache = ours.new_cache(2, 8)
        got = [dec.step(tokens[:, :4], cache, 0, prefill=True).logits]
        got += [dec.step(tokens[:, i:i + 1], cache, i, step_index=i - 4).logits for i in range(4, 8)]
        dec.transport.close()
        torch.testing.assert_close(torch.stack(got, 1), want[:, 3:], rtol=1e-4, atol=1e-4)
    if family != "qwen2_moe":  # bf16: the router weight stays fp32, as transformers keeps it
        bf = load_checkpoint(tmp_path, dtype=torch.bfloat16)
        assert bf.layers[1].mlp.gate.weight.dtype == torch.float32 and bf.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
        torch.testing.assert_close(bf.layers[1].mlp.gate.weight, ours.layers[1].mlp.gate.weight, rtol=0, atol=0)
        logits = bf(tokens, bf.new_cache(2, 8), 0).float()
        assert torch.isfinite(logits).all() and (logits - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("dense", [[0], [1]], ids=["leading", "between"])
def test_dense_layers_decode_offloaded_and_their_trace_replays(tmp_path, dense):
    """Dense layers (here Qwen2-MoE's mlp_only_layers) run resident inside the offloaded
    step: exact policies decode the all-resident tokens, prediction reaches the NEXT MoE
    layer across a dense one, and the trace ([tokens, moe_layers, ...] routing, attn_s per
    model layer) reads back and replays in the simulator with the executor's own copies."""
    import numpy as np

    from moesim.executor.profile import Origin, ProfileSettings, build_trace, calibrate, generate
    from moesim.hardware import get_profile
    from moesim.sim.simulate import simulate
    from moesim.traces.format import read_trace, write_trace

    torch.manual_seed(0)
    ref = transformers.Qwen2MoeForCausalLM(_qwen2_config(mlp_only_layers=dense)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path / "ckpt")
    ours = load_checkpoint(tmp_path / "ckpt")
    s = ours.spec
    assert s.dense_layers == tuple(dense) and s.n_moe_layers == 2 and ours.experts[dense[0]] == []
    hw = get_profile("a6000")
    prompt = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(3))
    dv = calibrate(ours, torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(4)))  # [L, E, hidden]
    runs = {}
    for name, policy, predictor in (("all-resident", "all-resident", "stale"), ("on-demand", "on-demand", "stale"),
                                    ("prefetch-fom", "prefetch-fom", "stale"), ("quasi", "prefetch-fom", "quasi")):
        st = ProfileSettings(policy=policy, predictor=predictor, tokens=5)
        runs[name] = (st, *generate(ours, prompt, st, hw, dv))
    want = torch.cat(runs["all-resident"][3], 1)
    for name in ("on-demand", "prefetch-fom", "quasi"):
        assert torch.equal(torch.cat(runs[name][3], 1), want), name
    assert all((r.pred_ids[1] >= 0).all() for r in runs["quasi"][2])  # quasi predicts across the dense layer

    st, prefill, records, out = runs["prefetch-fom"]
    trace = build_trace(ours, prompt, st, hw, prefill, records, out, Origin("cpu", True, "test model"))
    back = read_trace(write_trace(trace, tmp_path / "run.npz"))
    tm = back.timings
    assert back.true_ids.shape == (5, 2, 2, 2) and tm["attn_s"].shape == (5, 3) and tm["expert_s"].shape == (5, 2)
    assert (back.pred_ids[:, 0] == -1).all() and (back.pred_ids[:, 1] >= 0).all()  # MoE layer 1 predicted from 0
    parts = tm["attn_s"].sum(1) + tm["expert_s"].sum(1) + tm["stall_s"].sum(1) + tm["other_s"]
    np.testing.assert_allclose(parts, tm["tpot_s"], rtol=1e-6)  # the dense layer's time is in its attn_s
    # The simulator plans the recorded routing with the same planner: per step and MoE layer
    # it copies exactly what the executor copied (copy records name model layers).
    sim = simulate(back, hw, "prefetch-fom", Setting(timing="measured"))
    for kind, want_counts in ((1, sim.plan.demand), (0, sim.plan.prefetch)):
        got = np.zeros_like(want_counts)
        for t, layer, k in zip(tm["copy_token"], tm["copy_layer"], tm["copy_kind"], strict=True):
            if k == kind:
                got[t, s.moe_layers.index(int(layer))] += 1
        np.testing.assert_array_equal(got, want_counts)
    assert sim.plan.prefetch.sum() > 0 and np.isfinite(sim.tpot).all() and (sim.tpot > 0).all()


def test_estimator_is_refused_for_models_with_dense_layers(tmp_path):
    from moesim.executor.runtime import OffloadedDecoder
    from moesim.executor.transport import EmulatedLink

    transformers.Qwen2MoeForCausalLM(_qwen2_config(mlp_only_layers=[0])).save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    with pytest.raises(MoesimError, match="dense layers"):
        OffloadedDecoder(ours, "on-demand", EmulatedLink(1e9, 0), predictor="estimator")
