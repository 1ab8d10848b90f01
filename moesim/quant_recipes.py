"""What a llama.cpp file type stores each tensor as, when only its name is known.

A GGUF file says every tensor's type (``moesim.gguf_file`` reads it exactly); a user who
only knows "Q4_K_M" (or "Q4_0", "IQ4_NL", ...) gets the file llama-quantize would write.
The rules are llama.cpp's own (``src/llama-quant.cpp`` at 0c1e57098,
``llama_ftype_get_default_type`` and ``llama_tensor_get_type_impl``): Q4_K_M stores the
expert ``gate``/``up`` matrices in Q4_K and ``ffn_down`` in Q6_K on the layers
``use_more_bits`` picks (the first and last eighth, and every third one between), the LM
head in Q6_K; the plain types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) store every matrix in the
type and the LM head in Q6_K; MXFP4_MOE (gpt-oss's native file) the experts in MXFP4 and
every other matrix in Q8_0. A matrix whose input dimension is no multiple of the type's
block takes llama-quantize's fallback (``tensor_type_fallback``: Q4_K -> Q5_0, Q6_K ->
Q8_0, the 256-blocks i-quants -> IQ4_NL, ...; the LM head Q8_0), so a model with
DeepSeek-V2-Lite's 1,408-wide experts has a Q4_K_M file, as it does on disk.
Unsloth's dynamic quants (``UD-*``) keep attention and shared weights in more bits and
differ per release; they are approximated by their base type, and a result says so.
"""

from __future__ import annotations

import math
from dataclasses import replace

from moesim.errors import MoesimError
from moesim.models import DTYPES, ModelSpec, matrix_bytes


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose ``ffn_down`` gets more bits."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


