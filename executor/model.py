"""A readable MoE decoder (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2, GLM-4-MoE) in one file.

Pre-norm blocks: RMSNorm -> attention with RoPE (GLM: on part of each head) and a KV cache
(grouped-query, or DeepSeek-V2's multi-head latent attention run uncompressed,
:class:`MLAttention`) -> residual -> RMSNorm -> top-k router (softmax; DeepSeek-V2:
group-limited and scaled; GLM-4-MoE: sigmoid with a selection bias, :class:`RouterRule`)
-> SwiGLU experts (+ shared experts, Qwen2-MoE's with a sigmoid gate) -> residual; or a
dense SwiGLU MLP in a dense layer. Geometry comes from :class:`moesim.models.ModelSpec`
(the one source of truth); this file adds only what executing needs (RoPE base and
fraction, norm epsilon, q/k-norm flavour, router rule).

Each expert's weights are one flat, contiguous tensor ``[gate; up; down]`` so that moving
an expert is one copy; :func:`expert_forward` computes an expert from such a buffer
wherever it lives (resident table, device slot or host store).

The layer pass exists once (:meth:`Block.forward`, looped by :meth:`MoEModel.hidden_states`).
How the routed experts are executed is a hook (:class:`ExpertHook`): all resident
(:class:`ResidentExperts`, which can also capture routing for calibration, distillation
and the training loss), or offloaded (``runtime.OffloadedDecoder``). Every hook mixes
experts with the one :func:`mix_experts`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moesim.errors import MoesimError
from moesim.models import ModelSpec, from_hf_config

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "glm4_moe")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterRule:
    """What a router does beyond plain softmax top-k, as transformers computes it.

    ``group_limited_greedy`` (DeepSeek-V2's ``DeepseekV2TopkRouter``): softmax, the experts
    split into ``n_group`` groups, only the ``topk_group`` groups whose best expert scores
    highest compete for the top-k. ``noaux_tc`` (GLM-4-MoE's ``Glm4MoeTopkRouter``, the
    DeepSeek-V3 router): sigmoid scores; the choice adds each layer's
    ``e_score_correction_bias`` (a buffer on the router) and ranks groups by the sum of
    their two best; the gates are the UNbiased scores of the chosen experts, renormalised
    if ``norm_topk_prob``. Then every rule multiplies the gates by ``scale``
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
    softmax scale by ``yarn_mscale(factor, mscale_all_dim)**2`` (DeepSeek-V2)."""

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
class ExecConfig:
    """A model spec plus the few numbers execution needs beyond geometry."""

    spec: ModelSpec
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_seq_len: int = 4096
    router: RouterRule = RouterRule()
    mla_bias: bool = False  # DeepSeek's attention_bias: q_a, kv_a and o projections
    partial_rotary: float = 1.0  # fraction of each head's dims RoPE rotates (GLM-4-MoE: 0.5)
    yarn: Yarn | None = None  # RoPE scaling (DeepSeek-V2's released checkpoints); None: plain RoPE

    def __post_init__(self) -> None:
        s, r = self.spec, self.router
        mla = s.attention.kind == "mla" and s.family == "deepseek_v2"
        if not (s.attention.kind == "gqa" or mla) or s.expert_dtype not in TORCH_DTYPES:
            raise MoesimError(f"the executor runs GQA models and DeepSeek-V2's MLA with bf16/fp32 experts "
                              f"({', '.join(FAMILIES)}); {s.name} is not one")
        if r.method not in TOPK_METHODS:
            raise MoesimError(f"{s.name}: topk_method {r.method!r} is not executable ({', '.join(TOPK_METHODS)})")
        if r.method != "greedy" and (s.n_experts % r.n_group or not 0 < r.topk_group <= r.n_group
                                     or r.topk_group * (s.n_experts // r.n_group) < s.top_k
                                     or r.method == "noaux_tc" and s.n_experts // r.n_group < 2):
            raise MoesimError(f"{s.name}: n_group {r.n_group} / topk_group {r.topk_group} do not fit "
                              f"{s.n_experts} experts and top-{s.top_k}")

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(cached heads, key dim, value dim) of one token in one layer's KV cache. MLA is
        cached UNCOMPRESSED: every head's expanded key (nope + rope) and value."""
        a = self.spec.attention
        if a.kind == "mla":
            return a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
        return a.n_kv_heads, a.head_dim, a.head_dim

    def with_dtype(self, dtype: torch.dtype) -> ExecConfig:
        """The same model stored in ``dtype``: the spec's byte accounting follows (one source of truth)."""
        name = next(k for k, v in TORCH_DTYPES.items() if v == dtype)
        return replace(self, spec=replace(self.spec, expert_dtype=name, dense_dtype=name))

    @property
    def router_fp32(self) -> bool:
        """DeepSeek-V2 and GLM-4-MoE keep their router weight (and GLM its selection bias)
        in fp32 and compute the logits in fp32 (transformers: ``_keep_in_fp32_modules_strict``),
        whatever the model's dtype."""
        return self.spec.family in ("deepseek_v2", "glm4_moe")

    @property
    def shared_gate(self) -> bool:
        """Qwen2-MoE scales its shared expert by ``sigmoid(w . x)`` per token; DeepSeek does not."""
        return self.spec.family == "qwen2_moe"

    @property
    def qk_norm(self) -> str:
        """``head``: RMSNorm per head (Qwen3); ``full``: over all heads (OLMoE); ``none``."""
        if not self.spec.attention.qk_norm:
            return "none"
        return "full" if self.spec.family == "olmoe" else "head"

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ExecConfig:
        path = Path(model_dir) / "config.json"
        spec = from_hf_config(path)
        if spec.family not in FAMILIES:
            raise MoesimError(f"{path}: model_type {spec.family!r} is not executable; supported: {', '.join(FAMILIES)}")
        cfg = json.loads(path.read_text())
        if cfg.get("use_sliding_window"):
            raise MoesimError(f"{path}: sliding-window attention is not executable")
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
        router = RouterRule()
        if spec.family == "deepseek_v2":
            if cfg.get("scoring_func", "softmax") != "softmax":
                raise MoesimError(f"{path}: scoring_func {cfg['scoring_func']!r} is not executable (softmax)")
            if cfg.get("norm_topk_prob"):  # transformers ignores it, DeepSeek's own code renormalises: refuse
                raise MoesimError(f"{path}: norm_topk_prob true is not executable for deepseek_v2 "
                                  "(transformers and DeepSeek's code disagree)")
            method = cfg.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):  # what DeepseekV2TopkRouter computes
                raise MoesimError(f"{path}: topk_method {method!r} is not executable for deepseek_v2 "
                                  "(greedy, group_limited_greedy)")
            router = RouterRule(method, int(cfg.get("n_group") or 1),
                                int(cfg.get("topk_group") or 1), float(cfg.get("routed_scaling_factor", 1.0)))
            spec = replace(spec, norm_topk_prob=False)
        elif spec.family == "glm4_moe":
            router = RouterRule("noaux_tc", int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
                                float(cfg.get("routed_scaling_factor", 1.0)))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial is None:
            partial = 0.5 if spec.family == "glm4_moe" else 1.0  # transformers' Glm4MoeConfig default
        return cls(spec, float(theta), float(cfg.get("rms_norm_eps", 1e-6)),
                   int(cfg.get("max_position_embeddings", 4096)), router, bool(cfg.get("attention_bias", False)),
                   float(partial), yarn)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(dim: int, theta: float, yarn: Yarn | None, device: torch.device) -> tuple[Tensor, float]:
    """(inverse frequencies [dim/2], factor on cos and sin): plain RoPE, or YaRN."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if yarn is None:
        return inv, 1.0
    return yarn.frequencies(inv, dim, theta), yarn.cos_sin_factor


def rope_tables(head_dim: int, positions: Tensor, theta: float, yarn: Yarn | None = None) -> tuple[Tensor, Tensor]:
    inv, att = rope_frequencies(head_dim, theta, yarn, positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * att, emb.sin() * att


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x``: [batch, heads, seq, head_dim]; rotate-half convention (Hugging Face)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def apply_rope_pairs(x: Tensor, positions: Tensor, theta: float, yarn: Yarn | None = None) -> Tensor:
    """``x``: [batch, heads, seq, dim]; DeepSeek's convention: adjacent pairs (2i, 2i+1) are
    one complex number rotated by ``position * theta^(-2i/dim)`` (computed in fp32)."""
    d = x.shape[-1]
    inv, att = rope_frequencies(d, theta, yarn, x.device)
    freqs = positions.float()[:, None] * inv[None, :]  # [seq, dim/2]
    cos, sin = freqs.cos() * att, freqs.sin() * att
    xf = x.float().unflatten(-1, (d // 2, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def attention_mask(t: int, start: int, tree: TreeMask | None, device: torch.device) -> Tensor:
    """[t, start + t] booleans: a tree's own mask, else causal within the new tokens with
    every cached token visible."""
    if tree is not None:
        return tree.mask
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start)


class Attention(nn.Module):
    def __init__(self, cfg: ExecConfig) -> None:
        super().__init__()
        a, h = cfg.spec.attention, cfg.spec.hidden
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(h, a.n_heads * a.head_dim, bias=a.bias)
        self.k_proj = nn.Linear(h, a.n_kv_heads * a.head_dim, bias=a.bias)
        self.v_proj = nn.Linear(h, a.n_kv_heads * a.head_dim, bias=a.bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, h, bias=False)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, cfg.rms_eps), RMSNorm(a.head_dim, cfg.rms_eps)
        elif self.qk_norm == "full":
            self.q_norm = RMSNorm(a.n_heads * a.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(a.n_kv_heads * a.head_dim, cfg.rms_eps)
        self.theta, self.yarn = cfg.rope_theta, cfg.yarn
        self.rotary_dim = int(a.head_dim * cfg.partial_rotary)  # RoPE on the first dims; the rest pass

    def forward(self, x: Tensor, cache: KVCache | None, layer: int, start: int, tree: TreeMask | None = None) -> Tensor:
        """``cache`` None: attend within ``x`` only (training). ``tree``: the new tokens are
        a candidate tree (speculative decoding), each at its own position and seeing only
        the cached prefix and its ancestors."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        positions = tree.positions if tree is not None else torch.arange(start, start + t, device=x.device)
        rd = self.rotary_dim
        cos, sin = rope_tables(rd, positions, self.theta, self.yarn)
        if rd == self.head_dim:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            q = torch.cat([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
            k = torch.cat([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
        if cache is not None:
            k, v = cache.update(layer, start, k, v)
        groups = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(t, start, tree, x.device))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention, run UNCOMPRESSED.

    Queries come from ``q_proj`` (or, with ``q_lora_rank``, the low-rank ``q_a`` -> norm
    -> ``q_b``). Keys and values come from a compressed latent: ``kv_a_proj_with_mqa`` gives
    the latent (``kv_lora_rank``) and one shared RoPE key (``qk_rope_head_dim``); the
    normed latent is expanded by ``kv_b_proj`` to every head's non-RoPE key and value.
    This straightforward implementation caches the EXPANDED per-head keys and values
    (heads x (nope + rope + v) per token), not the latent (rank + rope) that MLA was
    designed to cache, nor does it absorb ``kv_b_proj`` into the query and output: the
    logits are the same, the KV cache is larger and the attention does more work than an
    optimised MLA kernel."""

    def __init__(self, cfg: ExecConfig) -> None:
        super().__init__()
        a, h = cfg.spec.attention, cfg.spec.hidden
        self.n_heads, self.nope, self.rope, self.v_dim = a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.rank, qk = a.kv_lora_rank, a.qk_nope_head_dim + a.qk_rope_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if a.q_lora_rank:
            self.q_a_proj = nn.Linear(h, a.q_lora_rank, bias=cfg.mla_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(a.q_lora_rank, a.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, a.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, a.kv_lora_rank + a.qk_rope_head_dim, bias=cfg.mla_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.v_head_dim, h, bias=cfg.mla_bias)
        self.scale, self.theta, self.yarn = qk ** -0.5, cfg.rope_theta, cfg.yarn
        if cfg.yarn is not None and cfg.yarn.mscale_all_dim:  # transformers' yarn_apply_mscale
            self.scale *= yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2

    def forward(self, x: Tensor, cache: KVCache | None, layer: int, start: int, tree: TreeMask | None = None) -> Tensor:
        """As :meth:`Attention.forward`."""
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.n_heads, self.nope + self.rope).transpose(1, 2)  # [b, heads, t, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)  # [b, t, rank], [b, t, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # [b, t, heads * (nope + v)]
        k_nope, v = kv.view(b, t, self.n_heads, self.nope + self.v_dim).transpose(1, 2).split([self.nope, self.v_dim], -1)
        positions = tree.positions if tree is not None else torch.arange(start, start + t, device=x.device)
        q_pe = apply_rope_pairs(q_pe, positions, self.theta, self.yarn)
        k_pe = apply_rope_pairs(k_pe.view(b, 1, t, self.rope), positions, self.theta, self.yarn)  # one key shared by all heads
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, self.n_heads, t, self.rope)], dim=-1)  # [b, heads, t, nope + rope]
        if cache is not None:
            k, v = cache.update(layer, start, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(t, start, tree, x.device),
                                           scale=self.scale)  # [b, heads, t, v]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


@dataclass(frozen=True)
class TreeMask:
    """Attention of ``t`` tree tokens placed after ``start`` cached ones: ``positions`` [t]
    (RoPE positions: start + depth) and ``mask`` [t, start + t] (prefix and ancestors)."""

    positions: Tensor
    mask: Tensor

    @classmethod
    def from_parents(cls, parents: list[int], start: int, device: torch.device | str = "cpu") -> TreeMask:
        """``parents[i]`` is the index of token i's parent among the new tokens (-1: none)."""
        t = len(parents)
        mask = torch.zeros(t, start + t, dtype=torch.bool)
        mask[:, :start] = True
        depth = [0] * t
        for i, p in enumerate(parents):
            if p >= i:
                raise ValueError("a parent must come before its child")
            depth[i] = depth[p] + 1 if p >= 0 else 0
            mask[i, start + i] = True
            if p >= 0:
                mask[i, start:] |= mask[p, start:]
        return cls(torch.tensor(depth, device=device) + start, mask.to(device))


class KVCache:
    """Preallocated keys and values per layer: [batch, kv_heads, max_len, key or value dim]
    (:attr:`ExecConfig.kv_geometry`; MLA: every head, uncompressed)."""

    def __init__(self, cfg: ExecConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        heads, k_dim, v_dim = cfg.kv_geometry
        n = cfg.spec.n_layers
        self.k = [torch.zeros((batch, heads, max_len, k_dim), device=device, dtype=dtype) for _ in range(n)]
        self.v = [torch.zeros((batch, heads, max_len, v_dim), device=device, dtype=dtype) for _ in range(n)]
        self.max_len = max_len

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        if end > self.max_len:
            raise MoesimError(f"sequence of {end} tokens exceeds the KV cache of {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def keep(self, start: int, rows: list[int]) -> None:
        """After verifying a tree written at ``start``: keep only the tokens at offsets
        ``rows`` (increasing: the accepted path), moved to ``start, start + 1, ...``."""
        for k, v in zip(self.k, self.v, strict=True):
            for j, r in enumerate(rows):
                if r != j:
                    k[:, :, start + j] = k[:, :, start + r]
                    v[:, :, start + j] = v[:, :, start + r]


def expert_forward(w: Tensor, x: Tensor, hidden: int, inter: int) -> Tensor:
    """SwiGLU expert from one flat buffer ``[gate (inter x hidden); up; down (hidden x inter)]``."""
    n = inter * hidden
    gate_up = w[: 2 * n].view(2 * inter, hidden)
    down = w[2 * n:].view(hidden, inter)
    g, u = (x @ gate_up.T).split(inter, dim=-1)
    return (F.silu(g) * u) @ down.T


def route(logits: Tensor, top_k: int, renorm: bool, rule: RouterRule | None = None,
          bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax top-k router: (ids, gates), largest gate first; gates renormalised if asked.
    ``rule`` (:class:`RouterRule`): DeepSeek's group limit and gate scale, or GLM's
    sigmoid router with its selection ``bias`` [experts]."""
    if rule is not None and rule.method == "noaux_tc":
        return _route_noaux_tc(logits, top_k, renorm, rule, bias)
    probs = logits.float().softmax(-1)  # [rows, experts]
    if rule is not None and rule.method == "group_limited_greedy":
        rows, e = probs.shape
        best = probs.view(rows, rule.n_group, e // rule.n_group).amax(-1)  # [rows, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(rule.topk_group, dim=-1).indices, True)
        probs = probs.masked_fill(~keep.repeat_interleave(e // rule.n_group, dim=1), 0.0)
    gates, ids = probs.topk(top_k, dim=-1)
    if renorm:
        gates = gates / gates.sum(-1, keepdim=True)
    if rule is not None and rule.scale != 1.0:
        gates = gates * rule.scale
    return ids, gates


def _route_noaux_tc(logits: Tensor, top_k: int, renorm: bool, rule: RouterRule, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Sigmoid scores; the experts are chosen on scores + ``bias`` among the ``topk_group``
    groups with the largest sum of their two best biased scores; the gates are the chosen
    experts' unbiased scores (renormalised if asked), times ``rule.scale``."""
    scores = logits.float().sigmoid()  # [rows, experts]
    choice = scores + bias.float()
    rows, e = choice.shape
    best2 = choice.view(rows, rule.n_group, e // rule.n_group).topk(2, dim=-1).values.sum(-1)  # [rows, groups]
    keep = torch.zeros_like(best2, dtype=torch.bool).scatter_(1, best2.topk(rule.topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // rule.n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    gates = scores.gather(1, ids)
    if renorm:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
    return ids, gates * rule.scale


# --------------------------------------------------------------------------------------
# Expert execution: one mixing function, and hooks that say where experts run
# --------------------------------------------------------------------------------------

ExpertVisitor = Callable[[int, int, Tensor, Tensor], None]  # (layer, expert, rows, ungated output)


def mix_experts(x: Tensor, ids: np.ndarray, gates: Tensor, weights, hidden: int, inter: int,
                each: Callable[[int, Tensor, Tensor], None] | None = None) -> Tensor:
    """``sum_c gates[r, c] * expert_{ids[r, c]}(x[r])`` for every row ``r``.

    ``x`` [rows, hidden]; ``ids`` [rows, k] on the HOST (numpy): grouping rows by expert is
    host work, and taking ids already on the host keeps this free of device syncs (the
    offloaded runtime copies them once per layer anyway); ``gates`` [rows, k] on x's
    device; ``weights[e]``: expert e's flat buffer (a resident table, device slots, or
    trainable rows). ``each(e, rows, y)`` sees every expert's ungated output (calibration).
    Experts run in increasing id order, so every caller sums in the same order.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 1:  # decode at batch 1: every expert sees the single row, no gather
        for c, e in enumerate(ids[0].tolist()):
            y = expert_forward(weights[e].to(x.device), x, hidden, inter)
            if each is not None:
                each(e, torch.zeros(1, dtype=torch.long, device=x.device), y)
            out += gates[:, c, None].to(x.dtype) * y
        return out
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for r, row in enumerate(ids.tolist()):
        for c, e in enumerate(row):
            rows, cols = groups.setdefault(e, ([], []))
            rows.append(r)
            cols.append(c)
    for e in sorted(groups):
        rows, cols = groups[e]
        r = torch.tensor(rows, device=x.device)
        y = expert_forward(weights[e].to(x.device), x[r], hidden, inter)  # [n_e, hidden]
        if each is not None:
            each(e, r, y)
        out.index_add_(0, r, y * gates[r, torch.tensor(cols, device=x.device), None].to(y.dtype))
    return out


class ExpertHook(Protocol):
    """How a block's routed experts are executed. ``x`` [rows, hidden]: the router input
    (post-attention norm); ``logits`` [rows, experts]: the router's; ``resid`` [rows, hidden]:
    the residual stream after attention and the resident shared experts, which the routed
    output is added to (predictors read it). Returns the routed experts' mixed output
    [rows, hidden]. Implementations: :class:`ResidentExperts` (all weights in
    place; optional capture for calibration, distillation and training losses) and the
    offloaded runtime's per-step hook (routing, prediction, copies, stalls, timing)."""

    def __call__(self, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor: ...


class ResidentExperts:
    """Route and run experts whose weights are all in place: ``weights[layer][e]``
    (default: the model's table; training passes its parameters). ``on_route(layer, x,
    logits, resid, ids, gates)`` observes every layer's routing; ``each(layer, e, rows, y)``
    every expert's ungated output."""

    def __init__(self, model: MoEModel, weights=None, on_route: Callable | None = None,
                 each: ExpertVisitor | None = None) -> None:
        self.spec, self.weights = model.spec, weights if weights is not None else model.experts
        self.route = model.route
        self.on_route, self.each = on_route, each

    def __call__(self, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor:
        s = self.spec
        ids, gates = self.route(logits, layer)  # [rows, k] each
        if self.on_route is not None:
            self.on_route(layer, x, logits, resid, ids, gates)
        each = None if self.each is None else (lambda e, rows, y: self.each(layer, e, rows, y))
        return mix_experts(x, ids.cpu().numpy(), gates, self.weights[layer], s.hidden, s.expert_inter, each)


def quasi_hidden(model: MoEModel, layer: int, resid: Tensor, ids: Tensor, gates: Tensor, dv: Tensor,
                 nxt: int | None = None) -> Tensor:
    """The quasi-hidden state q_l: the next MoE layer's router input as it would be if layer
    l's experts returned their default vectors ``dv`` [L, E, hidden] (model layers): LN_n(r_l
    + d_l) with d_l the gate-weighted default vectors of the chosen ``ids`` [rows, k] and n
    = ``nxt`` (default l+1). Dense layers between l and n are skipped: their attention and
    MLP are not known yet when the prediction must be issued. [rows, hidden]."""
    d = (dv[layer][ids] * gates[..., None].to(dv.dtype)).sum(1)  # [rows, hidden]
    n = layer + 1 if nxt is None else nxt
    return model.layers[n].post_attention_layernorm(resid + d.to(resid.dtype))


class FeedForward(nn.Module):
    """SwiGLU MLP: a dense layer's FFN, or a layer's shared experts fused into one
    (``n_shared`` experts of ``inter`` = one MLP of ``n_shared * inter``)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: the ONE place where a layer's feed-forward part is assembled.

    A dense layer (``ModelSpec.dense_layers``: DeepSeek's leading layers, Qwen2-MoE's
    ``mlp_only_layers``) runs its MLP. An MoE layer runs its shared experts, if any
    (``n_shared``; Qwen2-MoE gates them with a sigmoid), which are resident, and its routed
    experts through ``experts`` (an :class:`ExpertHook`), which decides where they run."""

    def __init__(self, cfg: ExecConfig, layer: int) -> None:
        super().__init__()
        s = cfg.spec
        self.input_layernorm = RMSNorm(s.hidden, cfg.rms_eps)
        self.self_attn = MLAttention(cfg) if s.attention.kind == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(s.hidden, cfg.rms_eps)
        self.is_moe = layer not in s.dense_layers
        self.router_fp32 = cfg.router_fp32
        self.shared_expert = self.shared_expert_gate = None
        if not self.is_moe:
            self.mlp = FeedForward(s.hidden, s.dense_inter)
            return
        self.gate = nn.Linear(s.hidden, s.n_experts, bias=False)  # the router
        if cfg.router.method == "noaux_tc":  # GLM: added to the scores to choose experts, not to the gates
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(s.n_experts))
        if s.n_shared:
            self.shared_expert = FeedForward(s.hidden, s.n_shared * (s.shared_inter or s.expert_inter))
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(s.hidden, 1, bias=False)

    def forward(self, h: Tensor, layer: int, experts: ExpertHook, cache: KVCache | None, start: int,
                tree: TreeMask | None = None) -> Tensor:
        """``h`` [batch, seq, hidden] -> [batch, seq, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), cache, layer, start, tree)
        x = self.post_attention_layernorm(h)  # [batch, seq, hidden]
        if not self.is_moe:
            return h + self.mlp(x)
        x = x.flatten(0, 1)  # [batch*seq, hidden]
        resid = h.flatten(0, 1)  # [batch*seq, hidden]: what the routed experts add to
        if self.shared_expert is not None:  # resident; runs while the routed experts' copies fly
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            resid = resid + shared
        return (resid + experts(layer, x, self.router_logits(x), resid)).view_as(h)

    def router_logits(self, x: Tensor) -> Tensor:
        """``x`` [rows, hidden] -> [rows, experts]: the router (predictors call it too)."""
        if self.router_fp32:
            return F.linear(x.float(), self.gate.weight.float())
        return self.gate(x)


class MoEModel(nn.Module):
    """Embeddings, blocks and LM head. Experts are not parameters: they live in
    ``self.experts[layer][expert]`` (flat buffers) so an offload engine can place them."""

    def __init__(self, cfg: ExecConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, cfg.rms_eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.experts: list[list[Tensor]] = []  # [] for a dense layer

    @property
    def spec(self) -> ModelSpec:
        return self.cfg.spec

    def route(self, logits: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Model layer ``layer``'s router on its ``logits`` [rows, experts]: (ids, gates)
        [rows, k]. Every hook and predictor routes through here, so a family's rule lives
        in one place."""
        s = self.spec
        return route(logits, s.top_k, s.norm_topk_prob, self.cfg.router,
                     getattr(self.layers[layer].gate, "e_score_correction_bias", None))

    def blocks(self, h: Tensor, experts: ExpertHook, cache: KVCache | None = None, start: int = 0,
               tree: TreeMask | None = None, after: Callable[[int], None] | None = None) -> Tensor:
        """The layer pass: ``h`` [batch, seq, hidden] through every block, routed experts
        executed by ``experts``. ``cache`` None attends within the sequence only (training).
        ``after(layer)`` runs at the end of every block (the offloaded runtime times dense
        layers with it: they never call the expert hook)."""
        for layer, blk in enumerate(self.layers):
            h = blk(h, layer, experts, cache, start, tree)
            if after is not None:
                after(layer)
        return h

    def hidden_states(self, tokens: Tensor, experts: ExpertHook | None = None, cache: KVCache | None = None,
                      start: int = 0, tree: TreeMask | None = None) -> Tensor:
        """``tokens`` [batch, seq] -> final normed hidden [batch, seq, hidden]; experts all
        resident unless a hook says otherwise."""
        h = self.embed_tokens(tokens)  # [batch, seq, hidden]
        return self.norm(self.blocks(h, experts or ResidentExperts(self), cache, start, tree))

    @torch.no_grad()
    def forward(self, tokens: Tensor, cache: KVCache, start: int) -> Tensor:
        """Plain all-resident forward over ``tokens`` [batch, seq] -> logits [batch, seq, vocab]."""
        return self.lm_head(self.hidden_states(tokens, None, cache, start))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, p.device, p.dtype)


# --------------------------------------------------------------------------------------
# Construction: random (synthetic) weights, or a Hugging Face checkpoint directory
# --------------------------------------------------------------------------------------

# Per-expert on-disk names for each family: (gate, up, down).
_EXPERT_KEYS = {
    "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "qwen2_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "olmoe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
    "deepseek_v2": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "glm4_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}
_ROUTER_KEY = {"qwen3_moe": "mlp.gate", "qwen2_moe": "mlp.gate", "olmoe": "mlp.gate", "mixtral": "block_sparse_moe.gate",
               "deepseek_v2": "mlp.gate", "glm4_moe": "mlp.gate"}
_SHARED_KEY = {"deepseek_v2": "mlp.shared_experts", "glm4_moe": "mlp.shared_experts"}  # Qwen2-MoE: mlp.shared_expert


def _hub_key(name: str, family: str) -> str:
    """The checkpoint's name of our parameter ``name`` (dense MLPs are ``mlp.*`` in both)."""
    key = f"model.{name}" if not name.startswith("lm_head") else name
    key = key.replace(".shared_expert.", f".{_SHARED_KEY.get(family, 'mlp.shared_expert')}.")
    key = key.replace(".shared_expert_gate.", ".mlp.shared_expert_gate.")
    key = key.replace(".gate.e_score_correction_bias", f".{_ROUTER_KEY[family]}.e_score_correction_bias")
    return key.replace(".gate.weight", f".{_ROUTER_KEY[family]}.weight")


def random_model(cfg: ExecConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 expert_device: str | torch.device = "cpu", pin: bool = False) -> MoEModel:
    """Seeded random weights (std 0.02): a **synthetic** model of any catalogue geometry."""
    cfg = cfg.with_dtype(dtype)
    torch.manual_seed(seed)
    model = MoEModel(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    model.to(dtype)
    if cfg.router_fp32:
        for blk in model.layers:
            if blk.is_moe:
                blk.gate.float()
    s = cfg.spec
    g = torch.Generator().manual_seed(seed + 1)
    n = s.expert_weights
    model.experts = [[_store((torch.randn(n, generator=g) * 0.02).to(dtype), expert_device, pin)
                      for _ in range(s.n_experts)] if layer in s.moe_layers else [] for layer in range(s.n_layers)]
    return model


def _store(t: Tensor, device: str | torch.device, pin: bool) -> Tensor:
    t = t.contiguous()
    if str(device) != "cpu":
        return t.to(device)
    return t.pin_memory() if pin else t


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    expert_device: str | torch.device = "cpu", pin: bool = False) -> MoEModel:
    """Load ``config.json`` plus (sharded) ``*.safetensors`` in the hub's per-expert layout."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = ExecConfig.from_hf(model_dir).with_dtype(dtype)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise MoesimError(f"{model_dir}: no *.safetensors files")
    tensors: dict[str, Tensor] = {}
    try:
        for f in files:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[k] = st.get_tensor(k)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise MoesimError(f"{model_dir}: cannot read checkpoint ({e})") from None
    s, fam = cfg.spec, cfg.spec.family
    model = MoEModel(cfg)
    state = {}
    for name in model.state_dict():
        key = _hub_key(name, fam)
        if key not in tensors:
            if name == "lm_head.weight" and s.tie_embeddings:
                continue
            raise MoesimError(f"{model_dir}: checkpoint lacks {key}")
        state[name] = tensors[key]
    model.load_state_dict(state, strict=not s.tie_embeddings)
    model.to(dtype)
    if cfg.router_fp32:  # the router's weight (and bias) as stored, not rounded to ``dtype``
        for name, t in state.items():
            module, _, attr = name.rpartition(".")
            if module.endswith(".gate"):
                getattr(model.get_submodule(module), attr).data = t.float()
    experts = []
    for layer in range(s.n_layers):
        row = []
        for e in range(s.n_experts if layer in s.moe_layers else 0):
            parts = []
            for pat in _EXPERT_KEYS[fam]:
                key = f"model.layers.{layer}.{pat.format(e=e)}.weight"
                if key not in tensors:
                    raise MoesimError(f"{model_dir}: checkpoint lacks {key}")
                parts.append(tensors[key].reshape(-1))
            row.append(_store(torch.cat(parts).to(dtype), expert_device, pin))
        experts.append(row)
    model.experts = experts
    return model


def save_checkpoint(model: MoEModel, model_dir: str | Path, extra_config: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a Hugging Face style checkpoint (qwen3_moe layout) that :func:`load_checkpoint` reads."""
    from safetensors.torch import save

    from moesim.atomic import atomic_write, atomic_write_text

    s, cfg = model.spec, model.cfg
    if cfg.qk_norm != "head":
        raise MoesimError(f"save_checkpoint writes the qwen3_moe layout, which needs per-head q/k norms; {s.name} has none")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        tensors[_hub_key(name, "qwen3_moe")] = t.to(dtype).contiguous()
    n = s.expert_inter * s.hidden
    for layer, row in enumerate(model.experts):
        for e, w in enumerate(row):
            w = w.to("cpu", dtype)
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            tensors[f"{pre}.gate_proj.weight"] = w[:n].view(s.expert_inter, s.hidden).clone()
            tensors[f"{pre}.up_proj.weight"] = w[n:2 * n].view(s.expert_inter, s.hidden).clone()
            tensors[f"{pre}.down_proj.weight"] = w[2 * n:].view(s.hidden, s.expert_inter).clone()
    a = s.attention
    config = {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": s.n_layers,
        "num_experts": s.n_experts, "num_experts_per_tok": s.top_k, "hidden_size": s.hidden,
        "moe_intermediate_size": s.expert_inter, "intermediate_size": s.expert_inter * s.top_k,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "vocab_size": s.vocab, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len, "norm_topk_prob": s.norm_topk_prob,
        "tie_word_embeddings": s.tie_embeddings, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "attention_bias": False, "hidden_act": "silu", "torch_dtype": str(dtype).removeprefix("torch."),
        **(extra_config or {}),
    }
    data = save(tensors)
    atomic_write(model_dir / "model.safetensors", lambda f: f.write(data))
    atomic_write_text(model_dir / "config.json", json.dumps(config, indent=2) + "\n")


def read_tensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]] | None:
    """(tensors, metadata) of a small safetensors file stored beside a model, or None if absent."""
    if not Path(path).exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise MoesimError(f"cannot read {path} ({e})") from None


def count_params(model: MoEModel) -> int:
    return sum(p.numel() for p in model.parameters()) + sum(w.numel() for row in model.experts for w in row)


def log_softmax_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(p || q) between two logit tensors, per row (for output-fidelity metrics)."""
    p = p_logits.float().log_softmax(-1)
    q = q_logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


__all__ = ["ExecConfig", "RouterRule", "MoEModel", "KVCache", "MLAttention", "ExpertHook", "ResidentExperts", "expert_forward", "mix_experts",
           "quasi_hidden", "route", "random_model", "load_checkpoint",
           "save_checkpoint", "count_params", "log_softmax_kl"]
