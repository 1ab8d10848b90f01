"""``--lookahead N`` in the executor: MoE layer m's router predicts and prefetches MoE layer
m + N (the shared planner's ``prefetch_target``); the decoder waits for that prefetch at
layer m + N and keeps its slots until that layer ran. Exact policies stay exact, the
trace records N and ``pred_ids[:, m]`` is the prediction made N layers earlier."""


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_run import BOTH_WAYS  # noqa: E402
from tiny_models import sharp_tiny  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor import runs  # noqa: E402
from moesim.executor.model import Hooks, ResidentExperts, quasi_hidden  # noqa: E402
from moesim.executor.profile import Origin, ProfileSettings, build_trace, calibrate, generate  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.policy import Planner  # noqa: E402
from moesim.traces.format import read_trace, write_trace  # noqa: E402

HW = get_profile("a6000").with_figure("h2d_pinned_gbs", 0.1)
PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model = sharp_tiny()
    dv = calibrate(model, torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0)))
    return model, dv


def _run(model, dv, tokens=6, **kw):
    st = ProfileSettings(tokens=tokens, **kw)
    prefill, records, out = generate(model, PROMPT, st, HW, dv)
    return torch.cat(out, 1), records, (st, prefill, out)


@pytest.mark.parametrize("queue", ["fifo", "demand-first", "cancel-unstarted"])
@pytest.mark.parametrize("policy, predictor, cache", [
    ("prefetch-fom", "quasi", 0), ("prefetch-fom", "stale", 12), ("oracle", "quasi", 0), ("oracle", "quasi", 12),
])
def test_lookahead_2_decodes_the_all_resident_tokens(tiny, queue, policy, predictor, cache):
    model, dv = tiny
    want, ref, _ = _run(model, dv, policy="all-resident")
    got, recs, _ = _run(model, dv, policy=policy, predictor=predictor, cache_experts=cache, copy_queue=queue,
                        lookahead=2)
    assert torch.equal(got, want)
    torch.testing.assert_close(recs[-1].logits, ref[-1].logits, rtol=1e-5, atol=1e-5)
    moe = model.spec.moe_layers
    for r in recs:  # nothing is predicted for the first two MoE layers: no router two layers before them
        assert (r.pred_ids[:2] == -1).all() and (r.pred_gates[:2] == 0).all() and (r.pred_ids[2:] >= 0).all()
        assert all(moe.index(c.layer) >= 2 for c in r.copies if c.kind == 0)
    assert sum(c.kind == 0 for r in recs for c in r.copies) > 0


def test_the_trace_records_n_and_each_prefetch_is_issued_n_layers_ahead(tiny, tmp_path):
    """The header says ``lookahead: 2``; the copy records, in issue order, are each layer's
    demand copies then the prefetch of the layer two ahead (the layer a copy was issued at
    never goes back); and the shared planner, fed the recorded routing with the same
    lookahead, copies per step and layer exactly what the run copied, so ``pred_ids[:, m]``
    is the prediction that MoE layer m - 2's router made for m."""
    model, dv = tiny
    s = model.spec
    _, records, (st, prefill, out) = _run(model, dv, policy="prefetch-fom", predictor="stale", lookahead=2)
    back = read_trace(write_trace(build_trace(model, PROMPT, st, HW, prefill, records, out, Origin("cpu", True, "t")),
                                  tmp_path / "la.npz"))
    assert back.header["lookahead"] == 2 and back.meta.lookahead == 2
    tm = back.timings
    kinds, steps, issue = tm["copy_kind"], tm["copy_token"], tm["copy_issue_s"]
    moe = np.array([s.moe_layers.index(int(lay)) for lay in tm["copy_layer"]])
    issuer = np.where(kinds == 1, moe, moe - 2)  # the MoE layer whose router issued each copy
    assert (issuer >= 0).all() and ((moe >= 2) | (kinds == 1)).all()
    for t in range(back.n_tokens):
        here = steps == t
        assert (np.diff(issuer[here]) >= 0).all()  # in issue order, the issuing layer never goes back
        assert (np.diff(issue[here]) >= 0).all()  # ... and neither do the issue times
    planner = Planner("prefetch-fom", lookahead=2)
    counts = planner.plan_trace_stepwise(back.true_ids, back.pred_ids)
    for row, kind in ((0, 0), (1, 1)):  # prefetch copies by target layer, demand copies by layer
        got = np.zeros((back.n_tokens, s.n_moe_layers), np.int32)
        np.add.at(got, (steps[kinds == kind], moe[kinds == kind]), 1)
        np.testing.assert_array_equal(got, counts[row])
    one = build_trace(model, PROMPT, ProfileSettings(tokens=2), HW, prefill, records[:2], out[:2], Origin("cpu", True, "t"))
    assert "lookahead" not in one.header  # N = 1 is the default: not written


