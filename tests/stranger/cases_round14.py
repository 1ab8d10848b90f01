"""Hostile cases of round 14 (issue 52, "Trust, round 5"): see tests/stranger/cases.py.

The classes (docs/robustness.md, "Round 14"):

- ``r14 overflow``: rates, sizes and shares out of range (``--link-gbps 1e-9``, ``--cache-gib 1e308``,
  ``--tensor-split 1e308,1e308``), refused in one line naming the range before any work, by whatif,
  replay, profile and speculate alike; a huge but real value still answers; no answer prints an
  exponent;
- ``r14 same value``: one host or machine given twice however spelled (``@2x4800``/``@2x4800.0``/
  ``@02x4800``, ``2xrtx3090``/``rtx3090+rtx3090``/``1xa6000``), refused;
- ``r14 user engine``: a user's engine file named as a built-in is labelled as the user's; one
  copied and renamed prints the arguments of the engine its ``runs_as`` names;
- ``r14 messages``: ``2Xrtx3090`` is a machine (never "nested too deeply"), ``--host @2x4800``
  asks for the host's name; replay and whatif refuse the same option values alike;
- ``r14 names``: ``deepseek-r1`` and other fine-tunes resolve to their geometry; unknown names
  suggest the nearest (``epyc-7302`` -> ``epyc-7343``);
- ``r14 commands``: the printed context is the user's (``--ctx``) or the engine's default, said; never the prompt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cases import Case
from cases_round10 import ENGINE, _install_words_hook, case_adder, json_rows

W = ["whatif", "--model", "tiny", "--hw", "a6000", "--tokens", "4", "--jobs", "1", "--out", "w"]
R = ["replay", "t.npz", "--sim", "fast"]
EXPONENT = re.compile(r"\d\.?\d*e[+-]\d", re.IGNORECASE)


def some_rows(d: Path, stdout: str) -> str | None:
    """JSON rows came back (a machine of several GPUs may fit none: its rows say so)."""
    obj = json.loads(stdout)
    return None if obj.get("rows") else "no rows"


def no_exponent(d: Path, stdout: str) -> str | None:
    """A text answer (not JSON): no figure written with an exponent."""
    hit = EXPONENT.search(stdout)
    return f"an exponent in the answer: {stdout[max(0, hit.start() - 40):hit.end() + 10]!r}" if hit else None


def engine_file(name: str, new_name: str, runs_as: str | None = None):
    """A copy of llama.cpp's engine profile named ``new_name`` (and ``runs_as``, when given)."""
    def make(d: Path) -> None:
        text = ENGINE.read_text()
        text = re.sub(r'^name = .*$', f'name = "{new_name}"', text, count=1, flags=re.M)
        if runs_as is not None:
            top, _, rest = text.partition("\n[")
            text = f'{top}\nruns_as = "{runs_as}"\n[{rest}'
        (d / name).write_text(text)
    return make


def printed(want: str, absent: str | None = None):
    """The text answer holds ``want`` (and not ``absent``)."""
    def check(d: Path, stdout: str) -> str | None:
        if want not in stdout:
            return f"{want!r} not in the answer"
        if absent is not None and absent in stdout:
            return f"{absent!r} in the answer"
        return None
    return check


