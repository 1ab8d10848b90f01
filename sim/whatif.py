"""``moesim whatif`` as one call: build the traces, sweep, pick the best, explain it.

Without a trace each model gets a **synthetic** trace (moesim.traces.synthetic) of each
given shape (batch size x prompt length); the result says so (``synthetic``). The best configuration fits in device
memory and is never the oracle (:func:`moesim.sim.sweep.best`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moesim import bounds, budget
from moesim.atomic import exclusive
from moesim.engines import alias_note, get_engine
from moesim.errors import MoesimError
from moesim.hardware import Machine, get_machine
from moesim.models import DTYPES, get_model
from moesim.policy import (
    QUEUES,
    WHATIF_POLICIES,
    Policy,
    as_policy,
    check_eviction,
    check_lookahead,
    default_policies,
    get_policy,
    runs_on,
)
from moesim.policy.placement import UNIFORM
from moesim.quant_recipes import approximation_note, is_format
from moesim.setting import HostKnobs
from moesim.sim.cpu_compute import load_calibration, separate_calibration
from moesim.sim.sweep import BACKENDS, GOALS, Sweep, best, compile_kernels_aside, resolve_host, run_sweep
from moesim.sim.sweep_rows import check_rows_path
from moesim.traces.format import read_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

DEFAULT_MODELS = ("qwen3-30b-a3b",)
DEFAULT_HWS = ("a6000", "h100-sxm", "gh200")
DEFAULT_POLICIES = WHATIF_POLICIES
DEFAULT_CACHE_GIB = (0.0, 8.0, 16.0)
CALIBRATION_SEED_OFFSET = 1  # the synthetic calibration trace: the replayed one's seed + this


@dataclass
class WhatIf:
    sweep: Sweep
    goal: str
    rows: list[dict[str, Any]]  # every configuration, with its family and "bound" (link, GPU/CPU compute, memory)
    winner: dict[str, Any] | None  # best over everything (None: nothing fits)
    best_by_hw: dict[str, dict[str, Any] | None]
    synthetic: bool  # some trace is synthetic
    notes: list[str] = field(default_factory=list)  # what the reader must know (synthetic calibration, optimism)
    #: With several engines (``--engine A,B``, an axis): each engine's own sweep, in the order given.
    by_engine: list[WhatIf] = field(default_factory=list)

    def ranked(self) -> list[dict[str, Any]]:
        """Fitting configurations first, then by the goal's figure."""
        key = GOALS[self.goal][0]
        return sorted(self.rows, key=lambda r: (not r["fits"], r[key] if r[key] is not None else float("inf")))


def value_of(p) -> tuple:
    """What a machine or profile is, not how it was spelled: a machine its GPUs (``2xrtx3090`` is
    ``rtx3090+rtx3090``), a profile its figures (``epyc-9654@2x4800`` is ``@02x4800.0``)."""
    if isinstance(p, Machine):
        return ("machine", *(value_of(g) for g in p.gpus))
    return (type(p).__name__, *sorted((k, f.value) for k, f in p.figures.items()))


def check_unique_names(given: list[str] | tuple[str, ...], profiles: list, option: str = "--hw") -> None:
    """Rows are keyed by profile name: two profiles with one name would report one's results twice;
    one value given twice, however spelled, would sweep the same rows twice (:func:`value_of`)."""
    seen: dict[str, str] = {}
    same: dict[tuple, str] = {}
    what = "machine" if option == "--hw" else "host"
    for g, p in zip(given, profiles):
        v = value_of(p)
        if v in same and same[v] != g:
            named = f"; both named {p.name!r}, and profile names must be unique in a run" if p.name in seen else ""
            raise MoesimError(f"{option}: {g!r} is the same {what} as {same[v]!r} (its figures, however spelled{named}): "
                              "give it once")
        if p.name in seen and seen[p.name] != g:
            raise MoesimError(f"{option}: {seen[p.name]} and {g} are both named {p.name!r}; profile names must be "
                              "unique in a run (change `name` in the .toml, or `moesim fit --name`)")
        same.setdefault(v, g)
        seen[p.name] = g


def unique_model_names(given: list[str], specs: list) -> list:
    """Rows are keyed by model name: two files of one model (a Q4_K_M and a Q8_0 GGUF share
    ``general.name``) each keep their rows, under the name and the file's name as given.
    A model given twice is swept once."""
    first: list[tuple[str, Any]] = []
    for g, s in zip(given, specs):
        if all(s != t for _, t in first):
            first.append((g, s))
    names = [s.name for _, s in first]
    files = [Path(g).name for g, s in first if names.count(s.name) > 1]
    # The file's name tells them apart; two files of one name in other folders, the path as given.
    return [replace(s, name=f"{s.name} ({Path(g).name if files.count(Path(g).name) == 1 else g})")
            if names.count(s.name) > 1 else s for g, s in first]


