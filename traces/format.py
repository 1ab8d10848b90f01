"""Trace format (version 3, or 4 with one-byte expert ids; versions 1 and 2 still read): the
contract between the executor, the simulator and users.

One ``.npz`` file (no pickles) holding a JSON header and numpy arrays; every field and unit
is documented in ``docs/trace-format.md``, and so is the layout: large members stored
uncompressed and aligned, so :func:`read_trace` maps them instead of inflating them. :func:`read_trace` checks
version, shapes, ranges and the physical plausibility of measured times, and rejects a
corrupt, truncated or inconsistent file with a one-line :class:`~moesim.errors.MoesimError`.
The header is built by :func:`moesim.traces.header.make_header` and read as
``Trace.meta``; the copy and speculative records are encoded in :mod:`moesim.traces.records`.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.lib import format as npformat

from moesim.atomic import atomic_write
from moesim.errors import MoesimError
from moesim.inputs import kind_of, original_names, readable_path
from moesim.models import ModelSpec
from moesim.traces.header import BYTE_IDS_VERSION, FORMAT, READABLE, VERSION, TraceMeta
from moesim.traces.records import COPY_FIELDS, COPY_KINDS

__all__ = ["BYTE_IDS_VERSION", "COPY_FIELDS", "COPY_KINDS", "COUNTS_2D", "FORMAT", "READABLE", "ROUTING", "SD_FIELDS",
           "TIMING_1D", "TIMING_2D", "VERSION", "Streamed", "Trace", "TraceMeta", "id_dtype", "read_trace", "validate",
           "write_trace", "write_trace_streamed"]

#: Routing arrays, all [tokens, moe_layers, batch, top_k].
ROUTING = ("true_ids", "true_gates", "pred_ids", "pred_gates", "exec_ids")
#: The routing arrays that hold expert ids (-1: none), stored as :func:`id_dtype` says.
ID_ARRAYS = ("true_ids", "pred_ids", "exec_ids")
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


def id_dtype(n_experts: int) -> np.dtype:
    """The narrowest exact dtype of a model's expert ids: every id in [0, n_experts) and the
    -1 of "no prediction". Signed, so -1 stays -1 and every reader's ``< 0`` / ``== -1`` reads
    it as before: int8 up to 128 experts (ids 0..127), int16 up to 32,768, else int32. Not
    uint8 with a sentinel 255: every reader would have to translate it, and a model of 256
    experts needs 257 values anyway. Readers widen where they compute (numba promotes a
    small int to int64 in arithmetic; numpy code widens its chunk) and never overflow."""
    if n_experts <= 1 << 7:
        return np.dtype(np.int8)
    return np.dtype(np.int16 if n_experts <= 1 << 15 else np.int32)


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
    true_ids: np.ndarray  # signed int [tokens, moe_layers, batch, top_k]: read, id_dtype; drawn, int16
    true_gates: np.ndarray  # float32, same shape
    pred_ids: np.ndarray  # signed int, same shape, -1 = no prediction
    pred_gates: np.ndarray  # float32, same shape; meaningless where pred_ids is -1 (0 when recorded)
    exec_ids: np.ndarray  # signed int, same shape: what the recorded run executed
    timings: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def meta(self) -> TraceMeta:
        """The header as typed attributes (recorded policy, hardware, link, ...), parsed once
        per header content (a fit of the published suite asks for it thousands
        of times; the header's model spec alone costs tens of microseconds to build)."""
        memo = self.__dict__.get("_meta_memo")
        if memo is None or memo[0] != self.header:  # a header edited in place is parsed again
            memo = self.__dict__["_meta_memo"] = (dict(self.header), TraceMeta.from_header(self.header))
        return memo[1]

    @property
    def model(self) -> ModelSpec:
        """The header's model, built once per header dict (a simulation asks for it per step
        and layer; a spec's checks cost tens of microseconds each time)."""
        raw = self.header["model"]
        memo = self.__dict__.get("_model_memo")
        if memo is None or memo[0] is not raw:
            memo = self.__dict__["_model_memo"] = (raw, ModelSpec.from_dict(raw))
        return memo[1]

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
    """Validate and write ``trace`` atomically (temp file, then rename).

    The file is an ordinary ``.npz`` (a zip of ``.npy`` members, as ``numpy.savez`` writes
    it): members of at least :data:`STORE_MIN_BYTES` are stored uncompressed, their data
    aligned to :data:`ALIGN` bytes so that :func:`read_trace` maps them instead of copying
    them; smaller members are deflated, as ``numpy.savez_compressed`` does. Expert ids are
    stored as :func:`id_dtype` says, whatever their dtype in memory (exact: the checks hold
    them in [-1, n_experts))."""
    trace.header.setdefault("format", FORMAT)
    trace.header.setdefault("version", VERSION)
    trace.header["n_tokens"] = trace.n_tokens
    trace.header["batch"] = trace.batch
    validate(trace, str(path))
    routing = _narrowed(trace)
    same_as = _repeats(routing)
    _name_repeats(trace.header, same_as)
    _name_id_width(trace.header, routing["true_ids"].dtype)
    arrays = {
        "header": _header_bytes(trace.header),
        "prompt_ids": trace.prompt_ids.astype(np.int32),
        "token_ids": trace.token_ids.astype(np.int32),
        **{a: routing[a] for a in ROUTING if a not in same_as},
        **trace.timings,
    }
    return atomic_write(path, lambda f: _write_npz(f, arrays))


@dataclass(frozen=True)
class Streamed:
    """Routing members written a block of rows at a time, never whole in memory: each member's
    shape and dtype (``members``, in file order), and ``blocks()``, an iterator of tuples holding
    one block of rows of each member, in that order, that stack along the first axis to those
    shapes (a block may be scratch that the next one reuses: each is written at once)."""

    members: dict[str, tuple[tuple[int, ...], np.dtype]]
    blocks: Callable[[], Iterable[tuple[np.ndarray, ...]]]


def write_trace_streamed(header: dict[str, Any], prompt_ids: np.ndarray, token_ids: np.ndarray,
                         stored: Streamed, same_as: dict[str, str], path: str | Path) -> Path:
    """:func:`write_trace` of a trace whose routing members are ``stored`` (:class:`Streamed`)
    and ``same_as`` (each the stored member it repeats): the same file, written a block at a
    time (the synthetic generator's, for traces larger than memory). Each block is checked as
    it goes by; the trace's checks (:func:`validate`) run on those results before the file is
    moved into place, so a trace that fails them is never written."""
    where, names = str(path), list(stored.members)
    if set(names) | set(same_as) != set(ROUTING) or any(same_as[a] not in names for a in same_as):
        raise ValueError(f"routing members {names} stored, {same_as} repeated: need each of {ROUTING}")
    shape = stored.members["true_ids"][0]
    header = {**header, "format": header.get("format", FORMAT), "version": header.get("version", VERSION),
              "n_tokens": shape[0], "batch": shape[2]}
    scans = {name: _Scan() for name in names}

    def checked() -> Iterator[tuple[np.ndarray, ...]]:
        for blocks in stored.blocks():  # scanned as given, before the ids are cast: 255 is refused, never -1
            for name, b in zip(names, blocks):
                _scan_add(scans[name], b, name == "true_ids")
            yield blocks

    narrow = _narrowed_streamed(replace(stored, blocks=checked),
                                id_dtype(TraceMeta.from_header(header).model.n_experts))
    _name_repeats(header, same_as)
    _name_id_width(header, narrow.members["true_ids"][1])

    def write(f: IO[bytes]) -> None:
        small = {"header": _header_bytes(header), "prompt_ids": prompt_ids.astype(np.int32),
                 "token_ids": token_ids.astype(np.int32)}
        if min(math.prod(sh) * dt.itemsize for sh, dt in narrow.members.values()) >= STORE_MIN_BYTES:
            _write_npz(f, small, narrow)
        else:  # a member write_trace would deflate: the trace is a few MB, gathered and written as it writes it
            parts = [[b.copy() for b in blocks] for blocks in narrow.blocks()]
            _write_npz(f, small | {n: np.concatenate([p[i] for p in parts]) for i, n in enumerate(names)})
        # What the checks see of a streamed member: its shape and dtype, no memory, and its scan.
        shells = {a: np.broadcast_to(np.zeros((), dt), sh) for a, (sh, dt) in narrow.members.items()}
        trace = Trace(header, prompt_ids, token_ids, *(shells[same_as.get(a, a)] for a in ROUTING))
        validate(trace, where, lambda name, _a, _repeats: scans[same_as.get(name, name)])

    return atomic_write(path, write)


def _narrowed(trace: Trace) -> dict[str, np.ndarray]:
    """The routing arrays as written: ids cast to :func:`id_dtype` (exact once :func:`validate`
    held them in [-1, n_experts)). Views of one array stay one array (a synthetic trace's
    ``exec_ids`` is its ``true_ids``), so the repeat is found without comparing them."""
    dt = id_dtype(trace.model.n_experts)
    done: dict[tuple, np.ndarray] = {}
    out = {}
    for name in ROUTING:
        a = getattr(trace, name)
        if name in ID_ARRAYS and a.dtype != dt:
            key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
            if key not in done:
                done[key] = a.astype(dt)
            a = done[key]
        out[name] = a
    return out


def _narrowed_streamed(stored: Streamed, dt: np.dtype) -> Streamed:
    """``stored`` with its id members declared, and each block cast, as :func:`id_dtype` says
    (the synthetic generator draws int16), so a streamed trace is the file :func:`write_trace`
    writes of it. Each member's blocks are cast into one scratch array, reused: a block is
    written before the next is asked for (:class:`Streamed`)."""
    wide = [n in ID_ARRAYS and d != dt for n, (_s, d) in stored.members.items()]
    if not any(wide):
        return stored
    members = {n: (s, dt if w else d) for (n, (s, d)), w in zip(stored.members.items(), wide)}
    declared = [d for _s, d in stored.members.values()]
    scratch: dict[int, np.ndarray] = {}

    def cast(i: int, b: np.ndarray) -> np.ndarray:
        out = scratch.get(i)
        if out is None or out.shape[0] < b.shape[0] or out.shape[1:] != b.shape[1:]:
            out = scratch[i] = np.empty(b.shape, dt)
        np.copyto(out[:len(b)], b, casting="same_kind")  # exact once the checks hold ids in [-1, n_experts)
        return out[:len(b)]

    def blocks() -> Iterator[tuple[np.ndarray, ...]]:
        for block in stored.blocks():  # a block not of its declared dtype goes on as it is, to be refused
            yield tuple(cast(i, b) if w and b.dtype == d else b
                        for i, (b, w, d) in enumerate(zip(block, wide, declared)))

    return Streamed(members, blocks)


def _name_id_width(header: dict[str, Any], dt: np.dtype) -> None:
    """Ids of one byte need version 4: a moesim that reads version 3 was never tested with them
    (numpy arithmetic on int8 wraps at 127), so it refuses the file rather than risk a wrong answer."""
    if dt.itemsize == 1:
        header["version"] = max(int(header["version"]), BYTE_IDS_VERSION)


def _header_bytes(header: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)


def _name_repeats(header: dict[str, Any], same_as: dict[str, str]) -> None:
    """Name the repeated routing members in ``header`` (version 3 when there are any)."""
    header.pop("same_as", None)
    if same_as:
        header["same_as"] = same_as
        header["version"] = max(int(header["version"]), SAME_AS_VERSION)


#: The first version whose header may name repeated routing members (``same_as``).
SAME_AS_VERSION = 3


def _kind(name: str) -> str:
    return "gates" if name.endswith("gates") else "ids"


def repeated_members(trace: Trace) -> dict[str, str]:
    """Routing arrays equal to an earlier one (same dtype, shape and values), each mapped to
    it: the file stores such an array once and the header's ``same_as`` names the repeat
    (version 3). A synthetic trace, or a run that executed the true experts, has
    ``exec_ids`` equal to ``true_ids``: 14% of the file not written, read or checked."""
    return _repeats({name: getattr(trace, name) for name in ROUTING})


def _repeats(routing: dict[str, np.ndarray]) -> dict[str, str]:
    """:func:`repeated_members` of the routing arrays ``routing`` (by name)."""
    out: dict[str, str] = {}
    for i, name in enumerate(ROUTING):
        a = routing[name]
        for first in ROUTING[:i]:
            b = routing[first]
            if first not in out and _kind(first) == _kind(name) and _equal(a, b):
                out[name] = first
                break
    return out


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and values, compared a block of rows at a time so that arrays that
    differ (the predictions against the true experts) are told apart in their first block."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a is b or not a.size or (a.ctypes.data == b.ctypes.data and a.strides == b.strides):  # views of one array
        return True
    rows = max(1, (1 << 20) // max(1, math.prod(a.shape[1:])))
    return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, a.shape[0], rows))


