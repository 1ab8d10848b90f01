"""Weight formats and exact bytes from a checkpoint's own artefacts.

- :func:`formats_from_config`: ``torch_dtype`` and ``quantization_config`` (or mlx's
  ``quantization``) -> moesim formats for the routed experts, the other layer weights, the
  input embedding and the LM head. Each repack's bytes follow its published layout (see
  :data:`moesim.models.DTYPES` and docs/models.md); a method moesim cannot size is refused
  in one line, never read as bf16.
- :func:`exact_bytes`: the safetensors headers of a folder (the JSON header only, no tensor
  data) give every tensor's stored size; the spec then carries the artefact's exact bytes
  per routed expert and MoE layer, per layer of non-expert weights, embedding, head and MTP.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.inputs import JSON_CAP, check_input, read_bytes
from moesim.spec import DTYPES, HF_DTYPES, ModelSpec

#: quantization_config methods moesim sizes (others are refused in one line).
QUANT_METHODS = ("fp8", "fbgemm_fp8", "mxfp4", "gptq", "awq", "compressed-tensors", "bitsandbytes", "mlx", "modelopt")


def _repack(bits: Any, group: Any, kind: str, path: Path, method: str) -> str:
    if group in (-1, None, 0):
        raise MoesimError(f"{path}: {method} without groups (group_size {group}) is not sized; group-wise only")
    name = f"int{bits}-g{group}-{kind}"
    if name not in DTYPES:
        raise MoesimError(f"{path}: {method} with {bits} bits and groups of {group} is not sized "
                          "(bits 2, 3, 4, 6, 8; groups 32, 64, 128)")
    return name


def _ct_format(group: dict[str, Any], path: Path) -> str:
    """A compressed-tensors ``config_groups`` entry's weight format."""
    w = group.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if kind == "float" and bits == 8:
        if strategy == "channel":
            return "fp8-channel"
        if strategy == "tensor":
            return "fp8-tensor"
        if strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return "fp8-block128"
    if kind == "float" and bits == 4 and strategy in ("group", "tensor_group") and w.get("group_size") == 16:
        return "nvfp4"
    if kind == "int" and strategy == "group":
        return _repack(bits, w.get("group_size"), "sym" if w.get("symmetric", True) else "awq", path,
                       "compressed-tensors")
    if kind == "int" and bits == 8 and strategy == "channel":
        return "int8"
    raise MoesimError(f"{path}: compressed-tensors weights {kind} {bits}-bit by {strategy} are not sized")


def _skip_list(quant: dict[str, Any], key: str, path: Path) -> list[str]:
    """``quant[key]``, the modules a quantisation leaves alone: a list of names or ``re:``
    patterns (a string alone was read a letter at a time: ``"self_attn"``'s ``s`` matched
    the experts; a pattern that is no regular expression was a traceback)."""
    skip = quant.get(key)
    if skip is None:
        return []
    if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
        raise MoesimError(f"{path}: quantization_config.{key} is {skip!r}: a list of module names")
    for p in skip:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise MoesimError(f"{path}: quantization_config.{key} pattern {p!r} is not a regular expression "
                                  f"({e})") from None
    return skip


def _ignored(patterns: list[str], *names: str) -> bool:
    """Whether any module name matches an ignore / skip list (plain names or ``re:`` patterns)."""
    for p in patterns or []:
        p = str(p)
        for n in names:
            if (p.startswith("re:") and re.search(p[3:], n)) or p == n or n.endswith(p) or p.endswith(n):
                return True
    return False


