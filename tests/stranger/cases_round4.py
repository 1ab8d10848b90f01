"""Hostile cases of issue 24, round 4 (a stranger's fresh-clone run): see tests/stranger/cases.py.

None of these repeats a case of cases.py, cases_inputs.py or cases_sweeps.py: other commands
given the old broken files (stats, synth --like, whatif --trace, --placement-from, fit), new
kinds of broken trace arrays and headers, odd hardware profiles, edge values of the newer
commands' options (stats, ecospec, import, record, replay's multi-GPU and prefetch options),
outputs of the newer commands, special paths (symlink loops, dangling links, a file even root
may not read, /proc files whose size says 0), interrupts by several signals or mixed signals,
two runs at once on one output, options that change nothing, and results whose numbers are
checked for plausibility (a silent wrong answer is a bad ending).

Two helpers reach past the harness's usual inputs, without changing it:

- ``signals(...)``: a ``before`` that starts a thread which finds the case's process (the
  harness's child whose working folder is the case's) and sends it further signals at
  given times; the harness sends the first (``signal_after``).
- ``concurrent(...)``: a ``before`` that starts a second ``moesim`` run (the same command
  or another) on a shared output outside the case's folder; the case's check waits for it
  and verifies both ended well and that the shared output has every row exactly once.

A check that must read stderr (a note that an option changed nothing) reads it from
:data:`LAST`, set by a wrapper of the harness's ``classify`` (thread-local: the harness runs
cases on a thread pool)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from cases import ROOT, Case, json_rows, no_tmp, run_moesim, trace_file

LAST = threading.local()  # .stderr of the case being classified on this thread
SHARED = Path(tempfile.gettempdir())
_BG: dict[str, subprocess.Popen] = {}
SHIPPED = ROOT / "executor" / "checkpoints" / "moe-stdlib"
EXAMPLES = ROOT / "traces" / "examples"
NOREAD = "/proc/sys/vm/compact_memory"  # a regular file (by stat) that even root may not read


def _install_stderr_hook() -> None:
    """Wrap ``classify`` of every loaded copy of the harness so checks can read stderr."""
    for mod in (sys.modules.get("cases"), sys.modules.get("__main__")):
        fn = getattr(mod, "classify", None)
        if fn is None or getattr(fn, "_r4", False):
            continue

        def wrapped(case, rc, stdout, stderr, *rest, _fn=fn):
            LAST.stderr = stderr
            return _fn(case, rc, stdout, stderr, *rest)
        wrapped._r4 = True
        mod.classify = wrapped


# -------------------------------------------------------------------------------------
# fixtures made by a case's ``before``
# -------------------------------------------------------------------------------------

def mutate(name: str, header: dict | None = None, drop: tuple[str, ...] = (), **exprs: str) -> Callable[[Path], None]:
    """``name``: t.npz with arrays replaced (``exprs``: Python over ``a``, the arrays, and
    ``np``), arrays dropped, header fields changed (None deletes a field)."""
    def make(d: Path) -> None:
        import numpy as np

        with np.load(d / "t.npz") as z:
            a = {k: z[k] for k in z.files}
        h = json.loads(bytes(a["header"]).decode())
        for k, v in (header or {}).items():
            if v is None:
                h.pop(k, None)
            else:
                h[k] = v
        new = {k: v for k, v in a.items() if k not in drop}
        for k, e in exprs.items():
            new[k] = eval(e, {"np": np, "a": a})  # noqa: S307 (the case's own literal)
        new["header"] = np.frombuffer(json.dumps(h).encode(), np.uint8)
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        with open(d / name, "wb") as f:
            np.savez(f, **new)
    return make


def link(name: str, target: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, d / name)
    return make


def both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        for m in makers:
            m(d)
    return make


def profile(name: str, old: str, new: str, count: int = 1) -> Callable[[Path], None]:
    """The a6000 profile with ``old`` replaced by ``new``."""
    def make(d: Path) -> None:
        text = (ROOT / "hwprofiles" / "a6000.toml").read_text()
        assert old in text, old
        (d / name).write_text(text.replace(old, new, count))
    return make


def synth(name: str, *extra: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        r = run_moesim(["synth", "--out", name, *extra], d, timeout=300)
        assert r.returncode == 0, r.stderr
    return make


def big_jsonl(name: str, tokens: int) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        with open(d / name, "w") as f:
            for t in range(tokens):
                for layer in range(4):
                    f.write(json.dumps({"token": t, "layer": layer, "experts": [(t + layer) % 16, (t * 7 + 3) % 16]})
                            + "\n")
    return make


# -------------------------------------------------------------------------------------
# signals and concurrent runs
# -------------------------------------------------------------------------------------

def _same_dir(pid: int, d: Path) -> bool:
    try:
        return os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(d)
    except OSError:
        return False


def _procs_in(d: Path) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid() and _same_dir(int(p), d):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            except OSError:
                continue
            if b"moesim" in cmd or b"multiprocessing" in cmd or b"python" in cmd:
                out.append(int(p))
    return out


def signals(at: list[tuple[float, int]]) -> Callable[[Path], None]:
    """Send ``sig`` at each ``t`` seconds after the case's process starts (besides the
    harness's own signal)."""
    def make(d: Path) -> None:
        def run() -> None:
            t0 = time.time()
            pid = None
            while pid is None and time.time() - t0 < 30:
                for p in _procs_in(d):
                    try:
                        if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                            pid = p
                    except (OSError, ValueError, IndexError):
                        pass
                time.sleep(0.02)
            if pid is None:
                return
            start = time.time()
            for t, sig in at:
                time.sleep(max(0.0, start + t - time.time()))
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
        threading.Thread(target=run, daemon=True).start()
    return make


