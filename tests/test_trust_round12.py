"""Issue "What the user sees is true", a stranger's round 12 (a fresh clone, 308 new hostile
invocations): each bad ending it found, held here (docs/robustness.md, round 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cli_run import ENV, ROOT, by_subprocess, in_process, one_line_error
from gguf_files import qwen3moe_gguf


def _gpu_file(tmp_path, name: str, **figures: float):
    """A copy of the built-in RTX 3090 profile named ``name``, some figures changed."""
    text = (ROOT / "hwprofiles" / "rtx3090.toml").read_text().replace('name = "rtx3090"', f'name = "{name}"')
    for key, value in figures.items():
        start = text.index(f"{key} = {{ value = ") + len(f"{key} = {{ value = ")
        text = text[:start] + str(value) + text[text.index(",", start):]
    path = tmp_path / f"{name}-{len(figures)}.toml"
    path.write_text(text)
    return path


def _args(out: dict) -> list[str]:
    return [" ".join(f["invocation"]["args"]) for d in out["deployment"] for f in d["families"] if f.get("invocation")]


def test_a_gpu_file_with_an_engine_gets_its_arguments_not_an_unknown_profile(tmp_path):
    """`--hw mygpu.toml --engine llama.cpp` was refused ("unknown hardware profile 'mygpu'"): the
    arguments looked the machine up by the row's name."""
    gpu = _gpu_file(tmp_path, "mygpu")
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", gpu, "--host", "epyc-7742", "--engine", "llama.cpp",
                   "--policy", "cpu-static,all-resident", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any(a.startswith("llama-server") for a in _args(json.loads(r.stdout)))


