"""moesim: performance modelling and a reference executor for offloaded MoE decoding.

Everything installs under this one import name. The repository keeps the design card's
top-level folders, each a subpackage of ``moesim``:

- ``moesim`` itself (this folder): the shared vocabulary (model specs and byte
  accounting, hardware profiles, policy decisions) and the CLI; never imports torch or
  SimPy at import time;
- ``moesim.traces`` (``traces/``): the trace format and synthetic traces;
- ``moesim.sim`` (``sim/``): the simulator; never imports torch;
- ``moesim.executor`` (``executor/``): the PyTorch reference executor;
- ``moesim.reports`` (``reports/``): HTML/PNG/Perfetto reports;
- ``moesim.hwprofiles`` (``hwprofiles/``): the built-in hardware profiles.
"""

from pathlib import Path as _Path

__version__ = "0.2.0"

#: The subpackages that live in top-level folders of the repository.
SUBPACKAGES = ("sim", "traces", "executor", "reports", "hwprofiles")


def _source_tree_subpackages() -> None:
    """Make ``moesim.sim`` & co. importable from a source tree (no install).

    An installed wheel or an editable install maps each folder to ``moesim.<name>``
    (``[tool.setuptools.package-dir]`` in pyproject.toml). Run from a checkout, the
    folders are siblings of this one instead, so the repository root joins this
    package's search path; it is recognised by its pyproject.toml naming moesim, so an
    unrelated ``sim`` package next to an installed moesim is never picked up.
    """
    here = _Path(__file__).resolve().parent
    if all((here / name).is_dir() for name in SUBPACKAGES):
        return  # installed: the subpackages are inside this folder
    root = here.parent
    pyproject = root / "pyproject.toml"
    try:
        ours = 'name = "moesim"' in pyproject.read_text(encoding="utf-8")
    except OSError:
        return
    if ours and str(root) not in __path__:
        __path__.append(str(root))  # noqa: F821 (the package's own __path__)


_source_tree_subpackages()
