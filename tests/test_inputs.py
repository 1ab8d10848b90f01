"""Every input file is looked at before it is read (moesim.inputs, issue 24): the readers
themselves on real files, devices, sockets, FIFOs and pipes, and the real CLI in
subprocesses where the path matters (a FIFO's writer runs in a thread with a deadline, so
no test can hang the suite)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cli_run import both_ways, runners, sample
from cli_run import one_line_error as one_line

from moesim import inputs
from moesim.errors import MoesimError
from moesim.inputs import check_input, check_name, kind_of, original_names, read_bytes, read_text, readable_path
from moesim.models import get_model
from moesim.traces.format import read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "executor" / "checkpoints" / "moe-stdlib"
LONG = "n" * 300  # longer than any file system's NAME_MAX (255)


def moesim(*args, cwd, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, **kw)


#: ``run``: in-process by default, this module's subprocess with -m slow (see cli_run.runners)
BOTH_WAYS = runners(moesim)


def feed(fifo: Path, data: bytes, deadline: float = 30.0) -> threading.Thread:
    """Write ``data`` into ``fifo`` once a reader opens it (never blocking past ``deadline``)."""
    def run():
        end = time.time() + deadline
        while time.time() < end:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO until a reader has it open
            except OSError:
                time.sleep(0.02)
                continue
            os.set_blocking(fd, True)
            try:
                os.write(fd, data)
            except BrokenPipeError:
                pass
            finally:
                os.close(fd)
            return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    write_trace(synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6, prompt_len=4)), d / "t.npz")
    shutil.copy(ROOT / "hwprofiles" / "a6000.toml", d / "a6000.toml")
    return d


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(inputs, "PIPE_WAIT_S", 0.2)


# -------------------------------------------------------------------------------------
# The readers
# -------------------------------------------------------------------------------------

def test_kinds(tmp_path):
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "p")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "s"))
        kinds = {n: kind_of(tmp_path / n) for n in ("f", "p", "s", "missing")}
    finally:
        s.close()
    assert kinds == {"f": "file", "p": "pipe", "s": "socket", "missing": "missing"}
    assert kind_of(tmp_path) == "folder" and kind_of("/dev/null") == "device"
    assert kind_of(tmp_path / "f" / "under-a-file") == "missing" and kind_of(tmp_path / LONG) == "missing"


def test_refusals_before_reading(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 2000)
    for path, words in ((tmp_path / "missing", "does not exist"), (tmp_path, "is a folder"),
                        ("/dev/zero", "is a device, not a regular file"), (tmp_path / "big", "at most 1000 bytes"),
                        (tmp_path / LONG, "300 bytes"), ("x/" * 2100, "paths are shorter than")):
        with pytest.raises(MoesimError, match=words) as e:
            check_input(path, "thing", cap=1000)
        assert "\n" not in str(e.value)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(MoesimError, match="is a socket"):
            read_bytes(tmp_path / "sock", "thing", 1000)
    finally:
        s.close()
    assert check_name(tmp_path / "short", "thing") == tmp_path / "short"


def test_a_silent_fifo_is_refused_without_blocking(tmp_path, quick):
    os.mkfifo(tmp_path / "f.toml")
    t0 = time.time()
    with pytest.raises(MoesimError, match=r"named pipe \(FIFO\) nothing was written to"):
        read_bytes(tmp_path / "f.toml", "profile", 1000)
    assert time.time() - t0 < 5
    with pytest.raises(MoesimError, match="named pipe"):
        readable_path(tmp_path / "f.toml", "profile")


def test_a_fed_fifo_and_an_anonymous_pipe_are_read(tmp_path, quick):
    fifo = tmp_path / "f.txt"
    os.mkfifo(fifo)
    t = feed(fifo, b"hello\n")
    assert read_text(fifo, "text") == "hello\n"
    t.join(5)
    r, w = os.pipe()
    os.write(w, b"\xef\xbb\xbfpiped")
    os.close(w)
    try:
        assert read_text(f"/dev/fd/{r}", "text") == "piped"  # a BOM is dropped
    finally:
        os.close(r)


def test_a_pipe_past_its_cap_is_refused(tmp_path, quick):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    feed(fifo, b"x" * 5000)
    with pytest.raises(MoesimError, match="a pipe that sent more than"):
        read_bytes(fifo, "thing", 1000)


def test_text_that_is_not_utf8_says_so(tmp_path):
    (tmp_path / "u16").write_bytes("name".encode("utf-16"))
    (tmp_path / "nul").write_bytes(b"a\x00b")
    with pytest.raises(MoesimError, match="looks like UTF-16"):
        read_text(tmp_path / "u16", "profile")
    with pytest.raises(MoesimError, match="binary data"):
        read_text(tmp_path / "nul", "profile")


def test_a_spooled_pipe_is_named_as_the_user_named_it(tmp_path, work, quick):
    fifo = tmp_path / "trace.npz"
    os.mkfifo(fifo)
    feed(fifo, (work / "t.npz").read_bytes())
    spooled = readable_path(fifo, "trace")
    assert spooled != fifo and spooled.is_file() and spooled.suffix == ".npz"
    assert readable_path(fifo, "trace") == spooled  # read once; a second reader gets the same bytes
    assert original_names(f"cannot read {spooled}") == f"cannot read {fifo}"
    assert readable_path(tmp_path / "nothing", "trace") == tmp_path / "nothing"  # the reader says it is missing


def test_read_trace_from_a_fifo_and_a_broken_pipe(tmp_path, work, quick):
    fifo = tmp_path / "t.npz"
    os.mkfifo(fifo)
    feed(fifo, (work / "t.npz").read_bytes())
    assert read_trace(fifo).n_tokens == 6
    half = tmp_path / "half.npz"
    os.mkfifo(half)
    feed(half, (work / "t.npz").read_bytes()[:500])
    with pytest.raises(MoesimError) as e:
        read_trace(half)
    assert str(half) in str(e.value) and "moesim-pipe" not in str(e.value)


# -------------------------------------------------------------------------------------
# Profiles, configs, GGUF, routing dumps (in-process)
# -------------------------------------------------------------------------------------

def test_profiles_refuse_devices_and_read_pipes(work, tmp_path, quick):
    from moesim.engines import get_engine
    from moesim.hardware import get_host, get_profile

    for get, what in ((get_profile, "hardware profile"), (get_host, "host profile"), (get_engine, "engine profile")):
        with pytest.raises(MoesimError, match=f"{what} /dev/zero is a device"):
            get("/dev/zero")
        with pytest.raises(MoesimError, match="300 bytes"):
            get(LONG)
    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    feed(fifo, (work / "a6000.toml").read_bytes())
    assert get_profile(str(fifo)).name == get_profile("a6000").name
    assert get_profile(str(fifo)).name == get_profile("a6000").name  # read once: the second look-up gets its bytes
    os.mkfifo(tmp_path / "silent.toml")
    with pytest.raises(MoesimError, match="named pipe"):
        get_profile(str(tmp_path / "silent.toml"))


def test_a_huge_profile_is_refused_unread(tmp_path):
    from moesim.hardware import get_profile

    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(inputs.TOML_CAP + 1)  # sparse: nothing is written, nothing may be read
    with pytest.raises(MoesimError, match="at most 4 MiB"):
        get_profile(str(big))


def test_model_config_through_a_fifo_folder_and_device(tmp_path, quick):
    from moesim.models import get_model

    with pytest.raises(MoesimError, match="model config /dev/zero is a device"):
        get_model("/dev/zero")
    with pytest.raises(MoesimError, match="300 bytes"):
        get_model(LONG)
    d = tmp_path / "m"
    d.mkdir()
    os.mkfifo(d / "config.json")
    with pytest.raises(MoesimError, match="named pipe"):
        get_model(str(d))
    feed(d / "config.json", (SHIPPED / "config.json").read_bytes())
    assert get_model(str(d)).n_experts == 32


def test_gguf_through_a_pipe_is_the_file(tmp_path, quick):
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_files import qwen3moe_gguf

    from moesim.gguf_file import spec_from_gguf

    (path,) = qwen3moe_gguf(tmp_path / "m.gguf")
    fifo = tmp_path / "piped.gguf"
    os.mkfifo(fifo)
    feed(fifo, path.read_bytes())
    piped = spec_from_gguf(fifo)
    assert piped.source == str(fifo)  # the user's name, not the spooled file's
    assert replace(piped, source=str(path)) == spec_from_gguf(path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(MoesimError, match="junk.gguf: not a readable GGUF file"):
        spec_from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(MoesimError, match="is a device"):
        spec_from_gguf("/dev/null")


@pytest.mark.parametrize("experts, words", [
    ("[NaN, 1]", "NaN is not JSON"), ("[true, 1]", "whole number, got True"), ('["a", 1]', "got 'a'"),
    ("[1.5, 1]", "got 1.5"), ("[99999999999999999999, 1]", "outside [0, 16)"), ("[-1, 1]", "outside [0, 16)"),
    ("[[0], 1]", "got [0]"), ("7", "non-empty list"),
])
def test_hostile_jsonl_values_are_one_line(tmp_path, experts, words):
    from moesim.traces.importers import import_routing

    p = tmp_path / "d.jsonl"
    p.write_text(f'{{"token": 0, "layer": 0, "experts": {experts}}}\n')
    with pytest.raises(MoesimError, match=re.escape(words)) as e:
        import_routing("jsonl", p, "tiny")
    assert "\n" not in str(e.value)


def test_a_huge_token_index_is_refused_before_allocating(tmp_path):
    from moesim.traces.importers import import_routing

    p = tmp_path / "d.jsonl"
    p.write_text('{"token": 99999999999, "layer": 0, "experts": [0, 1]}\n')
    with pytest.raises(MoesimError, match="holds 1 record"):
        import_routing("jsonl", p, "tiny")
    p.write_text('{"token": 0, "layer": 0, "experts": [0, 1], "gates": [1e400, 0.5]}\n')
    with pytest.raises(MoesimError, match="finite and in"):
        import_routing("jsonl", p, "tiny")


def test_routing_dumps_through_pipes(tmp_path, quick):
    from moesim.traces.importers import import_routing

    ex = ROOT / "traces" / "examples"
    want = import_routing("vllm", ex / "vllm-synthetic-deepseek-v2-lite.json", "deepseek-v2-lite")
    for name in ("vllm-synthetic-deepseek-v2-lite.json", "vllm-synthetic-deepseek-v2-lite.npz"):
        r, w = os.pipe()  # /dev/fd/N has no suffix: the dump's first bytes say what it is
        threading.Thread(target=lambda w=w, name=name: (os.write(w, (ex / name).read_bytes()), os.close(w)),
                         daemon=True).start()
        try:
            got = import_routing("vllm", f"/dev/fd/{r}", "deepseek-v2-lite")
        finally:
            os.close(r)
        np.testing.assert_array_equal(got.true_ids, want.true_ids)
    for path, words in (("/dev/zero", "is a device"), (tmp_path, "is a folder"), (tmp_path / "no", "does not exist")):
        with pytest.raises(MoesimError, match=words):
            import_routing("npz", path, "tiny")


def test_record_weights_are_checked_before_loading(tmp_path):
    pytest.importorskip("torch")
    from moesim.executor.record import checkpoint_folder

    cfg = json.loads((SHIPPED / "config.json").read_text())
    cases = {
        "only-other-safetensors": ({}, {"estimator.safetensors": SHIPPED / "estimator.safetensors"},
                                   "none that transformers loads"),
        "other-hidden": ({"hidden_size": 256}, {"model.safetensors": SHIPPED / "model.safetensors"},
                         "embed_tokens.weight is [256, 128]"),
        "more-layers": ({"num_hidden_layers": 6}, {"model.safetensors": SHIPPED / "model.safetensors"},
                        "hold 4 layer(s)"),
        "more-experts": ({"num_experts": 64}, {"model.safetensors": SHIPPED / "model.safetensors"},
                         "32 routed expert(s) (numbered up to 31); config.json says 64"),
        # fewer in the config than in the weights: transformers' size-mismatch RuntimeError (a stranger's)
        "fewer-experts": ({"num_experts": 16}, {"model.safetensors": SHIPPED / "model.safetensors"},
                          "32 routed expert(s) (numbered up to 31); config.json says 16"),
        "unknown-model-type": ({"model_type": "nonexistent_xyz"}, {"model.safetensors": SHIPPED / "model.safetensors"},
                               "model_type 'nonexistent_xyz' is not a model the installed transformers"),
    }
    for name, (change, files, words) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        for target, source in files.items():
            (d / target).symlink_to(source)
        with pytest.raises(MoesimError, match=re.escape(words)):
            checkpoint_folder(d)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model-00001-of-00002.safetensors").symlink_to(SHIPPED / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(MoesimError, match=r"names 2 shard\(s\); 1 not there \(model-00002-of-00002"):
        checkpoint_folder(d)
    assert checkpoint_folder(SHIPPED) == SHIPPED
    # weights whose bytes disagree with their own header: one line before loading (were
    # safetensors' exceptions after the model began loading)
    raw = (SHIPPED / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F64" if header[name]["dtype"] != "F64" else "F32"
    edited = json.dumps(header).encode()
    for case, body, words in (("truncated", raw[: len(raw) // 2], "truncated or corrupt"),
                              ("dtype-edited", len(edited).to_bytes(8, "little") + edited + raw[8 + n:],
                               f"tensor {name} takes")):
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "model.safetensors").write_bytes(body)
        with pytest.raises(MoesimError, match=re.escape(words)):
            checkpoint_folder(d)


# -------------------------------------------------------------------------------------
# The real CLI
# -------------------------------------------------------------------------------------

@pytest.mark.parametrize("run, option", both_ways([("--hw",), ("--host",), ("--engine",)], sub=moesim))
def test_replay_refuses_a_device_profile_at_once(work, run, option):
    t0 = time.time()
    r = run("replay", "t.npz", option, "/dev/zero", cwd=work, timeout=60)
    one_line(r, "/dev/zero is a device, not a regular file")
    assert time.time() - t0 < 30


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_stats_on_a_silent_fifo_is_refused_not_missing(work, tmp_path, run, quick):
    os.mkfifo(tmp_path / "f.npz")
    line = one_line(run("stats", "f.npz", cwd=tmp_path, timeout=60), "named pipe (FIFO)")
    assert "does not exist" not in line


def test_stats_reads_a_fed_fifo_and_process_substitution(work, tmp_path):
    fifo = tmp_path / "f.npz"
    os.mkfifo(fifo)
    feed(fifo, (work / "t.npz").read_bytes(), deadline=60)
    r = moesim("stats", "f.npz", "--json", cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)
    rd, wr = os.pipe()  # what bash's <(cat t.npz) hands the command: /dev/fd/N, a pipe
    threading.Thread(target=lambda: (os.write(wr, (work / "t.npz").read_bytes()), os.close(wr)), daemon=True).start()
    try:
        r = moesim("stats", f"/dev/fd/{rd}", "--json", cwd=tmp_path, timeout=60, pass_fds=(rd,))
    finally:
        os.close(rd)
    assert r.returncode == 0, r.stderr


def test_a_spooled_trace_error_names_the_users_path(tmp_path):
    fifo = tmp_path / "bad.npz"
    os.mkfifo(fifo)
    feed(fifo, b"PK\x03\x04" + b"\0" * 100, deadline=60)
    line = one_line(moesim("stats", "bad.npz", cwd=tmp_path, timeout=60), "bad.npz")
    assert "moesim-pipe" not in line


@pytest.mark.parametrize("run, args", both_ways([
    (["stats", LONG + ".npz"],), (["replay", "t.npz", "--hw", LONG + ".toml"],), (["models", LONG],),
    (["import", "jsonl", LONG + ".jsonl", "--model", "tiny"],), (["synth", "--model", LONG, "--tokens", "2"],),
], sub=moesim))
def test_a_name_too_long_is_one_line(work, run, args):
    one_line(run(*args, cwd=work, timeout=60), "bytes; this file system allows")


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_import_of_a_plain_npy_and_hostile_jsonl_is_one_line(tmp_path, run):
    np.save(tmp_path / "r.npy", np.zeros((5, 27, 6), np.uint8))
    one_line(moesim("import", "vllm", "r.npy", "--model", "deepseek-v2-lite", cwd=tmp_path), "--prompt-tokens")
    (tmp_path / "d.jsonl").write_text('{"token": 0, "layer": 0, "experts": [NaN, 1]}\n')
    one_line(run("import", "jsonl", "d.jsonl", "--model", "tiny", cwd=tmp_path), "d.jsonl:1", "NaN")
    (tmp_path / "big.jsonl").write_text('{"token": 0, "layer": 0, "experts": [99999999999999999999, 1]}\n')
    one_line(run("import", "jsonl", "big.jsonl", "--model", "tiny", cwd=tmp_path), "outside [0, 16)")


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_record_prompts_file_is_checked(tmp_path, run, quick):
    pytest.importorskip("torch")
    os.mkfifo(tmp_path / "p.txt")
    one_line(run("record", "moe-stdlib", "--prompts-file", "p.txt", "--tokens", "1", cwd=tmp_path), "named pipe")
    one_line(run("record", "moe-stdlib", "--prompts-file", "/dev/zero", "--tokens", "1", cwd=tmp_path),
             "is a device")
    (tmp_path / "e.txt").write_text("\n\n")
    one_line(run("record", "moe-stdlib", "--prompts-file", "e.txt", "--tokens", "1", cwd=tmp_path), "no prompt")


def test_stats_reads_a_trace_piped_into_stdin(work):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, "-m", "moesim", "stats", "/dev/stdin", "--json"], cwd=work, env=env,
                       input=(work / "t.npz").read_bytes(), capture_output=True, timeout=60)  # `cat t.npz | moesim ...`
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert json.loads(r.stdout)


# -- round 4 (a stranger's fresh-clone run, issue 24): option values, outputs, notes -------------

@pytest.fixture(scope="module")
def r4(refusal_dir):
    return refusal_dir


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_whole_number_and_finite_options_are_one_line_not_a_traceback_or_cut(r4, run):
    eco = ("ecospec", "--model", "qwen3-235b-a22b", "--deployment", "1xh200-offload", "--steps", 2, "--gamma")
    cases = [(("stats", "t.npz", "--sizes", "nan"), "whole numbers"),  # was ValueError
             (("stats", "t.npz", "--sizes", "inf"), "whole numbers"),  # was OverflowError
             (("stats", "t.npz", "--sizes", "1.5"), "whole numbers"),  # was 1, silently
             (("stats", "t.npz", "--sizes", ""), "at least one value"),  # was the default sizes
             (("stats", "t.npz", "--hw", ""), "--hw ''"),  # was no --hw
             ((*eco, "nan"), "whole numbers"), ((*eco, "1.5"), "whole numbers"),
             ((*eco, 2, "--seed", -1), "--seed -1"), ((*eco, 2, "--draft", "dense:nan"), "finite"),
             (("synth", "--model", "tiny", "--tokens", 4, "--seed", -1, "--out", "s.npz"), "--seed -1"),
             (("synth", "--like", "t.npz", "--tokens", 4, "--seed", -1, "--out", "s.npz"), "--seed -1"),
             (("replay", "t.npz", "--hw", "a6000", "--policy", "cpu-static", "--sim", "fast", "--cpu-layers", -1),
              "--cpu-layers -1"),  # was TypeError
             (("replay", "t.npz", "--hw", "", "--sim", "fast"), "--hw ''")]  # was "hardware profile . is a directory"
    for args, words in sample(cases, run):
        one_line(run(*args, cwd=r4), words)
    assert not (r4 / "s.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_record_refuses_batch_0_and_a_temperature_that_is_not_finite_and_positive(tmp_path, run):
    for extra, words in sample((((("--batch", 0)), "--batch 0"), (("--temperature", -1), "--temperature -1"),
                         (("--temperature", "inf"), "--temperature inf")), run):
        one_line(run("record", "moe-stdlib", "--tokens", 1, "--out", "r.npz", *extra, cwd=tmp_path, timeout=120),
                       words)
    assert not list(tmp_path.glob("r.npz*"))


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_whatif_out_dot_writes_here_and_a_symlink_loop_is_one_line(tmp_path, run):
    (tmp_path / "loop").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")
    w = ("whatif", "--model", "tiny", "--hw", "a6000", "--tokens", 4, "--jobs", 1, "--policy", "on-demand",
         "--cache-gib", 0, "--json")
    one_line(run(*w, "--out", "loop/x", cwd=tmp_path), "--out loop/x", "cannot resolve")  # was RuntimeError
    here = tmp_path / "here"
    here.mkdir()
    r = run(*w, "--out", ".", cwd=here)  # was ValueError: PosixPath('.') has an empty name
    assert r.returncode == 0, r.stderr[-2000:]
    assert (here / "report.html").exists() and not list(tmp_path.rglob("*.lock"))


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_options_that_change_nothing_say_so_in_stats_synth_like_import_and_ecospec(r4, run):
    jsonl = ROOT / "traces" / "examples" / "routing-moe-stdlib.jsonl"
    ck = ROOT / "executor" / "checkpoints" / "moe-stdlib"
    for args, words in sample(((("stats", "t.npz", "--policy", "prefetch"), "--policy"),
                        (("synth", "--like", "t.npz", "--tokens", 4, "--skew", 2, "--out", "l.npz"), "--skew"),
                        (("import", "jsonl", jsonl, "--model", ck, "--prompt-tokens", 3, "--out", "i.npz"),
                         "--prompt-tokens"),
                        (("ecospec", "--model", "qwen3-235b-a22b", "--deployment", "1xh200-offload", "--steps", 2,
                          "--gamma", 2, "--selection", "confidence", "--recall", 0.5, "--json"), "--recall")), run):
        r = run(*args, cwd=r4)
        assert r.returncode == 0, r.stderr[-2000:]
        notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
        assert len(notes) == 1 and words in notes[0] and "changed nothing" in notes[0], r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_an_ecospec_budget_past_the_tree_says_it_verifies_the_whole_tree(tmp_path, run):
    """--gamma 10^8 verified the whole 30-candidate tree with no word: a note names the tree's size, and the
    row is the whole tree's (the same as --gamma 30)."""
    base = ("ecospec", "--model", "olmoe-1b-7b", "--deployment", "1xh200-offload", "--steps", 2,
            "--selection", "confidence", "--json")
    big, tree = (run(*base, "--gamma", g, cwd=tmp_path) for g in (100000000, 30))
    assert big.returncode == 0 and tree.returncode == 0, big.stderr[-2000:]
    notes = [ln for ln in big.stderr.splitlines() if ln.startswith("note:")]
    assert notes == ["note: --gamma 100000000 is more than a draft tree's 30 candidates (--branch 2, --depth 4): "
                     "verifies the whole tree, as --gamma 30"], big.stderr
    assert not [ln for ln in tree.stderr.splitlines() if ln.startswith("note:")]
    none = run(*base[:-1], "--gamma", 0, cwd=tmp_path)  # an empty table said nothing of why
    assert none.returncode == 0 and "note: --gamma 0 alone is decoding without speculation" in none.stderr, none.stderr
    rows = [{k: v for k, v in r.items() if k != "gamma"} for r in json.loads(big.stdout)]
    assert rows == [{k: v for k, v in r.items() if k != "gamma"} for r in json.loads(tree.stdout)]


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_import_checks_its_output_before_reading_the_model(r4, run):
    ck = ROOT / "executor" / "checkpoints" / "moe-stdlib"
    jsonl = ROOT / "traces" / "examples" / "routing-moe-stdlib.jsonl"
    one_line(run("import", "jsonl", jsonl, "--model", ck, "--out", "adir", cwd=r4), "--out adir")
    # the output is refused even where the model could never be read: it is checked first
    one_line(run("import", "jsonl", jsonl, "--model", "afile", "--out", "adir", cwd=r4), "--out adir")


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_whatif_with_a_trace_says_the_synthetic_shape_options_changed_nothing(r4, run):
    w = ("whatif", "--trace", "t.npz", "--hw", "a6000", "--jobs", 1, "--policy", "on-demand", "--cache-gib", 0, "--json",
         "--out", "w")
    notes = json.loads(run(*w, "--model", "olmoe-1b-7b", "--tokens", 999, "--batch", 4, cwd=r4).stdout)["notes"]
    assert any("--model, --tokens, --batch shape synthetic traces" in n and "changed nothing" in n for n in notes), notes
    assert not any("shape" in n for n in json.loads(run(*w, cwd=r4).stdout)["notes"])


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_a_one_step_trace_is_one_step_and_its_reuse_distance_is_said_in_words(tmp_path, run):
    """A 1-step trace printed `1 steps` and `median reuse distance None steps`."""
    write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=1)), tmp_path / "one.npz")
    r = run("stats", "one.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "olmoe-1b-7b: 1 step, batch 1" in r.stdout and "no expert was used again" in r.stdout, r.stdout
    assert "None" not in r.stdout and "1 steps" not in r.stdout
    r = run("replay", "one.npz", "--hw", "a6000", "--policy", "on-demand", cwd=tmp_path)
    assert r.returncode == 0 and " 1 step (" in " ".join(r.stdout.split()), r.stdout


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_every_policy_reports_the_traces_prediction_recall(tmp_path, run):
    """The stranger's round 5: replay's `pred recall` was 0.708 for the copy policies and nan for the
    CPU-compute ones on the same trace. It is the trace's, whatever the policy (on-demand's said it too)."""
    write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=40, seed=4)), tmp_path / "t.npz")
    r = run("replay", "t.npz", "--hw", "a6000", "--policy", "on-demand,cpu-static,cpu-on-miss", "--cache-gib", 1,
               "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    recalls = {row["policy"]: row["pred_recall"] for row in json.loads(r.stdout)}
    assert len(recalls) == 3 and len(set(recalls.values())) == 1 and 0 < recalls["on-demand"] < 1, recalls


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_replay_says_when_a_deployment_does_not_fit_the_gpu(tmp_path, run):
    """The stranger's round 6: replay timed all-resident Qwen3-30B-A3B (61 GB) on a 48 GB A6000 with no
    word, where whatif marks the same row `fits: false`. Both read one figure (time_plan's)."""
    write_trace(synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=8, seed=2)), tmp_path / "q.npz")
    r = run("replay", "q.npz", "--hw", "a6000", "--policy", "all-resident,on-demand", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    fits = {row["policy"]: row["fits"] for row in json.loads(r.stdout)}
    assert fits == {"all-resident": False, "on-demand": True}, fits
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "all-resident needs 61" in notes[0] and "does not fit" in notes[0], r.stderr
    w = run("whatif", "--trace", "q.npz", "--hw", "a6000", "--policy", "all-resident", "--json", cwd=tmp_path)
    assert w.returncode == 0, w.stderr[-2000:]
    answer = json.loads(w.stdout)
    assert answer["best"] is None and [row["fits"] for row in answer["rows"]] == [False], answer


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_weight_streaming_counts_the_bytes_it_reads_over_the_link(tmp_path, run):
    """weight-streaming said 0.0 GB moved a token beside tens of ms of link time: the streamed layers'
    weights (dense, and the routed experts the kernels read) are what crosses the link."""
    write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=16, seed=5)), tmp_path / "o.npz")
    r = run("replay", "o.npz", "--hw", "a6000", "--policy", "weight-streaming", "--offload-gib", 5, "--json",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)
    rate = row["gb_moved_per_token"] / (row["copy_ms"] / 1e3)  # GB/s the link carried
    assert row["gb_moved_per_token"] < row["offload_gib"] * 2**30 / 1e9  # only what a token reads
    assert 0.5 * row["link_gbps"] < rate < 1.5 * row["link_gbps"], row


