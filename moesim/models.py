"""Model geometry and exact byte accounting: the one definition of "how big is an expert".

The simulator, the executor and every report take their sizes from :class:`ModelSpec`.
A spec comes from the built-in catalogue (``CATALOGUE``), from a Hugging Face
``config.json`` (:func:`from_hf_config`) or from a trace header (:meth:`ModelSpec.from_dict`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError

# ---------------------------------------------------------------------------------------
# Weight formats
# ---------------------------------------------------------------------------------------

#: Storage formats a weight matrix can have, with a one-line description each.
DTYPES: dict[str, str] = {
    "bf16": "2 bytes a weight",
    "fp16": "2 bytes a weight (IEEE half precision)",
    "fp32": "4 bytes a weight",
    "fp8-block128": "1 byte a weight plus one fp32 scale per 128x128 block (DeepSeek-V3)",
    "mxfp4": "4 bits a weight plus one 8-bit shared scale per 32 weights of a row (gpt-oss)",
    "int8": "int8 weight-only, per output channel: 1 byte a weight plus one fp16 scale per row",
    "int4-g32": "int4 weight-only, group-wise: 4 bits a weight plus an fp16 scale and fp16 zero per 32 weights of a row",
    "int4-g128": "int4 weight-only, group-wise: 4 bits a weight plus an fp16 scale and fp16 zero per 128 weights of a row",
    "q8_0": "llama.cpp/ggml Q8_0: blocks of 32 weights, 34 bytes (fp16 scale + 32 int8)",
    "q4_k": "llama.cpp/ggml Q4_K: super-blocks of 256 weights, 144 bytes (fp16 d, dmin; 12 scale bytes; 128 nibble bytes)",
    "q5_k": "llama.cpp/ggml Q5_K: super-blocks of 256 weights, 176 bytes (Q4_K plus 32 bytes of high bits)",
    "q6_k": "llama.cpp/ggml Q6_K: super-blocks of 256 weights, 210 bytes (128 low-nibble, 64 high-bit, 16 scale bytes, fp16 d)",
}

#: ggml block layouts: format -> (weights a block, bytes a block). From ggml's
#: ``ggml-common.h`` (https://github.com/ggml-org/llama.cpp, ``block_q8_0``, ``block_q4_K``,
#: ``block_q5_K``, ``block_q6_K`` and their ``static_assert`` sizes). Blocks run along a
#: row (the input dimension) and never straddle rows, so a row length that is not a
#: multiple of the block is not representable (llama.cpp quantises such a tensor to a
#: fallback format instead).
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 2 + 32),
    "q4_k": (256, 2 + 2 + 12 + 256 // 2),
    "q5_k": (256, 2 + 2 + 12 + 256 // 8 + 256 // 2),
    "q6_k": (256, 256 // 2 + 256 // 4 + 256 // 16 + 2),
}
#: Group size of the group-wise int4 formats (an fp16 scale and an fp16 zero per group).
INT4_GROUPS: dict[str, int] = {"int4-g32": 32, "int4-g128": 128}
#: Formats whose matrices a CPU kernel multiplies with integer dot products (llama.cpp
#: quantises the activations to 8 bits for its k-quant and Q8_0 kernels; weight-only int
#: formats run int8 kernels on CPUs with VNNI/AMX-INT8); every other format is
#: dequantised to bf16 and multiplied at the bf16 rate.
INTEGER_DTYPES = frozenset({"int8", *INT4_GROUPS, *GGML_BLOCKS})


def matrix_bytes(rows: int, cols: int, dtype: str) -> int:
    """Bytes of a ``rows x cols`` weight matrix (``cols`` = input dimension) in ``dtype``."""
    n = rows * cols
    if dtype in ("bf16", "fp16"):
        return 2 * n
    if dtype == "fp32":
        return 4 * n
    if dtype == "fp8-block128":
        return n + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
    if dtype == "mxfp4":
        # Two weights a byte; each run of 32 weights along a row shares one E8M0 scale byte.
        return math.ceil(n / 2) + rows * math.ceil(cols / 32)
    if dtype == "int8":
        return n + 2 * rows  # one fp16 scale per output channel (symmetric: no zero point)
    if dtype in INT4_GROUPS:
        # Each row packs two weights a byte; each group of a row has an fp16 scale and zero
        # (a short last group still carries both).
        return rows * math.ceil(cols / 2) + rows * math.ceil(cols / INT4_GROUPS[dtype]) * (2 + 2)
    if dtype in GGML_BLOCKS:
        per, size = GGML_BLOCKS[dtype]
        if cols % per:
            raise MoesimError(f"{dtype} stores rows in blocks of {per} weights; a row of {cols} is not a multiple "
                              f"(llama.cpp falls back to another format for such a tensor)")
        return rows * (cols // per) * size
    raise MoesimError(f"unknown weight dtype {dtype!r}; known: {', '.join(DTYPES)}")


# ---------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """Attention geometry. ``kind`` is ``gqa`` (grouped-query) or ``mla`` (multi-head latent)."""

    kind: str = "gqa"
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    bias: bool = False  # q/k/v projection biases (gpt-oss)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    # MLA only (DeepSeek-V2/V3, GLM-4.7-Flash); q_lora_rank 0 = no query compression.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of a decoder-only MoE model, and everything derived from it in bytes.

    Layer indices in ``dense_layers`` have a dense FFN of ``dense_inter`` instead of
    experts; every other layer is an MoE layer with ``n_experts`` routed experts (top-k)
    and ``n_shared`` always-active shared experts of ``expert_inter`` each.
    """

    name: str
    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    expert_inter: int
    vocab: int
    attention: Attention = field(default_factory=Attention)
    dense_layers: tuple[int, ...] = ()
    dense_inter: int = 0
    n_shared: int = 0
    shared_inter: int = 0  # each shared expert's intermediate size; 0 = expert_inter
    expert_dtype: str = "bf16"
    dense_dtype: str = "bf16"  # attention, router, shared experts, dense FFNs
    expert_bias: bool = False
    tie_embeddings: bool = False
    norm_topk_prob: bool = True
    family: str = "qwen3_moe"
    source: str = ""

    def __post_init__(self) -> None:
        problems = []
        for name in ("n_layers", "n_experts", "top_k", "hidden", "expert_inter", "vocab"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.top_k > self.n_experts:
            problems.append(f"top_k {self.top_k} exceeds n_experts {self.n_experts}")
        if any(not 0 <= i < self.n_layers for i in self.dense_layers):
            problems.append("dense_layers has an index outside the model")
        if self.dense_layers and self.dense_inter <= 0:
            problems.append("dense layers need dense_inter > 0")
        if len(self.dense_layers) >= self.n_layers:
            problems.append("the model has no MoE layer")
        for d in (self.expert_dtype, self.dense_dtype):
            if d not in DTYPES:
                problems.append(f"unknown dtype {d!r}")
        if not problems and self.expert_dtype in GGML_BLOCKS:
            per = GGML_BLOCKS[self.expert_dtype][0]
            bad = [f"{n} {v}" for n, v in (("hidden", self.hidden), ("expert_inter", self.expert_inter)) if v % per]
            if bad:
                problems.append(f"expert dtype {self.expert_dtype} needs input dimensions that are multiples of "
                                f"{per} ({', '.join(bad)} is not; llama.cpp would fall back to another format)")
        if problems:
            raise MoesimError(f"model {self.name!r}: " + "; ".join(problems))

    # -- layers -------------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.n_layers) if i not in dense)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - len(self.dense_layers)

    # -- experts ------------------------------------------------------------------------
    @property
    def expert_weights(self) -> int:
        """Weights of one routed SwiGLU expert: gate and up (inter x hidden), down (hidden x inter)."""
        return 3 * self.hidden * self.expert_inter

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as stored and moved (weights, scales, biases)."""
        h, i, d = self.hidden, self.expert_inter, self.expert_dtype
        b = 2 * matrix_bytes(i, h, d) + matrix_bytes(h, i, d)
        if self.expert_bias:
            b += 2 * (2 * i + h)  # bf16 biases of gate, up and down
        return b

    @property
    def layer_expert_bytes(self) -> int:
        return self.n_experts * self.expert_bytes

    @property
    def all_expert_bytes(self) -> int:
        return self.n_moe_layers * self.layer_expert_bytes

    def expert_flops(self, tokens: int = 1) -> int:
        """Multiply-adds x 2 of one expert applied to ``tokens`` tokens."""
        return 2 * self.expert_weights * tokens

    # -- non-expert weights --------------------------------------------------------------
    def _linear(self, rows: int, cols: int) -> int:
        return matrix_bytes(rows, cols, self.dense_dtype)

    @property
    def attention_bytes(self) -> int:
        """Bytes of one layer's attention block, with its two RMSNorms."""
        a, h = self.attention, self.hidden
        norms = 2 * 2 * h
        if a.kind == "mla":
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            if a.q_lora_rank:
                q = self._linear(a.q_lora_rank, h) + 2 * a.q_lora_rank
                q += self._linear(a.n_heads * qk, a.q_lora_rank)
            else:
                q = self._linear(a.n_heads * qk, h)
            kv = self._linear(a.kv_lora_rank + a.qk_rope_head_dim, h) + 2 * a.kv_lora_rank
            kv += self._linear(a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
            o = self._linear(h, a.n_heads * a.v_head_dim)
            return q + kv + o + norms
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        b = self._linear(q_dim, h) + 2 * self._linear(kv_dim, h) + self._linear(h, q_dim)
        if a.bias:
            b += 2 * (q_dim + 2 * kv_dim)
        if a.qk_norm:
            b += 2 * 2 * a.head_dim
        return b + norms

    @property
    def router_bytes(self) -> int:
        return 2 * self.n_experts * self.hidden

    @property
    def shared_expert_bytes(self) -> int:
        """Bytes of one layer's shared experts (always active, kept on the device)."""
        inter = self.shared_inter or self.expert_inter
        one = 2 * self._linear(inter, self.hidden) + self._linear(self.hidden, inter)
        return self.n_shared * one

    @property
    def dense_ffn_bytes(self) -> int:
        h, i = self.hidden, self.dense_inter
        return 2 * self._linear(i, h) + self._linear(h, i)

    @property
    def lm_head_bytes(self) -> int:
        """What a step reads after the last layer: the final norm and the LM head (bf16).

        The one definition the roofline, the calibration fit and prefill use; with tied
        embeddings the head is the input table itself."""
        return matrix_bytes(self.vocab, self.hidden, "bf16") + 2 * self.hidden

    @property
    def embedding_bytes(self) -> int:
        """Input embedding (unless tied to the head) plus :attr:`lm_head_bytes`."""
        table = 0 if self.tie_embeddings else matrix_bytes(self.vocab, self.hidden, "bf16")
        return table + self.lm_head_bytes

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one token (2 x its weights)."""
        return 2 * self.vocab * self.hidden

    def layer_resident_bytes(self, layer: int) -> int:
        """Non-expert bytes of one layer: what stays on the device and is read every step."""
        if layer in self.dense_layers:
            return self.attention_bytes + self.dense_ffn_bytes
        return self.attention_bytes + self.router_bytes + self.shared_expert_bytes

    @property
    def non_expert_bytes(self) -> int:
        return self.embedding_bytes + sum(self.layer_resident_bytes(i) for i in range(self.n_layers))

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV-cache bytes one past token costs one layer (bf16 cache)."""
        a = self.attention
        if a.kind == "mla":
            return 2 * (a.kv_lora_rank + a.qk_rope_head_dim)
        return 2 * 2 * a.n_kv_heads * a.head_dim

    @property
    def attention_weights(self) -> int:
        """Weights of one layer's attention projections (a count, not bytes: FLOPs follow it
        whatever the storage format)."""
        a, h = self.attention, self.hidden
        if a.kind == "mla":
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            q = (a.q_lora_rank * h + a.n_heads * qk * a.q_lora_rank) if a.q_lora_rank else a.n_heads * qk * h
            kv = (a.kv_lora_rank + a.qk_rope_head_dim) * h + a.n_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
            return q + kv + h * a.n_heads * a.v_head_dim
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return 2 * q_dim * h + 2 * kv_dim * h

    def attention_flops(self, context: int) -> int:
        """FLOPs of one layer's attention for one new token attending to ``context`` tokens:
        2 x the projection weights, plus the scores and the weighted sum over the context."""
        a = self.attention
        if a.kind == "mla":
            score_dim = a.kv_lora_rank + a.qk_rope_head_dim  # absorbed MLA attends in latent space
            per_ctx = 2 * a.n_heads * (score_dim + a.kv_lora_rank)
        else:
            per_ctx = 2 * 2 * a.n_heads * a.head_dim
        return 2 * self.attention_weights + per_ctx * context

    def dense_weights(self, layer: int) -> int:
        """Weights of a layer's non-attention, non-routed work: the dense FFN of a dense
        layer; the router and the shared experts of an MoE layer."""
        h = self.hidden
        if layer in self.dense_layers:
            return 3 * h * self.dense_inter
        return self.n_experts * h + self.n_shared * 3 * h * (self.shared_inter or self.expert_inter)

    def dense_flops_per_token(self, layer: int) -> int:
        """FLOPs one token spends in :meth:`dense_weights` (2 x the weight COUNT, never the
        bytes: a bf16 weight is two bytes but one multiply-add)."""
        return 2 * self.dense_weights(layer)

    def bytes_per_token(self, context: int = 0) -> int:
        """Bytes one decoded token touches at batch 1: all non-expert weights, top-k
        experts in every MoE layer, and the KV cache of ``context`` past tokens."""
        experts = self.n_moe_layers * self.top_k * self.expert_bytes
        kv = self.n_layers * self.kv_bytes_per_token_layer * context
        return self.non_expert_bytes + experts + kv

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise MoesimError(f"model spec has unknown keys: {', '.join(sorted(unknown))}")
        d = dict(d)
        try:
            d["attention"] = Attention(**d.get("attention", {}))
            d["dense_layers"] = tuple(d.get("dense_layers", ()))
            return cls(**d)
        except TypeError as e:
            raise MoesimError(f"model spec is malformed: {e}") from None

    def with_expert_dtype(self, dtype: str) -> ModelSpec:
        """The same model with its routed experts stored in ``dtype`` (what a quantised
        checkpoint of it holds): every byte count follows, FLOP counts do not."""
        if dtype not in DTYPES:
            raise MoesimError(f"unknown expert dtype {dtype!r}; known: {', '.join(DTYPES)}")
        if dtype == self.expert_dtype:
            return self
        return replace(self, name=f"{self.name}@{dtype}", expert_dtype=dtype)

    def with_layers(self, n_layers: int) -> ModelSpec:
        """The same model cut to its first ``n_layers`` layers (to fit a test machine)."""
        if not 0 < n_layers <= self.n_layers:
            raise MoesimError(f"{self.name} has {self.n_layers} layers; cannot keep {n_layers}")
        dense = tuple(i for i in self.dense_layers if i < n_layers)
        return replace(self, name=f"{self.name}[:{n_layers}]", n_layers=n_layers, dense_layers=dense)


# ---------------------------------------------------------------------------------------
# Catalogue (values and their sources: each entry's ``source``, and docs/models.md)
# ---------------------------------------------------------------------------------------

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
            vocab=201088, attention=Attention("gqa", 64, 8, 64, bias=True), expert_dtype="mxfp4",
            expert_bias=True, family="gpt_oss", source="NVIDIA Megatron-Bridge gpt-oss docs",
        ),
        ModelSpec(
            "gpt-oss-120b", n_layers=36, n_experts=128, top_k=4, hidden=2880, expert_inter=2880,
            vocab=201088, attention=Attention("gqa", 64, 8, 64, bias=True), expert_dtype="mxfp4",
            expert_bias=True, family="gpt_oss", source="NVIDIA Megatron-Bridge gpt-oss docs",
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
            vocab=50304, attention=Attention("gqa", 16, 16, 128, qk_norm=True), norm_topk_prob=False,
            family="olmoe", source="allenai/OLMoE-1B-7B-0924 config.json as quoted in a test fixture (secondary)",
        ),
        ModelSpec(
            "deepseek-v2-lite", n_layers=27, n_experts=64, top_k=6, hidden=2048, expert_inter=1408,
            vocab=102400, dense_layers=(0,), dense_inter=10944, n_shared=2,
            attention=Attention("mla", 16, 16, 0, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128),
            family="deepseek_v2", source=_DS_SRC + " config_16B.json",
        ),
        ModelSpec(
            "tiny", n_layers=4, n_experts=16, top_k=2, hidden=64, expert_inter=32, vocab=256,
            attention=Attention("gqa", 4, 2, 16, qk_norm=True), source="moesim test model (not a real model)",
        ),
    ]
}

