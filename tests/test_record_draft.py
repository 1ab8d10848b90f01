"""``moesim record --draft``: real speculative trees and the target's real routing, on tiny
random checkpoints written by transformers here (a Qwen3-MoE target; a 1-layer dense Qwen3
draft with the same vocabulary, the target itself as a draft that always agrees, and a
draft with another vocabulary)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_run import runners  # noqa: E402
from tiny_checkpoints import save_random_checkpoint  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor import record as rec  # noqa: E402
from moesim.executor import record_speculative as rs  # noqa: E402
from moesim.executor.interrupt import request_stop  # noqa: E402
from moesim.selection import Tree, select  # noqa: E402
from moesim.traces.format import read_trace  # noqa: E402
from moesim.traces.records import sd_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
PROMPT = [[1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pair")
    t = transformers
    cfgs = {
        "target": t.Qwen3MoeConfig(**COMMON, vocab_size=64, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=16, intermediate_size=48, norm_topk_prob=True),
        "dense": t.Qwen3Config(**COMMON, vocab_size=64, num_hidden_layers=1, intermediate_size=48),
        "other_vocab": t.Qwen3Config(**COMMON, vocab_size=80, num_hidden_layers=1, intermediate_size=48),
        # Another block layout (block_sparse_moe), and a family with sliding-window cache layers.
        "mixtral": t.MixtralConfig(**COMMON, vocab_size=64, num_hidden_layers=2, num_local_experts=8,
                                   num_experts_per_tok=2, intermediate_size=16),
        "gpt_oss": t.GptOssConfig(**COMMON, vocab_size=64, num_hidden_layers=2, num_local_experts=8,
                                  num_experts_per_tok=2, intermediate_size=16),
    }
    return {name: save_random_checkpoint(cfg, root / name) for name, cfg in cfgs.items()}


def _with_predictor(ckpt, tmp_path) -> Path:
    """The dense draft plus a random expert predictor (the executor's file format): EcoSpec
    then has per-node predictions to select by (their quality does not matter here)."""
    import shutil

    from safetensors.torch import save_file

    from moesim.executor.speculative import ExpertPredictor

    d = tmp_path / "draft-pred"
    shutil.copytree(ckpt["dense"], d)
    torch.manual_seed(1)
    pred = ExpertPredictor(32, 3, 8)
    save_file({k: v.contiguous() for k, v in pred.state_dict().items()}, str(d / rs.PREDICTOR_FILE),
              metadata={"draft_hidden": "32", "layers": "3", "experts": "8"})
    return d


def _route_last(model, layers, ids: list[int]) -> np.ndarray:
    """The target's top-k experts [M, k] (sorted ids) for the last token of ``ids``, from one
    full-sequence pass without a cache: an independent look at what the router chose."""
    got = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, o, j=j: got.__setitem__(j, o[2][-1]))
             for j, m in enumerate(layers)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return np.stack([np.sort(got[j].numpy()) for j in range(len(layers))])


@pytest.mark.parametrize("draft", ["dense", "target"])
def test_tokens_and_routing_are_the_targets_own(ckpt, tmp_path, draft):
    settings = rs.DraftSettings(depth=3, branch=2, budget=4, selection="confidence")
    rs.record_speculative_trace(ckpt["target"], ckpt[draft], tmp_path / "sd.npz", PROMPT, tokens=10,
                                settings=settings)
    back = read_trace(tmp_path / "sd.npz")
    n = back.n_tokens
    assert n >= 10 and back.speculative and not back.synthetic and back.header["version"] >= 2
    h = back.header
    assert h["recorded"]["draft_source"] == str(ckpt[draft])
    assert h["recorded"]["revision_sha256"] == rec.revision_hash(ckpt["target"])
    assert h["recorded"]["draft_revision_sha256"] == rec.revision_hash(ckpt[draft])
    assert h["speculative"]["gamma"] == 4 and h["speculative"]["strategy"] == "confidence"
    acc = back.timings["sd_accepted"]
    assert acc.sum() == n and (acc >= 1).all()

    # (a) speculation never changes the tokens; (b) nor the routing of an accepted token.
    plain = rec.record(ckpt["target"], np.array(PROMPT), tokens=n)
    np.testing.assert_array_equal(back.token_ids, plain.token_ids)
    np.testing.assert_array_equal(back.true_ids, plain.true_ids)
    np.testing.assert_allclose(back.true_gates, plain.true_gates, atol=1e-5)

    steps = sd_steps(back.timings)
    if draft == "target":  # the draft is the target: its top child is always the target's token
        assert all(s.accepted >= 2 for s in steps) and acc.mean() > 2
    # Every verified row, accepted or not, carries the target's routing for that node:
    # re-run the target on the committed text plus the node's path, no cache, no tree mask.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt["target"]), dtype=torch.float32).eval()
    layers = rec.find_moe_layers(model)
    text = list(PROMPT[0])
    toks = back.token_ids[0].tolist()
    start = 0
    rejected = 0
    for s in steps[:3]:
        base = text + toks[:start + 1]  # committed text and the step's root
        np.testing.assert_array_equal(np.sort(s.row_true[0], -1), _route_last(model, layers, base))
        for j, c in enumerate(s.chosen):
            path, node = [], c
            while node != -1:
                path.insert(0, s.tokens[node])
                node = s.parents[node]
            np.testing.assert_array_equal(np.sort(s.row_true[1 + j], -1), _route_last(model, layers, base + path))
        rejected += 1 + len(s.chosen) - s.accepted
        start += s.accepted
    if draft == "dense":
        assert rejected > 0  # the check above covered rows the target rejected


def test_ecospec_uses_the_drafts_expert_predictor(ckpt, tmp_path):
    d = _with_predictor(ckpt, tmp_path)
    t = rs.record_speculative(ckpt["target"], d, PROMPT, tokens=6,
                              settings=rs.DraftSettings(depth=2, branch=3, budget=3, selection="ecospec"))
    assert t.header["speculative"]["predictor"] == rs.PREDICTOR_FILE
    recall = t.header["metrics"]["sd_predictor_recall"]
    assert len(recall) == 3 and all(0 <= r <= 1 for r in recall)
    tm = t.timings
    nodes = (tm["sd_tree_parents"] != -2).sum(1)
    assert (nodes == 3 + 9).all()  # branch 3, depth 2
    assert tm["sd_node_pred"].sum(-1)[tm["sd_tree_parents"] != -2].min() == 2  # top-k = 2 per node and layer
    assert ((tm["sd_chosen"] >= 0).sum(1) == 3).all()
    plain = rec.record(ckpt["target"], np.array(PROMPT), tokens=t.n_tokens)
    np.testing.assert_array_equal(t.token_ids, plain.token_ids)
    # The recorded choice is EcoSpec's on the recorded tree and predictions (what the what-if re-runs).
    differs = 0
    for s in sd_steps(t.timings):
        tree = Tree(s.tokens, s.parents, s.prob, [[set(np.flatnonzero(m)) for m in node] for node in s.node_pred])
        assert select(tree, 3, "ecospec", [set(np.flatnonzero(m)) for m in s.root_pred], "ratio") == s.chosen
        differs += select(tree, 3, "confidence") != s.chosen
    assert differs  # the expert cost changed some choice (else this test would not tell the strategies apart)
    with pytest.raises(MoesimError, match="ecospec needs the draft's expert predictor"):
        rs.record_speculative(ckpt["target"], ckpt["dense"], PROMPT, tokens=2,
                              settings=rs.DraftSettings(selection="ecospec"))


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # four CLI subprocesses (~15 s on 2 cores)
def test_cli_records_and_every_consumer_reads_it(ckpt, tmp_path):
    r = _cli("record", ckpt["target"], "--draft", ckpt["target"], "--tokens", 8, "--tree-depth", 2, "--tree-branch",
             2, "--budget", 3, "--out", "sd.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "verification steps" in r.stderr
    back = read_trace(tmp_path / "sd.npz")
    assert back.speculative and back.header["speculative"]["depth"] == 2
    r = _cli("replay", "sd.npz", "--gamma", "2,4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "what-if gamma 4 ecospec" in r.stdout and "no measured times" in r.stdout
    r = _cli("stats", "sd.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli("synth", "--speculative", "--like", "sd.npz", "--tokens", 16, "--out", "like.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    like = read_trace(tmp_path / "like.npz")
    assert like.synthetic and like.speculative and like.header["generator"]["fitted_from"] == "sd.npz"


@pytest.mark.parametrize("run", runners(_cli))
def test_draft_with_another_vocabulary_is_one_line_before_any_work(ckpt, tmp_path, monkeypatch, run):
    r = run("record", ckpt["target"], "--draft", ckpt["other_vocab"], "--out", "x.npz", cwd=tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "vocabulary of 80" in lines[0], r.stderr
    assert not (tmp_path / "x.npz").exists()

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(rs, "load_model", no_load)
    with pytest.raises(MoesimError, match="vocabulary"):
        rs.record_speculative(ckpt["target"], ckpt["other_vocab"], PROMPT, tokens=2)
    with pytest.raises(MoesimError, match="one prompt"):
        rs.record_speculative(ckpt["target"], ckpt["dense"], [[1, 2], [3, 4]], tokens=2)
    with pytest.raises(MoesimError, match="tree-depth"):
        rs.DraftSettings(depth=0)
    from typer.testing import CliRunner

    from moesim.cli import every_command

    app = every_command()

    for args, says in [(["--draft", str(ckpt["dense"]), "--temperature", "1"], "greedily"),
                       (["--budget", "2"], "apply to record --draft"),
                       (["--draft", str(ckpt["dense"]), "--selection", "best"], "unknown selection")]:
        r = CliRunner().invoke(app, ["record", str(ckpt["target"]), *args, "--out", str(tmp_path / "y.npz")])
        assert isinstance(r.exception, MoesimError) and says in str(r.exception), r.output  # main(): exit 2
    assert not (tmp_path / "y.npz").exists()


def test_ctrl_c_keeps_finished_steps(ckpt):
    settings = rs.DraftSettings(depth=2, branch=2, budget=2)
    calls = []

    def stop_after_two(done, total):  # what the first Ctrl-C does: ask the loop to stop between steps
        calls.append(done)
        if len(calls) == 2:
            request_stop()

    t = rs.record_speculative(ckpt["target"], ckpt["target"], PROMPT, tokens=40, settings=settings,
                              progress=stop_after_two)
    assert len(t.timings["sd_accepted"]) == 2 and t.header["recorded"]["interrupted"]
    assert t.n_tokens == calls[-1] == t.timings["sd_accepted"].sum()

    def insist(done, total):  # a second Ctrl-C raises at once: the finished step is kept
        raise KeyboardInterrupt

    t = rs.record_speculative(ckpt["target"], ckpt["target"], PROMPT, tokens=40, settings=settings, progress=insist)
    assert len(t.timings["sd_accepted"]) == 1 and t.header["recorded"]["interrupted"]
    plain = rec.record(ckpt["target"], np.array(PROMPT), tokens=t.n_tokens)
    np.testing.assert_array_equal(t.true_ids, plain.true_ids)


def test_other_families_and_a_cache_tree_attention_cannot_use(ckpt):
    t = rs.record_speculative(ckpt["mixtral"], ckpt["mixtral"], PROMPT, tokens=6)
    plain = rec.record(ckpt["mixtral"], np.array(PROMPT), tokens=t.n_tokens)
    np.testing.assert_array_equal(t.token_ids, plain.token_ids)
    np.testing.assert_array_equal(t.true_ids, plain.true_ids)
    assert t.timings["sd_accepted"].min() >= 2  # the draft is the target
    with pytest.raises(MoesimError, match="sliding|not a plain growing cache") as e:
        rs.record_speculative(ckpt["gpt_oss"], ckpt["gpt_oss"], PROMPT, tokens=2)
    assert "\n" not in str(e.value)

    def stop_at_two(done, total):  # plain record stops the same way (the CLI command's first Ctrl-C)
        if done == 2:
            request_stop()

    p = rec.record(ckpt["target"], np.array(PROMPT), tokens=10, progress=stop_at_two)
    assert p.n_tokens == 2 and p.header["recorded"]["interrupted"]


@pytest.mark.slow  # a real SIGINT to a real `moesim record --draft` (a CLI subprocess, several seconds)
def test_sigint_to_record_draft_writes_the_finished_steps(ckpt, tmp_path):
    import signal

    from cli_signals import signal_when, steps_done

    total = 100000  # never reached before the signal
    rc, err = signal_when(["record", ckpt["target"], "--draft", ckpt["target"], "--tokens", total, "--tree-depth", 2,
                           "--budget", 2, "--out", "sd.npz"], steps_done(total), signal.SIGINT, cwd=tmp_path)
    assert rc == 130 and err.strip().splitlines()[-1] == "interrupted (Ctrl-C)", err  # kept, and stopped
    t = read_trace(tmp_path / "sd.npz")
    assert t.header["recorded"]["interrupted"] and 1 <= t.n_tokens < total
    assert t.n_tokens == t.timings["sd_accepted"].sum()
    n = min(t.n_tokens, 24)
    plain = rec.record(ckpt["target"], t.prompt_ids, tokens=n)  # no --prompt: 16 seeded random ids
    np.testing.assert_array_equal(t.token_ids[:, :n], plain.token_ids)
    np.testing.assert_array_equal(t.true_ids[:n], plain.true_ids)
