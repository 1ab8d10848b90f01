"""``python -m moesim`` and the ``moesim`` console script.

The CLI is imported inside :func:`run` so that a Ctrl-C while it is still importing ends
as one line too (a console script that imported ``moesim.cli`` itself would print a
traceback there)."""

import os
import sys

from moesim.stop import catch_sigterm, exit_code, interrupted_line


def run() -> None:
    catch_sigterm()
    if sys.stderr is None:  # `2>&-`: errors still end the run with their exit code, unseen
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (open for the life of the process)
    if sys.stdout is None:  # `>&-`: whatever the command, its answer would be lost
        sys.stderr.write("error: standard output is closed: give it a file, or >/dev/null to discard it\n")
        sys.exit(2)
    try:
        from moesim.cli import main  # here, so a Ctrl-C while it imports ends as one line
    except KeyboardInterrupt:
        sys.stderr.write(interrupted_line() + "\n")
        sys.exit(exit_code())
    main()


if __name__ == "__main__":
    run()
