"""Every decoder-only MoE family: real configs read to their published sizes, the two
readers agree, and a tiny random checkpoint of every family transformers has is read
(parameter total = the meta model's) and recorded."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from moesim.errors import MoesimError
from moesim.hf_config import hand_spec, transformers_spec
from moesim.models import get_model, read_config

CONFIGS = Path(__file__).parent / "data" / "configs"

#: name -> (published total, published active, where the figure is published). Totals of
#: the text decoder as Hugging Face builds it (no MTP module, no vision tower).
PUBLISHED = {
    "AI21-Jamba-1.5-Mini": (52e9, 12e9, "ai21labs/AI21-Jamba-1.5-Mini model card: 52B total, 12B active"),
    "DeepSeek-V2-Lite": (15.7e9, 2.4e9, "deepseek-ai/DeepSeek-V2-Lite model card: 15.7B total, 2.4B active"),
    "DeepSeek-V3.1": (671e9, 37e9, "deepseek-ai/DeepSeek-V3.1 model card: 671B total, 37B active"),
    "ERNIE-4.5-21B-A3B-PT": (21e9, 3e9, "baidu/ERNIE-4.5-21B-A3B-PT model card: 21B total, 3B active"),
    "GLM-4.5": (355e9, 32e9, "zai-org/GLM-4.5 model card: 355B total, 32B active"),
    "GLM-4.5-Air": (106e9, 12e9, "zai-org/GLM-4.5-Air model card: 106B total, 12B active"),
    "GLM-4.7-Flash": (30e9, 3e9, "zai-org/GLM-4.7-Flash model card: 30B-A3B"),
    "Hunyuan-A13B-Instruct": (80e9, 13e9, "tencent/Hunyuan-A13B-Instruct model card: 80B total, 13B active"),
    "Kimi-K2-Instruct": (1.04e12, 32e9, "moonshotai/Kimi-K2-Instruct model card: 1T total (1.04T), 32B active"),
    "Llama-4-Maverick-17B-128E-Instruct": (400e9, 17e9, "meta-llama/Llama-4-Maverick model card: 400B total, 17B "
                                                         "active"),
    "Llama-4-Scout-17B-16E-Instruct": (109e9, 17e9, "meta-llama/Llama-4-Scout model card: 109B total, 17B active"),
    "MiniMax-M2": (230e9, 10e9, "MiniMaxAI/MiniMax-M2 model card: 230B total, 10B active"),
    "Mixtral-8x22B-v0.1": (141e9, 39e9, "mistral.ai Mixtral 8x22B announcement: 141B total, 39B active"),
    "Mixtral-8x7B-v0.1": (46.7e9, 12.9e9, "Mixtral of Experts, arXiv:2401.04088: 47B total, 13B active"),
    "OLMoE-1B-7B-0924": (6.9e9, 1.3e9, "allenai/OLMoE-1B-7B-0924 model card: 6.9B total, 1.3B active"),
    "Phi-3.5-MoE-instruct": (41.9e9, 6.6e9, "microsoft/Phi-3.5-MoE-instruct model card: 41.9B total, 6.6B active"),
    "Qwen1.5-MoE-A2.7B": (14.3e9, 2.7e9, "Qwen/Qwen1.5-MoE-A2.7B model card: 14.3B total, 2.7B active"),
    "Qwen3-235B-A22B": (235e9, 22e9, "Qwen/Qwen3-235B-A22B model card: 235B total, 22B active"),
    "Qwen3-30B-A3B": (30.5e9, 3.3e9, "Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B active"),
    "Qwen3-Coder-480B-A35B-Instruct": (480e9, 35e9, "Qwen/Qwen3-Coder-480B-A35B-Instruct model card: 480B, 35B active"),
    "Qwen3-Next-80B-A3B-Instruct": (80e9, 3e9, "Qwen/Qwen3-Next-80B-A3B-Instruct model card: 80B total, 3B active"),
    "Qwen3.5-35B-A3B": (35e9, 3e9, "Qwen/Qwen3.5-35B-A3B model card: 35B total, 3B active"),
    "dbrx-instruct": (132e9, 36e9, "databricks/dbrx-instruct model card: 132B total, 36B active"),
    "dots.llm1.inst": (142e9, 14e9, "rednote-hilab/dots.llm1.inst model card: 142B total, 14B active"),
    "gpt-oss-120b": (116.83e9, 5.13e9, "OpenAI gpt-oss model card (arXiv:2508.10925): 116.83B total"),
    "gpt-oss-20b": (20.91e9, 3.61e9, "OpenAI gpt-oss model card (arXiv:2508.10925): 20.91B total"),
    "granite-3.1-3b-a800m-instruct": (3.3e9, 0.8e9, "ibm-granite/granite-3.1-3b-a800m-instruct: 3.3B, 800M active"),
}


def test_every_fixture_has_a_published_size():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(PUBLISHED)
    assert len(PUBLISHED) >= 25


_SPECS: dict[str, object] = {}


def _spec(name: str):
    """get_model of a fixture, once per run (each builds a meta-device model)."""
    if name not in _SPECS:
        _SPECS[name] = get_model(str(CONFIGS / name))
    return _SPECS[name]


@pytest.mark.filterwarnings("ignore:.*read by moesim's own key rules")
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_configs_read_to_their_published_totals(name):
    spec = _spec(name)
    total, _, _ = PUBLISHED[name]
    assert abs(spec.total_params - total) / total < 0.04, (name, spec.total_params / 1e9)
    assert spec.active_params < spec.total_params
    assert spec.n_moe_layers > 0 and spec.expert_bytes > 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hand_parser_gives_the_transformers_spec(name):
    path = CONFIGS / name / "config.json"
    raw = read_config(path)
    hand = hand_spec(raw, path)
    if name == "dbrx-instruct":  # transformers 5 refuses DBRX's own config (an int where it wants a float)
        with pytest.raises(Exception, match="moe_normalize_expert_weights"):
            transformers_spec(path, raw)
        with pytest.warns(UserWarning, match="read by moesim's own key rules"):
            assert get_model(str(path.parent)) == hand
        return
    assert _spec(name) == hand  # get_model went through transformers


def test_without_transformers_the_hand_parser_reads(monkeypatch):
    import moesim.hf_config as hf

    monkeypatch.setattr(hf, "transformers_available", lambda: False)
    for name in ("Qwen3-Next-80B-A3B-Instruct", "Llama-4-Maverick-17B-128E-Instruct", "Kimi-K2-Instruct"):
        path = CONFIGS / name / "config.json"
        assert get_model(str(path.parent)) == hand_spec(read_config(path), path)


def test_modelled_features_of_the_2026_families():
    scout, maverick = _spec("Llama-4-Scout-17B-16E-Instruct"), _spec("Llama-4-Maverick-17B-128E-Instruct")
    assert maverick.moe_layers == tuple(range(1, 48, 2)) and maverick.dense_inter == 16384
    assert scout.n_moe_layers == 48 and scout.n_shared == 1
    assert [scout.layer_kind(i) for i in range(4)] == ["chunked"] * 3 + ["full"]
    assert scout.kv_tokens(0, 10_000) == 10_000 - 8192 and scout.kv_tokens(3, 10_000) == 10_000
    nxt = _spec("Qwen3-Next-80B-A3B-Instruct")
    assert [nxt.layer_kind(i) for i in range(4)] == ["linear"] * 3 + ["full"]
    assert nxt.kv_bytes_per_token(0) == 0 and nxt.state_bytes(0) == 2 * (32 * 128 * 128 + 3 * (2 * 2048 + 4096))
    assert nxt.kv_cache_bytes(2, 1000) == 2 * (12 * 1000 * nxt.kv_bytes_per_token_layer + 36 * nxt.state_bytes(0))
    q35 = _spec("Qwen3.5-35B-A3B")
    assert q35.n_mtp_layers == 1 and q35.mtp_layer_bytes > 256 * q35.expert_bytes
    oss = _spec("gpt-oss-120b")
    assert oss.layer_kind(0) == "sliding" and oss.kv_tokens(0, 5000) == 127 and oss.kv_tokens(1, 5000) == 5000
    jamba = _spec("AI21-Jamba-1.5-Mini")
    assert sum(jamba.layer_kind(i) == "full" for i in range(32)) == 4 and jamba.linear.kind == "mamba"
    kimi = _spec("Kimi-K2-Instruct")  # model_type kimi_k2: DeepseekV3ForCausalLM
    assert kimi.family == "deepseek_v3" and kimi.expert_dtype == "fp8-block128" and kimi.dense_layers == (0,)


# --------------------------------------------------------------------------------------
# Tiny random checkpoints of every family transformers has
# --------------------------------------------------------------------------------------

RECORD_XFAIL: dict[str, str] = {}  # families read but not recordable (executor/record.py): none left
#: Families moesim refuses, in one line that names what is missing.
REFUSED = {
    "bailing_hybrid": "linear layers need a LinearAttention of a known kind",
    "kimi_linear": "linear layers need a LinearAttention of a known kind",
    "lara_mini": "linear layers need a LinearAttention of a known kind",
    "cohere2_moe": "counts .* parameters more than transformers builds",
    "deepseek_v4": "layer type 'compressed_sparse_attention' is not modelled",
    "inkling_text": "layer type 'hybrid' is not modelled",
    "zaya": "layer type 'hybrid' is not modelled",
    "ergo": "this expert layout is not modelled",
    "jetmoe": "this expert layout is not modelled",
    "nemotron_h": "missing field num_hidden_layers",
}
#: Families whose shrunk random model this transformers cannot build (its own errors).
UNBUILDABLE = {
    "dbrx": "transformers 5.24's DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig lacks",
    "dots3_note_text": "transformers' per-layer spec validation refuses a shrunk layer pattern",
    "lfm2_moe": "transformers' Lfm2MoeConfig cannot be rebuilt from its own to_dict() (layer_types None)",
    "kolibri1_1": "transformers' Kolibri1_1 validator refuses the shrunk index_layers ([4, 14, 19, 29] in 4 layers)",
    "longcat_flash": "LongcatFlash stacks num_layers x 2 sub-layers; the shrunk checkpoint has no plain layer stack",
    "qwen4_exp_text": "transformers' Qwen4ExpTextConfig defaults leave sizes None",
    "inkling2_text": "transformers builds Inkling2 from shrunk defaults with a negative embedding size (-199802)",
    "inkling2_loop_text": "transformers builds Inkling2 from shrunk defaults with a negative embedding size (-199802)",
}
#: Families recorded in the default run; the rest run with -m slow (about 2 s each).
FAST = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "granitemoehybrid", "minimax",
        "ernie4_5_moe", "llama4_text", "jamba")
FAMILIES = sorted(["afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx",
                   "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots1", "dots3_note_text",
                   "ergo", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
                   "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                   "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text", "inkling2_text", "inkling_text",
                   "jamba", "jetmoe", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2_moe", "llama4_text",
                   "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl_text",
                   "mixtral", "nemotron_h", "olmoe", "param2moe", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe",
                   "qwen3_next", "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "solar_open", "zaya"])


@pytest.fixture(scope="module")
def families():
    from moe_families import families as enumerate_families

    return enumerate_families()


#: The constraints CI installs from (.ci/run): the versions the suite was last green on.
CONSTRAINTS = Path(__file__).parents[1] / ".ci" / "constraints.txt"
#: Families the unlisted-family check always runs beside the unlisted ones, so that its read
#: and its refusal paths are exercised on the pinned transformers too (which has none unlisted).
CONTROLS = ("param2moe", "ergo")


def pinned_transformers() -> str | None:
    """The transformers version in .ci/constraints.txt (None without the file, as installed)."""
    if not CONSTRAINTS.is_file():
        return None
    for line in CONSTRAINTS.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == "transformers":
            return version.strip()
    return None


def test_the_family_list_is_transformers_own(families):
    """On the pinned transformers, every causal-LM family with an expert count that builds
    experts on the meta device is in FAMILIES, and nothing else is. On another release (the
    newest, ``bench/newest_packages.sh``), the families it adds or drops are a warning, not a
    failure: the added ones are checked by the test below, the dropped ones skipped."""
    import transformers

    added, dropped = sorted(set(families) - set(FAMILIES)), sorted(set(FAMILIES) - set(families))
    if transformers.__version__ == pinned_transformers():
        assert (added, dropped) == ([], []), "update FAMILIES (and its marks) for the pinned transformers"
    elif added or dropped:
        warnings.warn(f"transformers {transformers.__version__} (pinned: {pinned_transformers()}) adds the MoE "
                      f"families {added or 'none'} and drops {dropped or 'none'}: the added ones are checked by "
                      "test_a_family_moesim_has_not_seen_is_read_or_refused_in_one_line", stacklevel=1)


def test_a_family_moesim_has_not_seen_is_read_or_refused_in_one_line(families, tmp_path):
    """A family transformers adds (not in FAMILIES) is read through AutoConfig to the meta
    model's parameter total, or refused in one MoesimError line - never another exception.
    CONTROLS run too: one family read, one refused."""
    from moesim.hf_config import meta_model, stored_params

    unseen = sorted(set(families) - set(FAMILIES))
    outcome = {}
    for family in [*unseen, *CONTROLS]:
        try:
            d = _checkpoint(families, family, tmp_path)
        except Exception as e:  # noqa: BLE001 - transformers itself cannot build or save this shrunk family
            outcome[family] = f"unbuildable: {type(e).__name__}"
            continue
        try:
            spec = get_model(str(d))
        except MoesimError as e:
            assert "\n" not in str(e), (family, str(e))
            outcome[family] = "refused"
            continue
        from moe_families import quiet

        with quiet():
            assert spec.total_params == stored_params(meta_model(families[family])), family
        outcome[family] = "read"
    assert outcome["param2moe"] == "read" and outcome["ergo"] == "refused", outcome
    if unseen:
        warnings.warn(f"families moesim has not been tested on: {({f: outcome[f] for f in unseen})}", stacklevel=1)


def _params(fam: str, what: str):
    out = []
    for f in FAMILIES:
        marks = [] if f in FAST else [pytest.mark.slow]
        if f in UNBUILDABLE:
            marks.append(pytest.mark.xfail(strict=True, reason=UNBUILDABLE[f]))
        elif what == "record" and f in RECORD_XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=RECORD_XFAIL[f]))
        if what == "record" and f in REFUSED:
            continue
        out.append(pytest.param(f, marks=marks))
    return out


def _checkpoint(families, family: str, tmp_path: Path) -> Path:
    from moe_families import quiet
    from tiny_checkpoints import save_random_checkpoint

    if family not in families:
        pytest.skip(f"the installed transformers has no {family} (FAMILIES is for the pinned one)")
    cfg = families[family]
    if isinstance(cfg, Exception):
        raise cfg
    d = tmp_path / family
    with quiet():
        save_random_checkpoint(cfg, d)
    return d


@pytest.mark.parametrize("family", _params("", "read"))
def test_every_family_is_read(families, family, tmp_path):
    from moe_families import quiet
    from typer.testing import CliRunner

    from moesim.cli import every_command

    app = every_command()
    from moesim.hf_config import meta_model, stored_params

    d = _checkpoint(families, family, tmp_path)
    if family in REFUSED:
        with pytest.raises((MoesimError, RuntimeError), match=REFUSED[family]) as e:
            get_model(str(d))
        assert "\n" not in str(e.value)
        return
    spec = get_model(str(d))
    with quiet():
        assert spec.total_params == stored_params(meta_model(families[family]))
    r = CliRunner().invoke(app, ["models", str(d), "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)["models"][0]
    assert row["total_params"] == spec.total_params and row["moe_layers"] == spec.n_moe_layers
    assert dataclasses.replace(spec) == spec


@pytest.mark.parametrize("family", _params("", "record"))
def test_every_family_is_recorded(families, family, tmp_path):
    from typer.testing import CliRunner

    from moesim.cli import every_command

    app = every_command()
    from moesim.traces.format import read_trace

    d = _checkpoint(families, family, tmp_path)
    out = tmp_path / "r.npz"
    r = CliRunner().invoke(app, ["record", str(d), "--tokens", "4", "--out", str(out)])
    if r.exit_code != 0:
        raise AssertionError(r.output[-600:] + repr(r.exception))
    t = read_trace(out)
    spec = get_model(str(d))
    assert t.true_ids.shape[:2] == (4, spec.n_moe_layers) and t.model.n_moe_layers == spec.n_moe_layers
