"""Speculative decoding: selection strategies (the worked example from methods.md), and
lossless output equal to plain greedy decoding on the offload engine."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiny_models import sharp_tiny  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor.runtime import Offload, OffloadedDecoder  # noqa: E402
from moesim.executor.speculative import (  # noqa: E402
    SpecSettings,
    Tree,
    accept,
    greedy_reference,
    load_expert_predictor,
    select,
    speculative_generate,
    train_expert_predictor,
)
from moesim.executor.transport import EmulatedLink  # noqa: E402
from moesim.models import get_model  # noqa: E402


def test_worked_example_from_methods_md():
    """gamma = 2: after the root (E1-E4 in B), t1 (p 0.53) brings 3 new experts and scores
    0.53 / 3 = 0.17; t2 (p 0.40) brings 2 and scores 0.20: EcoSpec picks t2, confidence t1."""
    tree = Tree(tokens=[11, 12], parents=[-1, -1], prob=[0.53, 0.40],
                experts=[[{1, 5, 6, 7}], [{2, 8, 9}]])
    root = [{1, 2, 3, 4}]
    assert select(tree, 1, "ecospec", root, "ratio")[0] == 1
    assert select(tree, 1, "ecospec", root, "lagrangian", lam=0.12)[0] == 0  # 0.17 vs 0.16 with p=0.40
    tree.prob[1] = 0.44  # Lagrangian with lambda 0.12: 0.53 - 0.36 = 0.17 < 0.44 - 0.24 = 0.20
    assert select(tree, 1, "ecospec", root, "lagrangian", lam=0.12)[0] == 1
    assert select(tree, 1, "confidence")[0] == 0


def test_selection_keeps_a_tree_and_respects_the_budget():
    tree = Tree(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 0, 0, 2], prob=[0.6, 0.3, 0.5, 0.05, 0.45],
                experts=[[{1}], [{2}], [{3}], [{4}], [{5}]])
    for strategy in ("confidence", "ecospec"):
        chosen = select(tree, 3, strategy, [set()])
        assert len(chosen) == 3
        for i, c in enumerate(chosen):  # every parent chosen earlier
            assert tree.parents[c] == -1 or tree.parents[c] in chosen[:i]
    assert select(tree, 3, "confidence") == [0, 2, 4]


def test_greedy_acceptance_follows_the_target():
    tree = Tree(tokens=[7, 8, 9], parents=[-1, 0, -1], prob=[0.5, 0.4, 0.3])
    chosen = [0, 1, 2]  # rows 1, 2, 3
    assert accept(tree, chosen, target_next=[7, 8, 5, 0]) == [0, 1, 2]
    assert accept(tree, chosen, target_next=[9, 0, 0, 3]) == [0, 3]
    assert accept(tree, chosen, target_next=[4, 0, 0, 0]) == [0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)

    target = sharp_tiny()
    draft = sharp_tiny(spec=get_model("tiny").with_layers(2))
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)  # some agreement with the target
    draft.lm_head.weight.data.copy_(target.lm_head.weight.data)
    out = tmp_path_factory.mktemp("pred")
    gen = torch.Generator().manual_seed(0)
    rec = train_expert_predictor(draft, target, torch.randint(0, 256, (1024,), generator=gen),
                                 torch.randint(0, 256, (512,), generator=gen), out, epochs=5)
    return target, draft, load_expert_predictor(out), rec


@pytest.mark.parametrize("policy, strategy, gamma, branch, depth", [
    pytest.param("on-demand", "confidence", 3, 2, 2, id="on-demand-confidence-g3"),
    pytest.param("on-demand", "ecospec", 4, 2, 3, id="on-demand-ecospec-g4"),
    pytest.param("prefetch-fom", "ecospec", 6, 3, 2, id="prefetch-fom-ecospec-g6"),
    pytest.param("all-resident", "confidence", 1, 1, 1, id="all-resident-confidence-g1"),
    pytest.param("prefetch-fom", "ecospec", 0, 2, 2, id="prefetch-fom-no-candidates-g0"),
])
def test_speculative_output_equals_plain_greedy(models, policy, strategy, gamma, branch, depth):
    target, draft, predictor, _ = models
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = greedy_reference(target, prompt, 14)
    dec = OffloadedDecoder(target, policy, EmulatedLink(0.5e9, 10e-6), Offload(8), predictor="stale")
    _, records, got = speculative_generate(dec, draft, predictor, prompt,
                                           SpecSettings(gamma, branch, depth, strategy, "ratio", 0.1, 14))
    assert got == want
    for r in records:  # the accepted rows are a path from the root down the verified tree
        assert r.accepted_rows[0] == 0 and len(r.accepted_rows) <= 1 + len(r.chosen)
        node = [-1] + r.chosen  # verified row -> tree node (-1: the root)
        for above, below in zip(r.accepted_rows, r.accepted_rows[1:]):
            assert r.tree.parents[node[below]] == node[above]
        if gamma == 0:
            assert r.accepted_rows == [0] and r.chosen == []


def test_speculative_execution_policies_are_refused(models):
    target, draft, predictor, _ = models
    dec = OffloadedDecoder(target, "prefetch-spec", EmulatedLink(1e9, 0), predictor="stale")
    with pytest.raises(MoesimError, match="verifies exactly"):
        speculative_generate(dec, draft, predictor, torch.tensor([[1, 2]]), SpecSettings())


def test_speculative_trace_round_trips_and_replays(models, tmp_path):
    from moesim.executor.runtime import Origin
    from moesim.executor.speculative import build_sd_trace
    from moesim.hardware import get_profile
    from moesim.sim.speculative import recorded_steps, replay_sd, reselected_steps, simulate_steps
    from moesim.traces.format import read_trace, write_trace

    target, draft, predictor, _ = models
    hw = get_profile("a6000").with_figure("h2d_pinned_gbs", 0.5)
    dec = OffloadedDecoder(target, "on-demand", EmulatedLink(hw.link_bw, hw.transfer_latency), predictor="stale")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    st = SpecSettings(4, 2, 2, "ecospec", "ratio", 0.1, 12)
    pre, records, _ = speculative_generate(dec, draft, predictor, prompt, st)
    trace = build_sd_trace(target, prompt, records, pre, hw, st, "on-demand", 0, Origin("cpu", True, "t", "d"))
    back = read_trace(write_trace(trace, tmp_path / "sd.npz"))
    assert back.header["version"] >= 2 and back.speculative  # speculative records came in version 2
    assert back.timings["sd_accepted"].tolist() == [len(r.accepted_rows) for r in records]
    steps = recorded_steps(back)
    assert [s.true_union for s in steps] == [r.true_union for r in records]  # the recorded expert unions
    r = replay_sd(back, hw)
    assert np.isfinite(r["error"])  # replayed with its own measured times (how close: the suite measures it)
    # The same selection re-run on the stored trees reproduces the recording.
    again = reselected_steps(back, 4, "ecospec", "ratio", 0.1)
    assert [s.produced for s in again] == [s.produced for s in steps]
    assert [s.true_union for s in again] == [s.true_union for s in steps]
    # A smaller tree shape verifies fewer rows; an acceptance model gives expected tokens.
    shallow = reselected_steps(back, 4, "ecospec", depth=1, branch=1)
    assert all(s.rows <= 2 and s.produced <= 2 for s in shallow)
    expected = reselected_steps(back, 4, "confidence", acceptance=1.0)
    assert all(1 <= s.produced <= 5 for s in expected)
    more = simulate_steps(back, reselected_steps(back, 0, "confidence"), hw, "on-demand")
    assert more["accepted_per_step"] == 1.0 and more["rows_per_step"] == 1.0  # gamma 0: no candidates