def default_cpu_layers(specs: list) -> tuple[int | str, ...]:
    """``auto`` (the fewest that fit, per device) and a quarter, half and all of the MoE
    layers of the smallest model on the CPU: enough points to see the trade."""
    m = min(s.n_moe_layers for s in specs)
    return tuple(dict.fromkeys(("auto", m // 4, m // 2, m)))


def _positive_ints(values: list[int] | tuple[int, ...], what: str) -> list[int]:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoesimError(f"{what} {v!r}: a whole number >= 1")
    if len(set(values)) != len(values):
        raise MoesimError(f"{what}: a value appears twice")
    return list(values)


MAX_JOBS_PER_CORE = 4  # more worker processes than this per core only share the cores (and memory)


def check_values(*, eviction: str | None, sim: str, backend: str = "local", link_gbps=None, cache_gib=None,
                 copy_queues=None, expert_dtypes=None, threads=None, jobs=None, lookaheads=None, cpu_layers=None,
                 gpu_layers=None, gpu_expert_gib=None, offload_gib=None, prefetch_top=None, ratios=None,
                 cache_experts=None) -> None:
    """Every value the CLI can check, checked in one line before any work (a bad one found
    per configuration group would end, after the work, in "2 of 4 groups failed"). One
    definition for every command: ``whatif`` gives its lists, ``replay`` its one value of
    each (a list of one; None: left out), so an option both take is refused alike by both.
    Rates, sizes and shares lie in the ranges of :mod:`moesim.bounds` (1e308 GiB or 1e-9 GB/s
    overflow what is made of them)."""
    if eviction is not None:
        check_eviction(eviction)
    if sim not in ("fast", "simpy"):
        raise MoesimError(f"--sim: unknown simulator {sim!r}; known: simpy, fast")
    if backend not in BACKENDS:
        raise MoesimError(f"--backend: unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    for g in link_gbps or ():
        bounds.check_rate(g, "--link-gbps")
    for c in cache_gib or ():
        bounds.check_size(c, "--cache-gib")
    for c in cache_experts or ():
        bounds.check_count(c, "--cache-experts", 0, what="a count of experts")
    for c in gpu_expert_gib or ():
        bounds.check_size(c, "--gpu-expert-gib", auto=True)
    for c in offload_gib or ():
        bounds.check_size(c, "--offload-gib", auto=True)
    for n in cpu_layers or ():
        bounds.check_count(n, "--cpu-layers", 0, auto=True, what="a count of MoE layers")
    for n in gpu_layers or ():
        bounds.check_count(n, "--gpu-layers", 0, auto=True, what="a count of model layers")
    for m in prefetch_top or ():
        bounds.check_count(m, "--prefetch-top", 1, what="a count of experts")
    if ratios is not None:
        bounds.check_shares(ratios)
    for q in copy_queues or ():
        if q not in QUEUES:
            raise MoesimError(f"--copy-queue: unknown copy queue {q!r}; known: {', '.join(QUEUES)}")
    for d in expert_dtypes or ():
        if not is_format(d):
            raise MoesimError(f"--expert-dtype: unknown expert dtype {d!r}; known: {', '.join(DTYPES)}, or a llama.cpp "
                              "file type (q4_k_m, q8_0, ...)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise MoesimError(f"--threads {threads!r}: a count of CPU threads >= 1")
    cores = os.cpu_count() or 1
    if jobs is not None and jobs > MAX_JOBS_PER_CORE * cores:
        raise MoesimError(f"--jobs {jobs}: this machine has {cores} cores; at most {MAX_JOBS_PER_CORE * cores} worker "
                          "processes (0 = one per core)")
    _positive_ints(list(lookaheads or ()), "--lookahead")


def check_threads(threads: int | None, hosts) -> list[str]:
    """``--threads`` against every host the run may use: above 4x a host's cores it is a typo
    (one line); above its cores (SMT threads) a note each, for the cost model counts a core's
    work once (:meth:`moesim.costmodel.CostModel.cpu_rate`) and the threads beyond change nothing."""
    notes = []
    for h in hosts:
        total = h.cores * h.sockets
        if threads is not None and threads > 4 * total:
            raise MoesimError(f"--threads {threads}: a count from 1 to {4 * total} ({h.name} has {total} cores)")
        if threads is not None and threads > total:
            notes.append(f"--threads {threads} is above {h.name}'s {total} cores: timed as {total} threads (the "
                         "threads beyond one a core share its units and add no compute in the cost model)")
    return notes


def sockets_notes(hosts, engine) -> list[str]:
    """A note for each host of several sockets whose second socket's memory the engine does
    not read (``numa_efficiency`` 0, its default): only the compute of the further sockets
    counts, so a memory-bound answer is that of one socket and the user should know."""
    return [f"{h.name} has {int(h.sockets)} sockets, but {engine.name} reads the experts from one socket's memory "
            "(its numa_efficiency is 0): the further sockets add compute, not bandwidth"
            for h in hosts if h.sockets > 1 and engine.get("numa_efficiency") == 0]


@dataclass(frozen=True)
class Given:
    """The options a run was given, as :func:`unused_options` reads them: each knob a list of
    the values given (None or empty: left out; whatif sweeps several, replay gives one), and
    what was typed at all. ``eviction`` the one given (only a cache evicts: ``cached`` says
    whether any cache size of the run is above 0); ``link_given``: a link bandwidth was given
    (all-resident moves nothing over it); ``cache_given``: a cache above 0 was given (only the
    copy policies and cpu-on-miss keep one); ``cache_per_layer``: the cache is split by layer
    (only a cache above 0 is). ``auto`` is every count's default, so only other values count."""

    hosts: list | tuple | None = None
    cpu_layers: list | tuple | None = None
    gpu_expert_gib: list | tuple | None = None
    copy_queues: list | tuple | None = None
    prefetch_top: list | tuple | None = None
    gpu_layers: list | tuple | None = None
    offload_gib: list | tuple | None = None
    lookaheads: list | tuple | None = None
    placement_from: str | Path | None = None
    calibrate_on_replay: bool = False
    amx: bool = True
    eviction: str | None = None
    cached: bool = True
    threads: int | None = None
    link_given: bool = False
    cache_given: bool = False
    cache_per_layer: bool = False


def unused_options(pols: list, g: Given, *, pinned_hot_set: bool = False, no_gpu: bool = False,
                   verb: str = "swept") -> list[str]:
    """A note for each option given (``g``) that no policy of the run uses (``--cpu-layers``
    with no cpu-static, ...): the run is still valid, but the user should not believe the knob
    was tried. One definition for every command (whatif sweeps lists, replay takes one value
    each): ``pinned_hot_set``: ``--gpu-expert-gib`` also pins a copy policy's hot set (replay);
    ``no_gpu``: the machine has no GPU, where ``--host`` always applies; ``verb`` names the
    run's policies (swept, replayed, chosen)."""
    # Each option: the values given, and who reads it: the families whose knobs name it, and
    # here also the host of a machine without a GPU (it runs every layer), replay's copy
    # policies for --gpu-expert-gib (it pins their hot set), and a cache's knobs only with a cache.
    def reads(name: str, also=lambda p: False):
        return lambda p: name in p.knobs or also(p)

    host_too = lambda p: no_gpu  # noqa: E731
    cached = lambda name: lambda p: g.cached and name in p.knobs  # noqa: E731
    uses = [(g.hosts, "--host", "the CPU-compute policies", reads("--host", host_too)),
            ([n for n in g.gpu_layers or () if n != "auto"], "--gpu-layers", "gpu-layers", reads("--gpu-layers")),
            ([v for v in g.offload_gib or () if v != "auto"], "--offload-gib", "weight-streaming", reads("--offload-gib")),
            ([n for n in g.cpu_layers or () if n != "auto"], "--cpu-layers", "cpu-static", reads("--cpu-layers")),
            ([v for v in g.gpu_expert_gib or () if v != "auto"], "--gpu-expert-gib",
             "hot-experts and the copy policies" if pinned_hot_set else "hot-experts",
             reads("--gpu-expert-gib", lambda p: pinned_hot_set and p.copies_experts)),
            ([q for q in g.copy_queues or () if q not in ("fifo", None)], "--copy-queue", "the copy policies",
             reads("--copy-queue")),
            (g.prefetch_top, "--prefetch-top", "the prefetching policies", reads("--prefetch-top")),
            ([g.placement_from] if g.placement_from is not None else [], "--placement-from", "hot-experts and cpu-on-miss",
             reads("--placement-from")),
            ([True] if g.calibrate_on_replay else [], "--calibrate-on-replay", "hot-experts and cpu-on-miss",
             reads("--calibrate-on-replay")),
            ([True] if not g.amx else [], "--no-amx", "the CPU-compute policies", reads("--no-amx", host_too)),
            ([g.eviction] if g.eviction not in (None, "lru") else [], "--eviction",
             "the copy policies and cpu-on-miss, with a cache above 0", cached("--eviction")),
            (g.lookaheads or [], "--lookahead", "the prefetching policies", reads("--lookahead")),
            ([g.threads] if g.threads is not None else [], "--threads", "the CPU-compute policies",
             reads("--threads", host_too)),
            ([True] if g.link_given else [], "--link-gbps", "the policies that copy experts or activations",
             reads("--link-gbps")),
            ([True] if g.cache_given else [], "--cache-gib", "the copy policies and cpu-on-miss", reads("--cache-gib")),
            ([True] if g.cache_per_layer else [], "--cache-per-layer",
             "the copy policies and cpu-on-miss, with a cache above 0", cached("--cache-per-layer"))]
    return [f"{name} was given, but none of the {verb} policies "
            f"uses it (only {who}): it changed nothing"
            for given, name, who, applies in uses if given and not any(applies(p) for p in pols)]


@dataclass(frozen=True)
class WhatifOptions(HostKnobs):
    """What one ``whatif`` sweeps, as the CLI (``moesim.cli.whatif.WhatifArgs``) or a Python
    caller gives it: names and values, checked by :func:`whatif` before any work and resolved
    there once into the :class:`~moesim.sim.sweep.Sweep` every layer below takes. The fields
    are :func:`whatif`'s axes, each one described there; the host knobs
    (:class:`~moesim.setting.HostKnobs`: threads, AMX) go to the sweep as they are."""

    trace: str | Path | None = None
    models: tuple[str, ...] | list[str] = DEFAULT_MODELS
    hws: tuple[str, ...] | list[str] = DEFAULT_HWS
    policies: tuple[str | Policy, ...] | list[str | Policy] | None = None  # names or the resolved policies
    link_gbps: list[float] | None = None
    cache_gib: tuple[float, ...] | list[float] = DEFAULT_CACHE_GIB
    eviction: str = "lru"
    tokens: int = 256
    prompt_len: int | list[int] = 128
    batch: int | list[int] = 1
    goal: str = "tpot"
    sim: str = "fast"
    jobs: int | None = None
    backend: str = "local"
    address: str | None = None
    rows_csv: str | Path | None = None
    expert_dtypes: list[str] | None = None
    hosts: list[str] | None = None
    cpu_layers: list[int | str] | None = None
    gpu_expert_gib: list[float | str] | None = None
    copy_queues: list[str] | None = None
    prefetch_top: list[int] | None = None
    placement_from: str | Path | None = None
    calibrate_on_replay: bool = False
    engine: str | None = None
    gpu_layers: list[int | str] | None = None
    lookaheads: list[int] | None = None
    host_ram_gb: float | None = None
    cache_per_layer: bool = False
    offload_gib: list[float | str] | None = None
    split: str = "layer"
    ratios: list[float] | None = None


def whatif(o: WhatifOptions = WhatifOptions(), progress: Callable[[int, int], None] | None = None) -> WhatIf:
    """Sweep models x hardware x policies x link bandwidth (None: each profile's own) x cache
    size, and the axes each policy family has: ``expert_dtypes`` (every policy), ``hosts``
    (CPU policies; None: each GPU profile's own), ``cpu_layers`` (cpu-static; None:
    :func:`default_cpu_layers`), ``gpu_expert_gib`` (hot-experts; ``auto`` = all that fit),
    ``copy_queues`` and ``prefetch_top`` (the predicting copy policies), ``gpu_layers``
    (gpu-layers; None: auto, the most that fit), ``offload_gib`` (weight-streaming; None:
    auto, the least that fits); ``split`` and ``ratios`` spread layers over the GPUs of a
    machine of several (whole layers by bytes or in ``ratios``, llama.cpp's ``--tensor-split``;
    or every layer over all, ``tensor``). ``batch``, ``prompt_len`` and
    ``lookaheads`` (how many MoE layers ahead the predictions are made) are axes of the
    synthetic traces (a recorded trace has its own). ``hws`` are machines
    (:func:`moesim.hardware.get_machine`: ``a6000``, ``2xrtx5090``, ``none``); ``engine``
    the inference engine (:mod:`moesim.engines`) and ``threads`` its CPU threads; ``sim``
    the simulator (fast or simpy).

    hot-experts (and cpu-on-miss's warm cache) place experts by the routing of a SEPARATE
    calibration trace: ``placement_from``, else for synthetic traces a second synthetic
    trace with another seed; counting the replayed trace itself only with
    ``calibrate_on_replay``, and those rows say "optimistic".

    ``backend``/``address``: where the groups run (:func:`moesim.sim.sweep.run_sweep`);
    ``rows_csv``: stream every row to this CSV as its group finishes, and resume an
    interrupted sweep from it (the same sweep run again skips the finished groups).
    """
    if o.jobs is not None and o.jobs < 0:
        raise MoesimError(f"--jobs {o.jobs}: a number of worker processes (0 = all cores)")
    if o.goal not in GOALS:
        raise MoesimError(f"unknown goal {o.goal!r}; known: {', '.join(GOALS)}")
    _positive_ints([o.batch] if isinstance(o.batch, int) else list(o.batch), "--batch")
    _positive_ints([o.prompt_len] if isinstance(o.prompt_len, int) else list(o.prompt_len), "--prompt-len")
    check_values(eviction=o.eviction, sim=o.sim, backend=o.backend, link_gbps=o.link_gbps, cache_gib=o.cache_gib,
                 copy_queues=o.copy_queues, expert_dtypes=o.expert_dtypes, threads=o.threads, jobs=o.jobs,
                 lookaheads=o.lookaheads, cpu_layers=o.cpu_layers, gpu_layers=o.gpu_layers,
                 gpu_expert_gib=o.gpu_expert_gib, offload_gib=o.offload_gib, prefetch_top=o.prefetch_top,
                 ratios=o.ratios)
    if o.rows_csv is None:
        return _whatif(o, progress)

    check_rows_path(Path(o.rows_csv))
    with exclusive(o.rows_csv, "--rows"):  # a second identical sweep on these rows: one line, before any work
        return _whatif(o, progress)


def whatif_engines(o: WhatifOptions, engines: list[str],
                   progress: Callable[[int, int], None] | None = None) -> WhatIf:
    """``whatif`` with the engine as an axis: the same sweep under each of ``engines`` (its
    rows carry their engine), the best over all of them, and each engine's own result in
    ``by_engine`` (its deployment answer and arguments are that engine's)."""
    engines = list(dict.fromkeys(engines))
    if len(engines) == 1:
        return whatif(replace(o, engine=engines[0]), progress)
    if o.rows_csv is not None:
        raise MoesimError("--rows keeps one sweep's rows: give one --engine at a time with it")
    profiles = [get_engine(e) for e in engines]  # each resolved (one line for a bad one) before any sweep
    names = [p.name for p in profiles]  # what a row's engine column says
    if len(set(names)) < len(names):
        same = "the same engine" if len({p.label for p in profiles}) < len(profiles) else "builds of one engine"
        raise MoesimError(f"--engine {','.join(engines)}: two of them are {same} ({', '.join(p.label for p in profiles)}), "
                          "which the rows would not tell apart: give each once, or sweep each build on its own")
    results = [whatif(replace(o, engine=e), progress) for e in engines]
    rows = [r for res in results for r in res.rows]
    first = results[0]
    by_hw = {h.name: best([r for r in rows if r["hw"] == h.name], o.goal) for h in first.sweep.hws}
    notes = list(dict.fromkeys(n for res in results for n in res.notes))
    return WhatIf(first.sweep, o.goal, rows, best(rows, o.goal), by_hw, first.synthetic, notes, results)


def _whatif(o: WhatifOptions, progress: Callable[[int, int], None] | None) -> WhatIf:
    policies = o.policies
    batches = _positive_ints([o.batch] if isinstance(o.batch, int) else list(o.batch), "--batch")
    prompts = _positive_ints([o.prompt_len] if isinstance(o.prompt_len, int) else list(o.prompt_len), "--prompt-len")
    eng = get_engine(o.engine)  # an unknown engine: one line, before any work
    chosen = policies is not None
    if not chosen:  # the policies the engine runs (moesim's own defaults for PyTorch eager)
        policies = default_policies(eng, DEFAULT_POLICIES)
    pols = [as_policy(p) for p in policies]  # names checked before any work (the CLI's: resolved already)
    policies, engine_note = runs_on(eng, [p.name for p in pols])
    pols = [p for p in pols if p.name in policies]
    if o.placement_from is not None and o.calibrate_on_replay:
        raise MoesimError("give a calibration trace (--placement-from) or --calibrate-on-replay, not both")
    # A family that needs a device expert cache has no configuration without a size above 0: said
    # as that, not as "nothing fits" (one line when it is all that was asked for; a note beside others).
    no_cache = [p.name for p in pols if p.needs_cache] \
        if not any(isinstance(c, (int, float)) and c > 0 for c in o.cache_gib) else []
    if no_cache:
        why = (f"{', '.join(no_cache)} needs a device expert cache, and --cache-gib "
               f"{','.join(f'{c:g}' if isinstance(c, (int, float)) else str(c) for c in o.cache_gib)} gives it none: "
               "give a size above 0 (--cache-gib 8)")
        if len(no_cache) == len(pols):
            raise MoesimError(why)
        pols = [p for p in pols if p.name not in no_cache]
        policies = [p.name for p in pols]
        engine_note = "; ".join(x for x in (engine_note, f"{why}: left out") if x)
    hot_left_out = None
    uniform = eng.expert_placement == "uniform" and o.placement_from is None and not o.calibrate_on_replay
    if o.trace is not None and o.placement_from is None and not o.calibrate_on_replay and not uniform \
            and any(p.places_hot_set for p in pols):
        why = ("hot-experts places experts by a calibration trace's routing: give --placement-from TRACE (or "
               "--calibrate-on-replay for an optimistic bound)")
        if chosen:
            raise MoesimError(why)
        # Among the defaults it is left out, not the whole sweep refused: `moesim whatif --trace T` answers. Left
        # out before the options are checked, so one only hot-experts reads (--gpu-expert-gib) is noted as unused.
        pols = [p for p in pols if not p.places_hot_set]
        policies = [p.name for p in pols]
        hot_left_out = f"{why} to sweep it: left out"
    profiles = [get_machine(h) for h in o.hws]  # each machine resolved once, here
    no_gpu = any(m.n_gpus == 0 for m in profiles)  # --hw none: the host runs every layer
    check_unique_names(o.hws, profiles)  # before any trace is drawn: one value given twice
    host_table: dict = {}  # each host resolved once (the sweep keeps them)
    named_hosts = [h for h in o.hosts or () if h]
    check_unique_names(named_hosts, [resolve_host(host_table, h) for h in named_hosts], "--host")
    given = Given(o.hosts, o.cpu_layers, o.gpu_expert_gib, o.copy_queues, o.prefetch_top, o.gpu_layers,
                  o.offload_gib, o.lookaheads, eviction=o.eviction, threads=o.threads, amx=o.amx,
                  cached=any(isinstance(c, (int, float)) and c > 0 for c in o.cache_gib),
                  link_given=o.link_gbps is not None, cache_per_layer=o.cache_per_layer)
    notes: list[str] = unused_options(pols, given, no_gpu=no_gpu)
    notes += [n for d in dict.fromkeys(o.expert_dtypes or ()) if d and (n := approximation_note(d))]
    notes += split_notes(o.split, o.ratios, [m.n_gpus for m in profiles])
    if engine_note:
        notes.append(engine_note)
    if bundled := alias_note(eng):
        notes.append(bundled)
    if hot_left_out:
        notes.append(hot_left_out)
    if o.host_ram_gb is not None and not (isinstance(o.host_ram_gb, (int, float)) and 0 < o.host_ram_gb < 1e7):
        raise MoesimError(f"--host-ram-gb {o.host_ram_gb!r}: the host's RAM in GB, above 0 and below 10,000,000 "
                          "(10 PB)")
    if o.backend == "local":
        compile_kernels_aside(o.jobs)  # a first run: the sweep's kernels compile on another core while traces are drawn
    calibration: dict[str, Any] = {}
    calibration_source = "-"
    aheads = _positive_ints(list(o.lookaheads), "--lookahead") if o.lookaheads else [1]
    if o.trace is not None:
        if len(batches) > 1 or len(prompts) > 1:
            raise MoesimError("--batch and --prompt-len axes shape synthetic traces; a recorded trace (--trace) has its "
                              "own batch size and prompt length")
        t = read_trace(o.trace)
        shaped = [k for k, v in (("--model", tuple(o.models) != DEFAULT_MODELS), ("--tokens", o.tokens != 256),
                                 ("--batch", batches != [1]), ("--prompt-len", prompts != [128])) if v]
        if shaped:  # the trace's own model, steps, batch and prompt length are what is replayed
            notes.append(f"{', '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} synthetic traces; --trace {o.trace} "
                         "has its own: changed nothing")
        if t.speculative:
            raise MoesimError(f"{o.trace} records speculative decoding: sweep it with "
                              "`moesim replay TRACE --gamma ... --policy ...`")
        traces = {t.model.name: t}
        for n in aheads:
            if n != t.meta.lookahead:
                raise MoesimError(f"--lookahead {n}: {o.trace} holds predictions made {t.meta.lookahead} MoE layer(s) "
                                  f"ahead; record or synthesise it with --lookahead {n}")
        if o.placement_from is not None:
            calibration[t.model.name] = separate_calibration(load_calibration(str(o.placement_from), t.model), t,
                                                             o.placement_from)
            calibration_source = f"the calibration trace {o.placement_from}"
    else:
        if o.placement_from is not None:
            raise MoesimError("--placement-from calibrates a recorded trace (--trace); synthetic traces are calibrated "
                              "on a second synthetic trace")
        traces = {}
        specs = unique_model_names(list(o.models), [get_model(m) for m in o.models])
        for spec in specs:  # all sizes checked before any trace is made: the trace and one replay of it together
            for b in batches:
                made = budget.synth_estimate(spec, o.tokens, b, max(prompts))
                run = budget.replay_estimate(spec, o.tokens, b, 1, o.sim)
                budget.check(budget.Estimate(f"a synthetic trace of {o.tokens} steps x batch {b} of {spec.name} and one "
                                             "simulation of it", made.bytes + run.bytes, made.seconds + run.seconds))
        one_shape = len(batches) == 1 and len(prompts) == 1 and len(aheads) == 1
        for spec in specs:
            for n in aheads:
                check_lookahead(n, spec.n_moe_layers)
            for b in batches:
                for p in prompts:
                    for n in aheads:
                        params = SyntheticParams(tokens=o.tokens, batch=b, prompt_len=p, lookahead=n)
                        key = spec.name if one_shape else f"{spec.name} b{b} p{p}" + (f" ahead{n}" if n != 1 else "")
                        traces[key] = synthetic_trace(spec, params)
            # A family placed by routing frequency needs calibration routing (hot-experts not where the
            # engine places uniformly; cpu-on-miss warms its cache from it).
            if any("--placement-from" in p.knobs and not (uniform and p.places_hot_set) for p in pols) \
                    and not o.calibrate_on_replay:
                # The calibration twin: the replayed traces' expert popularity (one seed), other
                # draws, so "the hottest experts" are the replayed routing's hot experts without
                # the placement having seen the draws it is judged on.
                base = SyntheticParams()
                params = SyntheticParams(tokens=o.tokens, batch=batches[0], prompt_len=prompts[0],
                                         draw_seed=base.seed + CALIBRATION_SEED_OFFSET)
                calibration[spec.name] = synthetic_trace(spec, params).true_ids
                calibration_source = (f"a second synthetic trace (the same expert popularity, other draws: "
                                      f"draw seed {params.draw_seed})")
    if uniform and any(p.places_hot_set for p in pols):
        notes.append(f"hot-experts places experts as {eng.name} does by default, by {UNIFORM}; --calibrate-on-replay "
                     "(or --placement-from with --trace) places them by routing frequency")
    if calibration:
        who = "cpu-on-miss places" if uniform else "hot-experts and cpu-on-miss place"
        notes.append(f"{who} experts by the routing of {calibration_source}, not the replayed trace")
    if o.calibrate_on_replay:
        notes.append("optimistic: hot-experts places experts by the replayed trace's own routing (it has seen the "
                     "future), an upper bound")
    host_names = tuple(o.hosts) if o.hosts else (None,)
    used_hosts = [resolve_host(host_table, h) for h in host_names if h]
    used_hosts += [resolve_host(host_table, None, m.gpus[0]) for m in profiles
                   if not o.hosts and m.gpus and m.gpus[0].host]
    distinct_hosts = list({h.name: h for h in used_hosts}.values())
    notes.extend(check_threads(o.threads, distinct_hosts))
    if any(p.uses_host for p in pols):
        notes.extend(sockets_notes(distinct_hosts, eng))
    if o.address is not None and o.backend != "ray":
        notes.append("--address was given, but the backend is local: it changed nothing")
    if any(p.uses_host for p in pols) and not o.hosts or any(m.n_gpus == 0 for m in profiles) and not o.hosts:
        for prof in profiles:
            resolve_host(host_table, None, prof.gpus[0] if prof.gpus else None)  # a machine without a host: one line
    layers = tuple(o.cpu_layers) if o.cpu_layers else default_cpu_layers([t.model for t in traces.values()])
    sweep = Sweep(traces, profiles, list(policies), list(o.link_gbps) if o.link_gbps else [None],
                  list(o.cache_gib), o.eviction, o.sim, expert_dtypes=tuple(o.expert_dtypes) if o.expert_dtypes else (None,),
                  hosts=host_names, cpu_layers=layers,
                  gpu_expert_gib=tuple(o.gpu_expert_gib) if o.gpu_expert_gib else ("auto",),
                  copy_queues=tuple(o.copy_queues) if o.copy_queues else ("fifo",),
                  prefetch_top=tuple(o.prefetch_top) if o.prefetch_top else (None,),
                  calibration=calibration or None, calibration_source=calibration_source,
                  calibrate_on_replay=o.calibrate_on_replay, engine=o.engine, engine_profile=eng,
                  resolved={p.name: p for p in pols}, **o.host_knobs(), host_ram_gb=o.host_ram_gb,
                  cache_per_layer=o.cache_per_layer,
                  gpu_layers=tuple(o.gpu_layers) if o.gpu_layers else ("auto",),
                  offload_gib=tuple(o.offload_gib) if o.offload_gib else ("auto",), split=o.split,
                  ratios=tuple(o.ratios) if o.ratios is not None else None, host_profiles=host_table)
    n_groups = len(sweep.groups())
    workers = 1 if o.backend != "local" else max(1, min(o.jobs or os.cpu_count() or 1, n_groups))
    per_trace = {k: max(1, n // max(1, len(traces))) for k, n in
                 budget.runs_by_kind([sweep.resolved[g.policy] for g in sweep.groups()]).items()}  # alike per trace
    budget.check(budget.sweep_estimate([(t.model, t.n_tokens, t.batch) for t in traces.values()], per_trace,
                                       sweep.group_size, o.sim, workers))
    rows = run_sweep(sweep, o.jobs, progress, backend=o.backend, address=o.address, out=o.rows_csv, notes=notes)
    by_hw = {h.name: best([r for r in rows if r["hw"] == h.name], o.goal) for h in sweep.hws}
    if len(set(o.expert_dtypes or ())) > 1:
        from moesim.sim.answer import Timed, lighter_but_slower  # answer imports the sweep: not at module level
        notes += lighter_but_slower(rows, sweep.engine_profile, Timed.of(sweep))
    if any(t.synthetic for t in traces.values()):
        notes.insert(0, "synthetic traces: routing and predictions are generated, not recorded")
    return WhatIf(sweep, o.goal, rows, best(rows, o.goal), by_hw, any(t.synthetic for t in traces.values()), notes)


def split_notes(split: str, ratios, gpu_counts: list[int]) -> list[str]:
    """A note for ``--split``/``--tensor-split`` given where they change nothing: no machine of
    several GPUs, or shares with a tensor split (which spreads every layer evenly)."""
    most = max(gpu_counts, default=1)
    several = f"no machine has several GPUs ({'none' if most == 0 else 'one GPU at most'})" if len(gpu_counts) > 1 \
        else f"the machine has {most or 'no'} GPU{'s' if most != 1 else ''} (a split needs several)"
    notes = []
    if split != "layer" and most < 2:
        notes.append(f"--split {split} was given, but {several}: it changed nothing")
    if ratios is not None and (most < 2 or split != "layer"):
        notes.append("--tensor-split was given, but " + (several if most < 2 else f"--split {split} spreads every "
                     "layer over all the GPUs (the shares are a layer split's)") + ": it changed nothing")
    return notes


def profile_notes(policy: str, eviction: str, given: set[str], cached: bool, hardware: bool) -> list[str]:
    """``moesim profile``: a note for each option typed that the run does not use (the
    :func:`unused_options` wording)."""

    if hardware:
        return []
    pol = get_policy(policy)
    typed = Given(eviction=eviction if "--eviction" in given else None, cached=cached,
                  link_given="--link-gbps" in given)
    notes = unused_options([pol], typed, verb="chosen")
    if "--predictor" in given and "--predictor" not in pol.knobs:
        notes.append("--predictor was given, but none of the chosen policies uses it (only the prefetching "
                     "policies): it changed nothing")
    if "--name" in given:
        notes.append("--name was given, but only --hardware uses it: it changed nothing")
    return notes
