"""The model catalogue, and a model by name or file: the specs every command starts from.

A spec comes from the built-in catalogue (``CATALOGUE``), from a GGUF file
(:mod:`moesim.gguf_file`), from a Hugging Face ``config.json`` (:func:`from_hf_config`) or
from a trace header (:meth:`ModelSpec.from_dict`). What a spec is (its formats, attention
kinds and byte accounting) is :mod:`moesim.spec`; its names are this module's too, the
public ones every caller imports from here.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

from moesim.errors import MoesimError
from moesim.fmt import nearest_hint
from moesim.gguf_file import spec_from_gguf
from moesim.hf_config import spec_from_config
from moesim.inputs import check_input, check_name, kind_of
from moesim.spec import (  # noqa: F401 (re-exported: moesim.models is where callers find them)
    DTYPES,
    GGML_BLOCKS,
    HF_DTYPES,
    HF_FAMILIES,
    INT4_GROUPS,
    INTEGER_DTYPES,
    LAYER_KINDS,
    LINEAR_KINDS,
    REPACK_KINDS,
    SIZE_LIMITS,
    Attention,
    LinearAttention,
    ModelSpec,
    _int,
    matrix_bytes,
    read_config,
)

# ---------------------------------------------------------------------------------------
# Catalogue (values and their sources: each entry's ``source``, and docs/models.md)
# ---------------------------------------------------------------------------------------

def _cycle(pattern: list[str], n: int) -> tuple[str, ...]:
    """Layer kinds repeating ``pattern`` over ``n`` layers (Qwen3-Next: three linear, one full)."""
    return tuple(pattern[i % len(pattern)] for i in range(n))


_QWEN_SRC = "Hugging Face config.json (via axonn-ai/yalis external/config.py); attention geometry secondary"
_DS_SRC = "deepseek-ai/DeepSeek-V3 inference/configs"

CATALOGUE: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            "qwen3-30b-a3b", n_layers=48, n_experts=128, top_k=8, hidden=2048, expert_inter=768,
            vocab=151936, attention=Attention("gqa", 32, 4, 128, qk_norm=True), source=_QWEN_SRC,
        ),
        ModelSpec(
            "qwen3-235b-a22b", n_layers=94, n_experts=128, top_k=8, hidden=4096, expert_inter=1536,
            vocab=151936, attention=Attention("gqa", 64, 4, 128, qk_norm=True), source=_QWEN_SRC,
        ),
        ModelSpec(
            "gpt-oss-20b", n_layers=24, n_experts=32, top_k=4, hidden=2880, expert_inter=2880,
            vocab=201088, attention=Attention("gqa", 64, 8, 64, bias=True, o_bias=True, sinks=True),
            expert_dtype="mxfp4", expert_bias=True, family="gpt_oss", router_bias=True,
            layer_types=_cycle(["sliding", "full"], 24), sliding_window=128,
            source="NVIDIA Megatron-Bridge gpt-oss docs; sliding window 128 on every other layer, o_proj bias, "
                   "attention sinks and router bias from the openai/gpt-oss-20b config.json and transformers' GptOss",
        ),
        ModelSpec(
            "gpt-oss-120b", n_layers=36, n_experts=128, top_k=4, hidden=2880, expert_inter=2880,
            vocab=201088, attention=Attention("gqa", 64, 8, 64, bias=True, o_bias=True, sinks=True),
            expert_dtype="mxfp4", expert_bias=True, family="gpt_oss", router_bias=True,
            layer_types=_cycle(["sliding", "full"], 36), sliding_window=128,
            source="NVIDIA Megatron-Bridge gpt-oss docs; sliding window 128 on every other layer, o_proj bias, "
                   "attention sinks and router bias from the openai/gpt-oss-120b config.json and transformers' GptOss",
        ),
        ModelSpec(
            "glm-4.7-flash", n_layers=47, n_experts=64, top_k=4, hidden=2048, expert_inter=1536,
            vocab=154880, dense_layers=(0,), dense_inter=10240, n_shared=1,
            attention=Attention("mla", 20, 20, 0, q_lora_rank=768, kv_lora_rank=512,
                                qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256),
            family="glm4_moe", source="checkpoint config via a vLLM unit test; MLA head dims secondary",
        ),
        ModelSpec(
            "deepseek-v3", n_layers=61, n_experts=256, top_k=8, hidden=7168, expert_inter=2048,
            vocab=129280, dense_layers=(0, 1, 2), dense_inter=18432, n_shared=1,
            attention=Attention("mla", 128, 128, 0, q_lora_rank=1536, kv_lora_rank=512,
                                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            expert_dtype="fp8-block128", dense_dtype="fp8-block128", family="deepseek_v3",
            source=_DS_SRC + " config_671B.json / config_v3.1.json",
        ),
        ModelSpec(
            "mixtral-8x7b", n_layers=32, n_experts=8, top_k=2, hidden=4096, expert_inter=14336,
            vocab=32000, attention=Attention("gqa", 32, 8, 128), family="mixtral",
            source="Hugging Face config.json (via axonn-ai/yalis external/config.py)",
        ),
        ModelSpec(
            "olmoe-1b-7b", n_layers=16, n_experts=64, top_k=8, hidden=2048, expert_inter=1024,
            vocab=50304, attention=Attention("gqa", 16, 16, 128, qk_norm=True, qk_norm_full=True), norm_topk_prob=False,
            family="olmoe", source="allenai/OLMoE-1B-7B-0924 config.json as quoted in a test fixture (secondary)",
        ),
        ModelSpec(
            "deepseek-v2-lite", n_layers=27, n_experts=64, top_k=6, hidden=2048, expert_inter=1408,
            vocab=102400, dense_layers=(0,), dense_inter=10944, n_shared=2,
            attention=Attention("mla", 16, 16, 0, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128),
            family="deepseek_v2", source=_DS_SRC + " config_16B.json",
        ),
        # -- the MoE models people run in 2026 (each checked against its published totals in
        #    tests/test_families.py; the same geometry as reading its config.json, tests/data/configs) --
        ModelSpec('qwen3.5-35b-a3b', n_layers=40, n_experts=256, top_k=8, hidden=2048, expert_inter=512,
            vocab=248320, attention=Attention(n_heads=16, n_kv_heads=2, head_dim=256, qk_norm=True, q_gate=True),
            n_shared=1, shared_inter=512, family='qwen3_5_moe_text',
            source="Qwen/Qwen3.5-35B-A3B config.json text_config (the defaults of transformers' Qwen3_5MoeTextConfig); 35B total / 3B active per the model card",
            layer_types=_cycle(['linear', 'linear', 'linear', 'full'], 40),
            linear=LinearAttention(n_heads=32, n_k_heads=16, head_k_dim=128, head_v_dim=128), n_mtp_layers=1,
            shared_gate=True
        ),
        ModelSpec('qwen3-next-80b-a3b', n_layers=48, n_experts=512, top_k=10, hidden=2048, expert_inter=512,
            vocab=151936, attention=Attention(n_heads=16, n_kv_heads=2, head_dim=256, qk_norm=True, q_gate=True),
            dense_inter=5120, n_shared=1, shared_inter=512, family='qwen3_next',
            source='Qwen/Qwen3-Next-80B-A3B-Instruct config.json (as quoted in public model notes); 80B / 3B active',
            layer_types=_cycle(['linear', 'linear', 'linear', 'full'], 48),
            linear=LinearAttention(n_heads=32, n_k_heads=16, head_k_dim=128, head_v_dim=128), shared_gate=True
        ),
        ModelSpec('qwen3-coder-480b-a35b', n_layers=62, n_experts=160, top_k=8, hidden=6144, expert_inter=2560,
            vocab=151936, attention=Attention(n_heads=96, qk_norm=True), dense_inter=8192,
            source='Qwen/Qwen3-Coder-480B-A35B-Instruct config.json; 480B / 35B active (model card)'
        ),
        ModelSpec('kimi-k2', n_layers=61, n_experts=384, top_k=8, hidden=7168, expert_inter=2048, vocab=163840,
            attention=Attention(kind='mla', n_heads=64, n_kv_heads=64, head_dim=0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            dense_layers=(0,), dense_inter=18432, n_shared=1, expert_dtype='fp8-block128',
            dense_dtype='fp8-block128', family='deepseek_v3',
            source='moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM, fp8 128x128 blocks); 1.04T / 32B active (model card)',
            router_bias=True
        ),
        ModelSpec('deepseek-v3.1', n_layers=61, n_experts=256, top_k=8, hidden=7168, expert_inter=2048, vocab=129280,
            attention=Attention(kind='mla', n_heads=128, n_kv_heads=128, head_dim=0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            dense_layers=(0, 1, 2), dense_inter=18432, n_shared=1, expert_dtype='fp8-block128',
            dense_dtype='fp8-block128', family='deepseek_v3',
            source='deepseek-ai/DeepSeek-V3.1 config.json (fp8 128x128 blocks, one MTP layer); 671B / 37B active (model card)',
            n_mtp_layers=1, router_bias=True
        ),
        ModelSpec('glm-4.5', n_layers=92, n_experts=160, top_k=8, hidden=5120, expert_inter=1536, vocab=151552,
            attention=Attention(n_heads=96, bias=True, qk_norm=True), dense_layers=(0, 1, 2), dense_inter=12288,
            n_shared=1, family='glm4_moe', source='zai-org/GLM-4.5 config.json; 355B / 32B active (model card)',
            n_mtp_layers=1, router_bias=True
        ),
        ModelSpec('glm-4.5-air', n_layers=46, n_experts=128, top_k=8, hidden=4096, expert_inter=1408, vocab=151552,
            attention=Attention(n_heads=96, bias=True), dense_layers=(0,), dense_inter=10944, n_shared=1,
            family='glm4_moe',
            source="zai-org/GLM-4.5-Air config.json (the defaults of transformers' Glm4MoeConfig); 106B / 12B active",
            n_mtp_layers=1, router_bias=True
        ),
        ModelSpec('llama-4-scout-17b-16e', n_layers=48, n_experts=16, top_k=1, hidden=5120, expert_inter=8192,
            vocab=202048, attention=Attention(n_heads=40), dense_inter=16384, n_shared=1, family='llama4_text',
            source="meta-llama/Llama-4-Scout-17B-16E-Instruct config.json text_config (transformers' Llama4TextConfig defaults); 109B / 17B active (model card, vision tower included)",
            layer_types=_cycle(['chunked', 'chunked', 'chunked', 'full'], 48), attention_chunk=8192
        ),
        ModelSpec('llama-4-maverick-17b-128e', n_layers=48, n_experts=128, top_k=1, hidden=5120, expert_inter=8192,
            vocab=202048, attention=Attention(n_heads=40),
            dense_layers=(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46),
            dense_inter=16384, n_shared=1, family='llama4_text',
            source='meta-llama/Llama-4-Maverick-17B-128E-Instruct config.json text_config (MoE every other layer); 400B / 17B active (model card)',
            layer_types=_cycle(['chunked', 'chunked', 'chunked', 'full'], 48), attention_chunk=8192
        ),
        ModelSpec('mixtral-8x22b', n_layers=56, n_experts=8, top_k=2, hidden=6144, expert_inter=16384, vocab=32000,
            attention=Attention(n_heads=48), family='mixtral',
            source='mistralai/Mixtral-8x22B-v0.1 config.json; 141B / 39B active (Mistral AI)'
        ),
        ModelSpec('phi-3.5-moe', n_layers=32, n_experts=16, top_k=2, hidden=4096, expert_inter=6400, vocab=32064,
            attention=Attention(bias=True, o_bias=True), family='phimoe',
            source="microsoft/Phi-3.5-MoE-instruct config.json (the defaults of transformers' PhimoeConfig); 41.9B / 6.6B active (model card)",
            layer_types=_cycle(['sliding'], 32), sliding_window=131072, norm_bias=True, lm_head_bias=True
        ),
        ModelSpec('ernie-4.5-21b-a3b', n_layers=28, n_experts=64, top_k=6, hidden=2560, expert_inter=1536,
            vocab=103424, attention=Attention(n_heads=20, n_kv_heads=4), dense_layers=(0,), dense_inter=12288,
            n_shared=1, shared_inter=3072, tie_embeddings=True, family='ernie4_5_moe',
            source="baidu/ERNIE-4.5-21B-A3B-PT config.json (the defaults of transformers' Ernie4_5_MoeConfig); 21B / 3B active (model card)",
            router_bias=True
        ),
        ModelSpec('minimax-m2', n_layers=62, n_experts=256, top_k=8, hidden=3072, expert_inter=1536, vocab=200064,
            attention=Attention(n_heads=48, qk_norm=True, qk_norm_full=True), expert_dtype='fp8-block128',
            dense_dtype='fp8-block128', family='minimax_m2',
            source="MiniMaxAI/MiniMax-M2 config.json (fp8 128x128 blocks; transformers' MiniMaxM2Config defaults); 230B / 10B active",
            n_mtp_layers=3, router_bias=True
        ),
        ModelSpec('dots-llm1', n_layers=62, n_experts=128, top_k=6, hidden=4096, expert_inter=1408, vocab=152064,
            attention=Attention(n_kv_heads=32, qk_norm=True), dense_layers=(0,), dense_inter=10944, n_shared=2,
            family='dots1', source='rednote-hilab/dots.llm1.inst config.json; 142B / 14B active (model card)',
            router_bias=True
        ),
        ModelSpec('hunyuan-a13b', n_layers=32, n_experts=64, top_k=8, hidden=4096, expert_inter=3072, vocab=128167,
            attention=Attention(qk_norm=True), dense_inter=3072, n_shared=1, tie_embeddings=True,
            family='hunyuan_v1_moe',
            source='tencent/Hunyuan-A13B-Instruct config.json; 80B / 13B active (model card)'
        ),
        ModelSpec('jamba-1.5-mini', n_layers=32, n_experts=16, top_k=2, hidden=4096, expert_inter=14336, vocab=65536,
            dense_layers=(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), dense_inter=14336,
            family='jamba', source='ai21labs/AI21-Jamba-1.5-Mini config.json; 52B / 12B active (model card)',
            layer_types=_cycle(['linear', 'linear', 'linear', 'linear', 'full', 'linear', 'linear', 'linear'], 32),
            linear=LinearAttention(kind='mamba', d_inner=8192, d_state=16, dt_rank=256)
        ),
        ModelSpec('dbrx', n_layers=40, n_experts=16, top_k=4, hidden=6144, expert_inter=10752, vocab=100352,
            attention=Attention(n_heads=48), family='dbrx',
            source='databricks/dbrx-instruct config.json; 132B / 36B active (model card)'
        ),
        ModelSpec(
            "tiny", n_layers=4, n_experts=16, top_k=2, hidden=64, expert_inter=32, vocab=256,
            attention=Attention("gqa", 4, 2, 16, qk_norm=True), source="moesim test model (not a real model)",
        ),
    ]
}

ALIASES = {"olmoe-1b-7b-0924": "olmoe-1b-7b", "qwen3-30b": "qwen3-30b-a3b",
           "kimi-k2-instruct": "kimi-k2", "llama-4-scout": "llama-4-scout-17b-16e",
           "llama-4-maverick": "llama-4-maverick-17b-128e", "phi-3.5-moe-instruct": "phi-3.5-moe",
           # Fine-tunes and later checkpoints of one architecture: the geometry (layers, experts,
           # widths) is their base's, which is all moesim times.
           "deepseek-r1": "deepseek-v3", "deepseek-r1-0528": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3",
           "deepseek-v3-base": "deepseek-v3", "deepseek-v3.1-terminus": "deepseek-v3.1",
           "kimi-k2-instruct-0905": "kimi-k2", "kimi-k2-base": "kimi-k2",
           "qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b", "qwen3-30b-a3b-thinking-2507": "qwen3-30b-a3b",
           "qwen3-235b-a22b-instruct-2507": "qwen3-235b-a22b", "qwen3-235b-a22b-thinking-2507": "qwen3-235b-a22b"}


def cache_capacity(spec: ModelSpec, cache_gib: float = 0.0, cache_experts: int = 0) -> int:
    """Cross-token cache capacity in experts, from GiB or an expert count (not both). Shared
    by the simulator and the executor, so a cache of N GiB holds the same experts in both."""
    if not (0 <= cache_gib < float("inf")) or cache_experts < 0:  # NaN fails too
        raise MoesimError(f"cache size must be >= 0 and finite (got {cache_gib:g} GiB, {cache_experts} experts)")
    if cache_gib and cache_experts:
        raise MoesimError("give the cache size in GiB or in experts, not both")
    every = spec.n_moe_layers * spec.n_experts  # a cache past every expert holds every expert
    if cache_gib:  # (1e308 GiB is inf bytes: never NaN experts)
        return every if cache_gib * 2.0**30 >= every * spec.expert_bytes else int(cache_gib * 2**30 // spec.expert_bytes)
    return min(cache_experts, every)


#: Models read from a user's files in this process, by display name (what result rows carry):
#: filled by :func:`get_model`, read by :func:`model_named`.
_READ_FROM_FILES: dict[str, ModelSpec] = {}
_FILES: dict[str, Path] = {}  # display name -> the file it was read from (a GGUF, a config.json)


def model_named(name: str) -> ModelSpec:
    """The model a result row names (its ``model`` / ``base_model``): one read from a file in
    this process under that display name (a GGUF, a ``config.json``), else :func:`get_model`."""
    return _READ_FROM_FILES.get(name) or get_model(name)


def model_file(name: str) -> Path | None:
    """The file this process read the model a result row names from (a GGUF, a
    ``config.json``), None for a catalogue model: what an engine's arguments load."""
    return _FILES.get(name)


