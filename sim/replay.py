"""Replay one trace under several policies on one hardware profile: ``moesim replay``.

Which profile: the one named, else the one the trace was recorded on, else
:data:`moesim.hardware.DEFAULT_PROFILE` (a synthetic trace records none); the result says
which of the three it was, so no printed number hides where its hardware came from.

Which link: ``link_gbps`` when given; else, when the profile is the one the trace was
recorded on, the link the recording used (``trace.meta.link_gbps`` and its latency: a run
recorded at 0.5 GB/s replays at 0.5 GB/s, not at the profile's nominal figure); else the
profile's own. ``moesim replay --validate`` goes one step further and uses the rate the
recorded copies actually achieved (:func:`moesim.sim.validate.recorded_profile`), which is
why its prediction can differ from a plain replay's; both say which link they used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moesim import budget
from moesim.engines import get_engine
from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, Machine, get_host, get_machine, get_profile
from moesim.models import ModelSpec, get_model
from moesim.policy import Policy, as_policy, get_policy, runs_on
from moesim.setting import Setting
from moesim.sim.cpu_compute import load_calibration, separate_calibration
from moesim.sim.intervals import kind_of, with_range
from moesim.sim.prefetch_top import keep_top_predictions
from moesim.sim.quantised import with_expert_dtype
from moesim.sim.simulate import SimResult, simulate_policies
from moesim.sim.sweep import policy_family
from moesim.sim.whatif import Given, check_threads, check_values, split_notes, unused_options
from moesim.traces.format import Trace, read_trace

DEFAULT_POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle")


def trace_profile(trace: Trace, hw: str | Machine | None = None) -> tuple[HardwareProfile | Machine, str]:
    """(profile, where its name came from): ``hw`` (a GPU profile, or a machine of several
    GPUs or none: :func:`moesim.hardware.get_machine`), the trace's recording profile, or
    the default."""
    if hw:
        machine = get_machine(hw)
        return (machine.gpus[0] if machine.n_gpus == 1 else machine), "named"
    recorded = trace.meta.hw_profile
    if recorded:
        return get_profile(recorded), "recorded in the trace"
    return get_profile(DEFAULT_PROFILE), "default: the trace records no hardware"


def check_trace_model(trace: Trace, model: str | ModelSpec, where: str | Path = "the trace") -> None:
    """Error unless ``trace`` was recorded for ``model``'s routing geometry (MoE layers, experts, top-k)."""
    want = get_model(model) if isinstance(model, str) else model
    got = trace.model
    if (want.n_moe_layers, want.n_experts, want.top_k) != (got.n_moe_layers, got.n_experts, got.top_k):
        raise MoesimError(f"{where} was recorded for {got.name} ({got.n_moe_layers} MoE layers, "
                          f"{got.n_experts} experts, top-{got.top_k}), not {want.name}")


