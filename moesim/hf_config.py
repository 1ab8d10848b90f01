"""Hugging Face ``config.json`` -> :class:`moesim.models.ModelSpec`.

Two readers that give the same spec wherever both work (tests/test_families.py):

- **transformers** (when it and torch are installed): ``AutoConfig`` reads the folder or
  file (``trust_remote_code`` never), ``get_text_config()`` picks the decoder of a
  multimodal wrapper, and a model built on the ``meta`` device (no memory, no weights)
  says which layers really hold experts and how many parameters the model has. Every
  decoder-only MoE family the installed transformers knows is read this way.
- **by hand** (a simulator-only install): the same key rules on the raw JSON, for the
  families in :data:`HAND_FAMILIES`.

The geometry (layers, experts, attention, layer kinds, linear-attention state, MTP) comes
from the config's keys in both; the meta model checks it: a routed expert whose parameter
count differs from the geometry's is refused in one line, and parameters the geometry does
not name (a family's extra gates, per-layer embeddings, ...) are counted in
``ModelSpec.extra_params`` so ``total_params`` equals the meta model's count exactly.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

from moesim.artefacts import exact_bytes, formats_from_config
from moesim.errors import MoesimError
from moesim.inputs import kind_of
from moesim.spec import (
    HF_FAMILIES,
    LINEAR_MIXERS,
    SIZE_LIMITS,
    Attention,
    LinearAttention,
    ModelSpec,
    _int,
    read_config,
)

#: Families whose keys the hand parser knows (model_type values, after an ``architectures``
#: fallback: Kimi-K2's ``kimi_k2`` is DeepseekV3ForCausalLM).
HAND_FAMILIES = HF_FAMILIES
#: Architectures (config ``architectures[0]``) whose family a custom ``model_type`` stands for.
ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "Glm4MoeForCausalLM": "glm4_moe",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Llama4ForConditionalGeneration": "llama4",
                 "Llama4ForCausalLM": "llama4_text", "MiniMaxM2ForCausalLM": "minimax_m2",
                 "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe", "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                 "Dots1ForCausalLM": "dots1", "PhiMoEForCausalLM": "phimoe", "DbrxForCausalLM": "dbrx"}
#: Keys that name an expert count, in the spellings of the families transformers knows.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: Keys that count multi-token-prediction modules (0 or absent: none).
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")
TOPK_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk", "num_experts_per_token", "top_k_experts")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
               "linear_attention": "linear", "mamba": "linear", "full": "full", "sliding": "sliding",
               "chunked": "chunked", "linear": "linear", "attention": "full",
               # DeepSeek-V3.2's sparse attention: its lightning indexer picks the keys it reads, but the cache
               # holds every token's (modelled as full attention; the indexer's own keys are not counted)
               "indexed_attention": "full"}
#: Families with q/k norms: per head (Qwen3 style) or over all heads (OLMoE, MiniMax-M2).
QK_NORM_HEAD = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "dots1", "hunyuan_v1_moe")
QK_NORM_FULL = ("olmoe", "minimax_m2")
QWEN_NEXT = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def _first_key(cfg: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if cfg.get(k) is not None), None)


def _scalar(cfg: dict[str, Any], path: Path, key: str) -> None:
    """Hunyuan writes some sizes as one-per-layer lists: a list of equal values is that value."""
    v = cfg.get(key)
    if isinstance(v, list) and v:
        if len(set(map(str, v))) != 1:
            raise MoesimError(f"{path}: {key} differs between layers ({v[:4]}...); per-layer expert sizes are not modelled")
        cfg[key] = v[0]


def split_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the decoder's config keys, model_type). A multimodal wrapper (Llama-4, Qwen3.5)
    keeps the decoder under ``text_config``; its ``quantization_config`` and dtype stay at
    the top and apply to it. DBRX's ``attn_config`` / ``ffn_config`` are flattened to the
    common spellings."""
    cfg = dict(raw)
    text = raw.get("text_config")
    if isinstance(text, dict) and (_first_key(text, EXPERT_KEYS) or "num_hidden_layers" in text):
        cfg = {**{k: v for k, v in raw.items() if k in ("quantization_config", "torch_dtype", "dtype", "_name_or_path",
                                                         "tie_word_embeddings")}, **text}
        cfg.setdefault("model_type", raw.get("model_type"))
    mtype = cfg.get("model_type")
    if mtype == "dbrx":
        attn, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
        cfg.update(num_hidden_layers=cfg.get("n_layers"), hidden_size=cfg.get("d_model"),
                   num_attention_heads=cfg.get("n_heads"), num_key_value_heads=attn.get("kv_n_heads"),
                   num_local_experts=ffn.get("moe_num_experts"), num_experts_per_tok=ffn.get("moe_top_k"),
                   intermediate_size=ffn.get("ffn_hidden_size"))
    return cfg, mtype