@pytest.mark.parametrize("args, words", [
    (("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--link-gbps", "16,16.0"), "'16.0' appears twice (the same as '16')"),
    (("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--cache-gib", "8,08"), "'08' appears twice (the same as '8')"),
    (("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--policy", "prefetch,prefetch-fom"),
     "'prefetch-fom' appears twice (the same as 'prefetch')"),
])
def test_a_sweep_value_given_twice_however_spelled_is_refused(tmp_path, args, words):
    """16,16.0 or an alias and its policy wrote every row twice; 16,16 was refused already."""
    r = moesim(*args, "--tokens", 8, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {args[-2]}: {words}"], r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_lists_by_position_take_repeated_values(tmp_path, run):
    """An equal --tensor-split 1,1 (llama.cpp's) and per-depth --accept 0.8,0.8,0.6 were refused as repeats."""
    write_trace(synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=8, seed=6)), tmp_path / "o.npz")
    r = run("replay", "o.npz", "--hw", "2xa6000", "--policy", "all-resident", "--tensor-split", "1,1", "--json",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run("ecospec", "--model", "olmoe-1b-7b", "--deployment", "1xh200-offload", "--steps", 2, "--gamma", 2,
               "--accept", "0.8,0.8,0.6", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_synth_refuses_an_output_another_run_holds_and_an_empty_prompt(tmp_path):
    """Two synth runs on one --out both said `wrote` and the second's trace replaced the first's; and
    --prompt-len 0 made a trace whose replay said TTFT 0.0 ms (whatif refuses 0)."""
    from moesim.atomic import exclusive

    with exclusive(tmp_path / "m.npz"):  # what a first run holds while it draws and writes
        r = moesim("synth", "--model", "olmoe-1b-7b", "--tokens", 4, "--out", "m.npz", cwd=tmp_path)
    assert r.returncode == 2 and "is in use by another moesim run" in r.stderr and not (tmp_path / "m.npz").exists()
    r = moesim("synth", "--model", "olmoe-1b-7b", "--tokens", 4, "--prompt-len", 0, "--out", "p.npz", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: --prompt-len 0: a whole number >= 1", r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_models_takes_a_llama_cpp_file_type_as_replay_does(tmp_path, run):
    """`models --expert-dtype q4_k_m` said "unknown expert dtype" where whatif and replay take it."""
    r = run("models", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)["models"]
    assert row["model"] == "qwen3-30b-a3b@q4_k_m" and row["expert_bytes"] < get_model("qwen3-30b-a3b").expert_bytes / 3
    r = run("models", "--expert-dtype", "q4_k_m", "--json", cwd=tmp_path)
    assert r.returncode == 0 and len(json.loads(r.stdout)["models"]) > 10, r.stderr[-2000:]


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_a_speculative_replay_refuses_a_negative_lambda_as_ecospec_does(tmp_path, run):
    """replay of a speculative trace used --lambda -1 (ecospec refuses a negative lambda) and a negative
    --acceptance."""
    r = run("synth", "--speculative", "--model", "olmoe-1b-7b", "--tokens", 4, "--out", "sd.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    base = ("replay", "sd.npz", "--gamma", 2, "--selection", "ecospec", "--score", "lagrangian")
    for extra, line in ((("--lambda", "-1"), "error: --lambda -1: the Lagrangian score's lambda must be a number >= 0"),
                        (("--lambda", "nan"), "error: --lambda nan: the Lagrangian score's lambda must be a number >= 0"),
                        (("--acceptance", "-1"), "error: --acceptance -1: a positive number (it scales the draft's "
                                                 "probabilities)")):
        r = run(*base, *extra, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip() == line, r.stderr
