"""Ctrl-C at any instant keeps every finished step: a real SIGINT to a real `moesim profile`,
and the library loops (profile, speculative decoding, training) stopped mid-run."""

import re
import signal
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from cli_signals import signal_when  # noqa: E402

from moesim.executor.interrupt import Interrupted, request_stop, stop_on_interrupt  # noqa: E402
from moesim.executor.model import ExecConfig, load_checkpoint, random_model  # noqa: E402
from moesim.executor.profile import Origin, ProfileSettings, build_trace, generate  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.models import get_model  # noqa: E402
from moesim.traces.format import read_trace, write_trace  # noqa: E402

HW = get_profile("a6000")
TOKENS = 30000  # ~30 s or more of decoding: never finished before the signal, even on a loaded machine


def _interrupt_profile(out, when: str, delay: float) -> tuple[int, str]:
    """Start `moesim profile --tokens TOKENS` with a live progress bar on stderr (as in a
    terminal); once the bar shows ``when`` ('start': drawn, before prefill; 'steps': at least
    one finished step), wait ``delay`` s and send SIGINT. Returns (exit code, stderr)."""
    fired: list[bool] = []

    def ready(text: str) -> bool:
        counts = [int(c) for c in re.findall(rf"(\d+)/{TOKENS}", text)]
        if not fired and counts and (when == "start" or max(counts) >= 1):
            time.sleep(delay)  # in the reader thread: the signal goes once this returns
            fired.append(True)
        return bool(fired)

    return signal_when(["profile", "--model", "tiny", "--tokens", TOKENS, "--out", out], ready, signal.SIGINT)


def test_sigint_to_moesim_profile_keeps_a_valid_trace(tmp_path):
    cases = [("start", 0.0), ("steps", 0.0), ("steps", 0.4)]
    results: dict[int, tuple[int, str]] = {}
    threads = [threading.Thread(target=lambda i=i, c=c: results.__setitem__(i, _interrupt_profile(tmp_path / f"{i}.npz", *c)))
               for i, c in enumerate(cases)]
    for t in threads:  # in parallel: each run spends most of its time starting up
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(len(cases))), "a run did not end after its SIGINT (see the warning)"
    kept = 0
    for i, (rc, err) in results.items():
        assert "Traceback" not in err, err
        path = tmp_path / f"{i}.npz"
        assert rc == 130, err  # stopped: 130 whether or not a step had finished
        assert err.strip().splitlines()[-1].startswith("interrupted"), err  # "(Ctrl-C)", or "before ... nothing to keep"
        if not path.exists():  # interrupted before a step finished: one line, nothing written
            continue
        trace = read_trace(path)
        assert 1 <= trace.n_tokens < TOKENS
        assert trace.token_ids.shape[1] == trace.true_ids.shape[0] == trace.timings["tpot_s"].shape[0] == trace.n_tokens
        assert f"kept {trace.n_tokens} of {TOKENS}" in " ".join(err.split())  # the CLI says what it kept
        kept += 1
    assert kept >= 2  # the runs interrupted after a finished step kept it


def _model():
    torch.set_num_threads(1)
    return random_model(ExecConfig(get_model("tiny"), rope_theta=1e4), seed=1)


def test_stop_request_finishes_the_step_in_flight_and_keeps_tokens_and_records_equal(tmp_path):
    model = _model()
    prompt = torch.tensor([[1, 2, 3]])
    st = ProfileSettings(policy="on-demand", tokens=20)

    def stop_at_four(i, n):
        if i == 4:
            request_stop()

    pre, records, out = generate(model, prompt, st, HW, progress=stop_at_four)
    assert len(records) == len(out) == 4
    trace = build_trace(model, prompt, st, HW, pre, records, out, Origin("cpu", True, "test"))
    back = read_trace(write_trace(trace, tmp_path / "t.npz"))
    assert back.n_tokens == back.token_ids.shape[1] == 4
    # A stop requested before the first step: one clear error, not an empty trace.
    with stop_on_interrupt(), pytest.raises(Interrupted, match="before the first decode step"):
        request_stop()
        generate(model, prompt, st, HW)