def _aliases(header: dict[str, Any], data: dict[str, np.ndarray], where: str) -> dict[str, str]:
    """The header's ``same_as`` (repeated routing members), every entry checked: a version 3
    header, an absent member that repeats an earlier present one of its kind."""
    same_as = header.get("same_as", {})
    if not same_as:
        return {}
    if header["version"] < SAME_AS_VERSION:
        raise MoesimError(f"{where}: trace header same_as (repeated arrays) needs format version {SAME_AS_VERSION}; "
                          f"the header says version {header['version']}")
    if not isinstance(same_as, dict):
        raise MoesimError(f"{where}: trace header same_as must be an object (array -> the array it repeats), "
                          f"got {type(same_as).__name__}")
    for alias, first in same_as.items():
        if (alias not in ROUTING or first not in ROUTING or ROUTING.index(first) >= ROUTING.index(alias)
                or _kind(first) != _kind(alias) or first in same_as):
            raise MoesimError(f"{where}: trace header same_as {alias!r}: {first!r} is not an earlier routing array "
                              "of its kind")
        if alias in data or first not in data:
            raise MoesimError(f"{where}: trace header same_as {alias!r}: {first!r} must be stored and {alias!r} not")
    return same_as


#: Members at least this large are stored, not deflated (and mapped when read): zlib ran
#: at ~8 MB/s on the 540 MB of a 100,000-token Qwen3-30B-A3B trace (69 s a write, 3.8 s to
#: read back) for a file only 26% smaller; stored, the write is the disk's speed.
STORE_MIN_BYTES = 1 << 20
#: A stored member's array data starts at a multiple of this many bytes in the file.
ALIGN = 64
#: A zip member's local header, fixed part (zip APPNOTE 4.3.7); its name and extra field follow.
_LOCAL = struct.Struct("<4s5H3L2H")
_ZIP64_EXTRA = 20  # the zip64 sizes zipfile puts in a local header written with force_zip64
_PAD_ID = 0xD935  # extra-field id of alignment padding (what Android's zipalign writes); readers skip it
#: Bytes the checks read at a time from a mapped member (stays in the cache).
SCAN_BYTES = 4 << 20


