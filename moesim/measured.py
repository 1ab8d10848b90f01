"""Inference engines' own benchmark output, read into :class:`MeasuredRow` rows.

A foundation module (stdlib, :mod:`moesim.errors` and the input guard :mod:`moesim.inputs`): it turns what llama.cpp,
ik_llama.cpp and vLLM print about their own speed into one row per measured test, so
that a measurement can be set beside moesim's prediction for the same deployment.

Formats (``FORMATS``; :func:`read_measured` detects them from the content, ``fmt=``
forces one; docs/measured-formats.md says which command writes each and what becomes
which field):

``llama-bench-md``, ``llama-bench-json``, ``llama-bench-jsonl``, ``llama-bench-csv``
    llama.cpp's and ik_llama.cpp's ``llama-bench -o md|json|jsonl|csv`` (the markdown
    table also as pasted into GitHub issues, with log lines around it).
``llama-timings``
    the ``prompt eval time = ...`` / ``eval time = ...`` lines of llama-server's
    ``print_timings`` and of ``llama_perf_context_print`` (``llama_print_timings`` in
    older builds): one row per line.
``sweep-bench``, ``sweep-bench-jsonl``
    ik_llama.cpp's ``llama-sweep-bench`` table (or its ``--output-format jsonl``): a
    decode row and a prefill row per line.
``vllm-latency``
    ``vllm bench latency --output-json FILE``, layout of vLLM 0.33.0
    (vllm/benchmarks/latency.py); its JSON lacks the batch shape, so the reader needs
    ``output_len=``, ``input_len=`` and ``batch=`` (the command's arguments).
``csv``
    a plain CSV for any engine: one row per run, columns named as moesim options plus
    ``tokens_per_s`` (or ``tpot_ms``).

Whatever cannot be read is refused with one :class:`~moesim.errors.MoesimError` line that
names the file, the line (or row) and the field; a row the reader does not understand is
an error, never skipped.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.fmt import number as fmt_number
from moesim.inputs import kind_of, read_bytes  # the input guard every command's files go through

__all__ = [
    "FORMATS",
    "MeasuredRow",
    "llama_bench_md",
    "VLLM_LAYOUT_VERSION",
    "detect_format",
    "read_llama_bench_csv",
    "read_llama_bench_json",
    "read_llama_bench_jsonl",
    "read_llama_bench_md",
    "read_llama_timings",
    "read_measured",
    "read_plain_csv",
    "read_sweep_bench",
    "read_sweep_bench_jsonl",
    "read_vllm_latency",
]

FORMATS = (
    "llama-bench-md",
    "llama-bench-json",
    "llama-bench-jsonl",
    "llama-bench-csv",
    "llama-timings",
    "sweep-bench",
    "sweep-bench-jsonl",
    "vllm-latency",
    "csv",
)

TESTS = ("decode", "prefill", "prefill+decode")

#: The vLLM release whose ``vllm bench latency --output-json`` layout the reader follows.
VLLM_LAYOUT_VERSION = "0.33.0"

ENGINES_LLAMA = ("llama.cpp", "ik_llama.cpp")


@dataclass(frozen=True)
class MeasuredRow:
    """One measured test, as the engine reported it."""

    where: str                      # "FILE:LINE" (text formats) or "FILE[i]" (json): what every message names
    engine: str                     # "llama.cpp", "ik_llama.cpp", "vllm", or a plain CSV's engine column
    test: str                       # "decode" | "prefill" | "prefill+decode"
    tokens_per_s: float             # the engine's own mean for the test, per sequence (decode: generated tokens/s)
    n_gen: int = 0                  # tokens generated per run (0 for a prefill test)
    n_prompt: int = 0               # prompt tokens processed in the test (0 for a pure decode test)
    depth: int = 0                  # tokens already in the KV cache when the test starts
    batch: int = 1                  # sequences decoded at once
    model_file: str | None = None   # the model path as the output names it
    model_type: str | None = None   # the engine's description, e.g. "qwen3moe 30B.A3B Q4_K - Medium"
    model_bytes: int | None = None  # the model file's size as the engine printed it
    model_params: int | None = None  # its parameter count as the engine printed it
    threads: int | None = None
    n_gpu_layers: int | None = None
    n_cpu_moe: int | None = None
    override_tensors: tuple[str, ...] = ()   # -ot patterns, "REGEX=BUFFER"
    tensor_split: tuple[float, ...] = ()
    split_mode: str | None = None
    flash_attn: bool | None = None
    spread: tuple[float, float] | None = None   # (low, high) tokens/s over the runs when the output gives it (low >= 0)
    runs: int | None = None
    build: str | None = None        # engine build (commit / build number) when the output says
    backend: str | None = None
    cpu_info: str | None = None
    gpu_info: str | None = None
    options: dict[str, str] = field(default_factory=dict)  # fields of the output that no attribute holds


# ---------------------------------------------------------------- shared helpers


def _fail(where: str, message: str) -> MoesimError:
    return MoesimError(f"{where}: {message}")


def _show(value: object) -> str:
    """A value as a message quotes it: numbers bare, text in quotes (cut to 60 characters)."""
    if isinstance(value, bool) or value is None or isinstance(value, int | float):
        return json.dumps(value) if not isinstance(value, float) else repr(value)
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text if len(text) <= 60 else text[:57] + "...")


#: The largest benchmark output read (bytes): a llama-bench table or a server log of a day's
#: requests is kilobytes to a few megabytes; a larger file is not one (a 1 GB log, /dev/urandom).
MEASURED_CAP = 32 * 2**20


def _load_text(path: Path) -> str:
    """The file's text, read once through :func:`moesim.inputs.read_bytes` (a FIFO nobody writes
    to, a device, a folder or a file over :data:`MEASURED_CAP` refused before any reading; a
    pipe read once, whichever reader asks): refused when missing, empty or binary (a NUL byte,
    or mostly bytes that are not text)."""
    if kind_of(path) == "missing":
        raise MoesimError(f"{path}: no such file")
    data = read_bytes(path, "benchmark output", MEASURED_CAP)
    if not data.strip():
        raise MoesimError(f"{path}: empty file, no measurements")
    nul = data.find(b"\0")
    if nul >= 0:
        raise MoesimError(f"{path}: binary content (a NUL byte at offset {nul}), not a benchmark output")
    # Real logs hold a few odd bytes (llama-cli's spinner backspaces, a tiny model's broken UTF-8
    # in generated text): those stay, as U+FFFD; a file that is mostly such bytes is not text.
    text = data.decode("utf-8-sig", errors="replace")
    odd = text.count("\ufffd") + sum(1 for ch in text if ord(ch) < 32 and ch not in "\t\n\r\f\v\b\x1b")
    if odd > max(8, len(text) // 20):
        raise MoesimError(f"{path}: binary content ({odd} of {len(text)} characters are not text), "
                          "not a benchmark output")
    return text


#: The fastest tokens/s any test could have measured: a prompt of a tiny model on the largest
#: GPU is processed at some 10^5 tokens/s; a figure above this is a misread, not a speed.
MAX_TPS = 1e6
#: The slowest: a token in under three hours (a model read from disk a token at a time is
#: some 10^-2 tokens/s); a figure below this is a misread (a time in the wrong unit).
MIN_TPS = 1e-4


def _speed(value: object, where: str, name: str) -> float:
    """A tokens/s figure: a finite number above zero, from :data:`MIN_TPS` to :data:`MAX_TPS`."""
    number = _number(value, where, name)
    if number <= 0:
        raise _fail(where, f"{name} {_show(value)} is not a speed (it must be above zero)")
    return _plausible(number, where, f"{name} {_show(value)}")


def _plausible(tps: float, where: str, said: str) -> float:
    """``tps`` when a test could have measured it (:data:`MIN_TPS` to :data:`MAX_TPS`), else one line."""
    if tps > MAX_TPS:
        raise _fail(where, f"{said} is a speed above {MAX_TPS:,.0f} tokens/s: no test runs that fast")
    if tps < MIN_TPS:
        raise _fail(where, f"{said} is a speed below {MIN_TPS:g} tokens/s (a token in more than "
                           f"{1 / MIN_TPS / 3600:.1f} hours): a misread, not a measurement")
    return tps


def _tpot_speed(value: object, where: str, name: str) -> float:
    """The tokens/s of a time a token in ms (a plain CSV's ``tpot_ms``): a time whose speed is a speed."""
    ms = _number(value, where, name)
    if ms <= 0:
        raise _fail(where, f"{name} {_show(value)} is not a time (it must be above zero)")
    return _plausible(1000.0 / ms, where, f"{name} {_show(value)}")


def _number(value: object, where: str, name: str) -> float:
    if isinstance(value, bool):
        raise _fail(where, f"{name} {_show(value)} is not a number")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _fail(where, f"{name} {_show(value)} is not a number") from None
    else:
        raise _fail(where, f"{name} {_show(value)} is not a number")
    if not math.isfinite(number):
        raise _fail(where, f"{name} {_show(value)} is not a finite number")
    return number


def _int(value: object, where: str, name: str, *, low: int | None = 0) -> int:
    if isinstance(value, bool):
        raise _fail(where, f"{name} {_show(value)} is not a whole number")
    if isinstance(value, int):
        number = value
    elif (isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value)) or (
            isinstance(value, float) and value.is_integer()):
        number = int(value)
    else:
        raise _fail(where, f"{name} {_show(value)} is not a whole number")
    if low is not None and number < low:
        raise _fail(where, f"{name} {number} is below {low}")
    return number


