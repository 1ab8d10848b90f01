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

It also loads numba's array functions without their BLAS probe: that probe imports SciPy's
BLAS bindings (0.24 s of the 0.45 s a cached kernel took to load in ``moesim synth``) to
offer ``np.dot`` and ``np.linalg`` in kernels, and no moesim kernel uses either (one that
did would fail to compile, naming SciPy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("MOESIM_CACHE_DIR"):
        return Path(os.environ["MOESIM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moesim" / "numba"


def use_user_cache() -> None:
    """Point numba's on-disk cache at :func:`cache_dir` unless the user chose one."""
    from numba.core import config

    if not os.environ.get("NUMBA_CACHE_DIR"):
        config.CACHE_DIR = str(cache_dir())
    if "numba.np.arraymath" not in sys.modules and "scipy.linalg" not in sys.modules:
        sys.modules["scipy.linalg.cython_blas"] = None  # an ImportError to numba's probe (numba.np.linalg.ensure_blas)
        try:
            import numba.np.arraymath  # noqa: F401  (what loading a kernel imports first)
        finally:
            del sys.modules["scipy.linalg.cython_blas"]
