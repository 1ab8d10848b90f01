"""Recording routing from Hugging Face MoE checkpoints: tiny random checkpoints of eight
families written by transformers, recorded, checked against top-k computed here from
router logits of an independent full-sequence pass, and replayed by the simulator; the
folder layouts, prompts and routers a recorder meets in the wild."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_run import BOTH_WAYS  # noqa: E402
from tiny_checkpoints import save_random_checkpoint  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor import record as rec  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.setting import Setting  # noqa: E402
from moesim.sim.simulate import simulate  # noqa: E402
from moesim.traces.format import read_trace, write_trace  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def _configs():
    t = transformers
    return {
        "qwen3_moe": t.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      intermediate_size=48, head_dim=8, norm_topk_prob=True),
        "mixtral": t.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16),
        "olmoe": t.OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, intermediate_size=16),
        # Shared expert and a dense layer in the middle (mlp_only_layers).
        "qwen2_moe": t.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      intermediate_size=48, shared_expert_intermediate_size=24, mlp_only_layers=[1]),
        # Shared expert, first layer dense, softmax greedy top-k scaled by routed_scaling_factor.
        "deepseek_v2": t.DeepseekV2Config(**{**COMMON, **MLA}, n_routed_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=16, intermediate_size=48, n_shared_experts=1,
                                          first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy",
                                          routed_scaling_factor=2.0),
        # Sigmoid router with score-correction bias and group-limited top-k.
        "deepseek_v3": t.DeepseekV3Config(**{**COMMON, **MLA}, n_routed_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=16, intermediate_size=48, n_shared_experts=1,
                                          first_k_dense_replace=1, q_lora_rank=16, n_group=2, topk_group=1,
                                          routed_scaling_factor=2.5),
        "gpt_oss": t.GptOssConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                                  head_dim=8),
        # GLM-4.7-Flash: MLA, the DeepSeek-V3 router, dense layers named by mlp_layer_types.
        "glm4_moe_lite": t.Glm4MoeLiteConfig(**{**COMMON, **MLA}, n_routed_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=16, intermediate_size=48, n_shared_experts=1,
                                             q_lora_rank=16, n_group=2, topk_group=1, routed_scaling_factor=1.8,
                                             mlp_layer_types=["dense", "sparse", "sparse"]),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ckpt")
    return {name: save_random_checkpoint(cfg, root / name) for name, cfg in _configs().items()}


def _expected(name, cfg, logits, router):
    """Top-k ids and gates of each family, computed from router logits (transformers' documented rules)."""
    k = cfg.num_experts_per_tok
    if name == "gpt_oss":
        v, i = logits.topk(k, -1)
        return i, v.softmax(-1)
    if name in ("deepseek_v3", "glm4_moe_lite"):
        s = logits.sigmoid()
        choice = s + router.e_score_correction_bias
        g = choice.view(-1, cfg.n_group, 8 // cfg.n_group).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(g).scatter_(1, g.topk(cfg.topk_group, -1).indices, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(8 // cfg.n_group, 1), float("-inf"))
        i = choice.topk(k, -1).indices
        w = s.gather(1, i)
        return i, w / w.sum(-1, keepdim=True)
    p = logits.float().softmax(-1)
    v, i = p.topk(k, -1)
    if name == "mixtral" or getattr(cfg, "norm_topk_prob", False) and name != "deepseek_v2":
        v = v / v.sum(-1, keepdim=True)
    return i, v


@pytest.mark.parametrize("name", list(_configs()))
def test_recorded_routing_is_the_models_own(checkpoints, tmp_path, name):
    path = checkpoints[name]
    prompts = np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    trace = rec.record(path, prompts, tokens=5, prompt_source="test prompts")
    back = read_trace(write_trace(trace, tmp_path / "t.npz"))
    spec = back.model
    assert not back.synthetic and back.header["recorded"]["prompts"] == "test prompts"
    assert back.header["recorded"]["revision_sha256"] == rec.revision_hash(path)
    assert back.true_ids.shape == (5, spec.n_moe_layers, 2, spec.top_k)

    # Independent pass: the whole sequence at once (no KV cache), router logits hooked.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    layers = rec.find_moe_layers(model)
    assert tuple(m.layer for m in layers) == spec.moe_layers
    logits = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, o, j=j: logits.__setitem__(j, o[0].detach()))
             for j, m in enumerate(layers)]
    full = torch.tensor(np.concatenate([back.prompt_ids, back.token_ids], 1), dtype=torch.long)
    with torch.no_grad():
        model(input_ids=full)
    for h in hooks:
        h.remove()
    p = back.prompt_len
    for j, m in enumerate(layers):
        lg = logits[j].view(2, full.shape[1], -1)[:, p:p + 5].reshape(-1, lg_e := logits[j].shape[-1])
        assert lg_e == spec.n_experts
        ids, gates = _expected(name, model.config, lg, m.router)
        got = back.true_ids[:, j].transpose(1, 0, 2).reshape(-1, spec.top_k)  # [B*T, k], rows like ids
        got_g = back.true_gates[:, j].transpose(1, 0, 2).reshape(-1, spec.top_k)
        order = gates.argsort(-1, descending=True)
        np.testing.assert_array_equal(got, ids.gather(1, order).numpy())
        np.testing.assert_allclose(got_g, gates.gather(1, order).numpy(), atol=1e-4)

    preds = back.header["metrics"]["predictors"]
    assert set(preds) == {"quasi", "stale", "oracle"} and back.meta.predictor == "quasi"
    assert all(v == 1.0 for v in preds["oracle"][1:])
    assert all(0 <= v <= 1 for name_ in ("quasi", "stale") for v in preds[name_][1:])
    assert (back.pred_ids[:, 0] == -1).all() and (back.pred_ids[:, 1:] >= 0).all()
    # Replays: the simulator reads the trace and reports the quasi predictor's recall.
    res = simulate(back, get_profile("a6000"), "prefetch-fom", Setting(cache_experts=4, sim="fast")).summary()
    assert res["synthetic_trace"] is False and res["tpot_ms"] > 0
    assert res["pred_recall"] == pytest.approx(np.mean(preds["quasi"][1:]), abs=1e-9)


