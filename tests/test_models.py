import json
from dataclasses import replace
from pathlib import Path

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


def test_the_shipped_checkpoints_are_models_by_name_in_every_command(tmp_path, monkeypatch):
    """``moesim record moe-stdlib`` takes the shipped checkpoint by name; so do whatif,
    synth, import and the rest (get_model), reading its config.json, unless a local folder
    of that name exists (a path wins)."""
    from moesim.models import shipped_checkpoint

    spec = get_model("moe-stdlib")
    assert (spec.name, spec.n_experts, spec.n_moe_layers) == ("moe-stdlib", 32, 4)
    assert shipped_checkpoint("moe-stdlib-draft").is_dir() and shipped_checkpoint("qwen3-30b-a3b") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "moe-stdlib").mkdir()
    with pytest.raises(MoesimError, match="has no config.json"):
        get_model("moe-stdlib")


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


def test_nan_or_infinity_in_a_config_is_one_line(tmp_path):
    """JSON has no NaN: Python's json reads one, and a NaN rope_theta was recorded from."""
    from moesim.models import read_config

    for word in ("NaN", "Infinity", "-Infinity"):
        p = tmp_path / "config.json"
        p.write_text('{"model_type": "qwen3_moe", "rope_theta": ' + word + "}")
        with pytest.raises(MoesimError, match=f"not valid JSON .*{word} is not a JSON number"):
            read_config(p)


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
        norm = 2 * spec.hidden * (2 if spec.norm_bias else 1)
        bias = 2 * spec.vocab if spec.lm_head_bias else 0
        assert spec.lm_head_bytes == 2 * spec.vocab * spec.hidden + norm + bias
        assert spec.embedding_bytes == table + spec.lm_head_bytes == spec.input_embedding_bytes + spec.lm_head_bytes
        assert spec.embedding_row_bytes == 2 * spec.hidden


CONFIGS = Path(__file__).parent / "data" / "configs"
#: catalogue name -> its config.json fixture (the entry is that config's geometry).
NEW_ENTRIES = {"qwen3.5-35b-a3b": "Qwen3.5-35B-A3B", "qwen3-next-80b-a3b": "Qwen3-Next-80B-A3B-Instruct",
               "qwen3-coder-480b-a35b": "Qwen3-Coder-480B-A35B-Instruct", "kimi-k2": "Kimi-K2-Instruct",
               "deepseek-v3.1": "DeepSeek-V3.1", "glm-4.5": "GLM-4.5", "glm-4.5-air": "GLM-4.5-Air",
               "llama-4-scout-17b-16e": "Llama-4-Scout-17B-16E-Instruct",
               "llama-4-maverick-17b-128e": "Llama-4-Maverick-17B-128E-Instruct", "mixtral-8x22b": "Mixtral-8x22B-v0.1",
               "phi-3.5-moe": "Phi-3.5-MoE-instruct", "ernie-4.5-21b-a3b": "ERNIE-4.5-21B-A3B-PT",
               "minimax-m2": "MiniMax-M2", "dots-llm1": "dots.llm1.inst", "hunyuan-a13b": "Hunyuan-A13B-Instruct",
               "jamba-1.5-mini": "AI21-Jamba-1.5-Mini", "dbrx": "dbrx-instruct"}


@pytest.mark.parametrize("name", sorted(NEW_ENTRIES))
def test_new_catalogue_entries_are_their_configs(name):
    from moesim.hf_config import hand_spec
    from moesim.models import read_config

    path = CONFIGS / NEW_ENTRIES[name] / "config.json"
    spec = CATALOGUE[name]
    assert replace(hand_spec(read_config(path), path), name=name, source=spec.source) == spec
    assert spec.source and "config.json" in spec.source


def test_new_fields_round_trip_and_old_headers_load():
    for name in ("qwen3-next-80b-a3b", "llama-4-scout-17b-16e", "gpt-oss-120b", "jamba-1.5-mini"):
        m = get_model(name)
        assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    old = {k: v for k, v in get_model("deepseek-v2-lite").to_dict().items() if k in OLD_FIELDS}
    old["attention"] = {k: v for k, v in old["attention"].items() if k not in ("q_gate", "qk_norm_full", "o_bias", "sinks")}
    assert ModelSpec.from_dict(old) == get_model("deepseek-v2-lite")


