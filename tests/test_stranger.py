"""The fast subset of tests/stranger/cases.py (one or a few cases of each class): every
hostile invocation ends in a one-line refusal or a valid result. The whole set (over 200
invocations) runs with ``python tests/stranger/cases.py``."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "stranger"))
import cases  # noqa: E402


def test_the_fast_subset_of_hostile_invocations_ends_cleanly():
    selected = [k for k in cases.cases() if k.fast]
    assert len({k.cls for k in selected}) >= 7  # every class is represented
    outcomes = cases.run_all(selected, jobs=2)
    endings = Counter(o.ending for o in outcomes)
    bad = [f"{o.case.name} moesim {' '.join(o.case.args)}: {o.ending}: {o.detail}" for o in outcomes
           if o.ending in cases.BAD]
    assert not bad, "\n".join(bad)
    assert endings["error"] >= len(selected) // 2  # most of them are refusals, as designed
