"""Copy-queue disciplines executed: the queued emulated link (demand before prefetch,
cancellation of a prefetch's unstarted tail), the decoder driving it, and the simulator
replaying what it recorded. CPU only: a CUDA copy stream is FIFO (refused, see
docs/policies.md)."""

import json
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_run import both_ways, in_process  # noqa: E402
from tiny_models import sharp_tiny  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor.profile import Origin, ProfileSettings, build_trace, calibrate, generate  # noqa: E402
from moesim.executor.transport import QueuedEmulatedLink, Transfer  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402

SLOW = get_profile("a6000").with_figure("h2d_pinned_gbs", 0.02)  # copies ~30x a layer's compute: a backlog builds
PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))
QUEUED = ("demand-first", "cancel-unstarted")


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model = sharp_tiny()
    dv = calibrate(model, torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0)))
    return model, dv


def _run(model, dv, hw=SLOW, tokens=10, **kw):
    st = ProfileSettings(tokens=tokens, **kw)
    prefill, records, out = generate(model, PROMPT, st, hw, dv)
    return torch.cat(out, 1), records, (st, prefill, out)


# ---------------------------------------------------------------------------------------
# The link
# ---------------------------------------------------------------------------------------

def _item(kind: int, nbytes: int = 2000):
    return torch.empty(8), torch.ones(8), Transfer(0, 0, nbytes, kind), None


class _Held:
    """A copy destination that holds the link thread inside its copy until released, so the
    test knows which copy is under way whatever the machine's load (no sleeps)."""

    def __init__(self) -> None:
        self.entered, self.released = threading.Event(), threading.Event()

    def copy_(self, src) -> None:
        self.entered.set()
        assert self.released.wait(60)


def _held_item(kind: int = 0):
    held = _Held()
    return held, (held, torch.ones(8), Transfer(0, 0, 2000, kind), None)


def test_a_demand_copy_overtakes_queued_prefetch_copies_on_the_links_clock():
    """Four prefetch copies queued, the first under way, then a demand copy: on the link's
    own clock it starts when the copy under way ends, before the three still queued, which
    then follow it back to back; each copy has its own signal."""
    link = QueuedEmulatedLink(bandwidth=1e6, latency=0.0)  # 2 ms a copy
    held, first = _held_item()
    try:
        pre = link.copy_batch([first] + [_item(0) for _ in range(3)])
        assert held.entered.wait(60)  # the first prefetch copy is under way (and stays so until released)
        dem = link.copy_batch([_item(1)])
        held.released.set()
        link.wait(dem + pre)
    finally:
        link.close()
    d = dem[0]
    assert pre[0].start <= d.issue < pre[0].end  # issued while the first copy was under way
    assert d.start == pre[0].end  # ... and started the moment it ended, on the link's clock
    assert [p.start for p in pre[1:]] == [d.end, pre[1].end, pre[2].end]  # the queued ones after it
    assert len({id(t.done) for t in (*pre, d)}) == 5  # one signal a copy: a layer waits for its own only
    for t in (*pre, d):
        assert t.end - t.start >= 2e-3 - 1e-9  # paced: 2000 bytes at 1 MB/s


def test_cancel_drops_unstarted_copies_only_and_close_finishes_the_rest():
    link = QueuedEmulatedLink(bandwidth=1e6, latency=0.0)
    held, first = _held_item()
    pre = link.copy_batch([first] + [_item(0) for _ in range(4)])
    assert held.entered.wait(60)  # the first copy is under way: it cannot be withdrawn
    gone = link.cancel(pre[:1] + pre[3:])
    held.released.set()
    link.close()  # drains what is queued
    assert gone == pre[3:] and all(t.cancelled and not t.done.is_set() for t in gone)
    assert all(t.done.is_set() and not t.cancelled for t in pre[:3])
    assert link.closed()


