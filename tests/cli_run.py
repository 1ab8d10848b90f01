"""What the house rule says a refused command looks like (tests only): exit code 2 and
exactly one line on stderr, ``error: ...``."""

from __future__ import annotations

import subprocess


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The one ``error: ...`` line of a refused run, which holds each of ``words``."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]