def _flag(value: object, where: str, name: str) -> bool | None:
    """A flag as llama-bench writes it: true/false, 1/0, or -1 (auto: not known, None)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "enabled"):
        return True
    if text in ("0", "false", "no", "off", "disabled"):
        return False
    if text in ("-1", "auto", ""):
        return None
    raise _fail(where, f"{name} {_show(value)} is not a flag (1/0, true/false or -1 for auto)")


def _split_floats(value: str, where: str, name: str) -> tuple[float, ...]:
    text = value.strip()
    if not text or text.lower() == "none":
        return ()
    shares = tuple(_number(p, where, name) for p in re.split(r"[/,;]", text))
    if any(s < 0 for s in shares):
        raise _fail(where, f"{name} {_show(value)} has a negative share")
    return () if not any(shares) else shares


def _split_overrides(value: str, separator: str) -> tuple[str, ...]:
    """``-ot`` overrides as llama-bench joins them ("none", or "REGEX=BUFFER" joined by ``separator``).

    A regex may itself hold the separator (``{1,3}``): a piece without ``=`` belongs to the
    pattern before it.
    """
    text = value.strip()
    if not text or text.lower() == "none":
        return ()
    out: list[str] = []
    for piece in text.split(separator):
        if out and ("=" not in piece or "=" not in out[-1]):
            out[-1] += separator + piece
        else:
            out.append(piece)
    return tuple(p.strip() for p in out if p.strip() and p.strip().lower() != "none")


def _build(commit: object, number: object) -> str | None:
    commit = str(commit).strip() if commit is not None else ""
    number = str(number).strip() if number is not None else ""
    if commit and number:
        return f"{commit} ({number})"
    return commit or number or None


def _test_of(n_prompt: int, n_gen: int, where: str) -> str:
    if n_prompt > 0 and n_gen == 0:
        return "prefill"
    if n_gen > 0 and n_prompt == 0:
        return "decode"
    if n_gen > 0 and n_prompt > 0:
        return "prefill+decode"
    raise _fail(where, "n_prompt and n_gen are both 0: not a test")


def _no_kwargs(fmt: str, kw: dict[str, Any], path: Path) -> None:
    if kw:
        names = ", ".join(sorted(kw))
        raise MoesimError(f"{path}: {names} does not apply to a {fmt} file (only to vllm-latency)")


def _engine(engine: str | None, default: str) -> str:
    if engine is None:
        return default
    if not isinstance(engine, str) or not engine.strip():
        raise MoesimError(f"engine {engine!r} is not an engine name")
    return engine.strip()


def _pairs_no_duplicates(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _fail(where, f"field {key!r} appears twice in one object")
            out[key] = value
        return out
    return hook


def _json_load(text: str, where: str) -> Any:
    def constant(name: str) -> float:
        raise _fail(where, f"{name} in the JSON is not a number")
    try:
        return json.loads(text, object_pairs_hook=_pairs_no_duplicates(where), parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise _fail(where, f"not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise _fail(where, "JSON nested too deep") from None


# ---------------------------------------------------------------- llama-bench: json, jsonl, csv

# Fields of llama-bench's records that a MeasuredRow attribute holds (the rest go into options).
_LB_CONSUMED = {
    "model_filename", "model_type", "model_size", "model_n_params", "n_threads", "n_gpu_layers", "n_cpu_moe",
    "tensor_buft_overrides", "override_tensor", "tensor_split", "split_mode", "flash_attn",
    "build_commit", "build_number", "backends", "cpu_info", "gpu_info", "n_prompt", "n_gen",
    "n_depth", "avg_ts", "stddev_ts", "samples_ts", "samples_ns", "test",
}
# Fields only ik_llama.cpp's llama-bench writes.
_IK_FIELDS = {"mla_attn", "attn_max_batch", "ser", "fused_moe", "grouped_er", "rcache", "no_fused_up_gate",
              "no_ooae", "muge", "defer_experts", "override_tensor", "cuda_params", "use_thp", "mqkv", "sas"}
_IK_TEST = re.compile(r"tg(\d+)@pp(\d+)")


def _backend_of(record: dict[str, Any]) -> str | None:
    """llama-bench's backend: ``backends`` (llama.cpp), else the flags ik_llama.cpp and older builds write."""
    if record.get("backends") not in (None, ""):
        return str(record["backends"])
    flags = [("cuda", "CUDA"), ("vulkan", "Vulkan"), ("metal", "Metal"), ("sycl", "SYCL"), ("gpu_blas", "GPU BLAS"),
             ("blas", "BLAS")]
    if not any(key in record for key, _ in flags):
        return None
    for key, name in flags:
        if str(record.get(key, "")).strip().lower() in ("1", "true"):
            return name
    return "CPU"


