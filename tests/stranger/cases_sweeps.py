"""Hostile cases of issue 24 (round 3): see tests/stranger/cases.py for how they run.

Sweeps, replay and synth: interrupts of a pool sweep, resumed ``--rows`` files that are
foreign or edited, two runs on one output, long file names, values refused before any
work, options that change nothing (a note), size estimates."""

from __future__ import annotations

import csv
import io
import json
import signal
from pathlib import Path

from cases import Case, json_rows, no_tmp, run_moesim

W = ["whatif", "--model", "tiny", "--hw", "a6000", "--tokens", "4", "--jobs", "1", "--policy", "on-demand,prefetch",
     "--cache-gib", "0,1"]
POOL = ["whatif", "--model", "qwen3-30b-a3b,olmoe-1b-7b", "--hw", "a6000,h100-sxm,gh200", "--tokens", "256",
        "--link-gbps", "8,16,32,64", "--cache-gib", "0,4,8,16", "--jobs", "2", "--sim", "simpy", "--rows", "rows.csv",
        "--out", "w"]
R = ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--json"]


# Files a case's run rewrites live in s/: the harness digests the top folder's files as
# inputs that must not change, and a resumed rows file is rewritten by design.
ROWS = "s/r.csv"


def _swept(d: Path, rows: str = ROWS) -> None:
    (d / "s").mkdir(exist_ok=True)
    r = run_moesim([*W, "--rows", rows, "--out", "w0", "--json"], d)
    assert r.returncode == 0, r.stderr


def _edit(column: str, value: str, row: int = 0):
    def before(d: Path) -> None:
        _swept(d)
        lines = (d / ROWS).read_text().splitlines()
        header = lines[0].split(",")
        cells = next(csv.reader([lines[1 + row]]))
        cells[header.index(column)] = value
        buf = io.StringIO()
        csv.writer(buf, lineterminator="").writerow(cells)
        lines[1 + row] = buf.getvalue()
        (d / ROWS).write_text("\n".join(lines) + "\n")
    return before


def _rewrite(fn):
    def before(d: Path) -> None:
        _swept(d)
        fn(d)
    return before


def not_best(column: str, value: float):
    """The run's best is never the edited value; every fitting row is a positive number."""
    def check(cwd: Path, stdout: str) -> str | None:
        problem = json_rows(cwd, stdout)
        if problem:
            return problem
        best = json.loads(stdout).get("best") or {}
        if best.get(column) == value:
            return f"the edited {column} {value} was reported as the best"
        return None
    return check


def notes_say(*words: str):
    def check(cwd: Path, stdout: str) -> str | None:
        try:
            notes = " ".join(json.loads(stdout).get("notes", []))
        except (json.JSONDecodeError, AttributeError):
            return "stdout is not the JSON answer"
        missing = [w for w in words if w not in notes]
        return f"notes lack {missing}: {notes[:200]}" if missing else None
    return check


def _lock_held(target: str):
    """A stale lock file (its holder died): the next run must take it, not refuse."""
    def before(d: Path) -> None:
        (d / "s").mkdir(exist_ok=True)
        (d / f"{target}.lock").write_text("999999999")
    return before


