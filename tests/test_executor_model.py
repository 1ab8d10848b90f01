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
}


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
