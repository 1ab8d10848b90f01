"""`moesim fit --measured` reads every field the engine printed and writes only a fit that
explains its rows (issue "Calibration a user can trust", items 1-2): the file type in
llama.cpp's model description, the size and parameter count checked against --model, a GPU
build's row refused without --hw, vLLM's batch, --expert-dtype, and a fit that ends at the
end of its range refused unless --keep (then written without a range of its own)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from cli_run import in_process, one_line_error

from moesim.engines import load_engine
from moesim.errors import MoesimError
from moesim.measured import MeasuredRow, read_measured
from moesim.quant_recipes import FTYPE_NAMES, RECIPES, canonical, file_type_in, has_recipe
from moesim.sim.calibrate import Given, deployment
from moesim.sim.published import predict

MEASURED = Path(__file__).parent / "data" / "measured"
HOST = "ryzen-7950x"

# llama-bench's markdown as it prints it for Qwen3-30B-A3B Q4_K_M on a CPU build (the issue's
# row; the speed is a stand-in), and as a CUDA build prints the same file with -ngl 99.
PASTED = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CPU        |       8 |           tg128 |         {tps} ± 0.12 |

build: 5e5f6c2 (6310)
"""
CUDA = """\
| model                          |       size |     params | backend    | ngl |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | --: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CUDA       |  99 |           tg128 |        182.45 ± 0.91 |

build: 5e5f6c2 (6310)
"""


def _write(tmp_path: Path, text: str, name: str = "pasted.md") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_name_llama_cpp_prints_is_read_case_insensitively():
    for printed, key in FTYPE_NAMES.items():
        assert file_type_in(f"qwen3moe 30B.A3B {printed}") == (printed, key)
        assert canonical(printed.upper()) == canonical(printed.lower()) == key
    assert file_type_in("qwen3moe 30B.A3B Q2_K - Small")[1] == "q2_k_s"  # the longest name wins over "Q2_K"
    assert file_type_in("qwen3moe ?B") is None and file_type_in(None) is None
    assert canonical("Q4_K_M") == canonical("q4_k - medium") == "q4_k_m"
    assert canonical("UD-Q4_K_XL") == "q4_k_m"  # a dynamic quant: its base type
    # the file types a user most often holds are priced whole
    for key in ("q4_k_m", "q8_0", "mxfp4_moe", "iq4_xs", "bf16", "q6_k"):
        assert has_recipe(key), key
    assert not has_recipe("q3_k_m") and "q3_k_m" not in RECIPES


def test_a_pasted_table_is_priced_as_the_file_it_names(tmp_path):
    (row,) = read_measured(_write(tmp_path, PASTED.format(tps="24.10")))
    assert (row.model_bytes, row.model_params) == (round(17.28 * 2**30), 30_530_000_000)
    e = deployment(row, Given(host=HOST, model="qwen3-30b-a3b"))
    assert e.setting["quant"] == "q4_k_m" and e.setting["hw"] == "none"
    bf16 = deployment(row, Given(host=HOST, model="qwen3-30b-a3b", expert_dtype="q4_k_m"))
    assert bf16.setting == e.setting  # --expert-dtype saying what the table says: the same
    as_q4 = predict(e)["predicted_tps"]
    e.setting.pop("quant")
    as_bf16 = predict(e)["predicted_tps"]
    assert as_q4 > 2.5 * as_bf16  # the catalogue's bf16 would be about a third of the file's speed


def test_a_fitted_pasted_row_is_written_and_predicts_it(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="24.10"))
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST,
                   "--out", str(tmp_path / "box"))
    assert r.returncode == 0, r.stderr
    assert "file type q4_k_m" in r.stdout
    # 8 of the host's 16 cores and 3% slower than predicted: the memory's share, not a thread's rate
    assert "fitted: cpu_weight_efficiency.default" in r.stdout
    eng = load_engine(tmp_path / "box" / "engine.toml")
    assert eng.calibration is not None


