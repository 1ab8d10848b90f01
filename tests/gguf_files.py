"""Synthetic GGUF files for the tests (tests only): real gguf-py headers, zero tensor data.

Each tensor is written with the ggml type given and exactly the bytes that type stores for
its shape, so what moesim reads back is what a llama.cpp quantisation of that geometry
would hold. None of these is a real model's file: geometry and types are chosen here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


def _add(w, name: str, shape: tuple[int, ...], qtype) -> None:
    """A zero tensor of numpy ``shape`` (rows last = input dimension) stored as ``qtype``."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (T.F32, T.F16, T.BF16):
        dt = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[qtype]
        w.add_tensor(name, np.zeros(shape, dt), raw_dtype=qtype if qtype == T.BF16 else None)
        return
    assert shape[-1] % per == 0, (name, shape, qtype)
    data = np.zeros((*shape[:-1], shape[-1] // per * size), np.uint8)
    w.add_tensor(name, data, raw_dtype=qtype)  # gguf-py turns the byte shape into the element shape


def qwen3moe_gguf(path: Path, layers: int = 4, experts: int = 8, hidden: int = 256, inter: int = 256,
                  heads: int = 4, kv: int = 2, head_dim: int = 64, vocab: int = 512, top_k: int = 2,
                  gate_types=None, down_types=None, attn_type=T.Q4_K, embed_type=T.Q4_K, head_type=T.Q6_K,
                  parts: int = 1, meta: dict | None = None, drop: tuple[str, ...] = ()) -> list[Path]:
    """A Qwen3-MoE-shaped GGUF ("Q4_K_M"-like by default: experts Q4_K, ffn_down Q6_K in
    every other layer, output Q6_K), split into ``parts`` files when > 1. ``meta``: metadata
    keys (without the architecture) whose u32 value replaces the geometry's, None leaving the
    key out; ``drop``: tensors left out (broken files)."""
    gate_types = gate_types or [T.Q4_K] * layers
    down_types = down_types or [T.Q6_K if i % 2 == 0 else T.Q4_K for i in range(layers)]
    arch = "qwen3moe"
    tensors = [("token_embd.weight", (vocab, hidden), embed_type), ("output_norm.weight", (hidden,), T.F32),
               ("output.weight", (vocab, hidden), head_type)]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (hidden,), T.F32), (b + "ffn_norm.weight", (hidden,), T.F32),
                    (b + "attn_q.weight", (heads * head_dim, hidden), attn_type),
                    (b + "attn_k.weight", (kv * head_dim, hidden), attn_type),
                    (b + "attn_v.weight", (kv * head_dim, hidden), attn_type),
                    (b + "attn_output.weight", (hidden, heads * head_dim), attn_type),
                    (b + "attn_q_norm.weight", (head_dim,), T.F32), (b + "attn_k_norm.weight", (head_dim,), T.F32),
                    (b + "ffn_gate_inp.weight", (experts, hidden), T.F32),
                    (b + "ffn_gate_exps.weight", (experts, inter, hidden), gate_types[i]),
                    (b + "ffn_up_exps.weight", (experts, inter, hidden), gate_types[i]),
                    (b + "ffn_down_exps.weight", (experts, hidden, inter), down_types[i])]
    tensors = [t for t in tensors if t[0] not in drop]
    per_part = -(-len(tensors) // parts)
    paths = []
    for p in range(parts):
        name = path if parts == 1 else path.with_name(f"{path.stem}-{p + 1:05d}-of-{parts:05d}.gguf")
        w = gguf.GGUFWriter(str(name), arch)
        if p == 0:
            for k, v in (("block_count", layers), ("embedding_length", hidden), ("feed_forward_length", inter * 4),
                         ("expert_feed_forward_length", inter), ("expert_count", experts), ("expert_used_count", top_k),
                         ("attention.head_count", heads), ("attention.head_count_kv", kv),
                         ("attention.key_length", head_dim), ("attention.value_length", head_dim)):
                v = (meta or {}).get(k, v)
                if v is not None:
                    w.add_uint32(f"{arch}.{k}", v)
            w.add_string("general.name", "synthetic-qwen3moe")
            w.add_token_list([f"t{i}" for i in range(vocab)])
        if parts > 1:
            w.add_uint16("split.no", p)
            w.add_uint16("split.count", parts)
            w.add_int32("split.tensors.count", len(tensors))
        for n, shape, q in tensors[p * per_part:(p + 1) * per_part]:
            _add(w, n, shape, q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(name)
    return paths
