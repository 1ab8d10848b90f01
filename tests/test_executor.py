"""The reference executor: exact policies are exact, the emulated link keeps time, traces
round-trip. Runs on the CPU with the emulated link (and on CUDA when present)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_models import sharp_tiny  # noqa: E402

from moesim.executor.profile import Origin, ProfileSettings, build_trace, calibrate, generate  # noqa: E402
from moesim.executor.transport import EmulatedLink, Transfer  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.setting import Setting  # noqa: E402
from moesim.traces.format import read_trace, write_trace  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def tiny(request):
    """The tiny model on each device present (CUDA: experts pinned in host memory)."""
    torch.set_num_threads(1)
    device = torch.device(request.param)
    model = sharp_tiny()  # experts matter and routing is not a tie
    dv = calibrate(model, torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0)))
    if device.type == "cuda":
        model.experts = [[w.pin_memory() for w in row] for row in model.experts]
    return model.to(device), dv.to(device)


HW = get_profile("a6000").with_figure("h2d_pinned_gbs", 0.2)
PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))


def _tokens(model, dv, **kw):
    st = ProfileSettings(tokens=10, **kw)
    _, records, out = generate(model, PROMPT, st, HW, dv)
    return torch.cat(out, 1), records


@pytest.mark.parametrize("policy, predictor, cache", [
    ("on-demand", "quasi", 0), ("prefetch-fom", "quasi", 0), ("prefetch-fom", "stale", 0), ("oracle", "quasi", 0),
    ("prefetch-spec", "oracle", 0), ("on-demand", "quasi", 10), ("prefetch-fom", "quasi", 20),
    ("prefetch-spec", "oracle", 12),
])
def test_exact_policies_decode_the_all_resident_tokens(tiny, policy, predictor, cache):
    model, dv = tiny
    ref, ref_rec = _tokens(model, dv, policy="all-resident")
    got, rec = _tokens(model, dv, policy=policy, predictor=predictor, cache_experts=cache, eviction="lfu")
    assert torch.equal(got, ref)
    torch.testing.assert_close(rec[-1].logits, ref_rec[-1].logits, rtol=1e-5, atol=1e-5)


def test_speculative_execution_with_a_real_predictor_changes_the_output(tiny):
    model, dv = tiny
    _, ref = _tokens(model, dv, policy="all-resident")
    _, spec = _tokens(model, dv, policy="prefetch-spec", predictor="stale")
    # The test model is random, so its predictions are poor and the outputs must move.
    assert not torch.allclose(spec[-1].logits, ref[-1].logits)


def test_policies_copy_what_the_shared_planner_decides(tiny):
    model, dv = tiny
    _, on_demand = _tokens(model, dv, policy="on-demand")
    _, resident = _tokens(model, dv, policy="all-resident")
    assert all(not r.copies for r in resident)
    for r in on_demand:  # every step copies each layer's union of the batch's true experts
        per_layer = [len({int(e) for e in r.true_ids[layer].ravel()}) for layer in range(4)]
        assert len(r.copies) == sum(per_layer)
        assert all(c.kind == 1 for c in r.copies)
    _, cached = _tokens(model, dv, policy="on-demand", cache_experts=64)  # every expert fits: later steps copy less
    assert sum(len(r.copies) for r in cached) < sum(len(r.copies) for r in on_demand)


def test_emulated_link_paces_to_latency_plus_bytes_over_bandwidth():
    """The link keeps an ideal FIFO clock: a copy lasts latency + bytes / bandwidth (longer
    only if the real memcpy is slower), the next starts when it ends, and the waiter is
    never woken before the clock says the copy landed. All on the link's own clock and in
    order of events; how promptly a loaded machine wakes the waiter is not asserted."""
    link = EmulatedLink(bandwidth=4e6, latency=50e-6)
    src = torch.arange(16384, dtype=torch.float32)  # 64 KiB: 16.4 ms on this link, ~10 us of memcpy
    ideal = 50e-6 + src.numel() * 4 / 4e6
    try:
        dst_a, dst_b = torch.zeros_like(src), torch.zeros_like(src)
        a, b = Transfer(0, 0, src.numel() * 4, 1), Transfer(0, 1, src.numel() * 4, 1)
        link.copy_batch([(dst_a, src, a, None), (dst_b, src, b, None)])
        link.wait([a, b])
        woke = link.now()
    finally:
        link.close()
    assert torch.equal(dst_a, src) and torch.equal(dst_b, src)
    assert a.start >= a.issue and b.start == a.end  # FIFO: the second starts when the first ends
    assert a.end - a.start >= ideal * (1 - 1e-9) and b.end - b.start >= ideal * (1 - 1e-9)
    assert woke >= b.end  # never signalled early


def test_trace_records_timings_and_round_trips(tiny, tmp_path):
    model, dv = tiny
    st = ProfileSettings(policy="prefetch-fom", tokens=6)
    prefill, records, out = generate(model, PROMPT, st, HW, dv)
    trace = build_trace(model, PROMPT, st, HW, prefill, records, out, Origin("cpu", True, "test model"))
    back = read_trace(write_trace(trace, tmp_path / "run.npz"))
    assert back.measured and back.n_tokens == 6 and back.batch == 2
    tm = back.timings
    np.testing.assert_array_equal(back.true_ids, trace.true_ids)
    assert (tm["tpot_s"] > 0).all() and (tm["copy_end_s"] >= tm["copy_start_s"]).all()
    # The parts of a step add up to the step: contiguous marks on one clock (a layer's attn_s
    # starts where the previous layer's experts ended), so only rounding separates them.
    parts = tm["attn_s"].sum(1) + tm["expert_s"].sum(1) + tm["stall_s"].sum(1) + tm["other_s"]
    np.testing.assert_allclose(parts, tm["tpot_s"], rtol=1e-6)
    assert (tm["predict_s"] <= tm["attn_s"]).all()  # the prediction is part of attn_s
    assert back.header["recorded"]["hw_profile"] == "a6000" and back.header["synthetic"] is True
    assert len(back.header["metrics"]["recall_at_k"]) == 4


def test_interrupted_run_keeps_finished_steps(tiny, tmp_path):
    model, dv = tiny

    def stop_after_three(i, n):
        if i == 3:
            raise KeyboardInterrupt

    st = ProfileSettings(policy="on-demand", tokens=10)
    prefill, records, out = generate(model, PROMPT, st, HW, dv, progress=stop_after_three)
    assert len(records) == 3
    trace = build_trace(model, PROMPT, st, HW, prefill, records, out, Origin("cpu", True, "test model"))
    assert read_trace(write_trace(trace, tmp_path / "cut.npz")).n_tokens == 3


def _gpu_validate_in_process(*args):
    import runpy
    import sys
    from unittest import mock

    rng, threads = torch.get_rng_state(), torch.get_num_threads()  # its random_model seeds torch
    try:
        with mock.patch.object(sys, "argv", ["gpu_validate", *args]):
            runpy.run_module("moesim.executor.gpu_validate", run_name="__main__")
    finally:
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)


def _gpu_validate_by_subprocess(*args):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moesim.executor.gpu_validate", *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr


# the script as `python -m` runs it, in this process (its torch import paid once); in a subprocess with -m slow
@pytest.mark.parametrize("run", [_gpu_validate_in_process,
                                 pytest.param(_gpu_validate_by_subprocess, marks=pytest.mark.slow)],
                         ids=["in-process", "subprocess"])
def test_gpu_validation_script_runs_in_smoke_mode(tmp_path, run):
    import json

    run("--smoke", "--tokens", "3", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["runs"]) == 8 and all(row["tpot_ms"] > 0 for row in summary["runs"])
    assert read_trace(tmp_path / "oracle-quasi-cache0.npz").measured


def test_replaying_an_on_demand_run_keeps_the_prediction_it_paid_for(tiny):
    """An on-demand run still runs its predictor (its trace stands in for the prefetching
    policies): validating it must charge that time, while a what-if of on-demand drops it.
    Charging it was missing and made every on-demand validation case too fast by about the
    recorded predict_s (2-9%)."""
    from moesim.sim.simulate import simulate
    from moesim.sim.validate import recorded_profile, validate_trace

    model, dv = tiny
    st = ProfileSettings(policy="on-demand", predictor="quasi", tokens=6)
    prefill, records, out = generate(model, PROMPT, st, HW, dv)
    trace = build_trace(model, PROMPT, st, HW, prefill, records, out, Origin("cpu", True, "test model"))
    predict = trace.timings["predict_s"].sum(1)
    assert (predict[1:] > 0).all()
    _, as_run = validate_trace(trace)
    what_if = simulate(trace, recorded_profile(trace), "on-demand", Setting(timing="measured"))
    np.testing.assert_allclose(as_run.tpot - what_if.tpot, predict, rtol=1e-6, atol=1e-9)


def test_prefetching_only_the_top_m_predictions_stays_exact_and_copies_ahead_less(tiny):
    """`--prefetch-top 1` copies ahead only each sequence's most confident prediction:
    outputs stay those of all-resident decoding, fewer experts are prefetched, and a replay
    of the trace cuts the predictions the same way (header prefetch_top_m): it plans
    exactly the prefetch copies the run made."""
    from moesim.sim.validate import validate_trace

    model, dv = tiny
    want, _ = _tokens(model, dv, policy="all-resident")
    full, rec_full = _tokens(model, dv, policy="prefetch-fom")
    top1, rec_top = _tokens(model, dv, policy="prefetch-fom", prefetch_top=1)
    assert torch.equal(top1, want) and torch.equal(full, want)
    n_full = sum(c.kind == 0 for r in rec_full for c in r.copies)
    n_top = sum(c.kind == 0 for r in rec_top for c in r.copies)
    assert 0 < n_top < n_full
    st = ProfileSettings(policy="prefetch-fom", tokens=10, prefetch_top=1)
    prefill, records, out = generate(model, PROMPT, st, HW, dv)
    trace = build_trace(model, PROMPT, st, HW, prefill, records, out, Origin("cpu", True, "test model"))
    assert trace.header["prefetch_top_m"] == 1
    _, sim = validate_trace(trace)
    assert int(sim.plan.prefetch.sum()) == int((trace.timings["copy_kind"] == 0).sum())


def test_the_steadiness_probe_brackets_each_run_and_reports_against_its_best():
    from moesim.executor.steady import SteadyMachine

    s = SteadyMachine()
    n = len(s.probes)
    assert s.run(lambda: "result") == "result" and len(s.probes) == n + 2
    s.probes = [2e-3] * 9 + [6e-3]  # as if the machine slowed to a third around one run (no wall time asserted)
    text = s.summary()
    assert "3.00x (max)" in text and "1.00x its best (median)" in text
