"""Model families: what a family's ``config.json`` and checkpoint mean for execution.

Everything the executor knows about a family lives in ONE adapter (:class:`Family`),
registered in :data:`FAMILIES`: the transformers class its numerics follow, the config keys
that become :class:`ExecConfig` fields (router rule, RoPE, biases, attention windows), its
hub weight names (router, shared experts, expert layout) and its scalars (q/k-norm kind,
shared-expert gate, fp32 router, fp32 norms, RoPE convention, attention sinks). A new
family is one adapter here and one test in ``tests/test_executor_model.py``; the modules
in :mod:`moesim.executor.model` only read :class:`ExecConfig`.

Geometry (layers, experts, widths, dense layers) comes from :class:`moesim.models.ModelSpec`
(``from_hf_config``); an adapter corrects only what execution must get right
(:meth:`Family.fix_spec`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from moesim.errors import MoesimError
from moesim.executor.quant_experts import QuantExpert, mxfp4_matrix
from moesim.models import ModelSpec, from_hf_config, read_config

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PACKED_EXPERTS = ("mxfp4",)  # expert formats a checkpoint may store and the executor runs packed
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "topk_softmax")


# --------------------------------------------------------------------------------------
# Execution settings beyond geometry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterRule:
    """What a router does beyond plain softmax top-k, as transformers computes it.

    ``group_limited_greedy`` (``DeepseekV2TopkRouter``): softmax, the experts split into
    ``n_group`` groups, only the ``topk_group`` groups whose best expert scores highest
    compete. ``noaux_tc`` (``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``,
    ``Glm4MoeLiteTopkRouter``): sigmoid scores; the choice adds each layer's
    ``e_score_correction_bias`` and ranks groups by the sum of their two best; the gates
    are the UNbiased scores of the chosen experts, renormalised if ``norm_topk_prob``.
    ``topk_softmax`` (``GptOssTopKRouter``): top-k of the (biased) logits, then a softmax
    over the k chosen. Then every rule multiplies the gates by ``scale``
    (``routed_scaling_factor``). The defaults are plain softmax top-k."""

    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (Peng et al., "YaRN: Efficient Context Window Extension of Large
    Language Models", arXiv:2309.00071) as transformers' ``_compute_yarn_parameters``
    computes it: frequencies blend interpolated (/ ``factor``) and original ones over a
    linear ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times in
    ``original_max`` positions; cos and sin are scaled by the attention factor, and MLA's
    softmax scale by ``yarn_mscale(factor, mscale_all_dim)**2`` (DeepSeek)."""

    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def frequencies(self, inv: Tensor, dim: int, theta: float) -> Tensor:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv.device) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
        return inv / self.factor * (1 - extrapolation) + inv * extrapolation


@dataclass(frozen=True)
class SwiGLU:
    """An expert's gated activation of (gate, up): ``silu(g) * u``, or with ``limit`` gpt-oss's
    clamped form (``GptOssExperts._apply_gate``): ``g`` clamped above at ``limit``, ``u`` to
    ``[-limit, limit]``, then ``(u + 1) * g * sigmoid(alpha * g)``."""

    limit: float | None = None
    alpha: float = 1.0

    def __call__(self, g: Tensor, u: Tensor) -> Tensor:
        if self.limit is None:
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


SILU = SwiGLU()
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}  # transformers' layer_types values

#: ExecConfig fields a family supplies when they are left at None (see :class:`Family`).
_FAMILY_FIELDS = ("shared_gate", "router_fp32", "norm_fp32", "rope_pairs", "sinks", "partial_rotary")
#: ... and the values of the fields its config reader does not set.
_PLAIN = {"router": RouterRule(), "mla_bias": False, "o_bias": False, "router_bias": False, "act": SILU}


