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


TINY_QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
             "hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 128, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "'bert' .*not an MoE"),
    ({"model_type": "llama"}, "'llama' .*not an MoE"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be >= 1"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_size": 2048.7}, "hidden_size must be an integer"),
    ({"num_experts": "8"}, "num_experts must be an integer"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8' not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, "fp8 block size"),
])
def test_bad_config_fields_are_one_line(tmp_path, change, message):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**TINY_QWEN, **change}))
    with pytest.raises(MoesimError, match=message) as e:
        from_hf_config(p)
    assert "\n" not in str(e.value)


def test_config_dtype_sets_the_bytes(tmp_path):
    p = tmp_path / "config.json"
    specs = {}
    for dtype in ("bfloat16", "float16", "float32"):
        p.write_text(json.dumps({**TINY_QWEN, "torch_dtype": dtype}))
        specs[dtype] = from_hf_config(p)
    assert specs["float32"].expert_dtype == "fp32" and specs["float16"].expert_dtype == "fp16"
    assert specs["float32"].expert_bytes == 2 * specs["bfloat16"].expert_bytes == 2 * specs["float16"].expert_bytes
    assert specs["float32"].attention_bytes > specs["bfloat16"].attention_bytes


def test_binary_config_is_one_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary")
    with pytest.raises(MoesimError, match="not UTF-8") as e:
        from_hf_config(p)
    assert "\n" not in str(e.value)


def test_an_existing_path_wins_over_a_catalogue_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "Qwen3-30B-A3B"  # a local checkout named like the catalogue entry
    d.mkdir()
    with pytest.raises(MoesimError, match="no config.json .*also the catalogue model 'qwen3-30b-a3b'"):
        get_model("Qwen3-30B-A3B")  # never silently replaced by the catalogue entry
    (d / "config.json").write_text(json.dumps(TINY_QWEN))
    with pytest.warns(UserWarning, match="both a local path and the catalogue model"):
        spec = get_model("Qwen3-30B-A3B")
    assert (spec.n_layers, spec.n_experts) == (2, 8)  # the local geometry, not 48 x 128
    assert get_model("qwen3-30b").n_layers == 48  # no such path here: the catalogue


def test_flops_follow_weight_counts_not_bytes():
    bf16 = ModelSpec("d", n_layers=2, n_experts=4, top_k=2, hidden=64, expert_inter=32, vocab=64,
                     dense_layers=(0,), dense_inter=128)
    fp8 = ModelSpec("d8", n_layers=2, n_experts=4, top_k=2, hidden=128, expert_inter=128, vocab=64,
                    dense_layers=(0,), dense_inter=256, dense_dtype="fp8-block128", expert_dtype="fp8-block128")
    # A bf16 dense FFN: FLOPs = 2 x weights (3 x hidden x inter), not 2 x bytes (twice that).
    assert bf16.dense_flops_per_token(0) == 2 * 3 * 64 * 128 == bf16.dense_ffn_bytes
    assert fp8.dense_flops_per_token(0) == 2 * 3 * 128 * 256  # whatever the storage format
    assert bf16.dense_flops_per_token(1) == 2 * 4 * 64  # an MoE layer: its router
    # Attention FLOPs come from the projection weight count too (bf16: bytes / 2 minus norms).
    assert 2 * bf16.attention_weights == bf16.attention_bytes - 2 * 2 * 64


def test_lm_head_bytes_is_the_one_definition():
    for spec in CATALOGUE.values():
        table = 0 if spec.tie_embeddings else 2 * spec.vocab * spec.hidden
        assert spec.lm_head_bytes == 2 * spec.vocab * spec.hidden + 2 * spec.hidden
        assert spec.embedding_bytes == table + spec.lm_head_bytes