#: file type -> (expert gate/up, expert down on use_more_bits layers, other down, dense, head, embedding)
RECIPES: dict[str, tuple[str, str, str, str, str, str]] = {
    "q4_k_m": ("q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q4_k"),
    "q4_k_s": ("q4_k", "q4_k", "q4_k", "q4_k", "q6_k", "q4_k"),
    "q5_k_m": ("q5_k", "q6_k", "q5_k", "q5_k", "q6_k", "q5_k"),
    "q6_k": ("q6_k", "q6_k", "q6_k", "q6_k", "q6_k", "q6_k"),
    "q8_0": ("q8_0", "q8_0", "q8_0", "q8_0", "q8_0", "q8_0"),
    "q2_k": ("q2_k", "q3_k", "q3_k", "q4_k", "q6_k", "q2_k"),
    "iq1_s": ("iq1_s", "iq2_xxs", "iq1_s", "q4_k", "q6_k", "q4_k"),
    "iq3_xxs": ("iq3_xxs", "q4_k", "iq3_xxs", "q4_k", "q6_k", "iq3_xxs"),
    "iq4_xs": ("iq4_xs", "iq4_xs", "iq4_xs", "iq4_xs", "q6_k", "iq4_xs"),
    # The plain types: llama_ftype_get_default_type for every matrix, the output Q6_K.
    "q4_0": ("q4_0", "q4_0", "q4_0", "q4_0", "q6_k", "q4_0"),
    "q4_1": ("q4_1", "q4_1", "q4_1", "q4_1", "q6_k", "q4_1"),
    "q5_0": ("q5_0", "q5_0", "q5_0", "q5_0", "q6_k", "q5_0"),
    "q5_1": ("q5_1", "q5_1", "q5_1", "q5_1", "q6_k", "q5_1"),
    "iq4_nl": ("iq4_nl", "iq4_nl", "iq4_nl", "iq4_nl", "q6_k", "iq4_nl"),
    # gpt-oss's native GGUF: llama_tensor_get_type_impl's MXFP4_MOE branch, "MoE tensors ->
    # MXFP4, other tensors -> Q8_0", the output tensor Q8_0 (11.27 GiB for gpt-oss-20b, as
    # llama-bench reports the file).
    "mxfp4_moe": ("mxfp4-gguf", "mxfp4-gguf", "mxfp4-gguf", "q8_0", "q8_0", "q8_0"),
}
#: llama-quantize's fallback for a matrix whose input dimension is no multiple of the
#: type's block (``tensor_type_fallback``); a fallback that does not fit either is F16.
FALLBACK = {"iq1_s": "iq4_nl", "iq1_m": "iq4_nl", "iq2_xxs": "iq4_nl", "iq2_xs": "iq4_nl", "iq2_s": "iq4_nl",
            "iq3_xxs": "iq4_nl", "iq3_s": "iq4_nl", "iq4_xs": "iq4_nl", "q2_k": "q4_0", "q3_k": "q4_0",
            "tq1_0": "q4_0", "tq2_0": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _block(dtype: str) -> int:
    from moesim.spec import GGML_BLOCKS

    return GGML_BLOCKS[dtype][0] if dtype in GGML_BLOCKS else 1


def stored_type(dtype: str, cols: int, output: bool = False) -> str:
    """The type llama-quantize writes a matrix of ``cols`` input columns in, asked for
    ``dtype``: ``dtype`` when its blocks divide the row, else the fallback (the LM head:
    Q8_0), else F16 (moesim's ``fp16``)."""
    if cols % _block(dtype) == 0:
        return dtype
    fallback = "q8_0" if output else FALLBACK.get(dtype, dtype)
    return fallback if cols % _block(fallback) == 0 else "fp16"
#: Names people write for them (Unsloth's dynamic quants: their base type).
ALIASES = {"ud-q4_k_xl": "q4_k_m", "ud-iq1_s": "iq1_s", "ud-iq3_xxs": "iq3_xxs", "q2_k_xs": "q2_k",
           "ud-q2_k_xl": "q2_k"}


def apply_recipe(spec: ModelSpec, file_type: str) -> ModelSpec:
    """``spec`` stored as llama-quantize's ``file_type`` (a name of :data:`RECIPES` or
    :data:`ALIASES`): per-MoE-layer expert bytes, the dense, head and embedding formats."""
    key = file_type.strip().lower()
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        raise MoesimError(f"unknown llama.cpp file type {file_type!r}; known: {', '.join([*RECIPES, *ALIASES])}")
    gate_up, down_more, down, dense, head, embed = RECIPES[key]
    h, i = spec.hidden, spec.expert_inter
    gate_up = stored_type(gate_up, h)  # gate and up read the hidden state; down the expert's own width
    head, embed = stored_type(head, h, output=True), stored_type(embed, h)
    # One format holds every dense matrix here: the one that fits each of their input widths
    # (llama-quantize falls back for the odd one only: a dense FFN's down of 10,944 columns in
    # DeepSeek-V2-Lite is Q5_0 in its Q4_K_M file; here its other dense matrices are too).
    for cols in {h, spec.dense_inter or h, (spec.shared_inter or i) if spec.n_shared else h}:
        dense = stored_type(dense, cols)
    try:
        per_layer = []
        for layer in spec.moe_layers:
            d = stored_type(down_more if use_more_bits(layer, spec.n_layers) else down, i)
            n = (2 if spec.expert_gated else 1) * matrix_bytes(i, h, gate_up) + matrix_bytes(h, i, d)
            per_layer.append(n + (2 * (2 * i + h) if spec.expert_bias else 0))
        out = replace(spec, expert_dtype=gate_up, dense_dtype=dense, head_dtype=head, embed_dtype=embed,
                      expert_bytes_by_layer=tuple(per_layer))
    except MoesimError as e:  # a dimension the block format cannot hold (gpt-oss's 2,880 in K-quants)
        raise MoesimError(f"{spec.name} cannot be stored as {file_type}: {e}") from None
    if not math.isfinite(out.expert_bytes):
        raise MoesimError(f"{spec.name} as {file_type}: no expert size")
    return out


def store_as(spec: ModelSpec, fmt: str) -> ModelSpec:
    """``spec`` stored as ``fmt``: a llama.cpp file type (every tensor, :func:`apply_recipe`)
    or a weight format of :data:`moesim.models.DTYPES` for the routed experts."""
    key = fmt.strip().lower()
    if key in RECIPES or key in ALIASES:
        out = apply_recipe(spec, key)
        return replace(out, name=f"{spec.name}@{key}")
    return spec.with_expert_dtype(fmt)


def is_format(fmt: str) -> bool:
    """Whether ``fmt`` names a llama.cpp file type or a weight format moesim knows."""
    key = fmt.strip().lower()
    return key in RECIPES or key in ALIASES or fmt in DTYPES
