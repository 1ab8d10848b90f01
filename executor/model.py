"""A readable MoE decoder in one file, gpt-fast style: one module per part, one forward each.

Families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, GLM-4.7-Flash,
gpt-oss) differ only in :class:`~moesim.executor.families.ExecConfig` fields, which their
adapters in :mod:`moesim.executor.families` fill from a checkpoint's config (each adapter
names the transformers class its numerics follow). The pass:

    embed -> Block x L -> RMSNorm -> lm_head
    Block: h + Attention(RMSNorm(h))  (GQA with RoPE, q/k norms, sinks, sliding windows;
           or MLA run uncompressed), then h + MLP(RMSNorm(h)) in a dense layer, or the MoE
           block: h + shared experts + routed experts (a hook decides where they run).

:meth:`MoEModel.forward` is THE pass; callers (all-resident decoding, the offloaded
runtime, speculative decoding's draft and verification, training, calibration) supply a
small :class:`Hooks` object: the expert hook, an after-layer callback, a tree mask and
which logits to return. Routed experts mix through ONE function, :func:`mix_experts`
(dense, quantised, a subset of a layer, or outputs computed elsewhere: only the
per-expert forward differs).

Each expert's weights are one flat, contiguous tensor ``[gate; up; down(; biases)]`` so
that moving an expert is one copy (:func:`expert_forward`), or a packed quantised expert
(:class:`~moesim.executor.quant_experts.QuantExpert`, e.g. a gpt-oss MXFP4 checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor, nn

from moesim.atomic import atomic_write, atomic_write_text
from moesim.errors import MoesimError
from moesim.executor.families import (
    FAMILIES,
    TOPK_METHODS,
    TORCH_DTYPES,
    ExecConfig,
    RouterRule,
    SwiGLU,
    Yarn,
    yarn_mscale,
)
from moesim.executor.quant_experts import QuantExpert, quantize_experts
from moesim.models import ModelSpec

__all__ = ["FAMILIES", "TORCH_DTYPES", "TOPK_METHODS", "ExecConfig", "RouterRule", "SwiGLU", "Yarn", "Hooks",
           "MoEModel", "KVCache", "MLAttention", "TreeMask", "ExpertHook", "ResidentExperts", "expert_forward",
           "mix_experts", "quasi_hidden", "route", "random_model", "load_checkpoint", "save_checkpoint",
           "count_params", "log_softmax_kl"]


# --------------------------------------------------------------------------------------
# Norms and rotary embeddings
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in fp32. ``fp32_weight`` (gpt-oss's
    ``GptOssRMSNorm``): the weight multiplies before the cast back, not after."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.eps, self.fp32_weight = eps, fp32_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight.float() * x).to(dtype)
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
    one complex number rotated by ``position * theta^(-2i/dim)`` (computed in fp32).
    transformers' ``apply_rotary_pos_emb_interleave`` writes the same rotation with the
    pairs de-interleaved; applied to both queries and keys, the attention is the same."""
    d = x.shape[-1]
    inv, att = rope_frequencies(d, theta, yarn, x.device)
    freqs = positions.float()[:, None] * inv[None, :]  # [seq, dim/2]
    cos, sin = freqs.cos() * att, freqs.sin() * att
    xf = x.float().unflatten(-1, (d // 2, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


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


def positions_of(t: int, start: int, tree: TreeMask | None, device: torch.device) -> Tensor:
    """RoPE positions of ``t`` new tokens after ``start`` cached ones [t]."""
    return tree.positions if tree is not None else torch.arange(start, start + t, device=device)


def attention_mask(t: int, start: int, tree: TreeMask | None, device: torch.device, window: int = 0) -> Tensor:
    """[t, start + t] booleans: a tree's own mask, else causal within the new tokens with
    every cached token visible; with ``window`` (a sliding layer) a query sees only keys
    fewer than ``window`` positions behind it (transformers' ``sliding_window_overlay``)."""
    mask = tree.mask if tree is not None else torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start)
    if window:
        q = positions_of(t, start, tree, device)
        k = torch.cat([torch.arange(start, device=device), q])
        mask = mask & (q[:, None] - k[None, :] < window)
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None,
           sinks: Tensor | None = None) -> Tensor:
    """[b, heads, t, d] queries against [b, heads, T, d] keys and values under ``mask`` [t, T].
    ``sinks`` [heads] (gpt-oss, ``eager_attention_forward``): one extra logit per head in
    the softmax that takes probability and returns nothing."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [b, h, t, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    both = torch.cat([scores, sink], dim=-1)
    both = both - both.amax(-1, keepdim=True)
    return both.softmax(-1)[..., :-1].to(v.dtype) @ v


class Attention(nn.Module):
    """Grouped-query attention with RoPE (on the first ``partial_rotary`` of each head),
    optional q/k norms (per head or over all heads), biases, sinks and a sliding window."""

    def __init__(self, cfg: ExecConfig, layer: int) -> None:
        super().__init__()
        a, h = cfg.spec.attention, cfg.spec.hidden
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(h, a.n_heads * a.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, a.n_kv_heads * a.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, a.n_kv_heads * a.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, h, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, cfg.rms_eps), RMSNorm(a.head_dim, cfg.rms_eps)
        elif self.qk_norm == "full":
            self.q_norm = RMSNorm(a.n_heads * a.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(a.n_kv_heads * a.head_dim, cfg.rms_eps)
        self.sinks = nn.Parameter(torch.zeros(a.n_heads)) if cfg.sinks else None
        self.theta, self.yarn, self.window = cfg.rope_theta, cfg.yarn, cfg.window(layer)
        self.rotary_dim = int(a.head_dim * cfg.partial_rotary)  # RoPE on the first dims; the rest pass

    def forward(self, x: Tensor, cache: KVCache | None, start: int, tree: TreeMask | None = None) -> Tensor:
        """``x`` [b, t, hidden] -> [b, t, hidden]. ``cache`` None: attend within ``x`` only
        (training). ``tree``: the new tokens are a candidate tree (speculative decoding),
        each at its own position and seeing only the cached prefix and its ancestors."""
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [b, t, heads * head_dim]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, t, head_dim]
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        rd = self.rotary_dim
        cos, sin = rope_tables(rd, positions_of(t, start, tree, x.device), self.theta, self.yarn)
        if rd == self.head_dim:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            q = torch.cat([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
            k = torch.cat([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
        if cache is not None:
            k, v = cache.update(self.layer, start, k, v)  # [b, kv_heads, start + t, head_dim]
        groups = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = attend(q, k, v, attention_mask(t, start, tree, x.device, self.window), sinks=self.sinks)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention (``DeepseekV2Attention``, ``DeepseekV3Attention``,
    ``Glm4MoeLiteAttention``), run UNCOMPRESSED.

    Queries come from ``q_proj`` (or, with ``q_lora_rank``, the low-rank ``q_a`` -> norm
    -> ``q_b``). Keys and values come from a compressed latent: ``kv_a_proj_with_mqa`` gives
    the latent (``kv_lora_rank``) and one shared RoPE key (``qk_rope_head_dim``); the
    normed latent is expanded by ``kv_b_proj`` to every head's non-RoPE key and value.
    This straightforward implementation caches the EXPANDED per-head keys and values
    (heads x (nope + rope + v) per token), not the latent (rank + rope) that MLA was
    designed to cache, nor does it absorb ``kv_b_proj`` into the query and output: the
    logits are the same, the KV cache is larger and the attention does more work than an
    optimised MLA kernel. RoPE rotates adjacent pairs (``rope_pairs``: V2, and V3 / GLM
    with ``rope_interleave``) or halves."""

    def __init__(self, cfg: ExecConfig, layer: int) -> None:
        super().__init__()
        a, h = cfg.spec.attention, cfg.spec.hidden
        self.layer = layer
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
        self.scale, self.theta, self.yarn, self.pairs = qk ** -0.5, cfg.rope_theta, cfg.yarn, cfg.rope_pairs
        if cfg.yarn is not None and cfg.yarn.mscale_all_dim:  # transformers' yarn_apply_mscale
            self.scale *= yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        if self.pairs:
            return apply_rope_pairs(x, positions, self.theta, self.yarn)
        return apply_rope(x, *rope_tables(self.rope, positions, self.theta, self.yarn))

    def forward(self, x: Tensor, cache: KVCache | None, start: int, tree: TreeMask | None = None) -> Tensor:
        """As :meth:`Attention.forward`."""
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.n_heads, self.nope + self.rope).transpose(1, 2)  # [b, heads, t, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)  # [b, t, rank], [b, t, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # [b, t, heads * (nope + v)]
        k_nope, v = kv.view(b, t, self.n_heads, self.nope + self.v_dim).transpose(1, 2).split([self.nope, self.v_dim], -1)
        positions = positions_of(t, start, tree, x.device)
        q_pe = self._rope(q_pe, positions)
        k_pe = self._rope(k_pe.view(b, 1, t, self.rope), positions)  # one key shared by all heads
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, self.n_heads, t, self.rope)], dim=-1)  # [b, heads, t, nope + rope]
        if cache is not None:
            k, v = cache.update(self.layer, start, k, v)
        y = attend(q, k, v, attention_mask(t, start, tree, x.device), scale=self.scale)  # [b, heads, t, v]
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


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


