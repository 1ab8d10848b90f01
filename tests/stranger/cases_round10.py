"""Hostile cases of rounds 10 and 11 (issue "What the user sees is true"): see tests/stranger/cases.py.

Each row of the round-10 table in docs/robustness.md, and the rest of its class: the same
broken input given to the other commands that read it, other keys, other bad values (0,
negative, NaN, inf, huge, not a number, empty) and other files. The classes:

- ``r10 gguf metadata``: GGUF files whose geometry cannot be (a key 0 or missing, a block
  count the tensors do not describe, a header declaring more tensors or keys than the file
  holds, split names ``-00001-of-00000``, a layer with expert tensors but no router or a
  missing expert projection), read by ``models``, ``whatif --model``, ``synth --model``;
- ``r10 engine toml``: engine profiles with an empty or unknown ``policies``, a ``runs_on``
  the machine cannot run, a ``layer_efficiency`` below a thousandth, fractions above 1;
- ``r10 host variants``: ``--host NAME@CHANNELSxMTS@Ns`` out of range, repeated, malformed;
- ``r10 multi-gpu split``: ``whatif --tensor-split`` / ``--split`` good and bad, on one GPU,
  over machines of one and of several GPUs;
- ``r10 cpu-only``: ``replay``/``whatif`` with ``--hw none``, ``fit`` on a machine of other
  than one GPU, ``--hw this`` where NVML cannot answer;
- ``r10 npz members``: ``import npz``/``vllm`` dumps with a misspelt member;
- ``r10 sweep names``: two GGUF quantisations of one model in one sweep, two host profiles
  with one name;
- ``r10 host ram``: ``--host-ram-gb`` against the experts a copy policy keeps in host RAM;
- ``r10 resume fingerprint``: ``--rows`` resumed after a profile file was edited;
- ``r10 out locks``: a second writer of an ``--out`` another run holds;
- ``r10 early refusals``: ``--gpu-layers`` past the model, refused before any sweep;
- ``r10 config.json``: unknown ``torch_dtype``/quantisation, fp8 ``modules_to_not_convert``;
- ``r10 synth like``: ``synth --like`` a trace without predictions;
- ``r10 stdout`` and ``r10 columns``: the harness runs every case with stdout a pipe and
  ``COLUMNS=80``, so these cases run the command as usual (it must succeed) and their check
  runs it again with stdout closed or ``/dev/full`` (exit 2, resp. 1, and one line) or with a
  ``COLUMNS`` that is no width (the whole answer, exit 0).

A refusal must also say the right thing: ``error(..., words=...)`` registers words the one
``error:`` line must hold (a wrapper of the harness's ``classify``, as cases_round4.py
does for stderr); a refusal for another reason (a missing file instead of the GPU count)
is a bad ending."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cases import ROOT, Case, Outcome, json_rows, trace_file

sys.path.insert(0, str(ROOT / "tests"))
EXAMPLES = ROOT / "traces" / "examples"
ENGINE = ROOT / "hwprofiles" / "engines" / "llama.cpp.toml"
HOST = ROOT / "hwprofiles" / "hosts" / "epyc-9654.toml"
WORDS: dict[int, tuple[str, ...]] = {}  # id(case) -> words its error line must hold
ENV = {"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "80"}


def _install_words_hook() -> None:
    """Wrap ``classify`` of every loaded copy of the harness: a refusal must name its words."""
    for mod in (sys.modules.get("cases"), sys.modules.get("__main__")):
        fn = getattr(mod, "classify", None)
        if fn is None or getattr(fn, "_r10", False):
            continue

        def wrapped(case, rc, stdout, stderr, *rest, _fn=fn):
            out = _fn(case, rc, stdout, stderr, *rest)
            words = WORDS.get(id(case), ())
            missing = [w for w in words if w not in stderr]
            if out.ending == "error" and missing:
                return Outcome(case, "wrong", f"refused, but not naming {missing}: {out.detail}", out.seconds)
            return out
        wrapped._r10 = True
        mod.classify = wrapped


# -------------------------------------------------------------------------------------
# fixtures made by a case's ``before``
# -------------------------------------------------------------------------------------

def gguf(name: str, **kw) -> Callable[[Path], None]:
    """A synthetic Qwen3-MoE GGUF (tests/gguf_files.py), ``meta``/``drop``/types as given."""
    def make(d: Path) -> None:
        from gguf_files import qwen3moe_gguf

        qwen3moe_gguf(d / name, **kw)
    return make


def gguf_header(name: str, offset: int, value: int, size: int = 8) -> Callable[[Path], None]:
    """A valid GGUF whose header field at ``offset`` (8: tensor count, 16: key count) says ``value``."""
    def make(d: Path) -> None:
        gguf("_base.gguf")(d)
        data = bytearray((d / "_base.gguf").read_bytes())
        data[offset:offset + size] = value.to_bytes(size, "little")
        (d / "_base.gguf").unlink()
        (d / name).write_bytes(bytes(data))
    return make


def text_file(name: str, src: Path, old: str | None = None, new: str = "", append: str = "") -> Callable[[Path], None]:
    """``src`` with ``old`` replaced by ``new`` once (asserted present), ``append`` added."""
    def make(d: Path) -> None:
        text = src.read_text()
        if old is not None:
            assert old in text, (src, old)
            text = text.replace(old, new, 1)
        (d / name).write_text(text + append)
    return make


def engine(name: str, old: str | None = None, new: str = "", append: str = "") -> Callable[[Path], None]:
    return text_file(name, ENGINE, old, new, append)


def layer_eff(value: str, kind: str = "full") -> str:
    return f'\n[layer_efficiency]\n{kind} = {{ value = {value}, kind = "estimate", source = "stranger" }}\n'


def config(name: str, **extra) -> Callable[[Path], None]:
    """A small Qwen3-MoE config.json in folder ``name``, keys of ``extra`` added (None: removed)."""
    def make(d: Path) -> None:
        raw = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
               "hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 128, "vocab_size": 100,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "bfloat16"}
        for k, v in extra.items():
            if v is None:
                raw.pop(k, None)
            else:
                raw[k] = v
        (d / name).mkdir(parents=True, exist_ok=True)
        (d / name / "config.json").write_text(json.dumps(raw))
    return make


def npz(name: str, **arrays) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        import numpy as np

        np.savez(d / name, **{k: np.asarray(v) for k, v in arrays.items()})
    return make


def moesim(d: Path, *args: str, env: dict | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moesim", *args], cwd=d, env={**os.environ, **ENV, **(env or {})},
                          text=True, errors="replace", timeout=timeout, **kw)


def first(*args: str) -> Callable[[Path], None]:
    """Run ``moesim args`` before the case (it must succeed): a sweep to resume, an import."""
    def make(d: Path) -> None:
        r = moesim(d, *args, capture_output=True)
        assert r.returncode == 0, r.stderr
    return make


def then(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        for m in makers:
            m(d)
    return make


def edit(name: str, old: str, new: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        text = (d / name).read_text()
        assert old in text, (name, old)
        (d / name).write_text(text.replace(old, new, 1))
    return make


def hold(out: str) -> Callable[[Path], None]:
    """Another process holds ``out``'s lock (moesim.atomic.exclusive) until the case's folder
    is gone (or a minute): the case's run is the second writer."""
    def make(d: Path) -> None:
        code = ("import os, sys, time\nfrom moesim.atomic import exclusive\n"
                f"with exclusive({str(d / out)!r}):\n    print('held', flush=True)\n    t0 = time.time()\n"
                f"    while os.path.isdir({str(d)!r}) and time.time() - t0 < 60:\n        time.sleep(0.2)\n")
        p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert p.stdout.readline().strip() == "held"
    return make


