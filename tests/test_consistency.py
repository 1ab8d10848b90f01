"""One deployment, one number: every path a command takes to a TPOT gives the same TPOT.

The cases are generated from the registries (every registered policy, copy queue,
eviction, expert format the model can store, and the CPU-compute policies), so a policy,
queue or format that joins the project joins this test. For each deployment the paths
are: ``simulate`` on both engines, ``moesim replay`` (:func:`moesim.sim.replay.replay`),
``moesim whatif`` (:func:`moesim.sim.sweep.run_sweep`, local backend), the deployment
answer built from the sweep's rows (:func:`moesim.sim.answer.deployment_answer`) and
validation's predictor (:func:`moesim.sim.validate.validate_trace`) on a trace with
measured times.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.models import DTYPES, get_model
from moesim.policy import EVICTIONS, POLICIES, QUEUES
from moesim.setting import Setting
from moesim.sim.answer import deployment_answer
from moesim.sim.replay import TraceChanges, replay, replay_setting
from moesim.sim.simulate import simulate
from moesim.sim.sweep import Sweep, run_sweep
from moesim.traces.format import read_trace, write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

HW, LINK = "a6000", 2.0
RTOL = 1e-9
MODEL = "olmoe-1b-7b"  # 16 MoE layers of 64 experts, top-8: small and real-shaped
#: Real routing (the shipped learned-routing model, recorded through transformers): its
#: predictions are ordered by the predictor's confidence, so a prefetch's useful copies are
#: not simply its first ones (what the copy queues' waits depend on).
REAL = Path(__file__).resolve().parents[1] / "traces" / "examples" / "moe-stdlib-routing.npz"


@pytest.fixture(scope="module", params=["real", "synthetic"])
def trace(request):
    if request.param == "real":
        return read_trace(REAL).head(12)
    return synthetic_trace(get_model(MODEL), SyntheticParams(tokens=6, prompt_len=16, seed=5, hit_rate=0.6))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory, trace):
    """A calibration trace for the placements (the same model, other draws)."""
    t = synthetic_trace(trace.model, SyntheticParams(tokens=12, prompt_len=16, seed=6))
    return write_trace(t, tmp_path_factory.mktemp("cal") / "cal.npz"), t.true_ids


def _formats():
    spec = get_model(MODEL)
    out = []
    for d in DTYPES:
        try:
            spec.with_expert_dtype(d)
        except MoesimError:
            continue
        out.append(d)
    return out


def _copy_cases():
    """Every copy policy x cache (none, small) x eviction, the prefetching ones x every
    copy queue, and every storable expert format under one prefetching policy."""
    cases = []
    for name, pol in POLICIES.items():
        if pol.uses_host:
            continue
        caches = [0.0, 0.05] if "--cache-gib" in pol.knobs else [0.0]
        queues = QUEUES if pol.predicts else ("fifo",)
        for cache in caches:
            for ev in EVICTIONS if cache else ("lru",):
                for q in queues:
                    cases.append((name, cache, ev, q, None))
    cases += [("prefetch-fom", 0.05, "lru", "fifo", d) for d in _formats()]
    return cases


def _tpot(result) -> float:
    return float(result.tpot.mean())


def _sweep_row(trace, policy, cache, eviction, queue, dtype, **axes):
    sweep = Sweep({trace.model.name: trace}, [get_profile(HW)], [policy], [LINK], [cache], eviction, "fast",
                  expert_dtypes=(dtype,), copy_queues=(queue,), **axes)
    rows = run_sweep(sweep, jobs=1)
    assert len(rows) == 1, rows
    return rows[0], rows


@pytest.mark.parametrize("policy, cache, eviction, queue, dtype", _copy_cases())
def test_copy_policies_get_one_number_from_every_path(trace, policy, cache, eviction, queue, dtype):
    hw = get_profile(HW)
    kw = dict(cache_gib=cache, eviction=eviction, link_gbps=LINK, copy_queue=queue)
    t = trace
    if dtype is not None:
        from moesim.sim.quantised import with_expert_dtype

        try:
            t = with_expert_dtype(trace, dtype)
        except MoesimError:
            pytest.skip(f"{trace.model.name} cannot store its experts in {dtype}")
    ref = simulate(t, hw, policy, Setting(sim="simpy", **kw))
    want = _tpot(ref)
    if queue == "fifo":  # the compiled fast path times FIFO queues (copy queues: SimPy only)
        assert _tpot(simulate(t, hw, policy, Setting(sim="fast", **kw))) == pytest.approx(want, rel=RTOL)
    rep = replay(trace, HW, [policy], replay_setting(sim="simpy", **kw), TraceChanges(expert_dtype=dtype))
    assert rep.rows[0]["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)
    row, rows = _sweep_row(trace, policy, cache, eviction, queue, dtype)
    assert row["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)
    if not POLICIES[policy].oracle:  # the oracle is a bound, never the answer
        (answer,) = deployment_answer(rows)
        assert answer.winner["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("policy", [p for p, pol in POLICIES.items() if pol.uses_host])
def test_cpu_policies_get_one_number_from_every_path(trace, calibration, policy):
    path, ids = calibration
    hw = get_profile(HW)
    pol = POLICIES[policy]
    cache = 0.05 if pol.needs_cache else 0.0
    layers = 3 if "--cpu-layers" in pol.knobs else "auto"
    kw = dict(cache_gib=cache, link_gbps=LINK, cpu_layers=layers)
    calib = ids if "--placement-from" in pol.knobs else None
    want = _tpot(simulate(trace, hw, policy, Setting(sim="simpy", calibration=calib, **kw)))
    assert _tpot(simulate(trace, hw, policy, Setting(sim="fast", calibration=calib, **kw))) == pytest.approx(want, rel=RTOL)
    rep = replay(trace, HW, [policy], replay_setting(sim="simpy", **kw), TraceChanges(placement_from=path if calib is not None else None))
    assert rep.rows[0]["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)
    axes = dict(cpu_layers=(layers,), calibration={trace.model.name: ids} if calib is not None else None,
                calibration_source="a calibration trace")
    row, rows = _sweep_row(trace, policy, cache, "lru", "fifo", None, **axes)
    assert row["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)
    (answer,) = deployment_answer(rows)
    assert answer.winner["tpot_ms"] * 1e-3 == pytest.approx(want, rel=RTOL)


def _measured(trace):
    """``trace`` as if an executor had recorded it on a6000 at LINK GB/s: measured block times."""
    import copy

    from moesim.traces.format import Trace

    spec = trace.model
    rng = np.random.default_rng(0)
    t, m = trace.n_tokens, spec.n_moe_layers
    timings = {"attn_s": rng.uniform(1e-4, 2e-4, (t, spec.n_layers)), "expert_s": rng.uniform(3e-4, 6e-4, (t, m)),
               "other_s": rng.uniform(1e-4, 2e-4, t), "predict_s": np.full((t, spec.n_layers), 1e-5)}
    timings["tpot_s"] = timings["attn_s"].sum(1) + timings["expert_s"].sum(1) + timings["other_s"]
    header = copy.deepcopy(trace.header)
    header["recorded"] = {**header.get("recorded", {}), "hw_profile": HW, "link_gbps": LINK, "latency_us": 10.0}
    header["policy"] = {"name": "on-demand", "params": {}}
    return Trace(header, trace.prompt_ids, trace.token_ids, trace.true_ids, trace.true_gates, trace.pred_ids,
                 trace.pred_gates, trace.exec_ids, timings)


@pytest.mark.parametrize("policy", [p for p, pol in POLICIES.items() if not pol.uses_host])
def test_validations_predictor_is_replays_number(trace, policy):
    """Validation replays a measured run on its recorded profile and link; ``moesim replay``
    of the same trace with its measured times gives the same number (the recorded policy
    keeps the predictor time its run paid, ``as_recorded``, in both)."""
    from moesim.sim.validate import validate_trace

    measured = _measured(trace)
    _, predicted = validate_trace(measured, policy=policy, sim="simpy")
    rep = replay(measured, None, [policy], replay_setting(sim="simpy", timing="measured"),
                 as_recorded=policy == "on-demand")
    assert rep.rows[0]["tpot_ms"] * 1e-3 == pytest.approx(_tpot(predicted), rel=RTOL)


@pytest.mark.parametrize("machine", ["none", "2xa6000", "a6000+rtx4090"])
@pytest.mark.parametrize("policy", [p for p, pol in POLICIES.items()
                                    if pol.static_on(2) and pol.cannot_run_on(2) is None])
def test_machines_of_several_gpus_or_none_get_one_number(trace, machine, policy):
    """A static layout on a machine of several GPUs, or none: replay and the sweep agree."""
    if machine == "none" and policy != "all-resident":
        with pytest.raises(MoesimError, match="only all-resident"):
            replay(trace, machine, [policy], replay_setting(host="ryzen-7950x"))
        return
    from moesim.engines import get_engine

    engine = "llama.cpp" if get_engine("llama.cpp").runs(policy) else "pytorch-eager"  # replay keeps what it runs
    kw = dict(host="ryzen-7950x", engine=engine, threads=8)
    rep = replay(trace, machine, [policy], replay_setting(sim="fast", link_gbps=LINK, **kw)).rows[0]
    sweep = Sweep({trace.model.name: trace}, [machine], [policy], [LINK], [0.0], hosts=("ryzen-7950x",),
                  engine=engine, threads=8)
    (row,) = run_sweep(sweep, jobs=1)
    assert row["tpot_ms"] == pytest.approx(rep["tpot_ms"], rel=RTOL)
    assert row["hw"] == rep["hw"] and row["engine"] == rep["engine"] == engine and row["threads"] == 8


def test_a_static_layout_on_one_gpu_is_the_copy_paths_all_resident(trace):
    """All-resident on one GPU is timed by the copy path; the static layout of the same
    deployment (every layer on that GPU) gives the same TPOT and the same memory verdict."""
    from moesim.layout import make_layout
    from moesim.memory import device_bytes, layout_bytes
    from moesim.sim.static import simulate_static

    hw = get_profile(HW)
    copy_path = simulate(trace, hw, "all-resident", Setting(sim="fast"))
    static = simulate_static(trace, hw, "all-resident")
    assert _tpot(static) == pytest.approx(_tpot(copy_path), rel=RTOL)
    spec = trace.model
    ctx = trace.prompt_len + trace.n_tokens
    assert layout_bytes(spec, make_layout(spec, 1), context=ctx).gpu == [device_bytes(spec, "all-resident",
                                                                                      context=ctx)]