def test_shared_experts_and_dense_layers_are_in_the_spec(checkpoints):
    q2 = rec.record(checkpoints["qwen2_moe"], [[1, 2, 3]], tokens=2).model
    assert q2.dense_layers == (1,) and q2.n_shared == 1 and q2.shared_inter == 24
    ds = rec.record(checkpoints["deepseek_v2"], [[1, 2, 3]], tokens=2)
    assert ds.model.dense_layers == (0,) and ds.model.n_shared == 1
    assert ds.header["recorded"]["routed_scaling_factor"] == 2.0 and ds.true_gates.max() <= 1


def test_sampling_batch_progress_and_interrupt(checkpoints):
    seen = []

    def progress(done, total):
        seen.append(done)
        if done == 3:
            raise KeyboardInterrupt

    t = rec.record(checkpoints["mixtral"], [[1, 2, 3]], tokens=6, batch=3, temperature=1.0, seed=4, progress=progress)
    assert t.n_tokens == 3 and t.batch == 3 and seen == [1, 2, 3] and t.header["recorded"]["interrupted"]
    again = rec.record(checkpoints["mixtral"], [[1, 2, 3]], tokens=3, batch=3, temperature=1.0, seed=4)
    np.testing.assert_array_equal(again.true_ids, t.true_ids)  # same seed, same samples


def test_bad_inputs_are_one_line_errors(checkpoints, tmp_path, monkeypatch):
    with pytest.raises(MoesimError, match="no config.json"):
        rec.record(tmp_path, [[1]], tokens=1)
    with pytest.raises(MoesimError, match="outside the vocabulary"):
        rec.record(checkpoints["olmoe"], [[1, 999]], tokens=1)
    with pytest.raises(MoesimError, match="no tokenizer"):
        rec.record(checkpoints["olmoe"], ["hello"], tokens=1)
    monkeypatch.setattr(rec, "_host_available", lambda: 1000)
    with pytest.raises(MoesimError, match="needs ~.* GiB to load; host memory has") as e:
        rec.record(checkpoints["olmoe"], [[1, 2]], tokens=1)
    assert "\n" not in str(e.value)


