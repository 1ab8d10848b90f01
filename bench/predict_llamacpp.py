"""moesim's prediction for every llama-bench row that bench/bench_llamacpp.py measures.

Each row is one GGUF file, a thread count and a depth (llama-bench's ``-d``: tokens of context before the
``-n`` generated ones). moesim predicts it as the all-CPU deployment (``--hw none``, all-resident, every weight
in host memory and computed on the CPU) through the library path ``moesim replay`` / ``moesim validate
--published`` take (:func:`moesim.sim.static.simulate_static` on a **synthetic** trace):

- the model from the GGUF file itself (:func:`moesim.gguf_file.spec_from_gguf`: tensor types and bytes as
  written by the converter and llama-quantize);
- this machine's host profile as ``moesim profile --hardware`` measures it
  (:func:`moesim.executor.hwbench.measure_host`), measured in the same invocation as the llama-bench rows
  (right before and right after them) so that both see the same contention;
- the ``llama.cpp`` engine profile (hwprofiles/engines/llama.cpp.toml), unchanged;
- a synthetic trace of ``n_gen`` decode steps whose prompt length is the row's depth (1 for depth 0: a
  trace has at least one prompt token), ``threads`` = the row's threads.

Two host variants are predicted, both from figures measured in the same run; nothing is fitted:

- ``profile``: the host profile exactly as ``moesim profile --hardware`` writes it;
- ``profile_fp32``: the same profile with its compute rates (``bf16_tflops``; ``int8_tops`` = twice it, the
  profile's own rule) replaced by an fp32 GEMM timed exactly as measure_host times its bf16 GEMM.
  Why: measure_host times torch's bf16 GEMM, which on a CPU without AVX512-BF16 or AMX (this one has AVX2
  and FMA, no AVX512) runs a slow fallback ~50x below fp32, while llama.cpp's CPU backend never
  multiplies in bf16 there (bf16 weights are converted and multiplied in fp32; Q8_0/Q4_K use integer dot
  products on the activations quantised to 8 bits).

Optionally (``fit_split``) llama.cpp's ``cpu_weight_efficiency.default`` (one share of the bandwidth) and its
``cpu_kernel_gmacs`` per weight format (what one thread's kernels multiply-add a second) are **fitted** on a
named half of the rows (e.g. the 2-layer files) and the other half is reported with them; the fitted values
live only in this benchmark's output, never in the engine TOML.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from moesim.setting import Setting

ENGINE = "llama.cpp"
HOST_NAME = "this-machine-host"


def fp32_gemm_tflops(threads: int | None = None, n: int = 1024) -> float:
    """An fp32 GEMM n^3 on ``threads`` torch threads, timed as measure_host times its bf16 one (best of 5)."""
    import torch

    from moesim.timing import best_time

    old = torch.get_num_threads()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return 2 * n**3 / best_time(lambda: a @ b) / 1e12
    finally:
        torch.set_num_threads(old)


def measure_host_profile(out_dir: Path, tag: str) -> dict:
    """Measure this machine as ``moesim profile --hardware`` does (measure_host), write it as that command writes
    NAME-host.toml (``# description`` + to_toml) to ``out_dir/this-machine-host-<tag>.toml``, check it loads
    back, and time the fp32 GEMM beside it. Returns {"path", "when", "loadavg", "fp32_gemm_tflops", "figures"}."""
    import resource

    from moesim.executor.hwbench import measure_host
    from moesim.hardware import get_host

    out_dir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    t0 = time.time()
    busy0, ru0 = _cpu_busy_s(), resource.getrusage(resource.RUSAGE_SELF)
    host = measure_host(HOST_NAME)
    fp32 = fp32_gemm_tflops(int(host["cores"]))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    own = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    wall = time.time() - t0
    others = max(0.0, _cpu_busy_s() - busy0 - own) / (wall * (os.cpu_count() or 1))
    path = out_dir / f"{HOST_NAME}-{tag}.toml"
    path.write_text(f"# {host.description}\n" + host.to_toml())
    get_host(str(path))
    return {"path": str(path), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "seconds": round(wall, 1), "others_cpu_frac": round(others, 3), "loadavg": [round(x, 2) for x in (*load0, *os.getloadavg())],
            "fp32_gemm_tflops": round(fp32, 5),
            "figures": {k: f.value for k, f in host.figures.items()}}


def _cpu_busy_s() -> float:
    """Machine-wide busy CPU seconds so far (/proc/stat; 0.0 without it)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(f[:8]) - f[3] - (f[4] if len(f) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def host_variants(measured: dict) -> dict:
    """{"profile": the measured HostProfile, "profile_fp32": it with the fp32 GEMM as its compute rate}."""
    from moesim.hardware import get_host

    host = get_host(measured["path"])
    fp32 = measured["fp32_gemm_tflops"]
    src = (f"fp32 GEMM 1024^3 measured beside the host profile ({measured['when']}): llama.cpp's CPU kernels do not "
           "multiply in bf16 on a CPU without AVX512-BF16")
    fp = host.with_figure("bf16_tflops", fp32, "measured", src).with_figure("int8_tops", 2 * fp32, "measured",
                                                                           "twice the fp32 rate (measure_host's rule)")
    return {"profile": host, "profile_fp32": fp}


@functools.lru_cache(maxsize=16)
def _spec(path: str):
    from moesim.gguf_file import spec_from_gguf

    return spec_from_gguf(path)


@functools.lru_cache(maxsize=64)
def _trace(path: str, depth: int, n_gen: int):
    """The row's **synthetic** trace: n_gen decode steps after a prompt of `depth` tokens (at least 1)."""
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    return synthetic_trace(_spec(path), SyntheticParams(tokens=n_gen, prompt_len=max(depth, 1), seed=0))


def predict_tps(path: str | Path, threads: int, depth: int, n_gen: int, host, engine=ENGINE) -> float:
    """Decode tokens/s moesim predicts for llama-bench's `-m path -t threads -d depth -n n_gen` on `host`:
    the all-CPU deployment (machine ``none``, all-resident) through simulate_static."""
    from moesim.sim.static import simulate_static

    res = simulate_static(_trace(str(path), depth, n_gen), "none", "all-resident", Setting(host=host, engine=engine, threads=threads))
    return 1.0 / float(res.tpot.mean())


def whatif_tps(path: str | Path, threads: int, depth: int, n_gen: int, host_path: str) -> float:
    """The same prediction through `moesim whatif`'s own library call (moesim.sim.whatif.whatif: --model FILE --hw
    none --policy all-resident --host HOST --engine llama.cpp --threads T --prompt-len D --tokens n_gen): a check
    that predict_tps() takes the CLI's path."""
    from moesim.sim.whatif import WhatifOptions, whatif

    res = whatif(WhatifOptions(None, [str(path)], ["none"], ["all-resident"], None, [0], tokens=n_gen, prompt_len=[max(depth, 1)],
                 jobs=1, hosts=[host_path], engine=ENGINE, threads=threads))
    (row,) = res.rows
    return 1e3 / row["tpot_ms"]


def breakdown(path: str | Path, threads: int, depth: int, host, engine=ENGINE) -> dict:
    """Per-token milliseconds of the predicted step by piece (the cost model's own figures): the routed
    experts' weight reads and math (top_k experts a layer), their per-expert dispatch, attention blocks, head."""
    from moesim.costmodel import CostModel

    spec = _spec(str(path))
    cm = CostModel(spec, None, host, engine=engine, threads=threads)
    t = cm.expert_times(1)
    k, m = spec.top_k, spec.n_moe_layers
    attn = sum(float(cm.attention(layer, max(depth, 1), on="cpu")) for layer in range(spec.n_layers))
    return {"experts_mem_ms": round(k * m * t.cpu_mem * 1e3, 3), "experts_math_ms": round(k * m * t.cpu_tok * 1e3, 3),
            "experts_dispatch_ms": round(k * m * t.cpu_fixed * 1e3, 3), "attention_ms": round(attn * 1e3, 3),
            "head_ms": round(cm.head(1, on="cpu") * 1e3, 3)}


def _ratio_stats(ratios: Iterable[float]) -> dict:
    r = [x for x in ratios if x and math.isfinite(x)]
    if not r:
        return {"n": 0}
    return {"n": len(r), "within_15": sum(abs(x - 1) <= 0.15 for x in r),
            "median_ratio": round(statistics.median(r), 3),
            "median_abs_ln": round(statistics.median(abs(math.log(x)) for x in r), 3),
            "worst_ratio": round(max(r, key=lambda x: abs(math.log(x))), 3)}


#: What the fitted variant fits: one bandwidth share for every format, and the G multiply-adds a second one
#: thread of llama.cpp's CPU kernels reaches per weight format (bf16 is also the KV cache's: attention over the
#: context runs at it). Bounds: a share of the measured bandwidth; 0.1-200 GMAC/s a thread.
EFFICIENCY_KEY, RATE_TABLE = "cpu_weight_efficiency.default", "cpu_kernel_gmacs"


def fit_cpu_kernels(rows: Sequence[dict], host, n_gen: int, fit_layers: int, clean_only: bool = True) -> dict:
    """**Fitted**: llama.cpp's ``cpu_weight_efficiency.default`` and its ``cpu_kernel_gmacs`` for each weight
    format of the fit half (rows of `fit_layers`-layer files; uncontended ones only unless clean_only=False),
    by least squares on ln(predicted / measured) (scipy.optimize.least_squares over the figures' logarithms).
    The thread counts and depths of the fit half are what separate the two: a row whose one thread cannot keep
    up with the memory speeds up with a second thread, a bandwidth-bound one does not. Returns {"value",
    "figures", "fit_rows", "engine", ...}; the engine TOML is not touched."""
    import numpy as np
    from scipy.optimize import least_squares

    from moesim.engines import get_engine

    base = get_engine(ENGINE)
    fit = [r for r in rows if r["layers"] == fit_layers and (not clean_only or not r["contended"])]
    if not fit:
        return {"value": None, "fit_rows": 0, "note": "no uncontended fit-half rows"}
    formats = sorted({_spec(r["path"]).expert_dtype for r in fit} | {_spec(r["path"]).dense_dtype for r in fit}
                     | {"bf16"})
    keys = [EFFICIENCY_KEY, *(f"{RATE_TABLE}.{f}" for f in formats)]
    lo = np.log([0.05] + [0.1] * len(formats))
    hi = np.log([1.0] + [200.0] * len(formats))

    def engine(x, kind: str = "fitted", source: str = "bench"):
        eng = base
        for key, v in zip(keys, np.exp(x)):
            eng = eng.with_figure(key, float(v), kind, source)
        return eng

    def residuals(x):
        eng = engine(x)
        return [math.log(predict_tps(r["path"], r["threads"], r["depth"], n_gen, host, eng) / r["measured_tok_s"])
                for r in fit]

    x0 = np.log([0.8] + [5.0] * len(formats))
    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale=1.0, diff_step=1e-3)
    values = {k: round(float(v), 4) for k, v in zip(keys, np.exp(sol.x))}
    src = (f"fitted by bench/predict_llamacpp.py on the {fit_layers}-layer rows of bench/llamacpp.json "
           f"({len(fit)} rows{', uncontended' if clean_only else ''}; 1 and 2 threads, both depths): least squares "
           "on ln(predicted / measured)")
    return {"value": values[EFFICIENCY_KEY], "figures": values, "fit_rows": len(fit), "fit_layers": fit_layers,
            "engine": engine(sol.x, "fitted", src), "source": src,
            "fit_rms_ln": round(float(np.sqrt(np.mean(np.square(sol.fun)))), 4)}


def predict_rows(rows: Sequence[dict], hosts: dict, n_gen: int, fit_layers: int | None = None) -> dict:
    """Add predictions to measured rows (each with path, threads, depth, layers, measured_tok_s, contended).

    hosts: {"before": measured-host dict, "after": ...} (measure_host_profile). The rows are measured when the
    machine has room for their threads (bench_llamacpp.measure waits for it), so the prediction uses the
    bracketing profile measured with the least CPU use by other processes ("used"; before when equal or
    unrecorded), and the other one gives the spread (the *_other fields). Returns {"rows", "summary", "fit",
    "host_used"}."""
    order = [k for k in ("before", "after") if hosts.get(k)]
    order.sort(key=lambda k: hosts[k].get("others_cpu_frac", 1.0))  # stable: before wins a tie
    before = host_variants(hosts[order[0]])
    after = host_variants(hosts[order[1]]) if len(order) > 1 else None
    used = order[0]
    fit = None
    if fit_layers is not None:
        fit = fit_cpu_kernels(rows, before["profile_fp32"], n_gen, fit_layers)
    out = []
    for r in rows:
        p = {k: predict_tps(r["path"], r["threads"], r["depth"], n_gen, h) for k, h in before.items()}
        row = {**r, "predicted_tok_s": round(p["profile"], 2), "ratio": round(p["profile"] / r["measured_tok_s"], 3),
               "predicted_tok_s_fp32": round(p["profile_fp32"], 2),
               "ratio_fp32": round(p["profile_fp32"] / r["measured_tok_s"], 3)}
        if after is not None:
            row["predicted_tok_s_other"] = round(predict_tps(r["path"], r["threads"], r["depth"], n_gen,
                                                             after["profile"]), 2)
            row["predicted_tok_s_fp32_other"] = round(predict_tps(r["path"], r["threads"], r["depth"], n_gen,
                                                                  after["profile_fp32"]), 2)
        row["whatif_tok_s"] = round(whatif_tps(r["path"], r["threads"], r["depth"], n_gen, hosts[used]["path"]), 2)
        row["breakdown_ms"] = breakdown(r["path"], r["threads"], r["depth"], before["profile"])
        row["breakdown_ms_fp32"] = breakdown(r["path"], r["threads"], r["depth"], before["profile_fp32"])
        if fit and fit.get("engine") is not None:
            pf = predict_tps(r["path"], r["threads"], r["depth"], n_gen, before["profile_fp32"], fit["engine"])
            row["predicted_tok_s_fitted"] = round(pf, 2)
            row["ratio_fitted"] = round(pf / r["measured_tok_s"], 3)
            row["split"] = "fit" if r["layers"] == fit["fit_layers"] else "holdout"
        out.append(row)

    def stats(key: str, sel=lambda r: True) -> dict:
        return {"all": _ratio_stats(r[key] for r in out if sel(r)),
                "uncontended": _ratio_stats(r[key] for r in out if sel(r) and not r["contended"])}

    summary = {"profile": stats("ratio"), "profile_fp32": stats("ratio_fp32"),
               "whatif_agrees": all(abs(r["whatif_tok_s"] / r["predicted_tok_s"] - 1) < 0.005 for r in out)}
    if fit and fit.get("engine") is not None:
        summary["fitted_holdout"] = stats("ratio_fitted", lambda r: r["split"] == "holdout")
        summary["fitted_fit"] = stats("ratio_fitted", lambda r: r["split"] == "fit")
    fit_out = None if fit is None else {k: v for k, v in fit.items() if k != "engine"}
    return {"rows": out, "summary": summary, "fit": fit_out, "host_used": used}
