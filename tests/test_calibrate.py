"""Calibration on a user's own measurements (moesim.sim.calibrate, `moesim fit --measured`):
rows become deployments, a known figure is recovered, no more figures than rows, the written
profiles load back and make whatif answer with the calibration's range."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
from cli_run import in_process, one_line_error

from moesim.engines import get_engine, load_engine
from moesim.errors import MoesimError
from moesim.measured import MeasuredRow
from moesim.sim.calibrate import Given, calibrate, calibrate_entries, choose, deployment
from moesim.sim.published import predict

MODEL = "qwen3-30b-a3b"
HOST = "ryzen-7950x"


def row(**kw) -> MeasuredRow:
    base = dict(where="run.json[0]", engine="llama.cpp", test="decode", tokens_per_s=10.0, n_gen=16, threads=16,
                model_file=MODEL, n_gpu_layers=0)
    return MeasuredRow(**{**base, **kw})


def test_rows_become_the_deployments_the_engine_ran():
    g = Given("rtx4090", HOST)
    assert deployment(row(), g).setting["hw"] == "none"  # -ngl 0: every layer on the CPU
    s = deployment(row(n_gpu_layers=99, n_cpu_moe=20), g).setting
    assert (s["policy"], s["cpu_layers"], s["hw"]) == ("cpu-static", 20, "rtx4090")
    s = deployment(row(n_gpu_layers=30), g).setting
    assert (s["policy"], s["gpu_layers"]) == ("gpu-layers", 30)
    s = deployment(row(n_gpu_layers=99, override_tensors=(r"blk\.(0|1|2)\.ffn_.*_exps\.=CPU",)), g).setting
    assert (s["policy"], s["cpu_layers"]) == ("cpu-static", 3)
    s = deployment(row(n_gpu_layers=99, override_tensors=("exps=CPU",)), g).setting
    assert s["cpu_layers"] == 48
    s = deployment(row(n_gpu_layers=99, n_cpu_moe=2, override_tensors=(r"blk\.2\.ffn_.*_exps\.=CPU",)), g).setting
    assert s["cpu_layers"] == 3  # --n-cpu-moe 2 and -ot on the third: the first three
    s = deployment(row(n_gpu_layers=99), g).setting
    assert s["policy"] == "all-resident"
    assert deployment(row(depth=1024, n_gen=32), g).setting["context"] == 1024


@pytest.mark.parametrize("r, given, words", [
    (row(n_gpu_layers=99, override_tensors=(r"blk\.(5|6)\.ffn_.*_exps\.=CPU",)), Given("rtx4090", HOST),
     "MoE layers [5, 6]"),
    (row(n_gpu_layers=99, override_tensors=("exps=CUDA0",)), Given("rtx4090", HOST), "overrides to the CPU only"),
    (row(n_gpu_layers=99, override_tensors=("ex(ps=CPU",)), Given("rtx4090", HOST), "not a regular expression"),
    (row(n_gpu_layers=99, override_tensors=(r"blk\.1\.ffn_down_exps=CPU",)), Given("rtx4090", HOST),
     "keeps only ffn_down_exps of layer 1's experts"),
    (row(), Given("none"), "--host"),
    (row(model_file="/nowhere/model.gguf"), Given("none", HOST), "--model"),
])
def test_rows_moesim_cannot_express_are_refused_by_row(r, given, words):
    with pytest.raises(MoesimError, match="run.json") as e:
        deployment(r, given)
    assert words in str(e.value)


def _measured_with(engine, rows, given):
    """``rows`` with the speed ``engine`` predicts for each: measurements whose answer is known."""
    out = []
    for r in rows:
        e = deployment(r, given)
        out.append(MeasuredRow(**{**r.__dict__, "tokens_per_s": predict(e, {"llama.cpp": engine})["predicted_tps"]}))
    return out


def test_one_cpu_bound_row_recovers_the_cpu_weight_efficiency():
    truth = get_engine("llama.cpp").with_figure("cpu_weight_efficiency.default", 0.3, "estimate", "test")
    given = Given("none", HOST, model="qwen3-30b-a3b")
    rows = _measured_with(truth, [row(model_file=None)], given)
    cal = calibrate(rows, given, "t")
    assert list(cal.figures) == ["cpu_weight_efficiency.default"]  # one row, one figure
    assert cal.figures["cpu_weight_efficiency.default"] == pytest.approx(0.3, rel=0.02)
    assert abs(cal.rows[0]["ln_error_after"]) < 0.01
    assert cal.engine.calibration["rows"] == 1 and "published" in cal.engine.calibration["basis"]


def test_never_more_figures_than_rows_and_threads_only_when_they_differ():
    base = get_engine("llama.cpp")
    given = Given("none", HOST)
    one = [deployment(row(), given)]
    assert len(choose(one, base)[0]) == 1
    same = [deployment(row(depth=d), given) for d in (0, 512)]
    assert [k for k, _, _ in choose(same, base)[0]] == ["cpu_weight_efficiency.default"]
    differ = [deployment(row(threads=t), given) for t in (1, 8)]
    assert [k for k, _, _ in choose(differ, base)[0]] == ["cpu_weight_efficiency.default", "cpu_kernel_gbs"]


def test_rows_at_two_thread_counts_recover_a_thread_rate():
    from moesim.sim.calibrate import with_thread_rate

    # 4 GB/s of weights a thread: 2 threads are bound by the kernels, 16 by the memory (at an
    # efficiency of 0.5): the two rows determine both figures. (At thread counts where the
    # host's per-core bandwidth also scales with threads, they would not.)
    truth = with_thread_rate(get_engine("llama.cpp").with_figure("cpu_weight_efficiency.default", 0.5), 4.0, "test")
    given = Given("none", HOST)
    rows = _measured_with(truth, [row(threads=t) for t in (2, 16)], given)
    cal = calibrate(rows, given, "t")
    assert cal.figures["cpu_kernel_gbs"] == pytest.approx(4.0, rel=0.03)
    assert cal.figures["cpu_weight_efficiency.default"] == pytest.approx(0.5, rel=0.03)
    assert max(abs(r["ln_error_after"]) for r in cal.rows) < 0.02
    q8 = cal.engine.cpu_kernel_gmacs["q8_0"]
    assert q8.kind == "fitted" and q8.value == pytest.approx(4.0 / 1.0625, rel=0.03)  # written for every format


def test_gpu_bound_rows_fit_the_gpu_figure():
    truth = get_engine("llama.cpp").with_figure("gpu_weight_efficiency.default", 0.5, "estimate", "test")
    given = Given("rtx4090", HOST, model="qwen3-30b-a3b")
    rows = _measured_with(truth, [row(model_file=None, n_gpu_layers=99, threads=None)], given)
    cal = calibrate(rows, given, "t")
    assert list(cal.figures) == ["gpu_weight_efficiency.default"]
    assert cal.figures["gpu_weight_efficiency.default"] == pytest.approx(0.5, rel=0.03)


def test_prefill_rows_are_listed_not_dropped():
    given = Given("none", HOST)
    rows = [row(), row(where="run.json[1]", test="prefill", n_gen=0, n_prompt=512, tokens_per_s=100.0)]
    cal = calibrate(rows, given, "t")
    assert cal.unused == [("run.json[1]", "a prefill test: moesim calibrates decode speed")]
    with pytest.raises(MoesimError, match="no decode rows"):
        calibrate(rows[1:], given, "t")


def test_rows_of_two_engines_are_refused():
    with pytest.raises(MoesimError, match="several engines"):
        calibrate([row(), row(engine="ik_llama.cpp")], Given("none", HOST), "t")


def test_leave_one_row_out_predicts_each_row_from_the_others():
    truth = get_engine("llama.cpp").with_figure("cpu_weight_efficiency.default", 0.4, "estimate", "test")
    given = Given("none", HOST)
    rows = _measured_with(truth, [row(depth=d) for d in (0, 1024, 4096)], given)
    entries = [deployment(r, given) for r in rows]
    cal = calibrate_entries(entries, get_engine("llama.cpp"), "three rows")
    assert len(cal.loro) == 3 and max(abs(x) for x in cal.loro) < 0.02  # one figure explains every row


def test_cli_round_trip_writes_profiles_that_whatif_answers_with(tmp_path):
    csv = tmp_path / "mine.csv"
    csv.write_text("engine,model,expert_dtype,threads,prompt_len,tokens_per_s\n"
                   "llama.cpp,qwen3-30b-a3b,q4_k_m,16,0,20.5\n"
                   "llama.cpp,qwen3-30b-a3b,q4_k_m,16,4096,17.9\n")
    r = in_process("fit", "--measured", str(csv), "--host", HOST, "--out", str(tmp_path / "box"))
    assert r.returncode == 0, r.stderr
    assert "cpu_weight_efficiency" in r.stdout and "leave one row out" in r.stdout
    eng = load_engine(tmp_path / "box" / "engine.toml")
    fitted = eng.cpu_weight_efficiency["q4_k"] if "q4_k" in eng.cpu_weight_efficiency else \
        eng.cpu_weight_efficiency["default"]
    assert fitted.kind == "fitted" and "mine.csv" in fitted.source
    assert eng.calibration["rows"] == 2
    assert tomllib.loads((tmp_path / "box" / "host.toml").read_text())["name"]
    w = in_process("whatif", "--model", MODEL, "--expert-dtype", "q4_k_m", "--hw", "none", "--engine",
                   str(tmp_path / "box" / "engine.toml"), "--host", str(tmp_path / "box" / "host.toml"),
                   "--threads", "16", "--tokens", "8", "--jobs", "1", "--json")
    assert w.returncode == 0, w.stderr
    out = json.loads(w.stdout)["rows"][0]
    assert out["range_basis"].startswith("calibrated on 2 rows of mine.csv")
    assert out["tokens_per_s"] == pytest.approx(20.5, rel=0.05)  # the calibrated machine, at the first row's setting
    assert math.isclose(out["tokens_per_s_low"], out["tokens_per_s"] * eng.calibration["low"], rel_tol=1e-9)


@pytest.mark.parametrize("args, words", [
    (("fit",), "TRACE"),
    (("fit", "x.npz", "--measured", "y.csv"), "not both"),
    (("fit", "x.npz", "--host", "ryzen-7950x"), "--host"),
])
def test_fit_refuses_what_it_cannot_do_in_one_line(tmp_path, args, words):
    one_line_error(in_process(*args, cwd=tmp_path), words)


MEASURED = Path(__file__).parent / "data" / "measured"


def _two_layer_config(folder: Path) -> Path:
    """The Hugging Face config bench/bench_llamacpp.py's 2-layer checkpoints were made from."""
    config = json.loads((Path(__file__).parent / "data" / "configs" / "Qwen3-30B-A3B" / "config.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "vocab_size": 1024}))
    return folder


def test_a_real_llama_bench_output_round_trips(tmp_path):
    """The committed llama-bench JSON (llama.cpp 0c1e570, two thread counts) calibrates; its
    GGUF file is not in the repository, so --model names the checkpoint it was converted from
    (bench/bench_llamacpp.py's: Qwen3-30B-A3B's config with 2 layers and a 1,024-token
    vocabulary), which wins over the file the output names, and the file type the output
    prints (Q4_K - Medium) is read: its 0.71 GiB and 1.25 B parameters match the checkpoint's."""
    _two_layer_config(tmp_path / "hf")
    r = in_process("fit", "--measured", str(MEASURED / "mybox-2L-q4_k_m.json"), "--model", str(tmp_path / "hf"),
                   "--host", HOST, "--out", str(tmp_path / "box"))
    assert r.returncode == 0, r.stderr
    assert "mybox-2L-q4_k_m.json[0]: all-resident, none" in r.stdout and "-t 1" in r.stdout and "-t 2" in r.stdout
    assert "file type q4_k_m" in r.stdout
    eng = load_engine(tmp_path / "box" / "engine.toml")
    assert eng.calibration["rows"] == 2 and "mybox-2L-q4_k_m.json" in eng.calibration["basis"]


def test_an_output_naming_a_model_that_is_not_here_asks_for_model(tmp_path):
    rows = json.loads((MEASURED / "mybox-2L-q4_k_m.json").read_text())
    for row in rows:
        row["model_filename"] = "/nowhere/model.gguf"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(rows))
    one_line_error(in_process("fit", "--measured", str(path), "--host", HOST, cwd=tmp_path), "run.json[0]", "--model")


def test_a_vllm_latency_run_calibrates_the_gpu_side(tmp_path):
    r = in_process("fit", "--measured", str(MEASURED / "vllm_latency_0.33.0.json"), "--output-len", "128",
                   "--input-len", "32", "--batch", "1", "--hw", "h100-sxm", "--model", MODEL,
                   "--out", str(tmp_path / "v"))
    assert r.returncode == 0, r.stderr
    assert "gpu_weight_efficiency.default" in r.stdout and "-d 32" in r.stdout  # its prompt is the context
    assert not (tmp_path / "v" / "host.toml").exists()  # no host given: none written


@pytest.mark.parametrize("columns, values, words", [
    ("policy", "bogus", "unknown policy 'bogus'"),
    ("expert_dtype", "q9_z", "unknown quant 'q9_z'"),
    ("policy,cpu_layers", "cpu-static,abc", "cpu_layers 'abc'"),
    ("hw", "rtx9999", "unknown hardware profile 'rtx9999'"),
])
def test_a_plain_csv_row_moesim_cannot_resolve_is_one_line_naming_it(tmp_path, columns, values, words):
    csv = tmp_path / "mine.csv"
    csv.write_text(f"engine,model,{columns},tokens_per_s\nllama.cpp,{MODEL},{values},10\n")
    line = one_line_error(in_process("fit", "--measured", str(csv), "--host", HOST, "--hw", "rtx4090",
                                     "--out", str(tmp_path / "o"), cwd=tmp_path), words)
    assert "mine.csv:2" in line and not (tmp_path / "o").exists()
