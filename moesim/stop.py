"""How a run is stopped, defined once for the console entry point (``moesim.__main__``,
which must catch a signal before the CLI has even imported) and the CLI (``moesim.cli``):
Ctrl-C, or a SIGTERM unwound exactly like it (temporary files removed, finished work kept),
ending on the line :func:`interrupted_line` says."""

from __future__ import annotations

import signal

#: What stopped the run: Ctrl-C unless a SIGTERM arrived.
_stopped_by = ["Ctrl-C"]


def _terminate(signum, frame) -> None:  # noqa: ARG001
    _stopped_by[0] = "SIGTERM"
    raise KeyboardInterrupt


def catch_sigterm() -> None:
    """From now on a SIGTERM raises KeyboardInterrupt, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _terminate)


def interrupted_line() -> str:
    return f"interrupted ({_stopped_by[0]})"