def family_of(raw: dict[str, Any]) -> str | None:
    """The family to read a config as: its model_type, or for a custom model_type whose
    ``architectures`` names a known class (Kimi-K2: ``kimi_k2``, DeepseekV3ForCausalLM), that class's."""
    mtype = raw.get("model_type")
    arch = raw.get("architectures") or []
    if mtype not in HAND_FAMILIES and isinstance(arch, list) and arch and arch[0] in ARCHITECTURES:
        return ARCHITECTURES[arch[0]]
    return mtype


# --------------------------------------------------------------------------------------
# The key rules (both readers)
# --------------------------------------------------------------------------------------


def _moe_layers(cfg: dict[str, Any], path: Path, mtype: str, n_layers: int) -> set[int]:
    """Indices of the layers with routed experts, by each family's rule."""
    if mtype in ("llama4", "llama4_text"):
        if isinstance(cfg.get("moe_layers"), list):
            return {int(i) for i in cfg["moe_layers"]}
        step = _int(cfg, path, "interleave_moe_layer_step", default=1)
        return set(range(step - 1, n_layers, step))
    if mtype == "ernie4_5_moe":
        start = _int(cfg, path, "moe_layer_start_index", default=0, minimum=0)
        end = cfg.get("moe_layer_end_index")
        end = n_layers - 1 if end is None or end == -1 else int(end)
        interval = _int(cfg, path, "moe_layer_interval", default=1)
        return {i for i in range(n_layers) if start <= i <= end and (i - start) % interval == 0}
    mlp_types = cfg.get("mlp_layer_types")
    if isinstance(mlp_types, list) and len(mlp_types) == n_layers:  # transformers 5: "dense" / "sparse" per layer
        return {i for i, t in enumerate(mlp_types) if str(t).lower() in ("sparse", "moe")}
    if mtype == "jamba":
        period = _int(cfg, path, "expert_layer_period", default=2)
        offset = _int(cfg, path, "expert_layer_offset", default=1, minimum=0)
        return {i for i in range(n_layers) if i % period == offset}
    dense: set[int] = set(range(_int(cfg, path, "first_k_dense_replace", "num_dense_layers", default=0, minimum=0)))
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise MoesimError(f"{path}: mlp_only_layers must be a list of layer indices")
    dense |= set(only)
    step = _int(cfg, path, "decoder_sparse_step", default=1)
    freq = _int(cfg, path, "moe_layer_freq", default=1)
    # Qwen: layer i is sparse when (i + 1) % decoder_sparse_step == 0; DeepSeek/GLM: when
    # i >= first_k_dense_replace and i % moe_layer_freq == 0.
    dense |= {i for i in range(n_layers) if (i + 1) % step != 0 or i % freq != 0}
    return set(range(n_layers)) - dense