@pytest.mark.parametrize("model, words", [
    ("qwen3-235b-a22b", ["17.28 GiB", "qwen3-235b-a22b as q4_k_m", "--model"]),
    ("gpt-oss-20b", ["17.28 GiB", "gpt-oss-20b", "--model"]),
])
def test_the_wrong_model_is_refused_naming_both(tmp_path, model, words):
    path = _write(tmp_path, PASTED.format(tps="24.10"))
    r = in_process("fit", "--measured", str(path), "--model", model, "--host", HOST, "--out", str(tmp_path / "o"))
    one_line_error(r, "pasted.md:3", *words)
    assert not (tmp_path / "o").exists()


def test_expert_dtype_that_contradicts_the_table_is_refused(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="24.10"))
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST, "--expert-dtype",
                   "bf16", "--out", str(tmp_path / "o"))
    one_line_error(r, "Q4_K - Medium", "--expert-dtype says bf16")


def test_a_file_type_without_a_recipe_asks_for_the_nearest(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="24.10").replace("Q4_K - Medium", "Q3_K - Medium"))
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST,
                   "--out", str(tmp_path / "o"))
    one_line_error(r, "Q3_K - Medium", "--expert-dtype")


def test_a_gpu_build_row_without_hw_is_refused_never_priced_on_the_cpu(tmp_path):
    path = _write(tmp_path, CUDA)
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--out", str(tmp_path / "o"))
    one_line_error(r, "CUDA build", "-ngl 99", "--hw")
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--hw", "rtx4090",
                   "--out", str(tmp_path / "o"))
    assert "all-resident, rtx4090" in r.stdout, r.stderr  # with the GPU named: all on it, as -ngl 99 says


def test_a_batch_of_four_is_priced_as_four_sequences(tmp_path):
    args = dict(where="v.json", engine="vllm", test="decode", tokens_per_s=50.0, n_gen=128, n_prompt=0,
                model_file="qwen3-30b-a3b")
    given = Given("h100-sxm")
    one = deployment(MeasuredRow(**args), given)
    four = deployment(MeasuredRow(**args, batch=4), given)
    assert "batch" not in one.setting and four.setting["batch"] == 4
    t1, t4 = predict(one)["predicted_tps"], predict(four)["predicted_tps"]
    assert t4 < t1  # a sequence of a batch of four decodes more slowly than one alone (more experts a step)
    r = in_process("fit", "--measured", str(MEASURED / "vllm_latency_0.33.0.json"), "--output-len", "128",
                   "--input-len", "32", "--batch", "4", "--hw", "h100-sxm", "--model", "qwen3-30b-a3b",
                   "--out", str(tmp_path / "v"))
    assert "batch 4" in r.stdout, r.stdout + r.stderr


def test_expert_dtype_prices_an_output_that_names_no_file_type(tmp_path):
    r = in_process("fit", "--measured", str(MEASURED / "vllm_latency_0.33.0.json"), "--output-len", "128",
                   "--input-len", "32", "--batch", "1", "--hw", "h100-sxm", "--model", "qwen3-30b-a3b",
                   "--expert-dtype", "FP8-BLOCK128", "--out", str(tmp_path / "v"))
    assert "file type fp8-block128" in r.stdout, r.stdout + r.stderr


def test_a_fit_that_ends_at_its_bound_is_not_written_unless_kept(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="95.00"))  # 4x what the host's memory can give for this file
    out = tmp_path / "box"
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST, "--out", str(out))
    assert r.returncode == 1 and not out.exists(), r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert "end of its range" in line and "faster" in line and "file type q4_k_m" in line and "--keep" in line
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST, "--out", str(out),
                   "--keep")
    assert r.returncode == 0, r.stderr
    data = tomllib.loads((out / "engine.toml").read_text())
    assert "calibration" not in data  # kept, but no answer's range narrows because of it
    assert "kept with --keep" in data["description"]
    w = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "none", "--host", HOST, "--engine",
                   str(out / "engine.toml"), "--json")
    assert w.returncode == 0, w.stderr
    basis = {row["range_basis"] for row in json.loads(w.stdout)["rows"]}
    assert not any("calibrated" in b for b in basis), basis


