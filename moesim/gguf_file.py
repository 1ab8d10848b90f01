"""GGUF files (llama.cpp) -> :class:`moesim.models.ModelSpec` with the file's exact bytes.

Read through gguf-py (``gguf.GGUFReader``, the reader llama.cpp maintains): the geometry
from the metadata (``{arch}.block_count``, ``expert_count``, ``expert_used_count``,
``embedding_length``, ``expert_feed_forward_length``, ``leading_dense_block_count``,
``expert_shared_count``, attention and MLA keys, ``nextn_predict_layers``...), and every
tensor's real ggml type and stored size (a Q4_K_M file mixes Q4_K and Q6_K; Q2_K, Q3_K and
the IQ types are sized the same way). The type sizes are gguf-py's ``GGML_QUANT_SIZES``
(through ``ReaderTensor.n_bytes``): a maintained library table is preferred over a
hand-written one. Split files (``name-00001-of-00003.gguf``) are followed: every part is
read, the first holds the metadata.

Only the headers are read (gguf-py memory-maps the file; no tensor data is touched).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from moesim.artefacts import apply_tensor_bytes
from moesim.errors import MoesimError
from moesim.fmt import printable
from moesim.inputs import check_name, kind_of, original_names, readable_path
from moesim.spec import DTYPES, Attention, LinearAttention, ModelSpec

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")
#: GGUF architectures whose attention is MLA (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash).
MLA_ARCHS = ("deepseek2", "glm4moe_lite", "kimi_k2")
#: ggml type names moesim knows under another name.
GGML_TO_DTYPE = {"F16": "fp16", "BF16": "bf16", "F32": "fp32", "MXFP4": "mxfp4-gguf", "NVFP4": "nvfp4-gguf"}


def _gguf():
    try:
        import gguf
    except ModuleNotFoundError:
        raise MoesimError("reading a .gguf file needs gguf-py: pip install gguf") from None
    return gguf


def parts_of(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF model, first part first."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count, no = int(m["count"]), int(m["no"])
    if not 1 <= no <= count:
        raise MoesimError(f"{path}: a split GGUF file's name says part {no} of {count}; parts count from 1 "
                          "to their number")
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if kind_of(f) == "missing"]
    if missing:
        raise MoesimError(f"{path}: split GGUF part {missing[0]} is missing ({len(missing)} of {count} parts)")
    return files


def _reader(path: Path):
    """gguf-py's reader (it maps the file): a pipe's bytes are spooled to a file first; a
    device, a socket or a silent named pipe is one line (moesim.inputs)."""
    gguf = _gguf()
    where, path = path, readable_path(path, "GGUF file")
    _check_counts(path, where)
    try:
        return gguf.GGUFReader(str(path), "r")
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, EOFError, UnicodeDecodeError,
            MemoryError) as e:
        raise MoesimError(f"{where}: not a readable GGUF file "
                          f"({original_names(str(e)).splitlines()[0][:120] if str(e) else type(e).__name__})") from None


# The fewest bytes one tensor's description (name length, dimension count, one dimension, type,
# offset) and one metadata pair (key length, value type, a one-byte value) take in a GGUF header.
_TENSOR_INFO_MIN, _KV_MIN = 8 + 4 + 8 + 4 + 8, 8 + 4 + 1


def _check_counts(path: Path, where: Path) -> None:
    """One line for a header whose tensor or metadata count the file is too short to hold,
    before gguf-py reads it (it would loop over 10^12 declared tensors for seconds, holding a
    gigabyte, before failing). The header: magic, version (u32), then the two counts (u64),
    little- or big-endian."""
    with open(path, "rb") as f:
        head = f.read(24)
        size = f.seek(0, 2)
    if len(head) < 24 or head[:4] != b"GGUF":
        return  # gguf-py's own message says what it is not
    order = "little" if int.from_bytes(head[4:8], "little") < 1 << 16 else "big"
    n_tensors, n_kv = (int.from_bytes(head[i:i + 8], order) for i in (8, 16))
    if 24 + n_tensors * _TENSOR_INFO_MIN + n_kv * _KV_MIN > size:
        raise MoesimError(f"{where}: not a readable GGUF file (its header declares {n_tensors} tensors and {n_kv} "
                          f"metadata keys, more than its {size} bytes can hold)")


def _value(field) -> Any:
    """A metadata field's value: a scalar, a string, or a list."""
    gguf = _gguf()
    v = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return list(v)
    return v


def metadata(reader) -> dict[str, Any]:
    return {name: _value(f) for name, f in reader.fields.items() if not name.startswith("tokenizer.ggml.")}