def formats_from_config(raw: dict[str, Any], path: Path) -> tuple[str, str, str, str]:
    """(expert, dense, embedding, head) formats of a config (its top level: a multimodal
    wrapper's ``quantization_config`` and dtype apply to its decoder)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    given = [d for src in (raw, text) for d in (src.get("dtype"), src.get("torch_dtype")) if d is not None]
    dtype = given[0] if given else "bfloat16"  # "" or [] is a wrong dtype, not an absent one
    if not isinstance(dtype, str) or dtype not in HF_DTYPES:
        raise MoesimError(f"{path}: torch_dtype {dtype!r} not supported ({', '.join(HF_DTYPES)})")
    base = HF_DTYPES[dtype]
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("quantization"), dict):  # mlx-lm writes "quantization"
        quant = {"quant_method": "mlx", **raw["quantization"]}
    if quant is None:
        quant = text.get("quantization_config")
    quant = quant or {}
    if not isinstance(quant, dict):
        raise MoesimError(f"{path}: quantization_config must be an object")
    method = str(quant.get("quant_method", "")).lower()
    if not method and {"bits", "group_size"} <= set(quant):
        method = "mlx"
    if not method:
        return base, base, base, base
    if method in ("fp8", "fbgemm_fp8"):
        block = quant.get("weight_block_size", [128, 128])
        if method == "fbgemm_fp8":
            fmt = "fp8-channel"
        elif block is None:
            fmt = "fp8-tensor"
        elif not isinstance(block, list) or block != [128, 128]:
            raise MoesimError(f"{path}: fp8 block size {block} not supported (only 128x128)")
        else:
            fmt = "fp8-block128"
        skip = _skip_list(quant, "modules_to_not_convert", path)  # kept in the model's dtype, as transformers loads them
        return (base if _ignored(skip, "experts") else fmt, base if _ignored(skip, "self_attn", "attn") else fmt,
                base, base)
    if method == "mxfp4":
        return "mxfp4", base, base, base
    if method in ("gptq", "awq"):
        bits = quant.get("bits", quant.get("w_bit"))
        group = quant.get("group_size", quant.get("q_group_size"))
        if method == "awq" and not quant.get("zero_point", True):
            raise MoesimError(f"{path}: AWQ without zero points is not sized")
        fmt = _repack(bits, group, method, path, method.upper())
        skip = _skip_list(quant, "modules_to_not_convert", path)
        dense = base if _ignored(skip, "self_attn", "attn") else fmt
        return fmt, dense, base, base
    if method == "bitsandbytes":
        if quant.get("load_in_4bit"):
            fmt = "nf4-bnb-dq" if quant.get("bnb_4bit_use_double_quant") else "nf4-bnb"
        elif quant.get("load_in_8bit"):
            fmt = "int8-bnb"
        else:
            raise MoesimError(f"{path}: bitsandbytes config loads neither 4-bit nor 8-bit")
        skip = _skip_list(quant, "llm_int8_skip_modules", path)
        return fmt, base if _ignored(skip, "self_attn") else fmt, base, base
    if method == "mlx":
        fmt = _repack(quant.get("bits"), quant.get("group_size"), "mlx", path, "mlx")
        return fmt, fmt, fmt, fmt  # mlx-lm quantises embeddings and the head too
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        if not groups:
            raise MoesimError(f"{path}: compressed-tensors config has no config_groups")
        fmts = {_ct_format(g, path) for g in groups.values()}
        if len(fmts) != 1:
            raise MoesimError(f"{path}: compressed-tensors mixes formats {sorted(fmts)}; per-module formats need "
                              "the safetensors files")
        fmt = fmts.pop()
        ignore = _skip_list(quant, "ignore", path)
        dense = base if _ignored(ignore, "model.layers.0.self_attn.q_proj", "self_attn") else fmt
        return fmt, dense, base, base
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "nvfp4", "nvfp4", base, base
        if algo == "FP8":
            return "fp8-tensor", "fp8-tensor", base, base
        raise MoesimError(f"{path}: modelopt quant_algo {algo!r} is not sized (NVFP4, FP8)")
    raise MoesimError(f"{path}: quantisation {method!r} not supported (sized: {', '.join(QUANT_METHODS)})")


# --------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h|blk)\.(\d+)\.")
_SKIP = ("vision", "visual", "multi_modal_projector", "audio", "mm_projector", "image_newline", "patch_embed")


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (8-byte little-endian length, then JSON);
    no tensor data is read. A device, socket or pipe is one line, never opened (a FIFO
    named model.safetensors would block the open)."""
    if check_input(path, "safetensors file") != "file":
        raise MoesimError(f"safetensors file {path} is a pipe, not a regular file: weights are read from files")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise MoesimError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise MoesimError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise MoesimError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MoesimError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise MoesimError(f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    _check_layout(path, header, os.stat(path).st_size - 8 - n)
    return header


#: Bytes an element of each safetensors dtype takes (the format's own list; a packed sub-byte
#: dtype is left out, its tensors' sizes are not checked).
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                           "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_layout(path: Path, header: dict[str, Any], data_len: int) -> None:
    """Every tensor's entry is a dtype, a shape and offsets inside the file, its bytes those
    its dtype and shape take, and the tensors cover the data to the file's end, as the
    safetensors library requires when it loads (there a truncated file, an edited dtype or an
    offset past the end is an exception after the model began loading; here one line)."""
    end = 0
    for name, t in header.items():
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        shape = t.get("shape") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)
                and isinstance(shape, list) and all(type(v) is int and v >= 0 for v in shape)
                and isinstance(t.get("dtype"), str)):
            raise MoesimError(f"{path}: tensor {name}'s header entry is not a dtype, a shape and two data offsets: "
                              "not a valid safetensors file")
        a, b = offsets
        if not 0 <= a <= b:
            raise MoesimError(f"{path}: tensor {name}'s data offsets {offsets} are not an interval: corrupt")
        if b > data_len:
            raise MoesimError(f"{path}: tensor {name} ends at byte {b} of the data; the file holds {max(0, data_len)}: "
                              "truncated or corrupt (download it again)")
        size = SAFETENSORS_DTYPE_BYTES.get(t["dtype"])
        if size is not None and b - a != size * math.prod(shape):
            raise MoesimError(f"{path}: tensor {name} takes {b - a} bytes; {t['dtype']} of shape {shape} takes "
                              f"{size * math.prod(shape)}: the header was edited or the file is corrupt")
        end = max(end, b)
    if header and end != data_len:
        raise MoesimError(f"{path}: its tensors cover {end} bytes of the data; the file holds {max(0, data_len)}: "
                          "truncated or corrupt (download it again)")