def _option_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(_option_text(v) for v in value)
    return str(value)


def _llama_bench_row(record: dict[str, Any], where: str, engine: str | None) -> MeasuredRow:
    """One llama-bench record (json object or csv row, field names as llama-bench writes them)."""
    for name in ("n_prompt", "n_gen", "avg_ts"):
        if name not in record or record[name] in (None, ""):
            raise _fail(where, f"field {name} is missing (not a llama-bench record)")
    is_ik = bool(_IK_FIELDS & record.keys())
    engine = _engine(engine, "ik_llama.cpp" if is_ik else "llama.cpp")
    n_prompt = _int(record["n_prompt"], where, "n_prompt")
    n_gen = _int(record["n_gen"], where, "n_gen")
    depth = _int(record.get("n_depth", 0) or 0, where, "n_depth")
    label = str(record.get("test", "")).strip()
    ik_gp = _IK_TEST.fullmatch(label.replace(" ", "")) if label else None
    if ik_gp:
        # ik_llama.cpp's "tgN@ppM": N tokens generated after an M-token prompt, timed alone
        if (int(ik_gp.group(1)), int(ik_gp.group(2))) != (n_gen, n_prompt):
            raise _fail(where, f"test {label!r} disagrees with n_gen {n_gen} and n_prompt {n_prompt}")
        test, depth, n_prompt = "decode", depth + n_prompt, 0
    else:
        test = _test_of(n_prompt, n_gen, where)
    avg = _speed(record["avg_ts"], where, "avg_ts")
    spread = None
    if record.get("stddev_ts") not in (None, ""):
        sd = _number(record["stddev_ts"], where, "stddev_ts")
        if sd < 0:
            raise _fail(where, f"stddev_ts {_show(record['stddev_ts'])} is negative")
        spread = (max(avg - sd, 0.0), avg + sd)
    runs = None
    if "samples_ts" in record:
        samples = record["samples_ts"]
        if not isinstance(samples, list):
            raise _fail(where, f"samples_ts {_show(samples)} is not a list")
        for value in samples:
            _speed(value, where, "samples_ts")
        runs = len(samples) or None
    if "tensor_buft_overrides" in record:
        overrides = _split_overrides(str(record["tensor_buft_overrides"]), ";")
    elif "override_tensor" in record:
        overrides = _split_overrides(str(record["override_tensor"]), ",")
    else:
        overrides = ()

    def opt_int(name: str, low: int | None = 0) -> int | None:
        value = record.get(name)
        return None if value in (None, "") else _int(value, where, name, low=low)

    def opt_str(name: str) -> str | None:
        value = record.get(name)
        return None if value in (None, "") else str(value)

    return MeasuredRow(
        where=where, engine=engine, test=test, tokens_per_s=avg, n_gen=n_gen, n_prompt=n_prompt, depth=depth,
        model_file=opt_str("model_filename"), model_type=opt_str("model_type"), model_bytes=opt_int("model_size"),
        model_params=opt_int("model_n_params"),
        threads=opt_int("n_threads", 1), n_gpu_layers=opt_int("n_gpu_layers", None), n_cpu_moe=opt_int("n_cpu_moe"),
        override_tensors=overrides,
        tensor_split=_split_floats(str(record.get("tensor_split", "")), where, "tensor_split"),
        split_mode=opt_str("split_mode"),
        flash_attn=None if record.get("flash_attn") in (None, "") else _flag(record["flash_attn"], where, "flash_attn"),
        spread=spread, runs=runs, build=_build(record.get("build_commit"), record.get("build_number")),
        backend=_backend_of(record), cpu_info=opt_str("cpu_info"), gpu_info=opt_str("gpu_info"),
        options={k: _option_text(v) for k, v in record.items() if k not in _LB_CONSUMED},
    )


