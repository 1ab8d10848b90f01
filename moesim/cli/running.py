"""How long-running commands behave while they run: a progress bar with the time left,
and Ctrl-C that keeps finished work."""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moesim.cli.app import err
from moesim.executor.interrupt import stop_on_interrupt
from moesim.stop import exit_code, interrupted_line, stop_received


@contextmanager
def progress_bar(what: str, unit: str, disable: bool = False,
                 lines: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar with the time left on stderr; yields ``update(done, total)``
    for a library call's ``progress`` callback (``update(done, total, doing)`` also says
    what is running now). ``lines``: where stderr is no terminal (a log, a pipe), a line
    ``what: 10 of 39 unit, 1m 20s`` at each tenth instead (a minutes-long command is never
    silent); stdout is untouched either way."""
    if lines and not disable and not err.is_terminal:
        yield _progress_lines(what, unit)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                  TimeRemainingColumn(), console=err, transient=True, disable=disable or not err.is_terminal) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int, doing: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=f"{what}: {doing}" if doing else what)

        yield update


@contextmanager
def writing_report(out_dir) -> Iterator[None]:
    """Around the writing of a report folder: a stop while it is written leaves some of its
    files (each one whole: moesim.atomic), and the run says so before its `interrupted` line."""
    try:
        yield
    except KeyboardInterrupt:
        if out_dir is not None and Path(out_dir).is_dir() and any(Path(out_dir).iterdir()):
            err.print(f"note: --out {out_dir} holds part of a report: it was stopped while writing it",
                      markup=False, highlight=False, soft_wrap=True)
        raise


def keeps_finished_work(command: Callable) -> Callable:
    """For a command whose work is a loop of steps: the first Ctrl-C, whenever it comes
    (even while torch is still importing or the model loading), only asks the loop to
    stop at its next step boundary (moesim.executor.interrupt), so every finished step is
    kept and a run stopped before its first step ends as one line; a run stopped after one
    writes what it finished, then ends on the `interrupted` line with exit code 130 (143,
    129), even when the signal came after its last step. Without this, a SIGINT
    that lands before the library's own loop begins took another path (a KeyboardInterrupt
    through imports), and under load it was once lost: the run went on to the end."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:

        with stop_on_interrupt():
            result = command(*args, **kwargs)
        if stop_received():  # the finished work is written; the run was stopped all the same
            err.print(interrupted_line(), highlight=False, markup=False)
            sys.exit(exit_code())
        return result

    return wrapper


def need_executor() -> None:
    """Refuse a command that runs the executor before any work when torch or safetensors is
    missing: the ModuleNotFoundError becomes main()'s one line naming the extra. Checked by
    name, not by importing what needs them: a half-importable torch makes other libraries
    (scipy's array-API checks) fail with unrelated errors first."""
    for name in ("torch", "safetensors"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _progress_lines(what: str, unit: str) -> Callable[..., None]:
    """``update(done, total)`` printing one line on stderr at each tenth of ``total`` (and at the end)."""
    start, shown = time.monotonic(), [-1]

    def update(done: int, total: int, doing: str | None = None) -> None:
        tenth = done * 10 // total if total else 0
        if total and tenth > shown[0]:
            shown[0] = tenth
            secs = int(time.monotonic() - start)
            err.print(f"{what}: {done} of {total} {unit}, {secs // 60}m {secs % 60:02d}s", markup=False,
                      highlight=False, soft_wrap=True)
    return update
