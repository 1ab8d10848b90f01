import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.memory import device_bytes
from moesim.models import get_model
from moesim.setting import Setting
from moesim.sim.sweep import Sweep, best, run_sweep
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


@pytest.fixture(scope="module")
def sweep():
    traces = {m: synthetic_trace(get_model(m), SyntheticParams(tokens=16, seed=2)) for m in ("tiny", "olmoe-1b-7b")}
    return Sweep(traces, [get_profile("a6000"), get_profile("rtx4090")], ["on-demand", "prefetch", "oracle", "all-resident"],
                 [8.0, 32.0], [0.0, 1.0])


def test_pool_and_inline_give_the_same_rows(sweep):
    inline = run_sweep(sweep, jobs=1)
    pooled = run_sweep(sweep, jobs=2)
    assert inline == pooled
    assert len(inline) == sweep.size


def test_sweep_rows_match_single_replays(sweep):
    from moesim.sim.simulate import simulate

    rows = run_sweep(sweep, jobs=1)
    row = next(r for r in rows if (r["model"], r["hw"], r["policy"], r["link_gbps"], r["cache_gib"]) ==
               ("olmoe-1b-7b", "rtx4090", "prefetch-fom", 8.0, 1.0))
    direct = simulate(sweep.traces["olmoe-1b-7b"], get_profile("rtx4090"), "prefetch", Setting(cache_gib=1, link_gbps=8, sim="simpy")).summary()
    assert row["tpot_ms"] == pytest.approx(direct["tpot_ms"], rel=1e-9)


def test_each_models_rows_carry_its_own_time_to_first_token(sweep):
    """A sweep memoises the time to first token across its groups; a model's rows never get
    another model's (the memo once keyed on the GPU and link alone)."""
    from moesim.sim.simulate import simulate

    rows = [r for r in run_sweep(sweep, jobs=1) if r["policy"] == "on-demand" and r["cache_gib"] == 0.0]
    assert len(rows) == 8
    for r in rows:
        direct = simulate(sweep.traces[r["model"]], get_profile(r["hw"]), "on-demand", Setting(link_gbps=r["link_gbps"]))
        assert r["ttft_ms"] == pytest.approx(direct.summary()["ttft_ms"], rel=1e-9), r["model"]


def test_best_skips_the_oracle_and_what_does_not_fit():
    rows = [
        {"policy": "oracle", "fits": True, "tpot_ms": 1.0},
        {"policy": "all-resident", "fits": False, "tpot_ms": 2.0},
        {"policy": "on-demand", "fits": True, "tpot_ms": 3.0},
    ]
    assert best(rows)["policy"] == "on-demand"
    with pytest.raises(MoesimError):
        best(rows, "vibes")


def test_memory_fit_uses_the_byte_accounting():
    spec = get_model("qwen3-30b-a3b")
    from moesim.memory import WORKSPACE_BYTES

    weights = spec.non_expert_bytes - spec.input_embedding_bytes  # the input table stays in host memory
    resident = device_bytes(spec, "all-resident")
    assert resident == weights + spec.all_expert_bytes + WORKSPACE_BYTES
    offload = device_bytes(spec, "on-demand", cache_experts=10)
    # The executor's pool: two whole layers (prefill is double-buffered) plus the cache.
    assert offload == weights + (2 * spec.n_experts + 10) * spec.expert_bytes + WORKSPACE_BYTES
    # Prefetching 2 layers ahead holds one more layer in flight.
    ahead = device_bytes(spec, "prefetch-fom", cache_experts=10, lookahead=2)
    assert ahead == offload + spec.n_experts * spec.expert_bytes


def test_bad_sweeps_are_rejected(sweep):
    with pytest.raises(MoesimError):
        Sweep(sweep.traces, sweep.hws, ["on-demand"], [0.0], [0.0])
    with pytest.raises(MoesimError):
        Sweep(sweep.traces, sweep.hws, ["nope"], [None], [0.0])


# --------------------------------------------------------------------------------------
# Scale: the batched fast path, streaming, resuming, failures, backends
# --------------------------------------------------------------------------------------


def test_many_links_in_one_call_equal_one_call_per_link(sweep):
    from moesim.hardware import get_profile as profile
    from moesim.sim.fastpath import run_fast, run_fast_many
    from moesim.sim.plan import build_plan
    from moesim.sim.simulate import pick_costs
    from moesim.sim.workload import Link, make_workload

    trace = sweep.traces["olmoe-1b-7b"]
    hw = profile("a6000")
    from moesim.costmodel import CostModel

    work = make_workload(trace.model, build_plan(trace, "prefetch-fom", 30), pick_costs(trace, CostModel(trace.model, hw),
                                                                                        "auto"))
    links = [Link(2e-6 + trace.model.expert_bytes / (g * 1e9), interference=i, wakeup=w)
             for g, i, w in ((8, 0, 0), (32, 0.3, 0), (16, 0.2, 2e-5), (400, 0, 1e-5))]
    many = run_fast_many(work, links)
    for j, link in enumerate(links):
        for got, want in zip((m[j] for m in many), run_fast(work, link)):
            np.testing.assert_array_equal(got, want)


