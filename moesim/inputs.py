"""What a user names as an input file, checked before it is read.

Every input path goes through one of these readers (the outputs' counterpart is
:mod:`moesim.outputs`). Before reading, the path is looked at, not opened:

- missing: ``does not exist``; a folder: ``is a folder``; a name longer than the file
  system allows: one line (never ``OSError: File name too long``);
- a regular file larger than the cap of its kind (a hardware profile is a few KB; a
  routing dump is bounded by this machine's memory): one line with both sizes, before
  reading a byte of it;
- a pipe (process substitution ``<(cat x.npz)``, ``/dev/stdin`` fed by a pipe) or a named
  pipe (FIFO) that a writer feeds: read, up to the cap. A named pipe nobody writes to
  within :data:`PIPE_WAIT_S` is refused (``a named pipe (FIFO) nothing was written to``)
  instead of blocking in ``open()`` forever;
- a device (``/dev/zero``, a terminal) or a socket: ``not a regular file``, never read
  (``/dev/zero`` as a profile once read until the kernel's OOM killer stopped it).

Readers that need a real file (a trace is a zip archive, read by random access and mapped)
get a pipe's bytes *spooled* into a temporary regular file (:func:`readable_path`), removed
at exit; :func:`original_names` puts the name the user gave back into a message that
names the temporary file.
"""

from __future__ import annotations

import atexit
import errno
import os
import select
import stat
import tempfile
from pathlib import Path

from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.host_detect import available_memory

KiB, MiB, GiB = 2**10, 2**20, 2**30
#: Caps per kind of input (bytes): far above any real file of the kind, far below memory.
TOML_CAP = 4 * MiB  # hardware, host and engine profiles are a few KB
JSON_CAP = 64 * MiB  # a model's config.json, a sweep's manifest
TEXT_CAP = 256 * MiB  # prompts, calibration text
PIPE_WAIT_S = 2.0  # how long a named pipe may stay silent before it is refused
NAME_MAX = 255  # bytes of one path component, where the file system does not say
PATH_MAX = 4096

_spooled: dict[str, str] = {}  # temporary file -> the name the user gave
_piped: dict[tuple[int, int], bytes] = {}  # a pipe read by read_bytes -> what it sent (a pipe sends once)
_spooled_pipes: dict[tuple[int, int], str] = {}  # a pipe spooled by readable_path -> its temporary file


