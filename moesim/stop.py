"""How a run is stopped, defined once for the console entry point (``moesim.__main__``,
which must catch a signal before the CLI has even imported) and the CLI (``moesim.cli``):
Ctrl-C, or a SIGTERM unwound exactly like it (temporary files removed, finished work kept),
ending on the line :func:`interrupted_line` says, with the exit code :func:`exit_code` gives."""

from __future__ import annotations

import signal

#: What stopped the run: Ctrl-C unless a SIGTERM arrived.
_stopped_by = ["Ctrl-C"]


def _terminate(signum, frame) -> None:  # noqa: ARG001
    _stopped_by[0] = "SIGTERM"
    raise KeyboardInterrupt


#: Exit code by what stopped the run: 128 + the signal's number, as a shell reports a
#: process the signal ended (130 for Ctrl-C, 143 for SIGTERM).
EXIT_CODES = {"Ctrl-C": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}


def exit_code() -> int:
    """The exit code of a run that was stopped (:data:`EXIT_CODES`)."""
    return EXIT_CODES[_stopped_by[0]]


def catch_sigterm() -> None:
    """From now on a SIGTERM raises KeyboardInterrupt, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _terminate)


def interrupted_line() -> str:
    """The run's last line once it is stopping; from this call on, further Ctrl-C or
    SIGTERM are ignored (:func:`ignore_further`)."""
    ignore_further()
    return f"interrupted ({_stopped_by[0]})"


def ignore_further() -> None:
    """Ignore Ctrl-C and SIGTERM for the rest of the process: it is exiting. Without this a
    second signal raised KeyboardInterrupt again while Python joined the worker threads at
    exit (a traceback after the `interrupted` line), and one arriving after the interpreter
    had put back the default handlers (it keeps an ignored signal ignored) killed the
    process, which then ended by the signal (-2, -15) instead of exit code 130 or 143."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