def _layer_types(cfg: dict[str, Any], path: Path, mtype: str, n_layers: int) -> tuple[str, ...]:
    """Per-layer kinds from ``layer_types`` or the family's own keys; () when all are full."""
    raw = cfg.get("layer_types")
    if isinstance(raw, list) and raw:
        if len(raw) != n_layers:
            raise MoesimError(f"{path}: layer_types has {len(raw)} entries for {n_layers} layers")
        unknown = sorted({str(t) for t in raw} - set(LAYER_TYPES))
        if unknown:
            raise MoesimError(f"{path}: layer type {unknown[0]!r} is not modelled (known: {', '.join(LAYER_TYPES)})")
        kinds = tuple(LAYER_TYPES[t] for t in raw)
    elif mtype in QWEN_NEXT:
        every = _int(cfg, path, "full_attention_interval", default=4)
        kinds = tuple("full" if (i + 1) % every == 0 else "linear" for i in range(n_layers))
    elif mtype in ("llama4", "llama4_text"):
        if isinstance(cfg.get("no_rope_layers"), list) and cfg["no_rope_layers"]:
            rope = [bool(x) for x in cfg["no_rope_layers"]]
        else:
            every = _int(cfg, path, "no_rope_layer_interval", default=4)
            rope = [(i + 1) % every != 0 for i in range(n_layers)]
        chunked = bool(cfg.get("attention_chunk_size"))
        kinds = tuple("chunked" if r and chunked else "full" for r in rope)
    elif mtype == "gpt_oss":
        kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    elif mtype == "jamba":
        period = _int(cfg, path, "attn_layer_period", default=8)
        offset = _int(cfg, path, "attn_layer_offset", default=4, minimum=0)
        kinds = tuple("full" if i % period == offset else "linear" for i in range(n_layers))
    elif mtype == "minimax" and isinstance(cfg.get("attn_type_list"), list):
        kinds = tuple("full" if t else "linear" for t in cfg["attn_type_list"])
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", mtype in ("mixtral", "phimoe")):
        first = _int(cfg, path, "max_window_layers", default=n_layers, minimum=0) if mtype.startswith("qwen") else 0
        kinds = tuple("sliding" if i >= first else "full" for i in range(n_layers))
    else:
        kinds = ()
    return () if all(k == "full" for k in kinds) else kinds


def _linear(cfg: dict[str, Any], path: Path, mtype: str, hidden: int) -> LinearAttention | None:
    """The linear layers' geometry, read by the mixer kind whose model types hold ``mtype``."""
    mixer = next((m for m in LINEAR_MIXERS.values() if mtype in m.model_types), None)
    return mixer.from_config(cfg, path, hidden) if mixer is not None else None


