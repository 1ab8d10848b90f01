"""Calibrate moesim on what a user measured on their own machine (``moesim fit --measured``).

A published figure fitted across machines, engine builds and formats cannot know what one
user's build does on one user's machine; one or two rows they measured can. Each measured
row (:mod:`moesim.measured`: llama-bench, llama-server, ik_llama.cpp, vLLM or a plain CSV)
becomes a deployment (:func:`deployment`: the model file or the file type the output printed,
checked against ``--model`` by size and parameter count; ``-ngl``, ``--n-cpu-moe`` / ``-ot``,
threads, depth, batch; a GPU build's row needs ``--hw``) predicted through the same path
``moesim validate --published`` takes (:func:`moesim.sim.published.predict`), and
:func:`calibrate` fits only what the rows can determine (:func:`choose`):

- one figure per resource that bounds some row under the starting profiles (the CPU's
  weight reads from CPU-bound rows, the GPU's from GPU-bound rows, the link from copy-bound
  rows), the format's own entry where the engine has one, else ``default``;
- one thread's kernel rate (``cpu_kernel_gmacs``) where CPU-bound rows differ in threads, or
  where a row on fewer threads than the host's cores ran slower than predicted;
- never more figures than rows: the figures that bound the most rows first.

Each is fitted by least squares on ln(predicted / measured) from the shipped engine profile,
and written as an ordinary engine profile (every fitted figure marked ``fitted``, its rows as
the source) with a ``[calibration]`` table: the range its answers carry, from the
leave-one-row-out residuals of this calibration when there are enough rows
(:data:`moesim.sim.intervals.MIN_CLASS`), else from the published sources' own one-row
calibrations (:func:`moesim.sim.intervals.calibrated_residuals`). A fit that does not explain
its rows is not written (:func:`verdict`). :func:`round_trip` scores the whole path as users
take it on the published suite: a row printed as its engine prints it (:func:`printed`),
read back, calibrated, the source's other rows predicted.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from moesim.engines import EngineProfile, get_engine
from moesim.errors import MoesimError
from moesim.fmt import number, plural
from moesim.hardware import get_host, get_machine
from moesim.models import DTYPES, get_model
from moesim.policy import get_policy
from moesim.quant_recipes import RECIPES, canonical, file_type_in, has_recipe
from moesim.sim import targets
from moesim.sim.intervals import MIN_CLASS, Interval, calibrated_residuals, conformal
from moesim.sim.published import Entry, predict, setting_spec
from moesim.sim.sweep import bound_of
from moesim.spec import matrix_bytes

if TYPE_CHECKING:  # the rows' type only: reading them is moesim.measured's
    from moesim.measured import MeasuredRow

#: What a calibration may fit: figure (the table's format key is chosen per row), the
#: resource whose rows inform it (:func:`moesim.sim.sweep.bound_of`'s words), bounds.
CANDIDATES = (("cpu_weight_efficiency", "CPU compute", 0.02, 1.0),
              ("gpu_weight_efficiency", "GPU compute", 0.02, 1.0),
              ("link_efficiency", "link", 0.02, 1.0))
#: One CPU thread's kernel rate, fitted when rows differ in threads: the GB/s of weights one
#: thread's kernels decode and multiply (a dequantise-and-dot kernel is bound by the bytes it
#: unpacks more than by its multiply-adds: llama.cpp's measured per-thread rates on this
#: project's bench, bf16 / Q8_0 / Q4_K, are 3.7 / 7.6 / 9.3 G multiply-adds but 7.4 / 8.0 / 5.3
#: GB/s), written as the engine's ``cpu_kernel_gmacs`` of every format at its bytes a weight.
THREAD_RATE = ("cpu_kernel_gbs", 0.05, 200.0)
#: The starts of each fit, as a share of each figure's log range (a max() of two terms has
#: flat regions: the best of several starts).
STARTS = (0.1, 0.4, 0.7, 0.95)


@dataclass(frozen=True)
class Given:
    """What the user says of the machine the rows were measured on (the outputs rarely do)."""

    hw: str | None = None  # GPUs (--hw): 'none' for a CPU-only build; None: not said (then 'none')
    host: str | None = None  # CPU (--host): a built-in, a file or 'this'
    engine: str | None = None  # the starting engine profile (default: the rows' engine)
    model: str | None = None  # the model, where the output names no file that exists here
    expert_dtype: str | None = None  # the file type, where the output names none (vLLM, a log line)


@dataclass(frozen=True)
class Calibration:
    """A fitted engine profile, what it was fitted on, and how well it predicts."""

    engine: EngineProfile
    figures: dict[str, float]  # fitted figure -> value
    rows: list[dict[str, Any]]  # per measured row: deployment, measured, before, after
    loro: list[float] = field(default_factory=list)  # leave-one-row-out ln(predicted / measured)
    at_bound: list[str] = field(default_factory=list)  # fitted figures that ended at a bound of their range
    unused: list[tuple[str, str]] = field(default_factory=list)  # (where, why) rows not calibrated on


def _spec_name(row: MeasuredRow, given: Given) -> str:
    """The model of ``row``: ``--model`` when given, else the file the output names when it is
    here, else that name as a catalogue model (a plain CSV's ``model`` column)."""
    from pathlib import Path

    if given.model:
        return given.model
    if row.model_file and Path(row.model_file).exists():
        return row.model_file
    if row.model_file:
        try:
            get_model(row.model_file)
            return row.model_file
        except MoesimError:
            pass
    named = f" names {row.model_file!r}, which is no file here nor a catalogue model" if row.model_file else \
        " names no model file"
    raise MoesimError(f"{row.where}: the output{named}; give the model with --model (a GGUF file, a config.json "
                      "folder or a catalogue name)")


#: The routed experts' tensors of a layer, as llama.cpp names them (``blk.N.ffn_*_exps.weight``).
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def cpu_moe_layers(row: MeasuredRow, moe_layers: Sequence[int]) -> int:
    """How many MoE layers keep their experts in host memory: ``--n-cpu-moe N`` (the first N)
    together with every ``-ot REGEX=CPU`` (a layer whose three expert tensors all match);
    one line where they are not the first N layers, or split a layer's experts."""
    on_cpu = set(range(min(row.n_cpu_moe or 0, len(moe_layers))))
    for ot in row.override_tensors:
        pattern, _, buf = ot.rpartition("=")
        if buf.upper() != "CPU":
            raise MoesimError(f"{row.where}: -ot {ot!r}: moesim reads overrides to the CPU only (experts kept in "
                              "host memory)")
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise MoesimError(f"{row.where}: -ot {ot!r}: not a regular expression ({e})") from None
        for m, layer in enumerate(moe_layers):
            hit = [t for t in EXPERT_TENSORS if rx.search(f"blk.{layer}.{t}.weight")]
            if hit and len(hit) < len(EXPERT_TENSORS):
                raise MoesimError(f"{row.where}: -ot {ot!r} keeps only {', '.join(hit)} of layer {layer}'s experts on "
                                  "the CPU; moesim places a layer's experts whole (llama.cpp's --n-cpu-moe)")
            if hit:
                on_cpu.add(m)
    if on_cpu != set(range(len(on_cpu))):
        raise MoesimError(f"{row.where}: -ot keeps the experts of MoE layers {sorted(on_cpu)} on the CPU; moesim's "
                          "cpu-static places the first N (llama.cpp's --n-cpu-moe N)")
    return len(on_cpu)


def deployment(row: MeasuredRow, given: Given) -> Entry:
    """The published-suite entry that expresses ``row`` (its settings as
    ``hwprofiles/published/settings.toml`` writes them), so it is predicted by the same path;
    every name in it resolved here, so a bad one is refused naming the row, before any fit."""
    try:
        entry = _deployment(row, given)
        s = entry.setting
        setting_spec(s), get_engine(s["engine"]), get_policy(s["policy"])
        if s.get("host"):
            get_host(s["host"])
    except MoesimError as e:
        text = str(e)
        raise MoesimError(text if text.startswith(row.where) else f"{row.where}: {text}") from None
    return entry


#: llama.cpp's GPU backends as llama-bench names them (``backends``, the markdown's ``backend``):
#: a row of such a build with layers offloaded ran on a GPU.
GPU_BACKENDS = ("CUDA", "ROCm", "HIP", "Vulkan", "Metal", "SYCL", "MUSA", "CANN", "OpenCL", "GPU BLAS")
#: How far the size or parameter count the output printed may be from the named model's at the
#: printed file type before the row is refused as another model (llama.cpp's sizes count every
#: tensor as stored; moesim's catalogue leaves out the odd norm and MTP layer: a few percent).
SIZE_TOLERANCE = 0.10


def _on_gpu_build(row: MeasuredRow) -> str | None:
    """The GPU backend ``row`` ran on (a GPU build with layers offloaded), else None."""
    names = [b.strip() for b in re.split(r"[,;/ ]+", row.backend or "") if b.strip()]
    gpu = next((b for b in names if b.lower() in {g.lower() for g in GPU_BACKENDS}), None)
    return gpu if gpu and (row.n_gpu_layers is None or row.n_gpu_layers > 0) else None


def _file_type(row: MeasuredRow, given: Given, model: str) -> str | None:
    """The file type ``row`` was measured with, as moesim prices it: the one the output printed
    (llama.cpp's model description), else ``--expert-dtype``; None for a GGUF file here (it
    says every tensor's type) or when neither says. One line when they disagree or when moesim
    has no recipe for the printed type."""
    printed = file_type_in(row.model_type)
    wanted = canonical(given.expert_dtype) if given.expert_dtype else None
    if printed and wanted and printed[1] != wanted:
        raise MoesimError(f"{row.where}: the output says the file type is {printed[0]} ({printed[1]}), "
                          f"--expert-dtype says {given.expert_dtype}: give the one the row was measured with")
    if model.lower().endswith(".gguf") and not wanted:
        return None  # the file's own tensor types
    key = printed[1] if printed else wanted
    if key is not None and not has_recipe(key):
        said = f"the output's file type {printed[0]}" if printed else f"--expert-dtype {given.expert_dtype}"
        raise MoesimError(f"{row.where}: {said} ({key}) is one moesim has no llama-quantize recipe for; give the "
                          f"nearest it knows with --expert-dtype (file types: {', '.join(RECIPES)})")
    return key


def _check_size(row: MeasuredRow, spec, model: str, quant: str | None) -> None:
    """Refuse a row whose printed size or parameter count is not ``spec``'s at its file type
    (more than :data:`SIZE_TOLERANCE` apart): the wrong ``--model``, or a file type misread."""
    as_what = f" as {quant}" if quant else ""
    def gib(n: float) -> str:
        return f"{number(n / 2**30, 4)} GiB"

    def billions(n: float) -> str:
        return f"{number(n / 1e9, 4)} B parameters"

    for printed, ours, say in ((row.model_bytes, spec.non_expert_bytes + spec.all_expert_bytes, gib),
                               (row.model_params, spec.total_params, billions)):
        if printed and ours and abs(math.log(printed / ours)) > math.log1p(SIZE_TOLERANCE):
            raise MoesimError(f"{row.where}: the output's model is {say(printed)}; {model}{as_what} is {say(ours)} "
                              f"(more than {SIZE_TOLERANCE:.0%} apart): not the model the row ran; give the right "
                              "--model (or --expert-dtype where the output names no file type)")


#: A plain CSV's columns that say where an engine keeps experts beyond the layer counts, as
#: the published settings write them: KTransformers' GPU experts a layer
#: (``--kt-num-gpu-experts``) and how it picks them, an expert cache (a count, or ``fill``:
#: the device memory the engine leaves) and its eviction.
PLACEMENT_COLUMNS = {"gpu_experts_per_layer": "a count of experts a layer", "placement": "uniform or frequency",
                     "cache_experts": "a count of experts", "cache_gib": "fill (the device memory left)",
                     "eviction": "lru or lfu", "cache_per_layer": "1 or 0"}


def _placement_columns(row: MeasuredRow) -> dict[str, Any]:
    """The :data:`PLACEMENT_COLUMNS` a plain CSV row gives, checked, as settings keys."""
    out: dict[str, Any] = {}
    for k, what in PLACEMENT_COLUMNS.items():
        v = (row.options.get(k) or "").strip()
        if not v:
            continue
        ok = {"gpu_experts_per_layer": re.fullmatch(r"[0-9]+", v), "cache_experts": re.fullmatch(r"[0-9]+", v),
              "placement": v in ("uniform", "frequency"), "cache_gib": v == "fill", "eviction": v in ("lru", "lfu"),
              "cache_per_layer": v in ("0", "1")}[k]
        if not ok:
            raise MoesimError(f"{row.where}: {k} {v!r}: {what}")
        out[k] = int(v) if k in ("gpu_experts_per_layer", "cache_experts") else v == "1" if k == "cache_per_layer" \
            else v
    return out


def _deployment(row: MeasuredRow, given: Given) -> Entry:
    o = row.options
    model = _spec_name(row, given)
    hw = o.get("hw") or given.hw or "none"
    gpu_build = _on_gpu_build(row)
    if gpu_build and not o.get("hw") and given.hw is None:
        raise MoesimError(f"{row.where}: a {gpu_build} build's row"
                          + (f" with -ngl {row.n_gpu_layers}" if row.n_gpu_layers is not None else "")
                          + " ran on a GPU: give --hw (the GPUs it ran on, `moesim hw` lists them); moesim never "
                          "prices a GPU row on the CPU")
    machine = get_machine(hw)
    quant = canonical(o["expert_dtype"]) if o.get("expert_dtype") else _file_type(row, given, model)
    spec = setting_spec({"model": model, "quant": quant, "id": row.where})
    _check_size(row, spec, model, quant)
    if row.split_mode and row.split_mode.strip().lower() == "row" and machine.n_gpus > 1:
        raise MoesimError(f"{row.where}: -sm row splits each matrix across the GPUs; moesim models llama.cpp's "
                          "layer split (-sm layer) only")
    s: dict[str, Any] = {"id": row.where, "model": model, "engine": o.get("engine") or given.engine or row.engine,
                         "hw": hw, "gen": max(row.n_gen, 1),
                         # the context the generated tokens see: the cache before the test, and the test's own
                         # prompt when it times prompt and generation together
                         "context": int(o.get("prompt_len", row.depth))
                         + (row.n_prompt if row.test == "prefill+decode" else 0)}
    if quant:
        s["quant"] = quant
    if row.batch > 1:  # sequences decoded at once (vLLM's --batch-size); priced per sequence, as measured
        s["batch"] = int(row.batch)
    host = o.get("host") or given.host
    if host:
        s["host"] = host
    if row.threads:
        s["threads"] = int(row.threads)
    if o.get("policy"):
        s["policy"] = o["policy"]
        s.update(_placement_columns(row))
        for k in ("cpu_layers", "gpu_layers"):
            if o.get(k):
                if o[k] not in ("auto", "all") and not re.fullmatch(r"[0-9]+", o[k]):  # ASCII digits only
                    raise MoesimError(f"{row.where}: {k} {o[k]!r}: a count of layers, auto or all")
                s[k] = o[k] if o[k] in ("auto", "all") else int(o[k])
        pol = get_policy(s["policy"])
        if machine.n_gpus == 0 and pol.uses_host:  # no GPU: every family that places weights is all on the CPU
            s["policy"] = "all-resident"
            for k in ("cpu_layers", "gpu_layers", *PLACEMENT_COLUMNS):
                s.pop(k, None)
        elif why := pol.cannot_run_on(machine.n_gpus):
            raise MoesimError(f"{row.where}: the file's policy {o['policy']} on hw {hw}: {why}")
    else:
        cpu_moe = cpu_moe_layers(row, spec.moe_layers)
        ngl = row.n_gpu_layers
        cpu_build = (row.backend or "").upper() == "CPU"  # a CPU-only build runs everything there, whatever -ngl says
        if machine.n_gpus == 0 or ngl == 0 or cpu_build:
            s["hw"], s["policy"] = "none", "all-resident"
        elif cpu_moe:
            s["policy"], s["cpu_layers"] = "cpu-static", min(int(cpu_moe), spec.n_moe_layers)
        elif ngl is not None and ngl < spec.n_layers:
            s["policy"], s["gpu_layers"] = "gpu-layers", int(ngl)
        else:
            s["policy"] = "all-resident"
    if s["hw"] == "none" and "cpu" not in get_engine(s["engine"]).runs_on:
        raise MoesimError(f"{row.where}: {s['engine']} runs on GPUs only: give --hw (the GPUs the row ran on, "
                          "`moesim hw` lists them)")
    if (get_policy(s["policy"]).uses_host or s["hw"] == "none") and not s.get("host"):
        raise MoesimError(f"{row.where}: a deployment with work on the CPU needs the host: give --host (a "
                              "built-in from `moesim hw --hosts`, a host profile file, or 'this')")
    m = {"id": s["id"], "source_url": row.where, "decode_tps": row.tokens_per_s,
         "category": "all-cpu" if s["hw"] == "none" else "all-gpu" if s["policy"] == "all-resident"
         else "hybrid-cpu-experts"}
    return Entry(m, s)


def _key(engine: EngineProfile, table: str, dtype: str) -> str:
    """The entry of ``table`` a row of ``dtype`` weights reads (its own, else ``default``)."""
    if table.endswith("efficiency") and table != "link_efficiency":
        return f"{table}.{dtype}" if dtype in getattr(engine, table) else f"{table}.default"
    return table


def _ln_errors(entries: Sequence[Entry], engine: EngineProfile) -> np.ndarray:
    return np.array([math.log(predict(e, {e.setting["engine"]: engine})["predicted_tps"]
                              / float(e.measurement["decode_tps"])) for e in entries])


def bound_under(e: Entry, engine: EngineProfile) -> str:
    """What bounds ``e``'s prediction under ``engine`` (:func:`moesim.sim.sweep.bound_of`'s words)
    and, after a colon, ``slower`` when the row measured slower than predicted by more than
    :data:`MISS` (``CPU compute: slower``): which way the row asks a figure to move."""
    p = predict(e, {e.setting["engine"]: engine})
    b = bound_of({**p["result"].summary(), "fits": True})
    # slower by more than a fit counts as explained (MISS): a few percent is the memory's share (or
    # noise), not a thread's kernels
    return f"{b}: slower" if p["predicted_tps"] > (1 + MISS) * float(e.measurement["decode_tps"]) else b


def choose(entries: Sequence[Entry], engine: EngineProfile,
           bounds: Sequence[str] | None = None) -> tuple[list[tuple[str, float, float]], list[str]]:
    """The figures the rows can determine (see the module docstring): [(key, low, high)] and
    each row's bound under ``engine`` (:func:`bound_under`'s; ``bounds``: already known, as a
    leave-one-row-out fold knows them from the fit on every row).

    A CPU-bound row on fewer threads than the host has cores that ran slower than predicted (by
    more than :data:`MISS`) is
    bound by what its threads' kernels decode (one thread draws a fraction of a socket's
    bandwidth, and no share of the memory's can make a row slower than a thread allows): it
    informs the thread rate, not the memory's share."""
    bounds = list(bounds) if bounds is not None else [bound_under(e, engine) for e in entries]
    keys: Counter = Counter()
    thread_keys: Counter = Counter()  # the memory's share the thread-bound rows would inform
    cpu_threads, few_threads = set(), 0
    for e, read in zip(entries, bounds, strict=True):
        b, slower = read.removesuffix(": slower"), read.endswith(": slower")
        dtype = setting_spec(e.setting).expert_dtype  # the spec the prediction used (a file type's recipe applied)
        informs = Counter((_key(engine, table, dtype), lo, hi) for table, resource, lo, hi in CANDIDATES
                          if resource == b)
        if b == "CPU compute":
            cpu_threads.add(e.setting.get("threads"))
            if slower and fewer_threads_than_cores(e):
                few_threads += 1
                thread_keys += informs
                continue
        keys += informs
    if len(cpu_threads) > 1:  # rows at two thread counts also say where the memory caps the threads
        keys += thread_keys
    chosen = [k for k, _ in keys.most_common()]
    if few_threads or len(cpu_threads) > 1:  # the rows say what a thread decodes, or how speed grows with threads
        chosen.insert(0 if few_threads > max(keys.values(), default=0) else len(chosen), THREAD_RATE)
    return chosen[:len(entries)], bounds


def fewer_threads_than_cores(e: Entry) -> bool:
    """Whether ``e`` ran on fewer threads than its host has cores: then what a thread's kernels
    decode binds it (one thread draws a fraction of a socket's bandwidth), and a row on every
    core is bound by the memory."""
    t = e.setting.get("threads")
    if not t or not e.setting.get("host"):
        return False
    h = get_host(e.setting["host"])
    return int(t) < h.cores * int(e.setting.get("sockets") or h.sockets)


def _bytes_per_weight(dtype: str) -> float:
    return matrix_bytes(4096, 4096, dtype) / 4096**2


def with_thread_rate(engine: EngineProfile, gbs: float, source: str) -> EngineProfile:
    """``engine`` whose CPU kernels decode ``gbs`` GB/s of weights a thread, in every format:
    its ``cpu_kernel_gmacs`` table at each format's bytes a weight (one multiply-add a weight
    a token)."""
    for dtype in ("default", *DTYPES):
        bpw = _bytes_per_weight("bf16" if dtype == "default" else dtype)
        engine = engine.with_figure(f"cpu_kernel_gmacs.{dtype}", gbs / bpw, "fitted",
                                    f"{source}; one thread's kernels decode {number(gbs, 4)} GB/s of weights, here in "
                                    f"multiply-adds at {number(bpw, 4)} bytes a weight")
    return engine


def _fit(entries: Sequence[Entry], base: EngineProfile, figures, source: str,
         start: dict[str, float] | None = None) -> tuple[EngineProfile, dict[str, float]]:
    """``base`` with ``figures`` fitted to ``entries``; ``start``: values to start from alone (a
    leave-one-row-out fit starts where the fit on every row ended, one start instead of
    :data:`STARTS`' grid: the rows left are nearly the same)."""
    from scipy.optimize import least_squares  # scipy.optimize: 0.4 s to import, only a fit pays it

    if not figures:
        return base, {}
    lo = np.log([f[1] for f in figures])
    hi = np.log([f[2] for f in figures])

    def engine_at(x) -> EngineProfile:
        eng = base
        for (key, _, _), v in zip(figures, np.exp(x)):
            eng = with_thread_rate(eng, float(v), source) if key == THREAD_RATE[0] else \
                eng.with_figure(key, float(v), "fitted", source)
        return eng

    def residuals(x):
        return _ln_errors(entries, engine_at(x))

    # Every combination of starts for up to two figures (a rate that does not bind has no
    # gradient: started where the other figure leaves it slack, it would never move), the
    # diagonal beyond.
    starts = itertools.product(STARTS, repeat=len(figures)) if len(figures) <= 2 else ((q,) * len(figures)
                                                                                       for q in STARTS)
    points = [lo + (hi - lo) * np.array(q) for q in starts]
    if start is not None and all(f[0] in start for f in figures):
        points = [np.clip(np.log([start[f[0]] for f in figures]), lo, hi)]
    best = min((least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3, xtol=1e-4, ftol=1e-6)
                for x0 in points), key=lambda r: r.cost)
    values = {key: float(v) for (key, _, _), v in zip(figures, np.exp(best.x))}
    return engine_at(best.x), values


