"""Atomic file writes: write to a temporary file beside the target, then rename.

An interrupted run therefore leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(fileobj)`` on a temporary file and move it to ``path`` when it returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))