def geometry(cfg: dict[str, Any], path: Path, mtype: str, formats: tuple[str, str, str, str],
             name: str) -> ModelSpec:
    """The spec from a decoder config's keys (raw JSON or transformers' normalised dict)."""
    cfg = dict(cfg)
    for key in ("moe_topk", "moe_intermediate_size", "num_shared_expert", "num_experts"):
        _scalar(cfg, path, key)
    n_experts = _int(cfg, path, *EXPERT_KEYS)
    n_layers = _int(cfg, path, "num_hidden_layers")
    hidden = _int(cfg, path, "hidden_size")
    heads = _int(cfg, path, "num_attention_heads")
    vocab = _int(cfg, path, "vocab_size")
    top_k = _int(cfg, path, *TOPK_KEYS)
    has_moe_inter = cfg.get("moe_intermediate_size") is not None
    expert_inter = _int(cfg, path, "moe_intermediate_size", "intermediate_size")
    if mtype in ("llama4", "llama4_text"):
        dense_inter = _int(cfg, path, "intermediate_size_mlp", default=0, minimum=0)
    else:
        dense_inter = _int(cfg, path, "intermediate_size", default=0, minimum=0) if has_moe_inter else 0

    moe = _moe_layers(cfg, path, mtype, n_layers)
    dense = sorted(set(range(n_layers)) - moe)
    if dense and not dense_inter:
        dense_inter = _int(cfg, path, "intermediate_size", default=expert_inter)

    if cfg.get("kv_lora_rank"):
        attention = Attention(
            "mla", heads, heads, 0,
            q_lora_rank=_int(cfg, path, "q_lora_rank", default=0, minimum=0),
            kv_lora_rank=_int(cfg, path, "kv_lora_rank"),
            qk_nope_head_dim=_int(cfg, path, "qk_nope_head_dim", default=128),
            qk_rope_head_dim=_int(cfg, path, "qk_rope_head_dim", default=64),
            v_head_dim=_int(cfg, path, "v_head_dim", default=128),
        )
    else:
        kv_heads = _int(cfg, path, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise MoesimError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if cfg.get("head_dim") is None and hidden % heads:
            raise MoesimError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                              "give head_dim")
        bias_default = mtype in ("gpt_oss", "qwen2_moe")
        bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", cfg.get("use_bias", bias_default))))
        attention = Attention(
            "gqa", heads, kv_heads, _int(cfg, path, "head_dim", default=hidden // heads),
            bias=bias, o_bias=bias and mtype in ("gpt_oss", "phimoe", "granitemoe", "granitemoeshared"),
            qk_norm=mtype in QK_NORM_HEAD + QK_NORM_FULL or bool(cfg.get("use_qk_norm", False)) and
            mtype not in ("llama4", "llama4_text"),  # Llama-4's qk norm is a weightless L2 norm
            qk_norm_full=mtype in QK_NORM_FULL, q_gate=mtype in QWEN_NEXT and cfg.get("attn_output_gate", True),
            sinks=mtype == "gpt_oss",
        )

    kinds = _layer_types(cfg, path, mtype, n_layers)
    window = _int(cfg, path, "sliding_window", default=0, minimum=0) if "sliding" in kinds else 0
    chunk = _int(cfg, path, "attention_chunk_size", default=0, minimum=0) if "chunked" in kinds else 0

    # Shared experts: DeepSeek/GLM n_shared_experts of moe_intermediate_size; Qwen2-MoE /
    # Qwen3-Next one of shared_expert_intermediate_size; Llama-4 always one of intermediate_size.
    shared_inter = _int(cfg, path, "shared_expert_intermediate_size", "shared_intermediate_size", default=0, minimum=0)
    n_shared = _int(cfg, path, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert",
                    default=0, minimum=0)
    if mtype in ("llama4", "llama4_text"):
        n_shared = 1
    elif mtype == "hunyuan_v1_moe":
        n_shared = n_shared if cfg.get("use_mixed_mlp_moe") else 0
    elif shared_inter and not n_shared:
        n_shared = 1
    if n_shared and shared_inter and mtype in ("deepseek_v2", "deepseek_v3", "glm4_moe", "dots1", "ernie4_5_moe"):
        shared_inter = 0  # these size each shared expert by moe_intermediate_size
    if mtype == "ernie4_5_moe" and n_shared:
        shared_inter = expert_inter * n_shared  # ERNIE fuses its shared experts into one MLP
        n_shared = 1

    expert_dtype, dense_dtype, embed_dtype, head_dtype = formats
    mtp = _int(cfg, path, *MTP_KEYS, default=0, minimum=0)
    if mtype == "minimax_m2" and not cfg.get("use_mtp", False):
        mtp = 0
    return ModelSpec(
        name=name, n_layers=n_layers, n_experts=n_experts, top_k=top_k, hidden=hidden,
        expert_inter=expert_inter, vocab=vocab, attention=attention,
        dense_layers=tuple(dense), dense_inter=dense_inter, n_shared=n_shared,
        shared_inter=shared_inter if n_shared else 0,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype, embed_dtype=embed_dtype, head_dtype=head_dtype,
        expert_bias=mtype == "gpt_oss",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", mtype not in ("olmoe", "qwen2_moe", "deepseek_v2"))),
        family=mtype, source=str(path),
        layer_types=kinds, sliding_window=window, attention_chunk=chunk,
        linear=_linear(cfg, path, mtype, hidden) if "linear" in kinds else None,
        n_mtp_layers=mtp,
        router_bias=mtype in ("gpt_oss", "minimax_m2", "dots1", "glm4_moe", "glm4_moe_lite", "ernie4_5_moe")
        or (mtype == "deepseek_v3" and cfg.get("topk_method", "noaux_tc") == "noaux_tc"),
        shared_gate=mtype in ("qwen2_moe", *QWEN_NEXT),
        norm_bias=mtype == "phimoe", lm_head_bias=bool(cfg.get("lm_head_bias", False)),
    )


def _name(raw: dict[str, Any], path: Path, mtype: str) -> str:
    return str(raw.get("_name_or_path") or path.parent.name or mtype)


def hand_spec(raw: dict[str, Any], path: Path) -> ModelSpec:
    """The spec from the raw JSON alone (no transformers)."""
    cfg, _ = split_config(raw)
    mtype = family_of(raw)
    if cfg.get("model_type") in HAND_FAMILIES:
        mtype = cfg["model_type"]  # a wrapper's decoder: llama4_text, qwen3_5_moe_text
    elif mtype in HAND_FAMILIES:
        cfg["model_type"] = mtype
    if mtype not in HAND_FAMILIES:
        what = ("has no expert count; not an MoE config" if _first_key(cfg, EXPERT_KEYS) is None
                else "is not a family this reader knows without transformers (pip install \"moesim[record]\")")
        raise MoesimError(f"{path}: model_type {mtype!r} {what} (supported: {', '.join(HAND_FAMILIES)})")
    if _first_key(cfg, EXPERT_KEYS) is None:
        raise MoesimError(f"{path}: model_type {mtype!r} has no expert count; not an MoE config")
    return geometry(cfg, path, mtype, formats_from_config(raw, path), _name(raw, path, mtype))


# --------------------------------------------------------------------------------------
# Through transformers
# --------------------------------------------------------------------------------------


def transformers_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "torch"))


