"""The stranger cases of issue "The first hour, round 6" that are not about fit's inputs
(tests/test_fit_inputs.py) or --hw this (tests/test_hw_this.py): file-type names in every
spelling, a dynamic quant said to be priced as its base type, the right missing option asked
for, and the file's own values named as the file's."""

from __future__ import annotations

import json

import pytest
from cli_run import ROOT, in_process, one_line_error

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


def test_an_engines_builds_are_listed(tmp_path):
    r = in_process("hw", "llama.cpp", "--engines", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (doc,) = json.loads(r.stdout)
    assert [b["before"] for b in doc["builds"]] == ["2026-02-16", "2026-02-11", "2025-05-27"]
    r = in_process("hw", "llama.cpp", "--engines", cwd=tmp_path, env={"COLUMNS": "200"})
    assert "llama.cpp's builds: --engine llama.cpp@YYYY-MM-DD" in r.stdout


def test_a_llama_cpp_release_number_is_its_date(tmp_path):
    """``llama.cpp@b6000``: the release's date from the dated releases (exact where listed,
    interpolated between two), then priced as that day's build; outside them, or for an engine
    that does not number its builds so, one line."""
    from moesim.engines import LLAMA_CPP_RELEASES, get_engine, release_date

    n, day, _ = LLAMA_CPP_RELEASES[8]
    assert release_date(n) == day
    assert "2025-05-27" < release_date(5500) < release_date(5600) < "2025-07-10"
    assert get_engine("llama.cpp@b5500").as_of == release_date(5500)
    # a build older than the 2025-05-27 change has that change's older figures; one after it does not
    assert get_engine("llama.cpp@b5300").figures != get_engine("llama.cpp@b5857").figures
    r = in_process("hw", "llama.cpp@b8000", "--engines", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["description"].endswith(f"(a build from {release_date(8000)})")
    one_line_error(in_process("hw", "llama.cpp@b99999", "--engines", cwd=tmp_path), "b99999 is outside",
                   "releases/tag/b99999")
    one_line_error(in_process("hw", "ktransformers@b6000", "--engines", cwd=tmp_path), "ktransformers")


@pytest.mark.parametrize("app", ["ollama", "LM-Studio", "lmstudio"])
def test_ollama_and_lm_studio_are_the_llama_cpp_they_bundle(tmp_path, app):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--hw", "rtx4090", "--host", HOST,
                   "--engine", app, "--policy", "all-resident", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert any(n.startswith(f"{app.lower()} runs the llama.cpp build it bundles") for n in out["notes"])
    (row,) = out["rows"]
    ref = in_process("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--hw", "rtx4090", "--engine",
                     "llama.cpp", "--policy", "all-resident", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    (same,) = json.loads(ref.stdout)["rows"]
    assert row["tokens_per_s"] == same["tokens_per_s"] and row["range_basis"] == same["range_basis"]


def test_the_answer_says_the_memory_a_placement_needs_and_the_largest_context():
    """The memory the deployment needs on each device and the largest context that fits, as
    the answer prints them beside the engine's command: the context found is the last that fits."""
    from moesim.hardware import get_machine
    from moesim.memory import layout_bytes
    from moesim.models import get_model
    from moesim.policy import get_policy
    from moesim.quant_recipes import store_as
    from moesim.setting import Setting
    from moesim.sim.answer import largest_context, memory_words
    from moesim.sim.static import layout_for

    spec, machine = store_as(get_model("gpt-oss-120b"), "mxfp4_moe"), get_machine("2xrtx5090")
    layout = layout_for(get_policy("cpu-static"), spec, machine, Setting(cpu_layers=2), batch=1, context=192)
    mem = [x * 1e9 for x in machine.device_memory_gb()]
    ctx = largest_context(spec, layout, mem, 1)
    assert 0 < ctx < 1 << 24
    assert all(b <= m for b, m in zip(layout_bytes(spec, layout, 1, ctx).gpu, mem))
    assert not all(b <= m for b, m in zip(layout_bytes(spec, layout, 1, ctx + 1).gpu, mem))
    words = memory_words(spec, layout, machine, 1, 192)
    assert words.startswith("memory: rtx5090 0 ") and "rtx5090 1 " in words and f"{ctx:,} tokens" in words
    assert "does not fit" not in words
    assert f"a {ctx + 1:,}-token context does not fit this placement: at most {ctx:,} tokens" in memory_words(
        spec, layout, machine, 1, ctx + 1)


def test_the_printed_context_is_the_users_or_the_engines_never_the_prompt():
    """``--ctx N`` is the printed ``-c`` / ``--max-model-len`` and the memory's context; without
    it the command leaves the engine's default and says so (the timed prompt is never the context)."""
    from moesim.sim.answer import Timed, invocation_of

    row = {"family": "all-resident", "policy": "all-resident", "expert_dtype": "q4_k_m", "base_model": "qwen3-30b-a3b",
           "hw": "rtx4090", "host": "-", "batch": 1, "prompt_len": 4096, "tokens": 8, "resident_experts": 0,
           "cpu_layers": "-", "gpu_layers": "-", "offload_gib": "-", "placement": "-"}
    for engine, flag in (("llama.cpp", "-c"), ("vllm", "--max-model-len")):
        inv, _ = invocation_of(row, engine, Timed({}, {}))
        assert flag not in inv.args and f"{engine}'s default" in inv.note and "4104" not in inv.note
        inv, _ = invocation_of(row, engine, Timed({}, {}, context=32768))
        assert inv.args[inv.args.index(flag) + 1] == "32768" and "at 32,768 tokens" in inv.note


def test_an_empty_sweep_says_its_true_cause(tmp_path):
    """cpu-on-miss with --cache-gib 0 has no configuration because it needs a cache, not because
    nothing fits in 48 GB; hot-experts without a GPU does not run, rather than "fits in no GB"."""
    one_line_error(in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--host", "epyc-7742",
                              "--policy", "cpu-on-miss", "--cache-gib", "0", "--tokens", "8", "--jobs", "1",
                              cwd=tmp_path), "cpu-on-miss needs a device expert cache", "--cache-gib 0")
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--host", "epyc-7742", "--policy",
                   "cpu-on-miss,cpu-static", "--cache-gib", "0", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {row["policy"] for row in out["rows"]} == {"cpu-static"}
    assert any("cpu-on-miss needs a device expert cache" in n for n in out["notes"])
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "none", "--host", "epyc-7742", "--policy",
                   "hot-experts", "--tokens", "8", "--jobs", "1", cwd=tmp_path, env={"COLUMNS": "200"})
    assert "on none: no configuration runs: without a GPU only all-resident applies" in r.stdout, r.stdout
    assert "in no GB" not in r.stdout


def test_a_built_in_engine_without_arguments_is_not_told_to_add_runs_as(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "h100-sxm", "--engine", "sglang", "--policy",
                   "all-resident", "--tokens", "8", "--jobs", "1", cwd=tmp_path, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "not sglang's" in r.stdout and "runs_as" not in r.stdout, r.stdout


def test_a_lighter_file_type_predicted_slower_says_why():
    """A file type with fewer bytes a weight predicted slower than a heavier one (IQ1_S against
    Q8_0 on a CPU) gets a note naming the engine's kernel figures for both; the heavier one
    predicted slower, as bytes say it should be, gets none."""
    from moesim.engines import get_engine
    from moesim.sim.answer import lighter_but_slower

    def row(dtype, tpot):
        return {"base_model": "qwen3-30b-a3b", "hw": "none", "host": "ryzen-7950x", "family": "all-resident",
                "expert_dtype": dtype, "tpot_ms": tpot, "fits": True, "bound": "CPU compute"}

    eng = get_engine("llama.cpp")
    (note,) = lighter_but_slower([row("iq1_s", 87.7), row("q8_0", 68.7)], eng)
    assert note.startswith("iq1_s (1.65 bits a weight) is predicted slower than q8_0 (8.5)")
    assert f"iq1_s reach {eng.weight_efficiency('cpu', 'iq1_s'):.2g} (fitted)" in note
    assert lighter_but_slower([row("iq1_s", 40.0), row("q8_0", 68.7)], eng) == []


def test_the_engine_is_a_whatif_axis(tmp_path):
    """``--engine A,B`` sweeps the same deployments under each engine: the rows carry their
    engine, each engine gets its own deployment answer and arguments, the best is over all; an
    engine named twice (however spelled) or a resumable --rows file with several is one line."""
    args = ("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--hw", "rtx4090", "--host", HOST,
            "--policy", "all-resident,cpu-static", "--cpu-layers", "24", "--tokens", "8", "--jobs", "1")
    r = in_process(*args, "--engine", "llama.cpp,ik_llama.cpp", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {x["engine"] for x in out["rows"]} == {"llama.cpp", "ik_llama.cpp"}
    assert {f["row"]["engine"] for d in out["deployment"] for f in d["families"] if f["row"]} == {"llama.cpp", "ik_llama.cpp"}
    assert out["best"]["tpot_ms"] == min(x["tpot_ms"] for x in out["rows"] if x["fits"])
    r = in_process(*args, "--engine", "llama.cpp,ik_llama.cpp", cwd=tmp_path, env={"COLUMNS": "200"})
    assert "-- with llama.cpp --" in r.stdout and "-- with ik_llama.cpp --" in r.stdout
    builtin = str(ROOT / "hwprofiles" / "engines" / "llama.cpp.toml")  # the built-in file, named by path
    one_line_error(in_process(*args, "--engine", f"llama.cpp,{builtin}", cwd=tmp_path), "same engine")
    one_line_error(in_process(*args, "--engine", "llama.cpp,vllm", "--rows", "r.csv", cwd=tmp_path), "--rows")


def test_an_engines_policy_names_are_checked_where_policies_are_known(tmp_path):
    """The engine layer keeps its profile's policy names as strings (it never imports the
    policies: no import circle); moesim.policy resolves them, aliases included, and a name no
    policy has is one line naming the engine, when a run uses it."""
    from dataclasses import replace

    from moesim.engines import builtin_engines, get_engine
    from moesim.errors import MoesimError
    from moesim.policy import engine_policies, runs_on

    for name in builtin_engines():  # the shipped profiles name registered policies, as written
        eng = get_engine(name)
        assert engine_policies(eng) == eng.policies
    llama = get_engine("llama.cpp")
    assert runs_on(replace(llama, policies=("resident",)), ["all-resident", "on-demand"]) == (
        ["all-resident"], "llama.cpp does not run on-demand (it runs all-resident): left out")
    with pytest.raises(MoesimError, match="engine llama.cpp: its policies: unknown policy 'yolo'"):
        runs_on(replace(llama, policies=("yolo",)), ["all-resident"])


def test_ctx_without_an_engine_changed_nothing_and_says_so(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--policy", "all-resident", "--ctx", "4096",
                   "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--ctx was given, but without --engine no command is printed: it changed nothing" in json.loads(r.stdout)["notes"]


def test_two_builds_of_one_engine_are_not_one_axis(tmp_path):
    """Rows name their engine, not its build: two builds in one --engine axis would be rows no
    one could tell apart, so it is one line."""
    one_line_error(in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--tokens", "4", "--jobs", "1",
                              "--engine", "llama.cpp,llama.cpp@2025-01-01", cwd=tmp_path), "builds of one engine")
