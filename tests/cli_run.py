"""How the tests run the CLI, and what the house rule says a refused command looks like
(tests only): exit code 2 and exactly one line on stderr, ``error: ...``.

:func:`by_subprocess` is ``python -m moesim ...``, as a user runs it. :func:`in_process`
calls the same entry point (``moesim.cli.main``) inside the test process, for the many
cases that check what a command answers rather than how a process ends: no interpreter
start and no torch import per call (1-5 s each on two cores). It returns the same
``CompletedProcess``: the exit code ``main`` ends with, and everything written to file
descriptors 1 and 2 (Python's and C's writes, warnings shown as a fresh interpreter shows
them); an exception that escapes ``main`` is a traceback on stderr and exit code 1, as in
a subprocess. Signals, stdin, missing dependencies, worker pools and terminal emulation
stay with real subprocesses.
"""

from __future__ import annotations

import io
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest

from moesim.stop import STOP_SIGNALS

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The one ``error: ...`` line of a refused run, which holds each of ``words``."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def by_subprocess(*args, cwd=None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m moesim *args`` in a new process."""
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **ENV, **(env or {})}, timeout=timeout)


# What a fresh interpreter does with warnings (Python's default filters, no -W): shown on
# stderr, except these.
_DEFAULT_FILTERS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                    ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                    ("ignore", ResourceWarning, None))


