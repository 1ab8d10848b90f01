"""The training corpus of the learned-routing models, and its one train / held-out split.

Every machine has the Python standard library's source offline, so it is the corpus:
``train`` fits the model on the first :data:`TRAIN_FRACTION` of it; calibration, the
estimator and the expert predictor train on that same part; evaluation and fidelity read
only the tail, which no model has seen. The split is defined here once so that no
consumer can drift onto text the model was trained on.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from pathlib import Path

TRAIN_FRACTION = 0.95  # the first 95% trains; the last 5% is held out


@functools.cache
def stdlib_corpus() -> tuple[bytes, dict]:
    """All ``*.py`` files of this Python's standard library (no site-packages, no tests),
    sorted by path and joined; the description records exactly what was read. Read once
    per process (tens of MB; the files do not change while it runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
                   and "idlelib" not in p.parts)
    data = b"\n".join(p.read_bytes() for p in files)
    return data, {"corpus": "Python standard library source (*.py, excluding test/, tests/, idlelib/, site-packages/)",
                  "python": sys.version.split()[0], "root": str(root), "files": len(files), "bytes": len(data)}


def split_index(n: int) -> int:
    """Where the held-out tail of an ``n``-item corpus starts."""
    return int(n * TRAIN_FRACTION)


def training_split() -> tuple[bytes, dict]:
    """The training part of the corpus (and the corpus description)."""
    corpus, desc = stdlib_corpus()
    return corpus[:split_index(len(corpus))], desc


def held_out_split() -> tuple[bytes, dict]:
    """The held-out tail of the corpus (and the corpus description)."""
    corpus, desc = stdlib_corpus()
    return corpus[split_index(len(corpus)):], desc


def describe_training_split(desc: dict) -> str:
    """How calibration records where its text came from."""
    return (f"start of the training split (first {TRAIN_FRACTION:.0%}) of {desc['corpus']}, "
            f"Python {desc['python']}")


def splits() -> tuple[bytes, bytes, dict]:
    """(training split, held-out split, description), reading the corpus once."""
    corpus, desc = stdlib_corpus()
    i = split_index(len(corpus))
    return corpus[:i], corpus[i:], desc