# ---------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("queue", QUEUED)
@pytest.mark.parametrize("policy, cache", [("on-demand", 0), ("prefetch-fom", 0), ("prefetch-fom", 24), ("oracle", 0)])
def test_queued_copies_decode_exactly_the_all_resident_tokens(tiny, queue, policy, cache):
    model, dv = tiny
    want, ref, _ = _run(model, dv, policy="all-resident")
    got, rec, _ = _run(model, dv, policy=policy, predictor="stale", cache_experts=cache, copy_queue=queue)
    assert torch.equal(got, want)
    torch.testing.assert_close(rec[-1].logits, ref[-1].logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("queue", QUEUED)
def test_no_slot_gets_a_copy_while_an_earlier_copy_into_it_is_unfinished(tiny, monkeypatch, queue):
    """The slot-reuse rule: a layer lets go of its unneeded prefetched experts while their
    copies may still be queued (demand-first); such a slot takes a new copy only after the
    old one ended or was cancelled, else the late copy would overwrite the new expert. The
    pool is shrunk so that the decoder must wait for one (the path that waits is run too)."""
    import moesim.executor.runtime as rt

    model, dv = tiny
    monkeypatch.setattr(rt, "expert_slots", lambda spec, pol, cache=0, ahead=1: spec.n_experts + 4)  # prefill: one layer
    into: dict[int, Transfer] = {}
    reused_late = []
    real = QueuedEmulatedLink.copy_batch

    def checked(self, items):
        for dst, _, t, _ in items:
            old = into.get(dst.data_ptr())
            if old is not None and not (old.done.is_set() or old.cancelled):
                reused_late.append((old, t))
            into[dst.data_ptr()] = t
        return real(self, items)

    monkeypatch.setattr(QueuedEmulatedLink, "copy_batch", checked)
    want, _, _ = _run(model, dv, policy="all-resident")
    got, rec, _ = _run(model, dv, policy="prefetch-fom", predictor="stale", copy_queue=queue)
    assert not reused_late
    assert torch.equal(got, want)


def test_demand_first_starts_no_prefetch_copy_between_a_demand_copys_issue_and_its_start(tiny):
    """Within a step, under demand-first a queued prefetch never starts (on the link's clock)
    while a demand copy waits; under FIFO it does (the test can tell the two apart). Both are
    orders of events on the link's own clock: a copy's issue time is taken under the
    queue's lock, so a prefetch the link took before a demand's issue started before it,
    whatever the load. The link is slow enough (a backlog of seconds) for FIFO to show it."""
    model, dv = tiny

    def overtaken(records):
        n = 0
        for r in records:
            pre = [c for c in r.copies if c.kind == 0]
            for d in (c for c in r.copies if c.kind == 1):
                n += sum(d.issue < p.start < d.start - 1e-6 for p in pre)
        return n

    slower = SLOW.with_figure("h2d_pinned_gbs", 0.005)
    _, fifo, _ = _run(model, dv, hw=slower, policy="prefetch-fom", predictor="stale", tokens=4)
    _, first, _ = _run(model, dv, hw=slower, policy="prefetch-fom", predictor="stale", copy_queue="demand-first",
                       tokens=4)
    assert overtaken(fifo) > 0
    assert overtaken(first) == 0


def test_cancel_unstarted_copies_fewer_prefetched_experts_and_records_none_it_dropped(tiny):
    model, dv = tiny
    _, first, _ = _run(model, dv, policy="prefetch-fom", predictor="stale", copy_queue="demand-first")
    _, cancel, _ = _run(model, dv, policy="prefetch-fom", predictor="stale", copy_queue="cancel-unstarted")
    n_first = sum(c.kind == 0 for r in first for c in r.copies)
    n_cancel = sum(c.kind == 0 for r in cancel for c in r.copies)
    assert n_cancel < n_first
    assert all(not c.cancelled and c.end >= c.start >= 0 for r in cancel for c in r.copies)


@pytest.mark.parametrize("queue", QUEUED)
def test_a_replay_of_a_queued_run_times_it_with_the_recorded_queue(tiny, queue, tmp_path):
    """The header records the discipline; replay --validate and a plain replay use it, and
    the simulator plans exactly the copies the run made (cancelled ones excepted)."""
    from moesim.sim.replay import replay, replay_setting
    from moesim.sim.validate import validate_trace

    model, dv = tiny
    _, records, (st, prefill, out) = _run(model, dv, policy="prefetch-fom", predictor="stale", copy_queue=queue)
    trace = build_trace(model, PROMPT, st, SLOW, prefill, records, out, Origin("cpu", True, "test model"))
    assert trace.header["copy_queue"] == queue
    stats, sim = validate_trace(trace)
    assert sim.config["copy_queue"] == queue
    assert np.isfinite(stats["error"]) and (sim.tpot > 0).all()  # how close is the suite's to measure, not a test's
    kinds = trace.timings["copy_kind"]
    assert int(sim.plan.demand.sum()) == int((kinds == 1).sum())
    planned = int(sim.plan.prefetch.sum())
    assert planned == int((kinds == 0).sum()) if queue == "demand-first" else planned >= int((kinds == 0).sum())
    rows = replay(trace, policies=["prefetch-fom"]).rows
    assert rows[0]["copy_queue"] == queue
    assert "copy_queue" not in replay(trace, None, ["prefetch-fom"], replay_setting(copy_queue="fifo")).rows[0]
    with pytest.raises(MoesimError, match=f"recorded with copy queue '{queue}'.*(?i:simpy)"):
        replay(trace, None, ["prefetch-fom"], replay_setting(sim="fast"))
    from moesim.traces.format import write_trace

    write_trace(trace, tmp_path / "q.npz")  # the CLI's --validate: the recorded queue, or the one asked for
    for asked, used in ((None, queue), ("fifo", "fifo")):
        r = in_process("replay", tmp_path / "q.npz", "--validate", "--json", *(["--copy-queue", asked] if asked else []))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["copy_queue"] == used


# in a subprocess with -m slow: profile imports torch (5 s a process)
@pytest.mark.parametrize("run, args, says", both_ways([
    (["--copy-queue", "lifo"], "unknown copy queue"),
    (["--copy-queue", "demand-first", "--policy", "all-resident"], "applies to the copy policies"),
    (["--copy-queue", "cancel-unstarted", "--policy", "cpu-on-miss", "--cache-experts", "8"], "applies to the copy policies"),
], first=False, subprocesses=1))
def test_profile_refuses_a_queue_it_cannot_run_in_one_line(tmp_path, run, args, says):
    r = run("profile", "--tokens", "2", "--out", str(tmp_path / "x.npz"), *args, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "x.npz").exists()


def test_a_cuda_transport_refuses_a_queue_it_cannot_keep():
    from moesim.executor.runtime import make_transport

    with pytest.raises(MoesimError, match="emulated link only"):
        make_transport(torch.device("cuda"), 1e9, 1e-5, "demand-first")


def test_the_link_thread_stops_when_the_decoder_closes(tiny):
    model, dv = tiny
    before = {t.name for t in threading.enumerate()}
    _run(model, dv, policy="prefetch-fom", predictor="stale", copy_queue="demand-first")
    assert "moesim-queued-link" not in {t.name for t in threading.enumerate()} - before  # close() joined it


# ---------------------------------------------------------------------------------------
# The validation suite's copy-queue part
# ---------------------------------------------------------------------------------------

def test_the_queue_suite_scores_every_queue_and_keeps_whole_settings_on_ctrl_c(tiny, tmp_path, monkeypatch):
    """Two settings (one link, two predictors); Ctrl-C during the second keeps the first
    whole: three queues scored, a winner, the median traces; nothing of the second."""
    from moesim.executor import validation_queues
    from moesim.executor.interrupt import request_stop

    model, dv = tiny
    machine = (SLOW.with_figure("copy_interference", 0.0, "estimate", "test")
               .with_figure("copy_interference_gbs", 1.0, "estimate", "test")
               .with_figure("wait_wakeup_us", 0.0, "estimate", "test"))
    monkeypatch.setattr(validation_queues, "suite_models",
                        lambda shipped: [None, ("tiny", lambda: (model, dv, True), [], 1)])
    monkeypatch.setattr(validation_queues, "QUEUE_LINKS", (0.02,))
    seen = []

    def progress(doing: str) -> None:
        seen.append(doing)
        if "oracle" in doing and "cancel-unstarted, run 1/2" in doing:
            request_stop()

    rows, winners, summary = validation_queues.run_queue_suite(tmp_path, tmp_path, tokens=4, repeats=2,
                                                                progress=progress, machine_hw=machine)
    assert [(r["predictor"], r["queue"]) for r in rows] == [("stale", q) for q in ("fifo", "demand-first",
                                                                                   "cancel-unstarted")]
    assert all(r["runs"] == 2 and r["measured_min_ms"] <= r["measured_ms"] <= r["measured_max_ms"] for r in rows)
    fifo = rows[0]
    assert fifo["from_fifo_ms"] > 0 and np.isfinite(fifo["same_policy_error"])  # scored (accuracy: the suite's)
    assert len(winners) == 1 and winners[0]["measured_winner"] in {r["queue"] for r in rows}
    assert "copy queues (executed)" in summary
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == sorted(
        f"queues-0.02gbps-stale-{q}.npz" for q in ("fifo", "demand-first", "cancel-unstarted"))


def test_a_win_inside_the_runs_spread_is_a_tie():
    from moesim.executor.validation_queues import pick_winners

    def row(q, med, lo, hi, pred, runs=3):
        return {"model": "m", "link_gbps": 1.0, "predictor": "stale", "queue": q, "runs": runs, "measured_ms": med,
                "measured_min_ms": lo, "measured_max_ms": hi, "from_fifo_ms": pred}

    clear = pick_winners([row("fifo", 10, 9.8, 10.2, 10), row("cancel-unstarted", 9, 8.9, 9.1, 9.2)])[0]
    assert clear["measured_winner"] == "cancel-unstarted" and clear["clear"]
    assert clear["predicted_winner"] == "cancel-unstarted" and clear["margin"] == pytest.approx(1 / 9)
    tie = pick_winners([row("fifo", 10, 9.5, 10.5, 10), row("demand-first", 9.9, 9.6, 10.4, 10.1)])[0]
    assert tie["measured_winner"] == "demand-first" and not tie["clear"]
    same = pick_winners([row("fifo", 10, 9.5, 10.5, 10), row("demand-first", 9.9, 9.6, 10.4, 10)])[0]
    assert same["predicted_winner"] == "tie"
    one_run = pick_winners([row("fifo", 10, 10, 10, 10, 1), row("demand-first", 5, 5, 5, 5, 1)])[0]
    assert not one_run["clear"]
