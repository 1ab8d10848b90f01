"""Atomic file writes: write to a temporary file beside the target, then rename.

An interrupted run therefore leaves either the old file or the new one, never half of one.
The temporary file carries the writer's process id (``.NAME.PID.XXXX.tmp``; NAME cut and
hashed, ``.NAM~HASH.PID.XXXX.tmp``, where the whole would not fit the file system's name
limit while the final name does): an exception,
Ctrl-C or SIGTERM (the CLI turns it into an exit) removes it on the way out, and one left by
a process that was killed outright (SIGKILL, power loss) is removed by the next write to
the same target once that process no longer exists.
"""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from moesim import stop
from moesim.errors import MoesimError
from moesim.inputs import check_name, name_max  # the file system's name limits: one definition, with the inputs'
from moesim.outputs import check_link  # a symbolic link loop is refused, not replaced by the file

_PID_ROOM = 10  # digits a process id may take in a temporary name (Linux: at most 7)
_TMP_EXTRA = 1 + 1 + _PID_ROOM + 1 + 8 + 4  # ".", ".", pid, ".", mkstemp's 8 letters, ".tmp"


def _short(name: str, room: int) -> str:
    """``name`` cut to fit ``room`` bytes with a hash of the whole (so two long names that
    share a beginning still differ)."""
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    keep = os.fsencode(name)[: max(0, room - 13)].decode(errors="ignore")
    return f"{keep}~{digest}"


def sidecar(path: str | os.PathLike, suffix: str) -> Path:
    """The file beside ``path`` named ``NAME + suffix`` (a manifest, a lock), or a shortened
    form of it when that name would not fit where ``NAME`` does."""
    path = Path(path)
    if path.name in ("", ".", ".."):  # '--out .' (ValueError: empty name) or '..': the folder's own name
        path = Path(os.path.abspath(path))
    if not path.name:
        raise MoesimError(f"{path}: a file system's root has no name to put {suffix} beside; choose a folder in it")
    limit = name_max(path.parent)
    if len(os.fsencode(path.name + suffix)) <= limit:
        return path.with_name(path.name + suffix)
    return path.with_name(_short(path.name, limit - len(os.fsencode(suffix))) + suffix)


def _tmp_stem(path: Path) -> str:
    """What the temporary names beside ``path`` start with: its name, or a shortened form
    when the temporary name would not fit (the final name does)."""
    limit = name_max(path.parent)
    if len(os.fsencode(path.name)) + _TMP_EXTRA <= limit:
        return path.name
    return _short(path.name, limit - _TMP_EXTRA)


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
    stem = _tmp_stem(path)
    for tmp in path.parent.glob(f".{glob.escape(stem)}.*.tmp"):
        parts = tmp.name[len(stem) + 2:].split(".")
        if len(parts) >= 3 and parts[0].isdigit() and not _pid_alive(int(parts[0])):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


STOP_SIGNALS = frozenset(stop.STOP_SIGNALS)  # the signals the CLI turns into an exit


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while the block runs; one that arrives meanwhile is delivered
    as it ends. For appends that must land whole (a sweep group's rows and their digest), where
    a rename cannot help."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(fileobj)`` on a temporary file and move it to ``path`` when it returns.

    A place that cannot be written (a folder in the way, a read-only file system) is a
    one-line :class:`MoesimError`; commands check their outputs before working
    (:mod:`moesim.outputs`), this is the backstop."""
    given = path = Path(path)
    check_name(path, "cannot write")
    check_link(path, "cannot write")
    if path.is_symlink():  # write the file the link points to: the rename would replace the link itself
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise MoesimError(f"cannot write {path}: it is a folder")
    if path.exists() and not path.is_file():  # the rename would replace a device or pipe node
        raise MoesimError(f"cannot write {path}: it is not a regular file (a device, pipe or socket)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{_tmp_stem(path)}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
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
    return given


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


_held: dict[str, int] = {}  # lock files this process holds -> how many nested holds


@contextmanager
def exclusive(path: str | os.PathLike, what: str = "--out") -> Iterator[None]:
    """Hold ``path``'s lock (``fcntl.flock`` on ``NAME.lock`` beside it) while within: a
    second run on the same output is refused in one line instead of interleaving its rows
    with the first's. The kernel drops the lock when its holder dies (even by SIGKILL), so
    a stale lock file never blocks; the file is removed on the way out. Nested holds by
    this process are allowed (a command and the library it calls)."""
    import fcntl

    lock = sidecar(path, ".lock")
    try:
        key = str(lock.resolve())
    except (OSError, RuntimeError) as e:  # a symbolic link loop in the path (RuntimeError up to Python 3.12)
        raise MoesimError(f"{what} {path}: cannot resolve its path ({e})") from None
    if _held.get(key):
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoesimError(f"{what} {path}: cannot create its folder: {e.strerror or e}") from None
    for _ in range(20):  # the file was unlinked by a holder finishing just as we opened it: again
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MoesimError(f"{what} {path}: cannot create its lock file {lock.name}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise MoesimError(f"{what} {path} is in use by another moesim run"
                              + (f" (process {holder})" if holder.isdigit() else "")
                              + ": wait for it to finish, or choose another path") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise MoesimError(f"{what} {path}: could not take its lock {lock.name}")
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[key] = 1
    try:
        yield
    finally:
        del _held[key]
        with suppress(OSError):
            lock.unlink()  # while still holding it: a waiter that opened it sees another inode and retries
        os.close(fd)
