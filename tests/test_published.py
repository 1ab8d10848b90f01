"""The published-measurements suite: every entry accounted for, scored leave-one-source-out
(no entry judged by figures fitted on its own source), and the scoring honest."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moesim.sim import engine_fit
from moesim.sim.engine_fit import FIT, UNFITTED, fit, leave_one_source_out
from moesim.sim.published import KINDS, WITHIN, _read, entries, excluded, run_published, score, source_id, summarise


def test_every_measurement_is_expressed_or_excluded_with_a_reason():
    measured = {m["id"] for m in _read("measurements.toml")["measurement"]}
    expressed = {e.id for e in entries()}
    skipped = excluded()
    assert expressed | set(skipped) == measured
    assert not expressed & set(skipped)
    assert all(reason.strip() for reason in skipped.values())
    assert len(expressed) >= 25


def test_a_source_is_one_thread_or_one_page():
    assert source_id({"source_url": "ggml-org/llama.cpp#16991 (comment by ORippler, turn 25)"}) == \
        source_id({"source_url": "ggml-org/llama.cpp#16991 (comment by someone else)"}) == "ggml-org/llama.cpp#16991"
    assert source_id({"source_url": "ggml-org/llama.cpp#1699 (x)"}) != "ggml-org/llama.cpp#16991"
    page = "https://forum.level1techs.com/t/deepseek-deep-dive-r1-at-home/225826/422"
    assert source_id({"source_url": f"{page} (post by ubergarm)"}) == source_id({"source_url": f"{page}/#reply"}) \
        == page
    assert source_id({"source_url": "https://unsloth.ai/blog/x (Jan 27, 2025); same figure in a post"}) == \
        "https://unsloth.ai/blog/x"
    # the suite's own: several sources per engine, and every entry of one tutorial page one source
    by_source = {}
    for e in entries():
        by_source.setdefault(e.source, set()).add(e.setting["engine"])
    assert len(by_source) >= 15
    tutorial = [e for e in entries() if "DeepseekR1_V3_tutorial" in e.measurement["source_url"]]
    assert len(tutorial) >= 2 and len({e.source for e in tutorial}) == 1


def test_every_entry_has_a_deployment_kind():
    kinds = {e.kind for e in entries()}
    assert kinds <= set(KINDS.values()) | {"multi-GPU"}
    assert {"all-GPU", "experts on the CPU", "all-CPU", "multi-GPU"} <= kinds


def test_a_fit_leaves_a_figure_no_entry_informs_unfitted():
    """llama.cpp fitted on one Q4_K entry: its IQ1_S efficiency is informed by nothing, so
    it keeps the unfitted value, and the fitted figures name only the entries given."""
    one = next(e for e in entries() if e.id == "lcpp-qwen3-30b-q4km-rtx2080-ncmoe36")
    f = fit([one], ["llama.cpp"])["llama.cpp"]
    assert f.entries == (one.id,)
    assert "cpu_weight_efficiency.iq1_s" in f.uninformed and "cpu_weight_efficiency.iq1_s" not in f.figures
    assert f.engine.weight_efficiency("cpu", "iq1_s") == UNFITTED["cpu_weight_efficiency"]
    assert f.figures and all(lo <= f.figures[k] <= hi for k, lo, hi in FIT["llama.cpp"] if k in f.figures)
    assert "cpu_weight_efficiency.default" in f.figures  # the entry computes its experts on the CPU
    nothing = fit([], ["vllm"])["vllm"]
    assert nothing.figures == {} and nothing.engine.weight_efficiency("gpu", "bf16") == 1.0


def lone_engines() -> set[str]:
    """The engines (with figures to fit) that one source alone measures: leaving that source out
    leaves nothing to fit them on."""
    sources: dict[str, set[str]] = {}
    for e in entries():
        sources.setdefault(e.setting["engine"], set()).add(e.source)
    return {name for name, s in sources.items() if len(s) == 1 and name in engine_fit.FIT}


def test_leave_one_source_out_never_fits_on_the_source_it_predicts(monkeypatch):
    fitted_on = []
    real = engine_fit._fit_uncached

    def spy(name, ids):
        fitted_on.append(set(ids))
        return real(name, ids)

    monkeypatch.setattr(engine_fit, "_fit_uncached", spy)
    monkeypatch.setattr(engine_fit, "_FITS", {})  # every fit made again, through the spy
    # the sources whose engines no other source measures (cheap: nothing to fit), and one
    # ik_llama.cpp source, whose figures come from the other ik_llama.cpp and llama.cpp sources
    lone = lone_engines()
    assert len(lone) >= 2, lone
    held = [e for e in entries() if e.setting["engine"] in lone or e.id == "ik-dsr1-q8-16x3090-all-gpu"]
    rows = leave_one_source_out(held, jobs=1)  # in this process, where the spy is
    assert fitted_on
    assert [r["id"] for r in rows] == [e.id for e in held]
    in_workers = leave_one_source_out(held, jobs=2)  # the folds on two worker processes: the same rows
    assert in_workers == rows
    source = {e.id: e.source for e in entries()}
    for r in rows:
        assert r["source_id"] == source[r["id"]]
        if r["engine"] in lone:  # every entry of theirs is of the held-out source
            assert r["fitted_on_entries"] == 0 and r["fitted_figures"] == {}
    ik = next(r for r in rows if r["engine"] == "ik_llama.cpp")
    assert ik["fitted_on_entries"] > 0 and ik["fitted_on_sources"] >= 2
    for ids in fitted_on:
        assert all(source[i] != source["ik-dsr1-q8-16x3090-all-gpu"] for i in ids)


def test_scoring_is_the_rows_own_figures():
    rows = run_published()
    for r in rows:
        assert r["ratio"] == pytest.approx(r["predicted_tps"] / r["measured_tps"])
        assert r["within_25"] == (abs(r["ratio"] - 1) <= WITHIN)
        assert r["synthetic_trace"] is True and r["source"] and r["source_id"] and r["kind"]
    s = summarise(rows)
    assert s["overall"] == score(rows)
    assert s["overall"]["median_abs_ln"] == pytest.approx(float(np.median([abs(r["ln_error"]) for r in rows])))
    for kind, k in s["by_kind"].items():
        mine = [r for r in rows if r["kind"] == kind]
        assert k["entries"] == len(mine) and k["sources"] == len({r["source_id"] for r in mine})
    assert sum(k["entries"] for k in s["by_engine"].values()) == len(rows)


def test_the_cli_prints_the_leave_one_source_out_tables(monkeypatch):
    """In process, over a few cheap sources (the whole suite is the slow test below)."""
    from cli_run import in_process

    lone = lone_engines()
    few = [e for e in entries() if e.setting["engine"] in lone]
    monkeypatch.setattr(engine_fit, "entries", lambda: tuple(few))
    r = in_process("validate", "--published", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    assert "note: --repeats: for the executor suite, not --published" in r.stderr and "changed nothing" in r.stderr
    assert "leave one source out" in r.stdout and "by deployment kind" in r.stdout and "by engine" in r.stdout
    assert f"{len(few)} entries from {len({e.source for e in few})} sources" in r.stdout and "unfitted" in r.stdout
    assert "with the shipped engine figures" in r.stdout
    d = json.loads(in_process("validate", "--published", "--json").stdout)  # the whole suite: test_strict_json, slow
    assert len(d["rows"]) == len(few) and set(d["summary"]["by_kind"]) == {e.kind for e in few}
    assert all(r["fitted_on_sources"] == 0 and r["source_id"] for r in d["rows"])
    assert d["shipped_figures"]["overall"]["entries"] == len(entries())
