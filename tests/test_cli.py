"""The command line, run as a user runs it: a separate process, exit codes, stderr.

Tests that take ``run`` call the CLI in-process by default and in a subprocess with -m slow
(cli_run.runners); the rest (--version, an unknown command, refusals, a missing optional
dependency, the torch-free import) start ``python -m moesim`` in the default run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import BOTH_WAYS, both_ways, sample

from moesim.models import get_model
from moesim.traces.format import write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def moesim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.fixture(scope="module")
def olmoe_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "olmoe.npz"
    write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=24, prompt_len=16)), path)
    return path


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_help_teaches_with_examples(run):
    top = run("--help")
    assert top.returncode == 0 and "moesim whatif" in top.stdout
    for cmd in ("models", "hw", "synth", "replay", "whatif"):
        r = run(cmd, "--help")
        assert r.returncode == 0, cmd
        assert "Example" in r.stdout, cmd


def test_each_command_is_registered_by_the_module_commands_names():
    """moesim.cli.COMMANDS is how a run finds the one module to import: in a fresh process, each
    name's module registers that command and no module registers a command missing from it."""
    code = ("import json, typer\nfrom moesim.cli import COMMANDS, app, load_commands\nout = {}\n"
            "for name in COMMANDS:\n    load_commands([name])\n"
            "    out[name] = [c.name or typer.main.get_command_name(c.callback.__name__) for c in app.registered_commands]\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    names = list(seen)
    for i, name in enumerate(names):  # each load adds its own command, in the order COMMANDS lists
        assert seen[name] == names[:i + 1], (name, seen[name])


def test_typer_builds_the_invoked_command_alone_and_keeps_every_one_for_the_group():
    """moesim.cli.argv.only_command: a command's run sees that command registered alone;
    the group's help, --version and an unknown name see all seventeen, and so does the app
    after any run (in-process callers, the suite's runner, invoke one after another)."""
    from moesim.cli import every_command
    from moesim.cli.argv import only_command

    app = every_command()
    every = list(app.registered_commands)
    assert len(every) >= 17
    for argv in (["replay", "t.npz", "--hw", "a6000"], ["train-estimator", "--help"]):
        with only_command(argv):
            assert len(app.registered_commands) == 1
        assert app.registered_commands == every
    for argv in ([], ["--help"], ["--version"], ["nope"], ["t.npz", "replay"]):
        with only_command(argv):
            assert app.registered_commands == every
    r = moesim("replayy", "x")
    assert r.returncode == 2 and "No such command 'replayy'" in r.stderr and "\n" not in r.stderr.strip()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_models_lists_the_catalogue_with_byte_accounting(run):
    r = run("models", "--json")
    rows = {m["model"]: m for m in json.loads(r.stdout)["models"]}
    assert rows["qwen3-30b-a3b"]["expert_bytes"] == 9_437_184
    assert "mixtral-8x7b" in run("models").stdout


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_hw_shows_sources(run):
    r = run("hw", "h100-sxm", "--json")
    figs = json.loads(r.stdout)["figures"]
    assert figs["h2d_pinned_gbs"]["value"] == 55.4 and figs["h2d_pinned_gbs"]["kind"] == "measured"
    assert "gh200" in run("hw").stdout


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_replay_json_and_report(olmoe_trace, tmp_path, run):
    r = run("replay", olmoe_trace, "--hw", "a6000", "--policy", "on-demand,prefetch", "--json",
               "--out", tmp_path / "rep")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["policy"] for row in rows] == ["on-demand", "prefetch-fom"]
    assert rows[0]["synthetic_trace"] is True
    for f in ("report.html", "breakdown.png", "timeline.png", "summary.csv", "simulated.trace.json"):
        assert (tmp_path / "rep" / f).stat().st_size > 0, f
    chrome = json.loads((tmp_path / "rep" / "simulated.trace.json").read_text())
    assert {e["tid"] for e in chrome["traceEvents"] if e["ph"] == "X"} == {1, 2}


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_synth_then_whatif_over_the_trace(tmp_path, run):
    trace = tmp_path / "t.npz"
    assert run("synth", "--model", "tiny", "--tokens", 20, "--out", trace).returncode == 0
    r = run("whatif", "--trace", trace, "--hw", "a6000,gh200", "--policy", "on-demand,prefetch,oracle",
               "--link-gbps", "16,32", "--cache-gib", "0,0.0001", "--json", "--out", tmp_path / "w", "--jobs", 1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["rows"]) == 2 * 3 * 2 * 2
    assert out["best"]["policy"] != "oracle"
    assert (tmp_path / "w" / "heatmap.png").exists() and (tmp_path / "w" / "whatif.csv").exists()


