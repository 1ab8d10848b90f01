"""Every command's documented ``--json`` example prints strict JSON and nothing else:
stdout parses with a parser that refuses NaN and Infinity, and holds one JSON value."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import in_process

from moesim.jsonout import strict_json

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "data" / "configs"


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_loads(s: str):
    return json.loads(s, parse_constant=_refuse)


def documented() -> list[tuple[list[str], str]]:
    """(setup commands, the --json command) of every sh block in docs/cli.md with a --json
    example; setup = the block's earlier synth lines (what makes the files it reads)."""
    text = (ROOT / "docs" / "cli.md").read_text()
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        lines = [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip().startswith("moesim ")]
        for i, ln in enumerate(lines):
            if "--json" in ln.split():
                out.append(([s for s in lines[:i] if s.startswith("moesim synth")], ln))
    return out


#: The --json examples of the commands' --help texts, and commands whose --json has no
#: example in docs/cli.md.
EXTRA = [
    "moesim hw h100-sxm --json",
    "moesim hw --json",
    "moesim hw --hosts --json",
    "moesim models --json",
    f"moesim models {CONFIGS / 'Qwen3-Next-80B-A3B-Instruct'} {CONFIGS / 'Llama-4-Scout-17B-16E-Instruct'} --json",
    "moesim ecospec --model qwen3-235b-a22b --deployment 8xh200-tp,1xh200-offload --gamma 2,8 --steps 8 --json",
]


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[0] == "moesim"
    return subprocess.run([sys.executable, "-m", "moesim", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_docs_have_json_examples():
    cmds = [c for _, c in documented()]
    for command in ("whatif", "replay", "stats", "models"):
        assert any(c.split()[1] == command for c in cmds), command


#: Examples that run for minutes in full (documented as long-running): run in-process over a
#: cut-down input (test_json_output_of_the_long_examples_is_strict), the same printing path in
#: seconds; the full scoring is `moesim validate --published`'s own business, minutes of two
#: cores that CI does not spend on a JSON check.
LONG = ("moesim validate --published --json",)


def _cases():
    for setup, cmd in documented() + [([], c) for c in EXTRA]:
        if cmd in LONG:
            continue
        # reading configs through transformers costs a subprocess ~15 s of imports: with -m slow
        yield pytest.param(setup, cmd, marks=[pytest.mark.slow] if str(CONFIGS) in cmd else [])


@pytest.mark.parametrize("setup, cmd", list(_cases()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_json_output_is_strict(tmp_path, setup, cmd):
    for s in setup:  # the files the example reads (made in-process: the command checked below is a subprocess)
        r = in_process(*shlex.split(s)[1:], cwd=tmp_path)
        assert r.returncode == 0, (s, r.stderr[-400:])
    r = _run(cmd, tmp_path)
    assert r.returncode == 0, r.stderr[-600:]
    strict_loads(r.stdout)  # one strict JSON value, nothing before or after it


def test_json_output_of_the_long_examples_is_strict(tmp_path, monkeypatch):
    """validate --published --json over the published entries of two sources whose engines
    no other source measures (nothing to fit): the same printing path, in seconds."""
    from moesim.sim import engine_fit

    assert [c for _, c in documented() if c in LONG] == list(LONG)  # still documented
    few = [e for e in engine_fit.entries() if e.setting["engine"] in ("vllm", "moe-infinity")]
    assert few
    monkeypatch.setattr(engine_fit, "entries", lambda: tuple(few))
    r = in_process("validate", "--published", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-600:]
    assert len(strict_loads(r.stdout)["rows"]) == len(few)


def test_non_finite_numbers_become_null_with_a_reason():
    import numpy as np

    out = strict_json({"speedup": float("nan"), "bound": float("inf"), "xs": [1.0, float("-inf")],
                       "n": np.float32("nan"), "a": np.arange(2), "k": np.int64(3)})
    assert out == {"speedup": None, "speedup_reason": "not defined for this input (NaN)", "bound": None,
                   "bound_reason": "unbounded (infinite)", "xs": [1.0, None], "n": None,
                   "n_reason": "not defined for this input (NaN)", "a": [0, 1], "k": 3}
    strict_loads(json.dumps(out, allow_nan=False))
