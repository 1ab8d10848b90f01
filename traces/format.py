"""Trace format (version 2; version 1 still read): the contract between the executor, the
simulator and users.

One compressed ``.npz`` file (no pickles) holding a JSON header and numpy arrays; every
field and unit is documented in ``docs/trace-format.md``. :func:`read_trace` checks
version, shapes, ranges and the physical plausibility of measured times, and rejects a
corrupt, truncated or inconsistent file with a one-line :class:`~moesim.errors.MoesimError`.
The header is built by :func:`moesim.traces.header.make_header` and read as
``Trace.meta``; the copy and speculative records are encoded in :mod:`moesim.traces.records`.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import atomic_write
from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.traces.header import FORMAT, READABLE, VERSION, TraceMeta
from moesim.traces.records import COPY_FIELDS, COPY_KINDS

__all__ = ["COPY_FIELDS", "COPY_KINDS", "COUNTS_2D", "FORMAT", "READABLE", "ROUTING", "SD_FIELDS", "TIMING_1D", "TIMING_2D",
           "VERSION", "Trace", "TraceMeta", "read_trace", "validate", "write_trace"]

#: Routing arrays, all [tokens, moe_layers, batch, top_k].
ROUTING = ("true_ids", "true_gates", "pred_ids", "pred_gates", "exec_ids")
#: Optional measured timings, in seconds (shapes in docs/trace-format.md).
TIMING_2D = {"attn_s": "layers", "expert_s": "moe", "stall_s": "moe", "predict_s": "layers",
             "cpu_s": "moe", "cpu_wait_s": "moe"}  # cpu_*: CPU-compute policies only
#: Optional per-layer counts [tokens, moe_layers] (CPU-compute policies): experts the CPU ran.
COUNTS_2D = ("cpu_experts",)
TIMING_1D = ("other_s", "tpot_s")
#: Plausibility limits on measured times (docs/trace-format.md, "Plausibility"): no single
#: recorded time (a block, a step, a copy, prefill) may exceed MAX_TIME_S, and a step's
#: measured TPOT may not differ from the sum of its measured parts by more than
#: PARTS_RATIO either way. Both are orders of magnitude beyond any real run, so they only
#: catch corrupt or hand-edited values (attn_s = 1e30), never a slow machine.
MAX_TIME_S = 3600.0
PARTS_RATIO = 100.0
#: Speculative decoding (version 2), all or none: per verification step s, candidate node n
#: (N = most candidates of a step, padded), MoE layer m, expert e; rows = root + candidates.
SD_FIELDS = {
    "sd_tree_tokens": ("i", 2), "sd_tree_parents": ("i", 2), "sd_tree_prob": ("f", 2), "sd_chosen": ("i", 2),
    "sd_accepted": ("i", 1), "sd_node_pred": ("b", 4), "sd_root_pred": ("b", 3), "sd_row_true": ("i", 4),
    "sd_draft_s": ("f", 1), "sd_verify_s": ("f", 1), "sd_attn_s": ("f", 2), "sd_expert_s": ("f", 2),
    "sd_stall_s": ("f", 2),
}


@dataclass
class Trace:
    """A decode run: routing per step and MoE layer, optional measured timings.

    ``header`` is the raw JSON header (as in the file) and ``meta`` its typed view;
    ``pred_ids`` is -1 where no prediction ran (always at the first MoE layer);
    ``timings`` is empty when nothing was measured.
    """

    header: dict[str, Any]
    prompt_ids: np.ndarray  # int32 [batch, prompt_len]
    token_ids: np.ndarray  # int32 [batch, tokens]
    true_ids: np.ndarray  # int16 [tokens, moe_layers, batch, top_k]
    true_gates: np.ndarray  # float32, same shape
    pred_ids: np.ndarray  # int16, same shape, -1 = no prediction
    pred_gates: np.ndarray  # float32, same shape, 0 where no prediction
    exec_ids: np.ndarray  # int16, same shape: what the recorded run executed
    timings: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def meta(self) -> TraceMeta:
        """The header as typed attributes (recorded policy, hardware, link, ...)."""
        return TraceMeta.from_header(self.header)

    @property
    def model(self) -> ModelSpec:
        return ModelSpec.from_dict(self.header["model"])

    @property
    def n_tokens(self) -> int:
        return int(self.true_ids.shape[0])

    @property
    def batch(self) -> int:
        return int(self.true_ids.shape[2])

    @property
    def prompt_len(self) -> int:
        p = self.meta.prompt_len
        return int(self.prompt_ids.shape[1] if p is None else p)

    @property
    def measured(self) -> bool:
        return "tpot_s" in self.timings

    @property
    def speculative(self) -> bool:
        """Whether the trace records speculative decoding (version 2 ``sd_*`` arrays)."""
        return "sd_accepted" in self.timings

    @property
    def synthetic(self) -> bool:
        return self.meta.synthetic

    def head(self, n: int) -> Trace:
        """The first ``n`` decode steps (an interrupted run keeps what it finished)."""
        t = dict(self.timings)
        if "copy_token" in t:
            keep = t["copy_token"] < n
            t.update({k: t[k][keep] for k in COPY_FIELDS})
        for k in (*TIMING_2D, *COUNTS_2D, *TIMING_1D):
            if k in t:
                t[k] = t[k][:n]
        header = {**self.header, "n_tokens": n}
        return Trace(header, self.prompt_ids, self.token_ids[:, :n],
                     *(getattr(self, a)[:n] for a in ROUTING), timings=t)


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Validate and write ``trace`` atomically (temp file, then rename)."""
    trace.header.setdefault("format", FORMAT)
    trace.header.setdefault("version", VERSION)
    trace.header["n_tokens"] = trace.n_tokens
    trace.header["batch"] = trace.batch
    validate(trace, str(path))
    arrays = {
        "header": np.frombuffer(json.dumps(trace.header, sort_keys=True).encode(), dtype=np.uint8),
        "prompt_ids": trace.prompt_ids.astype(np.int32),
        "token_ids": trace.token_ids.astype(np.int32),
        **{a: getattr(trace, a) for a in ROUTING},
        **trace.timings,
    }
    return atomic_write(path, lambda f: np.savez_compressed(f, **arrays))


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace; any problem is a one-line MoesimError naming the file."""
    path = Path(path)
    where = str(path)
    if path.is_dir():
        raise MoesimError(f"trace {where} is a folder, not a trace file (.npz)")
    if not path.exists():
        raise MoesimError(f"trace {where} does not exist")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MoesimError(f"cannot read trace {where}: {e.strerror or e}") from None
    if magic[:2] != b"PK":  # every .npz is a zip archive; anything else would reach numpy's pickle fallback
        raise MoesimError(f"{where}: not a readable moesim trace (not an .npz archive"
                          + ("; it is empty)" if not magic else ")"))
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as e:
        raise MoesimError(f"{where}: not a readable moesim trace (corrupt or truncated: {e})") from None
    if "header" not in data:
        raise MoesimError(f"{where}: not a moesim trace (no header)")
    try:
        header = json.loads(bytes(data.pop("header")).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoesimError(f"{where}: trace header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise MoesimError(f"{where}: not a moesim trace (format is {header.get('format') if isinstance(header, dict) else None!r})")
    version = header.get("version")
    if version not in READABLE:
        raise MoesimError(f"{where}: trace format version {version!r}; this moesim reads versions "
                          f"{', '.join(map(str, READABLE))}")
    missing = [k for k in ("prompt_ids", "token_ids", *ROUTING) if k not in data]
    if missing:
        raise MoesimError(f"{where}: trace lacks array(s) {', '.join(missing)}")
    core = {k: data.pop(k) for k in ("prompt_ids", "token_ids", *ROUTING)}
    unknown = set(data) - set(TIMING_2D) - set(COUNTS_2D) - set(TIMING_1D) - set(COPY_FIELDS) - set(SD_FIELDS)
    if unknown:
        raise MoesimError(f"{where}: trace has unknown array(s) {', '.join(sorted(unknown))}")
    trace = Trace(header, timings=data, **core)
    validate(trace, where)
    return trace


def validate(trace: Trace, where: str) -> None:
    """Check shapes, dtypes, ranges and header consistency; raise a one-line error."""

    def bad(msg: str) -> MoesimError:
        return MoesimError(f"{where}: {msg}")

    h = trace.header
    if "model" not in h:
        raise bad("header has no model spec")
    if not isinstance(h["model"], dict):
        raise bad("header model is not an object")
    try:
        spec = TraceMeta.from_header(h).model
    except MoesimError as e:
        raise bad(str(e)) from None
    for k in ROUTING:
        a = getattr(trace, k)
        if a.ndim != 4:
            raise bad(f"{k} must be 4-D [tokens, moe_layers, batch, top_k], got shape {a.shape}")
    shape = trace.true_ids.shape
    t, m, b, k = shape
    if t == 0:
        raise bad("trace holds no decode step")
    if m != spec.n_moe_layers or k != spec.top_k:
        raise bad(f"routing shape {shape} does not match model {spec.name} "
                  f"({spec.n_moe_layers} MoE layers, top-{spec.top_k})")
    for k_ in ROUTING:
        a = getattr(trace, k_)
        if a.shape != shape:
            raise bad(f"{k_} has shape {a.shape}, expected {shape}")
        kind = "f" if k_.endswith("gates") else "i"
        if a.dtype.kind != kind:
            raise bad(f"{k_} has dtype {a.dtype}, expected {'float' if kind == 'f' else 'integer'}")
    if h.get("n_tokens", t) != t:
        raise bad(f"header says {h.get('n_tokens')} tokens but arrays hold {t} (truncated?)")
    e = spec.n_experts
    if trace.true_ids.min() < 0 or trace.true_ids.max() >= e:
        raise bad(f"true_ids outside [0, {e})")
    for k_ in ("pred_ids", "exec_ids"):
        a = getattr(trace, k_)
        if a.min() < -1 or a.max() >= e:
            raise bad(f"{k_} outside [-1, {e})")
    srt = np.sort(trace.true_ids, axis=-1)
    if k > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        raise bad("true_ids repeats an expert within one token's top-k")
    for k_ in ("true_gates", "pred_gates"):
        g = getattr(trace, k_)
        if not np.isfinite(g).all() or g.min() < 0 or g.max() > 1 + 1e-5:
            raise bad(f"{k_} must be finite and in [0, 1]")
    for k_ in ("prompt_ids", "token_ids"):
        ids = getattr(trace, k_)
        if ids.ndim != 2 or ids.shape[0] != b:
            raise bad(f"{k_} must be [batch={b}, n], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= spec.vocab):
            raise bad(f"{k_} outside the vocabulary [0, {spec.vocab})")
    if trace.token_ids.shape[1] != t:
        raise bad(f"token_ids holds {trace.token_ids.shape[1]} tokens, routing {t}")
    _validate_timings(trace, spec, bad)


def _validate_timings(trace: Trace, spec: ModelSpec, bad) -> None:
    tm = trace.timings
    t = trace.n_tokens
    dims = {"layers": spec.n_layers, "moe": spec.n_moe_layers}
    for k, d in TIMING_2D.items():
        if k in tm and tm[k].shape != (t, dims[d]):
            raise bad(f"{k} has shape {tm[k].shape}, expected {(t, dims[d])}")
    for k in TIMING_1D:
        if k in tm and tm[k].shape != (t,):
            raise bad(f"{k} has shape {tm[k].shape}, expected {(t,)}")
    for k in COUNTS_2D:
        if k not in tm:
            continue
        a = tm[k]
        if a.shape != (t, spec.n_moe_layers) or a.dtype.kind not in "iu":
            raise bad(f"{k} must be integer [{t}, {spec.n_moe_layers}], got {a.dtype} {a.shape}")
        if a.size and (a.min() < 0 or a.max() > spec.n_experts):
            raise bad(f"{k} outside [0, {spec.n_experts}]")
    present = [k for k in COPY_FIELDS if k in tm]
    if present and len(present) != len(COPY_FIELDS):
        raise bad(f"copy records are incomplete (missing {', '.join(set(COPY_FIELDS) - set(present))})")
    if present:
        n = tm["copy_token"].shape
        if any(tm[k].shape != n or tm[k].ndim != 1 for k in COPY_FIELDS):
            raise bad("copy record arrays differ in length")
        if n[0] and (tm["copy_token"].min() < 0 or tm["copy_token"].max() >= t):
            raise bad("copy_token outside the trace's steps")
        if n[0] and (tm["copy_expert"].min() < 0 or tm["copy_expert"].max() >= spec.n_experts):
            raise bad("copy_expert outside the model's experts")
        if n[0] and (tm["copy_layer"].min() < 0 or tm["copy_layer"].max() >= spec.n_layers):
            raise bad("copy_layer outside the model's layers")
        if n[0] and ((tm["copy_start_s"] < tm["copy_issue_s"] - 1e-9).any()
                     or (tm["copy_end_s"] < tm["copy_start_s"]).any()):
            raise bad("copy times out of order (need issue <= start <= end)")
    sd = [k for k in SD_FIELDS if k in tm]
    if sd and len(sd) != len(SD_FIELDS):
        raise bad(f"speculative records are incomplete (missing {', '.join(sorted(set(SD_FIELDS) - set(sd)))})")
    if sd:
        if trace.header.get("version", 1) < 2:
            raise bad("speculative records need trace format version 2")
        n_steps = tm["sd_accepted"].shape[0]
        for k, (kind, ndim) in SD_FIELDS.items():
            a = tm[k]
            if a.ndim != ndim or a.shape[0] != n_steps:
                raise bad(f"{k} must be {ndim}-D with {n_steps} steps first, got shape {a.shape}")
            if kind == "i" and a.dtype.kind not in "iu" or kind == "b" and a.dtype != np.bool_:
                raise bad(f"{k} has dtype {a.dtype}")
        if tm["sd_node_pred"].shape[2:] != (spec.n_moe_layers, spec.n_experts):
            raise bad("sd_node_pred must be [steps, nodes, moe_layers, experts]")
        if (tm["sd_accepted"] < 1).any() or tm["sd_row_true"].max() >= spec.n_experts:
            raise bad("sd_accepted must be >= 1 and sd_row_true ids in range")
    for k, a in tm.items():
        if a.dtype.kind == "f" and (not np.isfinite(a).all() or (a.size and a.min() < 0)):
            raise bad(f"{k} must be finite and non-negative")
    _check_plausible(trace, bad)


def _check_plausible(trace: Trace, bad) -> None:
    """Reject physically impossible measured times (limits: MAX_TIME_S, PARTS_RATIO)."""
    tm = trace.timings
    prefill = trace.meta.prefill_s
    times = {k: a for k, a in tm.items() if k.endswith("_s") and a.size}
    if prefill is not None and not 0 <= prefill <= MAX_TIME_S:
        raise bad(f"prefill_s = {prefill:.3g} s is not a plausible time (0 to {MAX_TIME_S:g} s)")
    for k, a in times.items():
        if a.max() > MAX_TIME_S:
            raise bad(f"{k} holds {a.max():.3g} s, more than {MAX_TIME_S:g} s for one measured time: "
                      "not a plausible measurement")
    checks = [("tpot_s", ("attn_s", "expert_s", "stall_s", "other_s")),
              ("sd_verify_s", ("sd_attn_s", "sd_expert_s", "sd_stall_s"))]
    for total, parts in checks:
        if total not in tm or any(p not in tm for p in parts):
            continue
        whole = tm[total].astype(float)
        summed = sum(tm[p].reshape(len(whole), -1).sum(1) for p in parts)
        if total == "tpot_s" and "cpu_wait_s" in tm:  # a layer's end waiting on its CPU experts
            summed = summed + tm["cpu_wait_s"].sum(1)
        ok = (whole > 0) & (summed > 0)
        ratio = np.where(ok, whole / np.where(ok, summed, 1.0), 1.0)
        worst = int(np.argmax(np.abs(np.log(ratio))))
        if ratio[worst] > PARTS_RATIO or ratio[worst] < 1 / PARTS_RATIO:
            raise bad(f"step {worst}: {total} = {whole[worst]:.3g} s but its parts ({', '.join(parts)}) sum to "
                      f"{summed[worst]:.3g} s (more than {PARTS_RATIO:g}x apart): not a plausible measurement")


def load_calibration(path: str | Path, spec: ModelSpec) -> np.ndarray:
    """The routing ``[t, m, b, k]`` of a calibration trace (``--placement-from``), checked
    against the model it will place: a trace of another model is one clear error."""
    trace = read_trace(path)
    other = trace.model
    if (other.n_moe_layers, other.n_experts) != (spec.n_moe_layers, spec.n_experts):
        raise MoesimError(f"calibration trace {path} is of {other.name} ({other.n_moe_layers} MoE layers x "
                          f"{other.n_experts} experts); the simulated model {spec.name} has "
                          f"{spec.n_moe_layers} x {spec.n_experts}")
    return trace.true_ids
