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
#: Whether a stop signal arrived (a loop that keeps its finished steps may still end normally).
_received = [False]


def _terminate(signum, frame) -> None:  # noqa: ARG001
    note_stop(STOP_SIGNALS.get(signum, "Ctrl-C"))
    raise KeyboardInterrupt


def note_stop(name: str = "Ctrl-C") -> None:
    """Record that a stop signal arrived (the executor's first Ctrl-C only asks its loop to stop)."""
    _stopped_by[0], _received[0] = name, True


def reset() -> None:
    """A new run starts: nothing stopped it yet (a process running several, as the tests do)."""
    _stopped_by[0], _received[0] = "Ctrl-C", False


def stop_received() -> bool:
    """Whether a stop signal arrived in this process: a command that kept its finished work
    then still ends with :func:`exit_code` (130, 143, 129), not 0."""
    return _received[0]


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
