"""What drafting a candidate tree costs, from a draft profile instead of a recorded time.

A tree of ``depth`` levels takes ``depth`` sequential draft forwards (level j reads the
whole frontier in one pass), plus one more when the expert predictor needs the hidden
state of the deepest nodes (an EAGLE head's extra forward reads its layer only: nothing
is proposed from it, so not the LM head). At decode batch sizes every forward is bound by reading the
draft's weights, so each is charged like the target's blocks (:mod:`moesim.sim.costs`):
the larger of bytes / bandwidth and FLOPs / FLOP rate, plus kernel launches.

Kinds:

- ``none``: no draft cost (the "draft proposes for free" limit);
- ``eagle``: an EAGLE-style head (Li et al., "EAGLE: Speculative Sampling Requires
  Rethinking Feature Uncertainty", ICML 2024, arXiv:2401.15077): one decoder layer on the
  target's features, sized ``layer_fraction`` x one target layer (attention + the top-k
  experts it activates), reusing the target's LM head (vocab x hidden, read every forward);
- ``dense``: a small dense draft model of ``params_b`` billion parameters in ``dtype``
  (roofline of its weights; its own LM head included in the count);
- ``recorded``: the trace's measured ``sd_draft_s`` (only for recorded traces).

The expert predictor (EcoSpec only) is the executor's design: one linear probe from the
draft's hidden state to every MoE layer's router logits, ``hidden x moe_layers x experts``
bf16 weights read once per level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moesim.costmodel import CostModel
from moesim.errors import MoesimError
from moesim.models import ModelSpec, matrix_bytes

DRAFT_KINDS = ("none", "eagle", "dense", "recorded")


#: The largest draft the options take: a dense draft of 100,000 billion parameters (1e308 made
#: every time NaN), an eagle head of 1,000 target layers.
MAX_DRAFT_B = 1e5
MAX_HEAD_LAYERS = 1000


@dataclass(frozen=True)
class DraftProfile:
    kind: str = "eagle"
    layer_fraction: float = 1.0  # eagle: head size as a fraction of one target layer
    params_b: float = 0.0  # dense: parameters, billions
    dtype: str = "bf16"  # dense: weight format
    predictor: bool = True  # charge the expert predictor when the selection uses it (ecospec)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise MoesimError(f"unknown draft kind {self.kind!r}; known: {', '.join(DRAFT_KINDS)}")
        if not (0 <= self.layer_fraction < math.inf and 0 <= self.params_b < math.inf):  # NaN fails too
            raise MoesimError(f"draft layer_fraction and params_b must be finite and >= 0, got {self.layer_fraction:g} "
                              f"and {self.params_b:g}")
        if self.kind == "dense" and not 0 < self.params_b <= MAX_DRAFT_B:
            raise MoesimError(f"a dense draft needs params_b above 0 and at most {MAX_DRAFT_B:g} (billions of "
                              f"parameters), got {self.params_b:g}")
        if self.kind == "eagle" and not 0 < self.layer_fraction <= MAX_HEAD_LAYERS:  # eagle:0 was timed as a head
            raise MoesimError(f"an eagle head needs a size above 0 and at most {MAX_HEAD_LAYERS} target layers "
                              f"(eagle:F), got {self.layer_fraction:g}")

    @property
    def label(self) -> str:
        if self.kind == "eagle":
            return f"eagle head ({self.layer_fraction:g} target layer)"
        if self.kind == "dense":
            return f"dense draft {self.params_b:g}B {self.dtype}"
        return self.kind

    def forward_bytes(self, spec: ModelSpec) -> float:
        """Weight bytes one draft forward reads."""
        if self.kind == "eagle":
            layer = spec.layer_resident_bytes(spec.moe_layers[0]) + spec.top_k * spec.expert_bytes
            return self.layer_fraction * layer + spec.lm_head_bytes  # + the target's LM head
        if self.kind == "dense":
            return self.params_b * 1e9 * matrix_bytes(1024, 1024, self.dtype) / 2**20
        return 0.0

    def predictor_bytes(self, spec: ModelSpec) -> float:
        return 2.0 * spec.hidden * spec.n_moe_layers * spec.n_experts

    def tree_seconds(self, cm: CostModel, branch: int, depth: int, uses_predictor: bool, expand: int = 0) -> float:
        """Seconds to draft a full ``branch``-ary tree of ``depth`` levels (and predict its
        experts when ``uses_predictor``) on ``cm``'s deployment (weights split over its shards).
        ``expand`` > 0: a dynamic tree (EAGLE-2) whose forwards read only the ``expand``
        nodes a level grows, or, for the expert predictor, every node of the level."""
        if self.kind in ("none", "recorded") or depth == 0:
            return 0.0
        spec, e = cm.spec, cm.engine
        dtype = self.dtype if self.kind == "dense" else spec.dense_dtype
        w = self.forward_bytes(spec) / cm.shards
        params = w / (matrix_bytes(1024, 1024, dtype) / 2**20)
        kernels = e.attention_kernels + e.head_kernels + (e.expert_kernels if self.kind == "eagle" else 0)
        pred = uses_predictor and self.predictor
        total = 0.0
        for level in range(depth + (1 if pred else 0)):
            rows = branch ** level  # the frontier this forward reads
            if expand:
                rows = min(rows, expand * branch if pred else expand)
            if level == depth and self.kind == "eagle":
                # The extra forward only gives the deepest nodes' hidden states to the expert
                # predictor: no token is proposed from it, so the LM head is not read.
                w_l = w - spec.lm_head_bytes / cm.shards
                total += cm.draft_forward(w_l, w_l / w * params, rows, kernels - e.head_kernels, spec.dense_dtype)
            else:
                total += cm.draft_forward(w, params, rows, kernels, spec.dense_dtype)
            if pred:
                total += cm.read(self.predictor_bytes(spec) / cm.shards)
        return total


def parse_draft(text: str) -> DraftProfile:
    """A draft profile from its command-line spelling: ``none``, ``eagle`` or ``eagle:F``
    (a head of F target layers), ``dense:B`` (a dense draft of B billion parameters)."""
    kind, _, arg = text.strip().lower().partition(":")
    try:
        value = float(arg) if arg else None
    except ValueError:
        raise MoesimError(f"draft {text!r}: the part after ':' must be a number") from None
    if kind == "eagle":
        return DraftProfile("eagle", layer_fraction=1.0 if value is None else value)
    if kind == "dense":
        if value is None:
            raise MoesimError("a dense draft needs its size: dense:B (billions of parameters), e.g. dense:0.5")
        return DraftProfile("dense", params_b=value)
    if kind == "none" and value is None:
        return DraftProfile("none")
    raise MoesimError(f"unknown draft {text!r}; use none, eagle, eagle:F or dense:B")
