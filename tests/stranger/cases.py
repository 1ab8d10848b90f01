"""Try moesim as a stranger: hostile invocations of the real CLI, grouped by class.

Run ``python tests/stranger/cases.py`` (``--jobs N`` workers, ``--only CLASS``, ``-v``
for every case). It builds its fixture files in a temporary folder, runs every case as
``python -m moesim ...`` in a subprocess, prints how each ended and a table per class,
and exits 1 if any ended badly:

- ``error``: exit 2 and exactly one line on stderr, ``error: ...`` (a clean refusal);
- ``ok``: exit 0 and the case's check of the result passed (a valid result);
- ``interrupted``: a signalled run that exited 130, 143 or 129 (Ctrl-C, SIGTERM, SIGHUP; or 0, done before it) with no
  traceback and no temporary file left behind;
- ``traceback``, ``hang`` (past the case's time limit), ``wrong`` (exit 0 where a
  refusal was due or the reverse, more than one stderr line, a result that fails its
  check, a changed input file, a leftover ``.tmp``) are the bad endings.

``tests/test_stranger.py`` runs a fast subset in the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BAD = ("traceback", "hang", "wrong")


@dataclass
class Case:
    cls: str
    args: list[str]
    expect: str = "error"  # error | ok | either | interrupt
    check: Callable[[Path, str], str | None] | None = None  # (cwd, stdout) -> problem or None
    timeout: float = 60.0
    signal_after: float | None = None  # send SIGINT/SIGTERM after this many seconds
    sig: int = signal.SIGINT
    needs: str | None = None  # a fixture that may be unavailable (e.g. "readonly")
    before: Callable[[Path], None] | None = None
    fast: bool = False  # part of the test suite's subset
    name: str = ""


@dataclass
class Outcome:
    case: Case
    ending: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


# -------------------------------------------------------------------------------------
# Fixtures
# -------------------------------------------------------------------------------------

def make_readonly(path: Path) -> str | None:
    """Make ``path`` a folder nobody can write in (root included); return how, or None.

    chmod 0555 stops ordinary users but not root (tests often run as root); an immutable
    folder (chattr +i) stops root on ext4/xfs; else we cannot make one here."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o555)
    if _unwritable(path):
        return "chmod 0555"
    chattr = shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    if chattr and _unwritable(path):
        return "chattr +i"
    return None


def undo_readonly(path: Path) -> None:
    if path.exists():
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        os.chmod(path, 0o755)


