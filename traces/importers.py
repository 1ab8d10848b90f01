"""Import routing recorded by other engines into the moesim trace format.

Formats (full descriptions in docs/routing.md):

- ``vllm``: vLLM's per-completion routed experts (server flag
  ``--enable-return-routed-experts``; ``CompletionOutput.routed_experts`` in vLLM's
  ``vllm/outputs.py``, ``CompletionResponseChoice.routed_experts`` in its OpenAI-compatible
  server): an int array ``[seq_len, num_hidden_layers, top_k]`` (uint8, uint16 past 256
  experts) over every token that went through a forward pass (prompt tokens, then generated
  tokens except the last, so ``seq_len = prompt + completion - 1``), with a row for every
  layer, dense ones included: those rows are dropped using the model's MoE layers (an array
  of MoE layers only is read as it is). Read from a ``.npz`` (``routed_experts``,
  ``prompt_tokens``, optional ``token_ids`` and ``gates``), a plain ``.npy`` (the prompt
  length given as ``prompt_tokens``) or the server's JSON response (``choices[i].routed_experts``:
  base64 of the ``.npy`` bytes; ``usage.prompt_tokens`` or ``choices[i].prompt_token_ids``;
  ``choices[i].token_ids``). Several completions of equal length are stacked as a batch.
  The prompt rows are prefill and are dropped; the decode steps are the rest. vLLM returns
  no gate weights: gates are set to ``1/k`` and the header says so.
- ``sglang``: SGLang's ``/generate`` JSON with ``--enable-return-routed-experts``
  (``meta_info.routed_experts``, base64; ``meta_info.prompt_tokens``), the same layout.
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

import base64
import binascii
import difflib
import io
import json
import zipfile
from pathlib import Path

import numpy as np

from moesim import __version__
from moesim.errors import MoesimError
from moesim.host_detect import available_memory
from moesim.inputs import check_name, kind_of, original_names, read_bytes, readable_path
from moesim.models import ModelSpec, get_model
from moesim.outputs import check_output_file
from moesim.traces.format import Trace, write_trace
from moesim.traces.header import make_header

FORMATS = ("vllm", "sglang", "jsonl", "npz")


def import_routing(fmt: str, path: str | Path, model: str | ModelSpec, out: str | Path | None = None,
                   prompt_tokens: int | None = None) -> Trace:
    """Read ``path`` in format ``fmt`` for ``model`` (catalogue name, config path or spec);
    write the trace to ``out`` when given (atomic). ``prompt_tokens``: the prompt length
    of a plain ``.npy`` vLLM dump (a ``.npz`` or JSON carries its own). Returns the trace."""
    if fmt not in FORMATS:
        raise MoesimError(f"unknown routing format {fmt!r}; known: {', '.join(FORMATS)}")
    given = Path(path)
    if kind_of(check_name(given, "routing dump")) == "missing":
        raise MoesimError(f"routing dump {given} does not exist")
    if prompt_tokens is not None and (isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
                                      or prompt_tokens < 1):
        raise MoesimError(f"prompt_tokens must be a whole number >= 1 (got {prompt_tokens!r})")
    spec = model if isinstance(model, ModelSpec) else get_model(model)
    if out is not None:
        check_output_file(out, (".npz",))
    where = given.name
    try:  # a pipe (<(curl ...), a FIFO) is spooled to a file; a device, a folder, a file past memory: one line
        path = readable_path(given, "routing dump", _dump_cap())
        if kind_of(path) == "folder":
            raise MoesimError(f"routing dump {given} is a folder, not a file")
        if fmt in ("vllm", "sglang"):
            ids, gates, tokens, prompt_len = _read_vllm(path, where, spec, prompt_tokens, fmt, given.suffix)
        elif fmt == "jsonl":
            ids, gates, tokens, prompt_len = _read_jsonl(path, spec, where)
        else:
            ids, gates, tokens, prompt_len = _read_npz(path, where)
    except MoesimError as e:
        raise MoesimError(original_names(str(e))) from None
    trace = _build(spec, ids, gates, tokens, prompt_len, fmt, given, where)
    if out is not None:
        write_trace(trace, out)
    return trace


# --------------------------------------------------------------------------------------
# Readers: each returns ids [T, M, B, k], gates or None, token ids [B, T] or None, prompt length
# --------------------------------------------------------------------------------------


def _dump_cap() -> float:
    """The largest routing dump read: half of the memory this process can still allocate."""
    return available_memory() / 2


def _text(path: Path, where: str, expected: str) -> str:
    """A JSON or JSON-lines dump as text; its Python objects take ~10x its bytes, so a text
    dump is refused past a tenth of the memory left (before it is read)."""
    data = read_bytes(path, "routing dump", _dump_cap() / 5)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise MoesimError(f"{where}: not UTF-8 text ({expected} is expected)") from None


def _load_npz(path: Path, where: str, known: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The arrays of an .npz whose members are all among ``known``: a misspelt optional one
    (``gate`` for ``gates``) would otherwise be silently left out."""
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy array: np.load returns it, not an archive
            raise MoesimError(f"{where}: a single .npy array, not an .npz archive of named arrays (docs/routing.md "
                              "names the arrays each format expects)")
        with z:
            if unknown := [k for k in z.files if k not in known]:
                near = difflib.get_close_matches(unknown[0], known, n=1)
                raise MoesimError(f"{where}: unknown array {unknown[0]!r} in the .npz"
                                  f"{f' (did you mean {near[0]!r}?)' if near else ''}; this format's arrays are "
                                  f"{', '.join(known)} (docs/routing.md)")
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise MoesimError(f"{where}: not a readable .npz ({e})") from None