def _write_npz(f: IO[bytes], arrays: dict[str, np.ndarray], streamed: Streamed | None = None) -> None:
    """``arrays`` (then ``streamed``'s members) as ``.npy`` members of a zip archive on the seekable
    file ``f``, large ones stored and aligned, small ones deflated. The standard library's zipfile
    and numpy's own ``.npy`` header writer do the formats (any zip or npy reader reads the result);
    only the padding that aligns the data is computed here, and the layout of streamed members."""
    behind = _DropBehind(f)
    with zipfile.ZipFile(f, "w", allowZip64=True) as zf:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            head = _npy_head_bytes(a.shape, a.dtype)
            info = _member_info(name, a.nbytes >= STORE_MIN_BYTES, f.tell(), len(head))
            with zf.open(info, "w", force_zip64=True) as out:
                out.write(head)
                for b in _row_chunks(a, DROP_BEHIND_BYTES):  # so the pages behind go as it is written
                    out.write(b.reshape(-1).view(np.uint8))
                    behind.wrote(b.nbytes)
        if streamed is not None:
            _write_streamed(zf, f, streamed, behind)


def _npy_head_bytes(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    head = io.BytesIO()
    npformat.write_array_header_1_0(head, {"descr": npformat.dtype_to_descr(dtype), "fortran_order": False,
                                           "shape": tuple(shape)})
    return head.getvalue()


def _member_info(name: str, stored: bool, at: int, head: int) -> zipfile.ZipInfo:
    """A member's zip entry: stored with its data (after the ``head`` bytes of .npy header) aligned
    when the local header is written at offset ``at``, else deflated."""
    info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))  # same trace, same bytes
    info.external_attr = 0o644 << 16
    if stored:
        info.compress_type = zipfile.ZIP_STORED
        start = at + _LOCAL.size + len(info.filename.encode()) + 4 + _ZIP64_EXTRA + head
        info.extra = struct.pack("<HH", _PAD_ID, -start % ALIGN) + bytes(-start % ALIGN)
    else:
        info.compress_type = zipfile.ZIP_DEFLATED
    return info


