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

#: The file types as llama.cpp prints them in a model's description (llama-bench's ``model``
#: column, ``print_info: file type = ...``): ``llama_model_ftype_name`` in
#: src/llama-model-loader.cpp (ggml-org/llama.cpp), with the names ik_llama.cpp adds in its
#: own copy of that function (src/llama.cpp). Each maps to the name users type, lower case:
#: a key of :data:`RECIPES` where moesim knows the file llama-quantize writes, a weight format
#: of :data:`moesim.models.DTYPES` for the unquantised types, else a name without a recipe
#: (``q3_k_m``), which :func:`file_type_in` returns so that the caller can say so.
FTYPE_NAMES = {
    "all F32": "fp32", "F16": "fp16", "BF16": "bf16", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0",
    "Q5_1": "q5_1", "Q8_0": "q8_0", "MXFP4 MoE": "mxfp4_moe", "Q2_K - Medium": "q2_k", "Q2_K - Small": "q2_k_s",
    "Q3_K - Small": "q3_k_s", "Q3_K - Medium": "q3_k_m", "Q3_K - Large": "q3_k_l", "Q4_K - Small": "q4_k_s",
    "Q4_K - Medium": "q4_k_m", "Q5_K - Small": "q5_k_s", "Q5_K - Medium": "q5_k_m", "Q6_K": "q6_k",
    "TQ1_0 - 1.69 bpw ternary": "tq1_0", "TQ2_0 - 2.06 bpw ternary": "tq2_0", "IQ2_XXS - 2.0625 bpw": "iq2_xxs",
    "IQ2_XS - 2.3125 bpw": "iq2_xs", "IQ2_S - 2.5 bpw": "iq2_s", "IQ2_M - 2.7 bpw": "iq2_m",
    "IQ3_XS - 3.3 bpw": "iq3_xs", "IQ3_XXS - 3.0625 bpw": "iq3_xxs", "IQ1_S - 1.5625 bpw": "iq1_s",
    "IQ1_M - 1.75 bpw": "iq1_m", "IQ4_NL - 4.5 bpw": "iq4_nl", "IQ4_XS - 4.25 bpw": "iq4_xs",
    "IQ3_S - 3.4375 bpw": "iq3_s", "IQ3_S mix - 3.66 bpw": "iq3_m",
    # ik_llama.cpp's own types (its llama_model_ftype_name)
    "IQ2_K - 2.375 bpw": "iq2_k", "IQ2_KS - 2.1875 bpw": "iq2_ks", "IQ2_KL - 2.6875 bpw": "iq2_kl",
    "IQ3_K - 3.4325 bpw": "iq3_k", "IQ3_KL - 4 bpw": "iq3_kl", "IQ4_K - 4.5 bpw": "iq4_k",
    "IQ4_KS - 4.25 bpw": "iq4_ks", "IQ4_KSS - 4.0 bpw": "iq4_kss", "IQ5_K - 5.5 bpw": "iq5_k",
    "IQ5_KS - 5.25 bpw": "iq5_ks", "IQ6_K - 6.6 bpw": "iq6_k", "IQ1_KT - 1.75 bpw": "iq1_kt",
    "IQ2_KT - 2.125 bpw": "iq2_kt", "IQ3_KT - 3.125 bpw": "iq3_kt", "IQ4_KT - 4.0 bpw": "iq4_kt",
}


def canonical(name: str) -> str:
    """A file type or weight format as moesim keys it, in any spelling llama.cpp prints or
    users type: case-insensitive (``Q4_K_M``, ``q4_k_m``, ``Q4_K - Medium`` are one), a
    printed name mapped by :data:`FTYPE_NAMES`, an alias (:data:`ALIASES`) to its base type."""
    text = " ".join(name.split())
    key = _PRINTED.get(text.lower(), text.lower())
    return ALIASES.get(key, key)


_PRINTED = {k.lower(): v for k, v in FTYPE_NAMES.items()}


def approximation_note(name: str) -> str | None:
    """What a result must say when ``name`` is priced as another file type (an Unsloth dynamic
    quant, :data:`ALIASES`), else None."""
    key = " ".join(name.split()).lower()
    if key not in ALIASES:
        return None
    return (f"{name} is priced as its base file type {ALIASES[key]} (llama-quantize's recipe): Unsloth's dynamic "
            "quants keep attention and shared weights in more bits and differ per release; the file itself, given "
            "with --model FILE.gguf, is read tensor by tensor")


def printed_name(key: str) -> str | None:
    """The name llama.cpp prints for the file type ``key`` (:func:`canonical`'s), None for one it has not."""
    key = canonical(key)
    return next((printed for printed, k in FTYPE_NAMES.items() if k == key), None)


def file_type_in(description: str | None) -> tuple[str, str] | None:
    """The file type a llama.cpp model description names at its end (``qwen3moe 30B.A3B Q4_K -
    Medium`` -> ("Q4_K - Medium", "q4_k_m")): the printed name and its key, None when it names
    none (the longest printed name wins: "Q2_K - Small" before "Q2_K")."""
    if not description:
        return None
    text = " ".join(description.split()).lower()
    for printed in sorted(FTYPE_NAMES, key=len, reverse=True):
        p = printed.lower()
        if text == p or text.endswith(" " + p):
            return printed, FTYPE_NAMES[printed]
    return None


def has_recipe(key: str) -> bool:
    """Whether moesim can price a model stored as ``key`` (:func:`canonical`'s name) whole:
    a llama.cpp file type with a recipe, or a weight format of :data:`moesim.models.DTYPES`."""
    return key in RECIPES or key in DTYPES


def apply_recipe(spec: ModelSpec, file_type: str) -> ModelSpec:
    """``spec`` stored as llama-quantize's ``file_type`` (a name of :data:`RECIPES` or
    :data:`ALIASES`): per-MoE-layer expert bytes, the dense, head and embedding formats."""
    key = canonical(file_type)
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
    key = canonical(fmt)
    if key in RECIPES:
        out = apply_recipe(spec, key)
        return replace(out, name=f"{spec.name}@{key}")
    return spec.with_expert_dtype(key if key in DTYPES else fmt)


def is_format(fmt: str) -> bool:
    """Whether ``fmt`` names a llama.cpp file type or a weight format moesim knows."""
    return has_recipe(canonical(fmt)) or fmt in DTYPES
