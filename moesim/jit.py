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
"""

from __future__ import annotations

import os
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