@dataclass(frozen=True)
class ExecConfig:
    """A model spec plus the numbers execution needs beyond geometry.

    Fields left at None take the family's value (:class:`Family`, by ``spec.family``), so
    ``ExecConfig(spec)`` runs any catalogue geometry of an executable family with that
    family's numerics; :meth:`from_hf` fills every field from a checkpoint's config."""

    spec: ModelSpec
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_seq_len: int = 4096
    router: RouterRule | None = None  # the family's (default config's) when None
    mla_bias: bool | None = None  # DeepSeek's attention_bias: q_a, kv_a and o projections
    yarn: Yarn | None = None  # RoPE scaling; None: plain RoPE
    partial_rotary: float | None = None  # fraction of each head's dims RoPE rotates (GLM-4-MoE: 0.5)
    qk_norm: str | None = None  # "head": per head (Qwen3), "full": over all heads (OLMoE), "none"
    qkv_bias: bool | None = None  # q/k/v projection biases (None: the spec's attention.bias)
    o_bias: bool | None = None  # output projection bias (gpt-oss)
    shared_gate: bool | None = None  # a sigmoid gate on the shared experts (Qwen2-MoE)
    router_fp32: bool | None = None  # router weight kept and applied in fp32 (DeepSeek, GLM)
    router_bias: bool | None = None  # the router linear has a bias (gpt-oss)
    norm_fp32: bool | None = None  # RMSNorm weights kept in fp32 and applied before the cast (gpt-oss)
    rope_pairs: bool | None = None  # MLA RoPE on adjacent pairs (DeepSeek's interleaved layout) or halves
    sinks: bool | None = None  # one learned attention-sink logit per head (gpt-oss)
    sliding_window: int = 0  # tokens a sliding layer attends to (0: none)
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding" (empty: all full)
    act: SwiGLU | None = None  # the experts' activation (the family's; silu(g) * u for all but gpt-oss)

    def __post_init__(self) -> None:
        s = self.spec
        fam = FAMILIES.get(s.family)
        mla = s.attention.kind == "mla" and fam is not None and fam.mla
        if fam is None or not (s.attention.kind == "gqa" or mla) or not getattr(s, "expert_gated", True):
            raise MoesimError(f"the executor runs gated-expert GQA and MLA models of the families "
                              f"{', '.join(FAMILIES)}; {s.name} ({s.family}, {s.attention.kind}) is not one")
        if s.expert_dtype not in TORCH_DTYPES and s.expert_dtype not in PACKED_EXPERTS:
            raise MoesimError(f"{s.name}: {s.expert_dtype} experts are not executable (bf16, fp32, or mxfp4 as "
                              "stored); the executor is not one that runs them")
        for name in _FAMILY_FIELDS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(fam, name))
        # The family's numerics as its config's defaults give them (a catalogue geometry has
        # no config.json), then the plain ones.
        defaults = {**_PLAIN, **fam.config({"model_type": s.family}, s, Path(s.source or s.name))}
        for name, value in defaults.items():
            if name != "qkv_bias" and getattr(self, name) is None:
                object.__setattr__(self, name, value)
        r = self.router
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", fam.qk_norm if s.attention.qk_norm else "none")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", bool(s.attention.bias))
        if r.method not in TOPK_METHODS:
            raise MoesimError(f"{s.name}: topk_method {r.method!r} is not executable ({', '.join(TOPK_METHODS)})")
        if r.method in ("group_limited_greedy", "noaux_tc") and (
                s.n_experts % r.n_group or not 0 < r.topk_group <= r.n_group
                or r.topk_group * (s.n_experts // r.n_group) < s.top_k
                or r.method == "noaux_tc" and s.n_experts // r.n_group < 2):
            raise MoesimError(f"{s.name}: n_group {r.n_group} / topk_group {r.topk_group} do not fit "
                              f"{s.n_experts} experts and top-{s.top_k}")
        if self.layer_types and (len(self.layer_types) != s.n_layers or set(self.layer_types) - {"full", "sliding"}):
            raise MoesimError(f"{s.name}: layer_types must give full or sliding for each of {s.n_layers} layers")
        if "sliding" in self.layer_types and self.sliding_window <= 0:
            raise MoesimError(f"{s.name}: sliding layers need sliding_window > 0")

    @property
    def family(self) -> Family:
        return FAMILIES[self.spec.family]

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(cached heads, key dim, value dim) of one token in one layer's KV cache. MLA is
        cached UNCOMPRESSED: every head's expanded key (nope + rope) and value."""
        a = self.spec.attention
        if a.kind == "mla":
            return a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
        return a.n_kv_heads, a.head_dim, a.head_dim

    @property
    def expert_width(self) -> int:
        """Elements of one routed expert's flat buffer ``[gate; up; down(; biases)]``."""
        s = self.spec
        return 3 * s.hidden * s.expert_inter + ((2 * s.expert_inter + s.hidden) if s.expert_bias else 0)

    def window(self, layer: int) -> int:
        """Tokens model layer ``layer`` attends to (0: all)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else 0

    def with_dtype(self, dtype: torch.dtype) -> ExecConfig:
        """The same model stored in ``dtype`` (packed experts stay packed): the spec's byte
        accounting follows (one source of truth)."""
        name = next(k for k, v in TORCH_DTYPES.items() if v == dtype)
        s = self.spec
        experts = s.expert_dtype if s.expert_dtype in PACKED_EXPERTS else name
        # The checkpoint's exact byte counts were for the format it is stored in (bf16
        # safetensors); held in another, the format's formula counts them. Kept, they made an
        # fp32 run's trace say 49,152 bytes an expert where 98,304 crossed the link, and every
        # replay of it price half the copies (issue 51).
        return replace(self, spec=replace(
            s, expert_dtype=experts, dense_dtype=name,
            expert_bytes_by_layer=s.expert_bytes_by_layer if experts == s.expert_dtype else (),
            artefact_layer_bytes=s.artefact_layer_bytes if name == s.dense_dtype else ()))

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ExecConfig:
        return exec_config(model_dir)


# --------------------------------------------------------------------------------------
# The adapters
# --------------------------------------------------------------------------------------

ExpertLoader = Callable[["Family", dict[str, Tensor], int, ExecConfig], list]


def _per_expert(fam: Family, tensors: dict[str, Tensor], layer: int, cfg: ExecConfig) -> list:
    """Experts stored one tensor per expert and matrix (the hub layout of most families;
    ``save_pretrained`` writes it), or transformers 5's fused in-memory layout
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    s = cfg.spec
    pre = f"model.layers.{layer}.{fam.moe_prefix}.experts"
    names = [f"{pre}.{{e}}.{n}.weight" for n in fam.expert_names]
    if f"{pre}.gate_up_proj" in tensors and names[0].format(e=0) not in tensors:
        gate_up, down = _need(tensors, f"{pre}.gate_up_proj"), _need(tensors, f"{pre}.down_proj")
        return [torch.cat([gate_up[e].reshape(-1), down[e].reshape(-1)]) for e in range(s.n_experts)]
    return [torch.cat([_need(tensors, n.format(e=e)).reshape(-1) for n in names]) for e in range(s.n_experts)]


def _gpt_oss_experts(fam: Family, tensors: dict[str, Tensor], layer: int, cfg: ExecConfig) -> list:
    """gpt-oss's fused experts (``GptOssExperts``): ``gate_up_proj`` [E, H, 2I] with gate and
    up INTERLEAVED along the last axis (``[..., ::2]`` gate), ``down_proj`` [E, I, H] (both
    transposed against ``nn.Linear``), and biases; or, stored as MXFP4 (``*_blocks`` uint8
    [E, rows, cols/32, 16] and ``*_scales`` E8M0 [E, rows, cols/32], rows = output
    features), kept packed (:class:`~moesim.executor.quant_experts.QuantExpert`) and
    dequantised on use."""
    s = cfg.spec
    pre = f"model.layers.{layer}.mlp.experts"
    gu_b, down_b = _need(tensors, f"{pre}.gate_up_proj_bias"), _need(tensors, f"{pre}.down_proj_bias")
    if f"{pre}.gate_up_proj_blocks" in tensors:
        gu, gu_s = _need(tensors, f"{pre}.gate_up_proj_blocks"), _need(tensors, f"{pre}.gate_up_proj_scales")
        dn, dn_s = _need(tensors, f"{pre}.down_proj_blocks"), _need(tensors, f"{pre}.down_proj_scales")
        out = []
        for e in range(s.n_experts):
            bias = torch.cat([gu_b[e, 0::2], gu_b[e, 1::2], down_b[e]])
            out.append(QuantExpert(mxfp4_matrix(gu[e, 0::2], gu_s[e, 0::2], s.hidden),
                                   mxfp4_matrix(gu[e, 1::2], gu_s[e, 1::2], s.hidden),
                                   mxfp4_matrix(dn[e], dn_s[e], s.expert_inter), bias))
        return out
    gu, dn = _need(tensors, f"{pre}.gate_up_proj"), _need(tensors, f"{pre}.down_proj")
    return [torch.cat([gu[e][:, 0::2].T.reshape(-1), gu[e][:, 1::2].T.reshape(-1), dn[e].T.reshape(-1),
                       gu_b[e, 0::2], gu_b[e, 1::2], down_b[e]]) for e in range(s.n_experts)]


def _need(tensors: dict[str, Tensor], key: str) -> Tensor:
    if key not in tensors:
        raise MoesimError(f"checkpoint lacks {key}")
    return tensors[key]


def _no_keys(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family: the transformers class its numerics follow, its scalars, its hub
    weight names and how it reads its own config keys.

    ``config(cfg, spec, path)`` returns the family's :class:`ExecConfig` fields from its
    ``config.json`` (router rule, biases, RoPE layout, activation) and refuses, in one
    line, settings it would otherwise run wrongly; ``fix_spec`` corrects geometry the
    generic reader cannot know."""

    model_type: str
    reference: str  # the transformers class whose numerics (and tests) this follows
    qk_norm: str = "head"  # the kind of q/k norm when the spec has one: "head" or "full"
    shared_gate: bool = False
    router_fp32: bool = False
    norm_fp32: bool = False
    rope_pairs: bool = False
    sinks: bool = False
    partial_rotary: float = 1.0
    mla: bool = False  # multi-head latent attention (run uncompressed)
    router_key: str = "mlp.gate"  # the hub name of an MoE layer's router
    shared_key: str = "mlp.shared_experts"  # ... of its fused shared experts
    moe_prefix: str = "mlp"  # ... of its MoE block (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts: ExpertLoader = _per_expert
    config: Callable[[dict, ModelSpec, Path], dict] = _no_keys
    fix_spec: Callable[[dict, ModelSpec, Path], ModelSpec] = field(default=lambda cfg, spec, path: spec)

    def hub_key(self, name: str) -> str:
        """The checkpoint's name of our parameter ``name`` (dense MLPs are ``mlp.*`` in both)."""
        if name.startswith("lm_head"):
            return name
        key = f"model.{name}"
        key = key.replace(".mlp.shared_experts.", f".{self.shared_key}.")
        return key.replace(".mlp.gate.", f".{self.router_key}.")


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def family_of(model_type: str | None, where: str = "") -> Family:
    if model_type not in FAMILIES:
        raise MoesimError(f"{where}model_type {model_type!r} is not executable; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


# -- family config readers ---------------------------------------------------------------


def _norm_topk(spec: ModelSpec, value: bool) -> ModelSpec:
    return replace(spec, norm_topk_prob=bool(value))


def _deepseek_v2(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise MoesimError(f"{path}: scoring_func {cfg['scoring_func']!r} is not executable for deepseek_v2 (softmax)")
    if cfg.get("norm_topk_prob"):  # transformers ignores it, DeepSeek's own code renormalises: refuse
        raise MoesimError(f"{path}: norm_topk_prob true is not executable for deepseek_v2 "
                          "(transformers and DeepSeek's code disagree)")
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):  # what DeepseekV2TopkRouter computes
        raise MoesimError(f"{path}: topk_method {method!r} is not executable for deepseek_v2 "
                          "(greedy, group_limited_greedy)")
    return {"router": _groups(cfg, method), "mla_bias": bool(cfg.get("attention_bias", False))}


def _noaux(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    """The DeepSeek-V3 router (``noaux_tc``: sigmoid, selection bias, groups) and MLA's
    attention biases and RoPE layout (``rope_interleave``: adjacent pairs, else halves)."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise MoesimError(f"{path}: scoring_func {cfg.get('scoring_func')!r} / topk_method {cfg.get('topk_method')!r} "
                          f"are not executable for {cfg.get('model_type')} (sigmoid, noaux_tc)")
    return {"router": _groups(cfg, "noaux_tc"), "mla_bias": bool(cfg.get("attention_bias", False)),
            "rope_pairs": bool(cfg.get("rope_interleave", True))}


def _groups(cfg: dict, method: str) -> RouterRule:
    return RouterRule(method, int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
                      float(cfg.get("routed_scaling_factor") or 1.0))


def _glm4_moe(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    return {"router": _groups(cfg, "noaux_tc"), "qkv_bias": bool(cfg.get("attention_bias", False))}


def _gpt_oss_keys(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    bias = bool(cfg.get("attention_bias", True))
    return {"router": RouterRule("topk_softmax"), "qkv_bias": bias, "o_bias": bias, "router_bias": True,
            "act": SwiGLU(float(cfg.get("swiglu_limit", 7.0)), float(cfg.get("swiglu_alpha", 1.702)))}


def _qwen2_moe(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    return {"qkv_bias": bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))}


def _mlp_layer_types(cfg: dict, spec: ModelSpec, path: Path) -> ModelSpec:
    """GLM-4.7-Flash marks dense layers in ``mlp_layer_types`` ("dense" / "sparse";
    transformers' ``Glm4MoeLiteDecoderLayer``), not ``first_k_dense_replace``."""
    spec = _norm_topk(spec, cfg.get("norm_topk_prob", True))
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return spec
    if not isinstance(kinds, list) or len(kinds) != spec.n_layers or set(kinds) - {"dense", "sparse"}:
        raise MoesimError(f"{path}: mlp_layer_types must say dense or sparse for each of {spec.n_layers} layers")
    dense = tuple(i for i, k in enumerate(kinds) if k == "dense")
    if dense == spec.dense_layers:
        return spec
    return replace(spec, dense_layers=dense, dense_inter=spec.dense_inter or int(cfg.get("intermediate_size") or 0))


def _renorm_if_asked(cfg: dict, spec: ModelSpec, path: Path) -> ModelSpec:
    return _norm_topk(spec, cfg.get("norm_topk_prob", False))  # transformers' default for these families


register(Family("qwen3_moe", "Qwen3MoeForCausalLM", fix_spec=_renorm_if_asked))
register(Family("qwen2_moe", "Qwen2MoeForCausalLM", shared_gate=True, shared_key="mlp.shared_expert",
                config=_qwen2_moe, fix_spec=_renorm_if_asked))
register(Family("mixtral", "MixtralForCausalLM", router_key="block_sparse_moe.gate", moe_prefix="block_sparse_moe",
                expert_names=("w1", "w3", "w2"), fix_spec=lambda cfg, spec, path: _norm_topk(spec, True)))
register(Family("olmoe", "OlmoeForCausalLM", qk_norm="full", fix_spec=_renorm_if_asked))
register(Family("deepseek_v2", "DeepseekV2ForCausalLM", router_fp32=True, rope_pairs=True, mla=True,
                config=_deepseek_v2, fix_spec=lambda cfg, spec, path: _norm_topk(spec, False)))
register(Family("deepseek_v3", "DeepseekV3ForCausalLM", router_fp32=True, rope_pairs=True, mla=True,
                config=_noaux, fix_spec=lambda cfg, spec, path: _norm_topk(spec, cfg.get("norm_topk_prob", True))))
register(Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", router_fp32=True, rope_pairs=True, mla=True,
                config=_noaux, fix_spec=_mlp_layer_types))
register(Family("glm4_moe", "Glm4MoeForCausalLM", router_fp32=True, partial_rotary=0.5, config=_glm4_moe,
                fix_spec=lambda cfg, spec, path: _norm_topk(spec, cfg.get("norm_topk_prob", True))))
register(Family("gpt_oss", "GptOssForCausalLM", norm_fp32=True, sinks=True, router_key="mlp.router",
                experts=_gpt_oss_experts, config=_gpt_oss_keys))


# --------------------------------------------------------------------------------------
# From a checkpoint's config.json
# --------------------------------------------------------------------------------------


def hf_spec(model_dir: str | Path) -> tuple[ModelSpec, dict, Family]:
    """(spec as the executor runs it, the raw config, the family) of a checkpoint folder:
    :func:`moesim.models.from_hf_config`, corrected by the family's adapter."""
    path = Path(model_dir) / "config.json"
    cfg = read_config(path)
    fam = family_of(cfg.get("model_type"), f"{path}: ")
    return fam.fix_spec(cfg, from_hf_config(path), path), cfg, fam


def exec_config(model_dir: str | Path) -> ExecConfig:
    """Every :class:`ExecConfig` field from a checkpoint's ``config.json``: the generic keys
    (RoPE base and scaling, norm epsilon, context, attention windows) here, the family's own
    through its adapter. A setting the executor would run wrongly is one line."""
    spec, cfg, fam = hf_spec(model_dir)
    path = Path(model_dir) / "config.json"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):  # others (linear, dynamic, longrope) would be silently wrong
        raise MoesimError(f"{path}: RoPE type {rope_type!r} is not executable (default, yarn)")
    yarn = None
    if rope_type == "yarn":
        original = int(rope.get("original_max_position_embeddings") or 0)
        if original <= 0:
            raise MoesimError(f"{path}: yarn RoPE needs original_max_position_embeddings")
        factor = rope.get("factor") or int(cfg.get("max_position_embeddings", 0)) / original
        yarn = Yarn(float(factor), original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                    float(rope.get("mscale") or 0), float(rope.get("mscale_all_dim") or 0),
                    None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
                    bool(rope.get("truncate", True)))
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 1e4
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    kw = {"rope_theta": float(theta), "rms_eps": float(cfg.get("rms_norm_eps", 1e-6)),
          "max_seq_len": int(cfg.get("max_position_embeddings", 4096)), "yarn": yarn,
          **_windows(cfg, spec, path), **fam.config(cfg, spec, path)}
    if partial is not None:
        kw["partial_rotary"] = float(partial)
    return ExecConfig(spec, **kw)


def _windows(cfg: dict, spec: ModelSpec, path: Path) -> dict:
    """Sliding-window attention: ``layer_types`` (transformers' per-layer list), or Mixtral's
    ``sliding_window`` on every layer; ``use_sliding_window`` without a list is refused."""
    window = int(cfg.get("sliding_window") or 0)
    kinds = cfg.get("layer_types")
    if kinds is not None:
        bad = sorted({k for k in kinds if k not in LAYER_KINDS}) if isinstance(kinds, list) else [kinds]
        if bad:
            raise MoesimError(f"{path}: layer type {bad[0]!r} is not executable ({', '.join(LAYER_KINDS)})")
        types = tuple(LAYER_KINDS[k] for k in kinds)
        return {"layer_types": types, "sliding_window": window} if "sliding" in types else {}
    if cfg.get("use_sliding_window"):
        raise MoesimError(f"{path}: use_sliding_window without layer_types is not executable")
    if cfg.get("model_type") == "mixtral" and window:
        return {"layer_types": ("sliding",) * spec.n_layers, "sliding_window": window}
    return {}


__all__ = ["ExecConfig", "Family", "FAMILIES", "RouterRule", "SwiGLU", "Yarn", "exec_config", "family_of", "hf_spec",
           "register", "yarn_mscale"]
