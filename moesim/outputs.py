"""Where a command may write, checked before it does any work.

A run that computes for minutes and then cannot write its result wastes the minutes,
and an ``OSError`` deep inside a writer is a traceback, not an answer. Every command
that writes calls :func:`check_output_file` or :func:`check_output_dir` on its
destination first: a file where a folder is expected (or the reverse), a path under a
file, or a read-only place is one :class:`~moesim.errors.MoesimError` line.

Writability is *probed* (a temporary file created and removed in the nearest existing
folder) rather than read from permission bits: root ignores the bits, while a read-only
mount or an immutable folder stops root too.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.inputs import check_name, kind_of


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists; an ancestor that is a file is an error."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _probe_writable(folder: Path, what: str, target: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".moesim-probe."):
            pass
    except OSError as e:
        why = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "not permitted (read-only or immutable folder)",
               errno.ENOSPC: "no space left"}.get(e.errno, e.strerror or str(e))
        raise MoesimError(f"{what} {target}: cannot write in {folder}: {why}") from None


def _check_ancestors(path: Path, what: str) -> Path:
    existing = _nearest_existing(path.parent if path.parent != Path("") else Path("."))
    if existing.exists() and not existing.is_dir():
        raise MoesimError(f"{what} {path}: {existing} is a file, not a folder")
    return existing


def check_link(path: Path, what: str) -> None:
    """A symbolic link written through must lead somewhere (a dangling one's target is created):
    the write renames onto the file the link names, and a link that names none (a loop) would
    itself be replaced by the file."""
    if path.is_symlink():
        try:
            os.path.realpath(path, strict=True)
        except FileNotFoundError:  # dangling: the write makes its target, which needs a folder
            target = Path(os.path.realpath(path))
            if not target.parent.is_dir():
                raise MoesimError(f"{what} {path}: a symbolic link to {target}, whose folder does not exist") from None
        except OSError as e:
            raise MoesimError(f"{what} {path}: a symbolic link that cannot be followed ({e.strerror or e})") from None


def check_output_file(path: str | os.PathLike, suffixes: Iterable[str] = (), what: str = "--out") -> Path:
    """Check that a file can be (over)written at ``path`` (with one of ``suffixes``, if
    given) and return it as a Path. Creates nothing."""
    path = Path(path)
    check_name(path, what)
    check_link(path, what)
    suffixes = tuple(suffixes)
    if path.is_dir():
        raise MoesimError(f"{what} {path} is a folder; a file is expected"
                          + (f" ({' or '.join(suffixes)})" if suffixes else ""))
    if suffixes and path.suffix.lower() not in suffixes:
        raise MoesimError(f"{what} {path}: expected a {' or '.join(suffixes)} file")
    if path.exists() and not path.is_file():
        # A write is a rename onto the path: it would replace the device or pipe node itself
        # (as root, `--out /dev/null` would have turned /dev/null into a regular file).
        raise MoesimError(f"{what} {path} is not a regular file (a device, pipe or socket); give a file path")
    folder = _check_ancestors(path, what)
    _probe_writable(folder, what, path)
    return path


def check_output_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Check that ``path`` is, or can become, a folder we can write in. Creates nothing."""
    path = Path(path)
    check_name(path, what)
    check_link(path, what)
    if path.exists() and not path.is_dir():
        kind = kind_of(path)
        raise MoesimError(f"{what} {path} is a {kind}; a folder is expected")
    folder = path if path.is_dir() else _check_ancestors(path, what)
    _probe_writable(folder, what, path)
    return path


def check_free_space(path: str | os.PathLike, nbytes: float, what: str) -> None:
    """Refuse, before any work, a write of ``nbytes`` to ``path`` that its file system has no
    room for (a streamed trace can be larger than memory: 10^8 Qwen3-235B-A22B steps are 600 GB)."""
    import shutil

    folder = _nearest_existing(Path(path).absolute().parent)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # the write itself says what went wrong
    if nbytes > free:
        raise MoesimError(f"{what} needs about {number(nbytes / 1e9)} GB on disk and {folder} has {number(free / 1e9)} GB free: "
                          "refusing (ask for fewer tokens, layers or sequences)")
