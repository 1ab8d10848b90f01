"""Every decoder-only MoE family the installed transformers has, as a tiny config (tests only).

The families are enumerated from transformers' own auto mappings (``AutoModelForCausalLM``):
a family is MoE when its default model, built on the meta device with a shrunk config, has
a layer holding ``experts``. Each config is the family's defaults with every size shrunk to
a few dozen (so a random checkpoint of it saves and decodes in about a second).
"""

from __future__ import annotations

import contextlib
import io
import warnings

#: Sizes set wherever a family's config has the key.
SHRINK = {
    "hidden_size": 64, "d_model": 64, "intermediate_size": 64, "intermediate_size_mlp": 96,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "attention_head_dim": 16, "vocab_size": 256, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
    "moe_num_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2, "moe_k": 2, "moe_topk": 2,
    "num_experts_per_token": 2, "top_k_experts": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 24,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_n_heads": 4, "mamba_head_dim": 32, "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "ssm_state_size": 8, "sliding_window": 8, "attention_chunk_size": 8, "max_window_layers": 2,
    "max_position_embeddings": 512, "num_nextn_predict_layers": 0, "mtp_num_hidden_layers": 0,
    "first_k_dense_replace": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 3, "expert_layer_offset": 1,
    "expert_layer_period": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "full_attention_interval": 2,
    "num_hidden_layers": 4, "n_layers": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


@contextlib.contextmanager
def quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _shrunk(cls, defaults: dict):
    kw = {k: v for k, v in SHRINK.items() if k in defaults}
    if "q_lora_rank" in kw and defaults.get("q_lora_rank") is None:
        kw.pop("q_lora_rank")
    n_full = defaults.get("num_hidden_layers") or defaults.get("n_layers")
    n = kw.get("num_hidden_layers", kw.get("n_layers", 4))
    for k, v in defaults.items():  # per-layer lists and dicts: cut to the first layers
        if isinstance(v, list) and len(v) == n_full and k != "layer_types":
            kw[k] = v[:n]
        elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
            kw[k] = {i: c for i, c in v.items() if int(i) < n}
    lt = defaults.get("layer_types")
    if isinstance(lt, list) and lt:
        kinds = list(dict.fromkeys(lt))  # every kind the family has, within the first layers
        kw["layer_types"] = [kinds[i % len(kinds)] for i in range(n)] if len(kinds) > 1 else [lt[0]] * n
    for k in ("mlp_only_layers", "moe_layers", "no_rope_layers", "attn_type_list"):
        if isinstance(defaults.get(k), list) and defaults[k]:
            kw[k] = None if k != "mlp_only_layers" else []
    if defaults.get("kv_lora_rank"):
        kw["num_key_value_heads"] = SHRINK["num_attention_heads"]  # MLA: one latent for every head
        if "head_dim" in defaults:
            kw["head_dim"] = SHRINK["qk_rope_head_dim"]  # DeepSeek-V3's rotary size
    if defaults.get("model_type") == "granitemoehybrid":
        kw["layer_types"] = ["mamba", "attention"] * (n // 2)  # its defaults are all Mamba-2
    if defaults.get("model_type") == "zaya":
        kw["num_experts_per_tok"] = 1  # ZAYA routes top-1 only
    return cls(**{**{k: v for k, v in defaults.items() if k not in ("model_type", "transformers_version")}, **kw})


def families() -> dict[str, object]:
    """model_type -> shrunk (text) config of every decoder-only MoE family."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from moesim.hf_config import EXPERT_KEYS, moe_blocks

    out: dict[str, object] = {}
    for mtype in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with quiet():
            try:
                full = CONFIG_MAPPING[mtype]()
                text = full.get_text_config(decoder=True)
            except Exception:  # noqa: BLE001 - a family whose defaults do not even build is not MoE-detectable
                continue
        if text.model_type in out or text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        keys = text.to_dict()
        if mtype != "dbrx" and not any(k in keys for k in EXPERT_KEYS):
            continue  # no expert count: a dense family
        with quiet():
            try:
                cfg = _shrunk(type(text), text.to_dict())
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(cfg)
                n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layers", None)
                moe = moe_blocks(model, n)
            except Exception as e:  # noqa: BLE001
                out[text.model_type] = e
                continue
        if moe:
            out[text.model_type] = cfg
    return out
