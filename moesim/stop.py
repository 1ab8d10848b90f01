"""How a run is stopped, defined once for the console entry point (``moesim.__main__``,
which must catch a signal before the CLI has even imported) and the CLI (``moesim.cli``):
Ctrl-C, or a SIGTERM or SIGHUP unwound exactly like it (temporary files removed, finished work kept),
ending on the line :func:`interrupted_line` says, with the exit code :func:`exit_code` gives."""

from __future__ import annotations

import signal

#: The signals that stop a run, by the name its last line gives: Ctrl-C (SIGINT), and SIGTERM
#: and SIGHUP (a closed terminal or ssh session) unwound exactly like it. Every place that
#: handles, holds or ignores them takes them from here.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
if hasattr(signal, "SIGHUP"):  # POSIX
    STOP_SIGNALS[signal.SIGHUP] = "SIGHUP"

#: What stopped the run: Ctrl-C unless another of :data:`STOP_SIGNALS` arrived.
_stopped_by = ["Ctrl-C"]


def _terminate(signum, frame) -> None:  # noqa: ARG001
    _stopped_by[0] = STOP_SIGNALS.get(signum, "Ctrl-C")
    raise KeyboardInterrupt


#: Exit code by what stopped the run: 128 + the signal's number, as a shell reports a
#: process the signal ended (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
EXIT_CODES = {name: 128 + int(num) for num, name in STOP_SIGNALS.items()}


def exit_code() -> int:
    """The exit code of a run that was stopped (:data:`EXIT_CODES`)."""
    return EXIT_CODES[_stopped_by[0]]


def catch_sigterm() -> None:
    """From now on SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does."""
    for num in STOP_SIGNALS:
        if num != signal.SIGINT:
            signal.signal(num, _terminate)


def interrupted_line() -> str:
    """The run's last line once it is stopping; from this call on, further stop signals
    are ignored (:func:`ignore_further`)."""
    ignore_further()
    return f"interrupted ({_stopped_by[0]})"


def ignore_further() -> None:
    """Ignore every stop signal for the rest of the process: it is exiting. Without this a
    second signal raised KeyboardInterrupt again while Python joined the worker threads at
    exit (a traceback after the `interrupted` line), and one arriving after the interpreter
    had put back the default handlers (it keeps an ignored signal ignored) killed the
    process, which then ended by the signal (-2, -15) instead of exit code 130 or 143."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
