"""bench/code_metrics.py measures the code as issue "One deployment, resolved once" asks: its
static part runs here, so that a new import circle fails the suite instead of waiting to be
noticed (the resolution and cost-model counts are the bench's alone: they run a replay and a sweep)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import code_metrics  # noqa: E402


def test_no_import_circle_and_the_scan_sees_the_code():
    """The last circle (models -> the GGUF and config.json readers -> models) ended when the
    spec moved below the readers (moesim.spec): function-level imports count as edges."""
    res = code_metrics.scan()
    assert res["modules"] > 100
    assert any(w["function"] == "moesim.policy.kernel.plan_steps" for w in res["wide_functions"])  # it reads parameters
    assert res["circles"] == [], res["circles"]


def test_the_circle_finder_finds_a_planted_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert code_metrics.circles(edges) == [["a", "b", "c"]]


def test_a_policy_is_asked_not_tested_for_flags_outside_its_package():
    """Issue 53: the families answer what the rest of moesim asks (moesim/policy/families.py);
    a new flag test outside the policy package is a decision that belongs to a family."""
    res = code_metrics.flag_tests()
    assert res["flag_test_lines"] <= 15 and len(res["flag_test_files"]) <= 3, res
