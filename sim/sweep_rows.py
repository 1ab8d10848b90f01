"""A sweep's rows CSV (``whatif --rows``): streamed as groups finish, checked when resumed.

Beside ``NAME`` live ``NAME.sweep.json`` (the sweep's fingerprint: which traces, hardware
and settings the rows belong to) and ``NAME.sweep.sums`` (one line per finished group:
its index and a digest of its rows' cells, keyed by the fingerprint), and, while a run
holds it, ``NAME.lock`` (:func:`moesim.atomic.exclusive`). Names too long for the file
system beside a legal ``NAME`` are shortened (:func:`moesim.atomic.sidecar`).

Resuming trusts nothing it did not write: a file whose header is not a sweep's, or
whose manifest is another sweep's, is refused in one line; a finished group whose rows
do not match their digest (a value edited, a row added, removed, duplicated or copied
from another sweep), or whose values are not what a run writes (negative or NaN times,
a group index out of range), is dropped and recomputed, and the run says so in a note.
A torn last line (a run killed mid-write) and incomplete groups are dropped silently.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from moesim.atomic import atomic_write_text, sidecar, signals_held
from moesim.errors import MoesimError
from moesim.outputs import check_output_file

#: Figures that a run writes as a number >= 0 or leaves empty (None); anything else is an edit.
NON_NEGATIVE = ("tpot_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "tokens_per_s", "compute_ms", "copy_ms",
                "stall_ms", "cpu_ms", "cpu_wait_ms", "overlap_ms", "serial_bound_ms", "overlap_bound_ms",
                "experts_loaded_per_token", "gb_moved_per_token", "ttft_ms", "device_gb_needed", "host_gb_needed",
                "cache_gib", "link_gbps", "tokens", "batch", "prompt_len")


def manifest_path(out: Path) -> Path:
    return sidecar(out, ".sweep.json")


def sums_path(out: Path) -> Path:
    return sidecar(out, ".sweep.sums")


def digest(fingerprint: str, cells: list[list[str]]) -> str:
    h = hashlib.sha256(fingerprint.encode())
    for row in cells:
        h.update("\x1f".join(row).encode("utf-8", "surrogateescape"))
        h.update(b"\x1e")
    return h.hexdigest()[:24]


def parse(value: str) -> Any:
    """A CSV cell back to the type the row had (the writer writes repr-exact floats)."""
    if value in ("True", "False"):
        return value == "True"
    if value == "":
        return None  # a figure the row's policy does not have
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _implausible(row: dict[str, Any], groups: int) -> str | None:
    """Why ``row`` is not what a run writes, or None."""
    g = row.get("group")
    if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < groups:
        return f"group {g!r} is not one of the sweep's {groups}"
    if not isinstance(row.get("fits"), bool):
        return f"fits {row.get('fits')!r} is not True or False"
    for c in NON_NEGATIVE:
        v = row.get(c)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            return f"{c} {v!r} is not a number >= 0"
    if row["fits"] and not (isinstance(row.get("tpot_ms"), (int, float)) and row["tpot_ms"] > 0):
        return f"a fitting row with tpot_ms {row.get('tpot_ms')!r}"
    return None


def _read(out: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """The rows of ``out`` as cell texts, a torn last line dropped; a file that is not a
    sweep's rows CSV is one line."""
    not_ours = (f"--rows {out} is not a sweep's rows CSV ({{why}}); choose another path, or remove it and its "
                f"{manifest_path(out).name} to start over")
    try:
        text = out.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise MoesimError(not_ours.format(why="not UTF-8 text")) from None
    except OSError as e:
        raise MoesimError(f"--rows {out}: cannot read it: {e.strerror or e}") from None
    if "\x00" in text:
        raise MoesimError(not_ours.format(why="it holds NUL bytes"))
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]  # torn by the interruption
    if not lines:
        return []
    try:
        reader = csv.reader(lines)
        header = next(reader)
        if tuple(header) != columns:
            extra = sorted(set(header) - set(columns))
            why = (f"columns this moesim does not write: {', '.join(extra[:3])}" if extra
                   else "its header is not the columns a sweep writes")
            raise MoesimError(not_ours.format(why=why))
        return [dict(zip(columns, rec)) for rec in reader if len(rec) == len(columns)]
    except csv.Error as e:
        raise MoesimError(not_ours.format(why=f"not CSV: {e}")) from None


def _read_sums(path: Path) -> dict[int, str]:
    sums: dict[int, str] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return sums
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            sums[int(parts[0])] = parts[1]
    return sums


