"""Issue 24, round 3's last classes: an option that changes nothing for the chosen input says so
(one note line, the run still exits 0), two output flags that would print the same rows are
refused, a refusal names the option the user typed (not the figure it sets), a profile needs a
name, and a symbolic link loop as --out is refused instead of being replaced by the file."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from moesim.models import get_model
from moesim.traces.format import write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace
from moesim.traces.synthetic_speculative import synth_speculative

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_run import both_ways, hide, in_process, one_line_error  # noqa: E402


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("notes")
    write_trace(synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6)), d / "t.npz")
    synth_speculative("tiny", d / "sd.npz", steps=3)
    return d


def notes(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")]


@pytest.mark.parametrize("run, args, words", both_ways([
    (("replay", "t.npz", "--policy", "on-demand", "--tensor-split", "1"), ("--tensor-split", "1 GPU")),
    (("replay", "t.npz", "--hw", "2xa6000", "--policy", "gpu-layers", "--split", "tensor", "--tensor-split", "1,3"),
     ("--tensor-split", "--split tensor")),
    (("replay", "t.npz", "--policy", "on-demand", "--cache-per-layer"), ("--cache-per-layer", "cache above 0")),
    (("replay", "sd.npz", "--lambda", "0.2"), ("--lambda", "no --gamma")),
    (("replay", "sd.npz", "--gamma", "4", "--selection", "confidence", "--lambda", "0.2"), ("--lambda", "Lagrangian")),
    (("replay", "sd.npz", "--gamma", "4", "--selection", "confidence", "--score", "lagrangian"),
     ("--score", "ecospec selection")),
    (("synth", "--model", "tiny", "--tokens", "2", "--early-layers", "1000", "--out", "s.npz"),
     ("--early-layers 1000", "4 MoE layers")),
    (("replay", "t.npz", "--policy", "weight-streaming", "--offload-gib", "1e9"), ("--offload-gib 1,000,000,000", "every layer")),
]))
def test_an_option_that_changes_nothing_says_so(run, traces, args, words):
    r = run(*args, cwd=traces)
    assert r.returncode == 0, r.stderr[-2000:]
    said = notes(r)
    assert any(all(w in n for w in words) for n in said), r.stderr[-2000:]
    assert "changed nothing" in " ".join(said) or "every layer" in " ".join(said)


def test_the_options_used_say_nothing(traces):
    for args in (("--hw", "2xa6000", "--tensor-split", "1,3", "--policy", "gpu-layers"),
                 ("--cache-gib", "1", "--cache-per-layer", "--policy", "on-demand")):
        r = in_process("replay", "t.npz", *args, cwd=traces)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [n for n in notes(r) if "--tensor-split" in n or "--cache-per-layer" in n], r.stderr


@pytest.mark.parametrize("run, args, words", both_ways([
    (("replay", "t.npz", "--json", "--csv"), ("--json and --csv",)),
    (("hw", "--json", "--csv"), ("--json and --csv",)),
    (("replay", "t.npz", "--selection", "confidence"), ("--selection", "speculative-decoding traces")),
    (("replay", "t.npz", "--link-gbps", "0"), ("--link-gbps 0", "a bandwidth in GB/s")),
    (("replay", "t.npz", "--link-gbps", "nan"), ("--link-gbps nan", "a bandwidth in GB/s")),
    (("stats", "t.npz", "--hw", "a6000", "--policy", "cpu-static"), ("--policy cpu-static", "no expert cache")),
    (("replay", "t.npz", "--hw", "2xnone"), ("--hw '2xnone'", "takes no count")),
    (("models", ""), ("an argument '' is empty",)),
    (("replay", "sd.npz", "--gamma", "4", "--depth", "-1"), ("--depth -1", "whole number >= 1")),
    (("validate", "--model", "nope"), ("no suite model called 'nope'", "moe-stdlib")),
    (("calibrate", "--tokens", "0"), ("--tokens 0", "at least 2 tokens")),
    (("train-estimator", "--tokens", "-1"), ("--tokens -1", ">= 1")),
    (("calibrate", "--threads", "0", "--out", "cal"), ("--threads 0", "torch threads")),
    (("speculate", "--tokens", "2", "--threads", "99999", "--out", "s.npz"), ("--threads 99999", "torch threads")),
    (("replay", "sd.npz", "--gamma", "nan"), ("--gamma", "whole numbers")),
    (("replay", "sd.npz", "--gamma", "1.5"), ("--gamma", "whole numbers")),
    (("replay", "sd.npz", "--gamma", "4,-1"), ("--gamma -1", ">= 0")),
]))
def test_refusals_name_what_the_user_typed(run, traces, args, words):
    err = one_line_error(run(*args, cwd=traces), *words)
    assert "h2d_pinned_gbs" not in err and "a6000:" not in err


@pytest.mark.parametrize("name", ['""', '"   "', '"a\\u0007b"', '"' + "x" * 101 + '"'])
def test_a_profile_needs_a_printable_name(traces, tmp_path, name):
    from moesim.hardware import get_profile

    text = (Path(__file__).resolve().parents[1] / "hwprofiles" / "a6000.toml").read_text()
    lines = [f"name = {name}" if ln.startswith("name =") else ln for ln in text.splitlines()]
    (tmp_path / "bad.toml").write_text("\n".join(lines) + "\n")
    assert get_profile(str(Path(__file__).resolve().parents[1] / "hwprofiles" / "a6000.toml")).name
    one_line_error(in_process("replay", str(traces / "t.npz"), "--hw", str(tmp_path / "bad.toml"), cwd=tmp_path),
                   "name", "printable text")


def test_a_symbolic_link_loop_as_out_is_refused_and_kept(tmp_path):
    os.symlink("b.npz", tmp_path / "a.npz")
    os.symlink("a.npz", tmp_path / "b.npz")
    one_line_error(in_process("synth", "--model", "tiny", "--tokens", "2", "--out", "a.npz", cwd=tmp_path),
                   "a.npz", "symbolic link")
    assert (tmp_path / "a.npz").is_symlink() and os.readlink(tmp_path / "a.npz") == "b.npz"
    from moesim.atomic import atomic_write_text
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError, match="symbolic link"):
        atomic_write_text(tmp_path / "b.npz", "x")
    assert (tmp_path / "b.npz").is_symlink()


def test_a_dangling_link_as_out_writes_its_target(tmp_path):
    os.symlink("made.npz", tmp_path / "link.npz")
    r = in_process("synth", "--model", "tiny", "--tokens", "2", "--out", "link.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link.npz").is_symlink() and (tmp_path / "made.npz").is_file()


def test_a_policy_that_cannot_run_on_the_machine_is_not_run_not_out_of_memory():
    """--hw none: the copy policies need one GPU and the static layouts one at least; their rows
    were bound "memory" and the answer said "nothing fits in device memory"."""
    from moesim.sim.answer import deployment_answer
    from moesim.sim.whatif import WhatifOptions, whatif

    res = whatif(WhatifOptions(models=["olmoe-1b-7b"], hws=["none"], hosts=["epyc-9654"], tokens=16, cache_gib=[0]))
    bounds = {r["policy"]: r["bound"] for r in res.rows}
    assert bounds["all-resident"] == "CPU compute"
    assert bounds["on-demand"] == bounds["cpu-static"] == "not run", bounds
    answer = deployment_answer(res.rows)[0]
    assert {f.family: f.status for f in answer.families}["prefetching"] == "not run"
    assert "nothing fits in device memory" not in answer.reason and "not run on this machine" in answer.reason


@pytest.mark.parametrize("args", [("--tokens", "10"), ("--eval-tokens", "255"), ("--epochs", "0")])
def test_the_expert_predictors_counts_are_refused_before_torch(tmp_path, args):
    """They were refused after torch and both checkpoints had loaded (7.5-9.5 s on this machine);
    with torch hidden the line must still be the counts' own, not "needs torch"."""
    import subprocess

    code = (hide("torch") + "import sys; sys.argv = ['moesim', 'train-expert-predictor', *sys.argv[1:]]\n"
            "from moesim.cli import main\nmain()")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    one_line_error(r, "256-token chunks", "epochs >= 1")