def _interrupt_after(n_calls):
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) > n_calls:
            raise KeyboardInterrupt

    return progress


def test_rows_stream_to_csv_and_a_rerun_resumes_from_them(sweep, tmp_path):
    whole = run_sweep(sweep, jobs=1)
    out = tmp_path / "sweep.csv"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, jobs=1, out=out, progress=_interrupt_after(3))  # 3 groups finished, then interrupted
    per_group = sweep.group_size
    assert len(out.read_text().splitlines()) == 1 + 3 * per_group  # header + the finished groups
    next_group = next(r for r in whole if r["group"] == 3)
    with out.open("a") as f:  # the next group half written when the process died: one row and a torn line
        f.write(",".join(str(v) for v in next_group.values()) + "\n" + "tiny,a6")
    seen = []
    resumed = run_sweep(sweep, jobs=1, out=out, progress=lambda d, t: seen.append(d))
    assert seen[0] == 3 * per_group  # the finished groups count as done at once; the rest ran
    assert resumed == whole
    assert len(out.read_text().splitlines()) == 1 + sweep.size
    again = []
    assert run_sweep(sweep, jobs=1, out=out, progress=lambda d, t: again.append(d)) == whole
    assert again == [sweep.size]  # nothing left to do


def test_resume_refuses_another_sweeps_output(sweep, tmp_path):
    out = tmp_path / "sweep.csv"
    small = Sweep(sweep.traces, sweep.hws[:1], ["on-demand"], [8.0], [0.0])
    run_sweep(small, jobs=1, out=out)
    other = Sweep(sweep.traces, sweep.hws[:1], ["on-demand"], [16.0], [0.0])
    with pytest.raises(MoesimError, match="different sweep"):
        run_sweep(other, jobs=1, out=out)
    foreign = tmp_path / "mine.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(MoesimError, match="not a resumable"):
        run_sweep(small, jobs=1, out=foreign)
    assert foreign.read_text() == "a,b\n1,2\n"  # never overwritten


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_group_is_named_and_the_rest_are_kept(sweep, tmp_path, monkeypatch, jobs):
    from moesim.sim import sweep as sweep_module

    real = sweep_module.run_group

    def flaky(sw, index):
        if index == 2:
            raise ValueError("worker ran out of luck")
        return real(sw, index)

    monkeypatch.setattr(sweep_module, "run_group", flaky)
    out = tmp_path / "sweep.csv"
    with pytest.raises(sweep_module.SweepError) as e:
        run_sweep(sweep, jobs=jobs, out=out)
    cfg = sweep.groups()[2]
    assert f"trace {cfg.trace}, policy {cfg.policy}, cache {cfg.cache_gib:g} GiB" in str(e.value)
    assert "worker ran out of luck" in str(e.value)
    assert len(e.value.rows) == sweep.size - sweep.group_size
    assert len(out.read_text().splitlines()) == 1 + sweep.size - sweep.group_size
    monkeypatch.setattr(sweep_module, "run_group", real)
    assert run_sweep(sweep, jobs=1, out=out) == run_sweep(sweep, jobs=1)  # the rerun does only the failed group


def test_ray_backend_without_ray_names_the_extra(sweep, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(MoesimError, match=r'pip install "moesim\[distributed\]"'):
        run_sweep(sweep, backend="ray")
    with pytest.raises(MoesimError, match="unknown backend"):
        run_sweep(sweep, backend="slurm")


@pytest.mark.slow
def test_ray_backend_gives_the_local_rows(sweep):
    ray = pytest.importorskip("ray", reason="ray is not installed (optional extra moesim[distributed])")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert run_sweep(sweep, backend="ray") == run_sweep(sweep, jobs=2)
    finally:
        ray.shutdown()


def test_replay_of_several_policies_reports_progress_and_equals_single_replays():
    from moesim.sim.simulate import simulate, simulate_policies

    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=40, seed=5))
    hw = get_profile("a6000")
    policies = ["on-demand", "prefetch-fom", "oracle"]
    seen = []
    results = simulate_policies(trace, hw, policies, Setting(sim="fast", cache_gib=1, link_gbps=16), progress=lambda done, total: seen.append((done, total)))
    total = 2 * 40 * trace.model.n_moe_layers * len(policies)
    assert seen[-1] == (total, total) and all(b >= a for (a, _), (b, _) in zip(seen, seen[1:]))
    for p, r in zip(policies, results):
        assert r.summary() == simulate(trace, hw, p, Setting(sim="fast", cache_gib=1, link_gbps=16)).summary()
    with pytest.raises(MoesimError, match="unknown policy"):
        simulate_policies(trace, hw, ["on-demand", "nope"])