OLD_FIELDS = ("name", "n_layers", "n_experts", "top_k", "hidden", "expert_inter", "vocab", "attention", "dense_layers",
              "dense_inter", "n_shared", "shared_inter", "expert_dtype", "dense_dtype", "expert_bias", "tie_embeddings",
              "norm_topk_prob", "family", "source")


def test_layer_kinds_kv_and_state():
    import numpy as np

    nxt, scout, oss = get_model("qwen3-next-80b-a3b"), get_model("llama-4-scout-17b-16e"), get_model("gpt-oss-20b")
    ctx = np.array([0, 100, 8191, 8192, 20000])
    np.testing.assert_array_equal(scout.kv_tokens(0, ctx), ctx % 8192)
    np.testing.assert_array_equal(scout.kv_tokens(3, ctx), ctx)
    np.testing.assert_array_equal(oss.kv_tokens(0, ctx), np.minimum(ctx, 127))
    np.testing.assert_array_equal(nxt.kv_tokens(0, ctx), 0)
    assert nxt.layer_kind(0) == "linear" and nxt.kv_bytes_per_token(0) == 0 and nxt.state_bytes(3) == 0
    assert nxt.layer_attention_bytes(3) == nxt.attention_bytes and nxt.layer_attention_bytes(0) == nxt.linear_attention_bytes
    assert nxt.layer_attention_flops(3, 1000) == nxt.attention_flops(1000)
    np.testing.assert_array_equal(nxt.layer_attention_flops(0, ctx), nxt.layer_attention_flops(0, 5))
    # A linear layer's bf16 weights are twice its parameters, like every bf16 weight.
    assert nxt.linear_attention_bytes == 2 * nxt.linear_attention_params
    q = get_model("qwen3-30b-a3b")  # all full attention: the new per-layer calls equal the old figures
    assert q.kv_cache_bytes(4, 1000) == 4 * 1000 * q.n_layers * q.kv_bytes_per_token_layer
    assert all(q.layer_attention_flops(i, 77) == q.attention_flops(77) for i in range(q.n_layers))
    assert q.moe_expert_bytes(0) == q.expert_bytes and q.layer_kind(5) == "full"
    assert scout.kv_cache_bytes(1, 20000) == 12 * 20000 * scout.kv_bytes_per_token_layer + 36 * 8191 * scout.kv_bytes_per_token_layer


def test_parameter_counts_match_the_published_ones():
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("deepseek-v3", 671e9, 37e9),
                                ("mixtral-8x7b", 46.7e9, 12.9e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        m = get_model(name)
        assert abs(m.total_params - total) / total < 0.01, name
        # gpt-oss's published active count leaves out the 0.58B embedding table
        assert abs(m.active_params - active) / active < (0.12 if name == "gpt-oss-120b" else 0.04), name
    assert get_model("deepseek-v3.1").n_mtp_layers == 1 and get_model("deepseek-v3.1").mtp_layer_bytes > 0





QWEN30 = json.loads((CONFIGS / "Qwen3-30B-A3B" / "config.json").read_text())


@pytest.mark.parametrize("quant, expert_dtype, expert_bytes", [
    # mlx-lm: uint32-packed 4-bit weights, an fp16 scale and bias per 64 (mlx.nn.QuantizedLinear)
    ({"quantization": {"group_size": 64, "bits": 4}}, "int4-g64-mlx", 2_654_208),
    # GPTQ: qweight [in/8, out] int32, qzeros [in/128, out/8] int32, scales [in/128, out] fp16, g_idx [in] int32
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}},
     "int4-g128-gptq", 2 * (786432 + 6144 + 24576 + 8192) + (786432 + 6144 + 24576 + 3072)),
    # AutoAWQ GEMM: as GPTQ without g_idx
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                              "version": "gemm"}}, "int4-g128-awq", 3 * (786432 + 6144 + 24576)),
    # compressed-tensors pack-quantized, symmetric int4 groups of 128: weight_packed, weight_scale, weight_shape
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                  "group_size": 128}}}}}, "int4-g128-sym", 3 * (786432 + 24576 + 16)),
    # per-channel fp8 (compressed-tensors float-quantized; FBGEMM fp8): 1 byte a weight + an fp32 scale a row
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}},
     "fp8-channel", 3 * 768 * 2048 + 4 * (2 * 768 + 2048)),
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "fp8-channel", 3 * 768 * 2048 + 4 * (2 * 768 + 2048)),
    # bitsandbytes NF4, double quantisation: nibbles, a uint8 absmax per 64, an fp32 per 256 absmax (+1 offset)
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                              "bnb_4bit_use_double_quant": True}}, "nf4-bnb-dq",
     3 * (768 * 2048 // 2 + 768 * 2048 // 64 + 4 * (768 * 2048 // 64 // 256) + 4)),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, "int8-bnb",
     3 * 768 * 2048 + 4 * (2 * 768 + 2048)),
])
def test_repack_formats_are_sized_from_their_layouts(tmp_path, quant, expert_dtype, expert_bytes):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN30, **quant}))
    spec = get_model(str(d))
    assert spec.expert_dtype == expert_dtype and spec.expert_bytes == expert_bytes
    assert spec.expert_bytes < get_model("qwen3-30b-a3b").expert_bytes  # never read as bf16