QWEN = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64,
        "num_hidden_layers": 2, "moe_intermediate_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100}


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 10**8}, ("num_hidden_layers 100000000", "16,384 at most")),
    ({"num_experts": 0}, ("num_experts must be >= 1",)),
    ({"num_experts_per_tok": 8}, ("num_experts_per_tok 8 routes more experts than num_experts 4",)),
    ({"hidden_size": 64.5}, ("hidden_size must be an integer",)),
    ({"moe_intermediate_size": -32}, ("moe_intermediate_size must be >= 1",)),
])
def test_a_configs_impossible_counts_are_refused_before_transformers_builds_them(tmp_path, change, words):
    """10^8 layers ran a minute into 'out of memory' (transformers builds every layer); the others
    were refused after importing transformers (4 s)."""
    import json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**QWEN, **change}))
    one_line_error(in_process("models", "m", cwd=tmp_path), "m/config.json", *words)


def test_a_config_nested_too_deeply_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("[" * 100000 + "]" * 100000)
    one_line_error(in_process("models", "m", cwd=tmp_path), "nested too deeply")


def test_a_dangling_link_into_a_missing_folder_is_refused_before_any_work(traces, tmp_path):
    os.symlink("nowhere/x.csv", tmp_path / "dang.csv")
    r = in_process("whatif", "--trace", str(traces / "t.npz"), "--hw", "a6000", "--policy", "on-demand", "--jobs", "1",
                   "--rows", "dang.csv", "--out", "w", cwd=tmp_path)
    one_line_error(r, "--rows dang.csv", "whose folder does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dang.csv"]  # no sidecar, no report