def test_the_arguments_spell_the_gpu_file_the_row_ran_not_the_built_in_of_its_name(tmp_path):
    """A file named like a built-in (rtx3090, 12 GB here) beside an RTX 5090: the rows were timed
    on the 12 GB card and the split printed for the built-in 24 GB one (15 GB on the 12 GB card)."""
    base = ["whatif", "--model", "qwen3-30b-a3b", "--host", "ryzen-9950x", "--engine", "llama.cpp",
            "--policy", "gpu-layers,cpu-static", "--tokens", "4", "--jobs", "1", "--json"]

    def args(hw: str) -> list[str]:
        r = in_process(*base, "--hw", hw, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return _args(json.loads(r.stdout))

    same_name = args(f"rtx5090+{_gpu_file(tmp_path, 'rtx3090', device_memory_gb=12.0)}")
    own_name = args(f"rtx5090+{_gpu_file(tmp_path, 'mygpu', device_memory_gb=12.0)}")
    assert same_name and same_name == own_name, (same_name, own_name)  # the name changes nothing
    assert same_name != args("rtx5090+rtx3090")  # the memory does


def test_a_trace_of_a_model_outside_the_catalogue_gets_its_arguments(tmp_path):
    gguf = qwen3moe_gguf(tmp_path / "m.gguf")[0]
    assert in_process("synth", "--model", gguf, "--tokens", "4", "--out", "t.npz", cwd=tmp_path).returncode == 0
    # A process of its own: this one knows the GGUF's model by name since synth read it.
    r = by_subprocess("whatif", "--trace", "t.npz", "--hw", "rtx3090", "--engine", "llama.cpp", "--policy",
                      "all-resident", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any(a.startswith("llama-server") for a in _args(json.loads(r.stdout)))


def test_the_deployment_answer_covers_every_machine_of_the_sweep(tmp_path):
    """Each GPU's own link differs: only the machines at the first machine's link got an answer."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000,h100-sxm,rtx5090", "--engine", "llama.cpp",
                   "--policy", "all-resident,cpu-static", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {d["hw"] for d in json.loads(r.stdout)["deployment"]} == {"a6000", "h100-sxm", "rtx5090"}


def test_a_batch_deployments_llama_cpp_command_holds_every_sequence(tmp_path):
    """--batch 4 printed `-c 1008`, one sequence's context: llama-server's slots share -c (--ctx
    is one sequence's)."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "rtx3090", "--engine", "llama.cpp", "--policy",
                   "all-resident", "--batch", "4", "--ctx", "1008", "--tokens", "8", "--jobs", "1", "--json",
                   cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any("-np 4 -c 4032" in a for a in _args(json.loads(r.stdout))), _args(json.loads(r.stdout))


@pytest.mark.parametrize("args", [["--gpu-expert-gib", "1e12", "--policy", "hot-experts"],  # 1e308: refused (round 14)
                                  ["--offload-gib", "-0", "--policy", "weight-streaming"]])
def test_huge_and_negative_zero_budgets_are_answered(tmp_path, args):
    """1e308 GiB of hot experts was an OverflowError in a failed group; -0 GiB a row saying -0.0."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "epyc-7742", "--tokens", "4",
                   "--jobs", "1", "--json", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert rows and all(x["fits"] for x in rows) and "-0.0" not in r.stdout, rows


def test_a_negative_byte_count_in_a_trace_header_is_refused(tmp_path):
    from moesim.errors import MoesimError
    from moesim.models import get_model
    from moesim.spec import ModelSpec

    spec = get_model("olmoe-1b-7b").to_dict()
    with pytest.raises(MoesimError, match="artefact_layer_bytes must hold whole numbers of bytes >= 0"):
        ModelSpec.from_dict({**spec, "artefact_layer_bytes": [-10**12] * spec["n_layers"]})


def test_a_read_only_standard_output_is_one_line(tmp_path):
    """`moesim models 1</dev/null`: a traceback ending in EBADF, after the work."""
    with open("/dev/null") as f:
        r = subprocess.run([sys.executable, "-m", "moesim", "models"], stdout=f, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **ENV}, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("error: standard output is open for reading only: give it a file, "
                                                       "or >/dev/null to discard it"), r.stderr


@pytest.mark.parametrize("draft, words", [("dense:1e308", "at most 100000"), ("eagle:0", "above 0"),
                                          ("eagle:1001", "at most 1000")])
def test_a_draft_out_of_range_is_refused(tmp_path, draft, words):
    one_line_error(in_process("ecospec", "--model", "olmoe-1b-7b", "--gamma", "4", "--steps", "8", "--draft", draft,
                              cwd=tmp_path), words)


def test_a_selection_without_a_confidence_threshold_shows_a_dash_not_nan(tmp_path):
    r = in_process("ecospec", "--model", "olmoe-1b-7b", "--gamma", "4", "--steps", "8", "--deployment", "8xh200-tp",
                   "--selection", "ecospec:ratio", cwd=tmp_path, env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "nan" not in r.stdout.lower(), r.stdout


def test_a_misspelt_jsonl_field_is_refused_naming_the_field_meant(tmp_path):
    """`"gate"` for `"gates"`: the gates were silently dropped (0.5, 0.5 where 0.6, 0.4 were given)."""
    from moesim.models import get_model

    spec = get_model("tiny")
    lines = [json.dumps({"token": t, "layer": layer, "experts": list(range(spec.top_k)),
                         "gate": list(np.full(spec.top_k, 1 / spec.top_k))})
             for t in range(2) for layer in spec.moe_layers]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    one_line_error(in_process("import", "jsonl", "r.jsonl", "--model", "tiny", "--out", "t.npz", cwd=tmp_path),
                   "unknown field 'gate'", "did you mean 'gates'")


def test_an_empty_prompt_id_is_refused():
    from moesim.errors import MoesimError
    from moesim.executor.loading import parse_prompt_ids

    with pytest.raises(MoesimError, match="an empty item"):
        parse_prompt_ids("1,2,,3")


def test_a_control_character_in_a_gguf_name_is_not_sent_to_the_terminal(tmp_path):
    import gguf

    path = qwen3moe_gguf(tmp_path / "m.gguf")[0]
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields.get("general.name")
    if field is None:
        pytest.skip("the test GGUF has no general.name to edit")
    data = field.parts[field.data[0]]
    data[:] = np.frombuffer(("\x1b" + "x" * (len(data) - 1)).encode()[:len(data)], np.uint8)
    r = in_process("models", path, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\\u001b" not in r.stdout, r.stdout[:300]


def test_an_engine_moesim_writes_no_arguments_for_says_so(tmp_path):
    """SGLang's winner had no arguments and no word; an engine TOML (a copy of llama.cpp's, named
    llama.cpp) had no arguments at all: its profile's name picks the arguments."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--engine", "sglang", "--policy",
                   "all-resident", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    whys = [f.get("no_invocation") for d in json.loads(r.stdout)["deployment"] for f in d["families"] if f["row"]]
    assert any("not sglang's" in (w or "") for w in whys), whys
    # Round 14: a user's file is the user's even where its name is a built-in's; runs_as says whose arguments it prints.
    text = (ROOT / "hwprofiles" / "engines" / "llama.cpp.toml").read_text()
    (tmp_path / "mine.toml").write_text(text)
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "epyc-7742", "--engine", "mine.toml",
                   "--policy", "cpu-static", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert not _args(out) and all(row["engine"] == "llama.cpp (mine.toml, a user's file)" for row in out["rows"])
    top, _, rest = text.partition("\n[")
    (tmp_path / "mine.toml").write_text(f'{top}\nruns_as = "llama.cpp"\n[{rest}')
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "epyc-7742", "--engine", "mine.toml",
                   "--policy", "cpu-static", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any(a.startswith("llama-server") for a in _args(json.loads(r.stdout)))


def test_a_given_split_is_in_the_setting_and_a_reused_report_keeps_no_stale_figure(tmp_path):
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "2xrtx3090", "--policy", "all-resident", "--tensor-split",
                   "1,3", "--batch", "1,8", "--tokens", "4", "--jobs", "1", "--out", "rep", cwd=tmp_path,
                   env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "split 1,3" in r.stdout and (tmp_path / "rep" / "crossovers.png").exists(), r.stdout
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--policy", "all-resident", "--tokens", "4",
                   "--jobs", "1", "--out", "rep", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "rep" / "crossovers.png").exists()


def test_a_count_figure_beyond_any_machine_is_refused(tmp_path):
    """A host file saying `cores = 100000000` was taken (the printed command said `-t 100000000`)."""
    text = (ROOT / "hwprofiles" / "hosts" / "ryzen-9950x.toml").read_text()
    start = text.index("cores = { value = ") + len("cores = { value = ")
    (tmp_path / "huge.toml").write_text(text[:start] + "100000000" + text[text.index(",", start):])
    one_line_error(in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "huge.toml", "--policy",
                              "cpu-static", "--tokens", "4", cwd=tmp_path), "'cores' is a count of at most 65,536")