@pytest.mark.slow
def test_whatif_with_no_arguments_answers_and_writes_a_report(tmp_path):
    r = moesim("whatif", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "best for lowest mean time per output token" in r.stdout
    assert (tmp_path / "moesim-whatif" / "report.html").exists()


def _assert_one_line_error(r, text):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert text in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_bad_inputs_get_one_line_errors(tmp_path, olmoe_trace, run):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('name = "x"\nlink = "pcie4"\n[figures]\n')
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"\x00" * 100)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(olmoe_trace.read_bytes()[:2000])
    cases = [
        (("models", "gpt-7"), "unknown model 'gpt-7'"),
        (("hw", "tpu9"), "unknown hardware profile"),
        (("hw", bad_toml), "missing required figure"),
        (("replay", junk), "not a readable moesim trace"),
        (("replay", cut), "corrupt or truncated"),
        (("replay", tmp_path / "missing.npz"), "does not exist"),
        (("replay", olmoe_trace, "--policy", "yolo"), "unknown policy"),
        (("replay", olmoe_trace, "--link-gbps", "-5"), "--link-gbps -5: a bandwidth in GB/s from 0.001"),
        (("replay", olmoe_trace, "--model", "qwen3-30b-a3b"), "was recorded for olmoe-1b-7b"),
        (("replay", olmoe_trace, "--cache-gib", "-1"), "--cache-gib -1: a size in GiB from 0"),
        (("replay", olmoe_trace, "--sim", "warp"), "unknown simulator"), (("replay", olmoe_trace, "--engine", "warp"), "unknown engine"),
        (("whatif", "--link-gbps", "16,fast", "--out", tmp_path / "w"), "not a comma-separated list of numbers"),
        (("whatif", "--goal", "happiness"), "unknown goal"),
        (("synth", "--model", "tiny", "--hit-rate", "2", "--out", tmp_path / "x.npz"), "hit_rate must be in [0, 1]"),
    ]
    for i, (args, text) in enumerate(sample(cases, run)):
        _assert_one_line_error((moesim if i == 0 else run)(*args), text)


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_profile_records_a_trace_that_replays(tmp_path, run):
    trace = tmp_path / "run.npz"
    r = run("profile", "--model", "tiny", "--policy", "prefetch-spec", "--predictor", "stale", "--link-gbps", "0.5",
               "--tokens", 6, "--fidelity-tokens", 8, "--out", trace)
    assert r.returncode == 0, r.stderr
    assert "fidelity: agreement" in r.stderr
    rep = run("replay", trace, "--hw", "a6000", "--link-gbps", "0.5", "--policy", "prefetch-spec", "--json")
    row = json.loads(rep.stdout)[0]
    assert row["timing"] == "measured (trace)" and row["tokens"] == 6


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_profile_and_calibrate_errors_are_one_line(tmp_path, run):
    cases = [
        (("profile", "--model", "tiny", "--device", "tpu"), "unknown device"),
        (("profile", "--model", "gpt-9"), "unknown model"),
        (("profile", "--model", "deepseek-v3", "--layers", "4"), "not executable"),
        (("profile", "--model", "tiny", "--predictor", "tea-leaves"), "unknown predictor"),
        (("profile", "--model", "tiny", "--tokens", "0"), "must be >= 1"),
        (("calibrate", "--model", tmp_path / "nowhere"), "not a checkpoint directory"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((("profile", "--model", "tiny", "--device", "cuda"), "no CUDA device"))
    for args, text in sample(cases, run):
        _assert_one_line_error(run(*args), text)


def test_importing_the_simulator_never_imports_torch():
    code = ("import sys, moesim.sim, moesim.sim.sweep, moesim.sim.speculative, moesim.sim.validate, moesim.sim.device_fit, "
            "moesim.sim.stats, moesim.sim.ecospec, moesim.traces, moesim.cli, moesim.reports.render, "
            "moesim.sim.replay, moesim.sim.whatif, moesim.sim.analysis, moesim.executor.defaults; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent)  # not the repository root: the installed package too
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_speculate_errors_are_one_line(tmp_path, run):
    cases = [
        (("speculate", "--selection", "psychic"), "unknown selection"),
        (("speculate", "--policy", "prefetch-spec"), "verifies exactly"),
        (("speculate", "--gamma", "-1"), "gamma >= 0"),
        (("speculate", "--draft", tmp_path / "none"), "not a checkpoint directory"),
    ]
    for args, text in sample(cases, run):
        _assert_one_line_error(run(*args), text)


@pytest.mark.slow
def test_validation_suite_runs_end_to_end(tmp_path):
    r = moesim("validate", "--model", "moe-stdlib", "--tokens", 3, "--repeats", 1, "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert len(rows) == 3 * (4 + 3)  # 3 links x (4 same-policy + 3 transfer cases)
    assert {r["case"] for r in rows} == {"same-policy", "transfer from on-demand"}
    for f in ("report.html", "scatter.png", "timeline.png", "errors.csv", "timelines.trace.json"):
        assert (tmp_path / f).exists(), f


def test_version():
    from moesim import __version__

    r = moesim("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"moesim {__version__}"


def _tree_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def invoke(*args, cwd):
    """The CLI in-process (one torch import for many calls); restores torch's thread count."""
    import os

    import torch
    from typer.testing import CliRunner

    from moesim.cli import every_command

    app = every_command()

    threads, here = torch.get_num_threads(), os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(app, [str(a) for a in args])
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_no_command_overwrites_a_shipped_checkpoint_without_force(tmp_path, run):
    from moesim.errors import MoesimError
    from moesim.executor.loading import shipped_model

    target, draft = shipped_model(), shipped_model("moe-stdlib-draft")
    before = (_tree_bytes(target), _tree_bytes(draft))
    for args in [("calibrate", "--out", target), ("train-estimator", "--out", target)]:  # as a user sees it
        _assert_one_line_error(run(*args, cwd=tmp_path), "shipped checkpoint")
    for args in [("calibrate", "--model", target, "--out", target, "--tokens", 64),
                 ("train-expert-predictor", "--out", draft),
                 ("train", "--out", target / "retrained", "--steps", 1)]:
        r = invoke(*args, cwd=tmp_path)
        assert isinstance(r.exception, MoesimError) and "shipped checkpoint" in str(r.exception), (args, r.output)
    assert (_tree_bytes(target), _tree_bytes(draft)) == before
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_derived_checkpoint_folders(tmp_path):
    from moesim.errors import MoesimError
    from moesim.executor.loading import check_derived_out, derived_checkpoint, is_shipped, shipped_model

    assert is_shipped(shipped_model()) and is_shipped(shipped_model() / "config.json")
    assert not is_shipped(tmp_path) and not is_shipped(shipped_model().parent.parent)
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(b"weights")
    out = derived_checkpoint(src, tmp_path / "copy", force=False)
    assert _tree_bytes(out) == _tree_bytes(src)
    (out / "model.safetensors").write_bytes(b"derived")  # a later run keeps what an earlier one made
    derived_checkpoint(src, out, force=False)
    assert (out / "model.safetensors").read_bytes() == b"derived"
    assert derived_checkpoint(src, src, force=False) == src  # in place: nothing copied
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(MoesimError, match="does not hold a copy"):
        check_derived_out(src, other, force=False)
    check_derived_out(src, other, force=True)


def test_calibrate_writes_a_model_folder_in_the_current_directory(tmp_path):
    r = invoke("calibrate", "--tokens", 64, cwd=tmp_path)
    assert r.exit_code == 0, (r.output, r.exception)
    out = tmp_path / "moe-stdlib-calibrated"
    assert {"config.json", "model.safetensors", "default_vectors.safetensors", "calibration.json"} <= {
        p.name for p in out.iterdir()}
    assert json.loads((out / "calibration.json").read_text())["tokens"] == 64
    r = invoke("profile", "--model", out.name, "--policy", "prefetch-fom", "--tokens", 2, cwd=tmp_path)
    assert r.exit_code == 0, (r.output, r.exception)
    assert (tmp_path / "profile.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_synthetic_trace_replays_on_the_named_default_profile(olmoe_trace, run):
    from moesim.hardware import DEFAULT_PROFILE

    r = run("replay", olmoe_trace, "--policy", "on-demand")
    assert r.returncode == 0, r.stderr
    assert f"on {DEFAULT_PROFILE} (default: the trace records no hardware), link" in r.stdout.replace("\n", " ")
    row = json.loads(run("replay", olmoe_trace, "--policy", "on-demand", "--json").stdout)[0]
    assert row["hw"] == DEFAULT_PROFILE


def test_predictor_inputs_say_what_each_predictor_reads():
    from moesim.executor.runtime import predictor_inputs

    assert predictor_inputs("prefetch-fom", "quasi") == (True, False)
    assert predictor_inputs("on-demand", "hybrid") == (True, True)  # recorded, so the trace can predict
    assert predictor_inputs("prefetch", "stale") == (False, False)
    assert predictor_inputs("oracle", "quasi") == (False, False)
    assert predictor_inputs("all-resident", "estimator") == (False, False)


def test_corpus_split_is_defined_once():
    from moesim.executor.corpus import (
        TRAIN_FRACTION,
        held_out_split,
        split_index,
        splits,
        stdlib_corpus,
        training_split,
    )

    corpus, _ = stdlib_corpus()
    train, held_out, _ = splits()
    assert train + held_out == corpus and len(train) == int(len(corpus) * TRAIN_FRACTION) == split_index(len(corpus))
    assert training_split()[0] == train and held_out_split()[0] == held_out


EXAMPLES = Path(__file__).resolve().parents[1] / "traces" / "examples"
STDLIB = Path(__file__).resolve().parents[1] / "executor" / "checkpoints" / "moe-stdlib"


DUMPS = [("vllm", "vllm-moe-stdlib.npz"), ("jsonl", "routing-moe-stdlib.jsonl"), ("npz", "routing-moe-stdlib.npz")]


# in a subprocess with -m slow: reading the checkpoint's config there imports transformers (5 s a process)
@pytest.mark.parametrize("run,fmt,name", both_ways(DUMPS, first=False, subprocesses=1))
def test_import_reads_the_shipped_example_dumps(tmp_path, run, fmt, name):
    r = run("import", fmt, EXAMPLES / name, "--model", STDLIB, "--out", tmp_path / "t.npz")
    assert r.returncode == 0, r.stderr
    from moesim.traces.format import read_trace

    t = read_trace(tmp_path / "t.npz")
    assert t.model.n_experts == 32 and not t.synthetic and t.n_tokens >= 12


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_import_of_a_dump_for_another_model_is_one_line(tmp_path, run):
    r = run("import", "jsonl", EXAMPLES / "routing-moe-stdlib.jsonl", "--model", "olmoe-1b-7b",
               "--out", tmp_path / "t.npz")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:")
    assert not (tmp_path / "t.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_stats_and_synth_like_and_ecospec_from_the_command_line(tmp_path, run):
    assert run("synth", "--model", "tiny", "--tokens", 24, "--out", tmp_path / "t.npz").returncode == 0
    r = run("stats", tmp_path / "t.npz", "--hw", "a6000", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res["hit_rate"]) >= {"lru", "lfu", "belady"} and "knee_experts" in res["tpot"]
    assert all(b >= a - 1e-12 for a, b in zip(res["hit_rate"]["lru"], res["hit_rate"]["belady"], strict=True))
    r = run("synth", "--like", tmp_path / "t.npz", "--tokens", 40, "--batch", 2, "--out", tmp_path / "s.npz")
    assert r.returncode == 0, r.stderr
    r = run("ecospec", "--model", "qwen3-235b-a22b", "--deployment", "8xh200-tp", "--gamma", "2", "--steps", 4,
            "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["selection"] for row in rows} >= {"none", "confidence"} and all(row["synthetic"] for row in rows)


BLOCK_IMPORTS = """
import sys
class Missing:  # as if the package were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = ["moesim", *{args!r}]
from moesim.__main__ import run
run()
"""


@pytest.mark.parametrize("blocked, args, extra", [
    (("torch",), ("profile", "--tokens", "2"), "moesim[executor]"),
    (("safetensors",), ("profile", "--tokens", "2"), "moesim[executor]"),
    (("transformers",), ("record", "moe-stdlib", "--tokens", "2"), "moesim[record]"),
])
def test_a_missing_optional_dependency_is_one_line_naming_the_extra(tmp_path, blocked, args, extra):
    code = BLOCK_IMPORTS.format(blocked=set(blocked), args=list(args))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    assert f'pip install "{extra}"' in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written
