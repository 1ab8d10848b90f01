"""Ctrl-C that keeps finished work.

Long loops (decode steps, verification steps, training steps, validation cases) run
inside :func:`stop_on_interrupt`: the first SIGINT only *requests* a stop, which the loop
sees between two steps (:func:`stop_requested`), so every finished step is whole and the
caller writes them as usual; a step is never cut in half, and the record of a step is
committed in one statement. A second SIGINT raises ``KeyboardInterrupt`` at once (the
user insists); loops catch it too and keep what they had committed. Work interrupted
before its first step finished raises :class:`Interrupted`, a one-line user error.

Signals reach only the main thread, so elsewhere the context is a no-op.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from moesim.errors import MoesimError
from moesim.stop import note_stop

_stop = threading.Event()
_depth = 0


class Interrupted(MoesimError):
    """Ctrl-C before anything worth keeping finished."""


@contextmanager
def stop_on_interrupt() -> Iterator[None]:
    """Within: first SIGINT requests a stop, a second raises ``KeyboardInterrupt``.
    Contexts nest (a command around the loops it calls); the request is cleared when the
    outermost one exits."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum, frame) -> None:
        note_stop()  # the run ends with exit code 130 even if its loop finishes every step
        if _stop.is_set():
            raise KeyboardInterrupt
        _stop.set()

    if _depth == 0:
        _stop.clear()
    previous = signal.signal(signal.SIGINT, request_stop)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous)
        if _depth == 0:
            _stop.clear()


def stop_requested() -> bool:
    return _stop.is_set()


def request_stop() -> None:
    """What the first Ctrl-C does (for callbacks and tests that stop a loop from inside
    :func:`stop_on_interrupt`; the outermost context's entry and exit clear it)."""
    _stop.set()