@contextlib.contextmanager
def _quiet():
    """transformers' config validation notes go to its logger and warnings: not our stdout."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def load_config(path: Path, raw: dict[str, Any]):
    """transformers' config object for ``raw``, or None when transformers does not know the
    family (then the hand parser decides). A custom ``model_type`` with a known
    ``architectures`` class is read as that class's family (Kimi-K2)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    mtype = raw.get("model_type")
    with _quiet():
        if mtype in CONFIG_MAPPING:
            if path.name == "config.json" and kind_of(path) == "file":  # a pipe was read once: its bytes are raw
                return AutoConfig.from_pretrained(str(path.parent), trust_remote_code=False, local_files_only=True)
            return CONFIG_MAPPING[mtype].from_dict(raw)
        fam = family_of(raw)
        if fam in CONFIG_MAPPING:
            return CONFIG_MAPPING[fam].from_dict({**raw, "model_type": fam})
    return None


def _decoder_layers(model):
    """The ModuleList of decoder layers (the longest one directly under the backbone)."""
    import torch

    best = None
    for _, mod in model.named_modules():
        if (isinstance(mod, torch.nn.ModuleList) and len(mod) and (best is None or len(mod) > len(best))
                and any(sum(1 for _ in m.parameters()) for m in mod)):
            best = mod
    return best