def round14_cases() -> list[Case]:
    _install_words_hook()
    c: list[Case] = []
    add = case_adder(c)

    # -- overflow and underflow: one range per kind of number, whatever the command
    ov = "r14 overflow"
    for v in ("1e-9", "0.0009", "1e308", "100001", "1e400"):
        add(ov, [*W, "--policy", "on-demand", "--link-gbps", v], words=("--link-gbps", "from 0.001 to 100,000"),
            fast=v == "1e-9")
        add(ov, [*R, "--policy", "on-demand", "--link-gbps", v], words=("--link-gbps", "from 0.001"))
    for cmd in (["profile", "--model", "tiny", "--tokens", "2", "--out", "p.npz"],
                ["speculate", "--tokens", "2", "--out", "s.npz"]):
        for v in ("1e-9", "1e9"):
            add(ov, [*cmd, "--link-gbps", v], words=("--link-gbps", "from 0.001"))
    for opt, pol in (("--cache-gib", "on-demand"), ("--gpu-expert-gib", "hot-experts"),
                     ("--offload-gib", "weight-streaming")):
        for v in ("1e308", "1e13"):
            add(ov, [*W, "--policy", pol, opt, v], words=(opt, "from 0 to 1,000,000,000,000"))
        add(ov, [*R, "--policy", pol, opt, "1e308"], words=(opt, "1,000,000,000,000"))
    for shares in ("1e308,1e308", "1e7,1", "-1e-320,1", "0,0"):
        add(ov, [*W[:3], "--hw", "2xrtx3090", *W[5:], "--policy", "gpu-layers", "--tensor-split", shares],
            words=("--tensor-split", "shares from 0 to 1,000,000"), fast=shares == "1e308,1e308")
    add(ov, [*R, "--tensor-split", "1e308,1e308", "--hw", "2xrtx3090"], words=("--tensor-split",))
    # the edges are in range and answer
    add(ov, [*W, "--policy", "on-demand", "--link-gbps", "0.001", "--json"], expect="ok", check=json_rows)
    add(ov, [*W, "--policy", "on-demand", "--cache-gib", "1e12", "--json"], expect="ok", check=json_rows)
    for shares in ("1000000,1", "1e-320,1"):  # a denormal share is a share of 0, not an underflow of the sum
        add(ov, [*W[:3], "--hw", "2xrtx3090", *W[5:], "--policy", "gpu-layers", "--tensor-split", shares, "--json"],
            expect="ok", check=json_rows)
    # a slow link and a tiny model: figures far from 1 are written out, never with an exponent
    add(ov, ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--tokens", "4", "--jobs", "1", "--out", "w",
             "--policy", "gpu-layers,on-demand", "--link-gbps", "0.001"], expect="ok", check=no_exponent, timeout=120)
    add(ov, [*W, "--policy", "on-demand"], expect="ok", check=no_exponent, fast=True)

    # -- one value, several spellings
    sv = "r14 same value"
    for hosts in ("epyc-9654@2x4800,epyc-9654@2x4800.0", "epyc-9654@02x4800,epyc-9654@2x4800",
                  "epyc-9654@2x4800,EPYC-9654@2x4800", "epyc-9654@2s@2x4800,epyc-9654@2x4800@2s",
                  "epyc-9654@2s,epyc-9654@02s", "epyc-9654@12x4800.00,epyc-9654@12x4800"):
        add(sv, [*W, "--policy", "cpu-static", "--host", hosts], words=("--host", "EPYC" in hosts and "twice" or "the same host"),
            fast=hosts.endswith("4800.0"))
    for hws in ("2xrtx3090,rtx3090+rtx3090", "a6000,1xa6000", "2Xrtx3090,2xrtx3090", "3xa6000,a6000+a6000+a6000",
                "rtx3090+rtx3090,2xRTX3090"):
        add(sv, [*W[:3], "--hw", hws, *W[5:], "--policy", "on-demand"], words=("--hw", "2X" in hws and "twice" or "the same machine"),
            fast=hws.startswith("2xrtx3090"))
    add(sv, [*W, "--policy", "cpu-static", "--host", "epyc-9654@2x4800,epyc-9654@4x4800", "--json"], expect="ok",
        check=json_rows)
    add(sv, [*W[:3], "--hw", "2xrtx3090,rtx3090+rtx4090", *W[5:], "--policy", "on-demand", "--json"], expect="ok",
        check=some_rows)

    # -- a user's engine file
    ue = "r14 user engine"
    q = ["whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--tokens", "4", "--jobs", "1", "--out", "w",
         "--policy", "cpu-static"]
    add(ue, [*q, "--engine", "vl.toml"], expect="ok", before=engine_file("vl.toml", "vllm"),
        check=printed("vllm (vl.toml, a user's file)", "vllm serve"), timeout=120, fast=True)
    add(ue, [*q, "--engine", "my.toml"], expect="ok", before=engine_file("my.toml", "my-llama.cpp"),
        check=printed("runs_as", "llama-server"), timeout=120)
    add(ue, [*q, "--engine", "my.toml"], expect="ok", before=engine_file("my.toml", "my-llama.cpp", "llama.cpp"),
        check=printed("my-llama.cpp (runs as llama.cpp)", "vllm serve"), timeout=120)
    add(ue, [*q, "--engine", "my.toml"], expect="ok", before=engine_file("my.toml", "vllm", "llama.cpp"),
        check=printed("llama-server"), timeout=120)
    for bad in ("nope", "LLAMA"):
        add(ue, [*q, "--engine", "my.toml"], before=engine_file("my.toml", "mine", bad), words=("runs_as",))
    add(ue, [*q, "--engine", "llama.cp"], words=("nearest: 'llama.cpp'",))

    # -- messages that said the wrong thing
    ms = "r14 messages"
    for hw in ("2Xrtx3090", "2XA6000", "10Xa6000"):
        add(ms, [*W[:3], "--hw", hw, *W[5:], "--policy", "on-demand", "--json"], expect="ok", check=some_rows,
            fast=hw == "2Xrtx3090")
    add(ms, [*W[:3], "--hw", "2Xnope", *W[5:]], words=("unknown hardware profile",))
    add(ms, [*W[:3], "--hw", "100Xa6000", *W[5:]], words=("1 to 64 GPUs",))
    for host in ("@2x4800", "@2s", "@"):
        add(ms, [*W, "--policy", "cpu-static", "--host", host], words=("name the host before @",),
            fast=host == "@2x4800")
    for opt, v, words in (("--threads", "0", "--threads 0"), ("--gpu-layers", "-5", "--gpu-layers -5"),
                          ("--cpu-layers", "-1", "--cpu-layers -1"), ("--offload-gib", "-1", "--offload-gib"),
                          ("--gpu-expert-gib", "nan", "--gpu-expert-gib"), ("--prefetch-top", "0", "--prefetch-top 0"),
                          ("--cache-gib", "inf", "--cache-gib"), ("--tensor-split", "1,-1", "--tensor-split"),
                          ("--gpu-layers", "abc", "--gpu-layers")):
        add(ms, [*R, "--policy", "on-demand", opt, v], words=(words,), fast=opt == "--threads")
        add(ms, [*W, "--policy", "on-demand", opt, v], words=(words,))

    # -- names with a way forward
    nm = "r14 names"
    for alias in ("deepseek-r1", "DeepSeek-R1-0528", "kimi-k2-instruct-0905", "qwen3-30b-a3b-instruct-2507"):
        add(nm, ["models", alias, "--json"], expect="ok", check=lambda d, s: None if json.loads(s) else "empty",
            fast=alias == "deepseek-r1")
    for name, words in ((["--host", "epyc-7302"], ("nearest: 'epyc-7343'",)), (["--hw", "rtx309"], ("nearest: 'rtx3090'",)),
                        (["--model", "qwen3-30b-a3"], ("nearest: 'qwen3-30b-a3b'",))):
        args = [*W, "--policy", "cpu-static"]
        i = args.index(name[0]) if name[0] in args else None
        if i is not None:
            args[i + 1] = name[1]
        else:
            args += name
        add(nm, args, words=words, fast=name[0] == "--host")
    add(nm, ["synth", "--model", "deepseek-r", "--tokens", "4", "--out", "s.npz"], words=("nearest",))

    # -- printed commands: the context
    pc = "r14 commands"
    e = ["--engine", "llama.cpp", "--policy", "cpu-static", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--jobs", "1",
         "--out", "w"]
    add(pc, ["whatif", *e], expect="ok", check=printed("llama.cpp's default", " -c "), timeout=180)
    add(pc, ["whatif", *e, "--tokens", "8", "--prompt-len", "4096"], expect="ok",
        check=printed("llama.cpp's default", " -c "), timeout=180)  # the prompt is never the context
    add(pc, ["whatif", *e, "--tokens", "8", "--ctx", "32768"], expect="ok", check=printed("-c 32768"),
        timeout=180)
    add(pc, ["whatif", *e, "--ctx", "0"], words=("--ctx 0",))
    # builds and engines people have: a release number is a date; the engine is an axis
    add(pc, ["hw", "llama.cpp@b6000", "--engines"], expect="ok", check=printed("a build from 2025-07-26"))
    add(pc, ["hw", "llama.cpp@b1", "--engines"], words=("b1 is outside",))
    add(pc, ["whatif", *e, "--tokens", "8", "--engine", "llama.cpp,ik_llama.cpp"], expect="ok",
        check=printed("-- with ik_llama.cpp --"), timeout=180)
    # a lighter file type predicted slower says why (the engine's kernel figures for both)
    add(pc, ["whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "iq1_s,q8_0", "--hw", "none", "--host",
             "ryzen-7950x", "--engine", "llama.cpp", "--tokens", "8", "--jobs", "1", "--out", "w"], expect="ok",
        check=printed("iq1_s (1.65 bits a weight) is predicted slower than q8_0"), timeout=180)
    add(pc, ["whatif", *e, "--tokens", "8", "--host", "epyc-9654@2s"], expect="ok",
        check=printed("--numa distribute"), timeout=180)
    return c
