"""Published measurements of real engines, and what moesim predicts for each.

``hwprofiles/published/measurements.toml`` holds batch-1 decode speeds that other people
measured with llama.cpp, ik_llama.cpp, KTransformers, vLLM, MoE-Infinity and
mixtral-offloading (engine, model, quantisation, hardware, placement, context, the quoted
text and where it is); ``settings.toml`` expresses each one with moesim's own options and
says what it had to assume. :func:`run_published` predicts every entry through the same
path ``moesim replay`` takes (:func:`moesim.sim.static.simulate_static` for static layouts,
:func:`moesim.sim.simulate.simulate` for the copy policies) on a **synthetic** trace of the
model, and :func:`summarise` scores the rows overall, per deployment kind and per engine.
The claim is leave-one-source-out (:mod:`moesim.sim.engine_fit`): each entry predicted with
engine figures fitted without any measurement of its own source.
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import numpy as np

from moesim.engines import EngineProfile, get_engine
from moesim.errors import MoesimError
from moesim.hardware import get_host, get_machine
from moesim.memory import WORKSPACE_BYTES, device_bytes
from moesim.models import DTYPES, ModelSpec, get_model
from moesim.policy import get_policy
from moesim.policy.placement import hot_per_layer, routing_counts, uniform_per_layer
from moesim.quant_recipes import RECIPES, apply_recipe, canonical
from moesim.setting import Setting
from moesim.sim import targets
from moesim.sim.simulate import simulate
from moesim.sim.static import simulate_static
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

#: Decode steps of each entry's synthetic trace (its routing only shapes the hot-expert
#: placements and caches; the rest of a static layout's step is the same every token).
TOKENS = 8
WITHIN = targets.WITHIN
#: Deployment kind by the measurement's ``category`` (hwprofiles/published/README.md); any
#: entry on several GPUs is ``multi-GPU``.
KINDS = {"all-gpu": "all-GPU", "hybrid-cpu-experts": "experts on the CPU", "hybrid-hot-experts": "experts on the CPU",
         "hybrid-gpu-expert-cache": "experts on the CPU", "cpu-compute-on-miss": "experts on the CPU",
         "hybrid-layer-split": "layer split", "all-cpu": "all-CPU", "all-cpu-weights": "all-CPU",
         "gpu-copy-offload": "copy offload"}


def source_id(measurement: dict[str, Any]) -> str:
    """The source a measurement was published in: one issue or PR thread (``owner/repo#N``),
    one article or tutorial page (its address, without the note after it or a fragment)."""
    text = measurement["source_url"].split(" (")[0].split(";")[0].strip()
    if "://" in text:
        text = text.split("#")[0].rstrip("/")
    return text


@dataclass(frozen=True)
class Entry:
    """One measurement and the moesim setting that expresses it."""

    measurement: dict[str, Any]
    setting: dict[str, Any]

    @property
    def id(self) -> str:
        return self.setting["id"]

    @property
    def source(self) -> str:
        return source_id(self.measurement)

    @property
    def kind(self) -> str:
        """The deployment kind the headline figure is broken down by (:data:`KINDS`)."""
        if self.measurement.get("multi_gpu") or len(self.measurement.get("moesim_gpu") or ()) > 1:
            return "multi-GPU"
        return KINDS.get(self.measurement.get("category", ""), "other")


def _read(name: str) -> dict[str, Any]:
    path = resources.files("moesim.hwprofiles").joinpath("published", name)
    return tomllib.loads(path.read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def entries() -> tuple[Entry, ...]:
    """Every expressed measurement, in the settings file's order (ids checked against the
    measurements)."""
    measured = {m["id"]: m for m in _read("measurements.toml")["measurement"]}
    out = []
    for s in _read("settings.toml")["setting"]:
        if s["id"] not in measured:
            raise MoesimError(f"published settings: {s['id']!r} is no measurement of measurements.toml")
        out.append(Entry(measured[s["id"]], s))
    return tuple(out)


def excluded() -> dict[str, str]:
    """Measurements not expressed, with the reason."""
    return dict(_read("settings.toml").get("excluded", {}))


def setting_spec(s: dict[str, Any]) -> ModelSpec:
    """The model a setting predicts, in its format (a llama.cpp file type's recipe applied)."""
    return _spec_of(s["model"], s.get("quant"), s["id"])


@functools.lru_cache(maxsize=256)
def _spec_of(model: str, q: str | None, sid: str) -> ModelSpec:
    """The setting's model in its format (memoised: a fit predicts each entry thousands of
    times, and :func:`_trace`'s memo is keyed by the spec)."""
    spec = get_model(model)
    if q is None:
        return spec
    key = canonical(q)
    if key in RECIPES:
        return apply_recipe(spec, key)
    if key in DTYPES:
        return spec.with_expert_dtype(key)
    raise MoesimError(f"{sid}: unknown quant {q!r} (a llama.cpp file type or a weight format of "
                      "`moesim models --help`)")


def _host(s: dict[str, Any]):
    if "host" not in s:
        return None
    h = get_host(s["host"])
    src = f"published measurement {s['id']}"
    if "sockets" in s:
        h = h.with_figure("sockets", s["sockets"], "measured", src)
    if "ram_gb" in s:
        h = h.with_figure("ram_gb", s["ram_gb"], "measured", src)
    if "host_mem_bw_gbs" in s:
        bw = float(s["host_mem_bw_gbs"])
        if bw > h["mem_bw_peak_gbs"]:
            h = h.with_figure("mem_bw_peak_gbs", bw, "measured", src)
        h = h.with_figure("mem_bw_achievable_gbs", bw, "measured", src)
    return h


@functools.lru_cache(maxsize=64)
def _trace(spec: ModelSpec, context: int, tokens: int, draw_seed: int | None, batch: int = 1):
    """The entry's **synthetic** trace (memoised: a fit predicts each entry many times)."""
    return synthetic_trace(spec, SyntheticParams(tokens=tokens, batch=batch, prompt_len=context, seed=0,
                                                 draw_seed=draw_seed))


def predict(entry: Entry, engines: dict[str, EngineProfile] | None = None) -> dict[str, Any]:
    """The decode speed moesim predicts for ``entry`` (``engines`` replaces engine profiles
    by name: a fit tries its candidate figures this way)."""
    s = entry.setting
    spec = setting_spec(s)
    # The engine as a build from the measurement's date ran it (its [[before]] changes).
    engine = ((engines or {}).get(s["engine"]) or get_engine(s["engine"])).at(entry.measurement.get("date"))
    context = int(s.get("context", 1000)) + int(s.get("gen", 0)) // 2
    trace = _trace(spec, context, TOKENS, None, int(s.get("batch", 1)))  # batch: sequences decoded at once
    machine = get_machine(s["hw"])
    host = _host(s)
    pol = get_policy(s["policy"])
    setting = Setting(host=host, engine=engine, threads=s.get("threads"))
    if pol.uses_host or machine.n_gpus != 1:
        placement = None
        if "gpu_experts_per_layer" in s:  # KTransformers' GPU experts a layer, placed as the engine places them
            n = int(s["gpu_experts_per_layer"])
            if s.get("placement", engine.expert_placement) == "uniform":
                placement = uniform_per_layer(spec, n)
            else:  # by frequency: the most routed experts of a calibration twin
                twin = _trace(spec, context, 64, 1)
                placement = hot_per_layer(routing_counts(twin.true_ids, spec.n_experts), spec, n,
                                          "a calibration twin of the trace", False)
        cpu_layers = spec.n_moe_layers if s.get("cpu_layers") == "all" else s.get("cpu_layers", "auto")
        res = simulate_static(trace, machine, pol, replace(setting, cpu_layers=cpu_layers,
                                                           gpu_layers=s.get("gpu_layers", "auto")),
                              placement=placement, ttft=False)
    else:
        hw = machine.gpus[0]
        cache = s.get("cache_experts", 0)
        if s.get("cache_gib") == "fill":  # the device memory an engine leaves for its expert cache
            free = 0.75 * hw["device_memory_gb"] * 1e9 - device_bytes(spec, pol, context=context) + WORKSPACE_BYTES
            cache = max(0, int(free // spec.expert_bytes))
        res = simulate(trace, hw, pol, replace(setting, cache_experts=cache, eviction=s.get("eviction", "lru"),
                                               sim="fast", cache_per_layer=bool(s.get("cache_per_layer"))))
    tpot = float(res.tpot.mean())
    return {"predicted_tps": 1.0 / tpot, "result": res}


def run_published(engines: dict[str, EngineProfile] | None = None, which: list[Entry] | None = None
                  ) -> list[dict[str, Any]]:
    """One row per expressed measurement: source, kind, measured and predicted tokens/s."""
    rows = []
    for e in which if which is not None else entries():
        m, s = e.measurement, e.setting
        p = predict(e, engines)
        measured = float(m["decode_tps"])
        ratio = p["predicted_tps"] / measured
        rows.append({
            "id": e.id, "source_id": e.source, "kind": e.kind, "engine": s["engine"], "model": s["model"], "quant": s.get("quant", "-"),
            "hw": s["hw"], "host": s.get("host", "-"), "policy": s["policy"], "context": s.get("context", 1000),
            "measured_tps": measured, "predicted_tps": p["predicted_tps"], "ratio": ratio,
            "ln_error": math.log(ratio), "within_25": abs(ratio - 1) <= WITHIN,
            "source": m["source_url"], "category": m.get("category", "-"), "assumed": s.get("assumed", ""),
            "synthetic_trace": True,
        })
    return rows


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Entries, share within +-25%, median and worst |ln(predicted / measured)|, how many
    predictions are optimistic, and from how many sources."""
    ln = np.abs([r["ln_error"] for r in rows])
    return {"entries": len(rows), "sources": len({r["source_id"] for r in rows}),
            "within_25": float(np.mean([r["within_25"] for r in rows])), "median_abs_ln": float(np.median(ln)),
            "worst_abs_ln": float(ln.max()), "optimistic": int(sum(r["ratio"] > 1 for r in rows))}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`score` overall, per deployment kind and per engine, and whether the targets
    (:mod:`moesim.sim.targets`) are met: overall, and no kind or engine of
    :data:`~moesim.sim.targets.FLOOR_ENTRIES` or more entries under its floor."""
    def by(key: str) -> dict[str, dict[str, Any]]:
        return {k: score([r for r in rows if r[key] == k]) for k in sorted({r[key] for r in rows})}

    overall, kinds, engines = score(rows), by("kind"), by("engine")
    met = (overall["within_25"] >= targets.WITHIN_SHARE and overall["median_abs_ln"] <= targets.MEDIAN_ABS_LN
           and all(g["within_25"] >= targets.FLOOR_SHARE for g in (*kinds.values(), *engines.values())
                   if g["entries"] >= targets.FLOOR_ENTRIES))
    return {"overall": overall, "by_kind": kinds, "by_engine": engines, "meets_target": bool(met)}
