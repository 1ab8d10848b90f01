"""The stranger cases of issue "The first hour, round 6" that are not about fit's inputs
(tests/test_fit_inputs.py) or --hw this (tests/test_hw_this.py): file-type names in every
spelling, a dynamic quant said to be priced as its base type, the right missing option asked
for, and the file's own values named as the file's."""

from __future__ import annotations

import json

import pytest
from cli_run import in_process, one_line_error

from moesim.quant_recipes import approximation_note, canonical, is_format

HOST = "ryzen-7950x"


@pytest.mark.parametrize("name", ["Q4_K", "IQ1_M", "BF16", "MXFP4_MOE", "F16", "q4_k_m", "Q4_K_M", "Q4_K - Medium",
                                  "UD-Q4_K_XL"])
def test_file_type_names_are_taken_in_every_spelling(name):
    assert is_format(name), name
    assert canonical(name) == canonical(name.lower()) == canonical(name.upper())


def test_whatif_takes_an_upper_case_file_type_and_says_how_a_dynamic_quant_is_priced(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "UD-Q4_K_XL,Q4_K_M", "--hw", "rtx4090",
                   "--host", HOST, "--engine", "llama.cpp", "--policy", "cpu-static", "--tokens", "8", "--jobs", "1",
                   "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert approximation_note("UD-Q4_K_XL") in out["notes"]
    by_dtype: dict[str, list[float]] = {}
    for row in out["rows"]:
        by_dtype.setdefault(row["expert_dtype"], []).append(round(row["tokens_per_s"], 9))
    assert len(by_dtype) == 2 and len({tuple(sorted(v)) for v in by_dtype.values()}) == 1  # one recipe, said so


def test_a_gpu_only_engine_without_hw_is_asked_for_hw_not_host(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("model,engine,policy,test,n_gen,tokens_per_s\nqwen3-30b-a3b,vllm,all-resident,decode,128,120\n")
    one_line_error(in_process("fit", "--measured", str(path), "--out", str(tmp_path / "o")), "runs.csv:2",
                   "vllm runs on GPUs only", "--hw")


def test_a_file_without_a_gpu_names_its_policy_as_the_files(tmp_path):
    """A plain CSV row on hw none is all on the CPU whatever policy it names (the documented
    plain_runs.csv says cpu-static); a copy policy there is refused naming the file's values."""
    path = tmp_path / "runs.csv"
    path.write_text("model,hw,host,engine,policy,cpu_layers,threads,tokens_per_s\n"
                    f"qwen3-30b-a3b,none,{HOST},llama.cpp,cpu-static,48,16,20\n")
    r = in_process("fit", "--measured", str(path), "--out", str(tmp_path / "o"))
    assert "runs.csv:2: all-resident, none" in r.stdout, r.stdout + r.stderr
    path.write_text("model,hw,host,engine,policy,threads,tokens_per_s\n"
                    f"qwen3-30b-a3b,none,{HOST},llama.cpp,on-demand,16,20\n")
    line = one_line_error(in_process("fit", "--measured", str(path), "--out", str(tmp_path / "o")),
                          "the file's policy on-demand on hw none")
    assert "--hw" not in line
