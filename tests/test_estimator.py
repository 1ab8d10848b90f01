"""The neural expert estimator: it learns the routers, the hybrid choice is stored, and
the executor uses it (exactly, under fetch-on-miss)."""

import json

import pytest

torch = pytest.importorskip("torch")

from tiny_models import sharp_tiny  # noqa: E402

from moesim.executor.estimator import (  # noqa: E402
    Estimator,
    EstimatorTraining,
    collect,
    load_estimator,
    recall_by_layer,
    train_estimator,
)
from moesim.executor.profile import ProfileSettings, calibrate, generate  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    model = sharp_tiny(seed=2, expert_scale=1)
    gen = torch.Generator().manual_seed(0)
    dv = calibrate(model, torch.randint(0, 256, (512,), generator=gen))
    out = tmp_path_factory.mktemp("est")
    rec = train_estimator(model, dv, torch.randint(0, 256, (4096,), generator=gen),
                          torch.randint(0, 256, (1024,), generator=gen), out,
                          EstimatorTraining(epochs=8, width=64, batch=256))
    return model, dv, out, rec


def test_estimator_learns_the_next_router(trained):
    model, dv, out, rec = trained
    kl = [c["eval_kl"] for c in rec["curve"]]
    assert kl[-1] < kl[0]  # distillation reduces held-out KL
    # Better than chance (k / E = 2 / 16) on every layer.
    assert all(r > 2 * 2 / 16 for r in rec["estimator_recall_at_k"])
    assert len(rec["hybrid"]) == model.spec.n_layers - 1
    assert set(rec["hybrid"]) <= {"quasi", "estimator"}
    stored = json.loads((out / "estimator.json").read_text())
    assert stored["hybrid"] == rec["hybrid"] and stored["parameters"] == rec["parameters"]


def test_recall_by_layer_counts_overlap():
    pred = torch.tensor([[5.0, 4, 0, 0], [0, 0, 5, 4]])
    true = torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.5, 0.4, 0.05, 0.05]])
    assert recall_by_layer(pred, true, torch.tensor([0, 1]), 3, 2) == [1.0, 0.0]


def test_estimator_and_hybrid_prefetch_are_exact_under_fetch_on_miss(trained):
    model, dv, out, _ = trained
    est = load_estimator(out)
    assert isinstance(est[0], Estimator)
    hw = get_profile("a6000").with_figure("h2d_pinned_gbs", 0.5)
    prompt = torch.tensor([[1, 2, 3, 4]])
    _, _, ref = generate(model, prompt, ProfileSettings(policy="all-resident", tokens=6), hw)
    for predictor in ("estimator", "hybrid"):
        st = ProfileSettings(policy="prefetch-fom", predictor=predictor, tokens=6)
        _, records, got = generate(model, prompt, st, hw, dv, estimator=est)
        assert torch.equal(torch.cat(got, 1), torch.cat(ref, 1))
        assert all((r.predict_s[:-1] > 0).all() for r in records)  # the estimator's time is measured


def test_collect_pairs_quasi_states_with_next_layer_routers(trained):
    model, dv, _, _ = trained
    q, p, layers = collect(model, dv, torch.arange(20))
    assert q.shape[0] == p.shape[0] == layers.shape[0] == 20 * (model.spec.n_layers - 1)
    assert sorted(set(layers.tolist())) == list(range(model.spec.n_layers - 1))
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]))


def test_interrupted_training_keeps_a_loadable_estimator_that_says_so(trained, tmp_path):
    from moesim.executor.interrupt import request_stop

    model, dv, _, _ = trained

    def stop_at_five(step, n, loss):
        if step == 5:
            request_stop()

    gen = torch.Generator().manual_seed(3)
    rec = train_estimator(model, dv, torch.randint(0, 256, (2048,), generator=gen),
                          torch.randint(0, 256, (512,), generator=gen), tmp_path,
                          EstimatorTraining(epochs=8, width=32, batch=256), progress=stop_at_five)
    assert rec["curve"][-1]["steps"] == 5 and "after 5 of" in rec["status"]  # 2048 * 3 / 256 = 24 steps an epoch
    est, hybrid = load_estimator(tmp_path)
    assert hybrid == rec["hybrid"] and json.loads((tmp_path / "estimator.json").read_text())["status"] == rec["status"]