def _pipe_id(path: Path) -> tuple[int, int]:
    """A pipe's identity (device, inode): /dev/fd/N names another pipe once N is reused."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def human(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{number(n / size)} {unit}"
    return f"{n:.0f} bytes"


def short(path: str | os.PathLike, keep: int = 60) -> str:
    """``path`` for a message: a very long name shortened in the middle."""
    s = str(path)
    return s if len(s) <= keep else f"{s[:keep // 2]}...{s[-(keep // 2 - 3):]}"


def name_max(folder: str | os.PathLike) -> int:
    """Bytes one file name may have in ``folder`` (its nearest existing ancestor)."""
    p = Path(folder)
    while not os.path.isdir(p) and p != p.parent:
        p = p.parent
    try:
        return int(os.pathconf(p, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def check_name(path: str | os.PathLike, what: str) -> Path:
    """One line if a component of ``path`` (or the whole) is longer than the file system allows."""
    path = Path(path)
    raw = os.fsencode(path)
    if len(raw) >= PATH_MAX:
        raise MoesimError(f"{what} {short(path)}: the path is {len(raw)} bytes; paths are shorter than {PATH_MAX}")
    limit = None
    for part in path.parts:
        n = len(os.fsencode(part))
        if n > 64:  # only a long name is worth asking the file system about
            limit = limit or name_max(path.parent)
            if n > limit:
                raise MoesimError(f"{what} {short(path)}: the name {short(part, 40)} is {n} bytes; this file system "
                                  f"allows {limit} at most")
    return path


def kind_of(path: str | os.PathLike) -> str:
    """``missing``, ``folder``, ``file``, ``pipe``, ``device`` or ``socket`` (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "missing"
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            return "missing"
        raise MoesimError(f"cannot read {short(path)}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _refuse_special(path: Path, kind: str, what: str) -> None:
    if kind == "device":
        raise MoesimError(f"{what} {path} is a device, not a regular file: give a file")
    if kind == "socket":
        raise MoesimError(f"{what} {path} is a socket, not a regular file: give a file")


def check_input(path: str | os.PathLike, what: str, cap: float | None = None) -> str:
    """The kind of input ``path`` is (``file`` or ``pipe``), after the checks of the module
    docstring that need no reading: missing, a folder, a device or socket, a name too long,
    a regular file over ``cap`` bytes."""
    path = check_name(path, what)
    kind = kind_of(path)
    if kind == "missing":
        raise MoesimError(f"{what} {short(path)} does not exist")
    if kind == "folder":
        raise MoesimError(f"{what} {path} is a folder, not a file")
    _refuse_special(path, kind, what)
    if kind == "file" and cap is not None:
        size = os.stat(path).st_size
        if size > cap:
            raise MoesimError(f"{what} {path} is {human(size)}; a {what} is at most {human(cap)}: not one")
    return kind


def _read_pipe(path: Path, what: str, cap: float) -> bytes:
    """A pipe's bytes, up to ``cap``; a named pipe nobody writes to within PIPE_WAIT_S is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MoesimError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if not poller.poll(PIPE_WAIT_S * 1000):
            raise MoesimError(f"{what} {path} is a named pipe (FIFO) nothing was written to in {PIPE_WAIT_S:g} s: "
                              "not a regular file; give a file (or write into the pipe as moesim starts)")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                raise MoesimError(f"{what} {path} is a pipe that sent more than {human(cap)}; a {what} is at most "
                                  f"{human(cap)}: not one")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike, what: str, cap: float) -> bytes:
    """The bytes of an input file or pipe of at most ``cap`` bytes (see the module docstring)."""
    path = Path(path)
    kind = check_input(path, what, cap)
    if kind == "pipe":  # read once: a second reader in this process (a profile looked up twice) gets the same bytes
        key = _pipe_id(path)
        if key not in _piped:
            _piped[key] = _read_pipe(path, what, cap)
        return _piped[key]
    try:
        with open(path, "rb") as f:
            # Its size and a byte more, not the cap: a read of the cap reserved that much memory
            # (11 GiB here), which a memory limit refused as out of memory. A file that grew
            # since it was looked at is read on, a block at a time, up to the cap.
            parts = [f.read(int(min(cap, os.fstat(f.fileno()).st_size)) + 1)]
            n = len(parts[0])
            while n <= cap and (block := f.read(int(min(1 << 24, cap + 1 - n)))):
                parts.append(block)
                n += len(block)
            data = parts[0] if len(parts) == 1 else b"".join(parts)
    except OSError as e:
        raise MoesimError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > cap:
        raise MoesimError(f"{what} {path} is larger than {human(cap)}; a {what} is at most {human(cap)}: not one")
    return data


def read_text(path: str | os.PathLike, what: str, cap: float = TEXT_CAP, expected: str = "text") -> str:
    """An input file as UTF-8 text (a BOM-less UTF-8 file; anything else is one line)."""
    data = read_bytes(path, what, cap)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise MoesimError(f"{path}: not a {what} (not UTF-8 text{hint}; {expected} is expected)") from None
    if "\x00" in text:
        raise MoesimError(f"{path}: not a {what} (binary data; {expected} is expected)")
    return text.removeprefix("\ufeff")


def readable_path(path: str | os.PathLike, what: str, cap: float | None = None) -> Path:
    """A regular file to read ``path`` from: ``path`` itself, or, for a pipe, its bytes
    spooled into a temporary file (removed at exit). A missing path is returned as it is
    (the reader's own message says so); the other refusals are as :func:`check_input`."""
    path = Path(path)
    check_name(path, what)
    kind = kind_of(path)
    if kind in ("missing", "folder", "file"):
        if kind == "file" and cap is not None:
            check_input(path, what, cap)
        return path
    _refuse_special(path, kind, what)
    key = _pipe_id(path)
    if key in _spooled_pipes and Path(_spooled_pipes[key]).is_file():  # a pipe is read once: a second
        return Path(_spooled_pipes[key])  # reader in this process reads what it sent
    data = _read_pipe(path, what, cap if cap is not None else available_memory() / 2)
    fd, tmp = tempfile.mkstemp(prefix="moesim-pipe-", suffix=path.suffix or ".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise MoesimError(f"cannot keep what {path} sent (a pipe is read into a temporary file): "
                          f"{e.strerror or e}") from None
    if not _spooled:
        atexit.register(_remove_spooled)
    _spooled[tmp] = str(path)
    _spooled_pipes[key] = tmp
    return Path(tmp)


def _remove_spooled() -> None:
    for tmp in list(_spooled):
        Path(tmp).unlink(missing_ok=True)
        _spooled.pop(tmp, None)


def original_names(text: str) -> str:
    """``text`` with every spooled temporary file named as the user named it."""
    for tmp, given in _spooled.items():
        text = text.replace(tmp, given)
    return text