def no_leftovers(d: Path, stdout: str) -> str | None:
    """No .tmp, no .lock, and no worker process left in the case's folder (2 s grace)."""
    problem = no_tmp(d, stdout)
    if problem:
        return problem
    locks = [str(p.relative_to(d)) for p in d.rglob("*.lock")]
    if locks:
        return f"lock files left: {locks}"
    deadline = time.time() + 2
    while (left := _procs_in(d)) and time.time() < deadline:
        time.sleep(0.1)
    if left:
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return f"processes left running: {left}"
    return None


def interrupted_with(*checks: Callable[[Path, str], str | None]) -> Callable[[Path, str], str | None]:
    def check(d: Path, stdout: str) -> str | None:
        for c in (no_leftovers, *checks):
            problem = c(d, stdout)
            if problem:
                return problem
        return None
    return check


def shared_dir() -> Path:
    return SHARED / f"moesim-r4-{uuid.uuid4().hex[:10]}"


def concurrent(args: list[str], shared: Path, delay: float = 1.0) -> Callable[[Path], None]:
    """Start ``moesim args`` beside the case's run, ``delay`` s before it (negative: after)."""
    def make(d: Path) -> None:
        shared.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "80"}

        def start() -> None:
            _BG[str(shared)] = subprocess.Popen([sys.executable, "-m", "moesim", *args], cwd=shared, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                errors="replace")
        if delay >= 0:
            start()
            time.sleep(delay)
        else:
            threading.Timer(-delay, start).start()
    return make


def _bg_result(shared: Path, timeout: float = 180) -> tuple[int, str, str] | str:
    for _ in range(100):  # a delayed start may not have happened yet
        if str(shared) in _BG:
            break
        time.sleep(0.1)
    p = _BG.pop(str(shared), None)
    if p is None:
        return "the second run never started"
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return "the second run hung"
    return p.returncode, out, err


def both_ended_well(shared: Path, rows: str | None = None, expect_rows: int | None = None, files: tuple[str, ...] = (),
                    trace: str | None = None) -> Callable[[Path, str], str | None]:
    """The concurrent run ended in exit 0 or a one-line refusal; the shared rows file holds
    every configuration once; the shared files exist; no .tmp or .lock left there."""
    def check(d: Path, stdout: str) -> str | None:
        res = _bg_result(shared)
        try:
            if isinstance(res, str):
                return res
            rc, _, err = res
            lines = [ln for ln in err.splitlines() if ln.strip()]
            if "Traceback" in err or rc not in (0, 2):
                return f"second run: exit {rc}: {lines[-1][:160] if lines else ''}"
            if rc == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
                return f"second run: exit 2 with {len(lines)} stderr lines"
            if rows is not None:
                with open(shared / rows, newline="") as f:
                    body = list(csv.DictReader(f))
                keys = [tuple(r.get(k) for k in ("model", "hw", "policy", "link_gbps", "cache_gib", "batch",
                                                   "prompt_len")) for r in body]
                if len(set(keys)) != len(keys):
                    return f"rows duplicated: {len(keys)} rows, {len(set(keys))} distinct"
                if expect_rows is not None and len(keys) != expect_rows:
                    return f"rows lost: {len(keys)} of {expect_rows}"
            for f in files:
                if not (shared / f).exists():
                    return f"{f} missing after both runs"
            if trace is not None:
                problem = trace_file(trace)(shared, "")
                if problem:
                    return problem
            left = [p.name for p in shared.rglob("*") if p.name.endswith((".tmp", ".lock"))]
            if left:
                return f"left in the shared folder: {left}"
            return None
        finally:
            shutil.rmtree(shared, ignore_errors=True)
    return check


# -------------------------------------------------------------------------------------
# checks of results: plausibility
# -------------------------------------------------------------------------------------

def says(*words: str, out: bool = False) -> Callable[[Path, str], str | None]:
    """stderr (or stdout) names every word: the note that an option changed nothing."""
    def check(d: Path, stdout: str) -> str | None:
        text = stdout if out else getattr(LAST, "stderr", "")
        missing = [w for w in words if w not in text]
        return f"no note naming {missing} ({'stdout' if out else 'stderr'}: {text.strip()[-160:]!r})" if missing else None
    return check


def replay_json(rows: list[dict]) -> list[dict]:
    return rows if isinstance(rows, list) else rows.get("rows", [])


def policy_order(*names: str) -> Callable[[Path, str], str | None]:
    """replay --json: the policies' mean TPOTs are in this order (each <= the next, 0.1%)."""
    def check(d: Path, stdout: str) -> str | None:
        problem = json_rows(d, stdout)
        if problem:
            return problem
        rows = {r["policy"]: r["tpot_ms"] for r in replay_json(json.loads(stdout))}
        vals = [rows.get(n) for n in names]
        if None in vals:
            return f"missing policies: {rows}"
        for a, b, x, y in zip(names, names[1:], vals, vals[1:], strict=False):
            if x > y * 1.001:
                return f"{a} ({x:.4g} ms) is slower than {b} ({y:.4g} ms)"
        return None
    return check


def row_sanity(d: Path, stdout: str) -> str | None:
    """Every row: tpot >= compute > 0, the parts finite and >= 0, tokens_per_s = 1000 / tpot (a
    sequence's rate: at batch > 1 the machine's is batch times it)."""
    problem = json_rows(d, stdout)
    if problem:
        return problem
    obj = json.loads(stdout)
    for r in replay_json(obj):
        t = r["tpot_ms"]
        for k in ("compute_ms", "copy_ms", "stall_ms"):
            v = r.get(k)
            if v is not None and (not isinstance(v, int | float) or v != v or v < -1e-9 or v == float("inf")):
                return f"{k} = {v!r}"
        if r.get("compute_ms") is not None and r["compute_ms"] > t * 1.0001:
            return f"compute {r['compute_ms']} ms > tpot {t} ms"
        tps = r.get("tokens_per_s")
        if tps is not None and abs(tps - 1000.0 / t) > 1e-3 * tps:
            return f"tokens_per_s {tps} != 1000 / tpot {t}"
    return None