def _dtype(type_name: str) -> str:
    d = GGML_TO_DTYPE.get(type_name, type_name.lower())
    if d not in DTYPES:
        raise MoesimError(f"ggml type {type_name} is not sized by moesim")
    return d


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """A spec for the model in a GGUF file (or the first part of a split one): geometry
    from its metadata, the routed experts' and every layer's bytes from its tensors."""
    path = check_name(Path(path), "GGUF file")
    if kind_of(path) == "missing":
        raise MoesimError(f"GGUF file {path} does not exist")
    if kind_of(path) == "folder":
        raise MoesimError(f"GGUF file {path} is a folder, not a file")
    files = parts_of(path)
    readers = [_reader(f) for f in files]
    meta = metadata(readers[0])
    tensors: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    for r in readers:
        for t in r.tensors:
            tensors[t.name] = (t.tensor_type.name, int(t.n_bytes), tuple(int(x) for x in t.shape))
    vocab = None
    tok = readers[0].fields.get("tokenizer.ggml.tokens")
    if tok is not None:
        vocab = len(tok.data)
    return spec_from_metadata(meta, tensors, str(path), vocab)


def spec_from_metadata(meta: dict[str, Any], tensors: dict[str, tuple[str, int, tuple[int, ...]]], where: str,
                       vocab: int | None = None) -> ModelSpec:
    """The spec from GGUF metadata and ``name -> (ggml type, bytes, shape)`` of every tensor."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise MoesimError(f"{where}: no general.architecture in the GGUF metadata")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if required and v is None:
            raise MoesimError(f"{where}: GGUF metadata has no {arch}.{name} (not an MoE model, or an architecture "
                              "moesim does not read)")
        if isinstance(v, list) and v and all(x == v[0] for x in v):
            v = v[0]  # a per-layer list of equal values (head_count_kv of some files)
        if isinstance(v, list):
            raise MoesimError(f"{where}: {arch}.{name} differs between layers; not modelled")
        return v

    def count(name: str, required: bool = True, default: Any = None) -> int:
        v = key(name, default, required)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoesimError(f"{where}: GGUF metadata {arch}.{name} is {v!r}, not a positive whole number")
        return v

    n_experts = count("expert_count")
    top_k = count("expert_used_count")
    blocks = count("block_count")
    nextn = int(key("nextn_predict_layers", 0) or 0)
    n_layers = blocks - nextn
    blk = {int(m[1]) for name in tensors if (m := _BLOCK.match(name))}
    if n_layers < 1 or n_layers > len(blk) or max(blk, default=-1) >= blocks:  # fewer blocks, or tensors beyond them
        raise MoesimError(f"{where}: GGUF metadata {arch}.block_count says {blocks} blocks ({nextn} of them MTP), "
                          f"but its tensors describe {len(blk)}" + (f" (up to blk.{max(blk)})" if blk else ""))
    hidden = count("embedding_length")
    given = key("expert_feed_forward_length") is not None  # given, it must be valid: not 0 read as "absent"
    expert_inter = count("expert_feed_forward_length") if given else count("feed_forward_length")
    dense_inter = key("feed_forward_length", 0) or 0
    heads = count("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    vocab = vocab or key("vocab_size") or tensors.get("token_embd.weight", ("", 0, (0, 0)))[2][-1]
    n_shared = int(key("expert_shared_count", 0) or 0)
    shared_inter = int(key("expert_shared_feed_forward_length", 0) or 0)

    moe = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not moe:
        raise MoesimError(f"{where}: no layer has a router (blk.N.ffn_gate_inp); not an MoE model")
    dense = [i for i in range(n_layers) if i not in moe]
    if lost := [i for i in dense if any(f"blk.{i}.ffn_{p}_exps.weight" in tensors for p in ("up", "gate", "down"))]:
        raise MoesimError(f"{where}: layer {lost[0]} has expert tensors (blk.{lost[0]}.ffn_*_exps) but no router "
                          f"(blk.{lost[0]}.ffn_gate_inp); its experts could not be routed to")
    parts = ("up", "gate", "down", "gate_up")
    have = {p for i in moe for p in parts if f"blk.{i}.ffn_{p}_exps.weight" in tensors}
    for i in moe:  # a MoE layer short of an expert tensor the others have: its bytes would vanish
        if missing := [p for p in parts if p in have and f"blk.{i}.ffn_{p}_exps.weight" not in tensors]:
            raise MoesimError(f"{where}: layer {i} has no blk.{i}.ffn_{missing[0]}_exps.weight, which the other MoE "
                              "layers have; a truncated or damaged file")
    shexp = tensors.get(f"blk.{moe[0]}.ffn_up_shexp.weight")  # ggml shape: [hidden, n_shared x inter]
    if shexp and not n_shared:
        n_shared = 1
    if shexp and not shared_inter and shexp[2][-1] != expert_inter * n_shared:
        shared_inter = shexp[2][-1] // n_shared

    if key("attention.kv_lora_rank"):
        k_len = key("attention.key_length", 192)
        rope = key("rope.dimension_count", 64)
        attention = Attention("mla", heads, heads, 0, q_lora_rank=int(key("attention.q_lora_rank", 0) or 0),
                              kv_lora_rank=key("attention.kv_lora_rank"), qk_nope_head_dim=k_len - rope,
                              qk_rope_head_dim=rope, v_head_dim=key("attention.value_length", 128))
    else:
        head_dim = key("attention.key_length") or hidden // heads
        attention = Attention("gqa", heads, kv_heads, head_dim,
                              bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
                              qk_norm="blk.0.attn_q_norm.weight" in tensors or any(
                                  f"blk.{i}.attn_q_norm.weight" in tensors for i in range(n_layers)))

    kinds: tuple[str, ...] = ()
    window = chunk = 0
    linear = None
    if arch == "gpt-oss":
        window = int(key("attention.sliding_window", 128))
        kinds = tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    elif arch == "llama4":
        chunk = int(key("attention.chunk_size", 8192) or 0)
        kinds = tuple("chunked" if (i + 1) % 4 and chunk else "full" for i in range(n_layers))  # every 4th is NoPE
    elif arch in ("qwen3next", "qwen35moe"):
        every = int(key("full_attention_interval", 4))
        kinds = tuple("full" if (i + 1) % every == 0 else "linear" for i in range(n_layers))
        inner, n_v = key("ssm.inner_size", required=True), key("ssm.time_step_rank", required=True)
        linear = LinearAttention("gated_deltanet", n_heads=n_v, n_k_heads=key("ssm.group_count", required=True),
                                 head_k_dim=key("ssm.state_size", required=True), head_v_dim=inner // n_v,
                                 conv_kernel=key("ssm.conv_kernel", 4))
    if kinds and all(k == "full" for k in kinds):
        kinds = ()

    def ttype(name: str) -> str | None:
        t = tensors.get(name)
        return t[0] if t else None

    first = moe[0]
    e_type = ttype(f"blk.{first}.ffn_gate_exps.weight") or ttype(f"blk.{first}.ffn_up_exps.weight")
    a_type = (ttype("blk.0.attn_q.weight") or ttype("blk.0.attn_qkv.weight") or ttype("blk.0.attn_q_a.weight")
              or ttype("blk.0.attn_q_b.weight") or e_type)
    embed_type = ttype("token_embd.weight") or "BF16"
    tied = "output.weight" not in tensors
    head_type = embed_type if tied else ttype("output.weight")

    spec = ModelSpec(
        name=printable(str(meta.get("general.name") or Path(where).stem)), n_layers=n_layers, n_experts=n_experts, top_k=top_k,
        hidden=hidden, expert_inter=expert_inter, vocab=int(vocab), attention=attention, dense_layers=tuple(dense),
        dense_inter=dense_inter if dense else 0, n_shared=n_shared, shared_inter=shared_inter,
        expert_dtype=_dtype(e_type), dense_dtype=_dtype(a_type), embed_dtype=_dtype(embed_type),
        head_dtype=_dtype(head_type), expert_bias=f"blk.{first}.ffn_gate_exps.bias" in tensors,
        tie_embeddings=tied, family=f"gguf:{arch}", source=where, layer_types=kinds, sliding_window=window,
        attention_chunk=chunk, linear=linear, n_mtp_layers=nextn,
        router_bias=f"blk.{first}.exp_probs_b.bias" in tensors or f"blk.{first}.ffn_gate_inp.bias" in tensors,
        # A placeholder that the file's real bytes replace below (a K-quant file stores tensors whose rows are
        # not a multiple of 256 in a fallback type, so the formula's checks do not apply).
        expert_bytes_by_layer=(1,) * (n_layers - len(dense)),
    )

    sizes = {name: b for name, (_, b, _) in tensors.items()}
    exact = apply_tensor_bytes(spec, sizes, where, expert_marks=("_exps.",), embed_names=("token_embd",),
                               head_names=("output.weight",), final_norm=("output_norm",))
    if exact is spec:
        raise MoesimError(f"{where}: the GGUF file does not hold every layer's tensors")
    return exact
