"""The range on every answer (moesim.sim.intervals): conformal bounds, pooling, the shipped
residuals, coverage counted leave-one-source-out, and the range in what-if's outputs."""

from __future__ import annotations

import json
import math

import pytest
from cli_run import in_process, one_line_error

from moesim.errors import MoesimError
from moesim.sim import intervals as iv
from moesim.sim.intervals import Residual, conformal, coverage, interval_for, kind_of


def test_conformal_order_statistics():
    # 19 residuals: an 80% interval is the 2nd and 18th of ln(measured / predicted), sorted.
    e = [0.01 * k for k in range(19)]  # ln(pred / meas)
    i = conformal(e, "t")
    meas_over_pred = sorted(-x for x in e)
    assert i.low == pytest.approx(math.exp(meas_over_pred[1]))
    assert i.high == pytest.approx(math.exp(meas_over_pred[17]))
    assert i.entries == 19


def test_conformal_refuses_too_few():
    with pytest.raises(MoesimError, match="too few"):
        conformal([0.1] * 8, "t")
    conformal([0.1] * 9, "t")  # (9 + 1) x 0.9 = 9: the largest exists


def test_interval_pools_toward_the_kind_and_says_so():
    pool = [Residual(f"a{k}", f"s{k}", "all-GPU", "vllm", 0.1) for k in range(9)]
    pool += [Residual(f"b{k}", f"t{k}", "all-GPU", "llama.cpp", -0.5) for k in range(3)]
    own = interval_for("all-GPU", "vllm", pool)
    assert own.basis.startswith("vllm, all-GPU") and own.entries == 9
    pooled = interval_for("all-GPU", "llama.cpp", pool)
    assert "pooled" in pooled.basis and pooled.entries == 12
    assert pooled.high > own.high  # the llama.cpp residuals (pessimistic) widen it upward
    every = interval_for("multi-GPU", "llama.cpp", pool)
    assert "every deployment kind" in every.basis


def test_exclude_source_leaves_its_residuals_out():
    pool = [Residual(f"a{k}", f"s{k}", "all-CPU", "llama.cpp", 0.0) for k in range(9)]
    pool.append(Residual("x", "far", "all-CPU", "llama.cpp", 5.0))
    assert interval_for("all-CPU", "llama.cpp", pool, exclude_source="far").high == pytest.approx(1.0)
    with pytest.raises(MoesimError, match="too few"):  # 8 left: no 80% interval at all
        interval_for("all-CPU", "llama.cpp", pool[:9], exclude_source="s0")


def test_interval_contains_is_the_measurement_inside():
    i = iv.Interval(0.5, 2.0, "t", 9)
    assert i.contains(math.log(1.9)) and i.contains(-math.log(1.9))
    assert not i.contains(math.log(2.1)) and not i.contains(-math.log(2.1))
    lo, hi = i.tpot_ms(10.0)
    assert (lo, hi) == (5.0, 20.0)


def test_kind_of_matches_the_published_kinds():
    assert kind_of("all-resident", 0) == "all-CPU"
    assert kind_of("cpu-static", 2) == "multi-GPU"
    assert kind_of("hot-experts", 1) == "experts on the CPU"
    assert kind_of("gpu-layers", 1) == "layer split"
    assert kind_of("prefetching", 1) == "copy offload"


def test_shipped_residuals_cover_every_expressed_entry():
    from moesim.sim.published import entries

    res = iv.residuals()
    assert {r.id for r in res} == {e.id for e in entries()}
    by_id = {e.id: e for e in entries()}
    assert all(r.kind == by_id[r.id].kind and r.source == by_id[r.id].source for r in res)


def test_coverage_counts_each_entry_with_its_own_source_left_out():
    # A source whose one entry is far off: its own residual must not widen its interval.
    rows = [{"id": f"e{k}", "source_id": f"s{k}", "kind": "all-GPU", "engine": "vllm", "ln_error": 0.0}
            for k in range(10)]
    rows.append({"id": "far", "source_id": "far", "kind": "all-GPU", "engine": "vllm", "ln_error": 2.0})
    c = coverage(rows)
    assert c["overall"]["entries"] == 11 and c["overall"]["covered"] == 10
    assert set(c["by_kind"]) == {"all-GPU"}


