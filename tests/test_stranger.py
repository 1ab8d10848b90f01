"""The fast subset of tests/stranger/cases.py (one or a few cases of each class): every
hostile invocation ends in a one-line refusal or a valid result. The default run takes the
first fast case of each class; the other fast cases run with -m slow. The whole set (over
200 invocations) runs with ``python tests/stranger/cases.py``."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "stranger"))
import cases  # noqa: E402


def _fast_cases(first_of_each_class: bool) -> list:
    """The fast cases: the first of each class, or every other one."""
    fast, seen = [], set()
    for k in cases.cases():
        if k.fast:
            first = k.cls not in seen
            seen.add(k.cls)
            if first == first_of_each_class:
                fast.append(k)
    return fast


def _run_and_check(selected: list) -> None:
    outcomes = cases.run_all(selected, jobs=2)
    endings = Counter(o.ending for o in outcomes)
    bad = [f"{o.case.name} moesim {' '.join(o.case.args)}: {o.ending}: {o.detail}" for o in outcomes
           if o.ending in cases.BAD]
    assert not bad, "\n".join(bad)
    assert endings["error"] >= len(selected) // 2  # most of them are refusals, as designed


def test_the_fast_subset_of_hostile_invocations_ends_cleanly():
    selected = _fast_cases(first_of_each_class=True)
    assert len({k.cls for k in selected}) == len(selected) >= 7  # every class is represented, once
    _run_and_check(selected)


@pytest.mark.slow
def test_the_rest_of_the_fast_subset_ends_cleanly():
    selected = _fast_cases(first_of_each_class=False)
    assert selected
    _run_and_check(selected)
