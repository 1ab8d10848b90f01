"""Atomic file writes: write to a temporary file beside the target, then rename.

An interrupted run therefore leaves either the old file or the new one, never half of one.
The temporary file carries the writer's process id (``.NAME.PID.XXXX.tmp``): an exception,
Ctrl-C or SIGTERM (the CLI turns it into an exit) removes it on the way out, and one left by
a process that was killed outright (SIGKILL, power loss) is removed by the next write to
the same target once that process no longer exists.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from moesim.errors import MoesimError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_tmp(path: str | os.PathLike) -> list[Path]:
    """Remove temporary files that dead writers left beside ``path``; return them."""
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        parts = tmp.name[len(path.name) + 2:].split(".")
        if len(parts) >= 3 and parts[0].isdigit() and not _pid_alive(int(parts[0])):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(fileobj)`` on a temporary file and move it to ``path`` when it returns.

    A place that cannot be written (a folder in the way, a read-only file system) is a
    one-line :class:`MoesimError`; commands check their outputs before working
    (:mod:`moesim.outputs`), this is the backstop."""
    path = Path(path)
    if path.is_dir():
        raise MoesimError(f"cannot write {path}: it is a folder")
    if path.exists() and not path.is_file():  # the rename would replace a device or pipe node
        raise MoesimError(f"cannot write {path}: it is not a regular file (a device, pipe or socket)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    except (FileExistsError, NotADirectoryError):
        raise MoesimError(f"cannot write {path}: a file is in the way of its folder") from None
    except OSError as e:
        raise MoesimError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise MoesimError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))