class ArgTopKRouter(torch.nn.Module):
    """A router called as MiniMax-M2's and Afmoe's are: the hidden states as [B, T, H] and
    the selection bias as a second argument, plus a keyword."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, bias, *, scale=1.0):
        return self.inner(hidden_states.reshape(-1, hidden_states.shape[-1]) * scale + bias)


class ArgBlock(torch.nn.Module):
    def __init__(self, block) -> None:
        super().__init__()
        self.gate, self.experts = ArgTopKRouter(block.gate), block.experts
        self.register_buffer("bias", torch.zeros(()))

    def forward(self, h):
        b, t, d = h.shape
        _, w, ids = self.gate(h, self.bias, scale=1.0)
        return self.experts(h.reshape(-1, d), ids, w).view(b, t, d)


def test_routers_called_with_extra_arguments_record_the_same_routing_and_predictions(checkpoints, monkeypatch):
    """The hook finds the hidden states however they are passed, and the predictions call
    each router exactly as its block does (input rank, extra arguments)."""
    prompts = [[1, 2, 3, 4]]
    plain = rec.record(checkpoints["qwen3_moe"], prompts, tokens=3)
    real_load = rec.load_model

    def load_with_arg_routers(model_dir, device):
        model = real_load(model_dir, device)
        for layer in model.model.layers:
            layer.mlp = ArgBlock(layer.mlp)
        return model

    monkeypatch.setattr(rec, "load_model", load_with_arg_routers)
    hooked = rec.record(checkpoints["qwen3_moe"], prompts, tokens=3)
    for name in ("true_ids", "pred_ids", "token_ids"):
        np.testing.assert_array_equal(getattr(hooked, name), getattr(plain, name))
    np.testing.assert_allclose(hooked.pred_gates, plain.pred_gates, atol=1e-6)
    for name, recall in plain.header["metrics"]["predictors"].items():  # NaN where nothing is predicted
        np.testing.assert_array_equal(hooked.header["metrics"]["predictors"][name], recall)


def test_a_hugging_face_cache_folder_resolves_to_its_snapshot(checkpoints, tmp_path):
    import shutil

    from moesim.executor.loading import load_model

    cache = tmp_path / "models--tiny-org--tiny-qwen3"
    snap = cache / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoints["qwen3_moe"], snap)
    (cache / "refs").mkdir()
    t = rec.record(cache, [[1, 2, 3]], tokens=2)
    assert t.header["recorded"]["model_source"] == str(snap)
    np.testing.assert_array_equal(t.true_ids, rec.record(checkpoints["qwen3_moe"], [[1, 2, 3]], tokens=2).true_ids)
    assert load_model(str(cache)).path == snap  # moesim profile --model reads the same folder
    shutil.copytree(snap, cache / "snapshots" / "fedcba")  # two snapshots: the ref names one, or it is one line
    with pytest.raises(MoesimError, match="2 snapshots"):
        rec.record(cache, [[1]], tokens=1)
    (cache / "refs" / "main").write_text(snap.name + "\n")
    assert rec.checkpoint_folder(cache) == snap


def test_a_config_without_weights_is_one_line_before_loading(checkpoints, tmp_path, monkeypatch):
    import shutil

    shutil.copy(checkpoints["olmoe"] / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text("{}")

    def no_load(*a, **k):
        raise AssertionError("started loading the model")

    monkeypatch.setattr(rec, "load_model", no_load)
    with pytest.raises(MoesimError, match="a config.json but no weight files") as e:
        rec.record(tmp_path, [[1, 2]], tokens=1)
    assert "\n" not in str(e.value) and "index.json" in str(e.value)


def test_cuda_recording_needs_accelerate(monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(MoesimError, match=r"needs accelerate.*moesim\[record\]"):
        rec.check_record_device("cuda")
    rec.check_record_device("cpu")


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_record_prompt_ids_on_the_command_line(checkpoints, tmp_path, run):
    out = tmp_path / "ids.npz"
    r = run("record", checkpoints["olmoe"], "--prompt-ids", "5,6,7", "--prompt-ids", "1,2,3", "--tokens", "2",
            "--out", out, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    t = read_trace(out)
    assert t.prompt_ids.tolist() == [[5, 6, 7], [1, 2, 3]] and t.header["recorded"]["prompts"] == "--prompt-ids"
    for ids, says in (("5,x", "comma-separated token ids"), ("5,999", "outside the vocabulary")):
        bad = run("record", checkpoints["olmoe"], "--prompt-ids", ids, "--tokens", "1", "--out", tmp_path / "no.npz",
                  cwd=tmp_path, timeout=300)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and says in bad.stderr, bad.stderr
    assert not (tmp_path / "no.npz").exists()