def sweep_rows(n: int, monotone_link: bool = False) -> Callable[[Path, str], str | None]:
    """whatif --json: exactly ``n`` rows, each sane; with ``monotone_link`` a copy policy is
    never faster on a slower link (same everything else)."""
    def check(d: Path, stdout: str) -> str | None:
        problem = row_sanity(d, stdout)
        if problem:
            return problem
        rows = json.loads(stdout)["rows"]
        if len(rows) != n:
            return f"{len(rows)} rows, expected {n}"
        if monotone_link:
            by: dict = {}
            for r in rows:
                by.setdefault((r["policy"], r["cache_gib"], r["hw"]), []).append((r["link_gbps"], r["tpot_ms"]))
            for k, v in by.items():
                v.sort()
                for (l1, t1), (l2, t2) in zip(v, v[1:], strict=False):
                    if t2 > t1 * 1.001:
                        return f"{k}: {t2:.4g} ms at {l2} GB/s > {t1:.4g} ms at {l1} GB/s"
        return None
    return check


def stats_sane(d: Path, stdout: str) -> str | None:
    """stats --json: hit rates in [0, 1], non-decreasing in size, Belady >= LRU and LFU."""
    try:
        h = json.loads(stdout)["hit_rate"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"no hit_rate in stdout ({e})"
    for k in ("lru", "lfu", "belady"):
        v = h[k]
        if any(not 0 <= x <= 1 for x in v):
            return f"{k} hit rate outside [0, 1]: {v}"
        if any(b < a - 1e-12 for a, b in zip(v, v[1:], strict=False)) and sorted(h["sizes"]) == h["sizes"]:
            return f"{k} hit rate falls as the cache grows: {v}"
    for k in ("lru", "lfu"):
        if any(x > y + 1e-12 for x, y in zip(h[k], h["belady"], strict=False)):
            return f"{k} beats Belady's optimum: {h[k]} > {h['belady']}"
    return None


def trace_tokens(name: str, tokens: int, batch: int | None = None) -> Callable[[Path, str], str | None]:
    def check(d: Path, stdout: str) -> str | None:
        import numpy as np

        problem = trace_file(name)(d, stdout)
        if problem:
            return problem
        with np.load(d / name) as z:
            ids = z["true_ids"]
        if ids.shape[0] != tokens or (batch is not None and ids.shape[2] != batch):
            return f"{name}: true_ids shape {ids.shape}, expected {tokens} steps" + (f", batch {batch}" if batch else "")
        return None
    return check


def ecospec_rows(d: Path, stdout: str) -> str | None:
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError as e:
        return f"stdout is not JSON ({e})"
    if not rows:
        return "no rows"
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                return f"{k} = {v} in row {r.get('selection')} gamma {r.get('gamma')}"
        t = r.get("tpot_ms")
        if t is not None and not t > 0:
            return f"tpot_ms {t}"
    return None


def all_of(*checks: Callable[[Path, str], str | None]) -> Callable[[Path, str], str | None]:
    def check(d: Path, stdout: str) -> str | None:
        for c in checks:
            problem = c(d, stdout)
            if problem:
                return problem
        return None
    return check


# -------------------------------------------------------------------------------------
# the cases
# -------------------------------------------------------------------------------------

R = ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--json"]
W = ["whatif", "--model", "tiny", "--hw", "a6000", "--tokens", "4", "--jobs", "1", "--policy", "on-demand",
     "--cache-gib", "0"]
DUMP = ["--model", "tiny", "--out", "o.npz"]
POOL = ["whatif", "--model", "qwen3-30b-a3b,olmoe-1b-7b", "--hw", "a6000,h100-sxm,gh200", "--tokens", "256",
        "--link-gbps", "8,16,32,64", "--cache-gib", "0,4,8,16", "--jobs", "2", "--sim", "simpy", "--rows", "s/rows.csv",
        "--out", "s/w"]
ECO = ["ecospec", "--model", "qwen3-235b-a22b", "--deployment", "1xh200-offload", "--gamma", "2", "--steps", "2"]


def round4_cases() -> list[Case]:
    _install_stderr_hook()
    c: list[Case] = []

    def add(cls: str, args: list[str], expect: str = "error", **kw) -> None:
        c.append(Case(cls, list(args), expect=expect, **kw))

    # -- the old broken trace files, given to the commands that read traces besides replay
    old = "r4 old files, other readers"
    for f in ("badids.npz", "nangates.npz", "wrongshape.npz", "floatids.npz", "truncated.npz", "noheader.npz",
              "lies.npz", "v99.npz", "listheader.npz", "noroute.npz", "badmodel.npz", "random.npz"):
        add(old, ["stats", f], fast=f == "badids.npz")
    for f in ("badids.npz", "nangates.npz", "wrongshape.npz", "floatids.npz", "lies.npz", "noroute.npz", "text.npz"):
        add(old, ["synth", "--like", f, "--tokens", "4", "--out", "s.npz"])
    for f in ("nangates.npz", "wrongshape.npz", "floatids.npz", "lies.npz", "truncated.npz"):
        add(old, ["whatif", "--trace", f, "--hw", "a6000", "--jobs", "1", "--policy", "on-demand", "--out", "w"])
    for f in ("badids.npz", "truncated.npz", "wrongshape.npz", "text.npz", "dir"):
        add(old, ["replay", "t.npz", "--hw", "a6000", "--policy", "hot-experts", "--placement-from", f])
    for f in ("nangates.npz", "floatids.npz", "noheader.npz"):
        add(old, ["fit", f])
    add(old, ["stats", "t.npz", "--hw", "binary.toml"])
    add(old, ["stats", "t.npz", "--hw", "negative.toml"])

    # -- new kinds of broken trace arrays and headers
    nt = "r4 trace arrays"
    for tag, kw in (("boolids", {"true_ids": "a['true_ids'] % 2 == 0"}),
                    ("negids", {"true_ids": "a['true_ids'] - 100"}),
                    ("int64big", {"true_ids": "a['true_ids'].astype(np.int64) + 2**40"}),
                    ("uint8ids", {"true_ids": "a['true_ids'].astype(np.uint8)"}),
                    ("gates>1", {"true_gates": "a['true_gates'] * 10"}),
                    ("neggates", {"true_gates": "-a['true_gates']"}),
                    ("infgates", {"true_gates": "np.full_like(a['true_gates'], np.inf)"}),
                    ("f16gates", {"true_gates": "a['true_gates'].astype(np.float16)"}),
                    ("objids", {"true_ids": "np.array([None] * 4, dtype=object)"}),
                    ("5d", {"true_ids": "a['true_ids'][..., None]"}),
                    ("0steps", {"true_ids": "a['true_ids'][:0]", "true_gates": "a['true_gates'][:0]",
                                "pred_ids": "a['pred_ids'][:0]", "pred_gates": "a['pred_gates'][:0]",
                                "exec_ids": "a['exec_ids'][:0]", "token_ids": "a['token_ids'][:, :0]"}),
                    ("dupexperts", {"true_ids": "np.zeros_like(a['true_ids'])"}),
                    ("predbad", {"pred_ids": "np.full(a['pred_ids'].shape, 9999, np.int16)"}),
                    ("predshape", {"pred_ids": "a['pred_ids'][:, :1]"}),
                    ("tokvocab", {"token_ids": "np.full_like(a['token_ids'], 10**6)"}),
                    ("strids", {"true_ids": "a['true_ids'].astype(str)"}),
                    ("cplxgates", {"true_gates": "a['true_gates'].astype(np.complex64)"}),
                    ("scalarids", {"true_ids": "np.int16(3)"})):
        add(nt, [*R[:1], f"{tag}.npz", *R[2:]], before=mutate(f"{tag}.npz", **kw),
            expect="either", check=row_sanity, fast=tag == "boolids")
        if tag in ("boolids", "negids", "dupexperts", "0steps", "objids", "gates>1"):
            add(nt, ["stats", f"{tag}.npz", "--json"], before=mutate(f"{tag}.npz", **kw), expect="either",
                check=stats_sane)
    for tag, h in (("ntok0", {"n_tokens": 0}), ("ntokneg", {"n_tokens": -8}), ("ntokbool", {"n_tokens": True}),
                   ("batch2", {"batch": 2}), ("nomodel", {"model": None}), ("promptneg", {"prompt_len": -5}),
                   ("fmt", {"format": "not-moesim"}), ("synthstr", {"synthetic": "yes"}),
                   ("modelnum", {"model": 5}), ("ntokstr", {"n_tokens": "8"}), ("promptstr", {"prompt_len": "abc"}),
                   ("prompthuge", {"prompt_len": 10**12}), ("promptbool", {"prompt_len": True})):
        # a header prompt_len the arrays do not hold (-5, 10**12) silently moved TPOT and TTFT: due a refusal
        add(nt, [*R[:1], f"{tag}.npz", *R[2:]], before=mutate(f"{tag}.npz", header=h),
            expect="error" if tag in ("promptneg", "prompthuge") else "either", check=row_sanity)
    add(nt, ["stats", "ntok0.npz"], before=mutate("ntok0.npz", header={"n_tokens": 0}), expect="either",
        check=lambda d, s: None)
    add(nt, ["synth", "--like", "dupexperts.npz", "--tokens", "4", "--out", "s.npz"],
        before=mutate("dupexperts.npz", true_ids="np.zeros_like(a['true_ids'])"), expect="either",
        check=trace_file("s.npz"))

    # -- odd hardware profiles
    hp = "r4 profiles"
    for tag, old_s, new_s in (("bool", "value = 48.0", "value = true"), ("nan", "value = 48.0", "value = nan"),
                              ("inf", "value = 676.0", "value = inf"), ("huge", "value = 48.0", "value = 1e308"),
                              ("zero", "value = 676.0", "value = 0.0"), ("str", "value = 48.0", 'value = "48"'),
                              ("tiny", "value = 25.0", "value = 1e-300"), ("noname", 'name = "a6000"\n', ""),
                              ("emptyname", 'name = "a6000"', 'name = ""'), ("comma", 'name = "a6000"', 'name = "a,b"'),
                              ("link", 'link = "pcie4"', 'link = "nope"'), ("host", 'host = "epyc-7742"', 'host = "nope"'),
                              ("dupkey", 'name = "a6000"', 'name = "a6000"\nname = "b"'),
                              ("negeff", "value = 0.6", "value = 1.5"), ("array", "value = 48.0", "value = [48.0]")):
        add(hp, [*R, "--hw", f"{tag}.toml"], before=profile(f"{tag}.toml", old_s, new_s), expect="either",
            check=row_sanity, fast=tag == "nan")
    add(hp, [*W, "--hw", "a6000,nan.toml", "--json", "--out", "w"],
        before=profile("nan.toml", "value = 48.0", "value = nan"))
    add(hp, [*R, "--hw", "/etc/passwd"])
    add(hp, [*R, "--hw", "/proc/cpuinfo"])
    add(hp, [*R, "--hw", "2xa6000-copy.toml"], expect="either", check=row_sanity)
    add(hp, [*R, "--hw", "a6000+a6000-copy.toml"], expect="either", check=row_sanity)
    add(hp, ["hw", "nan.toml"], before=profile("nan.toml", "value = 48.0", "value = nan"))

    # -- edge values of the newer commands' options
    num = "r4 numbers"
    for v in ("-1", "nan", "", "1,,2", "2,2", "1e12", "abc", "0", "inf", "1.5"):
        add(num, ["stats", "t.npz", "--sizes", v, "--json"], expect="either", check=stats_sane, fast=v == "nan")
    add(num, ["stats", "t.npz", "--sizes", "8,4,2", "--json"], expect="either", check=stats_sane)
    add(num, ["stats", "t.npz", "--hw", "a6000", "--policy", "nope"])
    add(num, ["stats", "t.npz", "--hw", "a6000", "--sizes", "100000000", "--json"], expect="either", check=stats_sane,
        timeout=120)
    for opt, v in (("--gamma", "-1"), ("--gamma", "nan"), ("--gamma", "1e9"), ("--gamma", "1.5"), ("--gamma", ""),
                   ("--steps", "-1"), ("--steps", "1000000000"), ("--branch", "0"), ("--branch", "-2"),
                   ("--depth", "-1"), ("--depth", "1000"), ("--accept", ""), ("--accept", "nan"),
                   ("--accept", "0.5,,0.5"), ("--recall", "-0.1"), ("--seed", "-1"), ("--draft", "eagle:-1"),
                   ("--draft", "nope"), ("--draft", "dense:nan"), ("--selection", ""), ("--selection", "ecospec:nope"),
                   ("--model", ""), ("--model", "tiny,tiny"), ("--deployment", "")):
        add(num, [*ECO, "--json", opt, v], expect="either", check=ecospec_rows, timeout=120)
    add(num, [*ECO[:-2], "--steps", "2", "--branch", "1000", "--depth", "10"], timeout=120)
    for opt, v in (("--tokens", "0"), ("--batch", "0"), ("--tokens", "1000000000000"), ("--lookahead", "0"),
                   ("--lookahead", "-1"), ("--draw-seed", "-1"), ("--seed", "99999999999999999999")):
        add(num, ["synth", "--like", "t.npz", opt, v, "--out", "s.npz"], expect="either", check=trace_file("s.npz"))
    for opt, v, hw in (("--tensor-split", "1,-1", "2xa6000"), ("--tensor-split", "nan,1", "2xa6000"),
                       ("--tensor-split", "1,2,3", "2xa6000"), ("--tensor-split", "0,0", "2xa6000"),
                       ("--split", "nope", "2xa6000"), ("--lookahead", "0", "a6000"), ("--lookahead", "99", "a6000"),
                       ("--prefetch-top", "-1", "a6000"), ("--prefetch-top", "99999", "a6000"),
                       ("--threads", "99999999", "a6000"), ("--cache-experts", "100000000000000000000", "a6000"),
                       ("--link-gbps", "1e300", "a6000"), ("--link-gbps", "1e-300", "a6000")):
        pol = ("prefetch" if opt in ("--lookahead", "--prefetch-top") else "all-resident" if hw == "2xa6000"
               else "on-demand")
        add(num, ["replay", "t.npz", "--hw", hw, "--policy", pol, "--sim", "fast", "--json", opt, v], expect="either",
            check=row_sanity)
    for opt, v in (("--gpu-layers", "-1"), ("--gpu-layers", "99999"), ("--offload-gib", "nan"),
                   ("--cpu-layers", "-1"), ("--cpu-layers", "99")):
        pol = {"--gpu-layers": "gpu-layers", "--offload-gib": "weight-streaming", "--cpu-layers": "cpu-static"}[opt]
        add(num, ["replay", "t.npz", "--hw", "a6000", "--policy", pol, "--sim", "fast", "--json", opt, v],
            expect="either", check=row_sanity)
    for hw in ("0xa6000", "99999xa6000", "a6000+", "+", "", "-1xa6000", "1.5xa6000"):
        add(num, ["replay", "t.npz", "--hw", hw, "--policy", "on-demand", "--sim", "fast", "--json"], expect="either",
            check=row_sanity)
    for v in ("-1", "0", "1000000000000"):
        add(num, ["import", "vllm", str(EXAMPLES / "vllm-synthetic-deepseek-v2-lite.npy"), "--model",
                  "deepseek-v2-lite", "--prompt-tokens", v, "--out", "o.npz"], expect="either", check=trace_file("o.npz"))
    for opt, v in (("--tokens", "0"), ("--batch", "0"), ("--temperature", "inf"), ("--temperature", "-1"),
                   ("--prompt-ids", "a,b"), ("--prompt-ids", "999999"), ("--prompt-ids", ""), ("--prompt-ids", "-1,2"),
                   ("--prompt", ""), ("--budget", "-1"), ("--lambda", "nan"), ("--tree-depth", "-1"),
                   ("--device", "cuda")):
        add(num, ["record", "moe-stdlib", "--tokens", "1", "--out", "r.npz", opt, v], timeout=120)
    for opt, v in (("--prompt-len", "-1"), ("--batch", "1,0"), ("--lookahead", "-1"), ("--top", "0"),
                   ("--host-ram-gb", "-1"), ("--host-ram-gb", "0"), ("--gpu-layers", "1e9"), ("--prefetch-top", "nan")):
        add(num, [*W, "--json", "--out", "w", opt, v], expect="either", check=row_sanity)

    # -- outputs of the newer commands
    out = "r4 outputs"
    for args in (["stats", "t.npz"], [*ECO], ["import", "jsonl", str(EXAMPLES / "routing-moe-stdlib.jsonl"),
                                              "--model", str(SHIPPED)]):
        kind = "file" if args[0] == "import" else "dir"
        wrong = "dir" if kind == "file" else "afile"
        add(out, [*args, "--out", wrong], fast=args[0] == "stats")
        add(out, [*args, "--out", "afile/sub"])
        add(out, [*args, "--out", "/dev/full"])
        add(out, [*args, "--out", "x" * 300])
        add(out, [*args, "--out", "ro/x" + (".npz" if kind == "file" else "")], needs="readonly")
        add(out, [*args, "--out", ""])
    add(out, ["record", "moe-stdlib", "--tokens", "1", "--out", "dir"], timeout=120)
    add(out, ["record", "moe-stdlib", "--tokens", "1", "--out", "/dev/full"], timeout=120)
    add(out, ["record", "moe-stdlib", "--tokens", "1", "--out", "ro/r.npz"], needs="readonly", timeout=120)
    add(out, ["synth", "--model", "tiny", "--tokens", "4", "--out", ""])
    add(out, ["synth", "--model", "tiny", "--tokens", "4", "--out", "x.txt"], expect="either", check=no_tmp)
    add(out, ["synth", "--model", "tiny", "--tokens", "4", "--out", ".npz"], expect="either", check=no_tmp)
    add(out, ["synth", "--model", "tiny", "--tokens", "4", "--out", "a\nb.npz"], expect="either",
        check=trace_file("a\nb.npz"))
    add(out, ["synth", "--like", "s/x.npz", "--tokens", "4", "--out", "s/x.npz"],
        before=lambda d: ((d / "s").mkdir(), shutil.copy(d / "t.npz", d / "s" / "x.npz")), expect="either",
        check=trace_tokens("s/x.npz", 4))
    add(out, ["replay", "t.npz", "--sim", "fast", "--policy", "on-demand", "--out", "t.npz"])
    add(out, ["whatif", "--trace", "t.npz", "--hw", "a6000", "--jobs", "1", "--policy", "on-demand", "--out", "w",
              "--rows", "t.npz"])
    add(out, [*W, "--out", "w", "--rows", "w"], expect="either", check=json_rows)
    add(out, [*W, "--out", "w", "--rows", ""])
    add(out, [*W, "--out", "", "--json"])
    add(out, [*W, "--out", "loop/x", "--json"], before=both(link("loop", "loop2"), link("loop2", "loop")))
    add(out, ["synth", "--model", "tiny", "--tokens", "4", "--out", "dangling.npz"], before=link("dangling.npz", "nowhere/x.npz"),
        expect="either", check=no_tmp)

    # -- special paths as inputs
    sp = "r4 special paths"
    loop = both(link("loop.npz", "loop2.npz"), link("loop2.npz", "loop.npz"))
    for args in (["stats", "loop.npz"], ["replay", "loop.npz"], ["synth", "--like", "loop.npz", "--out", "s.npz"],
                 ["fit", "loop.npz"], ["whatif", "--trace", "loop.npz", "--jobs", "1", "--out", "w"],
                 ["import", "jsonl", "loop.npz", *DUMP]):
        add(sp, args, before=loop, fast=args[0] == "stats")
    add(sp, [*R, "--hw", "loop.toml"], before=both(link("loop.toml", "l2.toml"), link("l2.toml", "loop.toml")))
    add(sp, ["models", "m"], before=both(link("m", "m2"), link("m2", "m")))
    add(sp, ["record", "m", "--tokens", "1"], before=both(link("m", "m2"), link("m2", "m")), timeout=120)
    for args in (["stats", "gone.npz"], [*R, "--hw", "gone.toml"], ["import", "jsonl", "gone.npz", *DUMP]):
        add(sp, args, before=link(next(a for a in args if a.startswith("gone.")), "nowhere"))
    # (in a subfolder: the harness hashes the top folder's files, and even root may not read these)
    for args in (["stats", "nr/t.npz"], ["replay", "nr/t.npz"], [*R, "--hw", "nr/p.toml"],
                 ["import", "jsonl", "nr/d.jsonl", *DUMP], ["synth", "--like", "nr/t.npz", "--out", "s.npz"],
                 ["record", "moe-stdlib", "--tokens", "1", "--prompts-file", "nr/p.txt"]):
        name = next(a for a in args if a.startswith("nr/"))
        add(sp, args, before=link(name, NOREAD), timeout=120)
    add(sp, ["models", "m"], before=both(lambda d: (d / "m").mkdir(), link("m/config.json", NOREAD)))
    for args in (["stats", "t.npz/"], ["stats", ""], ["stats", "-"], [*R, "--hw", "a6000.toml/"],
                 ["import", "jsonl", "", *DUMP], ["synth", "--like", "", "--out", "s.npz"],
                 ["stats", "/proc/self/environ"], ["import", "jsonl", "/proc/self/environ", *DUMP],
                 ["replay", "/proc/self/cmdline"], ["record", "moe-stdlib", "--tokens", "1",
                                                    "--prompts-file", "/proc/version"]):
        add(sp, args, expect="either" if "/proc/version" in args or args == ["stats", "t.npz/"] else "error",
            check=trace_file("o.npz") if args[0] == "import" else None, timeout=120)
    add(sp, [*R, "--hw", "my,prof.toml"], before=lambda d: shutil.copy(d / "a6000-copy.toml", d / "my,prof.toml"),
        expect="either", check=row_sanity)  # replay takes one machine: a file of that name is read
    add(sp, ["import", "jsonl", "d.jsonl", "--model", "moe-stdlib", "--out", "o.npz"],
        before=lambda d: shutil.copy(EXAMPLES / "routing-moe-stdlib.jsonl", d / "d.jsonl"), expect="either",
        check=trace_file("o.npz"))

    # -- interrupts: several signals, mixed signals, each command
    it = "r4 interrupts"
    INT, TERM = signal.SIGINT, signal.SIGTERM
    for first, more in ((INT, [(2.2, TERM)]), (TERM, [(2.1, TERM), (2.2, TERM), (2.3, TERM)]),
                        (INT, [(2.05, INT), (2.1, INT), (2.15, INT), (2.2, INT), (2.25, INT)]),
                        (TERM, [(2.3, INT)])):
        add(it, list(POOL), expect="interrupt", signal_after=2.0, sig=first, before=signals(more), timeout=120,
            check=no_leftovers)
    add(it, list(POOL), expect="interrupt", signal_after=0.3, sig=INT, timeout=120, check=no_leftovers)
    add(it, list(POOL), expect="interrupt", signal_after=0.6, sig=TERM, before=signals([(0.7, TERM)]), timeout=120,
        check=no_leftovers)
    big = synth("big.npz", "--model", "qwen3-30b-a3b", "--tokens", "3000")
    add(it, ["stats", "big.npz", "--hw", "a6000", "--out", "so"], expect="interrupt", signal_after=3.0, sig=INT,
        before=big, timeout=120, check=no_leftovers)
    add(it, ["stats", "big.npz", "--out", "so"], expect="interrupt", signal_after=2.5, sig=TERM,
        before=both(big, signals([(2.6, TERM)])), timeout=120, check=no_leftovers)
    add(it, ["ecospec", "--out", "eo"], expect="interrupt", signal_after=3.0, sig=INT, timeout=120, check=no_leftovers)
    add(it, ["ecospec", "--out", "eo"], expect="interrupt", signal_after=3.0, sig=TERM,
        before=signals([(3.1, INT)]), timeout=120, check=no_leftovers)
    add(it, ["synth", "--like", "big.npz", "--tokens", "20000", "--batch", "4", "--out", "s.npz"], expect="interrupt",
        signal_after=3.0, sig=INT, before=big, timeout=120, check=no_leftovers)
    add(it, ["import", "jsonl", "big.jsonl", *DUMP], expect="interrupt", signal_after=2.0, sig=INT,
        before=big_jsonl("big.jsonl", 200000), timeout=120, check=no_leftovers)
    add(it, ["record", "moe-stdlib", "--tokens", "400", "--out", "r.npz"], expect="interrupt", signal_after=12.0,
        sig=INT, before=signals([(12.2, INT)]), timeout=120,
        check=lambda d, s: no_leftovers(d, s) or (trace_file("r.npz")(d, s) if (d / "r.npz").exists() else None))
    add(it, ["record", "moe-stdlib", "--tokens", "400", "--out", "r.npz"], expect="interrupt", signal_after=12.0,
        sig=TERM, timeout=120,
        check=lambda d, s: no_leftovers(d, s) or (trace_file("r.npz")(d, s) if (d / "r.npz").exists() else None))
    add(it, ["synth", "--speculative", "--model", "qwen3-30b-a3b", "--tokens", "1400", "--out", "sp.npz"],
        expect="interrupt", signal_after=2.5, sig=TERM, before=signals([(2.6, INT)]), timeout=120, check=no_leftovers)
    add(it, ["replay", "big.npz", "--hw", "a6000", "--sim", "simpy", "--policy", "on-demand,prefetch", "--out", "ro2"],
        expect="interrupt", signal_after=4.0, sig=INT, before=both(big, signals([(4.01, INT), (4.02, TERM)])),
        timeout=120, check=no_leftovers)

    # -- two runs at once on one output
    cc = "r4 concurrency"
    small = ["whatif", "--model", "tiny", "--hw", "a6000,h100-sxm", "--tokens", "64", "--jobs", "1", "--policy",
             "on-demand,prefetch", "--cache-gib", "0,1", "--link-gbps", "8,16,32", "--sim", "simpy"]
    n_small = 2 * 2 * 2 * 3
    sh = shared_dir()
    args = [*small, "--rows", str(sh / "r.csv"), "--out", str(sh / "w1")]
    add(cc, args, expect="ok", before=concurrent([*small, "--rows", str(sh / "r.csv"), "--out", str(sh / "w2")], sh,
                                                 delay=-1.0),
        check=both_ended_well(sh, "r.csv", n_small), timeout=180)
    sh = shared_dir()
    args = [*small, "--rows", str(sh / "r.csv"), "--out", str(sh / "w")]
    add(cc, args, expect="ok", before=concurrent(args, sh, delay=-1.0), check=both_ended_well(sh, "r.csv", n_small),
        timeout=180)
    sh = shared_dir()
    args = [*small, "--out", str(sh / "w")]
    add(cc, args, expect="ok", before=concurrent(args, sh, delay=-1.0), check=both_ended_well(sh, files=("w/report.html",)),
        timeout=180)
    sh = shared_dir()
    add(cc, [*small, "--rows", str(sh / "r.csv"), "--out", str(sh / "w1")], before=concurrent(
        [*small, "--cache-gib", "0,1,2", "--rows", str(sh / "r.csv"), "--out", str(sh / "w2")], sh, delay=1.5),
        timeout=180)
    for cmd in (["synth", "--model", "qwen3-30b-a3b", "--tokens", "2000", "--out", "{sh}/s.npz"],
                ["stats", str(EXAMPLES / "moe-stdlib-routing.npz"), "--out", "{sh}/st"],
                ["import", "jsonl", str(EXAMPLES / "routing-moe-stdlib.jsonl"), "--model", str(SHIPPED), "--out",
                 "{sh}/i.npz"],
                ["replay", str(EXAMPLES / "moe-stdlib-routing.npz"), "--hw", "a6000", "--policy", "on-demand,prefetch",
                 "--out", "{sh}/rp"],
                [*ECO, "--out", "{sh}/eo"]):
        sh = shared_dir()
        args = [a.replace("{sh}", str(sh)) for a in cmd]
        target = args[-1]
        files = () if target.endswith(".npz") else (Path(target).name,)
        add(cc, args, expect="ok", before=concurrent(args, sh, delay=-0.5),
            check=both_ended_well(sh, files=files, trace=Path(target).name if target.endswith(".npz") else None),
            timeout=180)

    # -- options that change nothing: a note (stderr), exit 0
    un = "r4 unused options"
    add(un, ["stats", "t.npz", "--policy", "prefetch"], expect="ok", check=says("--policy"))
    add(un, ["import", "jsonl", str(EXAMPLES / "routing-moe-stdlib.jsonl"), "--model", str(SHIPPED), "--prompt-tokens",
             "3", "--out", "o.npz"], expect="ok", check=says("--prompt-tokens"))
    add(un, ["record", "moe-stdlib", "--tokens", "1", "--tree-depth", "5", "--out", "r.npz"], expect="either",
        check=says("--tree-depth"), timeout=120)
    add(un, ["record", "moe-stdlib", "--tokens", "1", "--selection", "ecospec", "--out", "r.npz"], expect="either",
        check=says("--selection"), timeout=120)
    add(un, ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--tensor-split", "1,1"],
        expect="either", check=says("--tensor-split"))
    add(un, ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--split", "tensor"],
        expect="either", check=says("--split"))
    add(un, ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--lookahead", "2"],
        expect="either", check=says("--lookahead"))
    add(un, ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--acceptance", "0.5"],
        expect="either", check=says("--acceptance"))
    add(un, ["replay", "t.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--eviction", "lfu"],
        expect="either", check=says("--eviction"))
    for extra in (["--skew", "2"], ["--hit-rate", "0.1"], ["--model", "olmoe-1b-7b"], ["--reuse", "0.9"]):
        add(un, ["synth", "--like", "t.npz", "--tokens", "4", "--out", "s.npz", *extra], expect="either",
            check=says(extra[0]))
    for extra in (["--model", "olmoe-1b-7b"], ["--tokens", "999"], ["--batch", "4"], ["--prompt-len", "7"]):
        add(un, ["whatif", "--trace", "t.npz", "--hw", "a6000", "--jobs", "1", "--policy", "on-demand", "--cache-gib",
                 "0", "--json", "--out", "w", *extra], expect="either", check=says(extra[0], out=True))
    add(un, [*ECO, "--recall", "0.5", "--selection", "confidence", "--json"], expect="either", check=says("--recall"))

    # -- results whose numbers are checked
    res = "r4 results"
    add(res, ["replay", "t.npz", "--hw", "a6000", "--policy", "all-resident,oracle,on-demand", "--sim", "fast",
              "--json"], expect="ok", check=policy_order("all-resident", "oracle", "on-demand"), fast=True)
    add(res, ["replay", "t.npz", "--hw", "a6000", "--policy", "all-resident,oracle,on-demand", "--sim", "simpy",
              "--json"], expect="ok", check=policy_order("all-resident", "oracle", "on-demand"))
    add(res, ["replay", "t.npz", "--hw", "h100-sxm", "--policy", "oracle,prefetch,on-demand", "--sim", "fast",
              "--link-gbps", "1", "--json"], expect="ok", check=policy_order("oracle", "on-demand"))
    add(res, [*W[:-4], "--policy", "on-demand,prefetch,oracle", "--cache-gib", "0,0.001", "--link-gbps", "1,4,64",
              "--json", "--out", "w"], expect="ok", check=sweep_rows(3 * 2 * 3, monotone_link=True))
    add(res, [*W[:-4], "--policy", "on-demand", "--cache-gib", "0", "--batch", "1,2", "--prompt-len", "4,64",
              "--json", "--out", "w"], expect="ok", check=sweep_rows(4))
    add(res, ["stats", "t.npz", "--sizes", "0,1,2,4,8,16,64", "--json"], expect="ok", check=stats_sane)
    add(res, ["stats", str(EXAMPLES / "moe-stdlib-routing.npz"), "--json"], expect="ok", check=stats_sane)
    add(res, ["synth", "--like", "t.npz", "--tokens", "16", "--batch", "3", "--out", "s.npz"], expect="ok",
        check=trace_tokens("s.npz", 16, 3))
    add(res, ["import", "jsonl", str(EXAMPLES / "routing-moe-stdlib.jsonl"), "--model", str(SHIPPED), "--out",
              "o.npz"], expect="ok", check=_import_matches)
    add(res, [*ECO, "--gamma", "1,4", "--json"], expect="ok", check=ecospec_rows)
    add(res, ["replay", "t2.npz", "--hw", "a6000", "--policy", "on-demand", "--sim", "fast", "--json"], expect="ok",
        check=row_sanity)
    add(res, ["replay", "t.npz", "--hw", "2xa6000", "--policy", "all-resident", "--sim", "fast", "--json"],
        expect="ok", check=row_sanity)
    return c


def _import_matches(d: Path, stdout: str) -> str | None:
    """The imported trace holds exactly the dump's experts, record by record."""
    import numpy as np

    problem = trace_file("o.npz")(d, stdout)
    if problem:
        return problem
    with np.load(d / "o.npz") as z:
        ids = z["true_ids"]
    for line in (EXAMPLES / "routing-moe-stdlib.jsonl").read_text().splitlines()[:200]:
        r = json.loads(line)
        got = sorted(int(x) for x in ids[r["token"], r["layer"], r.get("seq", 0)])
        if got != sorted(r["experts"]):
            return f"token {r['token']} layer {r['layer']} seq {r.get('seq', 0)}: {got} != {sorted(r['experts'])}"
    return None