@dataclass
class _Place:
    """Where a streamed member goes in the file, and how much of it is written."""

    info: zipfile.ZipInfo
    head: bytes  # its .npy header
    data: int  # file offset of its array data
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype
    done: int = 0


def _write_streamed(zf: zipfile.ZipFile, f: IO[bytes], streamed: Streamed, behind: _DropBehind) -> None:
    """Lay out ``streamed``'s members one after another as stored members (their sizes are known),
    then write each tuple of blocks into its members' places: one pass over the blocks, whatever
    the number of members (zipfile writes one member at a time, so a generator that draws every
    member at once would otherwise draw each again). zipfile's own ``ZipInfo.FileHeader`` writes
    the local headers, and each entry joins the archive's directory as ``zipfile`` does when a
    member it wrote is closed (``_ZipWriteFile.close``), so it writes the central directory."""
    at, places = zf.start_dir, []
    for name, (shape, dtype) in streamed.members.items():
        head = _npy_head_bytes(shape, dtype)
        info = _member_info(name, True, at, len(head))
        nbytes = math.prod(shape) * dtype.itemsize
        info.header_offset, info.CRC = at, zlib.crc32(head)
        info.file_size = info.compress_size = len(head) + nbytes
        data = at + len(info.FileHeader(zip64=True)) + len(head)
        places.append(_Place(info, head, data, nbytes, shape, dtype))
        at = data + nbytes
    for blocks in streamed.blocks():
        if len(blocks) != len(places):
            raise ValueError(f"{len(blocks)} blocks for {len(places)} streamed members")
        for place, b in zip(places, blocks):
            if b.dtype != place.dtype or b.shape[1:] != place.shape[1:] or place.done + b.nbytes > place.nbytes:
                raise ValueError(f"{place.info.filename}: a block of {b.dtype} {b.shape} beyond a member of "
                                 f"{place.dtype} {place.shape}")
            raw = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
            f.seek(place.data + place.done)
            f.write(raw)
            place.info.CRC = zlib.crc32(raw, place.info.CRC)
            place.done += b.nbytes
            behind.wrote(b.nbytes)
    for place in places:
        if place.done != place.nbytes:
            raise ValueError(f"{place.info.filename}: blocks of {place.done} bytes in a member of {place.nbytes}")
        f.seek(place.info.header_offset)
        f.write(place.info.FileHeader(zip64=True))  # now with the CRC-32
        f.write(place.head)
        zf.filelist.append(place.info)
        zf.NameToInfo[place.info.filename] = place.info
    f.seek(at)
    zf.start_dir = at


#: A write flushes what it wrote and drops it from the page cache every this many bytes.
DROP_BEHIND_BYTES = 64 << 20


