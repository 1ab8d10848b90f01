"""The ``moesim`` command line: one thin module per command (see moesim/cli/app.py).

Every user error ends as one line on stderr and exit code 2 (see :func:`main`).
"""

from __future__ import annotations

import sys

from moesim.cli import (  # noqa: F401  (each module registers its command on the app)
    calibrate,
    ecospec,
    fit,
    hw,
    import_routing,
    models,
    profile,
    record,
    replay,
    speculate,
    stats,
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


def main() -> None:
    """Console entry point: user errors become one line and exit code 2; Ctrl-C before
    anything worth keeping finished, one line and exit code 130."""
    try:
        app()
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