def test_a_second_fit_into_one_folder_replaces_the_set(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="24.10"))
    out = tmp_path / "box"
    assert in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST,
                      "--out", str(out)).returncode == 0
    assert (out / "host.toml").exists()
    v = in_process("fit", "--measured", str(MEASURED / "vllm_latency_0.33.0.json"), "--output-len", "128",
                   "--input-len", "32", "--batch", "1", "--hw", "h100-sxm", "--model", "qwen3-30b-a3b",
                   "--out", str(out))
    assert v.returncode == 0, v.stderr
    assert not (out / "host.toml").exists()  # the first run's host is not this calibration's


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1e3"])
def test_a_layer_count_in_other_digits_is_one_line(tmp_path, value):
    path = _write(tmp_path, "model,hw,host,engine,policy,cpu_layers,threads,tokens_per_s\n"
                            f"qwen3-30b-a3b,rtx4090,{HOST},llama.cpp,cpu-static,{value},8,20\n", "runs.csv")
    r = in_process("fit", "--measured", str(path), "--out", str(tmp_path / "o"))
    line = one_line_error(r, "runs.csv")
    assert re.search("cpu_layers", line), line


def test_split_mode_row_is_refused_on_several_gpus():
    row = MeasuredRow(where="r.md:3", engine="llama.cpp", test="decode", tokens_per_s=20.0, n_gen=128,
                      model_file="qwen3-30b-a3b", n_gpu_layers=99, split_mode="row", backend="CUDA")
    with pytest.raises(MoesimError, match="-sm row"):
        deployment(row, Given("2xrtx4090", HOST))


@pytest.mark.parametrize("threads, tps, figure", [(4, 2.0, "cpu_kernel_gbs"), (4, 200.0, "cpu_weight_efficiency.default"),
                                                 (16, 2.0, "cpu_weight_efficiency.default")])
def test_one_cpu_row_fits_what_binds_it(threads, tps, figure):
    """A row on fewer threads than the host's cores that ran much slower than predicted is bound
    by what its threads' kernels decode (one thread draws a fraction of a socket's bandwidth); a
    row faster than predicted, or a few percent slower, or on every core, by the memory's share."""
    from moesim.engines import get_engine
    from moesim.sim.calibrate import choose

    r = MeasuredRow(where="r.md:3", engine="llama.cpp", test="decode", tokens_per_s=tps, n_gen=128,
                    model_file="qwen3-30b-a3b", n_gpu_layers=0, threads=threads, backend="CPU")
    figures, bounds = choose([deployment(r, Given("none", HOST))], get_engine("llama.cpp"))
    assert bounds[0].startswith("CPU compute") and [k for k, _, _ in figures] == [figure]


def test_a_range_from_many_identical_rows_holds_its_prediction_and_has_width():
    """Nine rows of one deployment, each exactly what a profile predicts: leave one row out errs by
    nothing, and the range once had zero width; it holds the prediction and is at least +-15%."""
    from moesim.engines import get_engine
    from moesim.sim.calibrate import MISS, calibrate_entries

    r = MeasuredRow(where="r.md:3", engine="llama.cpp", test="decode", tokens_per_s=1.0, n_gen=128,
                    model_file="qwen3-30b-a3b", n_gpu_layers=0, threads=16, backend="CPU")
    e = deployment(r, Given("none", HOST))
    e.measurement["decode_tps"] = predict(e)["predicted_tps"]
    cal = calibrate_entries([e] * 9, get_engine("llama.cpp"), "nine rows")
    low, high = cal.engine.calibration["low"], cal.engine.calibration["high"]
    assert low <= 1 / (1 + MISS) + 1e-9 and high >= 1 + MISS - 1e-9


def test_a_profile_calibrated_from_a_dated_build_keeps_its_date(tmp_path):
    path = _write(tmp_path, PASTED.format(tps="24.10"))
    r = in_process("fit", "--measured", str(path), "--model", "qwen3-30b-a3b", "--host", HOST, "--engine",
                   "llama.cpp@2026-02-05", "--out", str(tmp_path / "box"))
    assert r.returncode == 0, r.stderr
    assert load_engine(tmp_path / "box" / "engine.toml").label == "llama.cpp@2026-02-05"