# --------------------------------------------------------------------------------------
# Feed-forward: dense MLP, router, MoE block
# --------------------------------------------------------------------------------------


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


def route(logits: Tensor, top_k: int, renorm: bool, rule: RouterRule | None = None,
          bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A router's choice on its ``logits`` [rows, experts]: (ids, gates) [rows, k], largest
    gate first; gates renormalised if asked. ``rule`` (:class:`RouterRule`): DeepSeek-V2's
    group limit, the ``noaux_tc`` sigmoid router with its selection ``bias`` [experts], or
    gpt-oss's softmax over the top-k logits; then the gate scale."""
    if rule is not None and rule.method == "noaux_tc":
        return _route_noaux_tc(logits, top_k, renorm, rule, bias)
    if rule is not None and rule.method == "topk_softmax":  # GptOssTopKRouter: top-k of logits, softmax over them
        values, ids = logits.topk(top_k, dim=-1)
        return ids, values.softmax(-1, dtype=values.dtype) * rule.scale
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


class Router(nn.Linear):
    """An MoE layer's router: ``forward`` gives the logits, :meth:`select` the family's
    choice on them (:func:`route`). DeepSeek and GLM keep the weight (and the selection
    bias, a buffer) in fp32 and compute the logits in fp32 (transformers'
    ``_keep_in_fp32_modules_strict``); gpt-oss's router has a bias."""

    def __init__(self, cfg: ExecConfig) -> None:
        s = cfg.spec
        super().__init__(s.hidden, s.n_experts, bias=cfg.router_bias)
        self.fp32, self.rule, self.top_k, self.renorm = cfg.router_fp32, cfg.router, s.top_k, s.norm_topk_prob
        if cfg.router.method == "noaux_tc":  # added to the scores to choose experts, not to the gates
            self.register_buffer("e_score_correction_bias", torch.zeros(s.n_experts))

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [rows, hidden] -> logits [rows, experts] (predictors call it on other inputs)."""
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return route(logits, self.top_k, self.renorm, self.rule, getattr(self, "e_score_correction_bias", None))


class MoE(nn.Module):
    """The MoE block (``*SparseMoeBlock`` / ``*MoE`` / ``GptOssMLP``): the router, the shared
    experts if any (``n_shared`` fused into one MLP; Qwen2-MoE scales them by a per-token
    sigmoid gate), which are resident, and the routed experts through the expert hook."""

    def __init__(self, cfg: ExecConfig, layer: int) -> None:
        super().__init__()
        s = cfg.spec
        self.layer = layer
        self.gate = Router(cfg)
        self.shared_experts = self.shared_expert_gate = None
        if s.n_shared:
            self.shared_experts = FeedForward(s.hidden, s.n_shared * (s.shared_inter or s.expert_inter))
            if cfg.shared_gate:
                self.shared_expert_gate = nn.Linear(s.hidden, 1, bias=False)

    def forward(self, x: Tensor, h: Tensor, experts: ExpertHook) -> Tensor:
        """Router input ``x`` and residual ``h`` [b, t, hidden] -> the new residual [b, t, hidden]."""
        x = x.flatten(0, 1)  # [rows, hidden]
        resid = h.flatten(0, 1)  # [rows, hidden]: what the routed experts add to
        if self.shared_experts is not None:  # resident; runs while the routed experts' copies fly
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            resid = resid + shared
        return (resid + experts(self.layer, x, self.gate(x), resid)).view_as(h)


class Block(nn.Module):
    """Pre-norm decoder block: attention, then the dense MLP (``ModelSpec.dense_layers``:
    DeepSeek's leading layers, Qwen2-MoE's ``mlp_only_layers``) or the MoE block."""

    def __init__(self, cfg: ExecConfig, layer: int) -> None:
        super().__init__()
        s = cfg.spec
        self.input_layernorm = RMSNorm(s.hidden, cfg.rms_eps, cfg.norm_fp32)
        self.self_attn = MLAttention(cfg, layer) if s.attention.kind == "mla" else Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(s.hidden, cfg.rms_eps, cfg.norm_fp32)
        self.is_moe = layer not in s.dense_layers
        self.mlp = MoE(cfg, layer) if self.is_moe else FeedForward(s.hidden, s.dense_inter)

    def forward(self, h: Tensor, cache: KVCache | None, start: int, hooks: Hooks) -> Tensor:
        """``h`` [b, t, hidden] -> [b, t, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), cache, start, hooks.tree)
        x = self.post_attention_layernorm(h)  # [b, t, hidden]
        if not self.is_moe:
            return h + self.mlp(x)
        return self.mlp(x, h, hooks.experts)


