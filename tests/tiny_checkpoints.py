"""Tiny random Hugging Face checkpoints for the recorder tests (tests only).

No weights can be downloaded, so the tests build their own with ``transformers``: seeded,
with the routers pushed far from ties so that the top-k is unambiguous and a recorded
routing can be compared exactly with one computed independently.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def save_random_checkpoint(cfg, path: Path, n_experts: int = 8) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] == n_experts:
                p.normal_(0, 1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3's sigmoid router: a bias that matters
                b.copy_(torch.linspace(-0.3, 0.3, b.numel()))
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------
# Named tiny geometries of the executable families (gpt-fast's ``transformer_configs``):
# small enough to run in a second, large enough that every family's features act (a
# sliding window shorter than the prompt, clamped gpt-oss activations, group-limited
# sigmoid routing, a leading dense layer, shared experts, both MLA RoPE layouts).
# ---------------------------------------------------------------------------------------

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
_DEEPSEEK_V3 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40,
                    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True)


def tiny_config(name: str):
    """A transformers config of a named tiny geometry (:data:`TINY_FAMILIES`)."""
    t = transformers
    return {
        # Attention sinks, a 4-token window on layers 0 and 2, YaRN (gpt-oss's default), clamped SwiGLU.
        "gpt_oss": lambda: t.GptOssConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                                          head_dim=8, sliding_window=4, swiglu_limit=0.6, eos_token_id=None),
        # MXFP4-able widths (rows of 32): hidden and intermediate multiples of 32.
        "gpt_oss_mxfp4": lambda: t.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                                intermediate_size=32, head_dim=8, sliding_window=4, eos_token_id=None),
        # MLA with query compression and interleaved RoPE pairs, noaux_tc routing in 2 groups, a dense layer.
        "deepseek_v3": lambda: t.DeepseekV3Config(**{**COMMON, **MLA}, **_DEEPSEEK_V3, q_lora_rank=12,
                                                  eos_token_id=None),
        # ... without query compression, RoPE on halves (rope_interleave false), YaRN with mscale_all_dim.
        "deepseek_v3_halves": lambda: t.DeepseekV3Config(
            **{**COMMON, **MLA}, **_DEEPSEEK_V3, q_lora_rank=None, rope_interleave=False, eos_token_id=None,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8}),
        # GLM-4.7-Flash: MLA, dense layers named by mlp_layer_types, noaux_tc routing.
        "glm4_moe_lite": lambda: t.Glm4MoeLiteConfig(**{**COMMON, **MLA}, n_routed_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, intermediate_size=40,
                                                     n_shared_experts=1, q_lora_rank=12, n_group=2, topk_group=1,
                                                     routed_scaling_factor=1.8, eos_token_id=None,
                                                     mlp_layer_types=["dense", "sparse", "sparse"]),
    }[name]()


TINY_FAMILIES = ("gpt_oss", "deepseek_v3", "deepseek_v3_halves", "glm4_moe_lite")


@torch.no_grad()
def randomise(model, std: float = 0.2) -> None:
    """Larger random weights than the default init, so routing is not a tie (and routers'
    selection biases, buffers zero at init, too)."""
    for p in model.parameters():
        p.normal_(0, std)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, std)


def save_tiny(name: str, path: Path, seed: int = 0):
    """The named tiny geometry with seeded random weights, saved with ``save_pretrained``;
    returns the transformers model (eval mode)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    randomise(model)
    model.save_pretrained(path)
    return model
