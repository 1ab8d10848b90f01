"""Where numba keeps the kernels it compiles: the user's cache folder, never the package.

``@njit(cache=True)`` writes its compiled code next to the source file by default, that
is into the installed package (``site-packages/moesim/...``). That breaks two promises:
no command writes into the installed package, and a package manager can remove what it
installed. It did bite: after ``pip install .`` and a run, ``pip install -e .`` left the
cache files behind in a ``site-packages/moesim`` folder without ``__init__.py``, which
Python then imported as an empty namespace package in place of the editable one. So,
before the kernels are decorated, numba's cache folder is pointed at
``$MOESIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/moesim/numba``, else
``~/.cache/moesim/numba`` (a user's own ``NUMBA_CACHE_DIR`` wins).

The cache is moesim's own state, so a damaged one never stops or misleads a run
(:func:`tolerate_damage`): an index or data file numba cannot read (emptied, truncated,
random bytes) is removed and its kernel compiled again, with one line on stderr saying so;
numba itself lets the ``EOFError`` of an empty index escape, which click then reported as an
interrupt (exit 130, with no signal sent). A cache path that is not a writable folder is
bypassed (kernels compiled in memory every run) with one line saying so.

It also loads numba's array functions without their BLAS probe: that probe imports SciPy's
BLAS bindings (0.24 s of the 0.45 s a cached kernel took to load in ``moesim synth``) to
offer ``np.dot`` and ``np.linalg`` in kernels, and no moesim kernel uses either (one that
did would fail to compile, naming SciPy).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("MOESIM_CACHE_DIR"):
        return Path(os.environ["MOESIM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moesim" / "numba"


def _say(line: str) -> None:
    """One line on stderr, once a process for each kind of trouble."""
    if line not in _SAID:
        _SAID.add(line)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"note: {line}\n")


_SAID: set[str] = set()


def _usable(folder: Path) -> bool:
    """Whether ``folder`` is (or can be made) a folder this process can write."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def tolerate_damage() -> None:
    """Make numba treat a cache file it cannot read as a miss: the file is removed, the
    kernel compiled again and written back, and the run says so in one line (see the module
    docstring). Wraps ``IndexDataCacheFile``'s two readers (numba >= 0.57 has both)."""
    from numba.core import caching

    cls = caching.IndexDataCacheFile
    if getattr(cls, "_moesim_tolerant", False):
        return
    load_index, load_data = cls._load_index, cls._load_data

    def damaged(path, e: BaseException) -> None:
        with contextlib.suppress(OSError):
            os.remove(path)
        _say(f"moesim's kernel cache had a damaged file ({Path(path).name}: {type(e).__name__}); it is compiled "
             f"again and rewritten ({cache_dir()})")

    def _load_index(self):
        try:
            return load_index(self)
        except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError,
                pickle.UnpicklingError) as e:
            if isinstance(e, FileNotFoundError):
                return {}
            damaged(self._index_path, e)
            return {}

    def _load_data(self, name):
        try:
            return load_data(self, name)
        except FileNotFoundError:
            raise  # numba's own case: a file removed while the index still named it
        except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError,
                pickle.UnpicklingError) as e:
            damaged(self._data_path(name), e)
            raise FileNotFoundError(name) from None  # numba's load() then compiles the kernel

    cls._load_index, cls._load_data, cls._moesim_tolerant = _load_index, _load_data, True


def use_user_cache() -> None:
    """Point numba's on-disk cache at :func:`cache_dir` unless the user chose one; bypass it
    when it is no writable folder, and tolerate damaged files in it (:func:`tolerate_damage`)."""
    from numba.core import config

    if not os.environ.get("NUMBA_CACHE_DIR"):
        folder = cache_dir()
        if _usable(folder):
            config.CACHE_DIR = str(folder)
        else:
            import atexit
            import shutil
            import tempfile

            config.CACHE_DIR = tempfile.mkdtemp(prefix="moesim-numba-")  # this run's only: compiled, not reused
            atexit.register(shutil.rmtree, config.CACHE_DIR, True)
            _say(f"moesim's kernel cache {folder} is not a folder this user can write: kernels are compiled for "
                 "this run only (20-30 s); remove it or set MOESIM_CACHE_DIR to a folder")
    tolerate_damage()
    if "numba.np.arraymath" not in sys.modules and "scipy.linalg" not in sys.modules:
        sys.modules["scipy.linalg.cython_blas"] = None  # an ImportError to numba's probe (numba.np.linalg.ensure_blas)
        try:
            import numba.np.arraymath  # noqa: F401  (what loading a kernel imports first)
        finally:
            del sys.modules["scipy.linalg.cython_blas"]
