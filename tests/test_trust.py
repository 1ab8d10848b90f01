"""No input ends in a traceback or a silent wrong answer: one subprocess test per fault
class (outputs, missing optional dependency, bad input files, absurd sizes, duplicate
names, interruptions), and the library pieces behind them (moesim.outputs, moesim.atomic,
moesim.budget, the recorded link of a replay, fit naming and warnings)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.traces.format import read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "stranger"))
from cases import make_readonly, undo_readonly  # noqa: E402
from cli_run import BOTH_WAYS, both_ways, hide, one_line_error, sample  # noqa: E402
from cli_signals import signal_when  # noqa: E402


def moesim(*args, cwd, pre: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess; ``pre`` is Python run first (e.g. to hide torch)."""
    code = f"{pre}\nimport sys\nsys.argv = ['moesim', *sys.argv[1:]]\nfrom moesim.cli import main\nmain()"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def work(refusal_dir):
    return refusal_dir


@pytest.fixture
def readonly(tmp_path):
    ro = tmp_path / "ro"
    how = make_readonly(ro)
    if how is None:
        pytest.skip("cannot make a folder that root cannot write here (neither chmod nor chattr +i works)")
    yield ro
    undo_readonly(ro)


# -- outputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("run, args, out, words", both_ways([
    (("synth", "--model", "tiny", "--tokens", "2"), "adir", ("is a folder; a file is expected",)),
    (("synth", "--model", "tiny", "--tokens", "2"), "afile/x.npz", ("afile is a file, not a folder",)),
    (("replay", "t.npz", "--policy", "on-demand"), "afile", ("is a file; a folder is expected",)),
    (("whatif", "--model", "tiny", "--tokens", "2"), "afile/sub", ("afile is a file, not a folder",)),
    (("fit", "t.npz"), "adir", ("is a folder",)),
    (("profile", "--model", "tiny", "--tokens", "2"), "adir", ("is a folder",)),
    (("train", "--steps", "1"), "afile", ("is a file; a folder is expected",)),
]))
def test_a_bad_output_path_is_one_line_before_any_work(work, run, args, out, words):
    t0 = time.time()
    r = run(*args, "--out", out, cwd=work)
    one_line_error(r, *words)
    assert time.time() - t0 < 60  # nothing ran


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_an_output_that_is_a_device_or_pipe_is_refused_and_left_as_it_is(work, tmp_path, run):
    """A write renames a new file onto its path: run as root, `--out /dev/full` once replaced
    the device node with a regular file. A real named pipe stands in for the device."""
    import os
    import stat

    from moesim.atomic import atomic_write

    pipe = tmp_path / "pipe.npz"
    os.mkfifo(pipe)
    for i, args in enumerate((("synth", "--model", "tiny", "--tokens", "2"), ("profile", "--model", "tiny", "--tokens", "2"))):
        one_line_error((moesim if i == 0 else run)(*args, "--out", pipe, cwd=work), "not a regular file")
        assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    with pytest.raises(MoesimError, match="not a regular file"):
        atomic_write(pipe, lambda f: f.write(b"x"))  # the backstop every writer goes through
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_a_read_only_folder_is_refused_before_any_work(work, readonly, run):
    for i, args in enumerate((("synth", "--model", "tiny", "--tokens", "2", "--out", readonly / "x.npz"),
                 ("replay", work / "t.npz", "--out", readonly / "report"),
                 ("profile", "--model", "tiny", "--tokens", "2", "--out", readonly / "sub" / "p.npz"))):
        one_line_error((moesim if i == 0 else run)(*args, cwd=work), "cannot write in", str(readonly))
    assert not any(readonly.iterdir())


