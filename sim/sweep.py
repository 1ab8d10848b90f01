"""What-if sweeps: the cross product of models, hardware, policies, link bandwidths and
cache sizes, timed on one trace per model, on every core or on a Ray cluster.

Work is grouped by (model, policy, cache): a group builds its plan once (the expensive,
hardware-independent part) and times it on every hardware profile and link bandwidth,
all links of a profile in one compiled call (:func:`moesim.sim.fastpath.run_fast_many`).
Groups are the unit of parallel work, of streaming and of resuming:

- ``backend="local"``: a process pool on this machine's cores (traces reach each worker
  once, with the pool's initializer); ``backend="ray"``: tasks on a Ray cluster (traces
  put in the object store once). Both run the same groups, so rows are identical.
- ``out=path.csv``: each finished group's rows are appended to the CSV and flushed, so
  memory holds the rows once and an interrupted sweep keeps what it finished; run the
  same sweep with the same ``out`` again and it skips the finished groups.
- A failing group does not stop the others: :class:`SweepError` names each failed
  configuration group and why, and carries the finished rows.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moesim.atomic import exclusive
from moesim.costmodel import CostModels, Residence
from moesim.engines import EngineProfile, get_engine
from moesim.errors import DoesNotFit, MoesimError
from moesim.hardware import HardwareProfile, HostProfile, Machine, get_host, get_machine
from moesim.layout import SPLITS, check_ratios
from moesim.models import DTYPES
from moesim.policy import POLICIES, QUEUES, Planner, Policy, as_policy, get_policy
from moesim.policy.placement import expert_budget, hot_set, routing_counts, uniform_set
from moesim.quant_recipes import is_format, store_as
from moesim.setting import DEFAULT_SETTING, HostKnobs, Setting
from moesim.sim.cpu_compute import simulate_cpu_compute
from moesim.sim.fastpath import run_fast_many
from moesim.sim.intervals import RANGE_COLUMNS, with_range
from moesim.sim.plan import build_plan
from moesim.sim.pool import run_pool, start_aside, stop_pool, worker_ignores_stops  # noqa: F401 (stop_pool: the sweep's API)
from moesim.sim.prefetch_top import keep_top_predictions
from moesim.sim.quantised import with_expert_dtype
from moesim.sim.simulate import PerTrace, pick_costs, prediction_recall, time_plan
from moesim.sim.static import simulate_static
from moesim.sim.sweep_rows import parse, resume, write_rows
from moesim.sim.workload import Link, Workload
from moesim.traces.format import Trace

GOALS = {
    "tpot": ("tpot_ms", "lowest mean time per output token"),
    "p99": ("tpot_p99_ms", "lowest p99 time per output token"),
    "ttft": ("ttft_ms", "lowest time to first token"),
    "bytes": ("gb_moved_per_token", "fewest bytes over the host link per token"),
}
BACKENDS = ("local", "ray")
RAY_HINT = 'pip install "moesim[distributed]"'

@dataclass(frozen=True)
class Config:
    """One configuration group: everything but the hardware profile and the link bandwidth
    (those are the group's rows). Fields a policy ignores hold their neutral value."""

    trace: str  # key into Sweep.traces (a model at one batch size and prompt length)
    policy: str
    cache_gib: float = 0.0
    expert_dtype: str | None = None  # None: the model's own format
    host: str | None = None  # CPU policies; None: each GPU profile's own host
    cpu_layers: int | str = "-"  # cpu-static: a count or "auto"
    gpu_expert_gib: float | str = "-"  # hot-experts: GiB of experts kept on the device, or "auto" (all that fit)
    copy_queue: str = "fifo"
    prefetch_top: int | None = None
    gpu_layers: int | str = "-"  # gpu-layers: a count of model layers on the GPU(s), or "auto" (all that fit)
    offload_gib: float | str = "-"  # weight-streaming: GB of weights read over the link, or "auto" (the least that fits)

    def describe(self) -> str:
        parts = [f"trace {self.trace}", f"policy {self.policy}", f"cache {self.cache_gib:g} GiB"]
        for name, value, neutral in (("expert dtype", self.expert_dtype, None), ("host", self.host, None),
                                     ("cpu layers", self.cpu_layers, "-"), ("GPU expert GiB", self.gpu_expert_gib, "-"),
                                     ("copy queue", self.copy_queue, "fifo"), ("prefetch top", self.prefetch_top, None),
                                     ("gpu layers", self.gpu_layers, "-"), ("offload GB", self.offload_gib, "-")):
            if value != neutral:
                parts.append(f"{name} {value}")
        return ", ".join(parts)


Group = Config

#: Every row carries these columns, in this order (policy families report different
#: figures; a streamed CSV needs one header). A column a policy has no figure for holds
#: ``None`` (numbers, NaN too; an empty CSV cell, JSON null) or ``-`` (words).
ROW_COLUMNS = (
    "model", "base_model", "expert_dtype", "hw", "host", "policy", "family", "link_gbps", "cache_gib", "cache_experts",
    "eviction", "cpu_layers", "gpu_layers", "offload_gib", "gpu_expert_gib", "resident_experts", "copy_queue", "prefetch_top",
    "split", "tensor_split", "lookahead", "batch", "prompt_len", "engine", "threads", "sim", "timing", "synthetic_trace", "placement", "optimistic_placement", "tokens", "tpot_ms",
    "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "tokens_per_s", *RANGE_COLUMNS, "compute_ms", "copy_ms", "stall_ms", "cpu_ms",
    "cpu_wait_ms", "overlap_ms", "serial_bound_ms", "overlap_bound_ms", "max_prefetch_gain",
    "experts_loaded_per_token", "gb_moved_per_token", "cache_hit_rate", "prefetch_hit_rate", "pred_recall",
    "cpu_expert_share", "device_hit_rate", "ttft_ms", "device_gb_needed", "host_gb_needed", "page_miss", "fits", "bound",
    "note", "group",
)
_WORDS = {"model", "base_model", "expert_dtype", "hw", "host", "policy", "family", "eviction", "copy_queue", "engine",
          "sim", "timing", "placement", "bound", "note", "cpu_layers", "gpu_layers", "offload_gib", "gpu_expert_gib",
          "prefetch_top", "split", "tensor_split", "range_basis"}


def policy_family(policy: str | Policy) -> str:
    """The deployment family a policy belongs to (docs/policies.md): the copy policies are
    one family, ``prefetching``, with the oracle as its bound; each CPU policy and
    all-resident are their own."""
    return as_policy(policy).family


BOUND = "oracle (bound)"


def policy_families() -> tuple[str, ...]:
    """Every registered family but the oracle's bound, simplest first (keyed by the registry's
    policies, so a policy registered later joins the deployment answer)."""
    return _families(tuple(POLICIES.values()))


@functools.lru_cache(maxsize=8)
def _families(pols: tuple) -> tuple[str, ...]:
    """:func:`policy_families` of the registry ``pols`` (once each: the deployment answer asks
    for it per scenario and family, hundreds of times a sweep)."""
    family = {p.name: policy_family(p) for p in pols}
    fams = dict.fromkeys(family[p.name] for p in pols if family[p.name] != BOUND)
    return tuple(sorted(fams, key=lambda f: min(p.rank for p in pols if family[p.name] == f)))


def simplicity(fam: str) -> int:
    """Where ``fam`` stands in :func:`families` (simplest first); an unknown family last."""
    fams = policy_families()
    return fams.index(fam) if fam in fams else len(fams)


#: The bound of a row that did not run: the policy cannot run on the machine (its note says why).
NOT_RUN = "not run"


def bound_of(row: dict[str, Any]) -> str:
    """What bounds a configuration: :data:`NOT_RUN` when it cannot run on the machine (a copy
    policy without one GPU), ``memory`` when it does not fit in device memory, else
    the resource busiest per token: the ``link`` (expert copies), ``GPU compute`` (the
    device stream's own work) or ``CPU compute`` (experts run on the host)."""
    if not row["fits"]:
        return NOT_RUN if row.get("bound") == NOT_RUN else "memory"
    busy = {"link": row["copy_ms"], "GPU compute": row["compute_ms"], "CPU compute": row.get("cpu_ms") or 0.0}
    return max(busy, key=lambda k: busy[k])


def normalise(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with exactly :data:`ROW_COLUMNS`, missing figures filled (see there)."""
    def cell(c: str) -> Any:
        v = row.get(c)
        if v is None or (isinstance(v, float) and v != v):  # NaN (no prediction): None, equal to itself
            return "-" if c in _WORDS else None
        return v

    return {c: cell(c) for c in ROW_COLUMNS}


def resolve_host(table: dict[str, HostProfile], name: str | None, gpu: HardwareProfile | None = None) -> HostProfile:
    """:func:`moesim.hardware.get_host` of ``name`` (None: ``gpu``'s own host), kept in ``table``
    by the name it resolves, so a sweep resolves each host once."""
    key = name or (gpu.host if gpu is not None else None)
    if not key:
        return get_host(name, gpu)  # its one line: no host named or given by the GPU
    if key not in table:
        table[key] = get_host(name, gpu)
    return table[key]


#: Sweep fields the resume fingerprint takes by content rather than by value: the traces and the
#: calibration routing (hashed array by array), the policies as resolved (their names are in
#: ``policies``), the host profiles as resolved (each by its whole profile). Every other field
#: enters :meth:`Sweep.fingerprint` as it is.
_BY_CONTENT = frozenset({"traces", "calibration", "resolved", "host_profiles"})


@dataclass(frozen=True)
class Sweep(HostKnobs):  # its host knobs (threads, AMX) go to every group's Setting as they are
    traces: dict[str, Trace]  # trace key -> trace (a model at one batch size and prompt length)
    hws: list[HardwareProfile | Machine]  # machines (one GPU, several, or none: moesim.hardware.get_machine)
    policies: list[str]
    link_gbps: list[float | None]  # None = the profile's own figure
    cache_gib: list[float]
    eviction: str = "lru"
    sim: str = "fast"
    timing: str = "auto"
    expert_dtypes: tuple[str | None, ...] = (None,)  # None = the model's own format
    hosts: tuple[str | None, ...] = (None,)  # CPU policies; None = each GPU profile's own host
    cpu_layers: tuple[int | str, ...] = ("auto",)  # cpu-static
    gpu_expert_gib: tuple[float | str, ...] = ("auto",)  # hot-experts
    copy_queues: tuple[str, ...] = ("fifo",)  # prefetching policies
    prefetch_top: tuple[int | None, ...] = (None,)  # prefetching policies (not the oracle)
    calibration: dict[str, Any] | None = None  # base model name -> [t, m, b, k] routing (hot-experts, cpu-on-miss)
    calibration_source: str = "-"  # said in every row that uses it
    calibrate_on_replay: bool = False  # hot-experts counts the replayed trace: rows marked optimistic
    engine: str | None = None  # the inference engine (moesim.engines); None: PyTorch eager
    engine_profile: EngineProfile | None = field(default=None, compare=False, repr=False)  # resolved: set once
    resolved: dict[str, Policy] = field(default_factory=dict, compare=False, repr=False)  # policy name -> Policy
    gpu_layers: tuple[int | str, ...] = ("auto",)  # gpu-layers
    offload_gib: tuple[float | str, ...] = ("auto",)  # weight-streaming
    host_ram_gb: float | None = None  # the host's RAM (None: the host profile's, if it gives one)
    cache_per_layer: bool = False  # each cache size is each MoE layer's (copy policies)
    split: str = "layer"  # several GPUs: whole layers per GPU (layer) or every layer over all (tensor)
    ratios: tuple[float, ...] | None = None  # several GPUs, layer split: each GPU's share (--tensor-split)
    #: Host profiles by name, each resolved once (:meth:`host_profile`; the caller's, or filled as asked).
    host_profiles: dict[str, HostProfile] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hws", [get_machine(h) for h in self.hws])  # rows name machines
        if self.sim not in ("simpy", "fast"):
            raise MoesimError(f"unknown simulator {self.sim!r}; known: simpy, fast")
        eng = self.engine_profile or get_engine(self.engine)  # an unknown engine: one line, before any work
        object.__setattr__(self, "engine_profile", eng)  # what every group's cost model is given, not the name
        if "cpu" not in eng.runs_on and (none := next((m for m in self.hws if m.n_gpus == 0), None)):
            raise MoesimError(f"--hw {none.name}: {eng.name} computes on GPUs only (its profile's runs_on); a machine "
                              "without a GPU cannot run it")
        if "gpu" not in eng.runs_on and (gpu := next((m for m in self.hws if m.n_gpus), None)):
            raise MoesimError(f"--hw {gpu.name}: {eng.name} computes on CPUs only (its profile's runs_on); give --hw none")
        if set(self.resolved) != set(self.policies):  # resolved by the caller already, or each name once here
            object.__setattr__(self, "resolved", {p: get_policy(p) for p in self.policies})
        if any(g is not None and g <= 0 for g in self.link_gbps):
            raise MoesimError("link bandwidths must be positive GB/s")
        if any(c < 0 for c in self.cache_gib):
            raise MoesimError("cache sizes must be >= 0 GiB")
        for d in self.expert_dtypes:
            if d is not None and not is_format(d):
                raise MoesimError(f"unknown expert dtype {d!r}; known: {', '.join(DTYPES)}, or a llama.cpp file type "
                                  "(q4_k_m, q8_0, ...)")
        for q in self.copy_queues:
            if q not in QUEUES:
                raise MoesimError(f"unknown copy queue {q!r}; known: {', '.join(QUEUES)}")
        for n in self.cpu_layers:
            if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise MoesimError(f"--cpu-layers: 'auto' or a count of MoE layers >= 0, got {n!r}")
        for n in self.gpu_layers:
            if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise MoesimError(f"--gpu-layers: 'auto' or a count of model layers >= 0, got {n!r}")
        for g in self.gpu_expert_gib:
            if g != "auto" and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf")):
                raise MoesimError(f"--gpu-expert-gib: 'auto' or a finite GiB >= 0, got {g!r}")
        for g in self.offload_gib:
            if g != "auto" and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf")):
                raise MoesimError(f"--offload-gib: 'auto' or a finite GB >= 0, got {g!r}")
        for axis in ("gpu_expert_gib", "offload_gib"):  # -0 is 0 (a row said -0.0)
            object.__setattr__(self, axis, tuple(g if g == "auto" or g != 0 else type(g)(0) for g in getattr(self, axis)))
        for m in self.prefetch_top:
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
                raise MoesimError(f"--prefetch-top: a count of experts >= 1, got {m!r}")
        for t in self.traces.values():
            for d in self.expert_dtypes:
                if d is not None:
                    store_as(t.model, d)  # a format the model cannot store: one line, before any work
            for n in self.cpu_layers:
                if any("--cpu-layers" in p.knobs for p in self.resolved.values()) and n != "auto" \
                        and n > t.model.n_moe_layers:
                    raise MoesimError(f"--cpu-layers {n}: {t.model.name} has {t.model.n_moe_layers} MoE layers")
            for n in self.gpu_layers:
                if any("--gpu-layers" in p.knobs for p in self.resolved.values()) and n != "auto" \
                        and n > t.model.n_layers:
                    raise MoesimError(f"--gpu-layers {n}: {t.model.name} has {t.model.n_layers} layers")
            for m in self.prefetch_top:
                if m is not None and m > t.model.top_k:
                    raise MoesimError(f"--prefetch-top {m}: {t.model.name} routes top-{t.model.top_k}")
        if self.split not in SPLITS:
            raise MoesimError(f"--split {self.split!r}: one of {', '.join(SPLITS)}")
        if self.ratios is not None:
            check_ratios(self.ratios, [m.n_gpus for m in self.hws if m.n_gpus > 1])
        names = [h.name for h in self.hws]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:  # rows are keyed by profile name: one name, two profiles would report one's result twice
            raise MoesimError(f"two hardware profiles named {dup[0]!r} in one sweep; names must be unique")

    @property
    def size(self) -> int:
        """Configurations the sweep times."""
        return len(self.groups()) * self.group_size

    @property
    def group_size(self) -> int:
        """Configurations (rows) per group: every profile times every link bandwidth."""
        return len(self.hws) * len(self.link_gbps)

    def groups(self) -> list[Group]:
        return self._groups

    @property
    def several_or_none(self) -> bool:
        """Whether some machine of the sweep has other than one GPU (where a host runs layers
        even for all-resident)."""
        return any(m.n_gpus != 1 for m in self.hws)

    @functools.cached_property
    def _groups(self) -> list[Group]:
        """Each policy crossed with the axes that apply to it, and no others (all-resident
        ignores the cache, the static CPU placements keep none, a cache-less cpu-on-miss is
        not a configuration)."""
        out = []
        for key, dtype, policy in itertools.product(self.traces, self.expert_dtypes, self.policies):
            out += [Config(key, policy, expert_dtype=dtype, **axes) for axes in self.resolved[policy].sweep_axes(self)]
        return out

    @functools.cached_property
    def recalls(self) -> dict[str, float]:
        """Each trace's prediction recall (per trace, not per configuration); computed once
        in the parent, it travels to the workers with the sweep."""
        return {m: prediction_recall(t) for m, t in self.traces.items()}

    @functools.cached_property
    def _ttft_memo(self) -> dict[tuple, float]:
        """(model, prompt, profile, link, offload, engine) -> TTFT: the same for every copy policy and
        cache, so a worker computes it once per sweep, not once per configuration (per process)."""
        return {}

    @functools.cached_property
    def cost_models(self) -> CostModels:
        """The cost models of the trace a worker is on, one per (machine at a link, host, engine):
        shared by every policy and cache timed there (cleared with :attr:`_costs_memo`)."""
        return CostModels()

    @functools.cached_property
    def _variants(self) -> dict[tuple, tuple[Any, Any]]:
        """(id of a profile, figure, value) -> (the profile, its variant): each made once, so a
        configuration on the same machine and link gets the same objects (and cost models)."""
        return {}

    def at_link(self, machine: Any, gbps: float | None) -> Any:
        """``machine`` (a GPU profile or a machine) at ``gbps`` GB/s of host link (None: its own)."""
        return machine if gbps is None else self._variant(machine, "h2d_pinned_gbs", gbps)

    def _variant(self, obj: Any, figure: str, value: Any, *why: str) -> Any:
        key = (id(obj), figure, value)
        if key not in self._variants:
            self._variants[key] = (obj, obj.with_figure(figure, value, *why))
        return self._variants[key][1]

    @functools.cached_property
    def _costs_memo(self) -> dict[tuple, Any]:
        """(trace, dtype, profile) -> compute times, for the trace a worker is on (groups come
        in trace order); they do not depend on the policy or cache."""
        return {}

    def host_profile(self, name: str | None, gpu: HardwareProfile | None = None) -> HostProfile:
        """The host named (None: ``gpu``'s own), resolved once a sweep (a name no profile gives,
        or none at all, is :func:`moesim.hardware.get_host`'s one line each time)."""
        return resolve_host(self.host_profiles, name, gpu)

    def fingerprint(self) -> str:
        """Identifies the sweep's inputs (traces by content), so a resumed output belongs to it."""
        h = hashlib.sha256()
        for name, tr in self.traces.items():
            h.update(name.encode())
            h.update(json.dumps(tr.header, sort_keys=True, default=str).encode())
            for a in (tr.true_ids, tr.pred_ids):
                h.update(memoryview(a.tobytes()))
        for name, ids in sorted((self.calibration or {}).items()):
            h.update(name.encode())
            h.update(memoryview(ids.tobytes()))
        # Every other field by its value, from the dataclass itself (a field added later cannot be
        # left out, as one could from a hand-written list): machines by their GPUs' figures, the
        # engine by its whole profile (an edited TOML must not resume the first run's rows).
        spec: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _BY_CONTENT}
        spec["hws"] = [[m.name, [{k: g[k] for k in sorted(g.figures)} for g in m.gpus]] for m in self.hws]
        spec["engine_profile"] = self.engine_profile.to_toml() if self.engine_profile else None
        spec["columns"] = ROW_COLUMNS
        spec["profiles"] = ([repr(self.host_profile(h)) for h in self.hosts if h]
                            + [repr(self.host_profile(None, m.gpus[0])) for m in self.hws if m.gpus and m.gpus[0].host])
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
        return h.hexdigest()[:16]


def _recall(sweep: Sweep, cfg: Config, trace: Trace) -> float:
    """The group's prediction recall: the sweep's trace's (computed once), or its own when
    the group cut the predictions to a top-m."""
    return sweep.recalls[cfg.trace] if cfg.prefetch_top is None else prediction_recall(trace)


def _group_trace(sweep: Sweep, cfg: Config) -> Trace:
    """The group's trace: the sweep's, with its experts in the group's format and its
    predictions cut to the group's top-m (the same transforms ``moesim replay`` applies)."""
    trace = sweep.traces[cfg.trace]
    if cfg.expert_dtype is not None:
        trace = with_expert_dtype(trace, cfg.expert_dtype)
    if cfg.prefetch_top is not None:
        trace = keep_top_predictions(trace, min(cfg.prefetch_top, trace.model.top_k))
    return trace


def _axes(sweep: Sweep, cfg: Config, trace: Trace, base: str) -> dict[str, Any]:
    return {"base_model": base, "expert_dtype": cfg.expert_dtype or trace.model.expert_dtype,
            "family": policy_family(sweep.resolved[cfg.policy]),
            "cpu_layers": cfg.cpu_layers, "gpu_expert_gib": cfg.gpu_expert_gib, "copy_queue": cfg.copy_queue,
            "prefetch_top": "-" if cfg.prefetch_top is None else cfg.prefetch_top, "batch": trace.batch,
            "prompt_len": trace.prompt_len, "gpu_layers": cfg.gpu_layers, "offload_gib": cfg.offload_gib,
            "lookahead": trace.meta.lookahead}


def _split_columns(sweep: Sweep, machine: Machine) -> dict[str, str]:
    """How the sweep spreads layers over ``machine``'s GPUs, as its rows say it (and the printed
    arguments read it back: moesim.sim.answer.row_layout); ``-`` on a machine of one GPU or none."""
    if machine.n_gpus < 2:
        return {"split": "-", "tensor_split": "-"}
    shares = "-" if sweep.ratios is None else ",".join(f"{r:.12g}" for r in sweep.ratios)
    return {"split": sweep.split, "tensor_split": shares}


def _hot_placement(sweep: Sweep, cfg: Config, trace: Trace, base: str, machine: Machine):
    """hot-experts' placement at the group's GPU expert budget (None: the policy's own
    choice, all that fit), from the sweep's calibration routing."""
    if cfg.gpu_expert_gib == "auto":
        return None
    spec = trace.model
    calib, source, optimistic = _calibration(sweep, base, trace)
    uniform = calib is None and sweep.engine_profile.expert_placement == "uniform"
    if calib is None and not uniform:
        return None  # simulate_cpu_compute explains what is missing
    if machine.n_gpus != 1:
        return None  # simulate_static refuses hot-experts on other than one GPU, in one line
    room = expert_budget(spec, machine.gpus[0]["device_memory_gb"] * 1e9, trace.batch, trace.prompt_len + trace.n_tokens)
    budget = int(min(room, float(cfg.gpu_expert_gib) * 2**30))  # 1e308 GiB: all that fit (int(inf) raised)
    if uniform:  # the engine's own placement, at the group's budget
        return uniform_set(spec, budget)
    return hot_set(routing_counts(calib, spec.n_experts), spec, budget, source, optimistic)


def _calibration(sweep: Sweep, base: str, trace: Trace):
    """(routing, source, optimistic) the CPU placements count expert frequencies on."""
    if sweep.calibration and base in sweep.calibration:
        return sweep.calibration[base], sweep.calibration_source, False
    if sweep.calibrate_on_replay:
        return trace.true_ids, "the replayed trace", True
    return None, "-", False


def _not_run(sweep: Sweep, index: int, cfg: Config, trace: Trace, base: str, machine: Machine, why: str,
             bound: str = NOT_RUN):
    """A row for a configuration that cannot run on ``machine`` (``bound`` ``memory``: nothing of
    the model fits it): it says why, never a best."""
    return {"model": trace.model.name, "hw": machine.name, "policy": cfg.policy, "link_gbps": machine.link_gbps(),
            "cache_gib": cfg.cache_gib, "fits": False, "note": why, "bound": bound, "synthetic_trace": trace.synthetic,
            "sim": sweep.sim, "group": index, "host": cfg.host or machine.host or "-", **_axes(sweep, cfg, trace, base),
            **_split_columns(sweep, machine)}


def _host(sweep: Sweep, cfg: Config, machine: Machine):
    """The group's host profile (its name, else the machine's own), with the sweep's RAM."""
    if cfg.host is None and not machine.gpus:
        return None  # simulate_static says, in one line, that a machine without GPUs needs --host
    host = sweep.host_profile(cfg.host, machine.gpus[0] if machine.gpus else None)
    return sweep._variant(host, "ram_gb", sweep.host_ram_gb, "estimate", "--host-ram-gb") if sweep.host_ram_gb else host


def _host_ram_short(sweep: Sweep, cfg: Config, machine: Machine, spec) -> str | None:
    """Why a copy policy's experts do not fit the host's RAM (every routed expert stays in host
    memory, whence they are copied), judged by the cost model as the CPU layouts are; None
    when they fit or the RAM is not known."""
    host = _host(sweep, cfg, machine)
    if host is None or host.ram_bytes is None:
        return None
    try:
        sweep.cost_models.get(spec, machine.gpus[0], host, sweep.engine_profile,
                              residence=Residence(host_weights=spec.all_expert_bytes))
    except DoesNotFit as e:
        return str(e)
    return None


def _bounded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` normalised, each with its bound."""
    for r in rows:
        r["bound"] = bound_of(normalise(r))
    return [normalise(r) for r in rows]


def _cpu_rows(sweep: Sweep, index: int, cfg: Config, trace: Trace, base: str,
              machines: list[Machine]) -> list[dict[str, Any]]:
    """The rows of a CPU-compute or static-layout group (:func:`moesim.sim.static.simulate_static`
    or :func:`moesim.sim.cpu_compute.simulate_cpu_compute`, the paths ``moesim replay`` takes), one per
    machine of ``machines`` and link."""
    pol = sweep.resolved[cfg.policy]
    capacity = pol.cache_capacity(trace.model, cfg.cache_gib)
    calib, source, optimistic = _calibration(sweep, base, trace)
    rows = []
    for machine in machines:
        for g in sweep.link_gbps:
            h = sweep.at_link(machine, g)
            setting = Setting(sim=sweep.sim, host=_host(sweep, cfg, h), calibration=None if optimistic else calib,
                              calibrate_on_replay=optimistic, engine=sweep.engine_profile, **sweep.host_knobs())
            several = Setting(split=sweep.split, ratios=list(sweep.ratios) if sweep.ratios else None) \
                if h.n_gpus > 1 else DEFAULT_SETTING  # the shares are a machine of several GPUs' (one count, checked)
            try:
                if why := pol.cannot_run_on(h.n_gpus):
                    rows.append(_not_run(sweep, index, cfg, trace, base, h, why))
                    continue
                if pol.static_on(h.n_gpus):
                    placement = _hot_placement(sweep, cfg, trace, base, h) if pol.places_hot_set else None
                    knobs = {k: getattr(cfg, k) for k in ("cpu_layers", "gpu_layers", "offload_gib")
                             if getattr(cfg, k) != "-"}  # the group's own layout knob; the others' "auto"
                    layout = replace(setting, **knobs, split=several.split, ratios=several.ratios)
                    res = simulate_static(trace, h, pol, layout, placement=placement)
                else:
                    res = simulate_cpu_compute(trace, h.gpus[0], pol, models=sweep.cost_models, s=replace(setting, cache_experts=capacity,
                                                                              eviction=sweep.eviction))
            except DoesNotFit as e:
                # Nothing of this model fits this machine: a row that says so, never a best.
                rows.append(_not_run(sweep, index, cfg, trace, base, h, str(e), bound="memory"))
                continue
            res.pred_recall = _recall(sweep, cfg, trace)
            row = res.summary()
            row.update(_axes(sweep, cfg, trace, base), **_split_columns(sweep, h))
            row.update(pol.answer_columns(res, cfg))
            row["cache_gib"] = cfg.cache_gib if capacity else 0.0
            row["device_gb_needed"] = res.config["device_gb_needed"]
            row["fits"] = res.config["fits"]
            if "--placement-from" in pol.knobs and calib is not None:
                row["note"] = ("optimistic: placed from the replayed trace itself" if optimistic
                               else f"placed from {source}")
            row["group"] = index
            rows.append(row)
    return rows


def run_group(sweep: Sweep, index: int) -> list[dict[str, Any]]:
    """The rows of group ``index`` of ``sweep.groups()``: one plan, every profile and link,
    each with the range its prediction's class errs within (:mod:`moesim.sim.intervals`)."""
    return [with_range(r, sweep.engine_profile.calibration) for r in _run_group(sweep, index)]


def _run_group(sweep: Sweep, index: int) -> list[dict[str, Any]]:
    cfg = sweep.groups()[index]
    trace = _group_trace(sweep, cfg)
    spec = trace.model
    base = sweep.traces[cfg.trace].model.name
    pol = sweep.resolved[cfg.policy]
    memo = sweep._costs_memo
    if getattr(sweep, "_on", None) != (cfg.trace, cfg.expert_dtype):  # one trace's compute times and cost
        memo.clear()                                                    # models at a time (groups come in order)
        sweep.cost_models.clear()
        object.__setattr__(sweep, "_on", (cfg.trace, cfg.expert_dtype))
    if pol.uses_host:
        return _bounded(_cpu_rows(sweep, index, cfg, trace, base, sweep.hws))
    capacity = pol.cache_capacity(spec, cfg.cache_gib)
    plan = build_plan(trace, pol, capacity, sweep.eviction, per_layer=sweep.cache_per_layer)
    recall = _recall(sweep, cfg, trace)
    rows = []
    # Copy queues other than fifo are modelled by the SimPy simulator only: those groups run
    # there, and their rows say sim "simpy" (never a silent substitute).
    sim = sweep.sim if cfg.copy_queue == "fifo" else "simpy"
    for hi, machine in enumerate(sweep.hws):
        if pol.static_on(machine.n_gpus):  # all-resident on several GPUs or none: a static layout
            rows += _bounded(_cpu_rows(sweep, index, cfg, trace, base, [machine]))
            continue
        if machine.n_gpus != 1:
            rows += [normalise(_not_run(sweep, index, cfg, trace, base, machine, f"{pol.name} copies experts to "
                                        "one GPU")) for _ in sweep.link_gbps]
            continue
        hw = machine.gpus[0]
        if why := _host_ram_short(sweep, cfg, machine, spec):
            rows += [normalise(_not_run(sweep, index, cfg, trace, base, machine, why, bound="memory"))
                     for _ in sweep.link_gbps]
            continue
        if (cfg.trace, cfg.expert_dtype, hi) not in memo:
            memo[cfg.trace, cfg.expert_dtype, hi] = pick_costs(
                trace, sweep.cost_models.get(spec, hw, engine=sweep.engine_profile), sweep.timing)
        profiles = [sweep.at_link(hw, g) for g in sweep.link_gbps]
        # The path replay takes (moesim.sim.simulate.time_plan): one deployment, one number.
        setting = Setting(sim=sim, engine=sweep.engine_profile, copy_queue=cfg.copy_queue)
        results = time_plan(trace, pol, plan, memo[cfg.trace, cfg.expert_dtype, hi], profiles, setting,
                            shared=PerTrace(spec, recall, sweep._ttft_memo, sweep.cost_models))
        for res in results:
            row = res.summary()
            row.update(_axes(sweep, cfg, trace, base))
            row["cache_gib"] = cfg.cache_gib if capacity else 0.0  # as asked; cache_experts is what fits
            row["group"] = index  # device_gb_needed and fits: time_plan's, as replay's
            row = normalise(row)
            row["bound"] = bound_of(row)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# Backends: each yields (group index, rows or the exception that group raised)
# --------------------------------------------------------------------------------------

Outcome = tuple[int, list[dict[str, Any]] | BaseException]
_WORKER_SWEEP: Sweep | None = None


def _init_worker(sweep: Sweep) -> None:
    """A worker leaves interrupts to the parent (:func:`moesim.sim.pool.worker_ignores_stops`)
    and keeps the sweep it runs groups of."""
    global _WORKER_SWEEP
    worker_ignores_stops()
    _WORKER_SWEEP = sweep


def _worker(index: int) -> list[dict[str, Any]]:
    assert _WORKER_SWEEP is not None
    return run_group(_WORKER_SWEEP, index)


def _warm_kernels() -> None:
    """Compile (first run on a machine) or load the numba kernels once, before forking
    workers, so each worker inherits them instead of loading them again."""
    import numpy as np

    z = np.zeros((1, 1))
    run_fast_many(Workload.build(z, z, z, np.zeros(1), "warm-up"), [Link(1.0)])
    join_kernels_aside()  # the planner, compiled aside meanwhile: loaded from numba's cache now
    _warm_planner()


def _warm_planner() -> None:
    import numpy as np

    ids = np.zeros((1, 1, 1, 1), np.int16)
    Planner("on-demand", 1).plan_trace(ids, ids, 1)


_ASIDE: Any = None  # the process compiling the sweep's kernels aside (compile_kernels_aside), until joined


def compile_kernels_aside(jobs: int | None) -> None:
    """On a first run numba compiles the planner's kernel (~7 s on one core of the 2-core
    machine), the synthetic traces' (~5 s) and the fast path's (~1 s), one after the other.
    With a second core and workers to come, a forked process compiles the planner's into
    numba's cache while this one draws the traces and compiles the fast path's, and
    :func:`_warm_kernels` loads it from there (issue "The first answer in seconds": the
    default whatif's first run 17 s -> 11 s, measured). Nothing is started where this process
    has them already (a second sweep in one process), for one worker or one core; if the
    cache cannot be written, :func:`_warm_kernels` compiles them itself, as before."""
    global _ASIDE
    kernel = sys.modules.get("moesim.policy.kernel")  # imported: perhaps compiled or loaded in this process already
    if _ASIDE is not None or (kernel and kernel.plan_steps.signatures) or jobs == 1:
        return
    _ASIDE = start_aside(_warm_planner)  # None (one core, a pool worker): compiled here later


#: Seconds :func:`join_kernels_aside` waits for the compiling process (it takes ~7 s on one
#: core of this project's 2-core machine); past that it is stopped and this process compiles.
ASIDE_WAIT_S = 300.0


def join_kernels_aside() -> None:
    """Wait for :func:`compile_kernels_aside`'s process, if one runs (its exit status is not
    read: a failed compile there is compiled here). A process forked beside a thread that held
    a lock could wait for it forever: it is given :data:`ASIDE_WAIT_S`, then stopped."""
    global _ASIDE
    if _ASIDE is not None:
        proc, _ASIDE = _ASIDE, None
        proc.join(ASIDE_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _local(sweep: Sweep, todo: list[int], jobs: int) -> Iterator[Outcome]:
    if jobs <= 1:
        join_kernels_aside()  # one group after all: its planner comes from the cache, not a second compile
        for i in todo:
            try:
                yield i, run_group(sweep, i)
            except Exception as e:  # noqa: BLE001 - reported per group by run_sweep
                yield i, e
        return
    _warm_kernels()
    yield from ((todo[k], out) for k, out in run_pool(_worker, todo, jobs, _init_worker, (sweep,)))


def _ray(sweep: Sweep, todo: list[int], address: str | None) -> Iterator[Outcome]:
    try:
        import ray
    except ImportError:
        raise MoesimError(f"backend ray needs Ray: {RAY_HINT}") from None
    if not ray.is_initialized():
        # address None: RAY_ADDRESS if set, else a new local cluster (ray.init's own rule).
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True,
                 log_to_driver=False, include_dashboard=False)
    group_task = ray.remote(max_retries=0)(run_group)
    sweep_ref = ray.put(sweep)  # traces travel to the object store once, not once per group
    pending = {group_task.remote(sweep_ref, i): i for i in todo}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i = pending.pop(ref)
                try:
                    rows = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a RayTaskError wraps the worker's exception
                    rows = getattr(e, "cause", None) or e
                yield i, rows
    finally:  # interrupted: do not leave the cluster computing groups nobody will collect
        for ref in pending:
            ray.cancel(ref)


# --------------------------------------------------------------------------------------
# Streaming and resuming
# --------------------------------------------------------------------------------------


_parse = parse  # the names this module had; sim/sweep_rows.py holds the rows file now


def _resume(sweep: Sweep, out: Path, notes: list[str] | None = None) -> dict[int, list[dict[str, Any]]]:
    return resume(sweep, out, ROW_COLUMNS, notes)


class SweepError(MoesimError):
    """Some groups failed; ``failures`` = [(group, reason)], ``rows`` = the finished rows."""

    def __init__(self, message: str, failures: list[tuple[Group, str]], rows: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.failures = failures
        self.rows = rows


def run_sweep(sweep: Sweep, jobs: int | None = None, progress: Callable[[int, int], None] | None = None, *,
              backend: str = "local", address: str | None = None, out: str | Path | None = None,
              keep_rows: bool = True, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """All rows of the sweep, in group order (rows of a group: profile, then link).

    ``progress(configurations_done, configurations)`` after each group (resumed groups
    count as done at once). ``backend``: ``local`` (``jobs`` processes, default all cores)
    or ``ray`` (the cluster at ``address``, else RAY_ADDRESS, else a new local one).
    ``out``: stream rows to this CSV as groups finish and resume from it (see the module
    docstring); with ``keep_rows=False`` it returns [] and holds one group's rows at a time.
    """
    if backend not in BACKENDS:
        raise MoesimError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise MoesimError(f"backend ray needs Ray: {RAY_HINT}") from None
    sweep.recalls  # noqa: B018 - computed once here, shipped with the sweep to every worker
    out = Path(out) if out is not None else None
    if out is None:
        return _run_sweep(sweep, jobs, progress, backend, address, None, keep_rows, notes)
    with exclusive(out, "--rows"):  # a second run on the same rows is refused, not interleaved
        return _run_sweep(sweep, jobs, progress, backend, address, out, keep_rows, notes)


def _run_sweep(sweep: Sweep, jobs, progress, backend: str, address, out: Path | None, keep_rows: bool,
               notes: list[str] | None) -> list[dict[str, Any]]:
    groups = sweep.groups()
    finished = resume(sweep, out, ROW_COLUMNS, notes) if out is not None else {}
    fingerprint = sweep.fingerprint() if out is not None else ""
    results: dict[int, list[dict[str, Any]]] = finished if keep_rows else {}
    todo = [i for i in range(len(groups)) if i not in finished]
    total, done = sweep.size, len(finished) * sweep.group_size
    if progress:
        progress(done, total)
    if backend == "ray":
        outcomes = _ray(sweep, todo, address)
    else:
        outcomes = _local(sweep, todo, max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1)))
    failures: list[tuple[Group, str]] = []
    try:
        for i, rows in outcomes:
            if isinstance(rows, BaseException):
                failures.append((groups[i], f"{type(rows).__name__}: {rows}"))
                continue
            if out is not None:
                write_rows(out, rows, fingerprint)
            if keep_rows:
                results[i] = rows
            done += len(rows)
            if progress:
                progress(done, total)
    finally:  # now, not when the traceback is freed: an interrupt stops the workers before the CLI exits
        outcomes.close()
    ordered = [r for i in sorted(results) for r in results[i]]
    if failures:
        cfg, why = failures[0]
        kept = f"; finished rows are in {out}" if out is not None else ""
        raise SweepError(f"{len(failures)} of {len(groups)} configuration groups failed, first: {cfg.describe()} "
                         f"(every profile and link of it): {why}{kept}",
                         failures, ordered)
    return ordered


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == x


def best(rows: list[dict[str, Any]], goal: str = "tpot") -> dict[str, Any] | None:
    """The best row for ``goal`` among those that fit in device memory. The oracle is a
    bound, not a policy anyone can run, so it is never the answer."""
    if goal not in GOALS:
        raise MoesimError(f"unknown goal {goal!r}; known: {', '.join(GOALS)}")
    key = GOALS[goal][0]
    oracles = {n for n, p in POLICIES.items() if p.is_bound}  # a row's policy is a registered name
    fitting = [r for r in rows if r["fits"] and r["policy"] not in oracles and _number(r[key])]
    return min(fitting, key=lambda r: (float(f"{r[key]:.6g}"), simplicity(r.get("family")))) if fitting else None
