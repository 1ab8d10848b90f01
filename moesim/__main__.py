"""``python -m moesim`` and the ``moesim`` console script.

The CLI is imported inside :func:`run` so that a Ctrl-C while it is still importing ends
as one line too (a console script that imported ``moesim.cli`` itself would print a
traceback there)."""

import sys


def run() -> None:
    try:
        from moesim.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (Ctrl-C)\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