# -------------------------------------------------------------------------------------
# checks
# -------------------------------------------------------------------------------------

def rows_of(stdout: str) -> list[dict]:
    obj = json.loads(stdout)
    return obj["rows"] if isinstance(obj, dict) and "rows" in obj else obj


def rows_where(want: Callable[[list[dict]], str | None]) -> Callable[[Path, str], str | None]:
    """json_rows, then ``want(rows)`` (a problem or None)."""
    def check(d: Path, stdout: str) -> str | None:
        return json_rows(d, stdout) or want(rows_of(stdout))
    return check


def split_rows(expected: set[tuple[str, str, str]]) -> Callable[[Path, str], str | None]:
    """whatif --json: the set of (hw, split, tensor_split) of the rows."""
    def want(rows: list[dict]) -> str | None:
        got = {(r["hw"], r["split"], r["tensor_split"].replace("-0", "0")) for r in rows}  # -0 is 0
        return None if got == expected else f"(hw, split, tensor_split) {sorted(got)}, expected {sorted(expected)}"
    return rows_where(want)


def json_note(*words: str) -> Callable[[Path, str], str | None]:
    """whatif --json: one of the notes holds every word."""
    def check(d: Path, stdout: str) -> str | None:
        problem = json_rows(d, stdout)
        if problem:
            return problem
        notes = json.loads(stdout).get("notes", [])
        return None if any(all(w in n for w in words) for n in notes) else f"no note naming {words}: {notes}"
    return check


def model_json(**want) -> Callable[[Path, str], str | None]:
    """models --json: the first model's fields as given."""
    def check(d: Path, stdout: str) -> str | None:
        try:
            m = json.loads(stdout)["models"][0]
        except (json.JSONDecodeError, KeyError, IndexError) as e:
            return f"stdout is not models --json ({e})"
        bad = {k: m.get(k) for k, v in want.items() if m.get(k) != v}
        return f"{bad}, expected {want}" if bad else None
    return check


def no_gpu_rows(stdout: str) -> str | None:
    """whatif --hw none --json: all-resident timed (a positive TPOT), every other row unfit with a note."""
    try:
        rows = rows_of(stdout)
    except json.JSONDecodeError as e:
        return f"stdout is not JSON ({e})"
    for r in rows:
        ok = r["policy"] == "all-resident"
        t = r["tpot_ms"]
        if ok and not (r["fits"] and isinstance(t, int | float) and 0 < t < float("inf")):
            return f"all-resident: fits {r['fits']}, tpot {t!r}"
        if not ok and (r["fits"] or not r.get("note") or r.get("note") == "-"):
            return f"{r['policy']} on no GPU: fits {r['fits']}, note {r.get('note')!r}"
    return None if any(r["policy"] == "all-resident" for r in rows) else "no all-resident row"


def out_words(*words: str) -> Callable[[Path, str], str | None]:
    def check(d: Path, stdout: str) -> str | None:
        missing = [w for w in words if w not in stdout]
        return f"stdout lacks {missing}: {stdout.strip()[-160:]!r}" if missing else None
    return check


def closed_stdout(args: list[str], full: bool = False, words: tuple[str, ...] = ()) -> Callable[[Path, str], str | None]:
    """The normal run (stdout a pipe) printed ``words``; run again with stdout closed: exit 2,
    one line; with stdout /dev/full: exit 1 and one line saying there was no room."""
    def check(d: Path, stdout: str) -> str | None:
        missing = [w for w in words if w not in stdout]
        if missing:
            return f"the normal run's stdout lacks {missing}"
        if full:
            with open("/dev/full", "w") as f:
                r = moesim(d, *args, stdout=f, stderr=subprocess.PIPE)
            want_rc, want = 1, "error: could not write the output: No space left on device"
        else:
            r = moesim(d, *args, stderr=subprocess.PIPE, pass_fds=(), preexec_fn=lambda: os.close(1))
            want_rc, want = 2, "error: standard output is closed"
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if r.returncode != want_rc or len(lines) != 1 or not lines[0].startswith(want):
            return (f"stdout {'/dev/full' if full else 'closed'}: exit {r.returncode}, {len(lines)} stderr lines: "
                    f"{(lines[-1] if lines else '')[:160]!r}")
        return None
    return check


