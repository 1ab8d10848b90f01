"""Work spread over forked worker processes, stopped cleanly: what a sweep's groups and the
leave-one-source-out folds of ``moesim validate --published`` run on.

:func:`run_pool` yields ``(index, result or the exception it raised)`` as each item finishes.
Workers are forked with the stop signals blocked, so none runs the parent's handlers before
:func:`worker_ignores_stops` (every pool's initializer calls it) ignores SIGINT and SIGHUP
(a terminal's Ctrl-C or hangup reaches the whole process group: the parent alone decides)
and leaves SIGTERM deadly (how the parent stops them). Interrupted (Ctrl-C, SIGTERM, an
error in the caller), :func:`stop_pool` ends the workers at once. :func:`start_aside` forks one
process by the same rules for work done beside the command's (a first compile, a figure).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from moesim.atomic import STOP_SIGNALS

#: Seconds :func:`stop_pool` waits for the pool's manager thread to end (it ends within a
#: second once the workers are gone; longer only on a machine busy with other work).
MANAGER_JOIN_S = 60.0


def worker_ignores_stops() -> None:
    """In a worker: leave interrupts to the parent (SIGINT and SIGHUP ignored, SIGTERM deadly)."""
    for s in STOP_SIGNALS - {signal.SIGTERM}:
        signal.signal(s, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent while it forked


def start_aside(target: Callable[[], Any]) -> multiprocessing.Process | None:
    """``target()`` in one forked process on the machine's other core while this one goes on,
    or None where none can start (one core, a daemon's child such as a pool worker, no fork):
    the caller then does the work itself. Forked with the stop signals blocked and leaving
    them to this process (:func:`worker_ignores_stops`); a daemon, so an interrupt or an error
    here ends it too. The caller joins it and reads its exit code (0: done; 1: ``target``
    raised, said by nothing on the terminal, for the caller to do the work again)."""
    if (os.cpu_count() or 1) < 2:
        return None
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice by the child
        stream.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc = multiprocessing.get_context("fork").Process(target=_aside, args=(target,), daemon=True)
        proc.start()
        return proc
    except (AssertionError, OSError):
        return None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _aside(target: Callable[[], Any]) -> None:
    worker_ignores_stops()
    try:
        target()
    except Exception:  # noqa: BLE001 - the caller redoes the work where an error is the command's, in one line
        sys.exit(1)  # an exit code, not a traceback on the user's terminal


def run_pool(fn: Callable[[Any], Any], items: Iterable[Any], jobs: int, initializer: Callable[..., None],
             initargs: tuple = ()) -> Iterator[tuple[int, Any]]:
    """``(i, fn(items[i]) or the exception it raised)`` for every item, as each finishes, on
    ``jobs`` forked workers; ``initializer(*initargs)`` runs first in each and must call
    :func:`worker_ignores_stops`."""
    pool, finished = None, False
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        try:
            pool = ProcessPoolExecutor(jobs, initializer=initializer, initargs=initargs)
            pending = {pool.submit(fn, item): i for i, item in enumerate(items)}
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                exc = fut.exception()
                yield i, exc if exc is not None else fut.result()
        finished = True
    finally:
        if pool is None:
            pass
        elif finished:
            pool.shutdown(wait=True)
        else:  # interrupted (Ctrl-C, SIGTERM, an error in the caller): stop the workers, wait for none
            stop_pool(pool)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """End ``pool`` now: queued work cancelled, running workers terminated (their items are
    lost; finished ones were already yielded). Further SIGINT/SIGTERM are ignored while it
    does (a second Ctrl-C must not cut the cleanup short), then restored."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)
        manager = getattr(pool, "_executor_manager_thread", None)
        if manager is not None:  # else the interpreter's exit joins it, where a signal is a traceback
            # Joined whole: at exit concurrent.futures wakes every manager still running, and one
            # closing its pipe at that moment makes the wake-up an OSError (EBADF) printed after the
            # `interrupted` line (seen once in 10 runs beside a CPU-bound process with a 5 s join;
            # a manager still alive at exit is the only way to that race, so the join is the fix).
            manager.join(MANAGER_JOIN_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