def test_speculative_decoding_stopped_keeps_finished_verification_steps(monkeypatch):
    from moesim.executor import speculative
    from moesim.executor.runtime import OffloadedDecoder
    from moesim.executor.transport import EmulatedLink

    target = _model()
    draft = random_model(ExecConfig(get_model("tiny").with_layers(2), rope_theta=1e4), seed=2)
    calls = []
    build = speculative.build_tree

    def build_and_stop_on_third(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            request_stop()
        return build(*a, **kw)

    monkeypatch.setattr(speculative, "build_tree", build_and_stop_on_third)
    dec = OffloadedDecoder(target, "on-demand", EmulatedLink(1e9, 0), predictor="stale")
    prompt = torch.tensor([[3, 1, 4, 1]])
    _, records, out = speculative.speculative_generate(dec, draft, None, prompt,
                                                       speculative.SpecSettings(2, 2, 2, "confidence", tokens=30))
    assert len(records) == 3  # the step that was drafting when asked to stop still finished
    assert out == [t for r in records for t in (r.row_tokens[0], *r.new_tokens)]
    assert out == speculative.greedy_reference(target, prompt, len(out))  # still lossless


def test_training_stopped_keeps_a_loadable_checkpoint(tmp_path):
    import json

    from moesim.executor.train import TrainConfig, stdlib_spec, train

    def stop_at_three(step, n, loss):
        if step == 3:
            request_stop()

    spec = stdlib_spec("t", layers=2, experts=4, top_k=2, hidden=16, inter=8, heads=2)
    rec = train(tmp_path, TrainConfig(steps=50, batch=2, seq=16, save_every=2), spec, progress=stop_at_three)
    assert rec["steps"] == 3 and "stopped by Ctrl-C after 3 of 50" in rec["status"]
    stored = json.loads((tmp_path / "training.json").read_text())
    assert stored["steps"] == 3 and [e["step"] for e in stored["evals"]] == [2, 3]
    m = load_checkpoint(tmp_path)
    assert m.spec.n_layers == 2 and m(torch.tensor([[1, 2]]), m.new_cache(1, 4), 0).isfinite().all()


def test_validation_suite_stopped_scores_the_finished_cases(tmp_path, monkeypatch):
    from moesim.executor import validation

    model = _model()
    hw = get_profile("a6000")
    machine = (hw.with_figure("copy_interference", 0.0, "estimate", "test")
               .with_figure("copy_interference_gbs", 1.0, "estimate", "test")
               .with_figure("wait_wakeup_us", 0.0, "estimate", "test"))
    monkeypatch.setattr(validation, "machine_profile", lambda: machine)  # skip the machine measurement
    monkeypatch.setattr(validation, "suite_models", lambda shipped: [("tiny", lambda: (model, None, True), [1.0, 2.0], 1)])
    monkeypatch.setattr(validation, "POLICIES", ("on-demand", "prefetch-fom"))
    started = []

    def stop_at_third_case(what: str, done: int, total: int) -> None:
        if "GB/s" in what:
            started.append(what)
            if len(started) == 3:  # the first case of the second link
                request_stop()

    monkeypatch.setattr(validation, "generate", _stale_generate(validation.generate))
    rows, traces, summary = validation.run_suite(tmp_path, tmp_path, tokens=4, progress=stop_at_third_case, repeats=1)
    assert sorted(traces) == ["tiny-1gbps-on-demand", "tiny-1gbps-prefetch-fom"]  # the third case did not finish
    assert [(r["policy"], r["case"]) for r in rows] == [("on-demand", "same-policy"), ("prefetch-fom", "same-policy"),
                                                         ("prefetch-fom", "transfer from on-demand")]
    assert "interrupted" in summary
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [f"{k}.npz" for k in sorted(traces)]


def _stale_generate(generate_):
    """The suite's runs with the stale predictor (the tiny model has no default vectors)."""
    def run(model, prompt, st, hw, dv=None, **kw):
        st.predictor = "stale"
        return generate_(model, prompt, st, hw, dv, **kw)
    return run