def _unwritable(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return False
    except OSError:
        return True


def run_moesim(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "moesim", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, errors="replace")


def build_fixtures(d: Path, measured: bool = True) -> dict[str, str]:
    """Valid and broken input files in ``d``; returns notes (e.g. how the read-only folder was made).
    ``measured``: also record a (short) executor trace, od.npz (needs torch, takes seconds)."""
    import numpy as np

    notes = {}
    r = run_moesim(["synth", "--model", "tiny", "--tokens", "8", "--prompt-len", "4", "--out", "t.npz"], d)
    assert r.returncode == 0, r.stderr
    r = run_moesim(["synth", "--model", "tiny", "--tokens", "8", "--batch", "2", "--out", "t2.npz"], d)
    assert r.returncode == 0, r.stderr
    if measured:
        r = run_moesim(["profile", "--model", "tiny", "--policy", "on-demand", "--tokens", "4", "--link-gbps", "0.5",
                        "--out", "od.npz"], d, timeout=300)
        assert r.returncode == 0, r.stderr
    rng = np.random.default_rng(0)
    (d / "random.npz").write_bytes(rng.bytes(4096))
    (d / "empty.npz").write_bytes(b"")
    (d / "text.npz").write_text("hello, I am not a trace\n")
    (d / "utf16.npz").write_bytes("not a trace".encode("utf-16"))
    data = (d / "t.npz").read_bytes()
    (d / "truncated.npz").write_bytes(data[: len(data) // 2])
    np.save(d / "array.npy", np.arange(10))
    shutil.copy(d / "array.npy", d / "array.npz")
    with np.load(d / "t.npz") as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(d / "noheader.npz", **{k: v for k, v in arrays.items() if k != "header"})
    np.savez(d / "badjson.npz", **{**arrays, "header": np.frombuffer(b"{not json", np.uint8)})
    np.savez(d / "latin1header.npz", **{**arrays, "header": np.frombuffer("{\"a\": \"\xe9\"}".encode("latin-1"), np.uint8)})
    header = json.loads(bytes(arrays["header"]).decode())
    for name, h in {"listheader.npz": [1, 2], "v99.npz": {**header, "version": 99},
                    "lies.npz": {**header, "n_tokens": 10**9}, "badmodel.npz": {**header, "model": "x"}}.items():
        np.savez(d / name, **{**arrays, "header": np.frombuffer(json.dumps(h).encode(), np.uint8)})
    np.savez(d / "noroute.npz", **{k: v for k, v in arrays.items() if k != "true_ids"})
    np.savez(d / "badids.npz", **{**arrays, "true_ids": np.full(arrays["true_ids"].shape, 999, np.int16)})  # 999 needs int16
    np.savez(d / "nangates.npz", **{**arrays, "true_gates": np.full_like(arrays["true_gates"], np.nan)})
    np.savez(d / "wrongshape.npz", **{**arrays, "true_ids": arrays["true_ids"][:, :1]})
    np.savez(d / "floatids.npz", **{**arrays, "true_ids": arrays["true_ids"].astype(np.float32)})
    np.savez(d / "extra.npz", **{**arrays, "surprise": np.zeros(3)})
    (d / "dir").mkdir()
    (d / "afile").write_text("x")
    (d / "binary.toml").write_bytes(rng.bytes(512))
    (d / "latin1.toml").write_bytes("name = \"caf\xe9\"\n".encode("latin-1"))
    (d / "bad.toml").write_text("name = [unclosed\n")
    (d / "empty.toml").write_text("")
    prof = (ROOT / "hwprofiles" / "a6000.toml").read_text()
    (d / "a6000-copy.toml").write_text(prof)
    (d / "negative.toml").write_text(prof.replace("value = ", "value = -", 1))
    (d / "nofigures.toml").write_text("name = \"x\"\ndescription = \"d\"\nlink = \"pcie4\"\n")
    (d / "utf16.toml").write_bytes(prof.encode("utf-16"))
    (d / "model-badjson").mkdir()
    (d / "model-badjson" / "config.json").write_text("{nope")
    (d / "model-binary").mkdir()
    (d / "model-binary" / "config.json").write_bytes(rng.bytes(300))
    (d / "model-list").mkdir()
    (d / "model-list" / "config.json").write_text("[1, 2, 3]")
    (d / "model-zero").mkdir()
    (d / "model-zero" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 0, "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
        "moe_intermediate_size": 32, "vocab_size": 100}))
    (d / "model-empty").mkdir()
    (d / "binary.txt").write_bytes(rng.bytes(2048))
    how = make_readonly(d / "ro")
    notes["readonly"] = how or ""
    return notes


# -------------------------------------------------------------------------------------
# Checks of valid results
# -------------------------------------------------------------------------------------

def json_rows(cwd: Path, stdout: str) -> str | None:
    try:
        obj = json.loads(stdout)
    except json.JSONDecodeError as e:
        return f"stdout is not JSON ({e})"
    rows = obj["rows"] if isinstance(obj, dict) and "rows" in obj else obj
    if not isinstance(rows, list) or not rows:
        return "no rows"
    for r in rows:
        v = r.get("tpot_ms")
        if not isinstance(v, int | float) or not v > 0 or v != v or v == float("inf"):
            return f"tpot_ms {v!r} is not a positive number"
    return None


def trace_file(name: str) -> Callable[[Path, str], str | None]:
    def check(cwd: Path, stdout: str) -> str | None:
        sys.path.insert(0, str(ROOT))
        from moesim.errors import MoesimError
        from moesim.traces.format import read_trace

        try:
            read_trace(cwd / name)
        except MoesimError as e:
            return f"{name} does not read back: {e}"
        return None
    return check


def no_tmp(cwd: Path, stdout: str) -> str | None:
    left = [str(p.relative_to(cwd)) for p in cwd.rglob("*.tmp")]
    return f"temporary files left: {left}" if left else None


def stale_tmp(cwd: Path) -> None:
    """A temporary file as a writer killed outright (SIGKILL) leaves it: a dead pid."""
    (cwd / ".stale.npz.999999999.abcd1234.tmp").write_bytes(b"half a trace")


# -------------------------------------------------------------------------------------
# The cases
# -------------------------------------------------------------------------------------

def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    # bad paths: outputs
    writers = [
        (["synth", "--model", "tiny", "--tokens", "4"], "file"),
        (["replay", "t.npz", "--policy", "on-demand", "--sim", "fast"], "dir"),
        (["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand", "--cache-gib", "0", "--tokens", "4",
          "--jobs", "1"], "dir"),
        (["profile", "--model", "tiny", "--tokens", "2"], "file"),
        (["fit", "od.npz"], "toml"),
        (["train", "--steps", "1", "--batch", "1", "--seq", "8"], "dir"),
        (["calibrate", "--tokens", "64"], "dir"),
        (["speculate", "--tokens", "2"], "file"),
        (["validate", "--tokens", "3"], "dir"),
        (["train-estimator", "--tokens", "64"], "dir"),
        (["train-expert-predictor", "--tokens", "64"], "dir"),
        (["profile", "--hardware"], "toml"),
    ]
    for args, kind in writers:
        fast = args[0] == "synth"
        wrong = "dir" if kind in ("file", "toml") else "afile"
        add(Case("bad paths", [*args, "--out", wrong], fast=fast))
        add(Case("bad paths", [*args, "--out", "afile/sub" + (".toml" if kind == "toml" else "")], fast=fast))
        add(Case("bad paths", [*args, "--out", "ro/x" + (".toml" if kind == "toml" else ".npz" if kind == "file" else "")],
                 needs="readonly", fast=fast))
        add(Case("bad paths", [*args, "--out", "ro/deeper/x" + (".toml" if kind == "toml" else "")], needs="readonly"))
    for args in (["replay", "missing.npz"], ["replay", "dir"], ["fit", "dir"], ["fit", "missing.npz"],
                 ["whatif", "--trace", "dir", "--jobs", "1"], ["replay", "t.npz", "--hw", "missing.toml"],
                 ["replay", "t.npz", "--hw", "dir"], ["models", "dir"], ["models", "missing-dir/config.json"],
                 ["calibrate", "--text", "dir", "--out", "cal"], ["calibrate", "--text", "missing.txt", "--out", "cal"],
                 ["profile", "--model", "dir", "--tokens", "2"], ["speculate", "--draft", "dir", "--tokens", "2"],
                 ["hw", "dir"], ["hw", "afile"]):
        add(Case("bad paths", list(args), fast=args == ["replay", "dir"]))

    # bad numbers
    for opt, vals in {"--tokens": ["0", "-1", "abc", "1.5"], "--batch": ["0", "-3"], "--prompt-len": ["-1"],
                      "--skew": ["-1", "nan", "inf"], "--reuse": ["1.5", "-0.1"], "--hit-rate": ["2"],
                      "--early-layers": ["-1"]}.items():
        for v in vals:
            add(Case("bad numbers", ["synth", "--model", "tiny", opt, v, "--out", "n.npz"], fast=v == "nan"))
    for opt, vals in {"--link-gbps": ["0", "-1", "nan", "inf", "abc"], "--cache-gib": ["-1", "nan"],
                      "--cache-experts": ["-5"], "--step": ["99", "-1"]}.items():
        for v in vals:
            add(Case("bad numbers", ["replay", "t.npz", "--policy", "on-demand", "--sim", "fast", opt, v]))
    for opt, v in (("--link-gbps", "1,,x"), ("--link-gbps", "0"), ("--cache-gib", "-1"), ("--cache-gib", "nan"),
                   ("--tokens", "0"), ("--batch", "0"), ("--top", "-1"), ("--jobs", "-2"), ("--link-gbps", ",")):
        add(Case("bad numbers", ["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand",
                                 "--cache-gib", "0", "--tokens", "4", "--jobs", "1", "--out", "w", opt, v]))
    for opt, v in (("--tokens", "0"), ("--threads", "0"), ("--temperature", "-1"), ("--temperature", "nan"),
                   ("--prompt-len", "0"), ("--cache-experts", "-1"), ("--fidelity-tokens", "-1")):
        add(Case("bad numbers", ["profile", "--model", "tiny", "--tokens", "2", "--out", "p.npz", opt, v]))
    for args in (["train", "--steps", "0", "--out", "tr"], ["train", "--lr", "0", "--steps", "1", "--out", "tr"],
                 ["train", "--hidden", "63", "--steps", "1", "--out", "tr"], ["validate", "--tokens", "2"],
                 ["validate", "--repeats", "0"], ["speculate", "--gamma", "-1", "--tokens", "2"],
                 ["speculate", "--lambda", "nan", "--tokens", "2", "--score", "lagrangian"],
                 ["replay", "t.npz", "--gamma", "2"]):
        add(Case("bad numbers", list(args)))

    # bad files: traces, profiles, model configs
    for f in ("random.npz", "empty.npz", "text.npz", "utf16.npz", "truncated.npz", "array.npy", "array.npz",
              "noheader.npz", "badjson.npz", "latin1header.npz", "listheader.npz", "v99.npz", "lies.npz",
              "badmodel.npz", "noroute.npz", "badids.npz", "nangates.npz", "wrongshape.npz", "floatids.npz",
              "extra.npz", "binary.toml"):
        add(Case("bad files", ["replay", f, "--sim", "fast"], fast=f in ("random.npz", "latin1header.npz")))
    for f in ("random.npz", "empty.npz", "badids.npz"):
        add(Case("bad files", ["whatif", "--trace", f, "--jobs", "1", "--out", "w"]))
        add(Case("bad files", ["fit", f]))
    for f in ("t.npz", "binary.toml", "latin1.toml", "bad.toml", "empty.toml", "negative.toml", "nofigures.toml",
              "utf16.toml", "afile"):
        add(Case("bad files", ["replay", "t.npz", "--sim", "fast", "--policy", "on-demand", "--hw", f],
                 fast=f == "t.npz"))
    for f in ("binary.toml", "t.npz"):
        add(Case("bad files", ["hw", f]))
    for d in ("model-badjson", "model-binary", "model-list", "model-zero", "model-empty"):
        add(Case("bad files", ["models", d], fast=d == "model-binary"))
        add(Case("bad files", ["synth", "--model", d, "--tokens", "2", "--out", "m.npz"]))
    add(Case("bad files", ["fit", "t.npz"]))
    add(Case("bad files", ["replay", "t.npz", "--validate"]))
    add(Case("bad files", ["fit", "t2.npz"]))
    add(Case("bad files", ["calibrate", "--text", "binary.txt", "--tokens", "64", "--out", "cal"], expect="ok",
             timeout=180))

    # absurd sizes
    for args in (["synth", "--model", "tiny", "--tokens", "1000000000000", "--out", "big.npz"],
                 ["synth", "--model", "qwen3-30b-a3b", "--tokens", "100000000", "--out", "big.npz"],
                 ["synth", "--model", "tiny", "--batch", "1000000000", "--out", "big.npz"],
                 ["whatif", "--model", "tiny", "--tokens", "1000000000000", "--jobs", "1", "--out", "w"],
                 ["whatif", "--model", "qwen3-30b-a3b", "--batch", "100000000", "--tokens", "4", "--jobs", "1",
                  "--out", "w"],
                 ["profile", "--model", "qwen3-30b-a3b", "--tokens", "2", "--out", "p.npz"],
                 ["profile", "--model", "qwen3-30b-a3b", "--layers", "0", "--tokens", "2", "--out", "p.npz"],
                 ["profile", "--model", "tiny", "--layers", "1000", "--tokens", "2", "--out", "p.npz"],
                 ["profile", "--model", "tiny", "--link-gbps", "1e-9", "--tokens", "2", "--out", "p.npz"],
                 ["profile", "--model", "tiny", "--tokens", "1000000000000", "--out", "p.npz"],
                 ["profile", "--model", "tiny", "--batch", "1000000000", "--tokens", "2", "--out", "p.npz"],
                 ["train", "--steps", "1", "--batch", "100000000", "--out", "tr"]):
        add(Case("absurd sizes", list(args), timeout=90, fast=args[0] == "synth" and "tiny" in args))
    for args in (["profile", "--model", "tiny", "--cache-gib", "1e9", "--tokens", "2", "--fidelity-tokens", "0",
                  "--out", "p.npz"],
                 ["replay", "t.npz", "--cache-gib", "1e12", "--policy", "on-demand", "--sim", "fast", "--json"],
                 ["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand", "--cache-gib", "1e12",
                  "--tokens", "4", "--jobs", "1", "--json", "--out", "w"]):
        add(Case("absurd sizes", list(args), expect="ok", timeout=180,
                 check=json_rows if "--json" in args else trace_file("p.npz")))

    # encodings and odd text
    for args, expect in ((["replay", "t.npz", "--hw", "a6\udce9000"], "error"),
                         (["synth", "--model", "ti\u00f1y", "--out", "e.npz"], "error"),
                         (["replay", "t.npz", "--policy", "\u00f6n-demand"], "error"),
                         (["replay", "t.npz", "--policy", "on-demand\t"], "either"),
                         (["models", "\U0001f600"], "error"),
                         (["synth", "--model", "tiny", "--tokens", "4", "--out", "caf\u00e9 tr\u00e4ce.npz"], "ok"),
                         (["synth", "--model", "tiny", "--tokens", "4", "--out", "\U0001f600.npz"], "ok"),
                         (["replay", "t.npz", "--hw", "latin1.toml"], "error"),
                         (["replay", "t.npz", "--hw", "utf16.toml"], "error"),
                         (["replay", "latin1header.npz"], "error"),
                         (["synth", "--model", "tiny", "--tokens", "\u0663"], "either"),
                         (["replay", "t.npz", "--link-gbps", "\uff11"], "either"),
                         (["whatif", "--model", "tiny", "--hw", "a6000", "--link-gbps", "1\u00a0", "--tokens", "4",
                           "--jobs", "1", "--policy", "on-demand", "--cache-gib", "0", "--json", "--out", "w"], "either"),
                         (["profile", "--model", "tiny", "--tokens", "2", "--prompt", "h\u00e9llo \U0001f600",
                           "--out", "p.npz"], "ok"),
                         (["hw", "\u00e46000"], "error")):
        check = None
        if expect == "ok" and args[0] == "synth":
            check = trace_file(args[args.index("--out") + 1])
        add(Case("encodings", list(args), expect=expect, check=check, timeout=120, fast=expect == "ok" and args[0] == "synth"))

    # duplicate names
    add(Case("duplicate names", ["whatif", "--model", "tiny", "--hw", "a6000,a6000", "--tokens", "4", "--jobs", "1",
                                 "--cache-gib", "0", "--policy", "on-demand", "--out", "w"], fast=True))
    add(Case("duplicate names", ["whatif", "--model", "tiny", "--hw", "a6000,a6000-copy.toml", "--tokens", "4",
                                 "--jobs", "1", "--cache-gib", "0", "--policy", "on-demand", "--out", "w"]))
    add(Case("duplicate names", ["whatif", "--model", "tiny", "--hw", "A6000,a6000", "--tokens", "4", "--jobs", "1",
                                 "--cache-gib", "0", "--policy", "on-demand", "--out", "w"]))
    for args in (["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand,on-demand", "--tokens", "4",
                  "--jobs", "1", "--cache-gib", "0", "--json", "--out", "w"],
                 ["whatif", "--model", "tiny,tiny", "--hw", "a6000", "--policy", "on-demand", "--tokens", "4",
                  "--jobs", "1", "--cache-gib", "0", "--json", "--out", "w"],
                 ["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand", "--tokens", "4", "--jobs", "1",
                  "--cache-gib", "0,0", "--json", "--out", "w"],
                 ["whatif", "--model", "tiny", "--hw", "a6000", "--policy", "on-demand", "--tokens", "4", "--jobs", "1",
                  "--cache-gib", "0", "--link-gbps", "16,16", "--json", "--out", "w"],
                 ["replay", "t.npz", "--policy", "on-demand,on-demand", "--sim", "fast", "--json"],
                 ["replay", "t.npz", "--policy", "prefetch,prefetch-fom", "--sim", "fast", "--json"]):
        add(Case("duplicate names", list(args), expect="either", check=json_rows))

    # interrupted runs
    add(Case("interrupted runs", ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--tokens", "2048",
                                  "--jobs", "1", "--sim", "simpy", "--out", "wi"], expect="interrupt",
             signal_after=4.0, sig=signal.SIGINT, check=no_tmp))
    add(Case("interrupted runs", ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--tokens", "2048",
                                  "--jobs", "1", "--sim", "simpy", "--out", "wi"], expect="interrupt",
             signal_after=4.0, sig=signal.SIGTERM, check=no_tmp))
    add(Case("interrupted runs", ["replay", "big.npz", "--sim", "simpy"], expect="interrupt", signal_after=2.0,
             sig=signal.SIGTERM, check=no_tmp,
             before=lambda d: run_moesim(["synth", "--model", "qwen3-30b-a3b", "--tokens", "4096", "--out", "big.npz"], d)))
    add(Case("interrupted runs", ["synth", "--model", "qwen3-30b-a3b", "--tokens", "20000", "--out", "s.npz"],
             expect="interrupt", signal_after=2.0, sig=signal.SIGTERM, check=no_tmp))
    add(Case("interrupted runs", ["profile", "--model", "tiny", "--tokens", "400", "--link-gbps", "0.05",
                                  "--out", "pi.npz"], expect="interrupt", signal_after=8.0, sig=signal.SIGINT,
             check=lambda d, s: no_tmp(d, s) or (trace_file("pi.npz")(d, s) if (d / "pi.npz").exists() else None)))
    add(Case("interrupted runs", ["profile", "--model", "tiny", "--tokens", "3000", "--link-gbps", "0.05",
                                  "--policy", "prefetch-fom", "--predictor", "stale", "--copy-queue", "demand-first",
                                  "--out", "pq.npz"], expect="interrupt", signal_after=8.0, sig=signal.SIGINT,
             check=lambda d, s: no_tmp(d, s) or (trace_file("pq.npz")(d, s) if (d / "pq.npz").exists() else None)))
    add(Case("interrupted runs", ["synth", "--model", "tiny", "--tokens", "4", "--out", "stale.npz"], expect="ok",
             before=stale_tmp, check=lambda d, s: no_tmp(d, s) or trace_file("stale.npz")(d, s), fast=True))

    # unknown names and mismatches
    for args in (["synth", "--model", "nope"], ["replay", "t.npz", "--hw", "nope"], ["replay", "t.npz", "--policy", "nope"],
                 ["replay", "t.npz", "--sim", "nope"], ["replay", "t.npz", "--eviction", "nope", "--cache-gib", "1"],
                 ["replay", "t.npz", "--timing", "nope"], ["whatif", "--goal", "nope", "--model", "tiny"],
                 ["profile", "--model", "tiny", "--device", "nope", "--tokens", "2"],
                 ["profile", "--model", "tiny", "--dtype", "fp8", "--tokens", "2"],
                 ["profile", "--model", "tiny", "--predictor", "nope", "--tokens", "2"],
                 ["speculate", "--selection", "nope", "--tokens", "2"], ["hw", "nope"], ["models", "nope"],
                 ["replay", "t.npz", "--model", "olmoe-1b-7b"], ["replay", "t.npz", "--cache-gib", "1", "--cache-experts", "2"],
                 ["replay", "t.npz", "--timing", "measured"], ["replay", "t.npz", "--hw", "a6000,h200"],
                 ["profile", "--model", "moe-stdlib", "--layers", "2", "--tokens", "2"],
                 ["profile", "--model", "tiny", "--copy-queue", "nope", "--tokens", "2"],
                 ["profile", "--model", "tiny", "--copy-queue", "demand-first", "--policy", "all-resident", "--tokens", "2"],
                 ["replay", "t.npz", "--copy-queue", "nope"],
                 ["replay", "t.npz", "--copy-queue", "demand-first", "--sim", "fast"],
                 ["nonsense-command"], ["replay"]):
        add(Case("unknown names", list(args), fast=args in (["replay", "t.npz", "--policy", "nope"], ["nonsense-command"])))
    # Round 3 (issue 24): each class family in its own module, sharing Case and the fixtures.
    from cases_inputs import input_cases  # noqa: PLC0415 (they import Case from here)
    from cases_round4 import round4_cases  # noqa: PLC0415 (round 4: a stranger's fresh-clone run)
    from cases_round10 import round10_cases  # noqa: PLC0415 (rounds 10 and 11: what the user sees is true)
    from cases_round14 import round14_cases  # noqa: PLC0415 (round 14: trust, round 5)
    from cases_sweeps import sweep_cases  # noqa: PLC0415

    c += input_cases() + sweep_cases() + round4_cases() + round10_cases() + round14_cases()
    for i, k in enumerate(c):
        k.name = f"{k.cls[:3]}-{i:03d}"
    return c