ALIASES = {"deepseek-v3.1": "deepseek-v3", "olmoe-1b-7b-0924": "olmoe-1b-7b", "qwen3-30b": "qwen3-30b-a3b"}


def cache_capacity(spec: ModelSpec, cache_gib: float = 0.0, cache_experts: int = 0) -> int:
    """Cross-token cache capacity in experts, from GiB or an expert count (not both). Shared
    by the simulator and the executor, so a cache of N GiB holds the same experts in both."""
    if not (0 <= cache_gib < float("inf")) or cache_experts < 0:  # NaN fails too
        raise MoesimError(f"cache size must be >= 0 and finite (got {cache_gib:g} GiB, {cache_experts} experts)")
    if cache_gib and cache_experts:
        raise MoesimError("give the cache size in GiB or in experts, not both")
    if cache_gib:
        return int(cache_gib * 2**30 // spec.expert_bytes)
    return cache_experts


def get_model(name_or_path: str) -> ModelSpec:
    """A model directory / ``config.json`` path, or a catalogue model by name.

    A path that exists always wins over a catalogue name: a user who points at their own
    checkout of a model must get that checkout's geometry, not the built-in entry. When
    the argument is both, the choice is reported (a warning naming both); an existing
    directory without a ``config.json`` whose name is also a catalogue name is an error
    rather than a silent fallback to the catalogue.
    """
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    p = Path(name_or_path)
    if p.exists():
        cfg = p / "config.json" if p.is_dir() else p
        if not cfg.is_file():
            also = f" (also the catalogue model {key!r}: pass it from another directory)" if key in CATALOGUE else ""
            raise MoesimError(f"model directory {p} has no config.json{also}")
        spec = from_hf_config(cfg)
        if key in CATALOGUE:
            warnings.warn(f"{name_or_path!r} is both a local path and the catalogue model {key!r}; "
                          f"using the local {cfg}", UserWarning, stacklevel=2)
        return spec
    if key in CATALOGUE:
        return CATALOGUE[key]
    raise MoesimError(
        f"unknown model {name_or_path!r}: not in the catalogue ({', '.join(CATALOGUE)}) "
        "and not a directory or config.json"
    )


# ---------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


#: ``model_type`` values whose config keys :func:`from_hf_config` knows; any other family
#: (llama, bert, ...) is refused rather than read with guessed keys.
HF_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe",
               "glm4_moe_lite")
