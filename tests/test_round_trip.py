"""The round trip as users take it (issue "Calibration a user can trust", item 4): a published
entry printed as its engine prints it (llama-bench's markdown, else the plain CSV) reads back
through `moesim fit --measured`'s path as the same deployment, and a source calibrated on its
first row that way predicts its others with the profile it wrote."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from moesim.atomic import atomic_write_text
from moesim.measured import read_measured
from moesim.sim.calibrate import Given, deployment, printed, round_trip
from moesim.sim.published import Entry, _host, entries, predict, run_published


def _undated(e: Entry) -> Entry:
    """``e`` priced at the engine's current build (an output printed today names no date)."""
    return replace(e, measurement={k: v for k, v in e.measurement.items() if k != "date"})


@pytest.mark.parametrize("e", entries(), ids=lambda e: e.id)
def test_every_entry_printed_reads_back_as_the_same_deployment(tmp_path: Path, e: Entry):
    host = None
    if e.setting.get("host"):
        host = tmp_path / "host.toml"
        atomic_write_text(host, _host(e.setting).to_toml())
    name, text = printed(e, str(host) if host else None)
    path = tmp_path / name
    path.write_text(text)
    (row,) = read_measured(path)
    assert row.tokens_per_s == pytest.approx(float(e.measurement["decode_tps"]), rel=1e-3)
    back = deployment(row, Given(e.setting["hw"], str(host) if host else None, e.setting["engine"],
                                 e.setting["model"]))
    want = predict(_undated(e))["predicted_tps"]
    # 1%: a printed row always says its generated tokens (tg128 where the source gave none), which
    # moves the context the prediction averages over by half of them
    assert predict(back)["predicted_tps"] == pytest.approx(want, rel=0.01), text


def test_a_llama_cpp_entry_prints_as_llama_bench_markdown(tmp_path):
    (e,) = [e for e in entries() if e.id == "lcpp-qwen35-35b-q4km-5080-9950x-ncmoe24"]
    name, text = printed(e, "host.toml")
    assert name == "llama-bench.md"
    assert "Q4_K - Medium" in text and "| CUDA |" in text and "n_cpu_moe" in text.splitlines()[0]


def test_a_source_calibrated_through_its_printed_row_predicts_its_others(tmp_path):
    src = next(e.source for e in entries() if e.id == "vllm-qwen3-30b-a100-isl2048")
    rows = run_published(which=[e for e in entries() if e.source == src])
    trip = round_trip(rows, tmp_path)
    (s,) = trip["sources"]
    assert s["status"] == "written" and s["format"] == "runs.csv"
    assert s["median_abs_ln_after"] < s["median_abs_ln_before"]
    assert (tmp_path / "source-1" / "engine.toml").exists()
    assert trip["entries"] == len(rows) - 1
