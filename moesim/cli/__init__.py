"""The ``moesim`` command line: one thin module per command (see moesim/cli/app.py).

Every user error ends as one line on stderr and exit code 2 (see :func:`main`).
"""

from __future__ import annotations

import signal
import sys

from moesim.cli import (  # noqa: F401  (each module registers its command on the app)
    calibrate,
    fit,
    hw,
    models,
    profile,
    replay,
    speculate,
    synth,
    train,
    train_estimator,
    train_expert_predictor,
    validate,
    whatif,
)
from moesim.cli.app import app, err
from moesim.errors import MoesimError

__all__ = ["app", "main"]

OPTIONAL = {"torch": "executor", "safetensors": "executor", "pynvml": "executor", "ray": "distributed"}
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def missing_dependency(e: ModuleNotFoundError) -> str | None:
    """One line for an optional dependency that is not installed, naming the extra."""
    top = (e.name or "").split(".")[0]
    extra = OPTIONAL.get(top)
    if extra is None:
        return None
    hint = f" (for a CPU-only torch, first: {CPU_TORCH})" if top == "torch" else ""
    return f"this command needs {top}, which is not installed: pip install \"moesim[{extra}]\"{hint}"


def _terminate(signum, frame) -> None:  # noqa: ARG001
    """SIGTERM unwinds like Ctrl-C, so temporary files are removed and finished work kept."""
    raise KeyboardInterrupt


def main() -> None:
    """Console entry point: user errors become one line and exit code 2; Ctrl-C before
    anything worth keeping finished, one line and exit code 130."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except ModuleNotFoundError as e:
        line = missing_dependency(e)
        if line is None:
            raise
        err.print(f"error: {line}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except MemoryError:
        err.print("error: out of memory (the run is larger than this machine can hold; ask for fewer tokens, "
                  "layers or a smaller cache)", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except MoesimError as e:
        from moesim.executor.interrupt import Interrupted  # no torch: errors only

        if isinstance(e, Interrupted):
            err.print(str(e), highlight=False, markup=False, soft_wrap=True)
            sys.exit(130)
        err.print(f"error: {e}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before anything worth keeping: one line, no traceback
        err.print("interrupted (Ctrl-C)", highlight=False, markup=False)
        sys.exit(130)
    except SystemExit as e:
        if e.code == 130:  # typer turns a KeyboardInterrupt inside a command into a silent exit 130
            err.print("interrupted (Ctrl-C)", highlight=False, markup=False)
        raise