def test_output_checks_in_the_library(tmp_path, readonly):
    from moesim.outputs import check_output_dir, check_output_file

    (tmp_path / "f").write_text("x")
    assert check_output_file(tmp_path / "new" / "deeper" / "a.npz") == tmp_path / "new" / "deeper" / "a.npz"
    assert not (tmp_path / "new").exists()  # checking creates nothing
    with pytest.raises(MoesimError, match="expected a .toml file"):
        check_output_file(tmp_path / "a.npz", (".toml",))
    with pytest.raises(MoesimError, match="is a file; a folder is expected"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(MoesimError, match="f is a file, not a folder"):
        check_output_dir(tmp_path / "f" / "sub")
    with pytest.raises(MoesimError, match="cannot write in"):
        check_output_dir(readonly / "report")


def test_an_output_that_is_a_symbolic_link_writes_the_file_it_points_to(tmp_path):
    """The rename replaced the link by a regular file and left its target as it was (a stranger's)."""
    from moesim.atomic import atomic_write_text

    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "t.txt"
    target.write_text("old")
    (tmp_path / "link.txt").symlink_to(target)
    assert atomic_write_text(tmp_path / "link.txt", "new") == tmp_path / "link.txt"
    assert (tmp_path / "link.txt").is_symlink() and target.read_text() == "new"
    assert not list(tmp_path.rglob("*.tmp"))


def test_atomic_writes_clean_temporary_files_of_dead_writers_only(tmp_path):
    from moesim.atomic import atomic_write_text

    dead = tmp_path / ".a.txt.999999999.x1.tmp"  # no such pid
    alive = tmp_path / f".a.txt.{os.getpid()}.x2.tmp"  # a writer still running
    dead.write_text("half")
    alive.write_text("half")
    atomic_write_text(tmp_path / "a.txt", "whole")
    assert (tmp_path / "a.txt").read_text() == "whole"
    assert not dead.exists() and alive.exists()
    with pytest.raises(MoesimError, match="it is a folder"):
        atomic_write_text(tmp_path, "x")


@pytest.mark.parametrize("sig,word", [(signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")])
def test_sigterm_leaves_no_temporary_file(work, tmp_path, sig, word):
    """SIGTERM (or SIGHUP: a closed terminal) unwinds like Ctrl-C: one line, no .tmp beside the
    output, and exit 143 (129: 128 + the signal's number, as a shell reports a process the signal
    ended; Ctrl-C exits 130)."""
    # ~4 x 200k layer-steps through SimPy: seconds of work on any machine, so the signal lands
    # mid-run. It is sent once the progress bar is drawn (a terminal is emulated): sent after
    # a fixed sleep, on a loaded machine it once arrived while Python was still importing,
    # before the CLI had its handler, and the default action killed the process (-15).
    write_trace(synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=4096)), tmp_path / "big.npz")
    rc, err = signal_when(["replay", "big.npz", "--sim", "simpy", "--out", "rep"], lambda text: "replaying" in text,
                          sig, cwd=tmp_path, wait_s=60)
    assert "Traceback" not in err
    assert rc == 128 + sig, err
    assert err.strip().splitlines()[-1] == f"interrupted ({word})", err  # says what stopped it
    assert not list(tmp_path.rglob("*.tmp"))


def test_signals_after_the_interrupted_line_are_ignored_while_python_exits(tmp_path):
    """The stranger's round 4: SIGTERM, SIGINT, SIGTERM 0.1 s apart to stats, replay, ecospec
    or a pool sweep printed `interrupted` and then a KeyboardInterrupt traceback (raised while
    Python joined a busy worker thread at exit), or died of the signal (-2, -15) once the
    interpreter had put back the default handlers. The exit path the CLI takes
    (moesim.stop.interrupted_line) now ignores further signals: the one line, and the exit code
    of what stopped it first (143: the SIGTERM)."""
    code = ("import os, signal, sys, threading, time\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "from moesim.stop import catch_sigterm, exit_code, interrupted_line\n"
            "catch_sigterm()\n"
            "ThreadPoolExecutor(1).submit(time.sleep, 2.0)  # a worker still busy when the run exits\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
            "except KeyboardInterrupt:\n"
            "    sys.stderr.write(interrupted_line() + '\\n')\n"
            "    for at, sig in ((0.3, signal.SIGTERM), (0.5, signal.SIGINT), (0.7, signal.SIGTERM)):\n"
            "        threading.Timer(at, os.kill, (os.getpid(), sig)).start()  # while Python joins the worker\n"
            "    sys.exit(exit_code())\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 143 and r.stderr == "interrupted (SIGTERM)\n", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("args", [("stats", "t.npz", "--out", ""), ("whatif", "--model", "tiny", "--json", "--out="),
                                  ("replay", "t.npz", "--hw", "")])
def test_an_empty_option_value_is_one_line_before_any_work(tmp_path, args):
    """typer reads ``--out ''`` as the current folder: stats, ecospec and whatif wrote their
    reports there and exited 0 (the stranger's round 4). No moesim option means an empty value."""
    r = subprocess.run([sys.executable, "-m", "moesim", *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    one_line_error(r, f"{args[-1].rstrip('=') if args[-1] else args[-2]} '' is empty")
    assert not list(tmp_path.iterdir())  # nothing written, nothing read


# -- missing optional dependency ---------------------------------------------------------

@pytest.mark.parametrize("args", [("profile", "--model", "tiny", "--tokens", "2"), ("validate",), ("calibrate",)])
def test_missing_torch_is_one_line_naming_the_extra(work, args):
    r = moesim(*args, cwd=work, pre=hide("torch", "safetensors"))
    one_line_error(r, 'pip install "moesim[executor]"', "download.pytorch.org/whl/cpu")


# -- bad input files ---------------------------------------------------------------------

@pytest.mark.parametrize("run", BOTH_WAYS)
def test_bad_input_files_are_one_line_each(work, run):
    (work / "random.npz").write_bytes(np.random.default_rng(0).bytes(2000))
    (work / "empty.npz").write_bytes(b"")
    assert "is a folder, not a trace file" in one_line_error(moesim("replay", "adir", cwd=work))
    line = one_line_error(run("replay", "random.npz", cwd=work), "not an .npz archive")
    assert "pickle" not in line
    one_line_error(run("replay", "empty.npz", cwd=work), "empty")
    one_line_error(run("replay", "t.npz", "--hw", "t.npz", cwd=work), "not a hardware profile")


# -- absurd sizes --------------------------------------------------------------------------

@pytest.mark.parametrize("run, args, words", both_ways([
    (("synth", "--model", "tiny", "--tokens", "1000000000000"), ("TiB", "available: refusing")),
    (("whatif", "--model", "tiny", "--tokens", "1000000000000", "--out", "w"), ("available: refusing",)),
    (("profile", "--model", "tiny", "--link-gbps", "1e-9", "--tokens", "2"), ("--link-gbps", "from 0.001")),
    (("profile", "--model", "qwen3-30b-a3b", "--layers", "0", "--tokens", "2"), ("--layers 0",)),
    (("validate", "--tokens", "100000000", "--repeats", "1", "--out", "v"), ("TiB", "available: refusing")),
    (("validate", "--tokens", "3", "--repeats", "100000000", "--out", "v"), ("years", "more than a day")),
    # round 5: these ran until killed, or overflowed torch after the models loaded
    (("train-expert-predictor", "--epochs", "1000000000", "--out", "tp"), ("years", "more than a day")),
    (("train-estimator", "--epochs", "1000000000", "--out", "te"), ("years", "more than a day")),
    (("speculate", "--depth", "1000", "--branch", "1000", "--tokens", "2"), ("4,096 candidates",)),
    (("train", "--lr", "nan", "--steps", "1", "--out", "tr"), ("lr a positive number",)),
    (("train", "--layers", "16000", "--steps", "1", "--out", "tr"), ("1 step of", "GiB", "available: refusing")),
    (("train", "--layers", "1000000", "--steps", "1", "--out", "tr"), ("n_layers 1000000", "16,384 at most")),
]))
def test_absurd_sizes_are_refused_with_the_estimate(work, run, args, words):
    t0 = time.time()
    one_line_error(run(*args, cwd=work), *words)
    assert time.time() - t0 < 60


def test_budget_estimates_grow_with_the_run_and_refuse_what_cannot_fit():
    from moesim import budget

    spec = get_model("qwen3-30b-a3b")
    small, big = budget.synth_estimate(spec, 100, 1), budget.synth_estimate(spec, 10_000, 1)
    assert big.bytes > small.bytes and big.seconds > 10 * small.seconds
    assert budget.replay_estimate(spec, 100, 1, runs=4).seconds == pytest.approx(
        4 * budget.replay_estimate(spec, 100, 1, runs=1).seconds)
    slow = budget.decode_estimate(get_model("tiny"), 10, 1, 4, 1e-6, 0, True)
    fast = budget.decode_estimate(get_model("tiny"), 10, 1, 4, 10.0, 0, True)
    assert slow.seconds > 1000 * fast.seconds
    huge_cache = budget.decode_estimate(get_model("tiny"), 1, 1, 4, 10.0, 10**15, True)
    assert huge_cache.bytes < 2**30  # a cache cannot hold more than every expert
    with pytest.raises(MoesimError, match="refusing"):
        budget.check(budget.Estimate("x", budget.available_memory() * 2, 1.0))
    warned = []
    budget.check(budget.Estimate("x", 1.0, budget.WARN_S * 2), warn=warned.append)
    assert warned and "about" in warned[0]


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_a_huge_cache_in_profile_holds_every_expert_instead_of_allocating(work, tmp_path, run):
    r = run("profile", "--model", "tiny", "--policy", "on-demand", "--cache-gib", "1e9", "--tokens", "2",
               "--out", tmp_path / "p.npz", cwd=work)
    assert r.returncode == 0, r.stderr
    spec = get_model("tiny")
    assert read_trace(tmp_path / "p.npz").meta.cache_experts == spec.n_moe_layers * spec.n_experts


# -- duplicate names, fit names and warnings ---------------------------------------------

@pytest.mark.parametrize("run", BOTH_WAYS)
def test_two_profiles_with_one_name_are_refused(work, run):
    shutil.copy(ROOT / "hwprofiles" / "a6000.toml", work / "copy.toml")
    one_line_error(run("whatif", "--model", "tiny", "--hw", "a6000,copy.toml", "--tokens", "2", "--out", "w",
                          cwd=work), "both named 'a6000'", "unique")


def test_fit_names_its_profile_and_warns_on_a_poor_fit():
    from moesim.hardware import get_profile
    from moesim.sim.device_fit import fit_warnings, fitted_name

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=2))
    name = fitted_name(trace, get_profile("a6000"))
    assert name != "a6000" and name.endswith("-fit-a6000")
    good = {"r2": 0.99, "tpot_error_with_fitted_profile": 0.02}
    assert fit_warnings(good) == []
    bad = fit_warnings({"r2": 0.675, "tpot_error_with_fitted_profile": -0.266})
    assert len(bad) == 2 and "R^2 0.675" in bad[0] and "-26.6%" in bad[1]


# -- the recorded link ---------------------------------------------------------------------

def test_replay_uses_the_link_the_trace_was_recorded_with():
    from moesim.sim.replay import replay, replay_setting

    trace = synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6))
    trace.header["recorded"] = {**trace.header.get("recorded", {}), "hw_profile": "a6000", "link_gbps": 0.5,
                                "latency_us": 10.0}
    assert trace.meta.link_gbps == 0.5
    rec = replay(trace, None, ["on-demand"], replay_setting(sim="fast"))
    assert rec.rows[0]["link_gbps"] == 0.5 and rec.link_source == "recorded in the trace"
    named = replay(trace, "a6000", ["on-demand"], replay_setting(sim="fast"))  # another profile named: its own link
    assert named.link_source == "the profile's" and named.rows[0]["link_gbps"] == named.profile["h2d_pinned_gbs"] != 0.5
    given = replay(trace, None, ["on-demand"], replay_setting(sim="fast", link_gbps=2.0))
    assert given.rows[0]["link_gbps"] == 2.0 and given.link_source == "given"
    assert rec.rows[0]["tpot_ms"] > given.rows[0]["tpot_ms"]  # a slower link is not ignored


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_replay_uses_the_cache_the_trace_was_recorded_with(tmp_path, run):
    """A run recorded with an 8-expert LFU cache replays with that cache unless told otherwise."""
    r = run("profile", "--model", "tiny", "--policy", "on-demand", "--tokens", 4, "--cache-experts", 8,
               "--eviction", "lfu", "--out", "c.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rec = run("replay", "c.npz", "--policy", "on-demand", "--json", cwd=tmp_path)
    row = json.loads(rec.stdout)[0]
    assert (row["cache_experts"], row["eviction"]) == (8, "lfu"), rec.stderr
    table = run("replay", "c.npz", "--policy", "on-demand", cwd=tmp_path)
    assert "8-expert LFU cache (recorded in the trace)" in " ".join(table.stdout.split())
    none = json.loads(run("replay", "c.npz", "--policy", "on-demand", "--cache-experts", 0, "--json",
                             cwd=tmp_path).stdout)[0]
    assert none["cache_experts"] == 0 and none["cache_hit_rate"] == 0 < row["cache_hit_rate"]


def test_signed_intercepts_never_read_plus_minus():
    from moesim.cli.replay_views import signed_ms

    assert signed_ms(-4.57) == "- 4.57 ms" and signed_ms(1.2) == "+ 1.2 ms"


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_json_of_a_replay_names_its_sources(work, run):
    r = run("replay", "t.npz", "--policy", "on-demand", "--sim", "fast", "--json", cwd=work)
    row = json.loads(r.stdout)[0]
    assert row["hw_source"].startswith("default") and row["link_source"] == "the profile's"


# -- record and record --draft: refused before any model loads --------------------------------

@pytest.mark.parametrize("run", BOTH_WAYS)
def test_record_refuses_what_cannot_run_in_one_line(tmp_path, run):
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_bytes(b"\xff\xfe{}")
    cases = [
        (("record", "moe-stdlib", "--draft", "badcfg", "--tokens", 2, "--out", "r.npz"), "not UTF-8 text"),
        (("record", "moe-stdlib", "--draft", "moe-stdlib-draft", "--tokens", 2, "--tree-depth", 1000, "--tree-branch",
          1000, "--out", "r.npz"), "choose a smaller tree"),
        (("record", "moe-stdlib", "--tokens", 100_000_000, "--out", "r.npz"), "refusing"),
        (("record", "moe-stdlib", "--draft", "moe-stdlib-draft", "--tokens", 100_000_000, "--out", "r.npz"), "refusing"),
    ]
    for args, words in sample(cases, run):
        one_line_error(run(*args, cwd=tmp_path, timeout=120), words)
    assert not list(tmp_path.glob("r.npz*"))


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_deployment_options_refuse_bad_input_in_one_line(work, run):
    from moesim.models import catalogue_in

    (work / "same.npz").write_bytes((work / "t.npz").read_bytes())  # a copy of the trace being replayed
    w = ("whatif", "--hw", "a6000", "--tokens", 8, "--jobs", 1, "--out", "o")
    cases = [
        ((*w, "--model", "olmoe-1b-7b,gpt-oss-20b", "--expert-dtype", "bf16,q4_k"), "multiples of 256"),
        ((*w, "--model", "olmoe-1b-7b", "--policy", "hot-experts", "--gpu-expert-gib", "nan"), "a size in GiB"),
        ((*w, "--model", "olmoe-1b-7b", "--policy", "hot-experts", "--gpu-expert-gib", "inf"), "a size in GiB"),
        (("whatif", "--trace", "t.npz", "--hw", "a6000", "--jobs", 1, "--out", "o", "--policy", "hot-experts",
          "--placement-from", "same.npz"), "has seen the future"),
        (("replay", "t.npz", "--policy", "hot-experts", "--placement-from", "same.npz"), "has seen the future"),
        (("hw", "grace"), "is a host (CPU) profile"),
        ((*w, "--model", "olmoe-1b-7b", "--batch", 10_000_000), "refusing"),  # trace + its replay, before any work
    ]
    for args, words in cases:
        one_line_error(run(*args, cwd=work), words)
    specs, skipped = catalogue_in("q4_k")  # the listing shows what the format can store, and says what it skipped
    assert specs and "gpt-oss-20b" in skipped and all(s.expert_dtype == "q4_k" for s in specs)
    r = run("models", "--expert-dtype", "q4_k", cwd=work)
    assert r.returncode == 0 and "olmoe-1b-7b@q4_k" in r.stdout and "not listed: gpt-oss-20b" in r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_list_options_refuse_repeats_and_empty_items_and_unused_knobs_are_named(work, run):
    w = ("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--tokens", 8, "--jobs", 1, "--out", "o")
    for args, words in ([((*w, "--policy", "cpu-static", "--host", "grace,grace"), "appears twice"),
                                       ((*w, "--expert-dtype", "bf16,,q4_k"), "an empty item"),
                                       ((*w, "--policy", "cpu-static", "--host", ""), "give at least one value"),
                                       ((*w, "--policy", "On-demand,on-demand"), "appears twice")]):
        one_line_error(run(*args, cwd=work), words)
    r = run(*w, "--policy", "on-demand", "--cpu-layers", 2, cwd=work)
    assert r.returncode == 0 and "--cpu-layers was given, but none of the swept policies uses it" in r.stdout + r.stderr


def test_validate_refuses_impossible_repeats_before_importing_torch():
    """`validate --repeats 10^9` reached its refusal after ~10 s of importing the executor: the
    plan and the synthetic model's estimate are torch-free (executor/validation_plan.py)."""
    code = ("import sys\nfrom moesim.cli import main\nsys.argv = ['moesim', 'validate', '--repeats', '1000000000',"
            " '--out', 'v']\ntry:\n    main()\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)  # the CLI's path
    assert r.stdout.split() == ["2", "False", "False"], (r.stdout, r.stderr[-2000:])
    assert "synthetic model alone" in r.stderr and "more than a day" in r.stderr, r.stderr


def test_train_refuses_an_impossible_geometry_before_importing_torch():
    """`train --layers 10^6` summed a million layers' bytes property by property (13 s) after
    importing torch; the geometry and its estimate are torch-free and each figure is computed once."""
    code = ("import sys\nfrom moesim.cli import main\nsys.argv = ['moesim', 'train', '--layers', '1000000', '--steps', '1',"
            " '--out', 'tr']\ntry:\n    main()\nexcept SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr[-2000:])
    assert "beyond any model's" in r.stderr  # past moesim.models.SIZE_LIMITS; below, the estimate refuses it
