"""The README's what-if, every policy's replay --json, two deployment answers and their
sweep CSVs are byte-identical to the committed ones (tests/golden/outputs.py): a
refactor that moves an output fails here, and one that means to says so by rewriting
them (``python tests/golden/outputs.py --write``)."""

from __future__ import annotations

import pytest

from tests.golden.outputs import COMMANDS, SLOW_COMMANDS, differences, generate


def test_outputs_are_the_committed_ones(tmp_path):
    got = generate(tmp_path)
    assert len(got) == sum(bool(s) + len(f) for s, _, f in COMMANDS)
    assert not differences(got), "\n\n".join(differences(got))


@pytest.mark.slow
def test_the_accuracy_figures_are_the_committed_ones(tmp_path):
    """``validate --published`` (leave one source out, calibration, round trip) prints what the
    README quotes as the accuracy figures: a figure that moves fails here."""
    got = generate(tmp_path, SLOW_COMMANDS)
    assert not differences(got), "\n\n".join(differences(got))


def test_a_changed_output_is_reported(tmp_path):
    got = {"replay.json": b"[]\n", "nothing-kept.txt": b"x"}
    diffs = differences(got)
    assert len(diffs) == 2 and "committed replay.json" in diffs[0] and "no committed file" in diffs[1]