class _DropBehind:
    """Write a large file without filling memory with its pages (as ``dd oflag=nocache`` or
    ``rsync --drop-cache`` do): every :data:`DROP_BEHIND_BYTES`, what was written is flushed
    (``fdatasync``) and its clean pages dropped (``posix_fadvise(DONTNEED)``), so the next
    bytes reuse the pages just freed. The file must reach the disk anyway (the write ends in
    ``fsync``); what this saves is memory, and on a virtual machine whose freed memory goes
    back to the host (this project's runs at ~0.4 GB/s for memory new to the guest), time: 600 MB
    written in 0.54-0.71 s against 0.53-2.39 s (three alternating runs, the slow one each time
    memory had gone back to the host). A file object without a descriptor is left alone."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.pending = f, 0
        try:
            self.fd = f.fileno() if hasattr(os, "posix_fadvise") else None
        except (AttributeError, OSError, io.UnsupportedOperation):
            self.fd = None

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.fd is None or self.pending < DROP_BEHIND_BYTES:
            return
        self.pending = 0
        self.f.flush()
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace; any problem is a one-line MoesimError naming the file.

    Stored routing arrays (large ones, as :func:`write_trace` writes them) are mapped from
    the file copy-on-write, not copied: their pages are read when a command first touches
    them, so an array a command never reads (the gates, for ``stats``) costs it no memory,
    and writing into one never changes the file. The checks read such arrays through a
    small buffer (with their CRC-32), not through the map. Deflated members (every trace
    written before version 2's stored layout, and small arrays) are decompressed."""
    where = str(path)
    try:
        return _read_trace(readable_path(path, "trace"), where)  # a pipe's bytes are spooled to a file first
    except MoesimError as e:
        raise MoesimError(original_names(str(e))) from None


def _read_trace(path: Path, where: str) -> Trace:
    kind = kind_of(path)
    if kind == "folder":
        raise MoesimError(f"trace {where} is a folder, not a trace file (.npz)")
    if kind == "missing":
        raise MoesimError(f"trace {where} does not exist")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic[:2] != b"PK":  # every .npz is a zip archive; anything else would reach numpy's pickle fallback
                raise MoesimError(f"{where}: not a readable moesim trace (not an .npz archive"
                                  + ("; it is empty)" if not magic else ")"))
            try:
                data, mapped = _read_members(f, os.fstat(f.fileno()).st_size)
            except _Mismatch as e:
                raise MoesimError(f"{where}: {e}") from None
            except _CORRUPT as e:
                raise _corrupt(where, e) from None
            return _checked(f, data, mapped, where)
    except OSError as e:
        raise MoesimError(f"cannot read trace {where}: {e.strerror or e}") from None


#: What reading a hostile or damaged archive raises (RuntimeError: zipfile's "encrypted,
#: password required"; NotImplementedError: an unknown compression method).
_CORRUPT = (zipfile.BadZipFile, EOFError, ValueError, zlib.error, struct.error, TypeError, OverflowError,
            SyntaxError, KeyError, NotImplementedError, RuntimeError, UnicodeDecodeError, MemoryError)


def _corrupt(where: str, e: BaseException) -> MoesimError:
    return MoesimError(f"{where}: not a readable moesim trace (corrupt or truncated: {e})")