def columns(args: list[str], value: str, *words: str) -> Callable[[Path, str], str | None]:
    """Run again with COLUMNS=``value``: exit 0, and the answer still there (``words``)."""
    def check(d: Path, stdout: str) -> str | None:
        r = moesim(d, *args, env={"COLUMNS": value}, capture_output=True)
        if r.returncode != 0 or "Traceback" in r.stderr:
            return f"COLUMNS={value!r}: exit {r.returncode}: {r.stderr.strip()[-160:]!r}"
        missing = [w for w in words if w not in r.stdout]
        return f"COLUMNS={value!r}: stdout ({len(r.stdout)} chars) lacks {missing}" if missing else None
    return check


def no_predictions(name: str, tokens: int, batch: int = 1) -> Callable[[Path, str], str | None]:
    """The synthetic trace holds routing but no predictions (pred_ids -1, as the trace it is like)."""
    def check(d: Path, stdout: str) -> str | None:
        import numpy as np

        problem = trace_file(name)(d, stdout)
        if problem:
            return problem
        with np.load(d / name) as z:
            true, pred = z["true_ids"], z["pred_ids"]
        if true.shape[0] != tokens or true.shape[2] != batch:
            return f"true_ids shape {true.shape}, expected {tokens} steps, batch {batch}"
        if not (pred == -1).all():
            return f"predictions invented: {int((pred != -1).sum())} of {pred.size} pred_ids are not -1"
        if not (true >= 0).all():
            return "true_ids hold -1"
        return None
    return check


# -------------------------------------------------------------------------------------
# the cases
# -------------------------------------------------------------------------------------

R = ["replay", "t.npz", "--hw", "a6000", "--sim", "fast"]
W = ["whatif", "--model", "tiny", "--hw", "a6000", "--tokens", "4", "--jobs", "1"]
Q = ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--tokens", "8", "--jobs", "1"]
SPLIT = ["whatif", "--model", "olmoe-1b-7b", "--hw", "2xrtx3090", "--host", "epyc-7742", "--engine", "llama.cpp",
         "--policy", "cpu-static", "--cpu-layers", "8", "--tokens", "4", "--jobs", "1", "--json"]
STDLIB = EXAMPLES / "routing-moe-stdlib.npz"


def case_adder(c: list[Case]):
    """``add(cls, args, expect="error", words=(), **kw)``: a Case appended to ``c``, its ``words``
    checked in the one error line (the hook :func:`_install_words_hook` installs)."""
    def add(cls: str, args: list[str], expect: str = "error", words: tuple[str, ...] = (), **kw) -> None:
        k = Case(cls, list(args), expect=expect, **kw)
        if words:
            WORDS[id(k)] = tuple(words)
        c.append(k)
    return add


