import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.sim.whatif import Sweep, best, device_bytes_needed, run_sweep
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
    direct = simulate(sweep.traces["olmoe-1b-7b"], get_profile("rtx4090"), "prefetch", cache_gib=1, link_gbps=8,
                      engine="simpy").summary()
    assert row["tpot_ms"] == pytest.approx(direct["tpot_ms"], rel=1e-9)


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
    resident = device_bytes_needed(spec, "all-resident", 0, 1, 0)
    assert resident == spec.non_expert_bytes + spec.all_expert_bytes
    offload = device_bytes_needed(spec, "on-demand", 10, 1, 0)
    # The executor's pool: two whole layers (prefill is double-buffered) plus the cache.
    assert offload == spec.non_expert_bytes + (2 * spec.n_experts + 10) * spec.expert_bytes


def test_bad_sweeps_are_rejected(sweep):
    with pytest.raises(MoesimError):
        Sweep(sweep.traces, sweep.hws, ["on-demand"], [0.0], [0.0])
    with pytest.raises(MoesimError):
        Sweep(sweep.traces, sweep.hws, ["nope"], [None], [0.0])
