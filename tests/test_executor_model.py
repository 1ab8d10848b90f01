"""The executor's model equals the Hugging Face reference classes (float32 tolerance)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor.model import ExecConfig, load_checkpoint, random_model, save_checkpoint  # noqa: E402
from moesim.models import get_model  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True, **COMMON)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, **COMMON)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        num_experts=8, num_experts_per_tok=2, intermediate_size=16, norm_topk_prob=False, **COMMON)),
    # A shared expert with a sigmoid gate, attention biases, and layer 1 dense (mlp_only_layers).
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(_qwen2_config(mlp_only_layers=[1])),
}


def _qwen2_config(**kw):
    return transformers.Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=24, intermediate_size=40,
                                       norm_topk_prob=False, **COMMON, **kw)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = FAMILIES[request.param]().eval()
    with torch.no_grad():  # larger random weights than the default init, so routing is not a tie
        for p in ref.parameters():
            p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return ref, load_checkpoint(d)


def test_logits_equal_the_reference_for_prefill_and_decode(pair):
    ref, ours = pair
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    cache = ours.new_cache(2, 16)
    got = [ours(tokens[:, :5], cache, 0)]  # prefill of 5 tokens
    for i in range(5, 9):  # then 4 decode steps, one token at a time
        got.append(ours(tokens[:, i:i + 1], cache, i))
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-4)


def test_synthetic_model_round_trips_through_a_checkpoint(tmp_path):
    cfg = ExecConfig(get_model("tiny"))
    model = random_model(cfg, seed=3)
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    back = load_checkpoint(tmp_path)
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(back(tokens, back.new_cache(1, 8), 0), model(tokens, model.new_cache(1, 8), 0))


def test_unsupported_and_broken_checkpoints(tmp_path):
    with pytest.raises(MoesimError, match="not one"):
        ExecConfig(get_model("deepseek-v3"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_hidden_layers": 1, '
                                           '"num_experts": 2, "num_experts_per_tok": 1, "hidden_size": 8, '
                                           '"moe_intermediate_size": 4, "num_attention_heads": 2, "vocab_size": 8}')
    with pytest.raises(MoesimError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MoesimError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path)


def test_qwen2_moe_offloaded_decoding_equals_the_reference(tmp_path):
    """Shared experts (resident) join the offloaded runtime through the one block: exact
    policies decode the reference's logits."""
    from moesim.executor.runtime import OffloadedDecoder
    from moesim.executor.transport import EmulatedLink

    torch.manual_seed(0)
    ref = transformers.Qwen2MoeForCausalLM(_qwen2_config()).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.spec.n_shared == 1 and ours.spec.shared_inter == 24 and ours.spec.attention.bias
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(tokens).logits
    for policy in ("all-resident", "on-demand", "prefetch-fom"):
        dec = OffloadedDecoder(ours, policy, EmulatedLink(1e9, 0), predictor="stale", cache_experts=4)
        cache = ours.new_cache(2, 8)
        got = [dec.step(tokens[:, :4], cache, 0, prefill=True).logits]
        got += [dec.step(tokens[:, i:i + 1], cache, i, step_index=i - 4).logits for i in range(4, 8)]
        dec.transport.close()
        torch.testing.assert_close(torch.stack(got, 1), want[:, 3:], rtol=1e-4, atol=1e-4)


def test_dense_layers_run_resident_but_are_refused_offloaded(tmp_path):
    from moesim.executor.runtime import OffloadedDecoder
    from moesim.executor.transport import EmulatedLink

    transformers.Qwen2MoeForCausalLM(_qwen2_config(mlp_only_layers=[0])).save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.spec.dense_layers == (0,) and ours.experts[0] == [] and len(ours.experts[1]) == 8
    with pytest.raises(MoesimError, match="dense layers"):
        OffloadedDecoder(ours, "on-demand", EmulatedLink(1e9, 0))
