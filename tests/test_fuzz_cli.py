"""Fuzz the real CLI with mutated inputs: traces (bytes, arrays' shapes, dtypes and values,
header fields, encodings), hardware profiles (values, lines, encodings) and model configs.

Every run is the real CLI (in-process by default, the same examples as ``python -m moesim ...``
in subprocesses with ``-m slow``: see tests/cli_run.py), and must end in exit 2 with exactly
one ``error: ...`` line on stderr, or exit 0 with a valid result (JSON rows with positive
finite TPOTs, a trace that reads back); never a traceback, never a changed input file.
Deterministic (``derandomize=True``) and bounded (40 examples in all).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from cli_run import runners
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesim.hardware import builtin_profiles
from moesim.models import get_model
from moesim.traces.format import read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def moesim(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "moesim", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          errors="replace", timeout=120)


def by_subprocess(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return moesim(list(args), cwd)


#: ``run`` for the fuzzers: in-process by default, subprocesses with -m slow
BOTH_WAYS = runners(by_subprocess)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def assert_clean(r: subprocess.CompletedProcess, inputs: list[Path], digests: list[str], valid) -> str:
    """The run ended in a one-line refusal or a valid result; returns which."""
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert [sha(p) for p in inputs] == digests, "an input file changed"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if r.returncode == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        return "error"
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-1000:]}"
    valid(r.stdout)
    return "ok"


def valid_rows(stdout: str) -> None:
    rows = json.loads(stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert math.isfinite(row["tpot_ms"]) and row["tpot_ms"] > 0, row


@pytest.fixture(scope="module")
def base_trace() -> bytes:
    buf = Path(tempfile.mkdtemp()) / "t.npz"
    write_trace(synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6, prompt_len=4, seed=1)), buf)
    return buf.read_bytes()


# -- traces ---------------------------------------------------------------------------

ODD_VALUES = [None, -1, 0, 1.5, 10**12, -(10**12), "x", "", [], {}, True, float("nan")]
ARRAY_EDITS = ["dtype-f16", "dtype-i8", "dtype-f64", "dtype-bool", "drop-axis", "add-axis", "transpose",
               "set--1", "set-32767", "set-nan", "set-inf", "set-1e30", "delete", "empty"]


def mutate_arrays(data: bytes, name_i: int, edit: str) -> bytes:
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    names = sorted(k for k in arrays if k != "header")
    name = names[name_i % len(names)]
    a = arrays[name]
    if edit.startswith("dtype-"):
        a = a.astype({"f16": np.float16, "i8": np.int8, "f64": np.float64, "bool": bool}[edit[6:]])
    elif edit == "drop-axis":
        a = a.reshape(-1) if a.ndim > 1 else a[:0]
    elif edit == "add-axis":
        a = a[None]
    elif edit == "transpose":
        a = a.T.copy()
    elif edit.startswith("set-"):
        v = float(edit[4:])
        a = a.astype(np.float64 if not np.isfinite(v) or abs(v) > 4e4 else a.dtype) if a.dtype.kind in "iu" else a
        a = a.copy()
        if a.size:
            a.flat[a.size // 2] = v
    elif edit == "empty":
        a = a[:0]
    if edit == "delete":
        del arrays[name]
    else:
        arrays[name] = a
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def mutate_header(data: bytes, path: tuple[str, ...], value, encoding: str) -> bytes:
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(bytes(arrays["header"]).decode())
    node = header
    for k in path[:-1]:
        node = node.setdefault(k, {}) if isinstance(node.get(k), dict) else node
    if value == "<delete>":
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    text = json.dumps(header, ensure_ascii=False) + ("\u00e9" if encoding != "utf-8" else "")
    arrays["header"] = np.frombuffer(text.encode(encoding), np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


trace_mutations = st.one_of(
    st.tuples(st.just("bytes"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
              st.one_of(st.none(), st.integers(0, 10**6))),
    st.tuples(st.just("arrays"), st.integers(0, 20), st.sampled_from(ARRAY_EDITS)),
    st.tuples(st.just("header"),
              st.sampled_from([("n_tokens",), ("batch",), ("version",), ("format",), ("model", "n_layers"),
                               ("model", "n_experts"), ("model", "top_k"), ("model", "hidden"), ("model", "name"),
                               ("model", "vocab"), ("policy",), ("synthetic",), ("prompt_len",), ("recorded",)]),
              st.sampled_from([*ODD_VALUES, "<delete>"]), st.sampled_from(["utf-8", "latin-1", "utf-16"])),
)


@pytest.mark.parametrize("run", BOTH_WAYS)
@settings(max_examples=8, **SETTINGS)
@given(m=trace_mutations)
def test_fuzz_trace(run, base_trace, m):
    if m[0] == "bytes":
        data = bytearray(base_trace)
        for pos, val in m[1]:
            data[pos % len(data)] = val
        if m[2] is not None:
            data = data[: m[2] % len(data)]
        data = bytes(data)
    elif m[0] == "arrays":
        data = mutate_arrays(base_trace, m[1], m[2])
    else:
        data = mutate_header(base_trace, m[1], m[2], m[3])
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "mutated.npz"
        p.write_bytes(data)
        digests = [sha(p)]
        r = run("replay", p.name, "--policy", "on-demand", "--sim", "fast", "--json", cwd=Path(d))
        assert_clean(r, [p], digests, valid_rows)


# -- hardware profiles ----------------------------------------------------------------

PROFILE = builtin_profiles()["a6000"].read_text()
FIGURE_LINES = [i for i, ln in enumerate(PROFILE.splitlines()) if "value = " in ln]


@pytest.mark.parametrize("run", BOTH_WAYS)
@settings(max_examples=6, **SETTINGS)
@given(line=st.integers(0, 100), value=st.sampled_from(["-1", "0", "nan", "inf", "1e308", "\"x\"", "true", "1e-300",
                                                        "[]", "<delete>", "<garble>"]),
       encoding=st.sampled_from(["utf-8", "utf-8", "latin-1", "utf-16"]))
def test_fuzz_profile(run, base_trace, line, value, encoding):
    lines = PROFILE.splitlines()
    i = FIGURE_LINES[line % len(FIGURE_LINES)]
    if value == "<delete>":
        del lines[i]
    elif value == "<garble>":
        lines[i] = lines[i][: len(lines[i]) // 2]
    else:
        head, tail = lines[i].split("value = ", 1)
        lines[i] = f"{head}value = {value},{tail.split(',', 1)[1]}"
    text = "\n".join(lines) + ("\n# caf\u00e9\n" if encoding != "utf-8" else "\n")
    with tempfile.TemporaryDirectory() as d:
        trace, prof = Path(d) / "t.npz", Path(d) / "mutated.toml"
        trace.write_bytes(base_trace)
        prof.write_bytes(text.encode(encoding))
        digests = [sha(trace), sha(prof)]
        r = run("replay", "t.npz", "--hw", prof.name, "--policy", "on-demand", "--sim", "fast", "--json", cwd=Path(d))
        assert_clean(r, [trace, prof], digests, valid_rows)


# -- model configs --------------------------------------------------------------------

CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
          "hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 128, "vocab_size": 100,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("run", BOTH_WAYS)
@settings(max_examples=6, **SETTINGS)
@given(key=st.sampled_from(sorted(CONFIG)), value=st.sampled_from([*ODD_VALUES, "<delete>", 10**9, 3]),
       encoding=st.sampled_from(["utf-8", "utf-8", "latin-1", "utf-16"]))
def test_fuzz_config(run, key, value, encoding):
    cfg = dict(CONFIG)
    if value == "<delete>":
        del cfg[key]
    else:
        cfg[key] = value
    text = json.dumps(cfg, ensure_ascii=False) + ("\u00e9" if encoding != "utf-8" else "")
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        model.mkdir()
        (model / "config.json").write_bytes(text.encode(encoding))
        digests = [sha(model / "config.json")]
        r = run("synth", "--model", "model", "--tokens", "3", "--prompt-len", "2", "--out", "o.npz", cwd=Path(d))
        ending = assert_clean(r, [model / "config.json"], digests, lambda _: None)
        if ending == "ok":
            read_trace(Path(d) / "o.npz")
