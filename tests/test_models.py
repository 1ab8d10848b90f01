import json

import pytest

from moesim.errors import MoesimError
from moesim.models import CATALOGUE, ModelSpec, from_hf_config, get_model, matrix_bytes


def test_catalogue_has_every_reference_model():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.7-flash",
                 "deepseek-v3", "mixtral-8x7b", "olmoe-1b-7b", "deepseek-v2-lite", "tiny"):
        assert name in CATALOGUE


def test_qwen3_30b_byte_accounting_matches_models_md():
    m = get_model("qwen3-30b-a3b")
    assert m.expert_bytes == 3 * 2048 * 768 * 2 == 9_437_184  # 9.44 MB
    assert m.all_expert_bytes == 128 * 48 * 9_437_184  # 58.0 GB
    assert round(m.all_expert_bytes / 1e9, 1) == 58.0
    assert round(m.all_expert_bytes / 2**30) == 54


def test_deepseek_v3_fp8_expert_has_block_scales():
    m = get_model("deepseek-v3")
    weights = 3 * 7168 * 2048
    assert weights == 44_040_192
    blocks = 3 * (7168 // 128) * (2048 // 128)  # 128x128 blocks, one fp32 scale each
    assert m.expert_bytes == weights + 4 * blocks
    assert m.moe_layers[0] == 3 and m.n_moe_layers == 58


def test_mxfp4_is_4_25_bits_a_weight_plus_biases():
    m = get_model("gpt-oss-120b")
    weights = 3 * 2880 * 2880
    assert matrix_bytes(2880, 2880, "mxfp4") * 8 / (2880 * 2880) == pytest.approx(4.25)
    assert m.expert_bytes == weights * 4.25 / 8 + 2 * (2 * 2880 + 2880)
    assert m.n_layers == 36 and m.n_experts == 128  # not gpt-oss-20b's 24 x 32


def test_derived_figures_add_up():
    m = get_model("glm-4.7-flash")
    assert m.n_moe_layers == 46 and m.dense_layers == (0,)
    per_token = m.non_expert_bytes + m.n_moe_layers * m.top_k * m.expert_bytes
    assert m.bytes_per_token() == per_token
    assert m.bytes_per_token(context=100) == per_token + 100 * m.n_layers * m.kv_bytes_per_token_layer


def test_spec_round_trips_through_dict():
    m = get_model("deepseek-v2-lite")
    assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_unknown_model_is_a_clear_error():
    with pytest.raises(MoesimError, match="unknown model 'nope'"):
        get_model("nope")


def test_impossible_geometry_is_rejected():
    with pytest.raises(MoesimError, match="top_k 9 exceeds n_experts 8"):
        ModelSpec("bad", n_layers=2, n_experts=8, top_k=9, hidden=8, expert_inter=8, vocab=8)


HF_CONFIGS = {
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                   "hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 6144,
                   "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}, "qwen3-30b-a3b"),
    "mixtral": ({"model_type": "mixtral", "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 32000}, "mixtral-8x7b"),
    "olmoe": ({"model_type": "olmoe", "num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8,
               "hidden_size": 2048, "intermediate_size": 1024, "num_attention_heads": 16,
               "num_key_value_heads": 16, "vocab_size": 50304, "norm_topk_prob": False}, "olmoe-1b-7b"),
    "deepseek_v3": ({"model_type": "deepseek_v3", "num_hidden_layers": 61, "n_routed_experts": 256,
                     "num_experts_per_tok": 8, "n_shared_experts": 1, "hidden_size": 7168,
                     "moe_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 3,
                     "moe_layer_freq": 1, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                     "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
                     "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "deepseek-v3"),
    "deepseek_v2": ({"model_type": "deepseek_v2", "num_hidden_layers": 27, "n_routed_experts": 64,
                     "num_experts_per_tok": 6, "n_shared_experts": 2, "hidden_size": 2048,
                     "moe_intermediate_size": 1408, "intermediate_size": 10944, "first_k_dense_replace": 1,
                     "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400}, "deepseek-v2-lite"),
    "gpt_oss": ({"model_type": "gpt_oss", "num_hidden_layers": 36, "num_local_experts": 128,
                 "experts_per_token": 4, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
                 "quantization_config": {"quant_method": "mxfp4"}}, "gpt-oss-120b"),
    "glm4_moe_lite": ({"model_type": "glm4_moe_lite", "num_hidden_layers": 47, "n_routed_experts": 64,
                       "num_experts_per_tok": 4, "n_shared_experts": 1, "hidden_size": 2048,
                       "moe_intermediate_size": 1536, "intermediate_size": 10240, "first_k_dense_replace": 1,
                       "num_attention_heads": 20, "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
                       "qk_rope_head_dim": 64, "v_head_dim": 256, "vocab_size": 154880}, "glm-4.7-flash"),
}


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_hf_config_gives_the_catalogue_geometry(tmp_path, family):
    cfg, name = HF_CONFIGS[family]
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    spec = get_model(str(d))  # a model directory works wherever a name does
    ref = get_model(name)
    for field in ("n_layers", "n_experts", "top_k", "hidden", "expert_inter", "dense_layers", "n_shared",
                  "expert_dtype", "expert_bytes", "vocab"):
        assert getattr(spec, field) == getattr(ref, field), field
    assert spec.attention.kind == ref.attention.kind


def test_hf_config_errors_are_one_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    with pytest.raises(MoesimError, match="not an MoE config"):
        from_hf_config(p)
    p.write_text("{not json")
    with pytest.raises(MoesimError, match="cannot read"):
        from_hf_config(p)


def test_with_layers_keeps_geometry():
    m = get_model("deepseek-v3").with_layers(5)
    assert m.n_layers == 5 and m.dense_layers == (0, 1, 2) and m.n_moe_layers == 2
    with pytest.raises(MoesimError):
        get_model("tiny").with_layers(0)
