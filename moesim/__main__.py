"""``python -m moesim`` and the ``moesim`` console script.

The CLI is imported inside :func:`run` so that a Ctrl-C while it is still importing ends
as one line too (a console script that imported ``moesim.cli`` itself would print a
traceback there)."""

import signal
import sys

_stopped_by = ["Ctrl-C"]


def _terminate(signum, frame) -> None:  # noqa: ARG001
    """A SIGTERM while the CLI is still importing ends like Ctrl-C (main() installs its own)."""
    _stopped_by[0] = "SIGTERM"
    raise KeyboardInterrupt


def run() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        from moesim.cli import main
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted ({_stopped_by[0]})\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
