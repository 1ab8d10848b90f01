"""The trace header, typed: one writer (:func:`make_header`) and one reader (:class:`TraceMeta`).

The file keeps its header as JSON (``docs/trace-format.md``), and ``Trace.header`` stays
the raw dict, so the format does not change. Every consumer reads the header through
``Trace.meta`` instead of ``header.get("recorded", {}).get(...)`` chains: a key renamed or
a type gone wrong then fails in one place, with one line, instead of silently reading
``None`` in fifteen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moesim.errors import MoesimError
from moesim.models import ModelSpec
from moesim.policy import POLICIES, Policy

FORMAT = "moesim-trace"
#: 2 = 1 + optional speculative-decoding records (sd_*); 3 = 2 + routing arrays that repeat
#: an earlier one stored once (header ``same_as``); 4 = 3 + expert ids stored in one byte
#: (int8, models of at most 128 experts: ``BYTE_IDS_VERSION``). Readers take all four.
#: ``VERSION`` is what a trace of a larger model is written as: its ids are int16, as
#: before, so a moesim that reads version 3 still reads it.
VERSION = 3
BYTE_IDS_VERSION = 4
READABLE = (1, 2, 3, 4)

#: The policy a replay uses when the trace's recorded one is not a registered policy
#: (synthetic traces record "none"): on-demand executes exactly the true experts.
FALLBACK_POLICY = "on-demand"


def make_header(spec: ModelSpec, *, policy: str, params: dict[str, Any] | None = None, prompt_len: int,
                n_tokens: int, batch: int, seed: int, synthetic: bool, recorded: dict[str, Any],
                prefill_s: float | None = None, metrics: dict[str, Any] | None = None, lookahead: int = 1,
                **extra: Any) -> dict[str, Any]:
    """The JSON header every trace writer builds (executor, speculative executor, generator).

    ``recorded`` says where and how (``tool``, ``how``, and for measured traces
    ``hw_profile``, ``link_gbps``, ``latency_us``, ``device``, ``transport``, ...);
    ``extra`` holds the optional sections (``speculative``, ``generator``); ``lookahead``
    (how many MoE layers ahead ``pred_ids`` were predicted) is written only when it is not 1.
    """
    header: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "model": spec.to_dict(),
        "policy": {"name": policy, "params": dict(params or {})},
        "prompt_len": int(prompt_len), "n_tokens": int(n_tokens), "batch": int(batch), "seed": int(seed),
        "synthetic": bool(synthetic), "recorded": dict(recorded),
    }
    if prefill_s is not None:
        header["prefill_s"] = float(prefill_s)
    if metrics is not None:
        header["metrics"] = metrics
    if int(lookahead) != 1:
        header["lookahead"] = int(lookahead)
    header.update(extra)
    return header


def _section(h: dict[str, Any], key: str) -> dict[str, Any]:
    v = h.get(key, {})
    if not isinstance(v, dict):
        raise MoesimError(f"trace header {key!r} must be an object, got {type(v).__name__}")
    return v


def _opt(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)) or not isinstance(v, kind):
        raise MoesimError(f"trace header {where}{key!r} has the wrong type ({type(v).__name__})")
    return v


@dataclass(frozen=True)
class TraceMeta:
    """What a trace's header says, as attributes (``None`` where the header is silent)."""

    model: ModelSpec
    policy: str | None  # the recorded policy's name ("none" for a synthetic trace)
    policy_params: dict[str, Any]
    cache_experts: int  # the recorded run's cross-token cache, in experts
    eviction: str
    predictor: str | None
    host_profile: str | None  # CPU-compute policies: the host profile whose figures decided (policy params)
    cpu_layers: int | None  # cpu-static: MoE layers whose experts ran on the CPU
    placement_from: str | None  # hot-experts / cpu-on-miss: the calibration trace that placed the experts
    device_memory_gb: float | None  # CPU-compute policies: device memory the placement filled
    expert_dtype: str | None  # quantised routed experts (the model spec's expert_dtype says the same)
    prompt_len: int | None
    seed: int | None
    synthetic: bool
    prefill_s: float | None  # measured time to first token
    hw_profile: str | None  # the profile whose link the recording used
    link_gbps: float | None  # the link actually used
    latency_us: float | None
    device: str | None
    transport: str | None
    model_source: str | None  # where the model's weights came from (checkpoint path, ...)
    tool: str | None
    how: str | None
    metrics: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    generator: dict[str, Any] | None = None
    lookahead: int = 1  # pred_ids[:, m] was predicted at MoE layer m - lookahead's router

    @property
    def recorded_policy(self) -> Policy | None:
        """The recorded policy when it is a registered one (else None: synthetic, unknown)."""
        return POLICIES.get(self.policy) if self.policy else None

    @property
    def replay_policy(self) -> str:
        """The policy that reproduces the recorded run: the recorded one, or on-demand."""
        return self.policy if self.recorded_policy is not None else FALLBACK_POLICY

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> TraceMeta:
        """Read a header dict; a section of the wrong type is a one-line MoesimError."""
        if not isinstance(h.get("model"), dict):
            raise MoesimError("trace header has no model spec object")
        pol, rec = _section(h, "policy"), _section(h, "recorded")
        params = _section(pol, "params")
        num = (int, float)
        spec_, gen = h.get("speculative"), h.get("generator")
        for name, sec in (("speculative", spec_), ("generator", gen)):
            if sec is not None and not isinstance(sec, dict):
                raise MoesimError(f"trace header {name!r} must be an object")
        model = ModelSpec.from_dict(h["model"])
        lookahead = _opt(h, "lookahead", int, "")
        if lookahead is not None and (lookahead < 1 or lookahead != 1 and lookahead >= model.n_moe_layers):
            raise MoesimError(f"trace header lookahead {lookahead} must be >= 1 and less than {model.name}'s "
                              f"{model.n_moe_layers} MoE layers (predictions made that many MoE layers ahead)")
        return cls(
            model=model,
            policy=_opt(pol, "name", str, "policy "),
            policy_params=params,
            cache_experts=_opt(params, "cache_experts", int, "policy params ") or 0,
            eviction=_opt(params, "eviction", str, "policy params ") or "lru",
            predictor=_opt(params, "predictor", str, "policy params "),
            host_profile=_opt(params, "host_profile", str, "policy params "),
            cpu_layers=_opt(params, "cpu_layers", int, "policy params "),
            placement_from=_opt(params, "placement_from", str, "policy params "),
            device_memory_gb=_opt(params, "device_memory_gb", num, "policy params "),
            expert_dtype=_opt(params, "expert_dtype", str, "policy params "),
            prompt_len=_opt(h, "prompt_len", int, ""),
            seed=_opt(h, "seed", int, ""),
            synthetic=bool(_opt(h, "synthetic", bool, "") or False),
            prefill_s=_opt(h, "prefill_s", num, ""),
            hw_profile=_opt(rec, "hw_profile", str, "recorded "),
            link_gbps=_opt(rec, "link_gbps", num, "recorded "),
            latency_us=_opt(rec, "latency_us", num, "recorded "),
            device=_opt(rec, "device", str, "recorded "),
            transport=_opt(rec, "transport", str, "recorded "),
            model_source=_opt(rec, "model_source", str, "recorded "),
            tool=_opt(rec, "tool", str, "recorded "),
            how=_opt(rec, "how", str, "recorded "),
            metrics=_section(h, "metrics"),
            speculative=spec_,
            generator=gen,
            lookahead=1 if lookahead is None else lookahead,
        )