def in_process(*args, cwd=None, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``moesim *args`` through ``moesim.cli.main`` in this process (``timeout`` is
    accepted for a drop-in swap with :func:`by_subprocess` and not enforced). The working
    folder, environment, signal handlers, torch's thread count and the global random
    states are restored afterwards."""
    del timeout
    import moesim.cli

    argv = ["moesim", *map(str, args)]
    main_module = sys.modules["__main__"]
    saved = dict(argv=sys.argv, cwd=os.getcwd(), environ=dict(os.environ),
                 handlers={s: signal.getsignal(s) for s in STOP_SIGNALS},
                 package=getattr(main_module, "__package__", None), stdout=sys.stdout, stderr=sys.stderr,
                 random=random.getstate())
    try:  # imported first, so that a command's torch.set_num_threads can be undone
        import torch
    except ImportError:
        torch = None
    import numpy as np

    if torch is not None:
        saved.update(threads=torch.get_num_threads(), torch_rng=torch.get_rng_state())
    saved["np_rng"] = np.random.get_state()
    code: int | str | None = 0
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        for s in (sys.stdout, sys.stderr):
            s.flush()
        fds = os.dup(1), os.dup(2)
        os.dup2(out_f.fileno(), 1)
        os.dup2(err_f.fileno(), 2)
        # Python's own streams on a pipe: UTF-8, stdout strict, stderr backslashreplace.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                      write_through=True)
        logs = _logging_to(sys.stdout, sys.stderr, saved["stdout"], saved["stderr"])
        try:
            # click names the program from sys.argv[0] and __main__'s package, as `python -m moesim` has them
            sys.argv = [str(ROOT / "moesim" / "__main__.py"), *argv[1:]]
            main_module.__package__ = "moesim"
            os.environ.update({"MPLBACKEND": "Agg", **(env or {})})
            if cwd is not None:
                os.chdir(cwd)
            with warnings.catch_warnings():
                warnings.resetwarnings()
                for action, category, module in reversed(_DEFAULT_FILTERS):
                    warnings.filterwarnings(action, category=category, module=module or "")
                warnings.showwarning = _show_on_stderr
                try:
                    moesim.cli.main()
                except SystemExit as e:
                    code = e.code
                except BaseException:  # what the interpreter would print before exiting 1
                    sys.stderr.write(traceback.format_exc())
                    code = 1
            if code is not None and not isinstance(code, int):  # sys.exit("text"): printed, exit 1
                sys.stderr.write(f"{code}\n")
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            _logging_back(logs)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            sys.stdout, sys.stderr, sys.argv = saved["stdout"], saved["stderr"], saved["argv"]
            main_module.__package__ = saved["package"]
            os.chdir(saved["cwd"])
            os.environ.clear()
            os.environ.update(saved["environ"])
            for s, handler in saved["handlers"].items():
                signal.signal(s, handler)
            random.setstate(saved["random"])
            if torch is not None:
                torch.set_num_threads(saved["threads"])
                torch.set_rng_state(saved["torch_rng"])
            np.random.set_state(saved["np_rng"])
        out_f.seek(0)
        err_f.seek(0)
        stdout, stderr = out_f.read().decode(errors="replace"), err_f.read().decode(errors="replace")
    return subprocess.CompletedProcess(argv, code or 0, stdout, stderr)


def _logging_to(out, err, old_out, old_err) -> tuple[list, list]:
    """Logging as in a fresh interpreter: no handlers on the root logger (pytest's own
    removed, so a record with none reaches logging's last resort: stderr), and handlers a
    library made on the standard streams (transformers' does) writing to the new ones."""
    root = logging.getLogger()
    moved = []
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if type(h) is logging.StreamHandler:
                if h.stream in (old_err, sys.__stderr__):
                    moved.append((h, h.setStream(err)))
                elif h.stream in (old_out, sys.__stdout__):
                    moved.append((h, h.setStream(out)))
    root_handlers, root.handlers = root.handlers, []
    return root_handlers, moved


def _logging_back(logs: tuple[list, list]) -> None:
    root_handlers, moved = logs
    logging.getLogger().handlers = root_handlers
    for h, stream in moved:
        h.setStream(stream)


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def runners(sub=by_subprocess) -> list:
    """``run`` for a test of many commands: each one in-process in the default run, and each
    in a real subprocess (``sub``) with ``-m slow``; a test that takes it keeps at least one
    subprocess call of its own in the default run."""
    return [pytest.param(in_process, id="in-process"), pytest.param(sub, id="subprocess", marks=pytest.mark.slow)]


BOTH_WAYS = runners()


def sample(cases, run) -> list:
    """A test's ``cases`` for ``run``: all of them in-process (the default run); in a real
    subprocess (``-m slow``) the first and the last. What a real process adds is the same for
    every case (its exit code, one line on stderr, no traceback: ``moesim.cli.main``), and each
    of these subprocesses starts torch or transformers (seconds): the slow run's minutes went
    there, not to anything a third case proves."""
    cases = list(cases)
    return cases if run is in_process or len(cases) <= 2 else [cases[0], cases[-1]]


def both_ways(cases: list[tuple], sub=by_subprocess, first: bool = True, subprocesses: int | None = None) -> list:
    """``pytest.param``s of ``(run, *case)``: every case in-process in the default run; the
    first case also in a real subprocess (``sub``) there, every other case's with ``-m slow``.
    ``first=False``: every subprocess case with ``-m slow``, for a command whose process
    start alone costs seconds (torch or transformers imported) and proves nothing more.
    ``subprocesses``: only the first that many cases in a subprocess at all (what a real
    process adds is the same for each: :func:`sample`)."""
    params = []
    for i, case in enumerate(cases):
        params.append(pytest.param(in_process, *case, id=f"in-process-{i}"))
        if subprocesses is None or i < subprocesses:
            params.append(pytest.param(sub, *case, id=f"subprocess-{i}",
                                       marks=() if i == 0 and first else pytest.mark.slow))
    return params


def hide(*packages: str) -> str:
    """Python that makes ``packages`` not installed, as a machine without them has it: their
    import raises ModuleNotFoundError and ``sys.modules`` holds no entry (an entry of None,
    the usual trick, is not what such a machine has: scipy's array-API check reads it)."""
    return ("import importlib.abc, sys\n"
            "class _NotInstalled(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {set(packages)!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, _NotInstalled())\n")