@pytest.mark.parametrize("name, code", [("Ctrl-C", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_run_that_kept_its_work_still_ends_by_the_signal(capsys, name, code):
    """profile, record, speculate, train...: stopped after their last step (or mid-run, keeping
    the finished steps) they wrote their file and exited 0, so a script never knew it was stopped."""
    from moesim import stop
    from moesim.cli.running import keeps_finished_work

    @keeps_finished_work
    def command():
        stop.note_stop(name)  # what the signal handler records
        return "written"

    import signal

    handlers = {s: signal.getsignal(s) for s in stop.STOP_SIGNALS}  # the exit ignores further signals
    stop.reset()
    try:
        with pytest.raises(SystemExit) as e:
            command()
        assert e.value.code == code
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted ({name})"
    finally:
        stop.reset()
        for s, h in handlers.items():
            signal.signal(s, h)
    assert keeps_finished_work(lambda: "written")() == "written"  # not stopped: as before


def test_a_cache_past_every_expert_holds_every_expert(tmp_path):
    """--cache-gib 1e308 is infinite bytes: the sweep failed on 'cannot convert float NaN to integer'."""
    from moesim.models import cache_capacity

    spec = get_model("tiny")
    assert cache_capacity(spec, 1e308) == cache_capacity(spec, 1e6) == spec.n_moe_layers * spec.n_experts
    assert cache_capacity(spec, 5e-4) == int(5e-4 * 2**30 // spec.expert_bytes) == 43  # below every expert: as before
    assert cache_capacity(spec, cache_experts=10**20) == 64 and cache_capacity(spec, cache_experts=40) == 40
    # Round 14: 1e308 GiB overflows to infinite bytes: refused before work (moesim.bounds); 10^12 GiB still holds all.
    r = in_process("whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand", "--tokens", "4", "--jobs", "1",
                   "--cache-gib", "1e308", "--out", "w", cwd=tmp_path)
    assert r.returncode == 2 and "a size in GiB from 0 to 1,000,000,000,000" in r.stderr, r.stderr[-2000:]


@contextmanager
def held_by_another_process(path: Path):
    """``path``'s --out lock held by a second process, as a first run holds it (the lock
    allows nested holds within one process, so this process cannot play the first run for
    a command run in-process)."""
    code = ("import sys, time; from moesim.atomic import exclusive\n"
            "with exclusive(sys.argv[1], '--out'):\n    print('held', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert p.stdout.readline().strip() == "held"  # the lock is taken
        yield
    finally:
        p.kill()
        p.wait(30)


# in-process by default (the command checks the lock as a subprocess does); each in a
# subprocess with -m slow (profile, speculate and train import torch: 2 s a process)
@pytest.mark.parametrize("run, args", both_ways([(("ecospec", "--steps", "2", "--out", "held"),),
                                                 (("profile", "--tokens", "2", "--out", "held"),),
                                                 (("speculate", "--tokens", "2", "--out", "held"),),
                                                 (("train", "--steps", "1", "--out", "held"),)], first=False))
def test_a_second_run_on_one_out_is_refused(tmp_path, run, args):
    """Two ecospec runs on one --out left one report with the other's files; two profiles, one trace."""
    with held_by_another_process(tmp_path / "held"):
        r = run(*args, cwd=tmp_path, timeout=300)
    one_line_error(r, "--out", "held")
    assert not (tmp_path / "held").exists()


def test_a_layout_too_big_for_one_of_several_gpus_says_so(tmp_path):
    """--tensor-split 1,0 puts every layer of Qwen3-30B-A3B on the first of two 48 GB GPUs: the note
    said 'more than the 2xa6000's' (96 GB between them)."""
    write_trace(synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=3)), tmp_path / "q.npz")
    r = in_process("replay", "q.npz", "--hw", "2xa6000", "--tensor-split", "1,0", "--policy", "all-resident",
                   "--sim", "fast", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert any("one of its GPUs holds (48, 48 GB)" in n for n in notes(r)), r.stderr


def test_a_report_stopped_while_written_says_its_folder_is_partial(tmp_path, capsys):
    from moesim.cli.running import writing_report

    (tmp_path / "rep").mkdir()
    with pytest.raises(KeyboardInterrupt), writing_report(tmp_path / "rep"):
        (tmp_path / "rep" / "summary.json").write_text("{}")
        raise KeyboardInterrupt
    assert "holds part of a report" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt), writing_report(tmp_path / "empty"):
        raise KeyboardInterrupt  # nothing written yet: nothing to say
    assert "part of a report" not in capsys.readouterr().err


def test_profile_refuses_an_unknown_eviction_before_any_work(tmp_path):
    """``profile --eviction mru`` decoded a token and exited 0 (no cache used it); now refused
    as sweeps refuse it, and before torch loads."""
    probe = ("import sys, runpy; sys.argv = ['moesim', 'profile', '--model', 'tiny', '--eviction', 'mru', "
             "'--tokens', '1', '--out', 'p.npz']\ntry:\n    runpy.run_module('moesim', run_name='__main__')\n"
             "finally:\n    print('torch' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == "False", r.stderr[-2000:]
    one_line_error(in_process("profile", "--model", "tiny", "--eviction", "mru", "--out", "p.npz", cwd=tmp_path),
                   "--eviction", "'mru'", "lru, lfu")
    assert not (tmp_path / "p.npz").exists()


def test_one_lambda_rule_for_every_command():
    """``speculate --lambda 1e308`` was refused as "a finite number" (it is finite) while replay took it,
    and speculate took -1 that replay refused; now one rule, ``moesim.selection.lambda_ok``."""
    from moesim.errors import MoesimError
    from moesim.executor.speculative import SDSettings
    from moesim.selection import check_lambda, lambda_ok
    from moesim.sim.ecospec import parse_selections

    assert lambda_ok(0.0) and lambda_ok(1e308)
    assert not any(lambda_ok(v) for v in (-1.0, float("inf"), float("nan")))
    check_lambda(1e308)
    SDSettings(lam=1e308)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(MoesimError, match="--lambda"):
            SDSettings(lam=bad)
        with pytest.raises(MoesimError):
            parse_selections(f"ecospec:lagrangian:{bad}")
    assert parse_selections("ecospec:lagrangian:1e308")[0].lam_per_layer_k == 1e308


def test_profile_notes_what_changed_nothing(tmp_path):
    """Round 9: profile notes --eviction, --predictor, --link-gbps and --name it did not use."""
    r = in_process("profile", "--model", "tiny", "--tokens", "2", "--policy", "all-resident", "--eviction", "lfu",
                   "--predictor", "stale", "--link-gbps", "1", "--name", "x", "--out", "p.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    said = " ".join(notes(r))
    for o in ("--eviction", "--predictor", "--link-gbps", "--name"):
        assert f"{o} was given" in said and "changed nothing" in said, r.stderr[-2000:]
