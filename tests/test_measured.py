"""moesim.measured: engines' own benchmark output read into rows.

Every file under tests/data/measured/ is a real output (its README says which command and build
wrote it), except vllm_latency_0.33.0.json (vLLM's own writing statements on illustrative
latencies: no GPU to run vLLM) and plain_runs.csv (a plain CSV written by hand from the real
runs beside it). The refusal tests change one thing in a real output."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moesim.errors import MoesimError
from moesim.measured import (
    FORMATS,
    VLLM_LAYOUT_VERSION,
    MeasuredRow,
    detect_format,
    read_llama_bench_csv,
    read_llama_bench_json,
    read_llama_bench_jsonl,
    read_llama_bench_md,
    read_llama_timings,
    read_measured,
    read_plain_csv,
    read_sweep_bench,
    read_sweep_bench_jsonl,
    read_vllm_latency,
)

DATA = Path(__file__).parent / "data" / "measured"
GGUF = "/root/.cache/moesim/llamacpp/gguf/qwen3moe-a3b-geom-2L-"
BUILD = "0c1e570 (1)"
VLLM_KW = dict(output_len=128, input_len=32, batch=8)

# The identity of a measurement: what two outputs of the same llama-bench test must share.
IDENTITY = ("engine", "test", "n_gen", "n_prompt", "depth", "batch", "model_type", "threads", "n_cpu_moe",
            "override_tensors", "tensor_split", "flash_attn", "build", "backend")
# What json, jsonl and csv all print (md prints fewer: no path, no exact size, no ngl on a CPU backend).
RECORD = (*IDENTITY, "model_file", "model_bytes", "n_gpu_layers", "split_mode", "cpu_info", "gpu_info")


def _read(name: str, **kw) -> list[MeasuredRow]:
    return read_measured(DATA / name, **kw)


def _refused(path: Path, *fragments: str, **kw) -> str:
    with pytest.raises(MoesimError) as err:
        read_measured(path, **kw)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _fixtures() -> list[Path]:
    return sorted(p for p in DATA.iterdir() if p.name != "README.md")


# ---------------------------------------------------------------- every fixture

EXPECTED_FORMAT = {
    ".md": "llama-bench-md", ".json": "llama-bench-json", ".jsonl": "llama-bench-jsonl",
    ".csv": "llama-bench-csv", ".log": "llama-timings",
}


def test_every_fixture_is_read_and_its_format_detected():
    seen = set()
    for path in _fixtures():
        fmt = detect_format(path)
        seen.add(fmt)
        if path.name.startswith(("llama-bench_", "ik-llama-bench_")) or path.name.startswith("llama-") and \
                path.suffix == ".log":
            assert fmt == EXPECTED_FORMAT[path.suffix], path.name
        rows = read_measured(path, **(VLLM_KW if fmt == "vllm-latency" else {}))
        assert rows, path.name
        for row in rows:
            assert row.test in ("decode", "prefill", "prefill+decode")
            assert math.isfinite(row.tokens_per_s) and row.tokens_per_s > 0
            assert row.where.startswith(str(path))
            if row.spread is not None:
                assert 0 <= row.spread[0] <= row.tokens_per_s <= row.spread[1]
    assert seen == set(FORMATS)


def test_llama_bench_threads_md():
    rows = _read("llama-bench_threads.md")
    assert [(r.where.rsplit("/", 1)[-1], r.threads, r.tokens_per_s) for r in rows] == [
        ("llama-bench_threads.md:3", 1, 267.49), ("llama-bench_threads.md:4", 2, 44.00)]
    first = rows[0]
    assert (first.engine, first.test, first.n_gen, first.n_prompt, first.depth, first.batch) == (
        "llama.cpp", "decode", 16, 0, 0, 1)
    assert first.model_type == "qwen3moe ?B Q4_K - Medium"
    assert first.model_file is None and first.runs is None
    # the size and parameter count as printed (722.81 MiB, 1.25 B), to the printed precision
    assert (first.model_bytes, first.model_params) == (round(722.81 * 2**20), 1_250_000_000)
    assert first.spread == pytest.approx((267.49 - 19.20, 267.49 + 19.20))
    assert rows[1].spread == pytest.approx((0.0, 44.00 + 66.48))  # 44.00 ± 66.48: the low end stops at 0
    assert first.build == BUILD and first.backend == "CPU"
    assert first.options == {}  # every column it printed has its field


def test_llama_bench_threads_json():
    rows = _read("llama-bench_threads.json")
    assert len(rows) == 2
    first = rows[0]
    assert first.where == f"{DATA / 'llama-bench_threads.json'}[0]"
    assert first.tokens_per_s == 267.49149 and first.threads == 1 and rows[1].threads == 2
    assert first.spread == pytest.approx((267.49149 - 19.197484, 267.49149 + 19.197484))
    assert first.runs == 3
    assert first.model_file == GGUF + "q4_k_m.gguf"
    assert first.model_bytes == 757925888 and first.n_gpu_layers == -1 and first.n_cpu_moe == 0
    assert first.override_tensors == () and first.tensor_split == () and first.split_mode == "layer"
    assert first.flash_attn is None  # -1: auto
    assert (first.build, first.backend, first.cpu_info, first.gpu_info) == (BUILD, "CPU", "AMD EPYC", None)  # gpu_info "": None
    assert first.options["n_ubatch"] == "512" and first.options["cpu_strict"] == "0"
    assert rows[1].tokens_per_s == 44.003658


def test_llama_bench_threads_jsonl_and_csv():
    jsonl = _read("llama-bench_threads.jsonl")
    csv_rows = _read("llama-bench_threads.csv")
    assert [r.tokens_per_s for r in jsonl] == [277.665798, 6.737887] == [r.tokens_per_s for r in csv_rows]
    assert [r.where.rsplit("/", 1)[-1] for r in jsonl] == ["llama-bench_threads.jsonl:1", "llama-bench_threads.jsonl:2"]
    assert [r.where.rsplit("/", 1)[-1] for r in csv_rows] == ["llama-bench_threads.csv:2", "llama-bench_threads.csv:3"]
    assert jsonl[0].runs == 3 and csv_rows[0].runs is None  # the csv has no samples


def test_llama_bench_depth():
    md = _read("llama-bench_depth.md")
    assert [(r.test, r.depth, r.n_gen, r.tokens_per_s) for r in md] == [
        ("decode", 0, 16, 3.77), ("decode", 512, 16, 7.07)]
    json_rows = _read("llama-bench_depth.json")
    assert [(r.depth, r.tokens_per_s, r.threads) for r in json_rows] == [(0, 3.773755, 2), (512, 7.070818, 2)]
    assert json_rows[0].model_file == GGUF + "q8_0.gguf" and json_rows[0].model_bytes == 1330161664
    assert [(r.depth, r.tokens_per_s) for r in _read("llama-bench_depth.jsonl")] == [(0, 4.804819), (512, 29.740255)]
    assert [(r.depth, r.tokens_per_s) for r in _read("llama-bench_depth.csv")] == [(0, 4.804819), (512, 29.740255)]


def test_llama_bench_prefill_rows_are_kept():
    md = _read("llama-bench_prefill.md")
    assert [(r.test, r.n_prompt, r.n_gen, r.tokens_per_s) for r in md] == [
        ("prefill", 64, 0, 269.78), ("decode", 0, 16, 29.90), ("prefill+decode", 64, 16, 102.63)]
    json_rows = _read("llama-bench_prefill.json")
    assert [(r.test, r.n_prompt, r.n_gen, r.tokens_per_s) for r in json_rows] == [
        ("prefill", 64, 0, 269.780692), ("decode", 0, 16, 29.899974), ("prefill+decode", 64, 16, 102.632761)]
    assert json_rows[0].model_type == "qwen3moe ?B BF16" and json_rows[0].model_bytes == 2501945344
    csv_rows = _read("llama-bench_prefill.csv")
    assert [(r.test, r.tokens_per_s) for r in csv_rows] == [
        ("prefill", 116.796611), ("decode", 24.561568), ("prefill+decode", 23.01746)]


def test_llama_bench_offload_columns():
    md = _read("llama-bench_offload.md")
    assert len(md) == 1
    row = md[0]
    assert (row.n_cpu_moe, row.threads, row.flash_attn, row.tokens_per_s) == (1, 2, True, 7.91)
    assert row.override_tensors == (r"blk\.1\.ffn_down_exps=CPU",)
    assert row.n_gpu_layers is None  # a CPU backend's table has no ngl column
    for name in ("llama-bench_offload.json", "llama-bench_offload.jsonl", "llama-bench_offload.csv"):
        (rec,) = _read(name)
        assert (rec.n_gpu_layers, rec.n_cpu_moe, rec.flash_attn, rec.threads) == (99, 1, True, 2), name
        assert rec.override_tensors == (r"blk\.1\.ffn_down_exps=CPU",), name
    assert _read("llama-bench_offload.json")[0].tokens_per_s == 7.913779
    assert _read("llama-bench_offload.csv")[0].tokens_per_s == 23.470582


# ---------------------------------------------------------------- one llama-bench run, four formats

RUNS = ("threads", "depth", "prefill", "offload")


@pytest.mark.parametrize("run", RUNS)
def test_md_and_json_of_one_run_agree(run):
    """-o md -oe json: the same tests printed twice."""
    md = _read(f"llama-bench_{run}.md")
    js = _read(f"llama-bench_{run}.json")
    assert len(md) == len(js)
    for a, b in zip(md, js):
        for name in IDENTITY:
            assert getattr(a, name) == getattr(b, name), (run, name)
        assert a.tokens_per_s == pytest.approx(b.tokens_per_s, abs=0.0051)  # md prints two decimals
        assert a.spread == pytest.approx(b.spread, abs=0.011)


@pytest.mark.parametrize("run", RUNS)
def test_jsonl_and_csv_of_one_run_agree(run):
    """-o jsonl -oe csv: every field but where and runs (the csv has no samples) is the same."""
    jl = _read(f"llama-bench_{run}.jsonl")
    cs = _read(f"llama-bench_{run}.csv")
    assert len(jl) == len(cs)
    for a, b in zip(jl, cs):
        assert dataclasses.replace(a, where="", runs=None) == dataclasses.replace(b, where="")


@pytest.mark.parametrize("run", RUNS)
def test_all_four_formats_describe_the_same_tests(run):
    """md+json and jsonl+csv were two runs of one command: all but the timings agree."""
    md, js, jl, cs = (_read(f"llama-bench_{run}.{ext}") for ext in ("md", "json", "jsonl", "csv"))
    assert len(md) == len(js) == len(jl) == len(cs)
    for rows in zip(md, js, jl, cs):
        for name in IDENTITY:
            assert len({getattr(r, name) for r in rows}) == 1, (run, name)
        for name in RECORD:
            assert len({getattr(r, name) for r in rows[1:]}) == 1, (run, name)
        timings = {"test_time", "avg_ns", "stddev_ns"}
        assert len({tuple(sorted((k, v) for k, v in r.options.items() if k not in timings)) for r in rows[1:]}) == 1


def test_pasted_md_with_log_lines_and_a_code_fence(tmp_path):
    """As in a GitHub issue: log lines, a fence, the table, the build line."""
    table = (DATA / "llama-bench_depth.md").read_text()
    pasted = tmp_path / "issue.md"
    pasted.write_text("load_backend: loaded CPU backend\n```\n" + table + "```\nthanks!\n")
    rows = read_measured(pasted)
    assert [(r.depth, r.tokens_per_s, r.build) for r in rows] == [(0, 3.77, BUILD), (512, 7.07, BUILD)]
    assert rows[0].where == f"{pasted}:5"


# ---------------------------------------------------------------- llama-server / llama-cli timings


def test_llama_server_timings():
    rows = _read("llama-server_timings.log")
    assert [(r.where.rsplit(":", 1)[-1], r.test, r.n_prompt, r.n_gen, r.depth, r.tokens_per_s) for r in rows] == [
        ("11", "prefill", 3, 0, 0, 7.80), ("12", "decode", 0, 16, 3, 5.03),
        ("18", "prefill", 26, 0, 0, 375.29), ("19", "decode", 0, 16, 26, 87.24)]
    assert {r.model_file for r in rows} == {GGUF + "q4_k_m.gguf"}
    assert {r.threads for r in rows} == {2} and {r.engine for r in rows} == {"llama.cpp"}


def test_llama_completion_perf_lines():
    rows = _read("llama-completion_perf.log")
    assert [(r.test, r.n_prompt, r.n_gen, r.depth, r.tokens_per_s, r.threads) for r in rows] == [
        ("prefill", 3, 0, 0, 6.88, 2), ("decode", 0, 15, 3, 14.77, 2)]


def test_llama_cli_summary_line():
    rows = _read("llama-cli_single-turn.txt")
    assert [(r.test, r.tokens_per_s, r.n_prompt, r.n_gen) for r in rows] == [
        ("prefill", 60.5, 0, 0), ("decode", 256.6, 0, 0)]
    assert rows[1].options == {"counts": "not printed"}
    assert rows[1].model_file == GGUF + "q4_k_m.gguf" and rows[1].build == BUILD
    assert rows[1].where.endswith("llama-cli_single-turn.txt:31")


def test_older_llama_print_timings_and_engine_override(tmp_path):
    log = tmp_path / "old.log"
    log.write_text(
        "llama_print_timings:        load time =     726.32 ms\n"
        "llama_print_timings: prompt eval time =     129.25 ms /    12 tokens (   10.77 ms per token,    92.84 tokens per second)\n"
        "llama_print_timings:        eval time =    1937.20 ms /   127 runs   (   15.25 ms per token,    65.56 tokens per second)\n")
    rows = read_llama_timings(log, engine="ik_llama.cpp")
    assert [(r.test, r.n_prompt, r.n_gen, r.depth, r.tokens_per_s, r.engine) for r in rows] == [
        ("prefill", 12, 0, 0, 92.84, "ik_llama.cpp"), ("decode", 0, 127, 12, 65.56, "ik_llama.cpp")]


# ---------------------------------------------------------------- ik_llama.cpp

IK_BUILD = "8337e4cd3 (4840)"


def test_ik_llama_bench_gp_md_json_csv():
    md = _read("ik-llama-bench_gp.md")
    assert [(r.engine, r.test, r.n_prompt, r.n_gen, r.depth, r.tokens_per_s) for r in md] == [
        ("ik_llama.cpp", "prefill", 64, 0, 0, 1370.69), ("ik_llama.cpp", "decode", 0, 16, 0, 383.84),
        ("ik_llama.cpp", "decode", 0, 16, 64, 417.88)]  # tg16@pp64: a decode at depth 64
    assert {r.build for r in md} == {IK_BUILD} and {r.n_cpu_moe for r in md} == {None}
    js = _read("ik-llama-bench_gp.json")
    assert [(r.test, r.n_prompt, r.n_gen, r.depth, r.tokens_per_s, r.runs) for r in js] == [
        ("prefill", 64, 0, 0, 1370.694539, 3), ("decode", 0, 16, 0, 383.837951, 3), ("decode", 0, 16, 64, 417.880174, 3)]
    first = js[0]
    assert (first.engine, first.build, first.backend, first.threads, first.n_gpu_layers) == (
        "ik_llama.cpp", IK_BUILD, "CPU", 2, 999)
    assert first.flash_attn is True and first.n_cpu_moe is None and first.override_tensors == ()
    assert first.model_file == GGUF + "q4_k_m.gguf" and first.model_bytes == 757925888
    assert first.options["mla_attn"] == "3" and first.options["fused_moe"] == "1"
    for a, b in zip(md, js):  # one run, printed twice
        for name in IDENTITY:
            if name != "flash_attn":  # ik's table shows fa only when it is not its default
                assert getattr(a, name) == getattr(b, name), name
        assert a.tokens_per_s == pytest.approx(b.tokens_per_s, abs=0.0051)
    cs = _read("ik-llama-bench_gp.csv")  # a second run of the same command
    assert [(r.test, r.depth, r.tokens_per_s) for r in cs] == [
        ("prefill", 0, 1224.318512), ("decode", 0, 424.174754), ("decode", 64, 386.957334)]
    for a, b in zip(js, cs):
        assert dataclasses.replace(a, where="", tokens_per_s=0, spread=None, runs=None, options={}) == \
            dataclasses.replace(b, where="", tokens_per_s=0, spread=None, options={})


def test_ik_llama_bench_overrides_and_its_own_columns():
    md = _read("ik-llama-bench_ot.md")
    assert [(r.engine, r.threads, r.tokens_per_s) for r in md] == [("ik_llama.cpp", 1, 240.91), ("ik_llama.cpp", 2, 79.73)]
    assert {r.override_tensors for r in md} == {(r"blk\.1\.ffn_down_exps=CPU",)}
    assert md[0].options["fused_moe"] == "0"  # the fmoe column, by llama-bench's field name
    js = _read("ik-llama-bench_ot.json")
    assert [(r.threads, r.tokens_per_s) for r in js] == [(1, 240.908243), (2, 79.729326)]
    assert {r.override_tensors for r in js} == {(r"blk\.1\.ffn_down_exps=CPU",)}
    assert js[1].spread == pytest.approx((0.0, 79.729326 + 127.907511))


def test_ik_sweep_bench_table():
    rows = _read("ik-sweep-bench.log")
    assert detect_format(DATA / "ik-sweep-bench.log") == "sweep-bench"
    assert [(r.where.rsplit(":", 1)[-1], r.test, r.depth, r.n_gen, r.n_prompt, r.tokens_per_s) for r in rows] == [
        ("141", "decode", 0, 32, 0, 7.62), ("141", "prefill", 0, 0, 128, 701.12),
        ("142", "decode", 128, 32, 0, 133.07), ("142", "prefill", 128, 0, 128, 665.04),
        ("143", "decode", 256, 32, 0, 135.90), ("143", "prefill", 256, 0, 128, 679.88),
        ("144", "decode", 384, 32, 0, 123.41), ("144", "prefill", 384, 0, 128, 622.17)]
    first = rows[0]
    assert (first.engine, first.threads, first.n_gpu_layers, first.flash_attn) == ("ik_llama.cpp", 2, -1, True)
    assert first.model_file == GGUF + "q4_k_m.gguf" and first.model_type == "qwen3moe ?B Q4_K - Medium"
    assert first.options == {"n_kv_max": "512", "n_batch": "2048", "n_ubatch": "128", "n_threads_batch": "2"}
    # the run's totals printed after the table are llama_print_timings lines, read when asked for
    totals = read_measured(DATA / "ik-sweep-bench.log", "llama-timings")
    assert [(r.test, r.n_prompt, r.n_gen, r.tokens_per_s) for r in totals] == [
        ("prefill", 512, 0, 665.82), ("decode", 0, 128, 25.94)]


def test_ik_sweep_bench_jsonl_among_log_lines():
    rows = _read("ik-sweep-bench_jsonl.log")
    assert detect_format(DATA / "ik-sweep-bench_jsonl.log") == "sweep-bench-jsonl"
    assert [(r.where.rsplit(":", 1)[-1], r.test, r.depth, r.tokens_per_s) for r in rows] == [
        ("136", "decode", 0, 12.196837), ("136", "prefill", 0, 426.672363),
        ("137", "decode", 128, 6.517766), ("137", "prefill", 128, 609.77356),
        ("138", "decode", 256, 9.651887), ("138", "prefill", 256, 456.284058),
        ("139", "decode", 384, 184.310562), ("139", "prefill", 384, 1498.092285)]
    assert {(r.threads, r.n_gpu_layers, r.flash_attn, r.n_gen or r.n_prompt) for r in rows} == {(2, -1, True, 32),
                                                                                                 (2, -1, True, 128)}
    assert rows[0].model_file == GGUF + "q4_k_m.gguf"


def test_joined_sweep_runs_keep_their_own_settings(tmp_path):
    text = (DATA / "ik-sweep-bench.log").read_text()
    joined = tmp_path / "two.log"
    joined.write_text(text + text.replace("n_threads = 2, n_threads_batch = 2", "n_threads = 1, n_threads_batch = 2"))
    rows = read_measured(joined)
    assert len(rows) == 16
    assert [r.threads for r in rows if r.test == "decode"] == [2] * 4 + [1] * 4
    assert {r.threads for r in rows if r.test == "prefill"} == {2}


def test_an_ik_table_without_ik_columns_needs_engine(tmp_path):
    lines = (DATA / "ik-llama-bench_gp.md").read_text().splitlines(keepends=True)
    plain = tmp_path / "ik.md"
    plain.write_text("".join(line for line in lines if "tg16@pp64" not in line))
    assert {r.engine for r in read_measured(plain)} == {"llama.cpp"}  # indistinguishable from llama.cpp's
    rows = read_measured(plain, engine="ik_llama.cpp")
    assert {r.engine for r in rows} == {"ik_llama.cpp"} and len(rows) == 2
    assert {r.n_cpu_moe for r in rows} == {None}  # ik's llama-bench has no n_cpu_moe


def test_sweep_bench_refusals(tmp_path):
    path = _variant(tmp_path, "ik-sweep-bench.log", "|   133.07 |", "|      nan |")
    _refused(path, f"{path}:142: S_TG t/s 'nan' is not a finite number")
    path = _variant(tmp_path, "ik-sweep-bench.log", "|   665.04 |", "|    -1.00 |")
    _refused(path, f"{path}:142: S_PP t/s '-1.00' is not a speed")
    path = _variant(tmp_path, "ik-sweep-bench.log", "|    128 |    0.192", "|    12x |    0.192")
    _refused(path, f"{path}:142: N_KV '12x' is not a whole number")
    path = _variant(tmp_path, "ik-sweep-bench.log", "|    0.240 |   133.07 |", "|   133.07 |")
    _refused(path, f"{path}:142: 6 cells where the table header has 7 columns")
    path = _variant(tmp_path, "ik-sweep-bench_jsonl.log", '"speed_tg": 6.517766', '"speed_tg": 0')
    _refused(path, f"{path}:137: S_TG t/s 0 is not a speed")
    path = _variant(tmp_path, "ik-sweep-bench_jsonl.log", '"speed_tg": 6.517766 }', '"speed_tg": 6.5')
    _refused(path, f"{path}:137: not valid JSON")
    path = _variant(tmp_path, "ik-sweep-bench_jsonl.log", '"n_kv": 128, ', "")
    _refused(path, f"{path}:137: field n_kv is missing")


# ---------------------------------------------------------------- vLLM


def test_vllm_latency_needs_the_batch_shape():
    path = DATA / "vllm_latency_0.33.0.json"
    assert VLLM_LAYOUT_VERSION == "0.33.0"
    assert detect_format(path) == "vllm-latency"
    msg = _refused(path, "output_len", "input_len", "batch", str(path))
    assert msg.startswith(f"{path}: ")
    _refused(path, "batch", output_len=128, input_len=32)
    (row,) = read_vllm_latency(path, **VLLM_KW)
    data = json.loads(path.read_text())
    assert row.tokens_per_s == pytest.approx(128 / data["avg_latency"])
    assert (row.engine, row.test, row.n_gen, row.n_prompt, row.batch, row.runs) == (
        "vllm", "prefill+decode", 128, 32, 8, 5)
    assert row.model_file == "Qwen/Qwen3-30B-A3B"
    assert row.spread == pytest.approx((128 / 2.431, 128 / 2.398))
    assert row.options["p50_latency_s"] == "2.412"
    assert read_measured(path, **VLLM_KW) == [row]


def test_vllm_options_are_refused_for_other_formats():
    _refused(DATA / "llama-bench_threads.md", "output_len", "vllm-latency", output_len=128)
    _refused(DATA / "llama-bench_threads.md", "unknown reader option", "n_gen", n_gen=3)


def test_vllm_older_layout_with_std_latency(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"avg_latency": 2.0, "std_latency": 0.1, "latencies": [1.9, 2.1],
                               "percentiles": {"10": 1.92, "50": 2.0}}, indent=4))
    (row,) = read_measured(old, output_len=64, input_len=128, batch=1)
    assert row.tokens_per_s == 32.0 and row.model_file is None and row.options["std_latency_s"] == "0.1"


# ---------------------------------------------------------------- plain CSV


def test_plain_csv():
    rows = _read("plain_runs.csv")
    assert [(r.engine, r.test, r.threads, r.depth, r.batch, r.n_gen) for r in rows] == [
        ("llama.cpp", "decode", 1, 0, 1, 16), ("llama.cpp", "decode", 2, 512, 1, 16), ("llama.cpp", "decode", 2, 26, 1, 16)]
    assert [r.tokens_per_s for r in rows] == pytest.approx([267.49149, 7.070818, 1000 / 11.46])
    assert rows[0].model_file == GGUF + "q4_k_m.gguf"
    assert rows[0].options == {"hw": "none", "host": "this", "policy": "cpu-static", "cpu_layers": "2",
                               "gpu_layers": "0", "expert_dtype": "q4_k"}
    # the plain rows carry the same numbers as the outputs they were copied from
    assert rows[0].tokens_per_s == _read("llama-bench_threads.json")[0].tokens_per_s
    assert rows[1].tokens_per_s == _read("llama-bench_depth.json")[1].tokens_per_s
    server = _read("llama-server_timings.log")[3]
    assert rows[2].depth == server.depth and rows[2].tokens_per_s == pytest.approx(server.tokens_per_s, rel=2e-3)


def test_plain_csv_refusals(tmp_path):
    def csv_file(text: str) -> Path:
        path = tmp_path / "runs.csv"
        path.write_text(text)
        return path

    _refused(csv_file("engine,threads\nllama.cpp,4\n"), "runs.csv:1", "tokens_per_s", fmt="csv")
    _refused(csv_file("threads,tokens_per_s\n4,10\n"), "runs.csv:1", "engine")
    assert read_plain_csv(csv_file("threads,tokens_per_s\n4,10\n"), engine="vllm")[0].engine == "vllm"
    _refused(csv_file("engine,tokens_per_s,tpot_ms\nvllm,10,50\n"), "runs.csv:2", "disagree")
    _refused(csv_file("engine,tokens_per_s\nvllm,\n"), "runs.csv:2", "empty")
    _refused(csv_file("engine,tokens_per_s,test\nvllm,10,generate\n"), "runs.csv:2", "test 'generate'")
    _refused(csv_file("engine,tokens_per_s,threads\nvllm,10,four\n"), "runs.csv:2", "threads 'four'")
    _refused(csv_file("engine,tokens_per_s,prompt_len,depth\nvllm,10,1,1\n"), "prompt_len and depth")
    _refused(csv_file("engine,tokens_per_s\n"), "no rows")
    _refused(csv_file("engine,tokens_per_s\nvllm,10,3\n"), "runs.csv:2", "3 cells")


# ---------------------------------------------------------------- refusals, one line each


def _variant(tmp_path: Path, name: str, old: str, new: str, *, count: int = 1) -> Path:
    text = (DATA / name).read_text()
    assert old in text, (name, old)
    path = tmp_path / name
    path.write_text(text.replace(old, new, count))
    return path


def test_empty_blank_and_missing_files(tmp_path):
    empty = tmp_path / "run.md"
    empty.write_text("")
    _refused(empty, f"{empty}: empty file")
    blank = tmp_path / "blank.json"
    blank.write_text("\n  \n")
    _refused(blank, "empty file")
    _refused(tmp_path / "nothere.md", "no such file")
    for fmt in FORMATS:
        with pytest.raises(MoesimError, match="empty file"):
            read_measured(empty, fmt, **(VLLM_KW if fmt == "vllm-latency" else {}))


def test_binary_garbage(tmp_path):
    garbage = tmp_path / "x.md"
    garbage.write_bytes(bytes(range(256)) * 8)
    _refused(garbage, "binary content")
    noisy = tmp_path / "y.csv"
    noisy.write_bytes(b"engine,tokens_per_s\n" + bytes(range(128, 256)) * 4)
    _refused(noisy, "binary content")
    zipped = tmp_path / "z.gguf"
    zipped.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    _refused(zipped, "NUL byte")


def test_unknown_format(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("the model ran at about 20 tokens a second\n")
    _refused(other, "not a benchmark output", "llama-bench-md")
    _refused(DATA / "llama-bench_threads.md", "format 'xlsx'", fmt="xlsx")


@pytest.mark.parametrize("bad, fragment", [
    ("abc", "t/s 'abc' is not a number"),
    ("nan ± 1.0", "t/s 'nan' is not a finite number"),
    ("inf ± 1.0", "t/s 'inf' is not a finite number"),
    ("-3.0 ± 1.0", "t/s '-3.0' is not a speed"),
    ("0.00 ± 0.00", "t/s '0.00' is not a speed"),
    ("3.0 ± -1", "negative"),
])
def test_md_bad_speeds(tmp_path, bad, fragment):
    path = _variant(tmp_path, "llama-bench_threads.md", "267.49 ± 19.20", bad)
    _refused(path, f"{path}:3: ", fragment)


def test_md_structure_refusals(tmp_path):
    path = _variant(tmp_path, "llama-bench_threads.md", "tg16 |", "tg16x |")
    _refused(path, f"{path}:3: test 'tg16x'")
    path = _variant(tmp_path, "llama-bench_threads.md", "|       1 |", "|       one |")
    _refused(path, f"{path}:3: threads 'one' is not a whole number")
    path = _variant(tmp_path, "llama-bench_threads.md", "| CPU        |       2 |", "| CPU        |")
    _refused(path, f"{path}:4: 6 cells where the table header has 7 columns")
    path = _variant(tmp_path, "llama-bench_threads.md", "| threads |", "| test |")
    _refused(path, f"{path}:1: column 'test' appears twice")
    text = (DATA / "llama-bench_threads.md").read_text().splitlines(keepends=True)
    repeated = tmp_path / "repeated.md"
    repeated.write_text("".join(text[:3] + text[:1] + text[3:]))
    _refused(repeated, f"{repeated}:4: the table header is repeated")
    header_only = tmp_path / "header.md"
    header_only.write_text("".join(text[:2]))
    _refused(header_only, "the llama-bench table has no rows")
    no_separator = tmp_path / "nosep.md"
    no_separator.write_text("".join(text[:1] + text[2:]))
    _refused(no_separator, f"{no_separator}:2: the table header is not followed")


@pytest.mark.parametrize("bad, fragment", [
    ('"avg_ts": NaN', "NaN in the JSON is not a number"),
    ('"avg_ts": Infinity', "Infinity in the JSON is not a number"),
    ('"avg_ts": -267.49149', "avg_ts -267.49149 is not a speed"),
    ('"avg_ts": 0', "avg_ts 0 is not a speed"),
    ('"avg_ts": "fast"', "avg_ts 'fast' is not a number"),
    ('"avg_ts": nan', "not valid JSON"),
])
def test_json_bad_speeds(tmp_path, bad, fragment):
    path = _variant(tmp_path, "llama-bench_threads.json", '"avg_ts": 267.491490', bad)
    message = _refused(path, fragment)
    if "not valid JSON" not in fragment:
        assert message.startswith(f"{path}[0]: ") or message.startswith(f"{path}: "), message


def test_json_structure_refusals(tmp_path):
    path = _variant(tmp_path, "llama-bench_threads.json", '"n_gen": 16,', '"n_gen": 16, "n_gen": 16,')
    _refused(path, "field 'n_gen' appears twice")
    path = _variant(tmp_path, "llama-bench_threads.json", '"n_gen": 16,', '"n_gen": 0,')
    _refused(path, f"{path}[0]: n_prompt and n_gen are both 0")
    path = _variant(tmp_path, "llama-bench_threads.json", '"n_threads": 1,', '"n_threads": -1,')
    _refused(path, f"{path}[0]: n_threads -1 is below 1")
    path = _variant(tmp_path, "llama-bench_threads.json", '"avg_ts": 267.491490,', "")
    _refused(path, f"{path}[0]: field avg_ts is missing")
    path = _variant(tmp_path, "llama-bench_threads.json", "245.324", "-245.324")
    _refused(path, f"{path}[0]: samples_ts")
    empty = tmp_path / "empty.json"
    empty.write_text("[\n]\n")
    _refused(empty, "no tests")
    truncated = tmp_path / "cut.json"
    truncated.write_text((DATA / "llama-bench_threads.json").read_text()[:500])
    _refused(truncated, "not valid JSON")


def test_jsonl_refusals(tmp_path):
    path = _variant(tmp_path, "llama-bench_threads.jsonl", '"avg_ts": 6.737887', '"avg_ts": -6.7')
    _refused(path, f"{path}:2: avg_ts -6.7 is not a speed")
    text = (DATA / "llama-bench_threads.jsonl").read_text()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(text + "[1, 2]\n")
    _refused(broken, f"{broken}:3: a jsonl line is one JSON object")


def test_csv_refusals(tmp_path):
    path = _variant(tmp_path, "llama-bench_threads.csv", '"277.665798"', '"inf"')
    _refused(path, f"{path}:2: avg_ts 'inf' is not a finite number")
    path = _variant(tmp_path, "llama-bench_threads.csv", '"277.665798"', '"0"')
    _refused(path, f"{path}:2: avg_ts '0' is not a speed")
    text = (DATA / "llama-bench_threads.csv").read_text()
    header = text.splitlines(keepends=True)[0]
    joined = tmp_path / "joined.csv"
    joined.write_text(text + header + text.splitlines(keepends=True)[1])
    _refused(joined, f"{joined}:4: the header is repeated")
    duplicated = tmp_path / "dup.csv"
    duplicated.write_text(header.replace("n_gen,", "n_gen,n_gen,", 1) + "".join(text.splitlines(keepends=True)[1:]))
    _refused(duplicated, f"{duplicated}:1: column 'n_gen' appears twice")
    only_header = tmp_path / "header.csv"
    only_header.write_text(header)
    _refused(only_header, "no tests")


def test_timing_refusals(tmp_path):
    path = _variant(tmp_path, "llama-server_timings.log", "87.24 tokens per second", "nan tokens per second")
    _refused(path, f"{path}:19: tokens per second 'nan' is not a finite number")
    path = _variant(tmp_path, "llama-server_timings.log", "375.29 tokens per second", "-375.29 tokens per second")
    _refused(path, f"{path}:18: tokens per second '-375.29' is not a speed")
    path = _variant(tmp_path, "llama-server_timings.log", "/    16 tokens (  198.84", "/    16 tokens")
    _refused(path, f"{path}:12: an 'eval time =' line not in llama.cpp's form")
    path = _variant(tmp_path, "llama-server_timings.log", "/     3 tokens (  128.25", "/     0 tokens (  128.25")
    _refused(path, f"{path}:11: tokens 0 is below 1")
    path = _variant(tmp_path, "llama-cli_single-turn.txt", "Generation: 256.6 t/s", "Generation: inf t/s")
    _refused(path, f"{path}:31: Generation t/s 'inf' is not a finite number")
    no_lines = tmp_path / "server.log"
    no_lines.write_text("srv  llama_server: listening on http://127.0.0.1:8089\n")
    _refused(no_lines, "no 'eval time =' lines", fmt="llama-timings")


def test_readers_one_per_format_agree_with_read_measured():
    for reader, name in ((read_llama_bench_md, "llama-bench_depth.md"), (read_llama_bench_json, "llama-bench_depth.json"),
                         (read_llama_bench_jsonl, "llama-bench_depth.jsonl"), (read_llama_bench_csv, "llama-bench_depth.csv"),
                         (read_llama_timings, "llama-server_timings.log"), (read_plain_csv, "plain_runs.csv"),
                         (read_sweep_bench, "ik-sweep-bench.log"), (read_sweep_bench_jsonl, "ik-sweep-bench_jsonl.log")):
        assert reader(DATA / name) == _read(name)


def test_forcing_the_wrong_format_is_one_line(tmp_path):
    _refused(DATA / "llama-bench_threads.md", "llama-bench_threads.md:1: column n_prompt is missing",
             fmt="llama-bench-csv")
    _refused(DATA / "llama-bench_threads.json", "no llama-bench table", fmt="llama-bench-md")
    _refused(DATA / "llama-bench_threads.csv", "no sweep-bench table", fmt="sweep-bench")


def test_foundation_module_imports_nothing_heavy():
    code = ("import sys, moesim.measured; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'torch', 'scipy', 'simpy', 'numba') or m.startswith(('moesim.sim', 'moesim.cli'))]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