def get_model(name_or_path: str) -> ModelSpec:
    """A model directory / ``config.json`` path, or a catalogue model by name.

    A path that exists always wins over a catalogue name: a user who points at their own
    checkout of a model must get that checkout's geometry, not the built-in entry. When
    the argument is both, the choice is reported (a warning naming both); an existing
    directory without a ``config.json`` whose name is also a catalogue name is an error
    rather than a silent fallback to the catalogue.
    """
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    p = check_name(Path(name_or_path), "model")
    kind = kind_of(p)
    if kind != "missing":
        if kind != "folder":
            check_input(p, "model config")  # a device or socket: one line, never read
        cfg = p / "config.json" if kind == "folder" else p
        gguf = sorted(p.glob("*.gguf")) if kind == "folder" else [p] if p.suffix == ".gguf" else []
        if gguf and kind_of(p / "config.json") == "missing":
            spec = spec_from_gguf(gguf[0])
            _READ_FROM_FILES[spec.name], _FILES[spec.name] = spec, gguf[0]
            if key in CATALOGUE:
                warnings.warn(f"{name_or_path!r} is both a local path and the catalogue model {key!r}; "
                              f"using the local {gguf[0]}", UserWarning, stacklevel=2)
            return spec
        if kind_of(cfg) == "missing":
            also = f" (also the catalogue model {key!r}: pass it from another directory)" if key in CATALOGUE else ""
            raise MoesimError(f"model directory {p} has no config.json{also}")
        spec = from_hf_config(cfg)
        _READ_FROM_FILES[spec.name], _FILES[spec.name] = spec, cfg
        if key in CATALOGUE:
            warnings.warn(f"{name_or_path!r} is both a local path and the catalogue model {key!r}; "
                          f"using the local {cfg}", UserWarning, stacklevel=2)
        return spec
    if key in CATALOGUE:
        return CATALOGUE[key]
    shipped = shipped_checkpoint(name_or_path)
    if shipped is not None:
        return get_model(str(shipped))
    raise MoesimError(
        f"unknown model {name_or_path!r}{nearest_hint(name_or_path, [*CATALOGUE, *ALIASES])}: not in the catalogue "
        f"({', '.join(CATALOGUE)}), "
        "not a checkpoint that ships with moesim and not a directory or config.json"
    )


