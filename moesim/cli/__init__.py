"""The ``moesim`` command line: one thin module per command (see moesim/cli/app.py).

Every user error ends as one line on stderr and exit code 2 (see :func:`main`).

A run imports the module of the command it runs and no other (:data:`COMMANDS`,
:func:`load_commands`): each command module imports the library it calls at its top, and
``moesim whatif`` never pays for ``record``'s. The group's help (``moesim``, ``--help``, a
name that is no command) imports them all, as does :func:`every_command`, the whole app
(for typer's test runner). Imports inside functions are left for torch (the executor) and
the numba kernels, each saying so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

import typer

from moesim.cli.app import app, err
from moesim.cli.argv import COMMANDS, clashing_flags, empty_option, every_command, load_commands, only_command
from moesim.errors import MoesimError
from moesim.executor.interrupt import Interrupted
from moesim.stop import catch_sigterm, exit_code, ignore_further, interrupted_line
from moesim.stop import reset as reset_stop

__all__ = ["COMMANDS", "app", "every_command", "load_commands", "main"]

OPTIONAL = {"torch": "executor", "safetensors": "executor", "pynvml": "executor", "transformers": "record",
            "ray": "distributed", "gguf": "gguf"}
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def missing_dependency(e: ModuleNotFoundError) -> str | None:
    """One line for an optional dependency that is not installed, naming the extra."""
    top = (e.name or "").split(".")[0]
    extra = OPTIONAL.get(top)
    if extra is None:
        return None
    hint = f" (for a CPU-only torch, first: {CPU_TORCH})" if top == "torch" else ""
    return f"this command needs {top}, which is not installed: pip install \"moesim[{extra}]\"{hint}"


def main() -> None:
    """Console entry point. User errors (including a bad option, which click would print as
    a usage box) become one line and exit code 2; Ctrl-C or SIGTERM before anything worth
    keeping finished, one line and exit code 130 (143 for SIGTERM: :func:`moesim.stop.exit_code`);
    a missing optional dependency, one line naming the extra to install."""
    click = _click_exceptions()
    reset_stop()
    catch_sigterm()
    empty = empty_option(sys.argv[1:])
    if empty:
        _fail(f"{empty} '' is empty: give at least one value")
    if clash := clashing_flags(sys.argv[1:]):
        _fail(clash)
    try:
        load_commands(sys.argv[1:])
        with only_command(sys.argv[1:]):
            code = app(standalone_mode=False)
    except click.NoArgsIsHelpError as e:  # `moesim CMD` alone: its help, as click shows it
        e.show()
        sys.exit(0)
    except click.ClickException as e:
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _fail(f"{e.format_message()}{hint}", e.exit_code if e.exit_code else 2)
    except typer.Abort:
        _interrupted()
    except ModuleNotFoundError as e:
        line = missing_dependency(e)
        if line is None:
            raise
        _fail(line)
    except RecursionError:  # json and tomllib recurse per level of nesting: a file nested thousands deep
        _fail("an input file is nested too deeply to read (thousands of levels of JSON or TOML brackets)")
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        _output_lost(e)
    except MemoryError:
        _fail("out of memory (the run is larger than this machine can hold; ask for fewer tokens, layers or "
              "a smaller cache)")
    except MoesimError as e:
        ignore_further()  # exiting either way: a signal now must not interrupt the line below
        if isinstance(e, Interrupted):
            err.print(str(e), highlight=False, markup=False, soft_wrap=True)
            sys.exit(exit_code())
        _fail(str(e))
    except KeyboardInterrupt:  # Ctrl-C before anything worth keeping: one line, no traceback
        _interrupted()
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into exit code 130
        _interrupted()
    ignore_further()  # finished: a signal while the interpreter tears down must not end it by the signal
    sys.exit(code if isinstance(code, int) else 0)


def _click_exceptions():
    """The exception classes of the click that typer runs on (typer >= 0.20 vendors its own)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


# A write that failed for want of room (`>/dev/full`, a full disk or quota): errors only a write
# raises, so a read's EIO or EBADF is never reported as an answer that could not be written.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _output_lost(e: OSError) -> None:
    """One line for an answer that could not be written, and standard output pointed at
    /dev/null so the interpreter's own flush at exit does not print a second complaint."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    _fail(f"could not write the output: {e.strerror or e}", 1)


def _fail(line: str, code: int = 2) -> None:
    ignore_further()
    err.print(f"error: {' '.join(line.split())}", highlight=False, markup=False, soft_wrap=True)
    sys.exit(code)


def _interrupted() -> None:
    err.print(interrupted_line(), highlight=False, markup=False)
    sys.exit(exit_code())