@dataclass
class Replay:
    trace: Trace
    profile: HardwareProfile | Machine
    profile_source: str  # named / recorded in the trace / default
    results: list[SimResult]
    link_source: str = "the profile's"  # given / recorded in the trace / the profile's
    cache_source: str = "given"  # given / recorded in the trace
    step: int = 1  # the decode step the report's timeline shows
    note: str | None = None  # the options given that changed nothing (:func:`unused_notes`)
    calibration: dict[str, Any] | None = None  # the engine profile's, when calibrated (moesim fit --measured)
    policies: tuple[Policy, ...] = ()  # each result's policy, in order (empty: read from the rows' names)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row a policy, each with the range its prediction's class errs within
        (:mod:`moesim.sim.intervals`, as whatif's rows)."""
        gpus = self.profile.n_gpus if isinstance(self.profile, Machine) else 1
        rows = [{**r.summary(), "hw_source": self.profile_source, "link_source": self.link_source}
                for r in self.results]
        pols = self.policies or [r["policy"] for r in rows]
        return [with_range(r, self.calibration, kind_of(policy_family(p), gpus, r)) for r, p in zip(rows, pols, strict=True)]


def replay_link(trace: Trace, profile: HardwareProfile, profile_source: str,
                link_gbps: float | None) -> tuple[HardwareProfile, str]:
    """(profile carrying the link to replay with, where that link came from); see the module docstring."""
    if link_gbps is not None:
        return profile.with_figure("h2d_pinned_gbs", link_gbps, "estimate", "--link-gbps"), "given"
    meta = trace.meta
    if profile_source.startswith("recorded") and meta.link_gbps is not None:
        profile = profile.with_figure("h2d_pinned_gbs", meta.link_gbps, "measured", "the trace's recorded link")
        if meta.latency_us is not None:
            profile = profile.with_figure("transfer_latency_us", meta.latency_us, "measured", "the trace's recorded link")
        return profile, "recorded in the trace"
    return profile, "the profile's"


@dataclass(frozen=True)
class TraceChanges:
    """What-ifs on the replayed trace itself (each None: none): ``expert_dtype`` stores the
    routed experts in another format (moesim.sim.quantised), ``prefetch_top`` prefetches only
    each sequence's ``m`` most confident predicted experts (moesim.sim.prefetch_top; None: as
    recorded), and ``placement_from`` names the calibration trace whose routing places the
    hot experts (docs/policies.md)."""

    expert_dtype: str | None = None
    prefetch_top: int | None = None
    placement_from: str | Path | None = None


NO_CHANGES = TraceChanges()
#: A replay's default setting: the cache, eviction and copy queue the trace was recorded
#: with (a field left None: as recorded), every other knob at its default.
REPLAY_DEFAULT = Setting(cache_gib=None, cache_experts=None, eviction=None, copy_queue=None)


def replay_setting(**given: Any) -> Setting:
    """A replay's setting: the knobs ``given`` (fields of :class:`~moesim.setting.Setting`),
    the cache, eviction and copy queue left out as the trace was recorded."""
    return replace(REPLAY_DEFAULT, **given)


def replay(trace: Trace | str | Path, hw: str | Machine | None = None,
           policies: list[str | Policy] | tuple[str | Policy, ...] = DEFAULT_POLICIES,
           given: Setting = REPLAY_DEFAULT, changes: TraceChanges = NO_CHANGES, *, step: int | None = None,
           where: str | Path | None = None, progress: Callable[[int, int], None] | None = None,
           as_recorded: bool = False) -> Replay:
    """Simulate a (non-speculative) trace under each policy, set up as ``given``
    (:func:`replay_setting`: the knobs given, the cache left out as recorded) with the what-ifs
    ``changes`` on the trace itself. ``step`` must be one of the trace's steps (the report's
    timeline shows it); ``where`` names the trace in errors; ``progress(done, total)`` counts
    layer-steps planned and timed, for a progress bar on long traces; ``as_recorded`` keeps
    the recorded predictor time in every policy's measured compute
    (:func:`moesim.sim.simulate.simulate`'s, as validation replays the measured run)."""
    where = where or ("the trace" if isinstance(trace, Trace) else trace)
    check_given(given, changes)  # whatif's checks of the options both take, before the trace is read
    # Names resolved once, here (the CLI hands objects already): what runs below takes the objects.
    policies = [as_policy(p) for p in policies]
    machine = get_machine(hw) if hw is not None else None
    engine_given = given.engine is not None
    given = replace(given, engine=get_engine(given.engine))
    trace = trace if isinstance(trace, Trace) else read_trace(trace)
    if trace.speculative:
        raise MoesimError("a speculative-decoding trace: replay it with moesim.sim.speculative.speculative_whatif")
    profile, source = trace_profile(trace, machine)
    if step is None:
        step = min(1, trace.n_tokens - 1)  # the report's timeline: the second step (the first warms the cache)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < trace.n_tokens:
        last = trace.n_tokens - 1
        raise MoesimError(f"--step {step}: the trace has {trace.n_tokens} decode step(s), numbered from 0: give "
                          + ("0" if last == 0 else f"0 to {last}"))
    engine_note = None
    if engine_given:  # the policies the engine runs, as whatif keeps them
        names, engine_note = runs_on(given.engine, [p.name for p in policies])
        policies = [p for p in policies if p.name in names]
    budget.check(budget.replay_estimate(trace.model, trace.n_tokens, trace.batch, budget.runs_by_kind(policies),
                                        given.sim))
    profile, link_source = replay_link(trace, profile, source, given.link_gbps)
    setting = replace(given, link_gbps=None)  # the profile carries the link now
    if changes.expert_dtype is not None:
        trace = with_expert_dtype(trace, changes.expert_dtype)
    prefetch_top = changes.prefetch_top
    if prefetch_top is None and trace.header.get("prefetch_top_m"):
        prefetch_top = int(trace.header["prefetch_top_m"])  # as recorded (moesim profile --prefetch-top)
    if prefetch_top is not None:
        trace = keep_top_predictions(trace, prefetch_top)
    if changes.placement_from is not None:
        setting = replace(setting, calibration=separate_calibration(
            load_calibration(str(changes.placement_from), trace.model), trace, changes.placement_from))
    setting, cache_source = recorded_cache(trace, setting)  # the cache as given, else as recorded
    note = unused_notes(policies, machine, given, changes,
                        cached=bool(setting.cache_gib) or bool(setting.cache_experts))
    note = "; ".join(n for n in (engine_note, note) if n) or None
    results = simulate_policies(trace, profile, policies, setting, progress=progress, as_recorded=as_recorded)
    note = "; ".join(n for n in (note, fit_note(results), capped_note(results, setting.offload_gib)) if n) or None
    cal = given.engine.calibration if engine_given else None
    return Replay(trace, profile, source, results, link_source, cache_source, step, note, cal, tuple(policies))


def check_given(given: Setting, changes: TraceChanges = NO_CHANGES) -> None:
    """``given`` and ``changes`` checked by the one definition whatif's options go through
    (:func:`moesim.sim.whatif.check_values`): ``--threads 0`` or ``--gpu-layers -5`` is one line in
    both commands, never a note that it changed nothing."""
    def one(v):
        return None if v is None else [v]

    check_values(eviction=given.eviction, sim=given.sim, link_gbps=one(given.link_gbps), cache_gib=one(given.cache_gib),
                 cache_experts=one(given.cache_experts), copy_queues=one(given.copy_queue),
                 expert_dtypes=one(changes.expert_dtype), threads=given.threads, lookaheads=one(given.lookahead),
                 cpu_layers=one(given.cpu_layers), gpu_layers=one(given.gpu_layers),
                 gpu_expert_gib=one(given.gpu_expert_gib), offload_gib=one(given.offload_gib),
                 prefetch_top=one(changes.prefetch_top), ratios=given.ratios)


def fit_note(results: list) -> str | None:
    """The policies whose configuration needs more device memory than the GPU has: their
    times assume it fits (whatif marks such rows and never picks one; replay says so)."""
    over = [r.summary() for r in results]
    over = [r for r in over if r.get("fits") is False]
    if not over:
        return None
    def more_than(hw: str) -> str:  # a machine of several GPUs: the fullest one's need against one's memory
        gpus = get_machine(hw).device_memory_gb()
        return f"the {hw}'s" if len(gpus) < 2 else f"one of its GPUs holds ({', '.join(f'{number(g)}' for g in gpus)} GB)"

    return "; ".join(f"{r['policy']} needs {number(r['device_gb_needed'])} GB of device memory, more than "
                     f"{more_than(r['hw'])}: it does not fit, and its times are as if it did" for r in over)


def capped_note(results: list, offload_gib: float | str | None) -> str | None:
    """weight-streaming asked to keep more GiB in host memory than its layers hold: all are (vLLM
    allows a --cpu-offload-gb past the model too), and the replay says how much that is."""
    if not isinstance(offload_gib, int | float):
        return None
    capped = [r.summary() for r in results]
    capped = [r for r in capped if r["policy"] == "weight-streaming" and r.get("offload_gib", offload_gib) < offload_gib]
    return "; ".join(f"--offload-gib {number(offload_gib)} is more than {r['model']}'s layers hold: every layer's weights, "
                     f"{number(r['offload_gib'])} GiB, are read over the link" for r in capped) or None


def recorded_cache(trace: Trace, s: Setting) -> tuple[Setting, str]:
    """``s`` with the cross-token cache and eviction the trace was recorded with wherever the
    caller left them unset (None), and where the cache came from. Why: a trace recorded
    with a 32-expert LRU cache replayed with no cache predicts a different run than the one
    measured; the recorded configuration is the default, like the recorded link."""
    source = "given"
    if s.cache_gib is None and s.cache_experts is None:
        s = replace(s, cache_gib=0.0, cache_experts=trace.meta.cache_experts)
        source = "recorded in the trace"
    if s.eviction is None:
        s = replace(s, eviction=trace.meta.eviction)
    return replace(s, cache_gib=s.cache_gib or 0.0, cache_experts=s.cache_experts or 0), source


def unused_notes(policies, hw: str | Machine | None, given: Setting, changes: TraceChanges = NO_CHANGES, *,
                 cached: bool = False) -> str | None:
    """One line naming every option given that none of the replayed policies uses
    (:func:`moesim.sim.whatif.unused_options`, the definition whatif uses), or None. ``given``
    and ``changes`` as given (``None``: left out); ``cached``: the cache the replay runs
    (given, else recorded) is above 0, for no cache evicts nothing; a split other than layer
    needs several GPUs."""
    machine = get_machine(hw) if hw is not None else None
    gpus = machine.n_gpus if machine is not None else 1
    typed = Given([given.host] if given.host else None, [given.cpu_layers],
                  [given.gpu_expert_gib] if given.gpu_expert_gib is not None else None, [given.copy_queue],
                  [changes.prefetch_top] if changes.prefetch_top is not None else None, [given.gpu_layers],
                  [given.offload_gib], [given.lookahead] if given.lookahead is not None else None,
                  placement_from=changes.placement_from, calibrate_on_replay=given.calibrate_on_replay,
                  amx=given.amx, eviction=given.eviction, cached=cached, threads=given.threads,
                  link_given=given.link_gbps is not None, cache_given=bool(given.cache_gib) or bool(given.cache_experts),
                  cache_per_layer=given.cache_per_layer)
    notes = unused_options([get_policy(p) for p in policies], typed, pinned_hot_set=True, no_gpu=gpus == 0,
                           verb="replayed")
    notes += split_notes(given.split, given.ratios, [gpus])
    default = machine.gpus[0] if machine is not None and machine.gpus and machine.gpus[0].host else None
    if given.threads is not None and (given.host or default):
        notes += check_threads(given.threads, [get_host(given.host, default)])
    return "; ".join(notes) if notes else None