@pytest.mark.parametrize("quant, message", [
    ({"quantization_config": {"quant_method": "hqq", "nbits": 4}}, "quantisation 'hqq' not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}, "without groups"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 5, "group_size": 128}}, "5 bits"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}},
     "without zero points"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "neither 4-bit nor 8-bit"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "channel"}}}}}, "not sized"),
])
def test_unsized_repacks_are_refused_in_one_line(tmp_path, quant, message):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**QWEN30, **quant}))
    with pytest.raises(MoesimError, match=message) as e:
        from_hf_config(p)
    assert "\n" not in str(e.value)


def _mlx_checkpoint(d: Path, layers: int = 2, drop_layer: int | None = None) -> dict:
    """A tiny mlx-style 4-bit repack: config.json and a safetensors file with the packed
    uint32 weights, fp16 scales and biases of every projection (zeros)."""
    import numpy as np
    from safetensors.numpy import save_file

    h, inter, experts, vocab, g = 128, 64, 4, 256, 64
    cfg = {**TINY_QWEN, "num_hidden_layers": layers, "hidden_size": h, "moe_intermediate_size": inter,
           "num_experts": experts, "vocab_size": vocab, "head_dim": 32, "quantization": {"group_size": g, "bits": 4}}
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))

    def q(name: str, rows: int, cols: int, out: dict):
        out[name + ".weight"] = np.zeros((rows, cols * 4 // 32), np.uint32)
        out[name + ".scales"] = np.zeros((rows, cols // g), np.float16)
        out[name + ".biases"] = np.zeros((rows, cols // g), np.float16)

    t: dict = {}
    q("model.embed_tokens", vocab, h, t)
    q("lm_head", vocab, h, t)
    t["model.norm.weight"] = np.zeros(h, np.float16)
    for i in range(layers):
        if i == drop_layer:
            continue
        b = f"model.layers.{i}."
        for n, rows, cols in (("q_proj", 128, h), ("k_proj", 64, h), ("v_proj", 64, h), ("o_proj", h, 128)):
            q(b + "self_attn." + n, rows, cols, t)
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[b + n + ".weight"] = np.zeros(h, np.float16)
        q(b + "mlp.gate", experts, h, t)
        for e in range(experts):
            q(f"{b}mlp.experts.{e}.gate_proj", inter, h, t)
            q(f"{b}mlp.experts.{e}.up_proj", inter, h, t)
            q(f"{b}mlp.experts.{e}.down_proj", h, inter, t)
    save_file(t, str(d / "model.safetensors"))
    return t


def test_safetensors_headers_give_exact_bytes(tmp_path):
    from moesim.models import matrix_bytes

    tensors = _mlx_checkpoint(tmp_path / "m")
    spec = get_model(str(tmp_path / "m"))
    per_expert = sum(v.nbytes for k, v in tensors.items() if ".experts.0." in k and ".layers.0." in k)
    assert spec.expert_dtype == "int4-g64-mlx" and spec.embed_dtype == spec.head_dtype == "int4-g64-mlx"
    assert [spec.moe_expert_bytes(m) for m in range(2)] == [per_expert] * 2
    assert per_expert == 2 * matrix_bytes(64, 128, "int4-g64-mlx") + matrix_bytes(128, 64, "int4-g64-mlx")
    assert spec.non_expert_bytes + spec.all_expert_bytes == sum(v.nbytes for v in tensors.values())
    # A partial download (a layer's file missing) keeps the formula instead of half the bytes.
    _mlx_checkpoint(tmp_path / "p", drop_layer=1)
    assert get_model(str(tmp_path / "p")).expert_bytes_by_layer == ()