def sweep_cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    # -- interrupts of a pool-backed sweep (the hang), any signal, any moment
    for after in (1.0, 3.0, 6.0, 9.0, 14.0):
        for sig in (signal.SIGINT, signal.SIGTERM):
            add(Case("sweep interrupts", list(POOL), expect="interrupt", signal_after=after, sig=sig, timeout=120,
                     check=lambda d, s: no_tmp(d, s) or (None if not list(d.glob("*.lock")) else "lock file left")))
    for after in (2.0, 5.0):
        add(Case("sweep interrupts", [*W[:-4], "--policy", "on-demand,prefetch,oracle,cpu-static", "--cache-gib",
                                      "0,1,2", "--tokens", "512", "--jobs", "2", "--sim", "simpy", "--rows", ROWS,
                                      "--out", "w"], expect="interrupt", signal_after=after, timeout=120, check=no_tmp))
    add(Case("sweep interrupts", ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--tokens", "2048",
                                  "--jobs", "2", "--sim", "simpy", "--out", "wi"], expect="interrupt",
             signal_after=5.0, sig=signal.SIGTERM, check=no_tmp))

    # -- --rows resume: foreign files and edited rows
    for content in (b"a,b\n1,2\n", b"\x00\x01\x02binary", b"\xff\xfe\x00n\x00o\x00", b"", b"\n\n\n",
                    b"model,hw,policy\ntiny,a6000,on-demand\n", b"\"unclosed,quote\n1,2\n"):
        def write(d: Path, content=content) -> None:
            _swept(d)
            (d / ROWS).write_bytes(content)
        add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="either",
                 before=write, check=json_rows, fast=content == b"a,b\n1,2\n"))
    for content in (b"a,b\n1,2\n", b"\x00binary"):  # a file of someone else's, no manifest: never touched
        add(Case("resume rows", [*W, "--rows", "mine.csv", "--out", "w"],  # top folder: must stay unchanged
                 before=lambda d, content=content: (d / "mine.csv").write_bytes(content)))
    for value in ("-5", "nan", "inf", "-inf", "0", "abc", "", "1e309", "0.0001", "True"):
        add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok",
                 before=_edit("tpot_ms", value), check=not_best("tpot_ms", _num(value))))
    for column, value in (("fits", "maybe"), ("fits", "True"), ("group", "99"), ("group", "-1"), ("hw", "h100-sxm"),
                          ("policy", "oracle"), ("link_gbps", "-3"), ("tokens_per_s", "1e12"),
                          ("copy_ms", "-1"), ("model", "qwen3-30b-a3b")):
        add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok",
                 before=_edit(column, value), check=json_rows))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok",
             before=_rewrite(lambda d: (d / ROWS).write_text(
                 "\n".join((lambda ls: ls + ls[1:])((d / ROWS).read_text().splitlines())) + "\n")),
             check=notes_say("recomputed")))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"],
             before=_rewrite(lambda d: (d / ROWS).write_text((d / ROWS).read_text().replace("tpot_ms", "tpot_us",
                                                                                                   1)))))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"],
             before=_rewrite(lambda d: (d / f"{ROWS}.sweep.json").write_text(json.dumps({"fingerprint": "0" * 16})))))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"],
             before=_rewrite(lambda d: (d / f"{ROWS}.sweep.json").write_bytes(b"\xff not json"))))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok", check=json_rows,
             before=_rewrite(lambda d: (d / f"{ROWS}.sweep.sums").write_text("0 deadbeef\n1 x y z\n"))))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok", check=json_rows,
             before=_rewrite(lambda d: (d / f"{ROWS}.sweep.sums").unlink())))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w", "--json"], expect="ok", check=json_rows,
             before=_rewrite(lambda d: (d / ROWS).write_text((d / ROWS).read_text()[:-40]))))  # torn
    add(Case("resume rows", [*W, "--cache-gib", "0,1,2", "--rows", ROWS, "--out", "w"],  # another sweep's rows
             before=lambda d: _swept(d)))
    add(Case("resume rows", [*W, "--rows", "dir", "--out", "w"]))
    add(Case("resume rows", [*W, "--rows", "afile/x.csv", "--out", "w"]))
    add(Case("resume rows", [*W, "--rows", "/dev/null", "--out", "w"]))
    add(Case("resume rows", [*W, "--rows", ROWS, "--out", "w"],
             before=lambda d: (d / f"{ROWS}.sweep.json").mkdir(parents=True)))

    # -- two runs on one output: the lock (a stale lock file never blocks)
    for target, args in ((ROWS, [*W, "--rows", ROWS, "--out", "w", "--json"]),
                         ("s/w", [*W, "--out", "s/w", "--json"])):
        add(Case("locks", list(args), expect="ok", check=lambda d, s: json_rows(d, s) or (
            "lock file left" if list(d.rglob("*.lock")) else None), before=_lock_held(target), fast=target == "s/w"))
    add(Case("locks", [*W, "--rows", "r.lock", "--out", "w", "--json"], expect="ok", check=json_rows))
    add(Case("locks", [*W, "--rows", "w", "--out", "w"], expect="either", check=json_rows))

    # -- long file names
    for flag, name in (("--rows", "r" * 245 + ".csv"), ("--out", "w" * 249), ("--rows", "é" * 120 + ".csv"),
                       ("--rows", "r" * 251 + ".csv")):
        add(Case("sweep file names", [*W, flag, name, "--json"] + (["--out", "w"] if flag == "--rows" else []),
                 expect="ok", check=json_rows))
    for flag, name in (("--rows", "r" * 300), ("--out", "w" * 256), ("--rows", "é" * 130 + ".csv"),
                       ("--rows", "d/" + "x" * 300 + "/r.csv"), ("--out", "/".join(["y" * 200] * 25))):
        add(Case("sweep file names", [*W, flag, name] + (["--out", "w"] if flag == "--rows" else [])))
    for n in (245, 251):
        add(Case("sweep file names", ["synth", "--model", "tiny", "--tokens", "4", "--out", "s" * n + ".npz"], expect="ok",
                 check=no_tmp))
    add(Case("sweep file names", ["synth", "--model", "tiny", "--tokens", "4", "--out", "s" * 300 + ".npz"]))
    add(Case("sweep file names", ["replay", "t.npz", "--sim", "fast", "--out", "o" * 300]))
    add(Case("sweep file names", ["replay", "t.npz", "--sim", "fast", "--policy", "on-demand", "--out", "o" * 250],
             expect="ok", check=no_tmp))

    # -- refused before any work (was: "N of M configuration groups failed" after the work)
    for opt, value in (("--eviction", "LRU"), ("--eviction", "fifo"), ("--engine", "nope"), ("--engine", "dir"),
                       ("--link-gbps", "nan"), ("--link-gbps", "inf"), ("--link-gbps", "-0"), ("--cache-gib", "inf"),
                       ("--cache-gib", "nan"), ("--threads", "0"), ("--threads", "-4"), ("--threads", "100000"),
                       ("--copy-queue", "LIFO"), ("--copy-queue", "demand-first,"), ("--jobs", "100000"),
                       ("--backend", "nope"), ("--sim", "SimPy"), ("--expert-dtype", "int3"), ("--host", "nope"),
                       ("--lookahead", "0"), ("--prefetch-top", "0"), ("--gpu-expert-gib", "nan"),
                       ("--offload-gib", "-1"), ("--goal", "speed"), ("--host-ram-gb", "nan")):
        add(Case("refused early", [*W, "--rows", ROWS, "--out", "w", opt, value],
                 fast=opt == "--eviction" and value == "LRU"))

    # -- options that change nothing: a note, exit 0
    for extra in (["--cpu-layers", "2"], ["--host", "epyc-7742"], ["--prefetch-top", "1"], ["--no-amx"],
                  ["--gpu-layers", "3"], ["--offload-gib", "1"], ["--calibrate-on-replay"],
                  ["--copy-queue", "demand-first", "--policy", "all-resident"]):
        args = [*R, *extra]
        if "--policy" in extra:
            args = [a for i, a in enumerate(args) if not (a == "on-demand" and args[i - 1] == "--policy")]
            args.remove("--policy")
            args += ["--sim", "simpy"]
        add(Case("unused options", args, expect="either", check=json_rows))
    add(Case("unused options", [*R, "--placement-from", "t2.npz"], expect="either", check=json_rows))
    for extra in (["--cpu-layers", "2"], ["--gpu-expert-gib", "1"], ["--prefetch-top", "1"], ["--address", "x:1"]):
        add(Case("unused options", [*W, "--policy", "on-demand", "--out", "w", "--json", *extra], expect="ok",
                 check=notes_say("changed nothing")))
    for extra in (["--depth", "3"], ["--branch", "3"], ["--recall", "0.5"]):
        add(Case("unused options", ["synth", "--model", "tiny", "--tokens", "4", "--out", "s.npz", *extra],
                 expect="ok", check=no_tmp))
    add(Case("unused options", ["synth", "--speculative", "--model", "tiny", "--tokens", "4", "--batch", "2",
                                "--out", "s.npz"], expect="ok", check=no_tmp))

    # -- size estimates and step ranges
    for depth, branch in ((40, 10), (64, 2), (12, 8), (200, 1)):
        add(Case("estimates", ["synth", "--speculative", "--model", "tiny", "--depth", str(depth), "--branch",
                               str(branch), "--out", "s.npz"], expect="either", timeout=120, check=no_tmp))
    for args in (["whatif", "--model", "qwen3-235b-a22b", "--tokens", "10000000", "--jobs", "1", "--out", "w"],
                 ["whatif", "--model", "tiny", "--tokens", "4", "--batch", "100000000", "--jobs", "1", "--out", "w"],
                 ["replay", "t.npz", "--step", "8"], ["replay", "t.npz", "--step", "-1"],
                 ["replay", "one.npz", "--step", "1"]):
        before = None
        if "one.npz" in args:
            def before(d: Path) -> None:
                r = run_moesim(["synth", "--model", "tiny", "--tokens", "1", "--out", "one.npz"], d)
                assert r.returncode == 0, r.stderr
        add(Case("estimates", list(args), before=before, timeout=120))

    def one_step(d: Path) -> None:
        r = run_moesim(["synth", "--model", "tiny", "--tokens", "1", "--out", "one.npz"], d)
        assert r.returncode == 0, r.stderr
    add(Case("estimates", ["replay", "one.npz", "--sim", "fast", "--policy", "on-demand", "--json"], expect="ok",
             before=one_step, check=json_rows))
    return c


def _num(value: str):
    try:
        return float(value)
    except ValueError:
        return value