def resume(sweep, out: Path, columns: tuple[str, ...], notes: list[str] | None = None
           ) -> dict[int, list[dict[str, Any]]]:
    """Finished, verified groups of an earlier run of the same sweep in ``out`` (rows of
    ``columns``: the what-if's row schema, passed in so this module needs nothing of the
    what-if's); the file (and its digests) rewritten with only those (see the module docstring)."""
    manifest, sums_file = manifest_path(out), sums_path(out)
    fingerprint = sweep.fingerprint()
    groups, per_group = len(sweep.groups()), sweep.group_size
    if out.exists():
        if not out.is_file():
            raise MoesimError(f"--rows {out} is not a regular file; give a file path")
        if not manifest.exists():
            raise MoesimError(f"{out} exists and is not a resumable sweep output; choose another path or remove it")
        try:
            old = json.loads(manifest.read_text(encoding="utf-8")).get("fingerprint")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            old = None
        if old != fingerprint:
            raise MoesimError(f"{out} holds a different sweep (other traces, hardware or settings, or a profile file "
                              f"edited since), or its "
                              f"{manifest.name} was edited; choose another path or remove it to start over")
        records = _read(out, columns)
    else:
        records = []
    atomic_write_text(manifest, json.dumps({"fingerprint": fingerprint, "groups": groups,
                                            "rows_per_group": per_group}))
    if not out.exists():
        sums_file.unlink(missing_ok=True)
        return {}
    sums = _read_sums(sums_file)
    by_group: dict[Any, list[dict[str, str]]] = {}
    for rec in records:
        by_group.setdefault(parse(rec["group"]), []).append(rec)
    finished: dict[int, list[dict[str, Any]]] = {}
    refused: list[str] = []
    for g, recs in by_group.items():
        rows = [{k: parse(v) for k, v in rec.items()} for rec in recs]
        if len(rows) != per_group:
            if len(rows) > per_group:
                refused.append(f"group {g}: {len(rows)} rows, a group has {per_group}")
            continue  # an incomplete group: the run died while writing it
        why = next((w for w in map(lambda r: _implausible(r, groups), rows) if w), None)
        if why is None and sums.get(g) != digest(fingerprint, [[rec[c] for c in columns] for rec in recs]):
            why = "its rows do not match the digest written with them" if g in sums else "no digest was written for it"
        if why is not None:
            refused.append(f"group {g}: {why}")
            continue
        finished[g] = rows
    if refused and notes is not None:
        notes.append(f"{out}: {len(refused)} finished group(s) not as this sweep wrote them (edited, foreign or "
                     f"duplicated rows; first: {refused[0]}): recomputed, never reported as they were")
    body = [r for g in sorted(finished) for r in finished[g]]
    write_rows(out, body, fingerprint, fresh=True)
    return finished


def _csv_text(rows: list[dict[str, Any]], header: bool) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    if header:
        w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _group_digests(fingerprint: str, text: str) -> dict[str, str]:
    """Each group's digest, from the CSV text as written (read back as resume reads it)."""
    per: dict[str, list[list[str]]] = {}
    for rec in csv.reader(io.StringIO(text)):
        per.setdefault(rec[-1], []).append(rec)  # "group" is the last column
    return {g: digest(fingerprint, cells) for g, cells in per.items()}


def write_rows(out: Path, rows: list[dict[str, Any]], fingerprint: str, fresh: bool = False) -> None:
    """Append one group's ``rows`` to ``out`` and its digest to the digests file, each
    flushed to disk (``fresh``: atomically replace both with ``rows``, any number of groups)."""
    sums_file = sums_path(out)
    if fresh and not rows:
        out.unlink(missing_ok=True)
        sums_file.unlink(missing_ok=True)
        return
    if not rows:
        return
    body = _csv_text(rows, header=False)
    sums = "".join(f"{g} {d}\n" for g, d in _group_digests(fingerprint, body).items())
    if fresh:
        atomic_write_text(sums_file, sums)
        atomic_write_text(out, _csv_text(rows[:1], header=True).split("\n", 1)[0] + "\n" + body)
        return
    new = not out.exists()
    with signals_held():  # a group lands whole, rows and digest, or not at all
        with out.open("a", newline="", encoding="utf-8") as f:
            f.write((_csv_text(rows[:1], header=True).split("\n", 1)[0] + "\n" if new else "") + body)
            f.flush()
            os.fsync(f.fileno())
        with sums_file.open("a", encoding="utf-8") as f:
            f.write(sums)
            f.flush()
            os.fsync(f.fileno())


def check_rows_path(out: Path) -> None:
    """``--rows`` checked before any work: a file (or a place one can be made) with names
    that fit, and, if it exists, one this moesim could have written."""

    check_output_file(out, what="--rows")
    for p in (manifest_path(out), sums_path(out)):
        if p.exists() and not p.is_file():
            raise MoesimError(f"--rows {out}: {p.name} beside it is not a regular file")