def test_replay_memory_grows_linearly_with_the_trace():
    """Plans and timings are arrays over [token, layer]: a few bytes per token x layer x
    top-k for four policies' results beyond a fixed few MB (working buffers of the compiled
    planner); the old per-expert Python lists took ~100 bytes a unit more."""
    import tracemalloc

    from moesim.sim.simulate import simulate_policies

    spec = get_model("olmoe-1b-7b")
    policies = ["on-demand", "prefetch-fom", "oracle", "prefetch-spec"]
    # One untraced run first: loading the compiled kernels and the thread pools is a one-time
    # cost that the first traced run would otherwise charge to the trace.
    simulate_policies(synthetic_trace(spec, SyntheticParams(tokens=40, seed=1)), get_profile("a6000"), policies, Setting(sim="fast", cache_gib=1))
    sizes, peaks = (1200, 2400, 4800), []
    for tokens in sizes:
        trace = synthetic_trace(spec, SyntheticParams(tokens=tokens, seed=1))
        tracemalloc.start()
        simulate_policies(trace, get_profile("a6000"), policies, Setting(sim="fast", cache_gib=1))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    unit = spec.n_moe_layers * spec.top_k  # expert accesses a token
    slopes = [(peaks[i + 1] - peaks[i]) / ((sizes[i + 1] - sizes[i]) * unit) for i in range(2)]
    assert max(slopes) < 60, slopes  # bytes per added expert access, at every size (no super-linear term)
    assert peaks[-1] / (sizes[-1] * unit) < 60


KILLED_SWEEP = """
import os, signal, sys
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.sim.sweep import Sweep, run_sweep
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

traces = {m: synthetic_trace(get_model(m), SyntheticParams(tokens=16, seed=2)) for m in ("tiny", "olmoe-1b-7b")}
sweep = Sweep(traces, [get_profile("a6000"), get_profile("rtx4090")], ["on-demand", "prefetch", "oracle", "all-resident"],
              [8.0, 32.0], [0.0, 1.0])
calls = []

def die_after_two_groups(done, total):
    calls.append(done)
    if len(calls) == 3:  # the initial call, then two groups
        os.kill(os.getpid(), signal.SIGKILL)

run_sweep(sweep, jobs=1, out=sys.argv[1], progress=die_after_two_groups)
"""


def test_a_killed_sweep_process_resumes_where_it_died(sweep, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "rows.csv"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", KILLED_SWEEP, str(out)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert len(out.read_text().splitlines()) == 1 + 2 * sweep.group_size
    seen = []
    assert run_sweep(sweep, jobs=2, out=out, progress=lambda d, t: seen.append(d)) == run_sweep(sweep, jobs=1)
    assert seen[0] == 2 * sweep.group_size


def test_an_interrupted_pool_stops_and_resumes(sweep, tmp_path):
    out = tmp_path / "rows.csv"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, jobs=2, out=out, progress=_interrupt_after(2))
    finished = len(out.read_text().splitlines()) - 1
    assert finished % sweep.group_size == 0 and 0 < finished < sweep.size
    assert run_sweep(sweep, jobs=2, out=out) == run_sweep(sweep, jobs=1)


def test_every_sweep_field_enters_the_resume_fingerprint(sweep):
    """The fingerprint lists no fields by hand (issue 53): a field added to Sweep and forgotten
    there would let --rows resume rows computed under another value. Each field but those
    taken by content changes it."""
    import dataclasses

    from moesim.hardware import get_machine
    from moesim.sim.sweep import _BY_CONTENT

    base = sweep.fingerprint()
    for f in dataclasses.fields(Sweep):
        if f.name in _BY_CONTENT:
            continue
        changed = dataclasses.replace(sweep)
        value = ([get_machine("h100-sxm")] if f.name == "hws" else
                 sweep.engine_profile.with_figure("attention_kernels", 99) if f.name == "engine_profile" else
                 ("epyc-9654",) if f.name == "hosts" else ("another value",))
        object.__setattr__(changed, f.name, value)
        assert changed.fingerprint() != base, f.name
    # The traces by content: another trace of the same name and header is another sweep.
    other = dataclasses.replace(sweep, traces={k: v for k, v in list(sweep.traces.items())[:1]})
    assert other.fingerprint() != base
