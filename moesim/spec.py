"""What a model is: weight formats, the attention kinds and :class:`ModelSpec`, the one
definition of "how big is an expert"; and the primitives every ``config.json`` reader shares.

The simulator, the executor and every report take their sizes from :class:`ModelSpec`. A
spec is built here from numbers; :mod:`moesim.models` holds the catalogue and resolves a
name or a file (a GGUF through :mod:`moesim.gguf_file`, a ``config.json`` through
:mod:`moesim.hf_config`), which build their specs from this module, so the readers sit
between the two and nothing imports in a circle.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.inputs import JSON_CAP, read_bytes

# ---------------------------------------------------------------------------------------
# Weight formats
# ---------------------------------------------------------------------------------------

#: Storage formats a weight matrix can have, with a one-line description each.
DTYPES: dict[str, str] = {
    "bf16": "2 bytes a weight",
    "fp16": "2 bytes a weight (IEEE half precision)",
    "fp32": "4 bytes a weight",
    "fp8-block128": "1 byte a weight plus one fp32 scale per 128x128 block (DeepSeek-V3)",
    "fp8-channel": "1 byte a weight plus one fp32 scale per output channel (compressed-tensors / FBGEMM per-channel fp8)",
    "fp8-tensor": "1 byte a weight plus one fp32 scale per matrix (per-tensor fp8)",
    "mxfp4": "4 bits a weight plus one 8-bit shared scale per 32 weights of a row (gpt-oss)",
    "nvfp4": "4 bits a weight plus one fp8 (E4M3) scale per 16 weights of a row and one fp32 global scale (NVFP4)",
    "int8": "int8 weight-only, per output channel: 1 byte a weight plus one fp16 scale per row",
    "int4-g32": "int4 weight-only, group-wise: 4 bits a weight plus an fp16 scale and fp16 zero per 32 weights of a row",
    "int4-g128": "int4 weight-only, group-wise: 4 bits a weight plus an fp16 scale and fp16 zero per 128 weights of a row",
}

#: Repack formats of Hugging Face ``quantization_config``: ``int{bits}-g{group}-{kind}``,
#: ``bits`` a weight packed into 32-bit words along the input dimension and a 16-bit scale
#: per group of ``group`` weights of a row, plus what each kind stores besides
#: (:func:`_repack_layout`, :func:`matrix_bytes`):
#:
#: - ``gptq`` (GPTQ, AutoGPTQ/GPTQModel ``QuantLinear``): ``qzeros`` (``bits``-bit zeros
#:   int32-packed along the output dimension, one row a group) and ``g_idx`` (one int32 per
#:   input channel);
#: - ``awq`` (AutoAWQ GEMM): ``qzeros`` as GPTQ's, no ``g_idx``;
#: - ``sym`` (compressed-tensors ``pack-quantized``, symmetric): ``weight_packed``,
#:   ``weight_scale`` and ``weight_shape`` (two int64);
#: - ``mlx`` (``mlx.nn.QuantizedLinear``): uint32 ``weight``, ``scales`` and ``biases`` (the
#:   affine zero, 16-bit), one of each per group.
REPACK_KINDS = ("gptq", "awq", "sym", "mlx")
for _bits in (2, 3, 4, 6, 8):
    for _g in (32, 64, 128):
        for _kind in REPACK_KINDS:
            DTYPES[f"int{_bits}-g{_g}-{_kind}"] = (f"{_kind} repack: {_bits}-bit weights packed in 32-bit words, a "
                                                   f"16-bit scale per {_g} weights of a row (docs/models.md)")
DTYPES["nf4-bnb"] = "bitsandbytes NF4/FP4: 4 bits a weight plus one fp32 absmax per 64 weights (blocksize 64)"
DTYPES["nf4-bnb-dq"] = ("bitsandbytes NF4/FP4 with double quantisation: 4 bits a weight, an 8-bit absmax per 64 "
                        "weights and one fp32 per 256 absmax values")
DTYPES["int8-bnb"] = "bitsandbytes LLM.int8(): 1 byte a weight plus one fp32 scale per output row (SCB)"

#: ggml block layouts: format -> (weights a block, bytes a block). Hand-written from
#: ggml's ``ggml-common.h`` (https://github.com/ggml-org/llama.cpp, the ``block_*`` structs
#: and their ``static_assert`` sizes) so that the simulator needs no extra package;
#: tests/test_gguf.py checks every entry against gguf-py's ``GGML_QUANT_SIZES`` (the
#: maintained table, which the GGUF reader itself uses). Blocks run along a row (the
#: input dimension) and never straddle rows, so a row length that is not a multiple of
#: the block is not representable (llama.cpp quantises such a tensor to a fallback
#: format instead).
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 2 + 32),
    "q4_k": (256, 2 + 2 + 12 + 256 // 2),
    "q5_k": (256, 2 + 2 + 12 + 256 // 8 + 256 // 2),
    "q6_k": (256, 256 // 2 + 256 // 4 + 256 // 16 + 2),
    "q4_0": (32, 2 + 16),
    "q4_1": (32, 2 + 2 + 16),
    "q5_0": (32, 2 + 4 + 16),
    "q5_1": (32, 2 + 2 + 4 + 16),
    "q8_1": (32, 4 + 4 + 32),
    "q2_k": (256, 2 + 2 + 256 // 16 + 256 // 4),
    "q3_k": (256, 2 + 256 // 4 + 256 // 8 + 12),
    "q8_k": (256, 4 + 256 + 256 // 16 * 2),
    "iq2_xxs": (256, 2 + 256 // 8 * 2),
    "iq2_xs": (256, 2 + 256 // 8 * 2 + 256 // 32),
    "iq3_xxs": (256, 2 + 256 // 4 + 256 // 8),
    "iq1_s": (256, 2 + 256 // 8 + 256 // 16),
    "iq4_nl": (32, 2 + 16),
    "iq3_s": (256, 2 + 256 // 4 + 256 // 8 + 256 // 32 + 4),
    "iq2_s": (256, 2 + 256 // 4 + 256 // 16),
    "iq4_xs": (256, 2 + 2 + 256 // 2 + 256 // 64),
    "iq1_m": (256, 256 // 8 + 256 // 16 + 256 // 32),
    "tq1_0": (256, 2 + 4 * 13),
    "tq2_0": (256, 2 + 64),
    "mxfp4-gguf": (32, 1 + 16),
    "nvfp4-gguf": (64, 4 * (1 + 8)),  # four sub-blocks of 16: an E4M3 scale and 8 nibble bytes each
    "q1_0": (128, 2 + 128 // 8),
}
_GGML_NAMES = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "mxfp4-gguf": "MXFP4", "nvfp4-gguf": "NVFP4"}
for _name, (_per, _size) in GGML_BLOCKS.items():
    DTYPES.setdefault(_name, f"llama.cpp/ggml {_GGML_NAMES.get(_name, _name.upper())}: blocks of {_per} weights, "
                             f"{_size} bytes ({_size * 8 / _per:g} bits a weight)")
#: Group size of the group-wise int4 formats (an fp16 scale and an fp16 zero per group).
INT4_GROUPS: dict[str, int] = {"int4-g32": 32, "int4-g128": 128}
#: Layer kinds (:meth:`ModelSpec.layer_kind`).
LAYER_KINDS = ("full", "sliding", "chunked", "linear")
#: Formats whose matrices a CPU kernel multiplies with integer dot products (llama.cpp
#: quantises the activations to 8 bits for its k-quant, i-quant and Q4_0..Q8_0 kernels;
#: weight-only int formats run int8 kernels on CPUs with VNNI/AMX-INT8); every other format is
#: dequantised to bf16 and multiplied at the bf16 rate.
INTEGER_DTYPES = frozenset({"int8", *INT4_GROUPS, *GGML_BLOCKS, "int8-bnb",
                            *(d for d in DTYPES if d.startswith("int") and d.endswith(("-gptq", "-awq", "-sym")))})


def _repack_layout(dtype: str) -> tuple[int, int, str] | None:
    """(bits, group, kind) of a ``int{bits}-g{group}-{gptq,sym,mlx}`` repack format."""
    if not dtype.startswith("int") or dtype.count("-") != 2:
        return None
    bits, group, kind = dtype.split("-")
    if kind not in REPACK_KINDS or not bits[3:].isdigit() or not group[1:].isdigit():
        return None
    return int(bits[3:]), int(group[1:]), kind


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
    if dtype == "fp8-channel":
        return n + 4 * rows
    if dtype == "fp8-tensor":
        return n + 4
    if dtype == "nvfp4":
        # modelopt NVFP4: two weights a byte, an E4M3 scale per 16 weights of a row, one fp32 global scale.
        return math.ceil(n / 2) + rows * math.ceil(cols / 16) + 4
    if dtype == "nf4-bnb":
        # bitsandbytes Params4bit (blocksize 64): packed nibbles over the flattened matrix, one fp32 absmax a block.
        return math.ceil(n / 2) + 4 * math.ceil(n / 64)
    if dtype == "nf4-bnb-dq":
        # compress_statistics: absmax quantised to uint8 in blocks of 256, each with an fp32 scale (+ one fp32 offset).
        blocks = math.ceil(n / 64)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4
    if dtype == "int8-bnb":
        return n + 4 * rows  # LLM.int8(): int8 weights, one fp32 SCB per output row
    rep = _repack_layout(dtype)
    if rep is not None:
        bits, group, kind = rep
        groups = math.ceil(cols / group)
        words = math.ceil(cols * bits / 32)  # weights packed along a row into 32-bit words
        b = rows * words * 4 + rows * groups * 2  # packed weights + fp16 scales
        if kind in ("gptq", "awq"):
            b += math.ceil(rows * bits / 32) * 4 * groups  # qzeros: int32-packed along the output dimension
        if kind == "gptq":
            b += 4 * cols  # g_idx: the group of each input channel
        elif kind == "sym":
            b += 16  # weight_shape: two int64
        elif kind == "mlx":
            b += rows * groups * 2  # 16-bit biases (mlx's affine zero)
        return b
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
    q_gate: bool = False  # gated attention: q_proj also yields a sigmoid output gate (Qwen3-Next, Qwen3.5)
    qk_norm_full: bool = False  # q/k norms over all heads (OLMoE, MiniMax-M2) instead of per head
    o_bias: bool = False  # output projection bias (Phi-3.5-MoE, gpt-oss)
    sinks: bool = False  # one learned attention-sink logit per head (gpt-oss)


class LinearMixer:
    """One kind of linear-attention or state-space token mixer, answering for a layer of it
    (:class:`LinearAttention`: the geometry, read from ``config.json`` or a GGUF): its
    projections (:meth:`matrices`, stored in the model's dense format), its small weights
    (:meth:`small_params`: conv, gates, norms, bf16), and the recurrent state one sequence
    keeps (:meth:`state_elements`, :meth:`conv_elements`). A new kind is one subclass and its
    line in :data:`LINEAR_MIXERS`; ``model_types`` are the ``config.json`` model types whose
    linear layers it is, read by :meth:`from_config`."""

    name: str = ""
    model_types: tuple[str, ...] = ()

    def matrices(self, la: LinearAttention, h: int) -> list[tuple[int, int]]:
        """The projections as (rows, cols) matrices, cols the input dimension."""
        raise NotImplementedError

    def small_params(self, la: LinearAttention, h: int) -> int:
        """The mixer's weights that are not :meth:`matrices` (conv, gates, its own norms)."""
        raise NotImplementedError

    def state_elements(self, la: LinearAttention) -> int:
        """Recurrent state elements of one sequence (the matrix state only)."""
        raise NotImplementedError

    def conv_elements(self, la: LinearAttention) -> int:
        """The causal convolution's tail of one sequence (``conv_kernel - 1`` past inputs)."""
        return 0

    def from_config(self, cfg: dict[str, Any], path: Path, hidden: int) -> LinearAttention:
        """The geometry from a ``config.json`` of one of ``model_types`` (a bad field: one line)."""
        raise NotImplementedError


class GatedDeltaNet(LinearMixer):
    """Qwen3-Next, Qwen3.5/3.6 (Kimi-Linear style): ``n_k_heads`` key heads of ``head_k_dim``,
    ``n_heads`` value heads of ``head_v_dim``; state ``head_k_dim x head_v_dim`` a value head,
    plus a conv tail of ``conv_kernel - 1`` rows of q, k, v."""

    name, model_types = "gated_deltanet", ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

    def matrices(self, la, h):
        key, value = la.n_k_heads * la.head_k_dim, la.n_heads * la.head_v_dim
        return [(2 * key + 2 * value, h), (2 * la.n_heads, h), (h, value)]

    def small_params(self, la, h):
        conv = 2 * la.n_k_heads * la.head_k_dim + la.n_heads * la.head_v_dim
        return conv * la.conv_kernel + 2 * la.n_heads + la.head_v_dim

    def state_elements(self, la):
        return la.n_heads * la.head_k_dim * la.head_v_dim

    def conv_elements(self, la):
        return max(la.conv_kernel - 1, 0) * (2 * la.n_k_heads * la.head_k_dim + la.n_heads * la.head_v_dim)

    def from_config(self, cfg, path, hidden):
        return LinearAttention(self.name, n_heads=_int(cfg, path, "linear_num_value_heads"),
                               n_k_heads=_int(cfg, path, "linear_num_key_heads"),
                               head_k_dim=_int(cfg, path, "linear_key_head_dim"),
                               head_v_dim=_int(cfg, path, "linear_value_head_dim"),
                               conv_kernel=_int(cfg, path, "linear_conv_kernel_dim", default=4))


class Mamba(LinearMixer):
    """Jamba: ``d_inner`` channels of ``d_state``, ``dt_rank``, a conv tail."""

    name, model_types = "mamba", ("jamba",)

    def matrices(self, la, h):
        return [(2 * la.d_inner, h), (la.dt_rank + 2 * la.d_state, la.d_inner), (la.d_inner, la.dt_rank),
                (h, la.d_inner)]

    def small_params(self, la, h):
        d, s, r = la.d_inner, la.d_state, la.dt_rank
        return d * la.conv_kernel + d + d + d * s + d + r + 2 * s  # conv, biases, A, D, Jamba's dt/B/C norms

    def state_elements(self, la):
        return la.d_inner * la.d_state

    def conv_elements(self, la):
        return max(la.conv_kernel - 1, 0) * la.d_inner

    def from_config(self, cfg, path, hidden):
        rank = cfg.get("mamba_dt_rank", "auto")
        rank = -(-hidden // 16) if rank == "auto" else _int(cfg, path, "mamba_dt_rank")
        if cfg.get("mamba_proj_bias") or not cfg.get("mamba_conv_bias", True):
            raise MoesimError(f"{path}: Jamba with mamba_proj_bias or without mamba_conv_bias is not modelled")
        return LinearAttention(self.name, d_inner=_int(cfg, path, "mamba_expand", default=2) * hidden,
                               d_state=_int(cfg, path, "mamba_d_state", default=16), dt_rank=rank,
                               conv_kernel=_int(cfg, path, "mamba_d_conv", default=4))


class Mamba2(LinearMixer):
    """Nemotron-H, Granite-4 hybrid: ``n_heads`` heads of ``head_v_dim``, ``n_groups`` B/C groups."""

    name, model_types = "mamba2", ("granitemoehybrid",)

    def matrices(self, la, h):
        return [(2 * la.d_inner + 2 * la.n_groups * la.d_state + la.n_heads, h), (h, la.d_inner)]

    def small_params(self, la, h):
        conv = la.d_inner + 2 * la.n_groups * la.d_state
        return conv * la.conv_kernel + conv + 3 * la.n_heads + la.d_inner

    def state_elements(self, la):
        return la.n_heads * la.head_v_dim * la.d_state

    def conv_elements(self, la):
        return max(la.conv_kernel - 1, 0) * (la.d_inner + 2 * la.n_groups * la.d_state)

    def from_config(self, cfg, path, hidden):
        heads, head = _int(cfg, path, "mamba_n_heads"), _int(cfg, path, "mamba_d_head")
        if cfg.get("mamba_proj_bias") or not cfg.get("mamba_conv_bias", True):
            raise MoesimError(f"{path}: Mamba-2 with mamba_proj_bias or without mamba_conv_bias is not modelled")
        return LinearAttention(self.name, n_heads=heads, head_v_dim=head, d_inner=heads * head,
                               d_state=_int(cfg, path, "mamba_d_state"), n_groups=_int(cfg, path, "mamba_n_groups"),
                               conv_kernel=_int(cfg, path, "mamba_d_conv", default=4))


class Lightning(LinearMixer):
    """MiniMax-01/M1: ``n_heads`` heads, state ``head_v_dim x head_v_dim`` a head; fused qkv,
    an output gate, an output norm and projection."""

    name, model_types = "lightning", ("minimax",)

    def matrices(self, la, h):
        inner = la.n_heads * la.head_v_dim
        return [(3 * inner, h), (inner, h), (h, inner)]

    def small_params(self, la, h):
        return la.n_heads * la.head_v_dim

    def state_elements(self, la):
        return la.n_heads * la.head_v_dim * la.head_v_dim

    def from_config(self, cfg, path, hidden):
        heads = _int(cfg, path, "num_attention_heads")
        return LinearAttention(self.name, n_heads=heads, head_v_dim=_int(cfg, path, "head_dim", default=hidden // heads))


#: Every linear-attention / state-space mixer moesim sizes, by ``LinearAttention.kind``.
LINEAR_MIXERS: dict[str, LinearMixer] = {m.name: m for m in (GatedDeltaNet(), Mamba(), Mamba2(), Lightning())}
LINEAR_KINDS = tuple(LINEAR_MIXERS)


@dataclass(frozen=True)
class LinearAttention:
    """A linear-attention or state-space token mixer's geometry: a fixed recurrent state per
    sequence instead of a KV cache. What each field means, and what a layer of it weighs and
    keeps, is its kind's (:data:`LINEAR_MIXERS`: :class:`GatedDeltaNet`, :class:`Mamba`,
    :class:`Mamba2`, :class:`Lightning`)."""

    kind: str = "gated_deltanet"
    n_heads: int = 0
    n_k_heads: int = 0
    head_k_dim: int = 0
    head_v_dim: int = 0
    d_inner: int = 0
    d_state: int = 0
    dt_rank: int = 0
    n_groups: int = 1
    conv_kernel: int = 4

    @property
    def mixer(self) -> LinearMixer:
        return LINEAR_MIXERS[self.kind]

    def params(self, hidden: int) -> int:
        """Weights of the mixer (projections, conv, gates, its own norms), without the layer's two norms."""
        return sum(r * c for r, c in self.mixer.matrices(self, hidden)) + self.mixer.small_params(self, hidden)

    @property
    def state_elements(self) -> int:
        """Recurrent state elements of one sequence (the matrix state only)."""
        return self.mixer.state_elements(self)

    @property
    def conv_elements(self) -> int:
        """The causal convolution's tail of one sequence (``conv_kernel - 1`` past inputs)."""
        return self.mixer.conv_elements(self)


#: Upper limits of a geometry, each far past any released model (widths of 7,168-16,384, expert
#: widths to 32,768, vocabularies to ~262k): a header or config.json beyond them is an error
#: (a hidden size of 1e30 replayed at 3e28 ms a token), not a model. Experts: the trace stores
#: ids as int16.
SIZE_LIMITS = {"hidden": 1 << 18, "expert_inter": 1 << 20, "vocab": 1 << 24, "n_experts": (1 << 15) - 1,
               "n_layers": 1 << 14}


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
    # -- added for 2026 families; every default keeps the byte counts of a spec without them --
    #: per layer "full", "sliding", "chunked" or "linear"; () = every layer full attention
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # tokens a sliding layer attends to (the current one included, as HF's masks)
    attention_chunk: int = 0  # chunked layers attend within aligned chunks of this many tokens (Llama-4)
    linear: LinearAttention | None = None  # the mixer of the "linear" layers
    n_mtp_layers: int = 0  # multi-token-prediction modules (DeepSeek-V3, GLM-4.5, Qwen3-Next): not in the main stack
    expert_gated: bool = True  # SwiGLU experts (gate, up, down); False: up and down only
    router_bias: bool = False  # a per-expert router bias (DeepSeek-V3's e_score_correction_bias, gpt-oss)
    shared_gate: bool = False  # a sigmoid gate (1 x hidden) on the shared expert (Qwen2-MoE, Qwen3-Next)
    norm_bias: bool = False  # LayerNorms with a bias (Phi-3.5-MoE)
    lm_head_bias: bool = False
    embed_dtype: str = "bf16"  # the input embedding table
    head_dtype: str = "bf16"  # the LM head (the table itself when tied)
    extra_params: int = 0  # weights the geometry does not name (measured on transformers' meta model)
    #: exact bytes of one routed expert per MoE layer from the artefact (GGUF, safetensors); () = the formula
    expert_bytes_by_layer: tuple[int, ...] = ()
    #: exact non-expert bytes per layer from the artefact; () = the formula
    artefact_layer_bytes: tuple[int, ...] = ()
    artefact_head_bytes: int = 0  # exact final norm + LM head bytes from the artefact; 0 = the formula
    artefact_embed_bytes: int = 0  # exact input-embedding bytes from the artefact; 0 = the formula
    artefact_mtp_bytes: int = 0  # exact bytes of all MTP modules from the artefact; 0 = the formula

    def __post_init__(self) -> None:
        problems = []
        for name in ("n_layers", "n_experts", "top_k", "hidden", "expert_inter", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # true read as 1, 2048.5 as a width
                problems.append(f"{name} must be a whole number (got {v!r})")
            elif v <= 0:
                problems.append(f"{name} must be positive (got {v})")
            elif v > SIZE_LIMITS.get(name, v):
                problems.append(f"{name} {v} is beyond any model's ({SIZE_LIMITS[name]:,} at most)")
        if problems:  # the checks below compare these numbers
            raise MoesimError(f"model {self.name!r}: " + "; ".join(problems))
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
        for d in (self.embed_dtype, self.head_dtype):
            if d not in DTYPES:
                problems.append(f"unknown dtype {d!r}")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
            if bad:
                problems.append(f"unknown layer type {bad[0]!r} (known: {', '.join(LAYER_KINDS)})")
            if "sliding" in self.layer_types and self.sliding_window <= 0:
                problems.append("sliding layers need sliding_window > 0")
            if "chunked" in self.layer_types and self.attention_chunk <= 0:
                problems.append("chunked layers need attention_chunk > 0")
            if "linear" in self.layer_types and (self.linear is None or self.linear.kind not in LINEAR_KINDS):
                problems.append("linear layers need a LinearAttention of a known kind")
        if self.expert_bytes_by_layer and len(self.expert_bytes_by_layer) != self.n_layers - len(self.dense_layers):
            problems.append("expert_bytes_by_layer needs one entry per MoE layer")
        if self.artefact_layer_bytes and len(self.artefact_layer_bytes) != self.n_layers:
            problems.append("artefact_layer_bytes needs one entry per layer")
        for name in ("expert_bytes_by_layer", "artefact_layer_bytes"):  # a byte count per layer: a whole number >= 0
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in getattr(self, name)):
                problems.append(f"{name} must hold whole numbers of bytes >= 0")
        if self.extra_params < 0 or self.n_mtp_layers < 0:
            problems.append("extra_params and n_mtp_layers must be >= 0")
        problems += [f"{name} must be >= 0 (got {v})" for part in (self, self.attention, self.linear) if part is not None
                     for name, v in ((f.name, getattr(part, f.name)) for f in fields(part))
                     if type(v) is int and v < 0 and name not in ("extra_params", "n_mtp_layers")]
        a = self.attention
        if any(kind != "linear" for kind in (self.layer_types or ("full",))):  # a layer that attends
            if a.n_heads < 1 or (a.kind == "gqa" and a.head_dim < 1):
                problems.append(f"attention needs n_heads >= 1 and head_dim >= 1 (got {a.n_heads}, {a.head_dim})")
            elif a.kind == "gqa" and (a.n_kv_heads < 1 or a.n_heads % a.n_kv_heads):
                problems.append(f"n_kv_heads {a.n_kv_heads} must divide n_heads {a.n_heads} (grouped-query attention)")
        if not problems and self.expert_dtype in GGML_BLOCKS and not self.expert_bytes_by_layer:
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
        return (3 if self.expert_gated else 2) * self.hidden * self.expert_inter

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: its weights plus its biases (gpt-oss)."""
        bias = (2 * self.expert_inter + self.hidden) if self.expert_bias else 0
        return self.expert_weights + bias

    @property
    def _formula_expert_bytes(self) -> int:
        h, i, d = self.hidden, self.expert_inter, self.expert_dtype
        b = (2 if self.expert_gated else 1) * matrix_bytes(i, h, d) + matrix_bytes(h, i, d)
        if self.expert_bias:
            b += 2 * (2 * i + h)  # bf16 biases of gate, up and down
        return b

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as stored and moved (weights, scales, biases).

        When the artefact gives the bytes per MoE layer (``expert_bytes_by_layer``: a GGUF
        Q4_K_M stores some layers' ``ffn_down`` in Q6_K), this is their mean, rounded to a
        byte; :meth:`moe_expert_bytes` is each layer's exact figure."""
        if self.expert_bytes_by_layer:
            return round(sum(self.expert_bytes_by_layer) / len(self.expert_bytes_by_layer))
        return self._formula_expert_bytes

    def moe_expert_bytes(self, m: int) -> int:
        """Bytes of one routed expert at MoE layer ``m`` (0-based among the MoE layers)."""
        if not 0 <= m < self.n_moe_layers:
            raise MoesimError(f"{self.name}: MoE layer {m} outside [0, {self.n_moe_layers})")
        return self.expert_bytes_by_layer[m] if self.expert_bytes_by_layer else self._formula_expert_bytes

    @property
    def layer_expert_bytes(self) -> int:
        return self.n_experts * self.expert_bytes

    @property
    def all_expert_bytes(self) -> int:
        if self.expert_bytes_by_layer:
            return self.n_experts * sum(self.expert_bytes_by_layer)
        return self.n_moe_layers * self.layer_expert_bytes

    def expert_flops(self, tokens: int = 1) -> int:
        """Multiply-adds x 2 of one expert applied to ``tokens`` tokens."""
        return 2 * self.expert_weights * tokens

    # -- non-expert weights --------------------------------------------------------------
    def _linear(self, rows: int, cols: int) -> int:
        return matrix_bytes(rows, cols, self.dense_dtype)

    @property
    def _norm_params(self) -> int:
        """Parameters of one norm over the hidden size (weight, and bias for LayerNorm)."""
        return self.hidden * (2 if self.norm_bias else 1)

    @cached_property  # a frozen spec's figure, computed once (per-layer sums call it for every layer)
    def attention_bytes(self) -> int:
        """Bytes of one full-attention layer's attention block, with the layer's two norms."""
        a, h = self.attention, self.hidden
        norms = 2 * 2 * self._norm_params
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
        q_rows = 2 * q_dim if a.q_gate else q_dim
        b = self._linear(q_rows, h) + 2 * self._linear(kv_dim, h) + self._linear(h, q_dim)
        return b + 2 * self._attention_small_params + norms

    @property
    def _attention_small_params(self) -> int:
        """Biases and q/k norms of a GQA block (kept in bf16 whatever the weights' format)."""
        a = self.attention
        if a.kind == "mla":
            return a.q_lora_rank + a.kv_lora_rank
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        p = 0
        if a.bias:
            p += (2 * q_dim if a.q_gate else q_dim) + 2 * kv_dim
        if a.o_bias:
            p += self.hidden
        if a.qk_norm:
            p += q_dim + kv_dim if a.qk_norm_full else 2 * a.head_dim
        if a.sinks:
            p += a.n_heads
        return p

    @property
    def attention_params(self) -> int:
        """Parameters of one full-attention block (projections, biases, q/k norms, the layer's two norms)."""
        return self.attention_weights + self._attention_small_params + 2 * self._norm_params

    @property
    def linear_attention_params(self) -> int:
        """Parameters of one linear-attention layer's mixer plus the layer's two norms (0 without one)."""
        return self.linear.params(self.hidden) + 2 * self._norm_params if self.linear is not None else 0

    @cached_property
    def linear_attention_bytes(self) -> int:
        """Bytes of one linear-attention layer's mixer and its two norms: the projections in
        ``dense_dtype``, the conv, gates and norms in bf16."""
        if self.linear is None:
            return 0
        la, h = self.linear, self.hidden
        mats = la.mixer.matrices(la, h)
        weights = sum(r * c for r, c in mats)
        small = la.params(h) - weights + 2 * self._norm_params
        return sum(self._linear(r, c) for r, c in mats) + 2 * small

    @cached_property
    def router_bytes(self) -> int:
        return 2 * self._router_params

    @property
    def _router_params(self) -> int:
        return self.n_experts * self.hidden + (self.n_experts if self.router_bias else 0) + (
            self.hidden if self.shared_gate and self.n_shared else 0)

    @property
    def _shared_inter(self) -> int:
        return self.shared_inter or self.expert_inter

    @cached_property
    def shared_expert_bytes(self) -> int:
        """Bytes of one layer's shared experts (always active, kept on the device)."""
        inter = self._shared_inter
        one = 2 * self._linear(inter, self.hidden) + self._linear(self.hidden, inter)
        return self.n_shared * one

    @cached_property
    def dense_ffn_bytes(self) -> int:
        h, i = self.hidden, self.dense_inter
        return 2 * self._linear(i, h) + self._linear(h, i)

    @property
    def lm_head_bytes(self) -> int:
        """What a step reads after the last layer: the final norm and the LM head (bf16
        unless ``head_dtype`` or the artefact says otherwise).

        The one definition the roofline, the calibration fit and prefill use; with tied
        embeddings the head is the input table itself."""
        if self.artefact_head_bytes:
            return self.artefact_head_bytes
        bias = 2 * self.vocab if self.lm_head_bias else 0
        return matrix_bytes(self.vocab, self.hidden, self.head_dtype) + 2 * self._norm_params + bias

    @property
    def input_embedding_bytes(self) -> int:
        """The input embedding table as stored (0 when tied to the LM head). Engines keep it in
        host memory and read one row a token (:attr:`embedding_row_bytes`)."""
        if self.tie_embeddings:
            return 0
        if self.artefact_embed_bytes:
            return self.artefact_embed_bytes
        return matrix_bytes(self.vocab, self.hidden, self.embed_dtype)

    @property
    def embedding_row_bytes(self) -> int:
        """Bytes of one token's embedding row (what a step really reads of the table)."""
        dtype = self.head_dtype if self.tie_embeddings else self.embed_dtype
        if self.artefact_embed_bytes and not self.tie_embeddings:
            return math.ceil(self.artefact_embed_bytes / self.vocab)
        return matrix_bytes(1, self.hidden, dtype)

    @property
    def embedding_bytes(self) -> int:
        """Input embedding (unless tied to the head) plus :attr:`lm_head_bytes`."""
        return self.input_embedding_bytes + self.lm_head_bytes

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one token (2 x its weights)."""
        return 2 * self.vocab * self.hidden

    def layer_kind(self, layer: int) -> str:
        """``full``, ``sliding``, ``chunked`` or ``linear`` (state-space / linear attention)."""
        if not 0 <= layer < self.n_layers:
            raise MoesimError(f"{self.name}: layer {layer} outside [0, {self.n_layers})")
        return self.layer_types[layer] if self.layer_types else "full"

    def layer_signature(self, layer: int) -> tuple:
        """What makes one layer's dense work cost differently from another's: its kind, its
        resident bytes and its dense (FFN, router and shared-expert) weights, everything the
        per-layer methods here read; layers with one signature cost the same, so the cost
        model times each signature once (:meth:`moesim.costmodel.CostModel.attention_by_layer`)."""
        return self.layer_kind(layer), self.layer_resident_bytes(layer), self.dense_weights(layer)

    def layer_attention_bytes(self, layer: int) -> int:
        """Bytes of layer ``layer``'s token mixer with its two norms (:attr:`attention_bytes`
        for an attention layer; the mixer's for a linear one)."""
        return self.linear_attention_bytes if self.layer_kind(layer) == "linear" else self.attention_bytes

    def layer_resident_bytes(self, layer: int) -> int:
        """Non-expert bytes of one layer: what stays on the device and is read every step."""
        if self.artefact_layer_bytes:
            return self.artefact_layer_bytes[layer]
        attn = self.layer_attention_bytes(layer) if self.layer_types else self.attention_bytes
        if layer in self.dense_layers:
            return attn + self.dense_ffn_bytes
        return attn + self.router_bytes + self.shared_expert_bytes

    @property
    def extra_bytes(self) -> int:
        """Bytes of :attr:`extra_params` (bf16, fp32 for an fp32 model): counted once, in no layer."""
        return self.extra_params * (4 if self.dense_dtype == "fp32" else 2)

    @cached_property
    def non_expert_bytes(self) -> int:
        return self.embedding_bytes + sum(self.layer_resident_bytes(i) for i in range(self.n_layers)) + self.extra_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV-cache bytes one past token costs one attention layer (bf16 cache)."""
        a = self.attention
        if a.kind == "mla":
            return 2 * (a.kv_lora_rank + a.qk_rope_head_dim)
        return 2 * 2 * a.n_kv_heads * a.head_dim

    def kv_bytes_per_token(self, layer: int) -> int:
        """KV-cache bytes one past token costs layer ``layer`` (0 for a linear layer)."""
        return 0 if self.layer_kind(layer) == "linear" else self.kv_bytes_per_token_layer

    def state_bytes(self, layer: int) -> int:
        """A linear layer's recurrent state of one sequence (matrix state and conv tail, bf16
        like the KV cache), read and written every token; 0 for an attention layer."""
        if self.layer_kind(layer) != "linear":
            return 0
        return 2 * (self.linear.state_elements + self.linear.conv_elements)

    def kv_tokens(self, layer: int, context):
        """Past tokens layer ``layer`` attends to when the new token has ``context`` before it
        (an int or a numpy array of contexts): all of them for full attention,
        ``min(context, sliding_window - 1)`` for sliding (the window counts the new token, as
        Hugging Face's masks do), ``context mod attention_chunk`` for chunked (the new token
        sees its own aligned chunk, Llama-4), 0 for linear layers."""
        import numpy as np

        kind = self.layer_kind(layer)
        arr = isinstance(context, np.ndarray)
        c = np.asarray(context)
        if kind == "full":
            r = c
        elif kind == "sliding":
            r = np.minimum(c, self.sliding_window - 1)
        elif kind == "chunked":
            r = c % self.attention_chunk
        else:
            r = np.zeros_like(c)
        return r if arr else int(r)

    def _kv_tokens_held(self, layer: int, context: int) -> int:
        """Tokens the cache must hold for layer ``layer`` over a run up to ``context`` (a
        chunked layer's whole chunk once the run has reached it)."""
        kind = self.layer_kind(layer)
        if kind == "chunked":
            return min(context, self.attention_chunk - 1)
        return self.kv_tokens(layer, context)

    def layer_kv_bytes(self, layer: int, context: int) -> int:
        """The KV cache (or a linear layer's state) layer ``layer`` holds for one sequence
        over a run up to ``context`` tokens: what the memory fit places with the layer."""
        if not self.layer_types:
            return context * self.kv_bytes_per_token_layer
        return self.kv_bytes_per_token(layer) * self._kv_tokens_held(layer, context) + self.state_bytes(layer)

    def kv_cache_bytes(self, batch: int, context: int) -> int:
        """KV cache plus linear-layer state for ``batch`` sequences of ``context`` tokens: what
        the memory fit needs (the most each layer holds up to that context)."""
        if not self.layer_types:
            return batch * context * self.n_layers * self.kv_bytes_per_token_layer
        return batch * sum(self.layer_kv_bytes(i, context) for i in range(self.n_layers))

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
        return (3 if a.q_gate else 2) * q_dim * h + 2 * kv_dim * h

    @property
    def _attention_flops_per_context(self) -> int:
        a = self.attention
        if a.kind == "mla":
            score_dim = a.kv_lora_rank + a.qk_rope_head_dim  # absorbed MLA attends in latent space
            return 2 * a.n_heads * (score_dim + a.kv_lora_rank)
        return 2 * 2 * a.n_heads * a.head_dim

    def attention_flops(self, context: int) -> int:
        """FLOPs of one layer's attention for one new token attending to ``context`` tokens:
        2 x the projection weights, plus the scores and the weighted sum over the context."""
        return 2 * self.attention_weights + self._attention_flops_per_context * context

    def layer_attention_flops(self, layer: int, context):
        """FLOPs of layer ``layer``'s token mixer for one new token at ``context`` (int or
        numpy array): :meth:`attention_flops` over :meth:`kv_tokens` for attention layers;
        for a linear layer 2 x its weights plus 6 per state element (the recurrent update
        and readout: two multiply-adds to update, one to read, per element)."""
        if self.layer_kind(layer) == "linear":
            import numpy as np

            f = 2 * self.linear.params(self.hidden) + 6 * self.linear.state_elements
            return np.full(np.shape(context), f, np.int64) if isinstance(context, np.ndarray) else f
        return 2 * self.attention_weights + self._attention_flops_per_context * self.kv_tokens(layer, context)

    def dense_weights(self, layer: int) -> int:
        """Weights of a layer's non-attention, non-routed work: the dense FFN of a dense
        layer; the router and the shared experts of an MoE layer."""
        h = self.hidden
        if layer in self.dense_layers:
            return 3 * h * self.dense_inter
        return self.n_experts * h + self.n_shared * 3 * h * self._shared_inter

    def dense_flops_per_token(self, layer: int) -> int:
        """FLOPs one token spends in :meth:`dense_weights` (2 x the weight COUNT, never the
        bytes: a bf16 weight is two bytes but one multiply-add)."""
        return 2 * self.dense_weights(layer)

    def bytes_per_token(self, context: int = 0) -> int:
        """Bytes one decoded token touches at batch 1: all non-expert weights, top-k
        experts in every MoE layer, and the KV cache of ``context`` past tokens (a linear
        layer's state instead, read and written)."""
        if self.expert_bytes_by_layer:
            experts = self.top_k * sum(self.expert_bytes_by_layer)
        else:
            experts = self.n_moe_layers * self.top_k * self.expert_bytes
        if not self.layer_types:
            kv = self.n_layers * self.kv_bytes_per_token_layer * context
        else:
            kv = sum(self.kv_bytes_per_token(i) * self.kv_tokens(i, context) + 2 * self.state_bytes(i)
                     for i in range(self.n_layers))
        return self.non_expert_bytes + experts + kv

    # -- parameter counts ----------------------------------------------------------------
    def _layer_params(self, layer: int) -> int:
        kind = self.layer_kind(layer)
        p = self.linear_attention_params if kind == "linear" else self.attention_params
        if layer in self.dense_layers:
            return p + 3 * self.hidden * self.dense_inter
        shared = self.n_shared * 3 * self.hidden * self._shared_inter
        return p + self._router_params + shared + self.n_experts * self.expert_params

    @property
    def total_params(self) -> int:
        """Every parameter of the model as Hugging Face builds it (input table unless tied,
        layers, final norm, LM head; MTP modules not included: :attr:`mtp_params`)."""
        table = 0 if self.tie_embeddings else self.vocab * self.hidden
        head = self.vocab * self.hidden + self._norm_params + (self.vocab if self.lm_head_bias else 0)
        return table + head + sum(self._layer_params(i) for i in range(self.n_layers)) + self.extra_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: :attr:`total_params` less the routed experts it is not sent to."""
        return self.total_params - self.n_moe_layers * (self.n_experts - self.top_k) * self.expert_params

    @property
    def _mtp_extra_params(self) -> int:
        return 2 * self.hidden * self.hidden + 3 * self._norm_params  # eh_proj (2h -> h), enorm, hnorm, final norm

    @property
    def mtp_params(self) -> int:
        """Parameters of the MTP modules (each a full-attention MoE layer plus its projection
        and norms; the embedding and head are the main model's)."""
        one = self.attention_params + self._router_params + self.n_shared * 3 * self.hidden * self._shared_inter
        one += self.n_experts * self.expert_params + self._mtp_extra_params
        return self.n_mtp_layers * one

    @property
    def mtp_layer_bytes(self) -> int:
        """Bytes of one MTP module as stored: a full-attention MoE layer with all its experts,
        the 2h -> h projection and its norms (what a speculative draft step reads, top-k
        experts aside). 0 without MTP."""
        if not self.n_mtp_layers:
            return 0
        if self.artefact_mtp_bytes:
            return round(self.artefact_mtp_bytes / self.n_mtp_layers)
        # Its experts as the file stores the others when it gives them per layer (a GGUF file, a
        # llama.cpp file type's recipe with its fallbacks), else by the format's formula.
        expert = self.expert_bytes if self.expert_bytes_by_layer else self._formula_expert_bytes
        return (self.attention_bytes + self.router_bytes + self.shared_expert_bytes
                + self.n_experts * expert + self._linear(self.hidden, 2 * self.hidden)
                + 2 * 3 * self._norm_params)

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("dense_layers", "layer_types", "expert_bytes_by_layer", "artefact_layer_bytes"):
            d[k] = list(getattr(self, k))
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
            if d.get("linear") is not None:
                d["linear"] = LinearAttention(**d["linear"])
            for k in ("dense_layers", "layer_types", "expert_bytes_by_layer", "artefact_layer_bytes"):
                d[k] = tuple(d.get(k, ()))
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
        # The artefact's exact expert bytes were for its own format; the new format's come from the formula.
        return replace(self, name=f"{self.name}@{dtype}", expert_dtype=dtype, expert_bytes_by_layer=())

    def with_layers(self, n_layers: int) -> ModelSpec:
        """The same model cut to its first ``n_layers`` layers (to fit a test machine)."""
        if not 0 < n_layers <= self.n_layers:
            raise MoesimError(f"{self.name} has {self.n_layers} layers; cannot keep {n_layers}")
        dense = tuple(i for i in self.dense_layers if i < n_layers)
        n_moe = n_layers - len(dense)
        return replace(self, name=f"{self.name}[:{n_layers}]", n_layers=n_layers, dense_layers=dense,
                       layer_types=self.layer_types[:n_layers], expert_bytes_by_layer=self.expert_bytes_by_layer[:n_moe],
                       artefact_layer_bytes=self.artefact_layer_bytes[:n_layers])


# ---------------------------------------------------------------------------------------
# Hugging Face config.json: the primitives its readers share
# ---------------------------------------------------------------------------------------


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


#: ``model_type`` values whose config keys :func:`from_hf_config` knows; any other family
#: (llama, bert, ...) is refused rather than read with guessed keys.
HF_FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "mixtral", "olmoe",
               "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe", "glm4_moe_lite", "llama4", "llama4_text", "dbrx",
               "ernie4_5_moe", "granitemoe", "granitemoeshared", "phimoe", "jamba", "hunyuan_v1_moe", "minimax_m2",
               "minimax", "dots1")
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
    def no_constant(name: str):  # Python's json reads NaN and Infinity, which JSON has not: a NaN rope_theta ran
        raise ValueError(f"{name} is not a JSON number")

    try:
        cfg = json.loads(read_bytes(path, "model config", JSON_CAP).decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError:
        raise MoesimError(f"cannot read {path}: not UTF-8 text (a config.json is expected)") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise MoesimError(f"cannot read {path}: not valid JSON ({e})") from None
    except RecursionError:
        raise MoesimError(f"cannot read {path}: JSON nested too deeply for a config") from None
    if not isinstance(cfg, dict):
        raise MoesimError(f"{path}: not a JSON object")
    return cfg