# --------------------------------------------------------------------------------------
# Routed experts: one per-expert forward per format, one mixing function
# --------------------------------------------------------------------------------------

ExpertFn = Callable[[object, Tensor], Tensor]  # (one expert's weights, rows [n, hidden]) -> [n, hidden]
ExpertVisitor = Callable[[int, int, Tensor, Tensor], None]  # (layer, expert, rows, ungated output)


def expert_forward(w: Tensor, x: Tensor, hidden: int, inter: int, act: SwiGLU | None = None,
                   bias: bool = False) -> Tensor:
    """A gated expert from one flat buffer ``[gate (inter x hidden); up; down (hidden x inter)]``,
    with gpt-oss's biases ``[gate (inter); up (inter); down (hidden)]`` after them if ``bias``."""
    n = inter * hidden
    gate_up = w[: 2 * n].view(2 * inter, hidden)
    down = w[2 * n:3 * n].view(hidden, inter)
    gu = x @ gate_up.T  # [rows, 2 * inter]
    if bias:
        gu = gu + w[3 * n:3 * n + 2 * inter]
    g, u = gu.split(inter, dim=-1)
    y = (F.silu(g) * u if act is None or act.limit is None else act(g, u)) @ down.T  # [rows, hidden]
    return y + w[3 * n + 2 * inter:] if bias else y