# -------------------------------------------------------------------------------------
# Running
# -------------------------------------------------------------------------------------

def _digest(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.iterdir()):
        if p.is_file():
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_case(case: Case, fixtures: Path, notes: dict[str, str]) -> Outcome:
    if case.needs == "readonly" and not notes.get("readonly"):
        return Outcome(case, "skipped", "no way to make a read-only folder here (not root-proof)")
    with tempfile.TemporaryDirectory(prefix="stranger-") as tmp:
        cwd = Path(tmp)
        for p in fixtures.iterdir():
            if p.name == "ro":
                continue
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, cwd / p.name)
        if case.needs == "readonly":
            (cwd / "ro").symlink_to(fixtures / "ro")
        if case.before:
            case.before(cwd)
        before = _digest(cwd)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "80"}
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "moesim", *case.args], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            if case.signal_after is not None:
                try:
                    proc.wait(case.signal_after)
                except subprocess.TimeoutExpired:
                    proc.send_signal(case.sig)
            stdout, stderr = proc.communicate(timeout=case.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return Outcome(case, "hang", f"no answer after {case.timeout:.0f} s", time.time() - t0)
        secs = time.time() - t0
        after = _digest(cwd)
        changed = [k for k, v in before.items() if after.get(k) != v and k != ".stale.npz.999999999.abcd1234.tmp"]
        return classify(case, proc.returncode, stdout, stderr, cwd, changed, secs)


def safe_run(case: Case, fixtures: Path, notes: dict[str, str]) -> Outcome:
    """:func:`run_case`, with a failure of the harness itself reported as a bad ending."""
    try:
        return run_case(case, fixtures, notes)
    except Exception as e:  # noqa: BLE001
        return Outcome(case, "wrong", f"harness could not run the case: {type(e).__name__}: {e}")


def classify(case: Case, rc: int, stdout: str, stderr: str, cwd: Path, changed: list[str], secs: float) -> Outcome:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    first = lines[0][:160] if lines else ""
    if "Traceback" in stderr or rc not in (0, 2, 129, 130, 143):
        tail = lines[-1][:160] if lines else f"exit {rc}"
        return Outcome(case, "traceback", f"exit {rc}: {tail}", secs)
    if changed:
        return Outcome(case, "wrong", f"changed input file(s) {changed}", secs)
    if case.expect == "interrupt":
        if case.signal_after is not None and rc in (0, 129, 130, 143):
            problem = case.check(cwd, stdout) if case.check else None
            if problem:
                return Outcome(case, "wrong", problem, secs)
            return Outcome(case, "interrupted" if rc in (129, 130, 143) else "ok", first, secs)
        return Outcome(case, "wrong", f"exit {rc}: {first}", secs)
    leftovers = no_tmp(cwd, stdout)
    if leftovers:
        return Outcome(case, "wrong", leftovers, secs)
    if rc == 2:
        if len(lines) != 1 or not lines[0].startswith("error: "):
            return Outcome(case, "wrong", f"exit 2 with {len(lines)} stderr lines: {first}", secs)
        if case.expect == "ok":
            return Outcome(case, "wrong", f"refused a valid run: {first}", secs)
        return Outcome(case, "error", first, secs)
    if rc == 0:
        if case.expect == "error":
            return Outcome(case, "wrong", "exit 0 where a one-line refusal was due" + (f": {first}" if first else ""), secs)
        problem = case.check(cwd, stdout) if case.check else None
        if problem:
            return Outcome(case, "wrong", problem, secs)
        return Outcome(case, "ok", first, secs)
    return Outcome(case, "wrong", f"exit {rc}: {first}", secs)


def run_all(selected: list[Case], jobs: int = 2, verbose: bool = False) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="stranger-fixtures-") as tmp:
        fixtures = Path(tmp)
        try:
            notes = build_fixtures(fixtures, measured=any("od.npz" in k.args for k in selected))
            with ThreadPoolExecutor(jobs) as pool:
                outcomes = []
                for o in pool.map(lambda k: safe_run(k, fixtures, notes), selected):
                    outcomes.append(o)
                    if verbose or o.ending in BAD:
                        print(f"{o.case.name} {o.ending:11s} {o.seconds:5.1f}s  moesim {' '.join(o.case.args)}\n"
                              f"    {o.detail}", flush=True)
        finally:
            undo_readonly(fixtures / "ro")
    return outcomes


