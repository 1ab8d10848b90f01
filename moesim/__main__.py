"""``python -m moesim`` and the ``moesim`` console script.

The CLI is imported inside :func:`run` so that a Ctrl-C while it is still importing ends
as one line too (a console script that imported ``moesim.cli`` itself would print a
traceback there)."""

import os
import sys

try:
    import fcntl
except ImportError:  # not a POSIX system: no descriptor flags to ask
    fcntl = None

from moesim.stop import catch_sigterm, exit_code, interrupted_line


def run() -> None:
    catch_sigterm()
    if sys.stderr is None:  # `2>&-`: errors still end the run with their exit code, unseen
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (open for the life of the process)
    if sys.stdout is None:  # `>&-`: whatever the command, its answer would be lost
        sys.stderr.write("error: standard output is closed: give it a file, or >/dev/null to discard it\n")
        sys.exit(2)
    if _read_only(sys.stdout):  # `1</dev/null`: every write would fail (EBADF), after the work
        sys.stderr.write("error: standard output is open for reading only: give it a file, or >/dev/null to discard "
                         "it\n")
        sys.exit(2)
    try:
        from moesim.cli import main  # here, so a Ctrl-C while it imports ends as one line
    except KeyboardInterrupt:
        sys.stderr.write(interrupted_line() + "\n")
        sys.exit(exit_code())
    main()


def _read_only(stream) -> bool:
    """Whether ``stream``'s file is open for reading only (a descriptor it cannot write)."""
    if fcntl is None:
        return False
    try:
        return fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's buffer): not a file to ask
        return False


if __name__ == "__main__":
    run()