#: Positional reads (no shared file position), so mapped members are scanned on threads.
_PREAD = hasattr(os, "preadv")
#: Mapped bytes from which the members are scanned on threads before the checks ask.
PRESCAN_MIN = 64 << 20


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` of ``fd``; returns the bytes read (fewer at the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def _scan_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _prescan(f: IO[bytes], mapped: dict[str, _Member]) -> None:
    """Scan the mapped members on threads before the checks ask for them: each reads its
    own part of the file by position, and the reads, CRC-32 and numpy's reductions release
    the GIL (100,000 Qwen3-30B-A3B tokens: 538 MB). A member whose scan fails is left
    unscanned, so the checks scan it again and its error comes where they raise it."""
    big = sorted(mapped.items(), key=lambda kv: -math.prod(kv[1].shape) * kv[1].dtype.itemsize)
    size = sum(math.prod(m.shape) * m.dtype.itemsize for _, m in big)
    threads = min(len(big), _scan_threads())
    if not _PREAD or threads < 2 or size < PRESCAN_MIN:
        return

    def one(item: tuple[str, _Member]) -> None:
        name, m = item
        try:
            m.scan(f, name == "true_ids")  # validate asks for repeats in true_ids alone
        except _CORRUPT:
            m.result = None

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, big))


def _checked(f: IO[bytes], data: dict[str, np.ndarray], mapped: dict[str, _Member], where: str) -> Trace:
    """The trace in ``data`` after every check, mapped members' CRC-32s included."""
    if "header" not in data:
        raise MoesimError(f"{where}: not a moesim trace (no header)")
    try:
        header = json.loads(bytes(data.pop("header")).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoesimError(f"{where}: trace header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise MoesimError(f"{where}: not a moesim trace (format is {header.get('format') if isinstance(header, dict) else None!r})")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE:  # True == 1, 3.0 == 3
        raise MoesimError(f"{where}: trace format version {version!r}; this moesim reads versions "
                          f"{', '.join(map(str, READABLE))}")
    aliases = _aliases(header, data, where)
    missing = [k for k in ("prompt_ids", "token_ids", *ROUTING) if k not in data and k not in aliases]
    if missing:
        raise MoesimError(f"{where}: trace lacks array(s) {', '.join(missing)}")
    core = {k: data.pop(k) for k in ("prompt_ids", "token_ids", *ROUTING) if k not in aliases}
    for alias, first in aliases.items():
        core[alias] = core[first].view()
        core[alias].flags.writeable = False  # a write meant for the repeat would change the original
    unknown = set(data) - set(TIMING_2D) - set(COUNTS_2D) - set(TIMING_1D) - set(COPY_FIELDS) - set(SD_FIELDS)
    if unknown:
        raise MoesimError(f"{where}: trace has unknown array(s) {', '.join(sorted(unknown))}")
    trace = Trace(header, timings=data, **core)

    def scan(name: str, a: np.ndarray, repeats: bool) -> _Scan:
        name = aliases.get(name, name)  # a repeat is the array it repeats: scanned once
        if name not in mapped:
            return _scan(_row_chunks(a), repeats)
        try:
            return mapped[name].scan(f, repeats)
        except _CORRUPT as e:
            raise _corrupt(where, e) from None

    _prescan(f, mapped)
    validate(trace, where, scan)
    for name, m in mapped.items():  # a mapped member no check read: its CRC-32 all the same
        if m.result is None:
            scan(name, core[name], False)
    return trace


@dataclass
class _Scan:
    """What the checks need of one array, gathered a chunk at a time: its range (over the
    values that are not NaN), whether it holds a NaN, whether a row of its last axis holds
    a value twice (when asked)."""

    lo: Any = None
    hi: Any = None
    nan: bool = False
    repeats: bool = False

    @property
    def finite(self) -> bool:
        return not self.nan and (self.lo is None or bool(np.isfinite(self.lo) and np.isfinite(self.hi)))


def _row_chunks(a: np.ndarray, nbytes: int = SCAN_BYTES) -> Iterator[np.ndarray]:
    """``a`` in views along its first axis of about ``nbytes`` each."""
    if a.ndim == 0:
        yield a.reshape(1)
        return
    rows = max(1, nbytes // max(1, a[:1].nbytes))
    for i in range(0, a.shape[0], rows):
        yield a[i:i + rows]


def _scan(chunks: Iterable[np.ndarray], repeats: bool) -> _Scan:
    """:class:`_Scan` of the array that ``chunks`` (slices along its first axis) make up.
    Arrays of other kinds than bool, int and float are skipped (their dtype is refused)."""
    out = _Scan()
    for c in chunks:
        _scan_add(out, c, repeats)
    return out


def _scan_add(out: _Scan, c: np.ndarray, repeats: bool) -> None:
    """Fold the slice ``c`` into ``out``."""
    if not c.size or c.dtype.kind not in "biuf":
        return
    lo, hi = c.min(), c.max()  # NaN when c holds one: the reductions propagate it
    if lo != lo or hi != hi:
        out.nan = True
    else:
        out.lo = lo if out.lo is None else min(out.lo, lo)
        out.hi = hi if out.hi is None else max(out.hi, hi)
    if repeats and not out.repeats and c.ndim:
        out.repeats = _has_repeat(c.reshape(-1, c.shape[-1]))


def _has_repeat(rows: np.ndarray) -> bool:
    """Whether a row of ``rows`` [n, k] holds a value twice. Up to k = 16, every pair of
    columns is compared as two contiguous vectors (k(k-1)/2 compares: ~5x faster than
    sorting millions of rows of 8); wider rows are sorted."""
    n, k = rows.shape
    if k < 2 or n == 0:
        return False
    if k > 16:
        srt = np.sort(rows, axis=1)
        return bool((srt[:, 1:] == srt[:, :-1]).any())
    cols = np.ascontiguousarray(rows.T)
    eq = np.empty(n, np.bool_)
    for i in range(k - 1):
        for j in range(i + 1, k):
            np.equal(cols[i], cols[j], out=eq)
            if eq.any():
                return True
    return False


@dataclass
class _Member:
    """A stored ``.npy`` member as it lies in the file."""

    filename: str
    head: bytes  # the member's bytes before its array data: the .npy header
    offset: int  # of the array data in the file
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    crc: int
    result: _Scan | None = None  # of the last scan (repeats looked for when asked)
    asked_repeats: bool = False

    def scan(self, f: IO[bytes], repeats: bool) -> _Scan:
        """:func:`_scan` of the array, read through a buffer of :data:`SCAN_BYTES` (not
        through any map of the file), checking the member's CRC-32 on the way."""
        if self.result is not None and (self.asked_repeats or not repeats):
            return self.result
        row = self.dtype.itemsize * math.prod(self.shape[1:])
        total = row * self.shape[0] if self.shape else self.dtype.itemsize
        buf = bytearray(min(total, max(row, SCAN_BYTES // max(row, 1) * row)))
        crc = zlib.crc32(self.head)

        def chunks() -> Iterator[np.ndarray]:
            nonlocal crc
            done = 0
            if not _PREAD:
                f.seek(self.offset)
            while done < total:
                n = min(len(buf), total - done)
                view = memoryview(buf)[:n]
                if (_pread_into(f.fileno(), view, self.offset + done) if _PREAD else f.readinto(view)) != n:
                    raise EOFError(f"{self.filename}: array data cut short")
                crc = zlib.crc32(view, crc)
                done += n
                yield np.frombuffer(buf, self.dtype, n // self.dtype.itemsize).reshape(-1, *self.shape[1:])

        result = _scan(chunks(), repeats)
        if crc != self.crc:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self.filename!r}")
        self.result, self.asked_repeats = result, repeats
        return result

    @property
    def mappable(self) -> bool:
        """Large, C-ordered, native and aligned: served straight from a map of the file."""
        return (self.dtype.kind in "biuf" and self.dtype.isnative and not self.fortran and bool(self.shape)
                and self.offset % self.dtype.alignment == 0
                and math.prod(self.shape) * self.dtype.itemsize >= STORE_MIN_BYTES)


def _read_members(f: IO[bytes], size: int) -> tuple[dict[str, np.ndarray], dict[str, _Member]]:
    """Every member of the ``.npz`` open as ``f`` (``size`` bytes): its arrays, and which
    routing arrays were mapped (:class:`_Member`, for the checks to read)."""
    zf = zipfile.ZipFile(f)
    infos = zf.infolist()
    if len({i.filename for i in infos}) != len(infos):
        raise zipfile.BadZipFile("a member name repeats")
    data: dict[str, np.ndarray] = {}
    to_map: dict[str, _Member] = {}
    infos = sorted(infos, key=lambda i: i.filename != "header.npy")  # the header first: it says the routing's shape
    expected = None
    for info in infos:
        if not info.filename.endswith(".npy"):
            data[info.filename] = np.zeros(0)  # not an array: named in the "unknown array" error
            continue
        name = info.filename[:-4]
        if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 1:
            m = _stored_member(f, info, size)
            if name in ROUTING and m.mappable:
                to_map[name] = m
            else:
                data[name] = _read_stored(f, m)
        else:
            data[name] = _read_deflated(zf, info, expected if name in ROUTING else None)
        if name == "header":
            expected = _routing_shape(data[name])
    if to_map:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private pages: writes never reach the file
        for name, m in to_map.items():
            data[name] = np.frombuffer(mm, m.dtype, math.prod(m.shape), m.offset).reshape(m.shape)
    return data, to_map


def _npy_header(fp: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of a ``.npy`` header (numpy's parser, which reads a
    literal and never runs code); object dtypes (pickles) are refused."""
    version = npformat.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = npformat.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = npformat.read_array_header_2_0(fp)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError("object arrays (pickles) are not read")
    return tuple(int(x) for x in shape), bool(fortran), dtype


def _stored_member(f: IO[bytes], info: zipfile.ZipInfo, size: int) -> _Member:
    """Where a stored member's array lies in the file (its local and ``.npy`` headers read,
    their sizes checked against the zip's and the file's)."""
    f.seek(info.header_offset)
    local = f.read(_LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header of {info.filename!r}")
    *_, name_len, extra_len = _LOCAL.unpack(local)
    start = info.header_offset + _LOCAL.size + name_len + extra_len
    if info.compress_size != info.file_size or start + info.file_size > size:
        raise zipfile.BadZipFile(f"{info.filename!r} runs past the end of the file")
    f.seek(start)
    shape, fortran, dtype = _npy_header(f)
    offset = f.tell()
    if offset - start + math.prod(shape) * dtype.itemsize != info.file_size:
        raise zipfile.BadZipFile(f"{info.filename!r} holds {info.file_size} bytes, not what its header says")
    f.seek(start)
    return _Member(info.filename, f.read(offset - start), offset, shape, fortran, dtype, info.CRC)


def _native(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _read_stored(f: IO[bytes], m: _Member) -> np.ndarray:
    """A stored member copied into memory, its CRC-32 checked."""
    a = np.empty(m.shape, m.dtype, order="F" if m.fortran else "C")
    raw = a.reshape(-1, order="A").view(np.uint8)
    f.seek(m.offset)
    if a.nbytes and f.readinto(raw) != a.nbytes:
        raise EOFError(f"{m.filename}: array data cut short")
    if zlib.crc32(raw, zlib.crc32(m.head)) != m.crc:
        raise zipfile.BadZipFile(f"Bad CRC-32 for file {m.filename!r}")
    return _native(a)


class _Mismatch(Exception):
    """A member whose shape the trace's own header contradicts, found before it is unpacked."""


#: A deflated routing member at least this large has its shape checked before it is
#: unpacked; smaller ones are unpacked and checked with the rest (the same messages).
EARLY_SHAPE_BYTES = 64 << 20
#: Bytes a trace's JSON header may hold (a 1,000-layer model's header is a few hundred KB).
HEADER_MAX_BYTES = 64 << 20


def _routing_shape(raw: np.ndarray) -> tuple[int, ...] | None:
    """[tokens, MoE layers, batch, top_k] as the header says, or None where it cannot say
    (the full checks then report what is wrong with it)."""
    try:
        h = json.loads(bytes(raw).decode())
        spec = ModelSpec.from_dict(h["model"])
        shape = (h["n_tokens"], spec.n_moe_layers, h["batch"], spec.top_k)
    except Exception:  # noqa: BLE001 - any malformed header: _checked says what is wrong
        return None
    return shape if all(isinstance(v, int) and not isinstance(v, bool) for v in shape) else None


def _read_deflated(zf: zipfile.ZipFile, info: zipfile.ZipInfo, expected: tuple[int, ...] | None = None) -> np.ndarray:
    """A compressed member (zipfile checks its CRC-32 at its end), its header's size checked
    against the zip's, and a routing member's shape against ``expected`` (the trace header's),
    before anything is allocated or unpacked: a member of zeros deflates ~1000:1, so a 3 MB
    file could otherwise make the reader unpack gigabytes before its shape was refused."""
    if info.filename == "header.npy" and info.file_size > HEADER_MAX_BYTES:
        raise zipfile.BadZipFile(f"its header member holds {info.file_size} bytes (at most {HEADER_MAX_BYTES})")
    with zf.open(info) as fp:
        shape, fortran, dtype = _npy_header(fp)
        nbytes = math.prod(shape) * dtype.itemsize
        if expected is not None and shape != expected and nbytes >= EARLY_SHAPE_BYTES:
            raise _Mismatch(f"{info.filename[:-4]} has shape {shape}, expected {expected} (the header's tokens, "
                            "MoE layers, batch and top-k)")
        if nbytes > info.file_size:
            raise zipfile.BadZipFile(f"{info.filename!r} holds {info.file_size} bytes, its header says more")
        a = np.empty(shape, dtype, order="F" if fortran else "C")
        raw = a.reshape(-1, order="A").view(np.uint8)
        done = 0
        while done < nbytes:
            chunk = fp.read(min(SCAN_BYTES, nbytes - done))
            if not chunk:
                raise EOFError(f"{info.filename}: array data cut short")
            raw[done:done + len(chunk)] = np.frombuffer(chunk, np.uint8)
            done += len(chunk)
        if fp.read(1):
            raise zipfile.BadZipFile(f"{info.filename!r} holds more than its header says")
    return _native(a)


def validate(trace: Trace, where: str,
             scan: Callable[[str, np.ndarray, bool], _Scan] | None = None) -> None:
    """Check shapes, dtypes, ranges and header consistency; raise a one-line error.

    The routing arrays' value checks go through ``scan(name, array, repeats)`` (default: the
    array in memory, a few MB at a time; :func:`read_trace` reads mapped ones from the file)."""
    if scan is None:
        def scan(name: str, a: np.ndarray, repeats: bool) -> _Scan:
            return _scan(_row_chunks(a), repeats)

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
            raise bad(f"{k_} has dtype {a.dtype}, expected {'float' if kind == 'f' else 'a signed integer (int8, int16)'}")
    n = h.get("n_tokens", t)
    if isinstance(n, bool) or not isinstance(n, int):
        raise bad(f"header n_tokens {n!r} must be a whole number of decode steps")
    if n != t:
        raise bad(f"header says {h.get('n_tokens')} tokens but arrays hold {t} (truncated?)")
    e = spec.n_experts
    ids = scan("true_ids", trace.true_ids, True)
    if ids.lo < 0 or ids.hi >= e:
        raise bad(f"true_ids outside [0, {e})")
    for k_ in ("pred_ids", "exec_ids"):
        sc = scan(k_, getattr(trace, k_), False)
        if sc.lo < -1 or sc.hi >= e:
            raise bad(f"{k_} outside [-1, {e})")
    if ids.repeats:
        raise bad("true_ids repeats an expert within one token's top-k")
    for k_ in ("true_gates", "pred_gates"):
        sc = scan(k_, getattr(trace, k_), False)
        if not sc.finite or sc.lo < 0 or sc.hi > 1 + 1e-5:
            raise bad(f"{k_} must be finite and in [0, 1]")
    for k_ in ("prompt_ids", "token_ids"):
        ids = getattr(trace, k_)
        if ids.ndim != 2 or ids.shape[0] != b:
            raise bad(f"{k_} must be [batch={b}, n], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= spec.vocab):
            raise bad(f"{k_} outside the vocabulary [0, {spec.vocab})")
    if trace.token_ids.shape[1] != t:
        raise bad(f"token_ids holds {trace.token_ids.shape[1]} tokens, routing {t}")
    # The header's prompt length prices prefill and every step's attention: one the prompt the
    # trace holds contradicts (10**12 for a 128-token prompt) gave a TTFT of 5.5e15 ms.
    p, held = h.get("prompt_len"), trace.prompt_ids.shape[1]
    if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0 or (held and p != held)):
        raise bad(f"header prompt_len {p!r} is not the {held} prompt tokens the trace holds" if held else
                  f"header prompt_len {p!r} must be a whole number of tokens >= 0")
    if h.get("batch", b) != b:
        raise bad(f"header says batch {h.get('batch')!r} but the arrays hold {b} sequences")
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
            raise bad("speculative records need trace format version 2 or later")
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
