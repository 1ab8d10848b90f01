"""``python -m moesim`` and the ``moesim`` console script.

The CLI is imported inside :func:`run` so that a Ctrl-C while it is still importing ends
as one line too (a console script that imported ``moesim.cli`` itself would print a
traceback there)."""

import sys

from moesim.stop import catch_sigterm, exit_code, interrupted_line


def run() -> None:
    catch_sigterm()
    try:
        from moesim.cli import main
    except KeyboardInterrupt:
        sys.stderr.write(interrupted_line() + "\n")
        sys.exit(exit_code())
    main()


if __name__ == "__main__":
    run()