def meta_model(cfg):
    """transformers' causal-LM model for ``cfg`` on the meta device: its modules and
    parameter shapes, no memory (torch imported here only: the simulator never imports it)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _quiet(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def stored_params(model) -> int:
    """Parameters plus persistent buffers (what a checkpoint stores; tied tensors once)."""
    keys = set(model.state_dict().keys())
    n = sum(p.numel() for p in model.parameters())
    return n + sum(b.numel() for name, b in model.named_buffers() if name in keys)


def moe_blocks(model, n_layers: int) -> dict[int, Any]:
    """Layer index -> the MoE block (the module holding ``experts``) of every layer that has one."""
    layers = _decoder_layers(model)
    if layers is None or len(layers) != n_layers:
        raise MoesimError(f"{type(model).__name__}: no stack of {n_layers} decoder layers found")
    out = {}
    for i, layer in enumerate(layers):
        for _, mod in layer.named_modules():
            experts = getattr(mod, "experts", None)
            if experts is not None and hasattr(experts, "parameters") and sum(p.numel() for p in experts.parameters()):
                out[i] = mod
                break
    return out


def transformers_spec(path: Path, raw: dict[str, Any]) -> ModelSpec | None:
    """The spec through transformers; None when transformers does not know the family."""
    cfg = load_config(path, raw)
    if cfg is None:
        return None
    try:
        text = cfg.get_text_config(decoder=True)
    except ValueError:
        text = cfg
    d = text.to_dict()
    mtype = family_of({**d, "model_type": d.get("model_type") or raw.get("model_type")})
    top, _ = split_config(raw)
    for k in ("quantization_config", "torch_dtype", "dtype"):
        if k in top and k not in d:
            d[k] = top[k]
    if _first_key(d, EXPERT_KEYS) is None and mtype != "dbrx":
        model = meta_model(cfg)
        raise MoesimError(f"{path}: model_type {mtype!r} ({type(model).__name__}) has no expert count; not an MoE "
                          "config")
    if mtype == "dbrx":
        d, _ = split_config({**d, "model_type": "dbrx"})
    spec = geometry(d, path, mtype, formats_from_config(raw, path), _name(raw, path, mtype or "model"))
    model = meta_model(cfg)
    blocks = moe_blocks(model, spec.n_layers)
    if not blocks:
        raise MoesimError(f"{path}: model_type {mtype!r} ({type(model).__name__}) builds no layer with routed "
                          "experts; not an MoE model")
    if tuple(sorted(blocks)) != spec.moe_layers:
        raise MoesimError(f"{path}: transformers builds experts in layers {sorted(blocks)[:8]}..., the config's keys "
                          f"say {list(spec.moe_layers)[:8]}...: the {mtype} layer rule is not modelled")
    experts = next(iter(blocks.values())).experts
    per_expert, rem = divmod(sum(p.numel() for p in experts.parameters()), spec.n_experts)
    if rem or per_expert != spec.expert_params:
        raise MoesimError(f"{path}: a routed {mtype} expert has {per_expert} parameters, the geometry "
                          f"{spec.expert_params} (hidden {spec.hidden}, expert_inter {spec.expert_inter}): "
                          "this expert layout is not modelled")
    total = stored_params(model)
    extra = total - spec.total_params
    if extra < 0:
        raise MoesimError(f"{path}: the {mtype} geometry counts {-extra} parameters more than transformers builds; "
                          "this family's layout is not modelled")
    from dataclasses import replace

    return replace(spec, extra_params=extra) if extra else spec


#: The config's counts checked against :data:`moesim.models.SIZE_LIMITS` before transformers
#: builds anything from them (it builds every layer: 10^8 layers ran a minute into out of memory).
COUNT_LIMITS = {"num_hidden_layers": "n_layers", **dict.fromkeys(MTP_KEYS, "n_layers"), "hidden_size": "hidden",
                "vocab_size": "vocab", **dict.fromkeys(EXPERT_KEYS, "n_experts")}


#: Widths checked as the counts are (when one number; per-layer lists are the family's).
WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _check_counts(raw: dict[str, Any], path: Path) -> None:
    """The counts a config gives, checked before transformers is imported (seconds) and builds
    from them: whole numbers, at least 1 (the MTP counts 0), within :data:`COUNT_LIMITS`, no
    more experts routed than there are."""
    cfg, _ = split_config(raw)
    for key in (*COUNT_LIMITS, *TOPK_KEYS, *WIDTH_KEYS):
        v = cfg.get(key)
        if v is None or (key in WIDTH_KEYS and isinstance(v, list)):  # a per-layer list is read by the family's rule
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise MoesimError(f"{path}: {key} must be an integer, got {v!r}")
        least = 0 if key in MTP_KEYS else 1  # a model may have no MTP module
        if v < least:
            raise MoesimError(f"{path}: {key} must be >= {least}, got {v}")
        if key in COUNT_LIMITS and v > SIZE_LIMITS[COUNT_LIMITS[key]]:
            raise MoesimError(f"{path}: {key} {v} is beyond any model's ({SIZE_LIMITS[COUNT_LIMITS[key]]:,} at most)")
    experts, k = _first_key(cfg, EXPERT_KEYS), _first_key(cfg, TOPK_KEYS)
    if experts and k and cfg[k] > cfg[experts]:
        raise MoesimError(f"{path}: {k} {cfg[k]} routes more experts than {experts} {cfg[experts]}")
    formats_from_config(raw, path)  # the dtype and quantisation too: one line, not after the import


def spec_from_config(path: str | Path) -> ModelSpec:
    """A model directory's or file's ``config.json`` as a spec (transformers when installed,
    else the hand parser); then the artefact's exact bytes when the folder has them."""
    path = Path(path)
    raw = read_config(path)
    _check_counts(raw, path)
    spec = None
    if transformers_available():
        try:
            spec = transformers_spec(path, raw)
        except MoesimError:
            raise
        except Exception as e:  # transformers' own config validation or model build failed
            if family_of(raw) in HAND_FAMILIES:
                spec = hand_spec(raw, path)  # its one-line error names the field; else its spec, with a note
                warnings.warn(f"{path}: transformers could not build this config ({type(e).__name__}); "
                              "read by moesim's own key rules", UserWarning, stacklevel=2)
            else:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise MoesimError(f"{path}: transformers cannot build model_type {raw.get('model_type')!r} "
                                  f"({type(e).__name__}: {msg[:160]})") from None
    if spec is None:
        spec = hand_spec(raw, path)

    return exact_bytes(spec, path.parent)