def test_the_shipped_residuals_cover_as_the_readme_claims():
    """The README's claim (its quoted `validate --published` line: N of M overall, within 70-90%;
    all-CPU 7 of 11, the one kind below), recomputed from the committed residuals: a change to
    the pooling rule or the residuals that the README does not follow fails here."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    said = re.search(r"^ranges: .* holds (\d+) of (\d+) measurements", readme, re.M)
    rows = [{"id": r.id, "source_id": r.source, "kind": r.kind, "engine": r.engine, "ln_error": r.ln_error}
            for r in iv.residuals()]
    c = coverage(rows)
    assert said and (c["overall"]["covered"], c["overall"]["entries"]) == (int(said[1]), int(said[2]))
    assert 0.7 <= c["overall"]["coverage"] <= 0.9 and not c["meets_target"]  # all-CPU is under
    below = {k for k, v in c["by_kind"].items() if not 0.7 <= v["coverage"] <= 0.9}
    assert below == {"all-CPU"} and (c["by_kind"]["all-CPU"]["covered"], c["by_kind"]["all-CPU"]["entries"]) == (7, 11)


def test_whatif_rows_carry_the_range():
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--expert-dtype", "q4_k_m",
                "--engine", "llama.cpp", "--policy", "all-resident", "--tokens", "8", "--jobs", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    row = rows[0]
    assert row["tokens_per_s_low"] <= row["tokens_per_s_high"]
    assert row["tpot_ms_low"] == pytest.approx(1e3 / row["tokens_per_s_high"], rel=1e-6)
    expected = interval_for("all-GPU", "llama.cpp")
    assert row["tokens_per_s_low"] == pytest.approx(row["tokens_per_s"] * expected.low)
    assert row["range_basis"] == expected.basis


def test_calibrated_engine_profile_gives_its_own_range(tmp_path):
    from moesim.engines import builtin_engines

    text = builtin_engines()["llama.cpp"].read_text()
    path = tmp_path / "mine.toml"
    path.write_text(text.replace('runs_on = ', 'calibration = { low = 0.9, high = 1.2, rows = 5, basis = '
                                 '"calibrated on 5 rows of run.json: leave one row out" }\nruns_on = ', 1))
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--expert-dtype", "q4_k_m",
                "--engine", str(path), "--policy", "all-resident", "--tokens", "8", "--jobs", "1", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert row["tokens_per_s_low"] == pytest.approx(0.9 * row["tokens_per_s"])
    assert row["range_basis"].startswith("calibrated on 5 rows")


@pytest.mark.parametrize("bad", ['{ low = 0.9, high = 1.2, rows = 5 }',
                                 '{ low = -1, high = 1.2, rows = 5, basis = "x" }',
                                 '{ low = 1.3, high = 1.2, rows = 5, basis = "x" }',
                                 '{ low = 0.9, high = 1.2, rows = 2.5, basis = "x" }'])
def test_bad_calibration_table_is_one_line(tmp_path, bad):
    from moesim.engines import builtin_engines

    path = tmp_path / "mine.toml"
    path.write_text(builtin_engines()["llama.cpp"].read_text().replace("runs_on = ", f"calibration = {bad}\nruns_on = ", 1))
    r = in_process("whatif", "--hw", "rtx4090", "--engine", str(path), "--tokens", "8", "--jobs", "1")
    one_line_error(r, "calibration")


def test_moved_names_every_prediction_that_changed_by_more_than_ten_percent(monkeypatch):
    monkeypatch.setattr(iv, "_shipped", lambda: {"entry": [
        {"id": "a", "ln_error": 0.0, "shipped_ln_error": 0.0}, {"id": "b", "ln_error": 0.5, "shipped_ln_error": 0.2}]})
    rows = [{"id": "a", "ln_error": math.log(1.09), "ratio": 1.09},  # 9%: not named
            {"id": "b", "ln_error": 0.5 - math.log(1.2), "ratio": math.exp(0.5) / 1.2},  # 20% down
            {"id": "c", "ln_error": 0.0, "ratio": 1.0}]  # not in the committed file
    m = iv.moved(rows)
    assert [x["id"] for x in m] == ["b", "c"]
    assert m[0]["change"] == pytest.approx(1 / 1.2) and m[1]["was"] is None
    assert [x["id"] for x in iv.moved(rows, "shipped_ln_error")] == ["b", "c"]  # b: 0.318 against 0.2


def test_the_committed_predictions_hold_both_figures_for_every_entry():
    entries = iv._shipped()["entry"]
    assert entries and all("shipped_ln_error" in e for e in entries)


def test_one_deployment_under_several_names_gets_one_range(tmp_path):
    """The range follows what the deployment does, not its policy's label: every layer on the
    GPU is all-GPU whether it is called all-resident, cpu-static with no layer on the CPU or
    gpu-layers with all 48 on the GPU; a deployment with CPU work is not."""
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--hw", "rtx4090", "--host",
                   "ryzen-7950x", "--engine", "llama.cpp", "--policy", "all-resident,cpu-static,gpu-layers",
                   "--cpu-layers", "0,24", "--gpu-layers", "48", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    on_gpu = [row for row in rows if not row["cpu_ms"]]
    assert {row["policy"] for row in on_gpu} == {"all-resident", "cpu-static", "gpu-layers"}
    assert len({(round(row["tokens_per_s_low"], 6), round(row["tokens_per_s_high"], 6), row["range_basis"])
                for row in on_gpu}) == 1
    assert "all-GPU" in on_gpu[0]["range_basis"]
    (half,) = [row for row in rows if row["cpu_ms"]]  # 24 layers' experts on the CPU: another kind
    assert "experts on the CPU" in half["range_basis"]