def mix_experts(x: Tensor, ids: np.ndarray, gates: Tensor, weights: Mapping | list, expert_fn: ExpertFn,
                only: set[int] | None = None, each: Callable[[int, Tensor, Tensor], None] | None = None,
                out: Tensor | None = None) -> Tensor:
    """``sum_c gates[r, c] * expert_{ids[r, c]}(x[r])`` for every row ``r``: THE expert mix.

    ``x`` [rows, hidden]; ``ids`` [rows, k] on the HOST (numpy): grouping rows by expert is
    host work, and taking ids already on the host keeps this free of device syncs (the
    offloaded runtime copies them once per layer anyway); ``gates`` [rows, k] on x's
    device; ``weights[e]``: expert e as ``expert_fn`` reads it (a flat buffer of a resident
    table, a device slot or trainable rows; a quantised expert; or an output computed
    elsewhere, e.g. by the host pool). ``only``: mix just these experts (a layer split
    between the device and the CPU). ``each(e, rows, y)`` sees every expert's ungated
    output (calibration); ``out`` [rows, hidden] accumulates in place (default zeros).
    At batch 1 the experts run in the row's routed order; otherwise in increasing id order,
    so every caller sums in the same order.
    """
    out = torch.zeros_like(x) if out is None else out
    if x.shape[0] == 1:  # decode at batch 1: every expert sees the single row, no gather
        for c, e in enumerate(ids[0].tolist()):
            if e < 0 or only is not None and e not in only:
                continue
            y = expert_fn(weights[e], x)
            if each is not None:
                each(e, torch.zeros(1, dtype=torch.long, device=x.device), y)
            out += gates[:, c, None].to(out.dtype) * y
        return out
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for r, row in enumerate(ids.tolist()):
        for c, e in enumerate(row):
            if e >= 0 and (only is None or e in only):
                rows, cols = groups.setdefault(e, ([], []))
                rows.append(r)
                cols.append(c)
    for e in sorted(groups):
        rows, cols = groups[e]
        r = torch.tensor(rows, device=x.device)
        y = expert_fn(weights[e], x[r])  # [n_e, hidden]
        if each is not None:
            each(e, r, y)
        out.index_add_(0, r, y * gates[r, torch.tensor(cols, device=x.device), None].to(y.dtype))
    return out


