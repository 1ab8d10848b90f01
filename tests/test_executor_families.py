"""The executor runs gpt-oss (``GptOssForCausalLM``), DeepSeek-V3 (``DeepseekV3ForCausalLM``)
and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): logits equal transformers' on tiny random
checkpoints (``save_pretrained`` layout), resident and offloaded under every copy policy,
recorded with timings; MXFP4 experts dequantised exactly as transformers does."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_run import both_ways  # noqa: E402
from tiny_checkpoints import TINY_FAMILIES, VOCAB, save_tiny  # noqa: E402

from moesim.errors import MoesimError  # noqa: E402
from moesim.executor import runs  # noqa: E402
from moesim.executor.default_vectors import calibrate  # noqa: E402
from moesim.executor.model import load_checkpoint  # noqa: E402
from moesim.executor.profile import ProfileSettings, generate  # noqa: E402
from moesim.executor.quant_experts import QuantExpert, mxfp4_matrix, quantize  # noqa: E402
from moesim.hardware import get_profile  # noqa: E402
from moesim.models import matrix_bytes  # noqa: E402
from moesim.traces.format import read_trace  # noqa: E402

HW = get_profile("a6000").with_figure("h2d_pinned_gbs", 1.0)
TOKENS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp(request.param)
    ref = save_tiny(request.param, d)
    return request.param, ref, load_checkpoint(d), d


def test_logits_equal_transformers_for_prefill_and_decode(pair):
    """A 6-token prefill (longer than gpt-oss's 4-token window), then 4 decode steps."""
    name, ref, ours, _ = pair
    with torch.no_grad():
        want = ref(TOKENS).logits
        cache = ours.new_cache(2, 16)
        got = [ours(TOKENS[:, :6], cache, 0)]
        got += [ours(TOKENS[:, i:i + 1], cache, i) for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-4)


def test_the_family_is_read_as_transformers_builds_it(pair):
    name, ref, ours, _ = pair
    s, cfg = ours.spec, ours.cfg
    if name == "gpt_oss":
        assert cfg.layer_types == ("sliding", "full", "sliding") and cfg.sliding_window == 4 and cfg.sinks
        assert cfg.act.limit == 0.6 and cfg.router.method == "topk_softmax" and cfg.o_bias and cfg.yarn is not None
        assert s.expert_bias and len(ours.experts[0][0]) == cfg.expert_width
    else:
        assert cfg.router.method == "noaux_tc" and cfg.router.n_group == 2 and cfg.router_fp32
        assert s.dense_layers == (0,) and s.n_shared == 1 and s.attention.kind == "mla" and ours.experts[0] == []
        assert cfg.rope_pairs == (name != "deepseek_v3_halves")


def test_bf16_keeps_what_transformers_keeps_in_fp32(pair):
    """DeepSeek and GLM keep their routers (and selection biases) in fp32, gpt-oss its norms."""
    name, ref, ours, d = pair
    bf = load_checkpoint(d, dtype=torch.bfloat16)
    moe = bf.spec.moe_layers[0]
    if name == "gpt_oss":
        assert bf.layers[0].input_layernorm.weight.dtype == torch.float32 and bf.norm.weight.dtype == torch.float32
    else:
        assert bf.layers[moe].mlp.gate.weight.dtype == torch.float32
        assert bf.layers[moe].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert bf.layers[moe].self_attn.o_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        want = ref(TOKENS).logits
        got = bf(TOKENS, bf.new_cache(2, 10), 0).float()
    assert torch.isfinite(got).all() and (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("policy, predictor", [
    ("all-resident", "stale"), ("on-demand", "quasi"), ("prefetch-fom", "stale"), ("prefetch-fom", "quasi"),
    ("oracle", "quasi"), ("prefetch-spec", "oracle"),
])
def test_offloaded_decoding_gives_the_all_resident_tokens(pair, policy, predictor):
    """Exact policies (and speculative execution with the oracle) decode all-resident's
    tokens, with transformers' logits at every step."""
    name, ref, ours, _ = pair
    dv = calibrate(ours, torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(4)))
    prompt = TOKENS[:, :5]
    _, want, toks = generate(ours, prompt, ProfileSettings("all-resident", tokens=4), HW, dv)
    st = ProfileSettings(policy, predictor=predictor, tokens=4, cache_experts=4)
    _, recs, got = generate(ours, prompt, st, HW, dv)
    assert torch.equal(torch.cat(got, 1), torch.cat(toks, 1))
    with torch.no_grad():
        full = ref(torch.cat([prompt, *got], 1)).logits  # transformers over the whole decoded text
    for i, r in enumerate(recs):
        torch.testing.assert_close(r.logits, full[:, prompt.shape[1] + i], rtol=1e-4, atol=1e-4)
    if policy not in ("all-resident",):
        assert sum(len(r.copies) for r in recs) > 0


def test_prefetch_spec_with_a_real_predictor_runs(pair):
    name, ref, ours, _ = pair
    _, recs, got = generate(ours, TOKENS[:, :5], ProfileSettings("prefetch-spec", predictor="stale", tokens=4), HW)
    assert len(recs) == 4 and all((r.exec_ids >= 0).all() for r in recs[1:])


def test_profile_records_a_trace_with_timings(pair, tmp_path):
    name, ref, ours, d = pair
    req = runs.DecodeRequest(model=str(d), policy="prefetch-fom", predictor="stale", tokens=3, prompt_ids="1,2,3,4,5",
                             link_gbps=1.0, fidelity_tokens=0)
    rec = runs.record_decode(req, tmp_path / "t.npz")
    tr = read_trace(tmp_path / "t.npz")
    assert rec.steps == 3 and tr.measured and tr.model.family == ours.spec.family
    assert tr.prompt_ids.tolist() == [[1, 2, 3, 4, 5]] and tr.true_ids.shape[1] == ours.spec.n_moe_layers
    assert (tr.timings["tpot_s"] > 0).all() and (tr.timings["copy_kind"] == 0).any()


# in a subprocess with -m slow: the in-process run decodes the same checkpoint through the same command
@pytest.mark.parametrize("run, name", both_ways([("gpt_oss",), ("deepseek_v3",)], first=False, subprocesses=1))
def test_moesim_profile_prompt_ids_gives_transformers_greedy_tokens(run, name, tmp_path):
    ref = save_tiny(name, tmp_path / "ckpt")
    prompt = [3, 1, 4, 1, 5, 9]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, 6:]
    out = tmp_path / "p.npz"
    r = run("profile", "--model", tmp_path / "ckpt", "--policy", "on-demand", "--prompt-ids", ",".join(map(str, prompt)),
            "--tokens", "5", "--out", out, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    tr = read_trace(out)
    assert tr.prompt_ids.tolist() == [prompt] and tr.token_ids[0].tolist() == want.tolist()


@pytest.mark.parametrize("ids, says", [
    ("", "at least one token id"), ("1,x", "comma-separated token ids"), (f"1,{VOCAB}", "outside the vocabulary"),
    ("-1", "outside the vocabulary"),
])
def test_bad_prompt_ids_are_one_line_before_the_model_loads(tmp_path, monkeypatch, ids, says):
    save_tiny("deepseek_v3", tmp_path / "ckpt")

    def no_model(*a, **k):
        raise AssertionError("loaded the model before checking --prompt-ids")

    monkeypatch.setattr(runs, "load_model", no_model)
    with pytest.raises(MoesimError) as e:
        runs.record_decode(runs.DecodeRequest(model=str(tmp_path / "ckpt"), policy="on-demand", prompt_ids=ids,
                                              tokens=2), tmp_path / "x.npz")
    assert says in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------

def test_mxfp4_dequantisation_equals_transformers_own():
    """Random codes and scales in gpt-oss's layout, dequantised by transformers'
    ``convert_moe_packed_tensors`` and by the executor's packed matrix: bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.int64).to(torch.uint8)  # [E, rows, G, 16]
    scales = torch.randint(118, 134, (3, 8, 2), generator=g, dtype=torch.int64).to(torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows], as GptOssExperts holds it
    for e in range(3):
        got = mxfp4_matrix(blocks[e], scales[e], 64).dequantize()  # [rows, cols]
        torch.testing.assert_close(got, want[e].T, rtol=0, atol=0)


def test_mxfp4_quantisation_round_trips_representable_weights_in_the_accounted_bytes():
    g = torch.Generator().manual_seed(1)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = values[torch.randint(0, 8, (5, 96), generator=g)] * torch.where(torch.rand(5, 96, generator=g) < 0.5, -1, 1)
    w[:, ::32] = 6.0  # every block's largest magnitude is 6: its scale is 2**0
    w = w * 2.0 ** torch.randint(-3, 4, (5, 1), generator=g)
    q = quantize(w, "mxfp4")
    torch.testing.assert_close(q.dequantize(), w, rtol=0, atol=0)
    assert q.nbytes == matrix_bytes(5, 96, "mxfp4")
    rough = torch.randn(7, 100, generator=g)
    assert quantize(rough, "mxfp4").nbytes == matrix_bytes(7, 100, "mxfp4")
    assert ((quantize(rough, "mxfp4").dequantize() - rough).norm() / rough.norm()) < 0.2


def _mxfp4_checkpoint(dense_dir, out_dir):
    """The dense tiny gpt-oss checkpoint with its experts stored as MXFP4 in gpt-oss's hub
    layout (``*_blocks`` / ``*_scales``, gate and up interleaved by rows), and the config's
    ``quantization_config`` saying so."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(dense_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(key)  # [E, in, out]
        packed = [quantize(w[e].T, "mxfp4") for e in range(w.shape[0])]  # rows = output features
        rows, cols = packed[0].rows, packed[0].cols
        tensors[f"{key}_blocks"] = torch.stack([q.codes.view(rows, cols // 32, 16) for q in packed])
        tensors[f"{key}_scales"] = torch.stack([q.scale for q in packed])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(cfg))


def test_an_mxfp4_checkpoint_runs_packed_and_equals_transformers(tmp_path):
    """Experts stored as MXFP4 stay packed (what a copy moves is the accounted bytes) and
    are dequantised on use: the logits equal transformers' on the same checkpoint (which
    dequantises on a CPU), resident and offloaded."""
    save_tiny("gpt_oss_mxfp4", tmp_path / "dense")
    _mxfp4_checkpoint(tmp_path / "dense", tmp_path / "mx")
    ours = load_checkpoint(tmp_path / "mx")
    assert ours.packed_experts == "mxfp4" and isinstance(ours.experts[0][0], QuantExpert)
    ref = transformers.AutoModelForCausalLM.from_pretrained(  # dequantised on load, as transformers does on a CPU
        str(tmp_path / "mx"), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        want = ref(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), want, rtol=1e-4, atol=1e-4)
    _, recs, _ = generate(ours, TOKENS[:, :5], ProfileSettings("on-demand", tokens=3), HW, forced=TOKENS[:, 5:8])
    torch.testing.assert_close(torch.stack([r.logits for r in recs], 1), want[:, 5:8], rtol=1e-4, atol=1e-4)
    assert {c.nbytes for r in recs for c in r.copies} == {ours.spec.expert_bytes}  # MXFP4 codes, scales, bf16 biases
    with pytest.raises(MoesimError, match="stores its experts as mxfp4"):
        generate(ours, TOKENS[:, :5], ProfileSettings("on-demand", tokens=1, expert_dtype="int8"), HW)


def test_a_catalogue_gpt_oss_runs_with_packed_mxfp4_experts():
    """gpt-oss's published format is MXFP4: a synthetic model of its geometry quantises its
    random experts to it, and every policy runs the packed experts."""
    from moesim.executor.model import ExecConfig, random_model
    from moesim.models import get_model

    spec = get_model("gpt-oss-20b").with_layers(2)
    small = type(spec)(**{**spec.__dict__, "hidden": 64, "expert_inter": 64, "n_experts": 8, "vocab": 128,
                          "attention": type(spec.attention)(**{**spec.attention.__dict__, "n_heads": 4,
                                                               "n_kv_heads": 2, "head_dim": 16})})
    model = random_model(ExecConfig(small), seed=0)
    assert model.packed_experts == "mxfp4" and model.cfg.sinks and model.cfg.router.method == "topk_softmax"
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    _, _, want = generate(model, prompt, ProfileSettings("all-resident", tokens=3), HW)
    _, recs, got = generate(model, prompt, ProfileSettings("prefetch-fom", predictor="stale", tokens=3), HW)
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    assert {c.nbytes for r in recs for c in r.copies} == {small.expert_bytes}
    np.testing.assert_array_equal(recs[0].true_ids.shape, (2, 1, spec.top_k))