def test_stale_and_quasi_look_n_layers_ahead(tiny):
    """The stale gate at lookahead 2 is MoE layer m+2's router on layer m's router input; the
    quasi state carries layer m's default-vector update through layer m+1 (routed by its own
    router) to layer m+2's norm; with nothing between it is the one-step quasi state."""
    model, dv = tiny
    moe = model.spec.moe_layers
    got, recs, _ = _run(model, dv, tokens=3, policy="prefetch-fom", predictor="stale", lookahead=2)
    seen = {}  # model layer -> (x, resid, ids, gates) of every position

    def capture(layer, x, logits, resid, ids, gates):
        seen[layer] = (x, resid, ids, gates)

    with torch.no_grad():
        model(torch.cat([PROMPT, got], 1), hooks=Hooks(ResidentExperts(model, on_route=capture)))
        p = PROMPT.shape[1]
        for step in range(3):
            rows = torch.arange(2) * (p + 3) + p + step  # both sequences' position of this step's token
            for m in range(len(moe) - 2):
                x = seen[moe[m]][0][rows]
                ids, _ = model.route(model.layers[moe[m + 2]].mlp.gate(x), moe[m + 2])
                assert np.array_equal(np.sort(recs[step].pred_ids[m + 2], 1), np.sort(ids.numpy(), 1))
        x, resid, ids, gates = (t[:4] for t in seen[moe[0]])
        one = quasi_hidden(model, moe[0], resid, ids, gates, dv, moe[1])
        d = (dv[moe[0]][ids] * gates[..., None]).sum(1)
        torch.testing.assert_close(one, model.layers[moe[1]].post_attention_layernorm(resid + d))
        r = resid + d
        ids1, gates1 = model.route(model.layers[moe[1]].mlp.gate(model.layers[moe[1]].post_attention_layernorm(r)),
                                   moe[1])
        two = model.layers[moe[2]].post_attention_layernorm(r + (dv[moe[1]][ids1] * gates1[..., None]).sum(1))
        torch.testing.assert_close(quasi_hidden(model, moe[0], resid, ids, gates, dv, moe[2], (moe[1],)), two)


@pytest.mark.parametrize(("kw", "text"), [
    ({"policy": "on-demand", "lookahead": 2}, "applies to the prefetching policies"),
    ({"policy": "prefetch-fom", "lookahead": 4}, "leaves nothing to prefetch"),
    ({"policy": "prefetch-fom", "lookahead": 0}, "whole number of MoE layers >= 1"),
    ({"policy": "prefetch-fom", "lookahead": 2, "predictor": "estimator"}, "trained one MoE layer ahead"),
    ({"policy": "cpu-static", "lookahead": 2}, "applies to the prefetching policies"),
])
def test_a_lookahead_that_means_nothing_is_one_line_before_any_work(tmp_path, monkeypatch, kw, text):
    def no_model(*a, **k):
        raise AssertionError("loaded the model before checking --lookahead")

    monkeypatch.setattr(runs, "load_model", no_model)
    with pytest.raises(MoesimError) as e:
        runs.record_decode(runs.DecodeRequest(model="tiny", tokens=2, **kw), tmp_path / "x.npz")
    assert text in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_profile_lookahead_on_the_command_line(tmp_path, run):
    out = tmp_path / "la.npz"
    r = run("profile", "--model", "tiny", "--policy", "prefetch-fom", "--predictor", "stale", "--lookahead", "2",
            "--tokens", "3", "--link-gbps", "1", "--out", out, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "lookahead 2" in r.stderr and read_trace(out).header["lookahead"] == 2
    bad = run("profile", "--model", "tiny", "--policy", "on-demand", "--lookahead", "2", "--tokens", "2",
              "--out", tmp_path / "no.npz", cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--lookahead" in bad.stderr, bad.stderr
    assert not (tmp_path / "no.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
@pytest.mark.parametrize("policy,top,words", [("prefetch-spec", "1", "prefetch-spec executes the predicted experts"),
                                              ("on-demand", "1", "on-demand prefetches nothing"),
                                              ("prefetch-fom", "99", "an integer from 1 to top_k")])
def test_prefetch_top_is_refused_in_one_line_before_the_model_loads(tmp_path, run, policy, top, words):
    """``--prefetch-top`` cuts what an exact prefetching policy copies ahead: under any other
    policy, or past top_k, ``moesim profile`` and the library call it makes refuse in one
    line, with the check the decoder runs when built (``runtime.check_prefetch_top``)."""
    r = run("profile", "--model", "tiny", "--policy", policy, "--prefetch-top", top, "--tokens", "2",
            "--out", tmp_path / "no.npz", cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "no.npz").exists()
    with pytest.raises(MoesimError, match=words):
        runs.record_decode(runs.DecodeRequest(model="tiny", tokens=2, policy=policy, prefetch_top=int(top)),
                           tmp_path / "x.npz")
