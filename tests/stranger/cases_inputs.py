"""Hostile cases of issue 24 (round 3): see tests/stranger/cases.py for how they run.

Input files, item 1: devices and sockets where a file is due, named pipes with and without
a writer, names longer than the file system allows, hostile routing dumps, and model
inputs (config.json, GGUF, checkpoints without the weights, prompts). A FIFO's writer is a
``timeout 60 sh -c 'cat SRC > FIFO'`` started by the case's ``before``: it ends when the
case has read it, or after a minute if the case never opens it (the harness never waits
on it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from cases import ROOT, Case, trace_file

SHIPPED = ROOT / "executor" / "checkpoints" / "moe-stdlib"
EXAMPLES = ROOT / "traces" / "examples"
LONG = "x" * 300  # past NAME_MAX (255 bytes) on every common file system
DUMP = ["--model", "tiny", "--out", "o.npz"]


def fifo(name: str, source: str | Path | None = None, head: int | None = None) -> Callable[[Path], None]:
    """A named pipe ``name`` in the case's folder; with ``source``, a writer feeds it that
    file (its first ``head`` bytes when given) once a reader opens it."""
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(d / name)
        if source is not None:
            src = f"head -c {head} {source}" if head is not None else f"cat {source}"
            subprocess.Popen(["timeout", "60", "sh", "-c", f"{src} > '{name}'"], cwd=d, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return make


def sock(name: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / name))
        s.close()  # the socket's node stays
    return make


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return make


def both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        for m in makers:
            m(d)
    return make


def checkpoint(name: str, change: dict | None = None, files: dict[str, str] | None = None,
               index: dict | None = None) -> Callable[[Path], None]:
    """A checkpoint folder: the shipped config.json (with ``change``), links to shipped files."""
    def make(d: Path) -> None:
        f = d / name
        f.mkdir()
        cfg = json.loads((SHIPPED / "config.json").read_text())
        (f / "config.json").write_text(json.dumps({**cfg, **(change or {})}))
        for target, source in (files or {}).items():
            (f / target).symlink_to(SHIPPED / source)
        if index is not None:
            (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return make


def jsonl(body: str) -> Callable[[Path], None]:
    return write("d.jsonl", body if body.endswith("\n") else body + "\n")


def npy(name: str, expr: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        import numpy as np

        np.save(d / name, eval(expr, {"np": np}))  # noqa: S307 (the case's own literal)
    return make


def npz(name: str, **exprs: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        import numpy as np

        np.savez(d / name, **{k: eval(v, {"np": np}) for k, v in exprs.items()})  # noqa: S307
    return make


def sparse(name: str, size: int) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        with open(d / name, "wb") as f:
            f.truncate(size)  # no data written: a reader that reads it first would take seconds and memory
    return make


def input_cases() -> list[Case]:
    c: list[Case] = []

    def add(cls: str, args: list[str], before=None, **kw) -> None:
        c.append(Case(cls, list(args), before=before, **kw))

    replay = ["replay", "t.npz", "--sim", "fast", "--policy", "on-demand"]
    wi = ["whatif", "--model", "tiny", "--tokens", "4", "--jobs", "1", "--policy", "on-demand", "--cache-gib", "0",
          "--out", "w"]

    # devices and sockets where a file is due: refused unread (/dev/zero once read until the OOM killer)
    dev = "devices"
    for d in ("/dev/zero", "/dev/urandom", "/dev/null", "/dev/full", "/dev/tty"):
        add(dev, [*replay, "--hw", d], fast=d == "/dev/zero")
    for opt in ("--host", "--engine"):
        add(dev, [*replay, opt, "/dev/zero"])
    add(dev, [*wi, "--hw", "a6000,/dev/zero"])
    add(dev, [*wi, "--hw", "a6000", "--host", "/dev/urandom"])
    add(dev, ["hw", "/dev/zero"])
    for args in (["stats", "/dev/zero"], ["replay", "/dev/urandom"], ["fit", "/dev/zero"],
                 ["whatif", "--trace", "/dev/zero", "--jobs", "1", "--out", "w"], ["models", "/dev/zero"],
                 ["synth", "--model", "/dev/urandom", "--out", "m.npz"], ["import", "jsonl", "/dev/zero", *DUMP],
                 ["import", "vllm", "/dev/urandom", "--model", "deepseek-v2-lite", "--out", "o.npz"],
                 ["replay", "t.npz", "--policy", "hot-experts", "--placement-from", "/dev/zero"],
                 ["synth", "--model", "tiny", "--like", "/dev/zero", "--tokens", "4", "--out", "s.npz"],
                 ["calibrate", "--text", "/dev/zero", "--tokens", "64", "--out", "cal"]):
        add(dev, args)
    add(dev, ["record", "moe-stdlib", "--prompts-file", "/dev/zero", "--tokens", "1"], timeout=120)
    add(dev, ["stats", "s.npz"], sock("s.npz"))
    add(dev, [*replay, "--hw", "s.toml"], sock("s.toml"))
    add(dev, ["import", "jsonl", "s.jsonl", *DUMP], sock("s.jsonl"))
    add(dev, ["models", "m"], sock("m/config.json"))
    add(dev, ["models", "m"], lambda d: ((d / "m").mkdir(), (d / "m" / "config.json").symlink_to("/dev/zero")))

    # named pipes: one nobody writes to is refused after 2 s (never "does not exist", never a hang);
    # one a writer feeds is read
    pip = "pipes"
    for args, name in ((["stats", "f.npz"], "f.npz"), (["replay", "f.npz"], "f.npz"), ([*replay, "--hw", "f.toml"], "f.toml"),
                       ([*replay, "--host", "f.toml"], "f.toml"), ([*replay, "--engine", "f.toml"], "f.toml"),
                       (["hw", "f.toml"], "f.toml"), (["models", "m"], "m/config.json"),
                       (["synth", "--model", "m", "--tokens", "2", "--out", "s.npz"], "m/config.json"),
                       (["import", "jsonl", "f.jsonl", *DUMP], "f.jsonl"),
                       (["import", "vllm", "f.json", "--model", "deepseek-v2-lite"], "f.json"),
                       (["fit", "f.npz"], "f.npz"), (["whatif", "--trace", "f.npz", "--jobs", "1", "--out", "w"], "f.npz"),
                       (["calibrate", "--text", "f.txt", "--tokens", "64", "--out", "cal"], "f.txt"),
                       (["record", "moe-stdlib", "--prompts-file", "f.txt", "--tokens", "1"], "f.txt"),
                       (["models", "f.gguf"], "f.gguf")):
        add(pip, args, fifo(name), timeout=120, fast=args == ["stats", "f.npz"],
            expect="ok" if "--host" in args else "error")  # a GPU-only policy never opens --host's file
    add(pip, [*replay[:4], "--policy", "cpu-on-miss", "--host", "f.toml"], fifo("f.toml"))  # one that does
    add(pip, ["stats", "f.npz", "--json"], fifo("f.npz", "t.npz"), expect="ok")
    add(pip, [*replay[:1], "f.npz", *replay[2:], "--json"], fifo("f.npz", "t.npz"), expect="ok")
    add(pip, [*replay, "--hw", "f.toml", "--json"], fifo("f.toml", "a6000-copy.toml"), expect="ok")
    add(pip, ["models", "m"], both(lambda d: (d / "m").mkdir(), fifo("m/config.json", SHIPPED / "config.json")),
        expect="ok")
    add(pip, ["import", "jsonl", "f.jsonl", "--model", str(SHIPPED), "--out", "o.npz"],
        fifo("f.jsonl", EXAMPLES / "routing-moe-stdlib.jsonl"), expect="ok", check=trace_file("o.npz"))
    add(pip, ["import", "vllm", "f.json", "--model", "deepseek-v2-lite", "--out", "o.npz"],
        fifo("f.json", EXAMPLES / "vllm-synthetic-deepseek-v2-lite.json"), expect="ok", check=trace_file("o.npz"))
    add(pip, ["stats", "f.npz"], fifo("f.npz", "random.npz"))
    add(pip, ["stats", "f.npz"], fifo("f.npz", "truncated.npz"))
    add(pip, ["hw", "f.toml"], fifo("f.toml", "binary.toml"))
    add(pip, [*replay, "--hw", "f.toml"], fifo("f.toml", "/dev/zero", head=5 * 2**20))  # past the 4 MiB cap
    add(pip, ["import", "jsonl", "f.jsonl", *DUMP], fifo("f.jsonl", "binary.txt"))

    # names longer than the file system allows, as inputs: one line, never OSError: File name too long
    lng = "long names"
    for args in (["stats", f"{LONG}.npz"], ["replay", f"{LONG}.npz"], [*replay, "--hw", f"{LONG}.toml"],
                 [*replay, "--hw", LONG], [*replay, "--host", LONG], [*replay, "--engine", f"{LONG}.toml"],
                 ["models", LONG], ["synth", "--model", LONG, "--out", "x.npz"],
                 ["import", "jsonl", f"{LONG}.jsonl", *DUMP], ["record", LONG, "--tokens", "1"],
                 ["profile", "--model", LONG, "--tokens", "2"], ["speculate", "--draft", LONG, "--tokens", "2"],
                 ["fit", f"{LONG}.npz"],
                 ["whatif", "--trace", f"{LONG}.npz", "--jobs", "1", "--out", "w"],
                 ["replay", "t.npz", "--policy", "hot-experts", "--placement-from", f"{LONG}.npz"], ["hw", LONG],
                 ["calibrate", "--text", f"{LONG}.txt", "--tokens", "64", "--out", "cal"],
                 ["stats", f"dir/{LONG}/t.npz"], ["stats", "a/" * 2100 + "t.npz"]):
        add(lng, args, timeout=120)

    # hostile routing dumps: one line naming the file (and line), before anything is allocated
    rd = "routing dumps"
    for body in ('{"token": 0, "layer": 0, "experts": [NaN, 1]}', '{"token": 0, "layer": 0, "experts": [Infinity, 1]}',
                 '{"token": 0, "layer": 0, "experts": [true, 1]}', '{"token": 0, "layer": 0, "experts": ["a", 1]}',
                 '{"token": 0, "layer": 0, "experts": [1.5, 1]}', '{"token": 0, "layer": 0, "experts": [1e400, 1]}',
                 '{"token": 0, "layer": 0, "experts": [99999999999999999999, 1]}',
                 '{"token": 0, "layer": 0, "experts": [-1, 1]}', '{"token": 0, "layer": 0, "experts": [16, 1]}',
                 '{"token": 0, "layer": 0, "experts": [[0], 1]}', '{"token": 0, "layer": 0, "experts": 7}',
                 '{"token": 0, "layer": 0, "experts": []}', '{"token": 99999999999, "layer": 0, "experts": [0, 1]}',
                 '{"token": 0, "seq": 99999999999, "layer": 0, "experts": [0, 1]}',
                 '{"token": -1, "layer": 0, "experts": [0, 1]}', '{"token": 0, "layer": "0", "experts": [0, 1]}',
                 '{"token": 0, "layer": 0, "experts": [0, 1], "gates": [NaN, 0.5]}',
                 '{"token": 0, "layer": 0, "experts": [0, 1], "gates": [2, 0.5]}',
                 '{"token": 0, "layer": 0, "experts": [0, 1], "gates": ["a", 0.5]}',
                 '{"token": 0, "layer": 99, "experts": [0, 1]}', "[1, 2]", "[" * 100000, "", "\n\n"):
        add(rd, ["import", "jsonl", "d.jsonl", *DUMP], jsonl(body), fast=body.startswith('{"token": 0, "layer": 0, '
                                                                                         '"experts": [NaN'))
    add(rd, ["import", "jsonl", "d.jsonl", *DUMP], write("d.jsonl", '{"token": 0}\n'.encode("utf-16")))
    add(rd, ["import", "jsonl", "binary.txt", *DUMP])
    v2 = ["--model", "deepseek-v2-lite", "--out", "o.npz"]
    for name, expr, extra in (("r.npy", "np.zeros((5, 27, 6), np.uint8)", []),
                              ("r.npy", "np.zeros((5, 27, 6), np.float32)", ["--prompt-tokens", "1"]),
                              ("r.npy", "np.array([1, 'a'], dtype=object)", ["--prompt-tokens", "1"]),
                              ("r.npy", "np.zeros((5, 27), np.int64)", ["--prompt-tokens", "1"]),
                              ("r.npy", "np.full((5, 27, 6), 10**6)", ["--prompt-tokens", "1"]),
                              ("r.npy", "np.zeros((5, 27, 6), np.uint8)", ["--prompt-tokens", "9"]),
                              ("r.npy", "np.zeros((0, 27, 6), np.uint8)", ["--prompt-tokens", "1"])):
        add(rd, ["import", "vllm", name, *v2, *extra], npy(name, expr))
    add(rd, ["import", "vllm", "r.npz", *v2], npz("r.npz", other="np.zeros(3)"))
    add(rd, ["import", "npz", "r.npz", *DUMP], npz("r.npz", experts="np.zeros((4, 4, 2), np.float32)"))
    add(rd, ["import", "npz", "r.npz", *DUMP], npz("r.npz", experts="np.tile(np.arange(2), (4, 4, 1))",
                                                 gates="np.zeros(5, np.float32)"))
    add(rd, ["import", "vllm", "r.json", *v2], write("r.json", '{"choices": [{"routed_experts": "@@not base64@@"}]}'))
    add(rd, ["import", "vllm", "r.json", *v2], write("r.json", '{"choices": [{"routed_experts": NaN}]}'))
    add(rd, ["import", "sglang", "r.json", *v2], write("r.json", '[{"meta_info": {"routed_experts": 5}}]'))

    # model inputs: config.json, GGUF, checkpoints without the weights transformers loads, prompts
    mi = "model inputs"
    ck = {"model.safetensors": "model.safetensors"}
    for before in (checkpoint("ck", files={"estimator.safetensors": "estimator.safetensors"}),
                   checkpoint("ck", {"hidden_size": 256}, ck), checkpoint("ck", {"num_hidden_layers": 6}, ck),
                   checkpoint("ck", {"num_experts": 64}, ck),
                   checkpoint("ck", files={"model-00001-of-00002.safetensors": "model.safetensors"},
                              index={"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                    "b": "model-00002-of-00002.safetensors"}}),
                   checkpoint("ck", {"x": 1}, {"model-1.safetensors": "model.safetensors"},
                              index={"weight_map": {"a": "../../etc/passwd"}}),
                   checkpoint("ck", {"x": 1}, {"model-1.safetensors": "model.safetensors"}, index={"weight_map": 5}),
                   checkpoint("ck", {"x": 1}, {"model-1.safetensors": "model.safetensors"}, index={"weight_map": {}}),
                   both(checkpoint("ck"), fifo("ck/model.safetensors"))):
        add(mi, ["record", "ck", "--tokens", "1", "--out", "r.npz"], before, timeout=120)
    add(mi, ["models", "ck"], both(checkpoint("ck"), fifo("ck/model.safetensors")))  # would block the header's open
    add(mi, ["models", "ck"], both(checkpoint("ck"), lambda d: (d / "ck" / "model.safetensors").symlink_to("/dev/zero")))
    add(mi, ["models", "ck"], checkpoint("ck", files={"model-1.safetensors": "model.safetensors"},
                                         index={"weight_map": 5}))
    add(mi, ["record", "/dev/zero", "--tokens", "1"], timeout=120)
    add(mi, ["record", "afile", "--tokens", "1"], timeout=120)
    add(mi, ["record", "missing-folder", "--tokens", "1"], timeout=120)
    add(mi, ["models", "m"], lambda d: (d / "m" / "config.json").mkdir(parents=True))
    add(mi, ["models", "m"], sparse("m/config.json", 65 * 2**20))
    add(mi, ["models", "huge.toml"], sparse("huge.toml", 65 * 2**20))
    add(mi, [*replay, "--hw", "huge.toml"], sparse("huge.toml", 5 * 2**20))
    add(mi, ["models", "junk.gguf"], write("junk.gguf", b"GGUF" + b"\xff" * 60))
    add(mi, ["models", "empty.gguf"], write("empty.gguf", b""))
    add(mi, ["models", "m"], write("m/x.gguf", b"GGUF\x03\x00\x00\x00" + b"\x00" * 8))
    add(mi, ["record", "moe-stdlib", "--prompts-file", "p.txt", "--tokens", "1"],
        write("p.txt", "hello\n".encode("utf-16")), timeout=120)
    add(mi, ["record", "moe-stdlib", "--prompts-file", "p.txt", "--tokens", "1"], write("p.txt", "\n \n"),
        timeout=120)
    add(mi, ["record", "moe-stdlib", "--prompts-file", "dir", "--tokens", "1"], timeout=120)
    add(mi, ["calibrate", "--text", "dir", "--tokens", "64", "--out", "cal"], timeout=120)
    return c
