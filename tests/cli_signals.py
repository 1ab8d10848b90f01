"""Send a real signal to a real ``moesim`` subprocess at a chosen moment (tests only).

The moment is read off the command's own progress bar (a terminal is emulated, so rich
draws it on stderr): signalling after a fixed sleep once landed, on a loaded machine,
while Python was still importing, before the CLI had its handlers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def signal_when(args: list[str], ready: Callable[[str], bool], sig: int, cwd: Path | None = None,
                wait_s: float = 90) -> tuple[int, str]:
    """Run ``python -m moesim *args``; once ``ready(the last stderr chunks)`` is true send
    ``sig``; return (exit code, stderr without terminal escapes). Fails the test if the bar
    never appears (2 min) or the process does not end ``wait_s`` after the signal."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1",
           "COLUMNS": "100"}
    p = subprocess.Popen([sys.executable, "-m", "moesim", *map(str, args)], cwd=cwd, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, chunks = threading.Event(), []

    def read() -> None:
        while chunk := p.stderr.read1(4096):
            chunks.append(chunk.decode(errors="replace"))
            if ready(ANSI.sub("", "".join(chunks[-3:]))):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(120), "".join(chunks)
        p.send_signal(sig)
        rc = p.wait(wait_s)  # a lost signal would run the whole command: far longer
    finally:
        p.kill()
    reader.join(10)
    return rc, ANSI.sub("", "".join(chunks))


def steps_done(total: int, at_least: int = 1) -> Callable[[str], bool]:
    """``ready``: the bar shows at least ``at_least`` of ``total`` steps finished."""
    return lambda text: any(int(c) >= at_least for c in re.findall(rf"(\d+)/{total}", text))