def tensor_bytes(folder: Path) -> dict[str, int] | None:
    """Stored bytes of every tensor in the folder's safetensors files (None without any)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint names its files; other .safetensors beside it are not the model
        try:
            names = set(json.loads(read_bytes(index, "safetensors index", JSON_CAP)).get("weight_map", {}).values())
        except (ValueError, AttributeError, TypeError):
            raise MoesimError(f"{index}: not a safetensors index (weight_map)") from None
        files = sorted(folder / n for n in names)
    else:
        files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    sizes: dict[str, int] = {}
    for f in files:
        for name, t in safetensors_header(f).items():
            try:
                a, b = t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise MoesimError(f"{f}: tensor {name} has no data_offsets") from None
            sizes[name] = int(b) - int(a)
    return sizes


def exact_bytes(spec: ModelSpec, folder: Path) -> ModelSpec:
    """``spec`` with the bytes the folder's safetensors headers give (unchanged without
    them, or when the files do not hold every layer: a partial download)."""
    sizes = tensor_bytes(folder)
    if not sizes:
        return spec
    return apply_tensor_bytes(spec, sizes, str(folder))


def apply_tensor_bytes(spec: ModelSpec, sizes: dict[str, int], where: str, expert_marks=(".experts.",),
                       embed_names=("embed_tokens", "wte", "tok_embeddings", "word_embeddings"),
                       head_names=("lm_head", "output.weight"), final_norm=("model.norm.", "norm_f", "ln_f")) -> ModelSpec:
    """Distribute tensor sizes (name -> bytes) over the spec's layers."""
    layer_bytes = [0] * spec.n_layers
    expert_bytes = [0] * spec.n_layers
    embed = head = norm = mtp = 0
    seen_layers: set[int] = set()
    for name, b in sizes.items():
        if any(s in name for s in _SKIP):
            continue
        m = _LAYER.search(name)
        if m:
            i = int(m.group(1))
            if i >= spec.n_layers:
                mtp += b
                continue
            seen_layers.add(i)
            if any(mark in name for mark in expert_marks) and "shared_expert" not in name:
                expert_bytes[i] += b
            else:
                layer_bytes[i] += b
        elif any(e in name for e in embed_names):
            embed += b
        elif any(h in name for h in head_names):
            head += b
        elif any(n in name for n in final_norm) or name.startswith("norm."):
            norm += b
        elif name.startswith("mtp.") or ".mtp." in name:
            mtp += b
    if seen_layers != set(range(spec.n_layers)) or any(expert_bytes[i] == 0 for i in spec.moe_layers):
        return spec  # not every layer's tensors are here (a partial download): keep the formula
    per = []
    for i in spec.moe_layers:
        q, r = divmod(expert_bytes[i], spec.n_experts)
        if r:
            raise MoesimError(f"{where}: layer {i}'s routed experts hold {expert_bytes[i]} bytes, not a multiple of "
                              f"{spec.n_experts} experts")
        per.append(q)
    if spec.tie_embeddings and not head:  # the head is the input table itself
        head, embed = embed, 0
    return replace(spec, expert_bytes_by_layer=tuple(per), artefact_layer_bytes=tuple(layer_bytes),
                   artefact_head_bytes=head + norm, artefact_embed_bytes=embed if not spec.tie_embeddings else 0,
                   artefact_mtp_bytes=mtp if spec.n_mtp_layers else 0)