def _whole(v, what: str, where: str) -> int:
    """A JSON / array scalar that must be a whole number (not a bool, float or string)."""
    if isinstance(v, np.ndarray):
        if v.size != 1 or v.dtype.kind not in "iu":
            raise MoesimError(f"{where}: {what} must be one whole number, got {v.dtype} {v.shape}")
        v = v.ravel()[0].item()
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise MoesimError(f"{where}: {what} must be a whole number, got {v!r}")
    return int(v)


def _npy_bytes(raw: bytes, where: str, what: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise MoesimError(f"{where}: {what} is not .npy data ({str(e)[:80]})") from None


def _b64_array(s, where: str, what: str, spec: ModelSpec) -> np.ndarray:
    """vLLM/SGLang's base64 routed experts: the bytes of a ``.npy`` (vLLM); raw int32 rows
    when they carry no ``.npy`` header (SGLang's tensor bytes), reshaped to [rows, layers, top_k]."""
    if not isinstance(s, str):
        raise MoesimError(f"{where}: {what} must be a base64 string, got {type(s).__name__}")
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise MoesimError(f"{where}: {what} is not base64") from None
    if raw.startswith(b"\x93NUMPY"):
        return _npy_bytes(raw, where, what)
    if len(raw) % 4:
        raise MoesimError(f"{where}: {what} holds {len(raw)} bytes: neither .npy nor int32 rows")
    flat = np.frombuffer(raw, "<i4")
    for layers in (spec.n_layers, spec.n_moe_layers):
        if flat.size % (layers * spec.top_k) == 0:
            return flat.reshape(-1, layers, spec.top_k)
    raise MoesimError(f"{where}: {what} holds {flat.size} ids: not rows of {spec.n_layers} layers x top-{spec.top_k}")


def _read_vllm_json(path: Path, where: str, spec: ModelSpec, fmt: str):
    """The OpenAI-compatible server's completion response (vLLM) or /generate's (SGLang)."""
    try:
        d = json.loads(_text(path, where, "a JSON response"), parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise MoesimError(f"{where}: not a JSON response ({str(e)[:80]})") from None
    items = d if isinstance(d, list) else [d]
    arrays, prompts, tokens = [], [], []
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise MoesimError(f"{where}: response {n} is not a JSON object")
        if fmt == "sglang":
            meta = item.get("meta_info")
            if not isinstance(meta, dict) or meta.get("routed_experts") is None:
                raise MoesimError(f"{where}: response {n} has no meta_info.routed_experts (start SGLang with "
                                  "--enable-return-routed-experts and ask for return_routed_experts)")
            arrays.append(_b64_array(meta["routed_experts"], where, "meta_info.routed_experts", spec))
            prompts.append(_whole(meta.get("prompt_tokens"), "meta_info.prompt_tokens", where))
            tokens.append(item.get("output_ids"))
            continue
        choices = item.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MoesimError(f"{where}: response {n} has no choices")
        usage = item.get("usage") if isinstance(item.get("usage"), dict) else {}
        for c in choices:
            if not isinstance(c, dict) or c.get("routed_experts") is None:
                raise MoesimError(f"{where}: a choice has no routed_experts (start vLLM with "
                                  "--enable-return-routed-experts)")
            arrays.append(_b64_array(c["routed_experts"], where, "choices[].routed_experts", spec))
            if isinstance(c.get("prompt_token_ids"), list):
                prompts.append(len(c["prompt_token_ids"]))
            else:
                prompts.append(_whole(usage.get("prompt_tokens"), "usage.prompt_tokens", where))
            tokens.append(c.get("token_ids"))
    if not arrays:
        raise MoesimError(f"{where}: no completion in it (a vLLM response: choices[] with routed_experts)")
    if len(set(prompts)) != 1 or len({a.shape for a in arrays}) != 1:
        raise MoesimError(f"{where}: completions of different lengths cannot be one batch "
                          f"(prompts {sorted(set(prompts))}, routed {sorted({a.shape for a in arrays})})")
    tok = None
    if all(isinstance(t, list) for t in tokens):
        if any(isinstance(x, bool) or not isinstance(x, int) for t in tokens for x in t):
            raise MoesimError(f"{where}: token_ids must be whole numbers")
        if len({len(t) for t in tokens}) == 1:
            tok = np.array(tokens, np.int64)
    return np.stack(arrays), prompts[0], tok, None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _sniff(path: Path, suffix: str) -> str:
    """The kind of a vLLM dump: its suffix, or (a pipe's /dev/fd/N has none) its first bytes."""
    if suffix in (".json", ".npy", ".npz"):
        return suffix
    with open(path, "rb") as f:
        head = f.read(8).lstrip()
    return ".npy" if head.startswith(b"\x93NUMPY") else ".npz" if head.startswith(b"PK") else ".json"


def _read_vllm(path: Path, where: str, spec: ModelSpec, prompt_tokens: int | None, fmt: str = "vllm",
               suffix: str | None = None):
    gates = tokens = None
    kind = _sniff(path, path.suffix if suffix is None else suffix)
    if kind == ".json" or fmt == "sglang":
        r, p, tokens, gates = _read_vllm_json(path, where, spec, fmt)
    elif kind == ".npy":
        if prompt_tokens is None:
            raise MoesimError(f"{where}: a plain .npy of routed experts does not say how long the prompt was: "
                              "give --prompt-tokens (or save a .npz with prompt_tokens)")
        r = _npy_bytes(read_bytes(path, "routing dump", _dump_cap()), where, "the file")
        p = prompt_tokens
    else:
        d = _load_npz(path, where, ("routed_experts", "prompt_tokens", "token_ids", "gates"))
        if "routed_experts" not in d or ("prompt_tokens" not in d and prompt_tokens is None):
            raise MoesimError(f"{where}: a vLLM dump needs arrays routed_experts and prompt_tokens")
        r = d["routed_experts"]
        p = prompt_tokens if prompt_tokens is not None else _whole(d["prompt_tokens"], "prompt_tokens", where)
        tokens, gates = d.get("token_ids"), d.get("gates")
    if r.dtype.kind not in "iu":
        raise MoesimError(f"{where}: routed experts must be integers, got {r.dtype} (a {r.dtype.kind!r} array)")
    if r.ndim == 3:
        r = r[None]
    if r.ndim != 4:
        raise MoesimError(f"{where}: routed_experts must be integer [seq_len, layers, top_k] "
                          f"(or [batch, seq_len, layers, top_k]), got {r.dtype} {r.shape}")
    if gates is not None:
        gates = np.asarray(gates)
        if gates.dtype.kind != "f" or gates.size != r.size:
            raise MoesimError(f"{where}: gates must be floats of the shape of routed_experts {r.shape}")
        gates = gates.reshape(r.shape)
    if not 1 <= p < r.shape[1]:
        raise MoesimError(f"{where}: prompt_tokens {p} leaves no decode step in {r.shape[1]} routed rows")
    layers = r.shape[2]
    if layers == spec.n_layers and spec.dense_layers:  # vLLM writes every layer; the dense ones carry nothing
        keep = list(spec.moe_layers)
        r = r[:, :, keep]
        gates = gates[:, :, keep] if gates is not None else None
    ids = r[:, p:].transpose(1, 2, 0, 3).astype(np.int64)  # [T, M, B, k]; rows before p are the prefill
    if gates is not None:
        gates = gates[:, p:].transpose(1, 2, 0, 3)
    if tokens is not None:
        tokens = np.atleast_2d(np.asarray(tokens))
        if tokens.dtype.kind not in "iu":
            raise MoesimError(f"{where}: token_ids must be integers, got {tokens.dtype}")
        if tokens.shape[1] not in (ids.shape[0], ids.shape[0] + 1):  # the last generated token is never fed
            raise MoesimError(f"{where}: token_ids holds {tokens.shape[1]} token(s) a sequence; the routing has "
                              f"{ids.shape[0]} decode step(s) (token_ids: the generated tokens, the last one "
                              "optional)")
        tokens = tokens[:, : ids.shape[0]]  # generated token i is fed at decode step i
    return ids, gates, tokens, p


def _read_npz(path: Path, where: str):
    d = _load_npz(path, where, ("experts", "gates", "token_ids"))
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
        if gates.dtype.kind != "f" or gates.size != ids.size:
            raise MoesimError(f"{where}: gates must be floats of the shape of experts {d['experts'].shape}")
        gates = gates.reshape(ids.shape)
    tokens = d.get("token_ids")
    if tokens is not None and tokens.dtype.kind not in "iu":
        raise MoesimError(f"{where}: token_ids must be integers, got {tokens.dtype}")
    return ids, gates, tokens, 0


#: The fields of a ``jsonl`` routing record (docs/routing.md).
JSONL_FIELDS = ("token", "layer", "experts", "gates", "seq")


def _read_jsonl(path: Path, spec: ModelSpec, where: str):
    moe_index = {layer: j for j, layer in enumerate(spec.moe_layers)}
    rows = []
    lines = _text(path, where, "a JSON-lines file").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line, parse_constant=_no_constant)
            if not isinstance(r, dict):
                raise TypeError("not an object")
            for key in r:  # a misspelt field ("gate") was silently left out; other fields are the file's own
                near = difflib.get_close_matches(key, JSONL_FIELDS, n=1, cutoff=0.75)
                if key not in JSONL_FIELDS and near:
                    raise MoesimError(f"{where}:{n}: unknown field {key!r} (did you mean {near[0]!r}?); a record's "
                                      f"fields are {', '.join(JSONL_FIELDS)} (docs/routing.md)")
            seq, tok, layer = (_whole(r.get("seq", 0), "seq", f"{where}:{n}"),
                               _whole(r["token"], "token", f"{where}:{n}"), _whole(r["layer"], "layer", f"{where}:{n}"))
            experts = r["experts"]
            if not isinstance(experts, list) or not experts:
                raise TypeError("experts must be a non-empty list")
            experts = [_whole(e, "an expert id", f"{where}:{n}") for e in experts]
            bad = next((e for e in experts if not 0 <= e < spec.n_experts), None)
            if bad is not None:
                raise MoesimError(f"{where}:{n}: expert id {bad} outside [0, {spec.n_experts}) of {spec.name}")
            g = r.get("gates")
            if g is not None and (not isinstance(g, list) or any(
                    isinstance(x, bool) or not isinstance(x, int | float) for x in g)):
                raise TypeError("gates must be a list of numbers")
            if g is not None and not all(0 <= x <= 1 + 1e-5 for x in g):  # NaN and inf fail too
                raise MoesimError(f"{where}:{n}: gates must be finite and in [0, 1], got {g[:4]}")
            if g is not None and len(g) != len(experts):
                raise MoesimError(f"{where}:{n}: {len(g)} gate(s) for {len(experts)} expert(s): one gate an expert")
            rows.append((seq, tok, layer, experts, g))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise MoesimError(f"{where}:{n}: not a routing record "
                              f'{{"token", "layer", "experts"[, "gates", "seq"]}} ({e})') from None
    if not rows:
        raise MoesimError(f"{where}: no routing records")
    k = len(rows[0][3])
    b = max(r[0] for r in rows) + 1
    t = max(r[1] for r in rows) + 1
    m = spec.n_moe_layers
    if min(r[0] for r in rows) < 0 or min(r[1] for r in rows) < 0:
        r = next(r for r in rows if r[0] < 0 or r[1] < 0)
        raise MoesimError(f"{where}: negative token or seq index ({r[1]}, {r[0]})")
    if t * m * b > max(len(rows), 2**20):  # every (token, MoE layer, seq) needs a record: say so before allocating
        raise MoesimError(f"{where}: token indices reach {t - 1} and seq indices {b - 1}: {t} x {m} MoE layers x {b} "
                          f"= {t * m * b} (token, layer, seq) rows, but the file holds {len(rows)} record(s)")
    with_gates = sum(r[4] is not None for r in rows)
    if 0 < with_gates < len(rows):  # the others' would be made up: refused, not silently dropped
        first = next(i for i, r in enumerate(rows) if (r[4] is None) == (rows[0][4] is not None))
        raise MoesimError(f"{where}: {with_gates} of {len(rows)} records give gates (record {first + 1} "
                          f"{'does not' if rows[0][4] is not None else 'does'}): give them in every record or in none")
    ids = np.full((t, m, b, k), -1, np.int64)
    gates = np.zeros((t, m, b, k), np.float32) if with_gates else None
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
    if ids.size == 0:
        raise MoesimError(f"{where}: no routing rows")
    if m != spec.n_moe_layers:
        extra = (f" ({spec.n_layers} layers, {len(spec.dense_layers)} dense; a dump of all {spec.n_layers} layers "
                 "is read too)") if spec.dense_layers else ""
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
    if tokens is not None and tokens.shape != (b, t):
        raise MoesimError(f"{where}: token_ids has shape {tuple(tokens.shape)}; the routing has {b} sequence(s) x "
                          f"{t} decode step(s): ({b}, {t})")
    if tokens is None:
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