def read_llama_bench_json(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """``llama-bench -o json``: a JSON array of one object per test."""
    text = _load_text(path)
    data = _json_load(text, str(path))
    if not isinstance(data, list):
        raise MoesimError(f"{path}: a llama-bench json file is a JSON array of tests, not {type(data).__name__}")
    if not data:
        raise MoesimError(f"{path}: no tests in the llama-bench json array")
    rows = []
    for i, record in enumerate(data):
        where = f"{path}[{i}]"
        if not isinstance(record, dict):
            raise _fail(where, f"a test is a JSON object, not {type(record).__name__}")
        rows.append(_llama_bench_row(record, where, engine))
    return rows


def read_llama_bench_jsonl(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """``llama-bench -o jsonl``: one JSON object per line."""
    text = _load_text(path)
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = _json_load(line, where)
        if not isinstance(record, dict):
            raise _fail(where, f"a jsonl line is one JSON object, not {type(record).__name__}")
        rows.append(_llama_bench_row(record, where, engine))
    if not rows:
        raise MoesimError(f"{path}: no tests in the llama-bench jsonl file")
    return rows


def _csv_records(text: str, path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """A CSV's header and its rows (with their line numbers); duplicated or repeated headers refused."""
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    records: list[tuple[int, dict[str, str]]] = []
    try:
        for cells in reader:
            line = reader.line_num
            if not any(c.strip() for c in cells):
                continue
            if header is None:
                header = [c.strip() for c in cells]
                seen: set[str] = set()
                for name in header:
                    if not name:
                        raise MoesimError(f"{path}:{line}: a column of the header has no name")
                    if name in seen:
                        raise MoesimError(f"{path}:{line}: column {name!r} appears twice in the header")
                    seen.add(name)
                continue
            if [c.strip() for c in cells] == header:
                raise MoesimError(f"{path}:{line}: the header is repeated (two outputs joined?); keep one header")
            if len(cells) != len(header):
                raise MoesimError(f"{path}:{line}: {len(cells)} cells where the header has {len(header)} columns")
            records.append((line, dict(zip(header, cells))))
    except csv.Error as exc:
        raise MoesimError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    if header is None:
        raise MoesimError(f"{path}: empty CSV, no header")
    return header, records


def read_llama_bench_csv(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """``llama-bench -o csv``: a header of llama-bench's field names, one row per test."""
    text = _load_text(path)
    header, records = _csv_records(text, path)
    for name in ("n_prompt", "n_gen", "avg_ts"):
        if name not in header:
            raise MoesimError(f"{path}:1: column {name} is missing (not a llama-bench csv)")
    if not records:
        raise MoesimError(f"{path}: no tests in the llama-bench csv (a header only)")
    return [_llama_bench_row(record, f"{path}:{line}", engine) for line, record in records]


# ---------------------------------------------------------------- llama-bench: markdown

# The markdown table's column names (display names) for llama-bench's fields, both engines.
_MD_NAMES = {
    "ngl": "n_gpu_layers", "sm": "split_mode", "threads": "n_threads", "nkvo": "no_kv_offload", "fa": "flash_attn",
    "lm": "load_mode", "embd": "embeddings", "nopo": "no_op_offload", "noh": "no_host", "rpk": "repack",
    "dev": "devices", "ts": "tensor_split", "ot": "tensor_buft_overrides", "fitt": "fit_target",
    "fitc": "fit_min_ctx",
    # ik_llama.cpp's names
    "mla": "mla_attn", "amb": "attn_max_batch", "gr": "reuse", "mmap": "use_mmap", "rtr": "repack",
    "defer": "defer_experts", "thp": "use_thp", "fmoe": "fused_moe", "ger": "grouped_er",
    "no-fug": "no_fused_up_gate", "no-ooae": "no_ooae", "cuda": "cuda_params",
}
_MD_IK_ONLY = {"mla", "amb", "ser", "gr", "rtr", "mqkv", "muge", "defer", "sas", "max_gpu", "thp", "fmoe", "ger",
               "rcache", "no-fug", "no-ooae", "cuda"}
_MD_TEST = re.compile(
    r"(?:pp\s*(?P<pp>\d+)\s*\+\s*tg\s*(?P<pg>\d+)|pp\s*(?P<p>\d+)|tg\s*(?P<g>\d+)\s*@\s*pp\s*(?P<gp>\d+)"
    r"|tg\s*(?P<t>\d+))(?:\s*@\s*d\s*(?P<d>\d+))?")
_MD_SPEED = re.compile(r"(?P<avg>\S+)\s*(?:(?:±|\+-|\+/-)\s*(?P<sd>\S+))?")
_MD_BUILD = re.compile(r"^\s*build:\s*(?P<commit>[0-9A-Za-z_.-]+)\s*\((?P<number>-?\d+)\)\s*$")


def _md_cells(line: str) -> list[str]:
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|"):
        body = body[:-1]
    return [c.strip() for c in body.split("|")]


def _is_separator(cells: list[str]) -> bool:
    return bool(cells) and all(re.fullmatch(r":?-{2,}:?", c) for c in cells)


def _md_tables(text: str, path: Path, is_header) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """Markdown tables whose header ``is_header`` accepts: (header line, header cells, [(line, cells)])."""
    tables: list[tuple[int, list[str], list[tuple[int, list[str]]]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        cells = _md_cells(lines[i]) if lines[i].lstrip().startswith("|") else None
        if cells is None or not is_header(cells):
            i += 1
            continue
        header_line = i + 1
        seen: set[str] = set()
        for name in cells:
            if name in seen:
                raise MoesimError(f"{path}:{header_line}: column {name!r} appears twice in the table header")
            seen.add(name)
        if i + 1 >= len(lines) or not _is_separator(_md_cells(lines[i + 1])):
            raise MoesimError(f"{path}:{header_line + 1}: the table header is not followed by its |---| line")
        rows: list[tuple[int, list[str]]] = []
        i += 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            row = _md_cells(lines[i])
            if row == cells:
                raise MoesimError(f"{path}:{i + 1}: the table header is repeated inside the table; keep one header")
            if not _is_separator(row):
                rows.append((i + 1, row))
            i += 1
        tables.append((header_line, cells, rows))
    return tables


def _is_llama_bench_header(cells: list[str]) -> bool:
    return "t/s" in cells and "test" in cells


def read_llama_bench_md(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """``llama-bench -o md`` (the default): the markdown table and its ``build:`` line.

    Log lines around the table (a paste from a GitHub issue) are not rows and are passed
    over; every line of the table is a row or an error.
    """
    text = _load_text(path)
    tables = _md_tables(text, path, _is_llama_bench_header)
    if not tables:
        raise MoesimError(f"{path}: no llama-bench table (a '| ... | test | t/s |' header)")
    builds = [(n, _build(m["commit"], m["number"])) for n, line in enumerate(text.splitlines(), 1)
              if (m := _MD_BUILD.match(line))]
    rows: list[MeasuredRow] = []
    for header_line, header, body in tables:
        if not body:
            raise MoesimError(f"{path}:{header_line}: the llama-bench table has no rows")
        build = next((b for n, b in builds if n > header_line), None)
        # ik_llama.cpp's table: an ik-only column, or a tgN@ppM test in any of its lines
        is_ik = bool(_MD_IK_ONLY & set(header)) or (
            "test" in header and any(_IK_TEST.fullmatch(cells[header.index("test")].replace(" ", ""))
                                     for _, cells in body if len(cells) == len(header))) or (
            engine is not None and engine.strip() == "ik_llama.cpp")
        for line, cells in body:
            where = f"{path}:{line}"
            if len(cells) != len(header):
                raise _fail(where, f"{len(cells)} cells where the table header has {len(header)} columns")
            rows.append(_md_row(dict(zip(header, cells)), where, engine, is_ik, build))
    return rows


#: The units of llama-bench's ``size`` and ``params`` columns (``"%.2f GiB"`` / ``"%.2f MiB"``;
#: ``"%.2f B"`` / ``"%.2f M"`` / ``"%.2f K"``, llama-bench.cpp's markdown printer).
_MD_BYTES = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12}
_MD_COUNT = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _md_amount(text: str | None, where: str, name: str, units: dict[str, float]) -> int | None:
    """A size or a count as llama-bench's markdown prints it (``17.28 GiB``, ``30.53 B``); None
    when the column is absent or unknown (``?``); anything else is refused naming the cell."""
    if text is None or text.strip() in ("", "?", "-"):
        return None
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", text.strip(), re.ASCII)
    if not m or m[2].lower() not in units:
        raise _fail(where, f"{name} {text.strip()!r} is not a {name} as llama-bench prints it "
                           f"({', '.join(k for k in units if k) or 'a number'})")
    value = float(m[1]) * units[m[2].lower()]
    return round(value) if math.isfinite(value) and value > 0 else None


def _md_row(cells: dict[str, str], where: str, engine: str | None, is_ik: bool, build: str | None) -> MeasuredRow:
    label = cells["test"]
    match = _MD_TEST.fullmatch(label.strip())
    if not match:
        raise _fail(where, f"test {label!r} is not a llama-bench test (ppN, tgN, ppN+tgM, '... @ dN', tgN@ppM)")
    depth = int(match["d"] or 0)
    if match["pg"]:
        n_prompt, n_gen, test = int(match["pp"]), int(match["pg"]), "prefill+decode"
    elif match["p"]:
        n_prompt, n_gen, test = int(match["p"]), 0, "prefill"
    elif match["g"]:
        n_prompt, n_gen, test, depth = 0, int(match["g"]), "decode", depth + int(match["gp"])
    else:
        n_prompt, n_gen, test = 0, int(match["t"]), "decode"
    if n_prompt == 0 and n_gen == 0:
        raise _fail(where, f"test {label!r} processes no tokens")
    speed = _MD_SPEED.fullmatch(cells["t/s"].strip())
    if not speed:
        raise _fail(where, f"t/s {cells['t/s']!r} is not a number")
    avg = _speed(speed["avg"], where, "t/s")
    spread = None
    if speed["sd"] is not None:
        sd = _number(speed["sd"], where, "t/s deviation")
        if sd < 0:
            raise _fail(where, f"t/s deviation {speed['sd']!r} is negative")
        spread = (max(avg - sd, 0.0), avg + sd)

    def opt_int(name: str, low: int | None = 0) -> int | None:
        value = cells.get(name)
        return None if value in (None, "") else _int(value, where, name, low=low)

    ot = cells.get("ot")
    mapped = {"model", "size", "params", "test", "t/s", "backend", "ngl", "n_cpu_moe", "threads", "ts", "ot", "sm",
              "fa"}
    # llama.cpp prints n_cpu_moe only when it is not 0 (ik_llama.cpp's llama-bench has no such field)
    n_cpu_moe = opt_int("n_cpu_moe") if "n_cpu_moe" in cells else None if is_ik else 0
    return MeasuredRow(
        where=where, engine=_engine(engine, "ik_llama.cpp" if is_ik else "llama.cpp"), test=test, tokens_per_s=avg,
        n_gen=n_gen, n_prompt=n_prompt, depth=depth, model_type=cells.get("model") or None,
        model_bytes=_md_amount(cells.get("size"), where, "size", _MD_BYTES),
        model_params=_md_amount(cells.get("params"), where, "params", _MD_COUNT),
        threads=opt_int("threads", 1), n_gpu_layers=opt_int("ngl", None), n_cpu_moe=n_cpu_moe,
        override_tensors=() if ot is None else _split_overrides(ot, "," if is_ik else ";"),
        tensor_split=_split_floats(cells.get("ts", ""), where, "ts"), split_mode=cells.get("sm") or None,
        flash_attn=None if "fa" not in cells else _flag(cells["fa"], where, "fa"), spread=spread,
        build=build, backend=cells.get("backend") or None,
        options={_MD_NAMES.get(k, k): v for k, v in cells.items() if k not in mapped},
    )


def llama_bench_md(rows: list[MeasuredRow], build: str | None = None) -> str:
    """``rows`` as llama-bench's markdown printer writes them (``-o md``, the table users paste):
    model, size, params, backend, ngl (a GPU backend's rows), n_cpu_moe (where not 0),
    threads, test (``tgN``, ``tgN @ dD``, ``ppN``), ``t/s`` as ``mean ± sd``; ``build`` as its
    ``build: COMMIT (NUMBER)`` line. What :func:`read_llama_bench_md` reads back field for field."""
    def size(n: int | None) -> str:
        return "?" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

    def params(n: int | None) -> str:
        return "?" if not n else f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"

    def test(r: MeasuredRow) -> str:
        name = {"decode": f"tg{r.n_gen}", "prefill": f"pp{r.n_prompt}",
                "prefill+decode": f"pp{r.n_prompt}+tg{r.n_gen}"}[r.test]
        return name + (f" @ d{r.depth}" if r.depth else "")

    gpu = any((r.backend or "CPU").upper() not in ("CPU", "BLAS") for r in rows)
    cpu_moe = any(r.n_cpu_moe for r in rows)
    head = ["model", "size", "params", "backend"] + (["ngl"] if gpu else []) + (["n_cpu_moe"] if cpu_moe else []) \
        + ["threads", "test", "t/s"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        low, high = r.spread or (r.tokens_per_s, r.tokens_per_s)
        cells = [r.model_type or "?", size(r.model_bytes), params(r.model_params), r.backend or "CPU"]
        cells += [str(99 if r.n_gpu_layers is None else r.n_gpu_layers)] if gpu else []
        cells += [str(r.n_cpu_moe or 0)] if cpu_moe else []
        cells += [str(r.threads or 1), test(r), f"{r.tokens_per_s:.2f} ± {(high - low) / 2:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nbuild: {build}\n" if build else "\n")


# ---------------------------------------------------------------- logs: llama-server / llama-cli timings, sweep-bench

_TIMING = re.compile(
    r"(?P<prompt>prompt )?eval time\s*=\s*(?P<ms>\S+)\s*ms\s*/\s*(?P<n>\S+)\s*(?:tokens|runs)\s*"
    r"\(\s*(?P<mspt>\S+)\s*ms per token,\s*(?P<tps>\S+)\s*tokens per second\s*\)")
_TIMING_HINT = re.compile(r"(?:^|[\s:|])(?:prompt )?eval time\s*=")
_SLOT = re.compile(r"\bid\s+\d+\s*\|\s*task\s+\d+")
_CLI_LINE = re.compile(r"\[\s*Prompt:\s*(?P<pp>\S+)\s*t/s\s*\|\s*Generation:\s*(?P<tg>\S+)\s*t/s\s*\]")
_CLI_HINT = re.compile(r"\[\s*Prompt:.*t/s")
_LOG_MODEL = re.compile(r"loaded meta data with \d+ key-value pairs and \d+ tensors from (?P<file>.+?) \(version "
                        r"|load_model: loading model '(?P<file2>[^']+)'|^model\s*:\s*(?P<file3>\S.*?)\s*$")
_LOG_BUILD = re.compile(r"\bbuild(?::| =)\s*(?P<number>\d+)\s*\((?P<commit>[0-9A-Za-z]+)\)"
                        r"|^build\s*:\s*b(?P<number2>\d+)-(?P<commit2>[0-9A-Za-z]+)\s*$")
_LOG_THREADS = re.compile(r"system_info: n_threads = (?P<n>\d+)|llama threadpool init, n_threads = (?P<n2>\d+)")
_LOG_INFO = re.compile(r"(?:print_info|llm_load_print_meta): (?P<key>arch|model type|file type|model ftype)\s*=\s*"
                       r"(?P<value>.+?)\s*$")


class _LogState:
    """What a log says before its measurements: the model file, build and threads."""

    def __init__(self) -> None:
        self.model_file: str | None = None
        self.build: str | None = None
        self.threads: int | None = None
        self.info: dict[str, str] = {}

    def see(self, line: str) -> None:
        if m := _LOG_MODEL.search(line):
            self.model_file, self.info = m["file"] or m["file2"] or m["file3"], {}
        elif m := _LOG_BUILD.search(line):
            self.build = _build(m["commit"] or m["commit2"], m["number"] or m["number2"])
        elif m := _LOG_THREADS.search(line):
            self.threads = int(m["n"] or m["n2"])
        elif m := _LOG_INFO.search(line):
            self.info.setdefault(m["key"], m["value"])

    @property
    def model_type(self) -> str | None:
        parts = [self.info.get("arch"), self.info.get("model type"),
                 self.info.get("file type") or self.info.get("model ftype")]
        return " ".join(parts) if all(parts) else None  # type: ignore[arg-type]


def read_llama_timings(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """llama-server's ``print_timings``, llama-completion's / older llama-cli's perf lines, new llama-cli's summary.

    ``prompt eval time = X ms / N tokens (... , Z tokens per second)`` is a prefill row of N
    prompt tokens; ``eval time = X ms / N tokens|runs (...)`` a decode row of N generated
    tokens, at the depth of the prompt evaluated just before it. llama-cli's
    ``[ Prompt: X t/s | Generation: Y t/s ]`` gives a prefill and a decode row whose token
    counts it does not print (n_prompt / n_gen 0, options["counts"] = "not printed").
    Other log lines are not measurements and are passed over (the model file, build and
    threads they name fill the rows that follow).
    """
    text = _load_text(path)
    state = _LogState()
    rows: list[MeasuredRow] = []
    last_prompt: dict[str, int] = {}  # by server slot and task ("" outside llama-server)
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{number}"
        slot = _SLOT.search(line)
        key = slot.group(0) if slot else ""
        if not _TIMING_HINT.search(line) and not _CLI_HINT.search(line):
            state.see(line)
            continue
        common = dict(where=where, engine=_engine(engine, "llama.cpp"), model_file=state.model_file,
                      model_type=state.model_type, threads=state.threads, build=state.build)
        if not _TIMING_HINT.search(line):
            cli = _CLI_LINE.search(line)
            if not cli:
                raise _fail(where, "a '[ Prompt: ...' line not in llama-cli's form "
                                   "'[ Prompt: X t/s | Generation: Y t/s ]'")
            unknown = {"counts": "not printed"}
            rows.append(MeasuredRow(test="prefill", tokens_per_s=_speed(cli["pp"], where, "Prompt t/s"),
                                    options=unknown, **common))
            rows.append(MeasuredRow(test="decode", tokens_per_s=_speed(cli["tg"], where, "Generation t/s"),
                                    options=dict(unknown), **common))
            continue
        match = _TIMING.search(line)
        if not match:
            raise _fail(where, "an 'eval time =' line not in llama.cpp's form "
                               "'X ms / N tokens (Y ms per token, Z tokens per second)'")
        n = _int(match["n"], where, "tokens", low=1)
        _speed(match["ms"], where, "eval time")
        tps = _speed(match["tps"], where, "tokens per second")
        if match["prompt"]:
            rows.append(MeasuredRow(test="prefill", n_prompt=n, tokens_per_s=tps, **common))
            last_prompt[key] = n
        else:
            rows.append(MeasuredRow(test="decode", n_gen=n, depth=last_prompt.pop(key, 0), tokens_per_s=tps,
                                    **common))
    if not rows:
        raise MoesimError(f"{path}: no 'eval time =' lines (llama-server / llama-cli timings)")
    return rows


_SWEEP_COLUMNS = ("PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
_SWEEP_PARAMS = re.compile(
    r"n_kv_max = (?P<n_kv_max>-?\d+), n_batch = (?P<n_batch>-?\d+), n_ubatch = (?P<n_ubatch>-?\d+), "
    r"flash_attn = (?P<flash_attn>-?\d+), n_gpu_layers = (?P<n_gpu_layers>-?\d+), n_threads = (?P<n_threads>\d+), "
    r"n_threads_batch = (?P<n_threads_batch>\d+)")


def _sweep_rows(values: dict[str, Any], where: str, engine: str, params: dict[str, Any],
                state: _LogState | None) -> list[MeasuredRow]:
    """A sweep-bench line: its decode row (TG tokens at depth N_KV) and its prefill row (PP tokens at N_KV)."""
    pp = _int(values["pp"], where, "PP", low=1)
    tg = _int(values["tg"], where, "TG", low=0)
    n_kv = _int(values["n_kv"], where, "N_KV")
    _speed(values["t_pp"], where, "T_PP s")
    if tg > 0:
        _speed(values["t_tg"], where, "T_TG s")
    threads = None if params.get("n_threads") is None else _int(params["n_threads"], where, "n_threads", low=1)
    threads_batch = threads if params.get("n_threads_batch") is None else _int(
        params["n_threads_batch"], where, "n_threads_batch", low=1)
    ngl = params.get("n_gpu_layers")
    fa = params.get("flash_attn")
    common = dict(
        where=where, engine=engine, depth=n_kv,
        model_file=state.model_file if state else None, model_type=state.model_type if state else None,
        build=state.build if state else None, n_gpu_layers=None if ngl is None else _int(ngl, where, "n_gpu_layers",
                                                                                          low=None),
        flash_attn=None if fa is None else _flag(fa, where, "flash_attn"),
        options={k: str(v) for k, v in params.items()
                 if k in ("n_kv_max", "n_batch", "n_ubatch", "n_threads_batch", "rss_hwm_mib", "vram_delta_mib")},
    )
    rows = []
    if tg > 0:
        rows.append(MeasuredRow(test="decode", n_gen=tg, tokens_per_s=_speed(values["speed_tg"], where, "S_TG t/s"),
                                threads=threads, **common))
    rows.append(MeasuredRow(test="prefill", n_prompt=pp, tokens_per_s=_speed(values["speed_pp"], where, "S_PP t/s"),
                            threads=threads_batch, **common))
    return rows


def read_sweep_bench(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """ik_llama.cpp's ``llama-sweep-bench`` table (its default output, with or without the log around it)."""
    text = _load_text(path)
    engine = _engine(engine, "ik_llama.cpp")
    lines = text.splitlines()
    tables = _md_tables(text, path, lambda cells: "S_TG t/s" in cells and "N_KV" in cells)
    if not tables:
        raise MoesimError(f"{path}: no sweep-bench table (a '| PP | TG | N_KV | ... | S_TG t/s |' header)")
    rows: list[MeasuredRow] = []
    for header_line, header, body in tables:
        # the log before a table (several runs may be joined): its model, build and "main:" settings
        state = _LogState()
        params: dict[str, Any] = {}
        for line in lines[:header_line - 1]:
            if m := _SWEEP_PARAMS.search(line):
                params = m.groupdict()
            else:
                state.see(line)
        missing = [c for c in _SWEEP_COLUMNS if c not in header]
        if missing:
            raise MoesimError(f"{path}:{header_line}: the sweep-bench table has no {missing[0]!r} column")
        if not body:
            raise MoesimError(f"{path}:{header_line}: the sweep-bench table has no rows")
        for line, cells in body:
            where = f"{path}:{line}"
            if len(cells) != len(header):
                raise _fail(where, f"{len(cells)} cells where the table header has {len(header)} columns")
            row = dict(zip(header, cells))
            values = {"pp": row["PP"], "tg": row["TG"], "n_kv": row["N_KV"], "t_pp": row["T_PP s"],
                      "speed_pp": row["S_PP t/s"], "t_tg": row["T_TG s"], "speed_tg": row["S_TG t/s"]}
            extra = {k: v for k, v in (("rss_hwm_mib", row.get("RSS HWM")), ("vram_delta_mib", row.get("VRAM delta")))
                     if v is not None}
            rows.extend(_sweep_rows(values, where, engine, {**params, **extra}, state))
    return rows


_SWEEP_JSON_LINE = re.compile(r"^(?:\[\d+\]\s*)?(?P<json>\{.*)$")
_SWEEP_FIELDS = ("pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")


def read_sweep_bench_jsonl(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """``llama-sweep-bench --output-format jsonl``: one JSON object per measured line.

    ik_llama.cpp prints these lines on stderr, among its log lines (and into llama.log
    behind a ``[timestamp]``): every line that is a JSON object is a measurement (a
    broken one is an error), the log lines around them are passed over and name the
    model file and build.
    """
    text = _load_text(path)
    engine = _engine(engine, "ik_llama.cpp")
    state = _LogState()
    rows: list[MeasuredRow] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _SWEEP_JSON_LINE.match(line.strip())
        if not match:
            state.see(line)
            continue
        where = f"{path}:{number}"
        record = _json_load(match["json"], where)
        if not isinstance(record, dict):
            raise _fail(where, f"a jsonl line is one JSON object, not {type(record).__name__}")
        for name in _SWEEP_FIELDS:
            if name not in record:
                raise _fail(where, f"field {name} is missing (not a sweep-bench jsonl line)")
        params = {k: v for k, v in record.items() if k not in _SWEEP_FIELDS}
        rows.extend(_sweep_rows(record, where, engine, params, state))
    if not rows:
        raise MoesimError(f"{path}: no sweep-bench jsonl lines (JSON objects with pp, tg, n_kv, speed_tg)")
    return rows


# ---------------------------------------------------------------- vLLM

_VLLM_KEYS = ("avg_latency", "latencies", "percentiles")


def read_vllm_latency(path: Path, *, output_len: int | None = None, input_len: int | None = None,
                      batch: int | None = None, engine: str | None = None) -> list[MeasuredRow]:
    """``vllm bench latency --output-json FILE`` (layout of vLLM 0.33.0, vllm/benchmarks/latency.py).

    The JSON holds the seconds of whole ``llm.generate`` calls on one batch
    (``avg_latency``, ``latencies``, ``percentiles``, ``model_id``) but not the batch's
    shape: ``output_len`` (--output-len), ``input_len`` (--input-len) and ``batch``
    (--batch-size) are the command's arguments and must be given. One row: test
    "prefill+decode" (the call includes the prompt), tokens/s per sequence =
    output_len / avg_latency, spread over the slowest and fastest call.
    """
    text = _load_text(path)
    where = str(path)
    missing = [name for name, value in (("output_len", output_len), ("input_len", input_len), ("batch", batch))
               if value is None]
    if missing:
        raise MoesimError(f"{path}: a vllm-latency JSON does not record the batch; give {', '.join(missing)} "
                          "(the --output-len, --input-len and --batch-size of the 'vllm bench latency' command)")
    output_len = _int(output_len, where, "output_len", low=1)
    input_len = _int(input_len, where, "input_len", low=0)
    batch = _int(batch, where, "batch", low=1)
    data = _json_load(text, where)
    if not isinstance(data, dict):
        raise _fail(where, f"a vllm bench latency JSON is one object, not {type(data).__name__}")
    for name in _VLLM_KEYS:
        if name not in data:
            raise _fail(where, f"field {name} is missing (not a 'vllm bench latency --output-json' file)")
    avg = _speed(data["avg_latency"], where, "avg_latency")
    latencies = data["latencies"]
    if not isinstance(latencies, list) or not latencies:
        raise _fail(where, f"latencies {_show(latencies)} is not a list of seconds")
    seconds = [_speed(v, f"{where} latencies[{i}]", "latency") for i, v in enumerate(latencies)]
    if not min(seconds) * 0.99 <= avg <= max(seconds) * 1.01:  # a mean lies among its own samples (to rounding)
        raise _fail(where, f"avg_latency {fmt_number(avg, 4)} s lies outside its own latencies ({fmt_number(min(seconds), 4)}"
                           f" to {fmt_number(max(seconds), 4)} s): not one run's output")
    percentiles = data["percentiles"]
    if not isinstance(percentiles, dict):
        raise _fail(where, f"percentiles {_show(percentiles)} is not an object")
    options = {"input_len": str(input_len), "output_len": str(output_len)}
    for key, value in percentiles.items():
        options[f"p{key}_latency_s"] = repr(_speed(value, where, f"percentiles[{key}]"))
    options["avg_latency_s"] = repr(avg)
    if "std_latency" in data:  # older layouts (before model_id) wrote std_latency
        options["std_latency_s"] = repr(_number(data["std_latency"], where, "std_latency"))
    model = data.get("model_id")
    return [MeasuredRow(
        where=where, engine=_engine(engine, "vllm"), test="prefill+decode", tokens_per_s=output_len / avg,
        n_gen=output_len, n_prompt=input_len, batch=batch, model_file=None if model in (None, "") else str(model),
        spread=(output_len / max(seconds), output_len / min(seconds)), runs=len(seconds), options=options,
    )]


# ---------------------------------------------------------------- plain CSV

# Plain-CSV columns that a MeasuredRow field holds: column -> field (the rest go into options).
_PLAIN_FIELDS = {
    "engine": "engine", "test": "test", "n_gen": "n_gen", "n_prompt": "n_prompt", "prompt_len": "depth",
    "depth": "depth", "batch": "batch", "model": "model_file", "model_file": "model_file", "model_type": "model_type",
    "model_bytes": "model_bytes", "threads": "threads", "n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe",
    "override_tensors": "override_tensors", "tensor_split": "tensor_split", "split": "split_mode",
    "split_mode": "split_mode", "flash_attn": "flash_attn", "runs": "runs", "build": "build", "backend": "backend",
    "cpu_info": "cpu_info", "gpu_info": "gpu_info",
}
_PLAIN_INTS = {"n_gen": 0, "n_prompt": 0, "depth": 0, "batch": 1, "model_bytes": 0, "threads": 1,
               "n_gpu_layers": None, "n_cpu_moe": 0, "runs": 1}


def read_plain_csv(path: Path, *, engine: str | None = None) -> list[MeasuredRow]:
    """A plain CSV for any engine: one row per run, moesim option names as columns.

    Needs ``engine`` (a column, or ``engine=``) and ``tokens_per_s`` or ``tpot_ms``
    (per sequence; both may be given when they agree to 1%). ``test`` defaults to decode,
    ``prompt_len`` is the depth; other columns (hw, host, policy, expert_dtype,
    cpu_layers, gpu_layers, ...) go into ``options`` as given.
    """
    text = _load_text(path)
    header, records = _csv_records(text, path)
    if "tokens_per_s" not in header and "tpot_ms" not in header:
        raise MoesimError(f"{path}:1: neither tokens_per_s nor tpot_ms is a column (plain CSV)")
    if "engine" not in header and engine is None:
        raise MoesimError(f"{path}:1: no engine column (name the engine in a column, or pass engine=)")
    if "prompt_len" in header and "depth" in header:
        raise MoesimError(f"{path}:1: prompt_len and depth are the same field; give one column")
    if "split" in header and "split_mode" in header:
        raise MoesimError(f"{path}:1: split and split_mode are the same field; give one column")
    if "model" in header and "model_file" in header:
        raise MoesimError(f"{path}:1: model and model_file are the same field; give one column")
    if not records:
        raise MoesimError(f"{path}: no rows in the CSV (a header only)")
    return [_plain_row(record, f"{path}:{line}", engine) for line, record in records]


def _plain_row(record: dict[str, str], where: str, engine: str | None) -> MeasuredRow:
    values: dict[str, Any] = {}
    options: dict[str, str] = {}
    for column, raw in record.items():
        value = raw.strip()
        name = _PLAIN_FIELDS.get(column)
        if column in ("tokens_per_s", "tpot_ms"):
            continue
        if name is None:
            options[column] = value
            continue
        if value == "":
            continue
        if name in _PLAIN_INTS:
            values[name] = _int(value, where, column, low=_PLAIN_INTS[name])
        elif name == "flash_attn":
            values[name] = _flag(value, where, column)
        elif name == "tensor_split":
            values[name] = _split_floats(value, where, column)
        elif name == "override_tensors":
            values[name] = _split_overrides(value, ";")
        else:
            values[name] = value
    speed = None
    if record.get("tokens_per_s", "").strip():
        speed = _speed(record["tokens_per_s"], where, "tokens_per_s")
    if record.get("tpot_ms", "").strip():
        from_tpot = _tpot_speed(record["tpot_ms"], where, "tpot_ms")
        if speed is not None and abs(from_tpot - speed) > 0.01 * speed:
            raise _fail(where, f"tokens_per_s {speed:g} and tpot_ms {record['tpot_ms'].strip()} disagree "
                               f"(1000/tpot_ms = {fmt_number(from_tpot, 4)})")
        speed = from_tpot if speed is None else speed
    if speed is None:
        raise _fail(where, "tokens_per_s (or tpot_ms) is empty")
    if "engine" not in values:
        if engine is None:
            raise _fail(where, "engine is empty")
        values["engine"] = engine
    elif engine is not None:
        values["engine"] = engine
    test = values.pop("test", "decode")
    if test not in TESTS:
        raise _fail(where, f"test {test!r} is not one of {', '.join(TESTS)}")
    return MeasuredRow(where=where, test=test, tokens_per_s=speed, options=options, **values)


# ---------------------------------------------------------------- detection and the one entry point

_READERS = {
    "llama-bench-md": read_llama_bench_md,
    "llama-bench-json": read_llama_bench_json,
    "llama-bench-jsonl": read_llama_bench_jsonl,
    "llama-bench-csv": read_llama_bench_csv,
    "llama-timings": read_llama_timings,
    "sweep-bench": read_sweep_bench,
    "sweep-bench-jsonl": read_sweep_bench_jsonl,
    "vllm-latency": read_vllm_latency,
    "csv": read_plain_csv,
}


def detect_format(path: Path) -> str:
    """The format of ``path`` (one of ``FORMATS``), from its content."""
    text = _load_text(path)
    stripped = text.lstrip()
    first = stripped.splitlines()[0].strip() if stripped else ""
    if stripped.startswith("["):
        return "llama-bench-json"
    if stripped.startswith("{"):
        if first.endswith("}"):
            if '"speed_tg"' in first:
                return "sweep-bench-jsonl"
            if '"avg_ts"' in first:
                return "llama-bench-jsonl"
        if '"avg_latency"' in text:
            return "vllm-latency"
        if '"avg_ts"' in text:
            return "llama-bench-jsonl"
        raise MoesimError(f"{path}: a JSON file that is neither llama-bench's, sweep-bench's nor vllm bench latency's")
    lines = text.splitlines()
    for line in lines:
        record = _SWEEP_JSON_LINE.match(line.strip())
        if record and '"speed_tg"' in line:
            return "sweep-bench-jsonl"
        if line.lstrip().startswith("|"):
            cells = _md_cells(line)
            if "S_TG t/s" in cells and "N_KV" in cells:
                return "sweep-bench"
            if _is_llama_bench_header(cells):
                return "llama-bench-md"
    if any(_TIMING_HINT.search(line) or _CLI_LINE.search(line) for line in lines):
        return "llama-timings"
    header = next(csv.reader([first]), [])
    names = {c.strip() for c in header}
    if {"avg_ts", "n_prompt", "n_gen"} <= names:
        return "llama-bench-csv"
    if names & {"tokens_per_s", "tpot_ms"}:
        return "csv"
    raise MoesimError(f"{path}: not a benchmark output moesim reads (formats: {', '.join(FORMATS)})")


def read_measured(path: Path, fmt: str | None = None, **kw: Any) -> list[MeasuredRow]:
    """Every measured row of ``path``; ``fmt`` (one of ``FORMATS``) forces the format.

    Keyword arguments go to the reader: ``engine=`` (every format: the engine's name, e.g.
    "ik_llama.cpp" for an ik_llama.cpp llama-bench table that has no ik-only column), and
    ``output_len=``, ``input_len=``, ``batch=`` (vllm-latency, where they are required).
    """
    path = Path(path)
    if fmt is None:
        fmt = detect_format(path)
    elif fmt not in _READERS:
        raise MoesimError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    unknown = set(kw) - {"engine", "output_len", "input_len", "batch"}
    if unknown:
        raise MoesimError(f"{path}: unknown reader option {sorted(unknown)[0]!r} "
                          "(the readers take engine=, and for vllm-latency output_len=, input_len=, batch=)")
    if fmt != "vllm-latency":
        _no_kwargs(fmt, {k: v for k, v in kw.items() if k != "engine" and v is not None}, path)
    return _READERS[fmt](path, **kw)