def round10_cases() -> list[Case]:
    _install_words_hook()
    c: list[Case] = []
    add = case_adder(c)

    # -- GGUF metadata whose geometry cannot be
    gm = "r10 gguf metadata"
    for tag, meta, words in (("hc0", {"attention.head_count": 0, "attention.key_length": None}, ("head_count is 0",)),
                             ("hc0k", {"attention.head_count": 0}, ("head_count is 0",)),
                             ("ec0", {"expert_count": 0}, ("expert_count is 0", "positive whole number")),
                             ("eu0", {"expert_used_count": 0}, ("expert_used_count is 0",)),
                             ("bc0", {"block_count": 0}, ("block_count is 0",)),
                             ("emb0", {"embedding_length": 0}, ("embedding_length",)),
                             ("noemb", {"embedding_length": None}, ("no qwen3moe.embedding_length",)),
                             ("noec", {"expert_count": None}, ("no qwen3moe.expert_count",)),
                             ("bc4e9", {"block_count": 4_000_000_000}, ("4000000000 blocks", "tensors describe 4")),
                             ("bcmax", {"block_count": 2**32 - 1}, ("4294967295 blocks",)),
                             ("bc5", {"block_count": 5}, ("5 blocks", "tensors describe 4")),
                             # the tensors describe 4 blocks, the metadata 3: one layer's bytes would vanish
                             ("bc3", {"block_count": 3}, ("3 blocks",)),
                             # 0 is no width: as expert_count 0, not silently feed_forward_length's
                             ("eff0", {"expert_feed_forward_length": 0}, ("expert_feed_forward_length",)),
                             ("eu9", {"expert_used_count": 9}, ("9",))):
        add(gm, ["models", f"{tag}.gguf"], words=words, before=gguf(f"{tag}.gguf", meta=meta), fast=tag == "ec0")
    for tag, meta in (("hc0", {"attention.head_count": 0, "attention.key_length": None}),
                      ("bc4e9", {"block_count": 4_000_000_000})):
        add(gm, [*W, "--model", f"{tag}.gguf", "--policy", "on-demand", "--out", "w"], before=gguf(f"{tag}.gguf", meta=meta),
            timeout=90)
        add(gm, ["synth", "--model", f"{tag}.gguf", "--tokens", "4", "--out", "s.npz"],
            before=gguf(f"{tag}.gguf", meta=meta))
    for tag, offset, value, words in (("t1e12", 8, 10**12, ("declares 1000000000000 tensors",)),
                                      ("tmax", 8, 2**64 - 1, ("tensors",)), ("kv1e12", 16, 10**12, ("metadata keys",)),
                                      ("kvmax", 16, 2**63, ("metadata keys",))):
        add(gm, ["models", f"{tag}.gguf"], words=words, before=gguf_header(f"{tag}.gguf", offset, value), timeout=20,
            fast=tag == "t1e12")
    add(gm, [*W, "--model", "t1e12.gguf", "--policy", "on-demand", "--out", "w"],
        before=gguf_header("t1e12.gguf", 8, 10**12), timeout=20)
    for name, words in (("m-00001-of-00000.gguf", ("part 1 of 0",)), ("m-00000-of-00002.gguf", ("part 0 of 2",)),
                        ("m-00003-of-00002.gguf", ("part 3 of 2",))):
        add(gm, ["models", name], words=words, before=gguf(name))
    add(gm, ["synth", "--model", "m-00001-of-00000.gguf", "--tokens", "4", "--out", "s.npz"],
        before=gguf("m-00001-of-00000.gguf"))
    for layer in (0, 2, 3):
        add(gm, ["models", f"nr{layer}.gguf"], words=(f"layer {layer} has expert tensors", "no router"),
            before=gguf(f"nr{layer}.gguf", drop=(f"blk.{layer}.ffn_gate_inp.weight",)))
    add(gm, [*W, "--model", "nr2.gguf", "--policy", "on-demand", "--out", "w"],
        before=gguf("nr2.gguf", drop=("blk.2.ffn_gate_inp.weight",)), timeout=90)
    # one projection of a layer's experts missing: its experts' bytes silently shrank, as a missing router's did
    add(gm, ["models", "noup.gguf"], words=("layer 1",), before=gguf("noup.gguf", drop=("blk.1.ffn_up_exps.weight",)))
    add(gm, ["models", "noexps.gguf"], before=gguf("noexps.gguf", drop=tuple(
        f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))))
    add(gm, ["models", "good.gguf", "--json"], expect="ok", before=gguf("good.gguf"),
        check=model_json(layers=4, experts=8, top_k=2, hidden=256, expert_inter=256))

    # -- engine profiles
    en = "r10 engine toml"
    pol = 'policies = ["all-resident", "cpu-static", "gpu-layers"]'
    runs = 'runs_on = ["gpu", "cpu"]'
    cwe = "\ndefault = { value = 0."
    for tag, make, words in (
            ("pol0", engine("e.toml", pol, "policies = []"), ("policies must name at least one",)),
            ("polnope", engine("e.toml", pol, 'policies = ["nope"]'), ("'nope'",)),
            ("polstr", engine("e.toml", pol, 'policies = "cpu-static"'), ("policies must be a list",)),
            ("polnum", engine("e.toml", pol, "policies = [1, 2]"), ("policies must be a list",)),
            ("run0", engine("e.toml", runs, "runs_on = []"), ("runs_on",)),
            ("runtpu", engine("e.toml", runs, 'runs_on = ["tpu"]'), ("runs_on",)),
            ("runstr", engine("e.toml", runs, 'runs_on = "cpu"'), ("runs_on",)),
            ("le1e-300", engine("e.toml", append=layer_eff("1e-300")), ("layer_efficiency.full", "at least 0.001")),
            ("le0", engine("e.toml", append=layer_eff("0.0")), ("full",)),
            ("le-neg", engine("e.toml", append=layer_eff("-0.5", "mla")), ("mla",)),
            ("lenan", engine("e.toml", append=layer_eff("nan")), ("full",)),
            ("leinf", engine("e.toml", append=layer_eff("inf")), ("full",)),
            ("le2", engine("e.toml", append=layer_eff("2.0", "linear")), ("linear", "at most 1")),
            ("lekind", engine("e.toml", append=layer_eff("0.5", "nope")), ("'nope'",)),
            ("cwe50", engine("e.toml", cwe, "\ndefault = { value = 50."), ("'default'", "at most 1")),
            ("cwe1p", engine("e.toml", cwe, "\ndefault = { value = 1.0001"), ("at most 1",)),
            ("cwe0", engine("e.toml", cwe, "\ndefault = { value = 0.0 }\nx = { value = 0."), ()),
            ("cwenan", engine("e.toml", "\ndefault = { value = 0.6499", "\ndefault = { value = nan"), ("'default'",)),
            ("cweq4", engine("e.toml", "\niq1_s = { value = 0.", "\nq4_k = { value = 3."), ("'q4_k'", "at most 1")),
            ("gwe", engine("e.toml", append='\n[gpu_weight_efficiency]\ndefault = { value = 1.5, kind = "estimate", '
                                             'source = "stranger" }\n'), ("at most 1",)),
            ("numa", engine("e.toml", "numa_efficiency = { value = 0.2", "numa_efficiency = { value = 20"),
             ("numa_efficiency",))):
        add(en, ["hw", "e.toml", "--engines"], words=words, before=make, fast=tag == "cwe50")
    add(en, [*R, "--policy", "all-resident", "--engine", "e.toml"], words=("computes on CPUs only", "--hw none"),
        before=engine("e.toml", runs, 'runs_on = ["cpu"]'), fast=True)
    add(en, [*W, "--engine", "e.toml", "--out", "w"], words=("computes on CPUs only",),
        before=engine("e.toml", runs, 'runs_on = ["cpu"]'), timeout=90)
    add(en, ["replay", "t.npz", "--hw", "none", "--host", "ryzen-9950x", "--policy", "all-resident", "--engine",
             "e.toml"], words=("computes on GPUs only",), before=engine("e.toml", runs, 'runs_on = ["gpu"]'))
    add(en, ["replay", "t.npz", "--hw", "none", "--host", "ryzen-9950x", "--policy", "all-resident", "--engine",
             "e.toml", "--json"], expect="ok", before=engine("e.toml", runs, 'runs_on = ["cpu"]'),
        check=rows_where(lambda rows: None if all(r["hw"] == "none" for r in rows) else f"hw {rows[0]['hw']}"))
    add(en, [*R, "--policy", "all-resident", "--engine", "e.toml"], words=("policies must name at least one",),
        before=engine("e.toml", pol, "policies = []"))
    add(en, [*W, "--engine", "e.toml", "--out", "w"], words=("layer_efficiency.full",),
        before=engine("e.toml", append=layer_eff("1e-300")), timeout=90)
    add(en, [*R, "--policy", "all-resident", "--engine", "e.toml", "--json"], expect="ok",
        before=engine("e.toml", append=layer_eff("0.001")),  # the least allowed: slow, finite
        check=rows_where(lambda rows: None if all(r["tpot_ms"] < 1e6 for r in rows) else f"tpot {rows[0]['tpot_ms']}"))

    # -- host variants on the command line
    hv = "r10 host variants"
    CPU = [*R, "--policy", "cpu-static"]
    for spec, words in (("ryzen-9950x@2", ("CHANNELSxMTS",)), ("ryzen-9950x@30x6400", ("1 to 24",)),
                        ("ryzen-9950x@2x100", ("800 to 20000",)), ("ryzen-9950x@0s", ("from 1 to 16",)),
                        ("nope@2x4800", ("unknown host profile 'nope'",)),
                        ("ryzen-9950x@2x6400@2x8000", ("both set the memory channels and speed",)),
                        ("epyc-9654@2s@3s", ("both set the sockets",)), ("ryzen-9950x@17s", ("from 1 to 16",)),
                        ("ryzen-9950x@0x6400", ("1 to 24",)), ("ryzen-9950x@2x20001", ("800 to 20000",)),
                        ("ryzen-9950x@-1s", ("CHANNELSxMTS",)), ("ryzen-9950x@x6400", ("CHANNELSxMTS",)),
                        ("ryzen-9950x@", ("CHANNELSxMTS",)), ("ryzen-9950x@2x6400@", ("CHANNELSxMTS",)),
                        ("ryzen-9950x@2x6400@2s@4s", ("both set the sockets",)),
                        ("ryzen-9950x@2xnan", ("CHANNELSxMTS",)), ("ryzen-9950x@2x1e4", ("CHANNELSxMTS",)),
                        ("ryzen-9950x@99999999999999999999s", ("from 1 to 16",))):
        add(hv, [*CPU, "--host", spec], words=words, fast=spec == "ryzen-9950x@2x6400@2x8000")
    for spec in ("epyc-9654@2s@3s", "ryzen-9950x@30x6400", "ryzen-9950x@2x6400,ryzen-9950x@2X6400"):
        add(hv, [*W, "--policy", "cpu-static", "--host", spec, "--out", "w"], timeout=90)
    add(hv, ["hw", "ryzen-9950x@2", "--hosts"], words=("CHANNELSxMTS",))
    add(hv, ["hw", "ryzen-9950x@4x6400@2s", "--hosts"], expect="ok", check=out_words("6400"))
    add(hv, [*CPU, "--host", "ryzen-9950x@4x6400@2s", "--json"], expect="ok",
        check=rows_where(lambda rows: None if rows[0]["host"] == "ryzen-9950x@4x6400@2s" else f"host {rows[0]['host']}"))
    add(hv, [*CPU, "--host", "ryzen-9950x@2X6400", "--json"], expect="ok",
        check=rows_where(lambda rows: None if rows[0]["host"] == "ryzen-9950x@2x6400" else f"host {rows[0]['host']}"))

    # -- whatif's split options
    sp = "r10 multi-gpu split"
    add(sp, [*SPLIT, "--tensor-split", "3,1"], expect="ok", check=split_rows({("2xrtx3090", "layer", "3,1")}),
        timeout=120, fast=True)
    add(sp, [*SPLIT, "--split", "tensor"], expect="ok", check=split_rows({("2xrtx3090", "tensor", "-")}), timeout=120)
    add(sp, [*SPLIT, "--tensor-split", "-0,1"], expect="ok", check=split_rows({("2xrtx3090", "layer", "0,1")}),
        timeout=120)
    for shares, words in (("0,0", ("positive sum",)), ("inf,1", ("shares from 0 to",)),
                          ("1e309,1", ("shares from 0 to",)), ("abc,1", ("--tensor-split",)),
                          ("1,,1", ("empty item",)), ("1", ("1 shares for 2 GPUs",)), ("1,1,1", ("3 shares for 2 GPUs",)),
                          ("-1,2", ("non-negative",)), ("nan,nan", ("non-negative",))):
        add(sp, [*SPLIT, "--tensor-split", shares], words=words, timeout=60, fast=shares == "1,,1")
    for mode in ("rows", "row", "LAYER", "none"):
        add(sp, [*SPLIT, "--split", mode], words=(f"--split '{mode}'",), timeout=60)
    add(sp, [*SPLIT, "--split", "tensor", "--tensor-split", "1,1,1"], words=("3 shares for 2 GPUs",), timeout=60)
    add(sp, ["whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--policy", "all-resident", "--tokens", "4",
             "--jobs", "1", "--json", "--split", "tensor"], expect="ok", check=json_note("--split", "changed nothing"),
        timeout=120)
    add(sp, ["whatif", "--model", "olmoe-1b-7b", "--hw", "a6000,2xrtx3090", "--host", "epyc-7742", "--engine",
             "llama.cpp", "--policy", "cpu-static", "--cpu-layers", "8", "--tensor-split", "1,3", "--tokens", "4",
             "--jobs", "1", "--json"], expect="ok",
        check=split_rows({("a6000", "-", "-"), ("2xrtx3090", "layer", "1,3")}), timeout=120)
    add(sp, ["whatif", "--model", "olmoe-1b-7b", "--hw", "a6000,rtx3090+rtx4090", "--host", "epyc-7742", "--engine",
             "llama.cpp", "--policy", "cpu-static", "--cpu-layers", "8", "--tensor-split", "2,1", "--tokens", "4",
             "--jobs", "1", "--json"], expect="ok",
        check=split_rows({("a6000", "-", "-"), ("rtx3090+rtx4090", "layer", "2,1")}), timeout=120)
    add(sp, ["whatif", "--model", "olmoe-1b-7b", "--hw", "2xrtx3090,3xrtx3090", "--host", "epyc-7742", "--engine",
             "llama.cpp", "--policy", "cpu-static", "--cpu-layers", "8", "--tensor-split", "1,3", "--tokens", "4",
             "--jobs", "1", "--json"], words=("--tensor-split",), timeout=120)

    # -- no GPU, or not one: replay --hw none, fit, --hw this
    cp = "r10 cpu-only"
    add(cp, ["replay", "t.npz", "--hw", "none", "--host", "ryzen-9950x", "--policy", "all-resident", "--out", "rp",
             "--json"], expect="ok", check=lambda d, s: json_rows(d, s) or (
                 None if "No timeline" in (d / "rp" / "report.html").read_text() else "report without its note"),
        timeout=120, fast=True)
    add(cp, ["replay", "t.npz", "--hw", "none", "--host", "epyc-9654@2s", "--policy", "all-resident",
             "--out", "rp", "--csv"], expect="ok", check=lambda d, s: None if (d / "rp" / "report.html").exists()
        and "all-resident" in s else "no report, or no all-resident row", timeout=120)
    add(cp, ["replay", "t.npz", "--hw", "none", "--host", "ryzen-9950x", "--policy", "cpu-static,all-resident"],
        words=("only all-resident applies",))
    add(cp, ["replay", "t.npz", "--hw", "none", "--policy", "all-resident", "--out", "rp"], words=("--host",))
    add(cp, ["whatif", "--model", "tiny", "--hw", "none", "--host", "ryzen-9950x", "--tokens", "4", "--jobs", "1",
             "--out", "w", "--json"], expect="ok", check=lambda d, s: no_gpu_rows(s) or (
                 None if (d / "w" / "report.html").exists() else "no report"), timeout=120)
    for hw, words in (("none", ("names no GPUs",)), ("2xa6000", ("names 2 GPUs",)),
                      ("a6000+rtx3090", ("names 2 GPUs",)), ("8xh200", ("names 8 GPUs",)),
                      ("a6000,h100-sxm", ("a6000,h100-sxm",))):
        add(cp, ["fit", "never-read.npz", "--hw", hw], words=words, fast=hw == "none")
    nvml = shutil.which("nvidia-smi") is not None
    add(cp, ["replay", "t.npz", "--hw", "this,a6000"], words=("this,a6000",))  # replay times one machine
    for args in (["fit", "never-read.npz", "--hw", "this"], [*R, "--hw", "this", "--policy", "on-demand"],
                 [*W, "--hw", "this", "--out", "w"], ["stats", "t.npz", "--hw", "this"], ["hw", "this"],
                 [*W, "--hw", "a6000,this", "--out", "w"]):
        # without an NVIDIA driver, one line naming --hw none (with one, a GPU's answer: either)
        add(cp, args, expect="either" if nvml else "error", words=() if nvml else ("--hw none",),
            check=lambda d, s: None, timeout=90)

    # -- npz routing dumps with a misspelt member
    nm = "r10 npz members"
    e = [[[0, 1], [2, 3]]] * 4
    for tag, arrays, words in (("gate", {"experts": e, "gate": [[[0.5, 0.5]] * 2] * 4}, ("'gate'", "'gates'")),
                               ("expert", {"expert": e}, ("'expert'", "'experts'")),
                               ("tokenid", {"experts": e, "tokenid": [1, 2, 3, 4]}, ("'tokenid'", "'token_ids'")),
                               ("Gates", {"experts": e, "Gates": [[[0.5, 0.5]] * 2] * 4}, ("'Gates'",)),
                               ("junk", {"experts": e, "zzz": [1]}, ("'zzz'",))):
        add(nm, ["import", "npz", f"{tag}.npz", "--model", "tiny", "--out", "o/t.npz"], words=words,
            before=npz(f"{tag}.npz", **arrays), fast=tag == "gate")
    r6 = [[[0, 1], [2, 3]]] * 6
    for tag, arrays, words in (("tokenids", {"routed_experts": r6, "prompt_tokens": 2, "tokenids": [0] * 4},
                                ("'tokenids'", "'token_ids'")),
                               ("routed", {"routed_expert": r6, "prompt_tokens": 2}, ("'routed_expert'",)),
                               ("prompt", {"routed_experts": r6, "prompt_token": 2}, ("'prompt_token'",))):
        add(nm, ["import", "vllm", f"{tag}.npz", "--model", "tiny", "--out", "o/t.npz"], words=words,
            before=npz(f"{tag}.npz", **arrays))
    e4 = [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 4  # tiny: 4 MoE layers, top 2
    add(nm, ["import", "npz", "ok.npz", "--model", "tiny", "--out", "o/t.npz"], expect="ok",
        before=npz("ok.npz", experts=e4, gates=[[[0.5, 0.5]] * 4] * 4, token_ids=[[1, 2, 3, 4]]),
        check=trace_file("o/t.npz"))

    # -- names in one sweep
    sn = "r10 sweep names"
    from gguf_files import T

    two = then(gguf("m-Q4_K.gguf"), gguf("m-Q8_0.gguf", gate_types=[T.Q8_0] * 4, down_types=[T.Q8_0] * 4))
    add(sn, ["whatif", "--model", "m-Q4_K.gguf,m-Q8_0.gguf", "--hw", "a6000", "--policy", "on-demand", "--cache-gib",
             "0", "--tokens", "8", "--jobs", "1", "--json", "--out", "w"], expect="ok", before=two,
        check=rows_where(lambda rows: None if sorted(r["model"] for r in rows) == [
            "synthetic-qwen3moe (m-Q4_K.gguf)", "synthetic-qwen3moe (m-Q8_0.gguf)"] else
            f"models {[r['model'] for r in rows]}"), timeout=120, fast=True)
    add(sn, ["whatif", "--model", "m-Q4_K.gguf,sub/m-Q4_K.gguf", "--hw", "a6000", "--policy", "on-demand",
             "--cache-gib", "0", "--tokens", "8", "--jobs", "1", "--json", "--out", "w"], expect="either",
        before=then(gguf("m-Q4_K.gguf"), lambda d: (d / "sub").mkdir(), gguf("sub/m-Q4_K.gguf")),
        check=rows_where(lambda rows: None if len({r["model"] for r in rows}) == len(rows) == 2 else
                         f"models {[r['model'] for r in rows]}"), timeout=120)
    host_dup = text_file("h.toml", HOST)
    add(sn, [*W, "--host", "epyc-9654,h.toml", "--policy", "cpu-static", "--out", "w"],
        words=("--host", "both named 'epyc-9654'"), before=host_dup, timeout=90)
    add(sn, [*W, "--host", "h.toml,h2.toml", "--policy", "cpu-static", "--out", "w"], words=("--host",),
        before=then(host_dup, text_file("h2.toml", HOST)), timeout=90)
    add(sn, [*W, "--host", "epyc-9654,EPYC-9654", "--policy", "cpu-static", "--out", "w"], timeout=90)
    add(sn, [*W, "--engine", "llama.cpp,e.toml", "--policy", "cpu-static", "--host", "epyc-9654", "--out", "w"],
        words=("llama.cpp",), before=engine("e.toml"), timeout=90)

    # -- host RAM against the experts a copy policy keeps there
    hr = "r10 host ram"

    def ram(fits: bool, *words: str) -> Callable[[Path, str], str | None]:
        """Every row fits (a valid TPOT) or none does, its note naming ``words``."""
        def check(d: Path, stdout: str) -> str | None:
            problem = json_rows(d, stdout) if fits else None
            if problem:
                return problem
            rows = rows_of(stdout)
            for r in rows:
                if r["fits"] is not fits or not all(w in (r.get("note") or "") for w in words):
                    return f"{r['policy']}: fits {r['fits']}, note {r.get('note')!r}"
            return None if rows else "no rows"
        return check
    for policy in ("on-demand", "prefetch", "oracle"):
        add(hr, [*Q, "--policy", policy, "--cache-gib", "0", "--host-ram-gb", "8", "--json", "--out", "w"],
            expect="ok", check=ram(False, "8 GB of RAM"), timeout=120, fast=policy == "on-demand")
    add(hr, [*Q, "--policy", "on-demand", "--cache-gib", "0", "--host-ram-gb", "200", "--json", "--out", "w"],
        expect="ok", check=ram(True), timeout=120)
    add(hr, [*Q, "--policy", "on-demand", "--cache-gib", "0", "--host-ram-gb", "1e6", "--json", "--out", "w"],
        expect="ok", check=ram(True), timeout=120)
    for v in ("inf", "abc", "-inf", "", "1e300"):
        add(hr, [*Q, "--policy", "on-demand", "--host-ram-gb", v, "--out", "w"], words=("--host-ram-gb",), timeout=60)

    # -- resumed rows after a profile file was edited
    rf = "r10 resume fingerprint"
    sweep = [*W, "--host", "h.toml", "--engine", "e.toml", "--policy", "cpu-static", "--cpu-layers", "2",
             "--rows", "r/rows.csv", "--out", "w", "--json"]
    files = then(text_file("h.toml", HOST, 'name = "epyc-9654"', 'name = "mine"'),
                 engine("e.toml", 'name = "llama.cpp"', 'name = "mine"'))
    add(rf, sweep, expect="ok", before=then(files, first(*sweep)), check=json_rows, timeout=120, fast=True)
    for _what, f, old, new in (("host figure", "h.toml", "{ value = ", "{ value = 1"),
                             ("engine figure", "e.toml", "{ value = ", "{ value = 1"),
                             ("engine table", "e.toml", "\ndefault = { value = 0.", "\ndefault = { value = 0.1"),
                             ("host description", "h.toml", "description = \"", "description = \"edited: "),
                             ("engine policies", "e.toml", '"gpu-layers"]', '"gpu-layers", "on-demand"]')):
        add(rf, sweep, words=("holds a different sweep",), before=then(files, first(*sweep), edit(f, old, new)),
            timeout=120)
    gpu_sweep = ["whatif", "--model", "tiny", "--hw", "g.toml", "--tokens", "4", "--jobs", "1", "--policy",
                 "on-demand", "--cache-gib", "0", "--rows", "r/rows.csv", "--out", "w", "--json"]
    add(rf, gpu_sweep, words=("holds a different sweep",), before=then(
        text_file("g.toml", ROOT / "hwprofiles" / "a6000.toml"), first(*gpu_sweep), edit("g.toml", "value = 676.0",
                                                                                          "value = 600.0")), timeout=120)

    # -- a second writer of one --out
    lk = "r10 out locks"
    for args, out in ((["import", "npz", str(STDLIB), "--model", "moe-stdlib"], "o/t.npz"),
                      (["import", "jsonl", str(EXAMPLES / "routing-moe-stdlib.jsonl"), "--model", "moe-stdlib"],
                       "o/t.npz"),
                      (["fit", "never-read.npz"], "o/p.toml"), (["fit", "t.npz", "--hw", "a6000"], "o/p.toml"),
                      (["record", "moe-stdlib", "--tokens", "2"], "o/r.npz"),
                      (["synth", "--model", "tiny", "--tokens", "4"], "o/s.npz"),
                      (["stats", "t.npz"], "o/st"), ([*R, "--policy", "on-demand"], "o/rp"),
                      ([*W, "--policy", "on-demand", "--cache-gib", "0"], "o/w"),
                      (["ecospec", "--model", "qwen3-235b-a22b", "--deployment", "1xh200-offload", "--gamma", "2",
                        "--steps", "2"], "o/eo")):
        add(lk, [*args, "--out", out], words=("in use by another moesim run",), before=hold(out), timeout=120,
            fast=args[0] == "synth")

    # -- refused before any work
    er = "r10 early refusals"
    for opt, v, policy, words in (("--gpu-layers", "1000", "gpu-layers", ("--gpu-layers 1000", "has 48 layers")),
                                  ("--gpu-layers", "49", "gpu-layers", ("--gpu-layers 49",)),
                                  ("--gpu-layers", "8,1000", "gpu-layers", ("1000",)),
                                  ("--cpu-layers", "1000", "cpu-static", ("1000",)),
                                  ("--cpu-layers", "49", "cpu-static", ("49",))):
        add(er, ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--policy", policy, opt, v, "--tokens", "256",
                 "--jobs", "1", "--out", "w"], words=words, timeout=20, fast=v == "1000" and opt == "--gpu-layers")
    add(er, ["whatif", "--model", "qwen3-30b-a3b,olmoe-1b-7b", "--hw", "a6000", "--policy", "gpu-layers",
             "--gpu-layers", "20", "--tokens", "256", "--jobs", "1", "--out", "w"], words=("--gpu-layers 20",),
        timeout=20)  # olmoe-1b-7b has 16 layers
    add(er, ["whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--policy", "gpu-layers", "--gpu-layers", "48",
             "--tokens", "8", "--jobs", "1", "--json", "--out", "w"], expect="ok", check=json_rows, timeout=120)

    # -- config.json: dtype and quantisation, refused before transformers loads
    cj = "r10 config.json"
    for tag, extra, words in (("float7", {"torch_dtype": "float7"}, ("torch_dtype 'float7'",)),
                              ("num", {"torch_dtype": 5}, ("torch_dtype 5",)),
                              ("emptydt", {"torch_dtype": ""}, ("torch_dtype",)),
                              ("list", {"torch_dtype": ["bfloat16"]}, ("torch_dtype",)),
                              ("q", {"quantization_config": {"quant_method": "nope"}}, ("quantisation 'nope'",)),
                              ("qlist", {"quantization_config": [1]}, ("quantization_config",)),
                              ("qnum", {"quantization_config": {"quant_method": 3}}, ("quant",)),
                              ("fp8re", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                                  "modules_to_not_convert": ["re:("]}},
                               ("modules_to_not_convert",))):
        add(cj, ["models", "m"], words=words, before=config("m", **extra), timeout=15, fast=tag == "float7")
    add(cj, ["synth", "--model", "m", "--tokens", "4", "--out", "s.npz"], words=("float7",),
        before=config("m", torch_dtype="float7"), timeout=15)
    add(cj, [*W, "--model", "m", "--policy", "on-demand", "--out", "w"], words=("quantisation 'nope'",),
        before=config("m", quantization_config={"quant_method": "nope"}), timeout=15)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    add(cj, ["models", "m", "--json"], expect="ok", before=config("m", quantization_config={
        **fp8, "modules_to_not_convert": ["self_attn"]}), check=model_json(expert_dtype="fp8-block128",
                                                                            dense_dtype="bf16"), timeout=120)
    # one name as a string, not a list: taken letter by letter, "s" matched "experts"
    add(cj, ["models", "m", "--json"], expect="either", before=config("m", quantization_config={
        **fp8, "modules_to_not_convert": "self_attn"}), check=model_json(expert_dtype="fp8-block128"), timeout=120)

    # -- synth --like a trace without predictions
    sl = "r10 synth like"
    imported = first("import", "npz", str(STDLIB), "--model", "moe-stdlib", "--out", "imp.npz")
    add(sl, ["synth", "--like", "imp.npz", "--tokens", "16", "--out", "like.npz"], expect="ok", before=imported,
        check=no_predictions("like.npz", 16), fast=True)
    add(sl, ["synth", "--like", "imp.npz", "--tokens", "8", "--batch", "3", "--out", "like.npz"], expect="ok",
        before=imported, check=no_predictions("like.npz", 8, 3))
    add(sl, ["synth", "--like", "imp.npz", "--tokens", "1", "--out", "like.npz"], expect="ok", before=imported,
        check=no_predictions("like.npz", 1))
    add(sl, ["stats", "like.npz"], expect="ok", before=then(imported, first(
        "synth", "--like", "imp.npz", "--tokens", "16", "--out", "like.npz")),
        check=lambda d, s: "a predictor line for a trace without predictions" if "predictor" in s else None)

    # -- stdout closed or full
    so = "r10 stdout"
    for args, words in ((["models"], ("qwen3-30b-a3b",)), (["hw", "--hosts"], ("epyc-9654",)),
                        (["hw", "--engines"], ("llama.cpp",)), (["stats", "t.npz"], ()),
                        ([*R, "--policy", "on-demand", "--json"], ("on-demand",)),
                        ([*W, "--policy", "on-demand", "--cache-gib", "0", "--json", "--out", "w"], ("on-demand",)),
                        (["models", "--help"], ("Usage",))):
        for full in (False, True):
            add(so, args, expect="ok", check=closed_stdout(args, full, words), timeout=120,
                fast=args == ["models"] and not full)

    # -- COLUMNS that is no width
    co = "r10 columns"
    for args, word in ((["models"], "qwen3-30b-a3b"), (["hw"], "a6000"), (["hw", "--engines"], "llama.cpp"),
                       ([*R, "--policy", "on-demand"], "on-demand"),
                       ([*W, "--policy", "on-demand", "--cache-gib", "0", "--out", "w"], "on-demand")):
        for value in ("0", "-3", "abc", "5", "", "1e3", "99999999999999999999"):
            if args[0] != "models" and value in ("-3", "1e3", "") or args[0] == "whatif" and value in ("5", "abc"):
                continue
            add(co, args, expect="ok", check=columns(args, value, word), timeout=120,
                fast=args == ["models"] and value == "0")
    return c