def expert_fn_for(cfg: ExecConfig, packed: bool) -> ExpertFn:
    """The per-expert forward of a model's routed experts: flat buffers (moved to the rows'
    device if they are elsewhere) or packed quantised experts (dequantise, then multiply)."""
    s, act = cfg.spec, cfg.act
    if packed:
        return lambda q, x: q.forward(x, act).to(x.dtype)
    return lambda w, x: expert_forward(w.to(x.device), x, s.hidden, s.expert_inter, act, s.expert_bias)


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
        self.weights = weights if weights is not None else model.experts
        self.route, self.expert_fn = model.route, model.expert_fn
        self.on_route, self.each = on_route, each

    def __call__(self, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor:
        ids, gates = self.route(logits, layer)  # [rows, k] each
        if self.on_route is not None:
            self.on_route(layer, x, logits, resid, ids, gates)
        each = None if self.each is None else (lambda e, rows, y: self.each(layer, e, rows, y))
        return mix_experts(x, ids.cpu().numpy(), gates, self.weights[layer], self.expert_fn, each=each)


def quasi_hidden(model: MoEModel, layer: int, resid: Tensor, ids: Tensor, gates: Tensor, dv: Tensor,
                 nxt: int | None = None, through: tuple[int, ...] = ()) -> Tensor:
    """The quasi-hidden state: MoE layer ``nxt``'s router input as it would be if layer
    ``layer``'s experts returned their default vectors ``dv`` [L, E, hidden] (model layers):
    ``LN_n(r_l + d_l)``, ``d_l`` the gate-weighted default vectors of the chosen ``ids``
    [rows, k], ``n`` = ``nxt`` (default l+1). Dense layers in between are skipped: their
    attention and MLP are not known yet when the prediction must be issued. ``through``
    (lookahead > 1): the MoE layers between ``layer`` and ``nxt``, each of which routes the
    carried state with its own norm and router and adds its own default vectors, as layer
    ``layer``'s did. [rows, hidden]."""
    r = resid + (dv[layer][ids] * gates[..., None].to(dv.dtype)).sum(1).to(resid.dtype)  # [rows, hidden]
    for j in through:
        blk = model.layers[j]
        ids_j, gates_j = model.route(blk.mlp.gate(blk.post_attention_layernorm(r)), j)
        r = r + (dv[j][ids_j] * gates_j[..., None].to(dv.dtype)).sum(1).to(resid.dtype)
    n = layer + 1 if nxt is None else nxt
    return model.layers[n].post_attention_layernorm(r)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


@dataclass
class Hooks:
    """What a caller of :meth:`MoEModel.forward` supplies. ``experts``: how routed experts run
    (None: all resident, :class:`ResidentExperts`); ``after_layer(layer)``: called after the
    embedding (``layer`` -1) and after every block (the offloaded runtime times dense
    layers with it: they never call the expert hook); ``tree``: a candidate tree's mask
    (speculative decoding); ``logits``: ``"all"`` positions [b, t, vocab], ``"last"``
    [b, vocab], or ``"none"``: the final normed hidden state [b, t, hidden] (no LM head)."""

    experts: ExpertHook | None = None
    after_layer: Callable[[int], None] | None = None
    tree: TreeMask | None = None
    logits: str = "all"


class MoEModel(nn.Module):
    """Embeddings, blocks and LM head. Experts are not parameters: they live in
    ``self.experts[layer][expert]`` (flat buffers, or packed quantised experts) so an
    offload engine can place them."""

    def __init__(self, cfg: ExecConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, cfg.rms_eps, cfg.norm_fp32)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.experts: list[list] = []  # [] for a dense layer
        self.expert_fn = expert_fn_for(cfg, packed=s.expert_dtype not in TORCH_DTYPES)

    @property
    def spec(self) -> ModelSpec:
        return self.cfg.spec

    @property
    def packed_experts(self) -> str | None:
        """The format of experts the model holds packed (a checkpoint's MXFP4), else None."""
        return None if self.spec.expert_dtype in TORCH_DTYPES else self.spec.expert_dtype

    def route(self, logits: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Model layer ``layer``'s router choice on its ``logits`` [rows, experts]: (ids, gates)
        [rows, k]. Every hook and predictor routes through here."""
        return self.layers[layer].mlp.gate.select(logits)

    def forward(self, tokens: Tensor, cache: KVCache | None = None, start: int = 0,
                hooks: Hooks | None = None) -> Tensor:
        """THE pass: ``tokens`` [b, t] at position ``start`` (after ``start`` cached tokens;
        ``cache`` None attends within ``tokens`` only, as training does) -> logits, or the
        final hidden state, as ``hooks.logits`` asks. Gradients flow unless the caller
        turns them off (inference callers run under ``torch.no_grad``)."""
        hooks = hooks or Hooks()
        if hooks.experts is None:
            hooks = Hooks(ResidentExperts(self), hooks.after_layer, hooks.tree, hooks.logits)
        h = self.embed_tokens(tokens)  # [b, t, hidden]
        if hooks.after_layer is not None:
            hooks.after_layer(-1)
        for layer, blk in enumerate(self.layers):
            h = blk(h, cache, start, hooks)  # [b, t, hidden]
            if hooks.after_layer is not None:
                hooks.after_layer(layer)
        if hooks.logits == "last":
            return self.lm_head(self.norm(h[:, -1]))  # [b, vocab]
        h = self.norm(h)  # [b, t, hidden]
        return h if hooks.logits == "none" else self.lm_head(h)  # [b, t, vocab]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, p.device, p.dtype)


# --------------------------------------------------------------------------------------
# Construction: random (synthetic) weights, or a Hugging Face checkpoint directory
# --------------------------------------------------------------------------------------


def _keep_fp32(model: MoEModel, state: dict[str, Tensor] | None = None) -> None:
    """The modules a family keeps in fp32 whatever the model's dtype (routers of DeepSeek and
    GLM, gpt-oss's norms), from the stored values when loading (not rounded to ``dtype``)."""
    cfg = model.cfg
    for name, module in model.named_modules():
        if (cfg.router_fp32 and isinstance(module, Router)) or (cfg.norm_fp32 and isinstance(module, RMSNorm)):
            module.float()
            for attr, t in module.named_parameters(recurse=False):
                if state is not None and f"{name}.{attr}" in state:
                    t.data = state[f"{name}.{attr}"].float()
            for attr, _ in module.named_buffers(recurse=False):
                if state is not None and f"{name}.{attr}" in state:
                    setattr(module, attr, state[f"{name}.{attr}"].float())


def random_model(cfg: ExecConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 expert_device: str | torch.device = "cpu", pin: bool = False) -> MoEModel:
    """Seeded random weights (std 0.02): a **synthetic** model of any catalogue geometry. A
    geometry whose experts are published packed (gpt-oss's MXFP4) gets packed experts,
    quantised from the random weights."""
    cfg = cfg.with_dtype(dtype)
    torch.manual_seed(seed)
    model = MoEModel(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    model.to(dtype)
    _keep_fp32(model)
    s = cfg.spec
    g = torch.Generator().manual_seed(seed + 1)
    n = cfg.expert_width
    dense = [[(torch.randn(n, generator=g) * 0.02).to(dtype) for _ in range(s.n_experts)]
             if layer in s.moe_layers else [] for layer in range(s.n_layers)]
    if model.packed_experts:
        model.experts = quantize_experts(dense, s.hidden, s.expert_inter, model.packed_experts, s.expert_bias)
    else:
        model.experts = [[_store(w, expert_device, pin) for w in row] for row in dense]
    return model


def _store(t: Tensor, device: str | torch.device, pin: bool) -> Tensor:
    t = t.contiguous()
    if str(device) != "cpu":
        return t.to(device)
    return t.pin_memory() if pin else t


def load_checkpoint(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    expert_device: str | torch.device = "cpu", pin: bool = False) -> MoEModel:
    """Load ``config.json`` plus (sharded) ``*.safetensors``: names and expert layouts are
    the family adapter's (:mod:`moesim.executor.families`)."""
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
    s, fam = cfg.spec, cfg.family
    model = MoEModel(cfg)
    state = {}
    for name in model.state_dict():
        key = fam.hub_key(name)
        if key not in tensors:
            if name == "lm_head.weight" and s.tie_embeddings:
                continue
            raise MoesimError(f"{model_dir}: checkpoint lacks {key}")
        state[name] = tensors[key]
    model.load_state_dict(state, strict=not s.tie_embeddings)
    model.to(dtype)
    _keep_fp32(model, state)
    try:
        rows = [fam.experts(fam, tensors, layer, cfg) if layer in s.moe_layers else [] for layer in range(s.n_layers)]
    except MoesimError as e:
        raise MoesimError(f"{model_dir}: {e}") from None
    model.experts = [[w if isinstance(w, QuantExpert) else _store(w.to(dtype), expert_device, pin) for w in row]
                     for row in rows]
    return model


def save_checkpoint(model: MoEModel, model_dir: str | Path, extra_config: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a Hugging Face style checkpoint (qwen3_moe layout) that :func:`load_checkpoint` reads."""
    s, cfg = model.spec, model.cfg
    if cfg.qk_norm != "head" or s.family != "qwen3_moe" or model.packed_experts:
        raise MoesimError(f"save_checkpoint writes the qwen3_moe layout (dense experts, per-head q/k norms); "
                          f"{s.name} is not one")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    fam = FAMILIES["qwen3_moe"]
    tensors = {fam.hub_key(name): t.to(dtype).contiguous() for name, t in model.state_dict().items()}
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
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise MoesimError(f"cannot read {path} ({e})") from None


def count_params(model: MoEModel) -> int:
    def size(w) -> int:
        return w.numel() if isinstance(w, Tensor) else sum(t.numel() for t in w._parts())

    return sum(p.numel() for p in model.parameters()) + sum(size(w) for row in model.experts for w in row)


def log_softmax_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(p || q) between two logit tensors, per row (for output-fidelity metrics)."""
    p = p_logits.float().log_softmax(-1)
    q = q_logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)