def _at_bound(figures, values: dict[str, float]) -> list[str]:
    """The fitted figures that ended within 0.1% of a bound: the rows ask for more than it can give."""
    return [key for key, lo, hi in figures if key in values and min(abs(math.log(values[key] / b)) for b in (lo, hi))
            < 1e-3]


#: A test that times the prompt and the generation together (``vllm bench latency``, llama-bench's
#: ``-pg``) counts as a decode measurement when its prompt is at most this share of the tokens
#: it generates: the prefill of so short a prompt is a few percent of the run.
MIXED_PROMPT_SHARE = 0.25


def usable(row: MeasuredRow) -> bool:
    """Whether ``row`` measures decode speed: a decode test, or a prompt-and-generation test
    whose prompt is short (:data:`MIXED_PROMPT_SHARE`)."""
    return row.test == "decode" or (row.test == "prefill+decode" and row.n_gen > 0
                                    and row.n_prompt <= MIXED_PROMPT_SHARE * row.n_gen)


def calibrate(rows: Sequence[MeasuredRow], given: Given, what: str,
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Fit the figures ``rows`` determine (decode rows; the others are listed as unused, with
    why), starting from the engine profile ``given`` names or the rows' engine."""
    decode = [r for r in rows if usable(r)]
    unused = [(r.where, f"a {r.test} test: moesim calibrates decode speed"
               + (f" (its {r.n_prompt}-token prompt is more than {MIXED_PROMPT_SHARE:.0%} of its {r.n_gen} "
                  "generated tokens: the prefill would weigh in its time)" if r.test == "prefill+decode" else ""))
              for r in rows if not usable(r)]
    if not decode:
        raise MoesimError(f"{what}: no decode rows to calibrate on ({len(rows)} rows, none of them decode); measure "
                          "generation (llama-bench -n, a server's eval time)")
    entries = [deployment(r, given) for r in decode]
    names = {e.setting["engine"] for e in entries}
    if len(names) > 1:
        raise MoesimError(f"{what}: rows of several engines ({', '.join(sorted(names))}): calibrate one at a time")
    cal = calibrate_entries(entries, get_engine(names.pop()), f"{plural(len(entries), 'row')} of {what}",
                            progress=progress)
    return replace(cal, unused=unused)


def calibrate_entries(entries: Sequence[Entry], base: EngineProfile, what: str, loro: bool = True,
                      progress: Callable[[int, int], None] | None = None) -> Calibration:
    """``base`` with the figures ``entries`` determine fitted to them; with ``loro``, each
    entry also predicted from a calibration on the others (``progress(done, total)`` after
    each), and the range answers carry. A fold reuses what the fit on every row knows (each
    row's bound, the fitted values as its one start): tens of rows take seconds, not minutes."""
    figures, bounds = choose(entries, base)
    source = (f"fitted by moesim fit --measured on {what} ({', '.join(e.measurement['source_url'] for e in entries)})"
              ": least squares on ln(predicted / measured)")
    engine, values = _fit(entries, base, figures, source)
    before, after = _ln_errors(entries, base), _ln_errors(entries, engine)
    left_out = []
    if loro and len(entries) >= 2:
        for i in range(len(entries)):
            rest = list(entries[:i]) + list(entries[i + 1:])
            eng_i, _ = _fit(rest, base, choose(rest, base, bounds[:i] + bounds[i + 1:])[0], source, start=values)
            left_out.append(float(_ln_errors([entries[i]], eng_i)[0]))
            if progress:
                progress(i + 1, len(entries))
    if loro:
        iv = _range(left_out, what)
        engine = replace(engine, description=f"{base.name} calibrated on {what}",
                         calibration={"low": iv.low, "high": iv.high, "rows": len(entries), "basis": iv.basis})
    out = [{"where": e.measurement["source_url"], "deployment": _words(e), "bound": b.removesuffix(": slower"),
            "reading": _reading(e),
            "measured_tps": float(e.measurement["decode_tps"]),
            "before_tps": float(e.measurement["decode_tps"]) * math.exp(x0),
            "after_tps": float(e.measurement["decode_tps"]) * math.exp(x1), "ln_error_after": float(x1)}
           for e, b, x0, x1 in zip(entries, bounds, before, after)]
    return Calibration(engine, values, out, left_out, at_bound=_at_bound(figures, values))


#: A calibration that still misses one of its own rows by more than this is not written
#: (:func:`verdict`): no setting of the figures it fits explains the rows.
MISS = 0.15


def verdict(cal: Calibration) -> str | None:
    """Why ``cal`` should not be used as a calibration, in words a user acts on, or None when it
    explains its rows: a fitted figure that ended at the end of its range, or a row it still
    misses by more than :data:`MISS`, each with the reading of the row to suspect."""
    off = [r for r in cal.rows if abs(r["after_tps"] / r["measured_tps"] - 1) > MISS]
    if not cal.at_bound and not off:
        return None
    r = off[0] if off else cal.rows[0]
    faster = r["measured_tps"] > r["after_tps"]
    what = (f"{', '.join(cal.at_bound)} ended at the end of its range" if cal.at_bound else
            f"the fit still misses {plural(len(off), 'row')} by more than {MISS:.0%}")
    where = f"{r['where']} ran {'faster' if faster else 'slower'} than any setting of the figures allows " \
            f"({number(r['measured_tps'], 4)} tok/s measured, {number(r['after_tps'], 4)} at best)"
    suspect = (f"a lighter file type than the one read ({r['reading']}), more threads or another host or GPU than "
               "given, or a build moesim's figures do not describe" if faster else
               f"a heavier file type than the one read ({r['reading']}), a busy machine, fewer threads than printed, "
               "or a setting moesim does not model")
    return f"{what}: {where}; suspect {suspect}"


def _range(left_out: list[float], what: str) -> Interval:
    """The range a calibration's answers carry: its own leave-one-row-out residuals when there
    are enough for a conformal interval, else the published sources' one-row calibrations'."""
    if len(left_out) >= MIN_CLASS:
        # Never narrower than what the fit counts as explaining a row (+-MISS), and always holding
        # the prediction itself: nine identical rows once gave a range of zero width, and a biased
        # set one that excluded its own prediction ("246 tok/s, 80% range 2,000-2,000").
        iv = conformal(left_out, f"calibrated on {what}: {len(left_out)} rows, leave one row out")
        return replace(iv, low=min(iv.low, 1 / (1 + MISS)), high=max(iv.high, 1 + MISS),
                       basis=f"{iv.basis}; at least +-{MISS:.0%}, what the fit counts as explaining a row")
    pool = calibrated_residuals()
    n_src = len({r.source for r in pool})
    return conformal([r.ln_error for r in pool],
                     f"calibrated on {what}; range from {len(pool)} published rows predicted after calibrating on one "
                     f"other row of the same source and machine ({n_src} sources): its own "
                     f"{plural(len(left_out), 'row')} left out are too few for a range of their own ({MIN_CLASS} "
                     "needed)")


def _reading(e: Entry) -> str:
    """What moesim read of a row that the speed depends on most: file type, threads, GPUs, build."""
    s = e.setting
    spec = setting_spec(s)
    parts = [f"file type {s['quant']}" if s.get("quant") else f"experts in {spec.expert_dtype}",
             plural(int(s["threads"]), "thread") if s.get("threads") else "threads as the host profile says",
             "CPU only" if s["hw"] == "none" else f"GPUs {s['hw']}"]
    return ", ".join(parts)


def _words(e: Entry) -> str:
    """A row's deployment as the engine's own flags say it, short: ``all-resident, none + HOST, -t 2, -d 512``."""
    s = e.setting
    from pathlib import Path

    host = f" + {Path(s['host']).name}" if s.get("host") else ""
    flags = {"quant": "file type", "cpu_layers": "--n-cpu-moe", "gpu_layers": "-ngl", "threads": "-t",
             "context": "-d", "batch": "batch"}
    return ", ".join([s["policy"], f"{s['hw']}{host}"] + [f"{f} {s[k]}" for k, f in flags.items() if k in s])


# --------------------------------------------------------------------------------------
# The published suite, calibrated: what one measured row buys, and whether the order holds
# --------------------------------------------------------------------------------------

#: A source's entries on one machine calibrated on its first (the first the source lists in
#: settings.toml) and judged on the others, when it has at least this many.
MIN_CALIBRATED = 3
#: The calibrated accuracy targets (:mod:`moesim.sim.targets`).
CALIBRATED_WITHIN = targets.CALIBRATED_WITHIN
CALIBRATED_TARGET = targets.CALIBRATED_SHARE
BEST_TARGET = targets.BEST_SHARE


def machine_groups(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Leave-one-source-out rows grouped by source and machine (GPUs and host), in the
    settings file's order: the settings one source measured on one machine."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["source_id"], r["hw"], r["host"]), []).append(r)
    return list(groups.values())


def _spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    from scipy.stats import spearmanr  # scipy.stats: imported only to score

    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def published_calibration(rows: Sequence[dict[str, Any]],
                          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """For each source with at least :data:`MIN_CALIBRATED` entries on one machine: calibrate
    on its first entry (starting from engine figures fitted without that source, as
    leave-one-source-out does), predict the others; and for each source with several
    settings of one machine, whether the predictions order them as measured (Spearman's rank
    correlation) and name the measured best, uncalibrated and calibrated on one row."""
    from moesim.sim.engine_fit import fit
    from moesim.sim.published import entries as all_entries

    by_id = {e.id: e for e in all_entries()}
    judged, sweeps = [], []
    groups = [g for g in machine_groups(rows) if len(g) >= 2]
    for done, group in enumerate(groups, 1):
        if progress:
            progress(done - 1, len(groups))
        src = group[0]["source_id"]
        first = by_id[group[0]["id"]]
        name = first.setting["engine"]
        base = fit(tuple(e for e in all_entries() if e.source != src), {name})[name].engine
        cal = calibrate_entries([first], base, f"the first row of {src}", loro=False)
        after = {}
        for r in group:
            e = by_id[r["id"]]
            eng = cal.engine if e.setting["engine"] == name else None
            after[r["id"]] = (r["predicted_tps"] if eng is None
                              else float(predict(e, {name: eng})["predicted_tps"]))
        if len(group) >= MIN_CALIBRATED:
            for r in group[1:]:
                ln = math.log(after[r["id"]] / r["measured_tps"])
                judged.append({"id": r["id"], "source_id": src, "kind": r["kind"], "engine": r["engine"],
                               "calibrated_on": first.id, "fitted": cal.figures, "measured_tps": r["measured_tps"],
                               "uncalibrated_tps": r["predicted_tps"], "calibrated_tps": after[r["id"]],
                               "ln_error": ln, "within_15": abs(math.expm1(ln)) <= CALIBRATED_WITHIN})
        measured = [r["measured_tps"] for r in group]
        best = max(range(len(group)), key=lambda i: measured[i])
        uncal = [r["predicted_tps"] for r in group]
        calp = [after[r["id"]] for r in group]
        sweeps.append({"source_id": src, "hw": group[0]["hw"], "host": group[0]["host"],
                       "ids": [r["id"] for r in group], "measured_best": group[best]["id"],
                       "spearman_uncalibrated": _spearman(uncal, measured),
                       "spearman_calibrated": _spearman(calp, measured),
                       "best_uncalibrated": group[max(range(len(group)), key=lambda i: uncal[i])]["id"] == group[best]["id"],
                       "best_calibrated": group[max(range(len(group)), key=lambda i: calp[i])]["id"] == group[best]["id"]})
    if progress and groups:
        progress(len(groups), len(groups))  # the last group is done too

    def share(key: str) -> float | None:
        return sum(s[key] for s in sweeps) / len(sweeps) if sweeps else None

    def median(key: str) -> float | None:
        vals = sorted(s[key] for s in sweeps if s[key] is not None)
        return vals[len(vals) // 2] if vals else None

    within = sum(j["within_15"] for j in judged) / len(judged) if judged else None
    return {"calibrated": {"rows": judged, "entries": len(judged), "sources": len({j["source_id"] for j in judged}),
                           "within_15": within, "target": CALIBRATED_TARGET,
                           "uncalibrated_within_15": (sum(abs(j["uncalibrated_tps"] / j["measured_tps"] - 1) <= 0.15
                                                          for j in judged) / len(judged)) if judged else None,
                           "meets_target": within is not None and within >= CALIBRATED_TARGET},
            "ordering": {"sweeps": sweeps, "n": len(sweeps), "best_uncalibrated": share("best_uncalibrated"),
                         "best_calibrated": share("best_calibrated"), "target": BEST_TARGET,
                         "median_spearman_uncalibrated": median("spearman_uncalibrated"),
                         "median_spearman_calibrated": median("spearman_calibrated")}}


# --------------------------------------------------------------------------------------
# The round trip as users take it: a source's first row printed as its engine prints it,
# read back and calibrated through `moesim fit --measured`'s path, the others predicted
# --------------------------------------------------------------------------------------

#: The settings a plain CSV row carries (moesim option names, :func:`moesim.measured.read_plain_csv`).
PLAIN_COLUMNS = ("model", "hw", "host", "engine", "policy", "cpu_layers", "gpu_layers", "threads", "prompt_len",
                 "batch", "expert_dtype", "test", "n_gen", "tokens_per_s")


def printed(e: Entry, host_file: str | None) -> tuple[str, str]:
    """``e``'s measurement as its engine prints it: (file name, text), llama-bench's markdown for
    llama.cpp and ik_llama.cpp (the model description with its file type, size and parameter
    count, backend, -ngl, --n-cpu-moe, threads, test at its depth), the plain CSV otherwise;
    threads as llama-bench prints them (the host's cores where the source gave none). ``host_file``:
    the host profile the user names with ``--host`` (the plain CSV's host column)."""
    from moesim.measured import MeasuredRow, llama_bench_md
    from moesim.quant_recipes import printed_name
    from moesim.sim.published import _host

    s = e.setting
    spec = setting_spec(s)
    threads = s.get("threads") or (_host(s).cores * _host(s).sockets if s.get("host") else None)  # as printed
    ftype = printed_name(s["quant"]) if s.get("quant") else printed_name(spec.expert_dtype)
    tps = float(e.measurement["decode_tps"])
    if s["engine"] in ("llama.cpp", "ik_llama.cpp") and ftype and s["policy"] in ("all-resident", "cpu-static",
                                                                                   "gpu-layers") \
            and not any(k in s for k in PLACEMENT_COLUMNS):
        cpu = s.get("cpu_layers", 0)
        row = MeasuredRow(
            where="", engine=s["engine"], test="decode", tokens_per_s=tps, n_gen=int(s.get("gen", 128)),
            depth=int(s.get("context", 0)), model_type=f"{s['model']} {ftype}",
            model_bytes=spec.non_expert_bytes + spec.all_expert_bytes, model_params=spec.total_params,
            threads=threads, backend="CPU" if s["hw"] == "none" else "CUDA",
            n_gpu_layers=0 if s["hw"] == "none" else int(s.get("gpu_layers", 99)) if s["policy"] == "gpu-layers"
            else 99, n_cpu_moe=spec.n_moe_layers if cpu == "all" else int(cpu or 0))
        return "llama-bench.md", llama_bench_md([row])
    values = {"model": s["model"], "hw": s["hw"], "host": host_file or "", "engine": s["engine"],
              "policy": s["policy"], "cpu_layers": s.get("cpu_layers", ""), "gpu_layers": s.get("gpu_layers", ""),
              "threads": s.get("threads", ""), "prompt_len": s.get("context", 0), "batch": s.get("batch", 1),
              "expert_dtype": s.get("quant", ""), "test": "decode", "n_gen": s.get("gen", 128),
              "tokens_per_s": f"{tps:.6g}"}
    columns = PLAIN_COLUMNS + tuple(k for k in PLACEMENT_COLUMNS if k in s)
    values.update({k: int(s[k]) if isinstance(s[k], bool) else s[k] for k in PLACEMENT_COLUMNS if k in s})
    return "runs.csv", ",".join(columns) + "\n" + ",".join(str(values[c]) for c in columns) + "\n"


def round_trip(rows: Sequence[dict[str, Any]], folder, progress: Callable[[int, int], None] | None = None
               ) -> dict[str, Any]:
    """For each source with at least :data:`MIN_CALIBRATED` entries on one machine: its first
    entry printed as its engine prints it (:func:`printed`) into ``folder``, with the engine
    profile fitted without that source and the host the entry ran on as the files a user
    names; read back and calibrated as ``moesim fit --measured`` does (:func:`calibrate`,
    :func:`verdict`: a fit that does not explain its row is not written, and the source's
    other entries keep the uncalibrated prediction); the others predicted with the profile it
    wrote. ``rows``: the leave-one-source-out rows (their ``predicted_tps`` is the "before")."""
    from pathlib import Path

    from moesim.atomic import atomic_write_text
    from moesim.engines import load_engine
    from moesim.measured import read_measured
    from moesim.sim.engine_fit import fit
    from moesim.sim.published import _host
    from moesim.sim.published import entries as all_entries

    folder = Path(folder)
    by_id = {e.id: e for e in all_entries()}
    groups = [g for g in machine_groups(rows) if len(g) >= MIN_CALIBRATED]
    judged, sources = [], []
    for done, group in enumerate(groups):
        if progress:
            progress(done, len(groups))
        src, first = group[0]["source_id"], by_id[group[0]["id"]]
        name = first.setting["engine"]
        here = folder / f"source-{done + 1}"
        here.mkdir(parents=True, exist_ok=True)
        base = fit(tuple(e for e in all_entries() if e.source != src), {name})[name].engine
        engine_file, host_file = here / "shipped-engine.toml", None
        atomic_write_text(engine_file, base.to_toml())
        if first.setting.get("host"):
            host_file = here / "host.toml"
            atomic_write_text(host_file, _host(first.setting).to_toml())
        text = printed(first, str(host_file) if host_file else None)
        status, doubt, figures, engine = "not printable", None, {}, base
        if text is not None:
            path = here / text[0]
            atomic_write_text(path, text[1])
            given = Given(first.setting["hw"], str(host_file) if host_file else None, str(engine_file),
                          first.setting["model"])
            try:
                cal = calibrate(read_measured(path), given, path.name)
            except MoesimError as err:
                status, doubt = "refused", str(err)
            else:
                doubt = verdict(cal)
                status, figures = ("not written" if doubt else "written"), cal.figures
                if not doubt:
                    written = here / "engine.toml"
                    atomic_write_text(written, cal.engine.to_toml())
                    engine = load_engine(written)
        before, after = [], []
        for r in group[1:]:
            e = by_id[r["id"]]
            tps = float(predict(e, {name: engine})["predicted_tps"]) if e.setting["engine"] == name \
                else r["predicted_tps"]
            ln = math.log(tps / r["measured_tps"])
            before.append(abs(math.log(r["predicted_tps"] / r["measured_tps"])))
            after.append(abs(ln))
            judged.append({"id": r["id"], "source_id": src, "kind": r["kind"], "engine": r["engine"],
                           "calibrated_on": first.id, "status": status, "measured_tps": r["measured_tps"],
                           "uncalibrated_tps": r["predicted_tps"], "calibrated_tps": tps, "ln_error": ln,
                           "within_15": abs(math.expm1(ln)) <= CALIBRATED_WITHIN})
        sources.append({"source_id": src, "calibrated_on": first.id, "format": text[0] if text else "-",
                        "status": status, "why": doubt, "fitted": figures, "rows": len(group) - 1,
                        "median_abs_ln_before": float(np.median(before)), "median_abs_ln_after": float(np.median(after)),
                        "worse": float(np.median(after)) > float(np.median(before)) + 1e-9})
    if progress and groups:
        progress(len(groups), len(groups))
    within = sum(j["within_15"] for j in judged) / len(judged) if judged else None
    return {"rows": judged, "sources": sources, "entries": len(judged), "within_15": within,
            "uncalibrated_within_15": (sum(abs(j["uncalibrated_tps"] / j["measured_tps"] - 1) <= CALIBRATED_WITHIN
                                           for j in judged) / len(judged)) if judged else None,
            "target": CALIBRATED_TARGET, "worse_sources": sum(s["worse"] for s in sources),
            "meets_target": within is not None and within >= CALIBRATED_TARGET
            and not any(s["worse"] for s in sources)}
