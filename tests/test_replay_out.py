"""`replay --out` writes a whole report for any mix of policy families (issue "The first hour,
round 6", item 4): a CPU policy's row has columns a copy policy's lacks, and the report's CSV
once stopped at the first such row with a traceback, leaving a half-written folder."""

from __future__ import annotations

import csv
import itertools

import pytest
from cli_run import in_process

from moesim.models import get_model
from moesim.policy import POLICIES, get_policy
from moesim.traces.format import write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

#: One policy of each family, in registry order.
ONE_A_FAMILY = list({get_policy(n).family: n for n in reversed(POLICIES)}.values())[::-1]
REPORT = ("report.html", "summary.csv", "summary.json", "breakdown.png")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A replayed trace, and beside it a calibration trace (other draws) for the placing families."""
    folder = tmp_path_factory.mktemp("replay-out")
    for name, seed in (("t.npz", 0), ("calibration.npz", 1)):
        write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=6, prompt_len=8, seed=seed)),
                    folder / name)
    return folder / "t.npz"


def _replay(trace, policies, out):
    places = any(get_policy(p).places_hot_set for p in policies)
    caches = any(get_policy(p).caches for p in policies)
    r = in_process("replay", str(trace), "--hw", "rtx4090", "--host", "ryzen-7950x", "--policy", ",".join(policies),
                   "--out", str(out), *(["--placement-from", str(trace.with_name("calibration.npz"))] if places else []),
                   *(["--cache-gib", "1"] if caches else []))
    assert r.returncode == 0, r.stderr[-1500:]
    for name in REPORT:
        assert (out / name).exists(), name
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["policy"] for row in rows] == policies
    return rows


def test_every_family_in_one_report(trace, tmp_path):
    rows = _replay(trace, ONE_A_FAMILY, tmp_path / "all")
    cpu = [row for row in rows if get_policy(row["policy"]).uses_host]
    assert cpu and all(row["cpu_ms"] != "" for row in cpu)  # a CPU policy's own columns are there
    assert any(row["cpu_ms"] == "" for row in rows if not get_policy(row["policy"]).uses_host)


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(itertools.combinations(ONE_A_FAMILY, 2)), ids="+".join)
def test_every_pair_of_families(trace, tmp_path, pair):
    _replay(trace, list(pair), tmp_path / "pair")