#: The checkpoints that ship with moesim's executor (its package data, ``checkpoints/NAME``):
#: the learned-routing model and its draft for speculative decoding.
SHIPPED_MODEL = "moe-stdlib"
DRAFT_MODEL = "moe-stdlib-draft"


def shipped_checkpoint(name: str) -> Path | None:
    """The folder of a checkpoint that ships with moesim's executor, by the name ``moesim
    record`` takes (:data:`SHIPPED_MODEL`, :data:`DRAFT_MODEL`), so every command that
    takes a model takes it; None for any other name. The folder is package data, located
    by the import system without running the executor's code (which needs torch)."""
    if name not in (SHIPPED_MODEL, DRAFT_MODEL):
        return None
    spec = importlib.util.find_spec("moesim.executor")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(r) / "checkpoints" / name for r in roots if (Path(r) / "checkpoints" / name).is_dir()]
    return found[0] if found else None


def from_hf_config(path: str | Path) -> ModelSpec:
    """Build a spec from a Hugging Face ``config.json`` of a decoder-only MoE model.

    With transformers installed, every MoE family it knows is read through ``AutoConfig``
    and a model built on the meta device (:mod:`moesim.hf_config`); without it, the
    families of :data:`HF_FAMILIES` by their keys. Weight formats come from ``torch_dtype``
    (or ``dtype``) and ``quantization_config`` (:mod:`moesim.artefacts`); a folder's
    safetensors headers then give the exact stored bytes. Every field is checked: an
    unknown family, a non-integer size, zero KV heads or an unknown dtype is a one-line
    error, never a silently wrong byte count.
    """
    return spec_from_config(path)


def catalogue_in(expert_dtype: str | None, store=None) -> tuple[list[ModelSpec], dict[str, str]]:
    """Every catalogue model with its routed experts in ``expert_dtype`` (None: as
    published), and the models that format cannot store, with the reason (llama.cpp's
    K-quants need dimensions that are multiples of 256, which gpt-oss's 2,880 is not):
    a listing shows the others instead of failing as a whole. An unknown format is
    still one error. ``store(spec, fmt)`` stores a spec in a format (default
    :meth:`ModelSpec.with_expert_dtype`; :func:`moesim.quant_recipes.store_as` adds llama.cpp's
    file types, such as q4_k_m)."""
    if expert_dtype is None:
        return list(CATALOGUE.values()), {}
    specs, skipped = [], {}
    for spec in CATALOGUE.values():
        try:
            specs.append(store(spec, expert_dtype) if store is not None else spec.with_expert_dtype(expert_dtype))
        except MoesimError as e:
            if "unknown expert dtype" in str(e):
                raise
            skipped[spec.name] = str(e)
    if not specs:
        raise MoesimError(f"no catalogue model can store its experts in {expert_dtype}")
    return specs, skipped