def summary_table(outcomes: list[Outcome]) -> str:
    endings = ["error", "ok", "interrupted", "skipped", *BAD]
    per: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        per[o.case.cls][o.ending] += 1
    width = max(len(k) for k in per) + 2
    head = "class".ljust(width) + "".join(f"{e:>12s}" for e in endings) + f"{'total':>8s}"
    rows = [head, "-" * len(head)]
    total: Counter = Counter()
    for cls, cnt in per.items():
        total.update(cnt)
        rows.append(cls.ljust(width) + "".join(f"{cnt[e]:12d}" for e in endings) + f"{sum(cnt.values()):8d}")
    rows.append("-" * len(head))
    rows.append("all".ljust(width) + "".join(f"{total[e]:12d}" for e in endings) + f"{sum(total.values()):8d}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", help="run one class (e.g. 'bad paths')")
    ap.add_argument("--fast", action="store_true", help="the test suite's subset only")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    selected = [k for k in cases() if (a.only is None or k.cls == a.only) and (not a.fast or k.fast)]
    t0 = time.time()
    outcomes = run_all(selected, a.jobs, a.verbose)
    print(summary_table(outcomes))
    bad = [o for o in outcomes if o.ending in BAD]
    print(f"{len(outcomes)} invocations in {time.time() - t0:.0f} s; {len(bad)} ended badly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
