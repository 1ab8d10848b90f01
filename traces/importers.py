"""Import routing recorded by other engines into the moesim trace format.

Formats (full descriptions in docs/routing.md):

- ``vllm``: vLLM's per-completion routed experts (server flag
  ``--enable-return-routed-experts``; ``CompletionOutput.routed_experts`` in vLLM's
  ``vllm/outputs.py``): an int array ``[seq_len, moe_layers, top_k]`` over every token that
  went through a forward pass (prompt tokens, then generated tokens except the last, so
  ``seq_len = prompt + completion - 1``). Saved by the user as ``.npz`` holding
  ``routed_experts`` and ``prompt_tokens`` (and optionally ``token_ids``, the completion's
  tokens); several completions of equal length may be stacked as
  ``[batch, seq_len, moe_layers, top_k]``. The prompt rows are prefill and are dropped;
  the decode steps are the rest. vLLM returns no gate weights: gates are set to ``1/k``
  and the header says so.
- ``jsonl``: one JSON object a line, ``{"token": i, "layer": l, "experts": [...],
  "gates": [...]}``, optional ``"seq": b`` (batch row, default 0); ``layer`` is the model
  layer index (an MoE layer of the model), experts largest gate first; ``gates`` optional.
- ``npz``: arrays ``experts`` ``[tokens, moe_layers, top_k]`` or
  ``[tokens, moe_layers, batch, top_k]``, optional ``gates`` of the same shape and
  ``token_ids`` ``[batch, tokens]``.

A dump that does not match the model (wrong layer count, expert id out of range, an
expert twice in one top-k, ragged top-k, missing rows) is refused with one line.
Imported traces have no predictions (``pred_ids`` -1) and no timings.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from moesim import __version__
from moesim.errors import MoesimError
from moesim.models import ModelSpec, get_model
from moesim.traces.format import Trace, write_trace
from moesim.traces.header import make_header

FORMATS = ("vllm", "jsonl", "npz")


def import_routing(fmt: str, path: str | Path, model: str | ModelSpec, out: str | Path | None = None) -> Trace:
    """Read ``path`` in format ``fmt`` for ``model`` (catalogue name, config path or spec);
    write the trace to ``out`` when given (atomic). Returns the trace."""
    if fmt not in FORMATS:
        raise MoesimError(f"unknown routing format {fmt!r}; known: {', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise MoesimError(f"routing dump {path} does not exist")
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    if out is not None:
        from moesim.outputs import check_output_file

        check_output_file(out, (".npz",))
    where = path.name
    if fmt == "vllm":
        ids, gates, tokens, prompt_len = _read_vllm(path, where)
    elif fmt == "jsonl":
        ids, gates, tokens, prompt_len = _read_jsonl(path, spec, where)
    else:
        ids, gates, tokens, prompt_len = _read_npz(path, where)
    trace = _build(spec, ids, gates, tokens, prompt_len, fmt, path, where)
    if out is not None:
        write_trace(trace, out)
    return trace


# --------------------------------------------------------------------------------------
# Readers: each returns ids [T, M, B, k], gates or None, token ids [B, T] or None, prompt length
# --------------------------------------------------------------------------------------


def _load_npz(path: Path, where: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise MoesimError(f"{where}: not a readable .npz ({e})") from None


def _read_vllm(path: Path, where: str):
    d = _load_npz(path, where)
    if "routed_experts" not in d or "prompt_tokens" not in d:
        raise MoesimError(f"{where}: a vLLM dump needs arrays routed_experts and prompt_tokens")
    r = d["routed_experts"]
    if r.ndim == 3:
        r = r[None]
    if r.ndim != 4 or r.dtype.kind not in "iu":
        raise MoesimError(f"{where}: routed_experts must be integer [seq_len, layers, top_k] "
                          f"(or [batch, seq_len, layers, top_k]), got {r.dtype} {r.shape}")
    p = int(np.asarray(d["prompt_tokens"]).ravel()[0])
    if not 1 <= p < r.shape[1]:
        raise MoesimError(f"{where}: prompt_tokens {p} leaves no decode step in {r.shape[1]} routed rows")
    ids = r[:, p:].transpose(1, 2, 0, 3)  # [T, M, B, k]; rows before p are the prefill
    tokens = d.get("token_ids")
    if tokens is not None:
        tokens = np.atleast_2d(tokens)[:, : ids.shape[0]]  # generated token i is fed at decode step i
    return ids, None, tokens, p


def _read_npz(path: Path, where: str):
    d = _load_npz(path, where)
    if "experts" not in d:
        raise MoesimError(f"{where}: a routing .npz needs an array 'experts'")
    ids = d["experts"]
    if ids.ndim == 3:
        ids = ids[:, :, None]
    if ids.ndim != 4 or ids.dtype.kind not in "iu":
        raise MoesimError(f"{where}: experts must be integer [tokens, layers, top_k] or "
                          f"[tokens, layers, batch, top_k], got {ids.dtype} {ids.shape}")
    gates = d.get("gates")
    if gates is not None:
        gates = gates.reshape(ids.shape) if gates.size == ids.size else None
        if gates is None:
            raise MoesimError(f"{where}: gates must have the shape of experts {d['experts'].shape}")
    return ids, gates, d.get("token_ids"), 0


def _read_jsonl(path: Path, spec: ModelSpec, where: str):
    moe_index = {layer: j for j, layer in enumerate(spec.moe_layers)}
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append((int(r.get("seq", 0)), int(r["token"]), int(r["layer"]), list(r["experts"]),
                             r.get("gates")))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                raise MoesimError(f"{where}:{n}: not a routing record "
                                  f'{{"token", "layer", "experts"[, "gates", "seq"]}} ({e})') from None
    if not rows:
        raise MoesimError(f"{where}: no routing records")
    k = len(rows[0][3])
    b = max(r[0] for r in rows) + 1
    t = max(r[1] for r in rows) + 1
    m = spec.n_moe_layers
    ids = np.full((t, m, b, k), -1, np.int64)
    gates = np.zeros((t, m, b, k), np.float32) if rows[0][4] is not None else None
    for seq, tok, layer, experts, g in rows:
        if seq < 0 or tok < 0:
            raise MoesimError(f"{where}: negative token or seq index ({tok}, {seq})")
        if layer not in moe_index:
            what = "a dense layer" if layer in spec.dense_layers else "not a layer"
            raise MoesimError(f"{where}: layer {layer} is {what} of {spec.name} (MoE layers "
                              f"{spec.moe_layers[0]}..{spec.moe_layers[-1]})")
        if len(experts) != k:
            raise MoesimError(f"{where}: ragged top-k: token {tok} layer {layer} has {len(experts)} experts, "
                              f"the first record {k}")
        j = moe_index[layer]
        if ids[tok, j, seq, 0] >= 0:
            raise MoesimError(f"{where}: token {tok} layer {layer} seq {seq} appears twice")
        ids[tok, j, seq] = experts
        if gates is not None:
            if g is None or len(g) != k:
                raise MoesimError(f"{where}: token {tok} layer {layer}: gates missing or not {k} long")
            gates[tok, j, seq] = g
    missing = np.argwhere(ids[..., 0] < 0)
    if missing.size:
        tk, j, seq = missing[0]
        raise MoesimError(f"{where}: no record for token {tk}, layer {spec.moe_layers[j]}, seq {seq} "
                          f"({len(missing)} (token, layer, seq) rows missing)")
    return ids, gates, None, 0


# --------------------------------------------------------------------------------------
# Checks and the trace
# --------------------------------------------------------------------------------------


def _build(spec: ModelSpec, ids: np.ndarray, gates: np.ndarray | None, tokens: np.ndarray | None, prompt_len: int,
           fmt: str, path: Path, where: str) -> Trace:
    t, m, b, k = ids.shape
    if m != spec.n_moe_layers:
        extra = f" ({spec.n_layers} layers, {len(spec.dense_layers)} dense)" if spec.dense_layers else ""
        raise MoesimError(f"{where}: routing has {m} layers; {spec.name} has {spec.n_moe_layers} MoE layers{extra}")
    if k != spec.top_k:
        raise MoesimError(f"{where}: routing has top-{k}; {spec.name} routes top-{spec.top_k}")
    if ids.min() < 0 or ids.max() >= spec.n_experts:
        bad = ids[(ids < 0) | (ids >= spec.n_experts)].ravel()[0]
        raise MoesimError(f"{where}: expert id {bad} outside [0, {spec.n_experts}) of {spec.name}")
    srt = np.sort(ids, -1)
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
    if dup.any():
        tk, j, seq = np.argwhere(dup)[0]
        raise MoesimError(f"{where}: duplicate expert ids at token {tk}, layer {spec.moe_layers[j]}, seq {seq}")
    how = "gates from the dump"
    if gates is None:
        gates = np.full(ids.shape, 1.0 / k, np.float32)
        how = "no gates in the dump: uniform 1/k"
    elif not np.isfinite(gates).all() or gates.min() < 0 or gates.max() > 1 + 1e-5:
        raise MoesimError(f"{where}: gates must be finite and in [0, 1]")
    else:  # largest gate first, as the trace format wants
        order = np.argsort(-gates, -1, kind="stable")
        ids, gates = np.take_along_axis(ids, order, -1), np.take_along_axis(gates, order, -1)
    if tokens is None or tokens.shape != (b, t):
        tokens = np.zeros((b, t), np.int32)
        token_note = "token ids not in the dump (zeros)"
    else:
        token_note = "token ids from the dump"
        if tokens.min() < 0 or tokens.max() >= spec.vocab:
            raise MoesimError(f"{where}: token ids outside the vocabulary [0, {spec.vocab})")
    header = make_header(
        spec, policy="none", prompt_len=prompt_len, n_tokens=t, batch=b, seed=0, synthetic=False,
        recorded={"tool": f"moesim {__version__}", "how": f"imported from a {fmt} routing dump; {how}; "
                  f"{token_note}; no predictions, no timings", "model_source": str(path.name),
                  "imported_from": fmt},
    )
    ids16 = ids.astype(np.int16)
    return Trace(header, np.zeros((b, prompt_len), np.int32), tokens.astype(np.int32), ids16, gates.astype(np.float32),
                 np.full(ids.shape, -1, np.int16), np.zeros(ids.shape, np.float32), ids16.copy())