#: ``torch_dtype`` / ``dtype`` values and the storage format they mean.
HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _int(cfg: dict[str, Any], path: Path, *keys: str, default: int | None = None, minimum: int = 1) -> int:
    """The first present key as an integer >= ``minimum``; a float, a string or a bool is an error."""
    key = next((k for k in keys if cfg.get(k) is not None), None)
    if key is None:
        if default is None:
            raise MoesimError(f"{path}: missing field {' / '.join(keys)}")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise MoesimError(f"{path}: {key} must be an integer, got {v!r}")
    if v < minimum:
        raise MoesimError(f"{path}: {key} must be >= {minimum}, got {v}")
    return v


def read_config(path: str | Path) -> dict:
    """A ``config.json`` as a dict; unreadable, non-UTF-8, invalid or non-object JSON is
    one clear error (every reader of a checkpoint's config goes through here)."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise MoesimError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise MoesimError(f"cannot read {path}: not UTF-8 text (a config.json is expected)") from None
    except json.JSONDecodeError as e:
        raise MoesimError(f"cannot read {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MoesimError(f"{path}: not a JSON object")
    return cfg


def from_hf_config(path: str | Path) -> ModelSpec:
    """Build a spec from a Hugging Face ``config.json`` of a supported MoE family.

    Covers the key spellings of Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, gpt-oss and
    GLM-4 MoE (:data:`HF_FAMILIES`). Weight formats come from ``torch_dtype`` (or
    ``dtype``) and ``quantization_config`` (fp8 block or mxfp4). Every field is checked:
    an unknown family, a non-integer size, zero KV heads or an unknown dtype is a
    one-line error, never a silently wrong byte count.
    """
    path = Path(path)
    cfg = read_config(path)
    mtype = cfg.get("model_type")
    n_experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    if mtype not in HF_FAMILIES:
        what = "has no expert count; not an MoE config" if n_experts is None else "is not a supported MoE family"
        raise MoesimError(f"{path}: model_type {mtype!r} {what} (supported: {', '.join(HF_FAMILIES)})")
    if n_experts is None:
        raise MoesimError(f"{path}: model_type {mtype!r} has no expert count; not an MoE config")
    n_experts = _int(cfg, path, "num_experts", "num_local_experts", "n_routed_experts")
    n_layers = _int(cfg, path, "num_hidden_layers")
    hidden = _int(cfg, path, "hidden_size")
    heads = _int(cfg, path, "num_attention_heads")
    vocab = _int(cfg, path, "vocab_size")
    top_k = _int(cfg, path, "num_experts_per_tok", "experts_per_token")
    has_moe_inter = "moe_intermediate_size" in cfg
    expert_inter = _int(cfg, path, "moe_intermediate_size", "intermediate_size")
    dense_inter = _int(cfg, path, "intermediate_size", default=0, minimum=0) if has_moe_inter else 0

    # Which layers are dense.
    dense: set[int] = set(range(_int(cfg, path, "first_k_dense_replace", default=0, minimum=0)))
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise MoesimError(f"{path}: mlp_only_layers must be a list of layer indices")
    dense |= set(only)
    step = _int(cfg, path, "decoder_sparse_step", default=1)
    freq = _int(cfg, path, "moe_layer_freq", default=1)
    # Qwen3: layer i is sparse when (i + 1) % decoder_sparse_step == 0;
    # DeepSeek/GLM: when i >= first_k_dense_replace and i % moe_layer_freq == 0.
    dense |= {i for i in range(n_layers) if (i + 1) % step != 0 or i % freq != 0}
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
        if "head_dim" not in cfg and hidden % heads:
            raise MoesimError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                              "give head_dim")
        attention = Attention(
            "gqa", heads, kv_heads, _int(cfg, path, "head_dim", default=hidden // heads),
            bias=bool(_first(cfg, "attention_bias", "qkv_bias", default=mtype in ("gpt_oss", "qwen2_moe"))),
            qk_norm=mtype in ("qwen3_moe", "olmoe") or bool(cfg.get("use_qk_norm", False)),
        )

    raw_dtype = _first(cfg, "dtype", "torch_dtype", default="bfloat16")
    if raw_dtype not in HF_DTYPES:
        raise MoesimError(f"{path}: torch_dtype {raw_dtype!r} not supported ({', '.join(HF_DTYPES)})")
    quant = cfg.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise MoesimError(f"{path}: quantization_config must be an object")
    method = str(quant.get("quant_method", "")).lower()
    expert_dtype = dense_dtype = HF_DTYPES[raw_dtype]
    if method == "fp8":
        expert_dtype = dense_dtype = "fp8-block128"
        block = quant.get("weight_block_size", [128, 128])
        if block != [128, 128]:
            raise MoesimError(f"{path}: fp8 block size {block} not supported (only 128x128)")
    elif method == "mxfp4":
        expert_dtype = "mxfp4"
    elif method:
        raise MoesimError(f"{path}: quantisation {method!r} not supported (fp8 block, mxfp4)")

    return ModelSpec(
        name=str(cfg.get("_name_or_path") or path.parent.name or mtype),
        n_layers=n_layers, n_experts=int(n_experts), top_k=top_k, hidden=hidden,
        expert_inter=expert_inter, vocab=vocab, attention=attention,
        dense_layers=tuple(sorted(dense)), dense_inter=dense_inter,
        # DeepSeek/GLM: n_shared_experts of moe_intermediate_size; Qwen2-MoE: one of its own size.
        n_shared=_int(cfg, path, "n_shared_experts", default=0, minimum=0)
        or (1 if cfg.get("shared_expert_intermediate_size") else 0),
        shared_inter=_int(cfg, path, "shared_expert_intermediate_size", default=0, minimum=0),
        expert_dtype=expert_dtype, dense_dtype=dense_dtype,
        expert_bias=mtype == "gpt_oss",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", mtype not in ("olmoe",))),
        family=mtype, source=str(path),
    )


def catalogue_in(expert_dtype: str | None) -> tuple[list[ModelSpec], dict[str, str]]:
    """Every catalogue model with its routed experts in ``expert_dtype`` (None: as
    published), and the models that format cannot store, with the reason (llama.cpp's
    K-quants need dimensions that are multiples of 256, which gpt-oss's 2,880 is not):
    a listing shows the others instead of failing as a whole. An unknown format is
    still one error."""
    if expert_dtype is None:
        return list(CATALOGUE.values()), {}
    specs, skipped = [], {}
    for spec in CATALOGUE.values():
        try:
            specs.append(spec.with_expert_dtype(expert_dtype))
        except MoesimError as e:
            if "unknown expert dtype" in str(e):
                raise
            skipped[spec.name] = str(e)
    if not specs:
        raise MoesimError(f"no catalogue model can store its experts in {expert_dtype}")
    return specs, skipped