@pytest.mark.parametrize("hw, words", [("2xa6000", "a machine of 2 GPUs; this command takes one GPU profile"),
                                       ("none", "a machine of no GPUs"), ("nope", "unknown hardware profile 'nope'")])
def test_a_machine_where_one_gpu_is_asked_for_is_named_so(tmp_path, hw, words):
    """`stats --hw 2xa6000` said "unknown hardware profile" of a name every sweep takes."""
    assert in_process("synth", "--model", "olmoe-1b-7b", "--tokens", "4", "--out", "t.npz", cwd=tmp_path).returncode == 0
    one_line_error(in_process("stats", "t.npz", "--hw", hw, cwd=tmp_path), words)


def test_llama_cpp_threads_over_two_sockets_read_memory_as_the_timing_assumes(tmp_path):
    """`--host epyc-9654@2s --engine llama.cpp`: timed with the figure of `--numa distribute`
    (its numa_efficiency), printed without it."""
    base = ["whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--engine", "llama.cpp", "--policy", "cpu-static",
            "--tokens", "4", "--jobs", "1", "--json"]
    for host, extra, numa in (("epyc-9654@2s", [], True), ("epyc-9654", [], False), ("epyc-9654@2s", ["--threads", "64"],
                                                                                          False)):
        r = in_process(*base, "--host", host, *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        args = _args(json.loads(r.stdout))
        assert args and all(("--numa distribute" in a) == numa for a in args), (host, extra, args)
