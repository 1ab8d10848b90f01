"""Run the reference executor and record a trace with measured timings: one call per kind of run.

:func:`record_decode` is ``moesim profile`` (decode under a policy) and
:func:`record_speculative` is ``moesim speculate`` (greedy speculative decoding with a
draft tree). Each resolves its inputs, checks them before any work, runs,
and writes the trace atomically; Ctrl-C during the run keeps and writes the finished
steps (moesim.executor.interrupt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moesim import budget
from moesim.errors import MoesimError
from moesim.executor.defaults import DECODE_THREADS, DRAFT_MODEL, SHIPPED_MODEL
from moesim.executor.interrupt import stop_on_interrupt, stop_requested
from moesim.executor.loading import checkpoint_dir, load_model, predictor_files, prompt_ids
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, get_profile
from moesim.models import cache_capacity
from moesim.outputs import check_output_file
from moesim.policy import get_policy
from moesim.traces.format import Trace, write_trace


def link_profile(hw: str, link_gbps: float | None) -> HardwareProfile:
    """The profile whose link the emulated link imitates, with an optional bandwidth override."""
    profile = get_profile(hw)
    return profile if link_gbps is None else profile.with_figure("h2d_pinned_gbs", link_gbps)


@dataclass
class DecodeRequest:
    """Everything ``moesim profile`` decides (the defaults are the CLI's)."""

    model: str = SHIPPED_MODEL
    policy: str = "prefetch-fom"
    predictor: str = "quasi"
    device: str = "cpu"
    hw: str = DEFAULT_PROFILE
    link_gbps: float | None = None
    tokens: int = 64
    batch: int = 1
    prompt: str | None = None
    prompt_len: int = 32
    cache_gib: float = 0.0
    cache_experts: int = 0
    eviction: str = "lru"
    layers: int | None = None
    dtype: str = "fp32"
    temperature: float = 0.0
    seed: int = 0
    fidelity_tokens: int = 128
    threads: int = DECODE_THREADS


@dataclass
class Recorded:
    """A written trace and what its run achieved."""

    trace: Trace
    path: Path
    steps: int  # finished decode steps (fewer than asked if interrupted)
    asked: int
    extra: dict = field(default_factory=dict)


def check_decode_budget(req: DecodeRequest, hw: HardwareProfile, offload: bool) -> None:
    """Refuse, before loading anything, a decode that cannot fit in memory or would take
    more than a day; announce one that takes long (moesim.budget)."""
    from moesim.executor.loading import shipped_model
    from moesim.models import get_model

    if req.layers is not None and req.layers < 1:
        raise MoesimError(f"--layers {req.layers}: keep at least one layer (leave it out for all)")
    if not 0 <= req.temperature < float("inf"):
        raise MoesimError(f"--temperature {req.temperature:g}: 0 (greedy) or a positive number")
    if req.fidelity_tokens < 0:
        raise MoesimError("--fidelity-tokens must be >= 0")
    if req.prompt_len < 1 and req.prompt is None:
        raise MoesimError("--prompt-len must be >= 1")
    if req.cache_gib < 0 or req.cache_experts < 0 or req.cache_gib != req.cache_gib:
        raise MoesimError("cache size must be >= 0")
    src = shipped_model(req.model) if req.model in (SHIPPED_MODEL, DRAFT_MODEL) else req.model
    spec = get_model(str(src))
    if req.layers is not None:
        spec = spec.with_layers(req.layers)
    from moesim.executor.model import ExecConfig

    ExecConfig(spec)  # a model the executor cannot run says so first
    capacity = cache_capacity(spec, min(req.cache_gib, 2.0**40), req.cache_experts)
    budget.check(budget.decode_estimate(spec, req.tokens, req.batch, 4 if req.dtype == "fp32" else 2,
                                        hw["h2d_pinned_gbs"], capacity, offload, req.prompt_len))


def record_decode(req: DecodeRequest, out: Path, progress: Callable[[int, int], None] | None = None) -> Recorded:
    """Decode with the reference executor under ``req.policy`` and write its trace to ``out``."""
    from moesim.executor.profile import (
        DEFAULT_PROMPT,
        ProfileSettings,
        build_trace,
        check_device,
        eval_text,
        fidelity,
        generate,
    )

    if req.tokens < 1 or req.batch < 1 or req.threads < 1:
        raise MoesimError("--tokens, --batch and --threads must be >= 1")
    check_output_file(out)
    torch.set_num_threads(req.threads)
    dev = check_device(req.device)
    hw_profile = link_profile(req.hw, req.link_gbps)
    pol = get_policy(req.policy)
    check_decode_budget(req, hw_profile, pol.offload)
    loaded = load_model(req.model, req.layers, req.dtype, req.device, req.seed)
    m = loaded.model
    capacity = min(cache_capacity(m.spec, req.cache_gib, req.cache_experts), m.spec.n_moe_layers * m.spec.n_experts) \
        if pol.offload else 0  # a cache larger than every expert holds every expert
    st = ProfileSettings(pol.name, req.predictor, capacity, req.eviction, req.tokens, req.temperature, req.seed)
    dv, est = predictor_files(loaded, req.model, pol.name, req.predictor, req.seed, dev)
    ids = prompt_ids(m, req.prompt if req.prompt is not None else DEFAULT_PROMPT, req.prompt_len, req.batch, req.seed)
    with stop_on_interrupt():  # from here on, Ctrl-C keeps and writes the finished steps
        prefill_s, records, produced = generate(m, ids, st, hw_profile, dv, progress=progress, estimator=est)
        extra = {}
        if pol.speculative and req.fidelity_tokens > 0 and len(records) == req.tokens and not stop_requested():
            text = eval_text(m.spec.vocab, req.fidelity_tokens + 1, req.seed)
            fid = fidelity(m, st, hw_profile, dv, text, est)
            if fid is not None:
                extra["fidelity"] = fid
        trace = build_trace(m, ids, st, hw_profile, prefill_s, records, produced, req.device, loaded.synthetic,
                            loaded.source, extra)
        write_trace(trace, out)
    return Recorded(trace, out, len(records), req.tokens, extra)


@dataclass
class SpeculateRequest:
    """Everything ``moesim speculate`` decides (the defaults are the CLI's)."""

    model: str = SHIPPED_MODEL
    draft: str = DRAFT_MODEL
    policy: str = "on-demand"
    selection: str = "ecospec"
    score: str = "ratio"
    lam: float = 0.05
    gamma: int = 4
    branch: int = 2
    depth: int = 3
    tokens: int = 64
    hw: str = DEFAULT_PROFILE
    link_gbps: float | None = None
    cache_experts: int = 0
    prompt: str | None = None
    threads: int = DECODE_THREADS


@dataclass
class SpeculateSummary:
    tokens: int
    steps: int
    ms_per_token: float
    distinct_experts_per_step: float


def record_speculative(req: SpeculateRequest, out: Path) -> tuple[Recorded, SpeculateSummary]:
    """Greedy (lossless) speculative decoding on the offload engine; writes its trace to ``out``."""
    from moesim.executor.model import load_checkpoint
    from moesim.executor.profile import DEFAULT_PROMPT, load_default_vectors
    from moesim.executor.runtime import OffloadedDecoder, make_transport
    from moesim.executor.speculative import SpecSettings, build_sd_trace, load_expert_predictor, speculative_generate

    check_output_file(out)
    pol = get_policy(req.policy)
    if pol.speculative or pol.oracle:
        raise MoesimError("speculative decoding verifies exactly: use all-resident, on-demand or prefetch-fom")
    st = SpecSettings(req.gamma, req.branch, req.depth, req.selection, req.score, req.lam, req.tokens)
    tpath, dpath = checkpoint_dir(req.model), checkpoint_dir(req.draft)
    torch.set_num_threads(req.threads)
    target, d = load_checkpoint(tpath), load_checkpoint(dpath)
    predictor = load_expert_predictor(dpath)
    if predictor is None and (req.selection == "ecospec" or pol.prefetch):
        raise MoesimError(f"{req.draft} has no expert predictor; run `moesim train-expert-predictor` first")
    hw = link_profile(req.hw, req.link_gbps)
    dec = OffloadedDecoder(target, pol.name, make_transport(torch.device("cpu"), hw.link_bw, hw.transfer_latency),
                           predictor="stale", default_vectors=load_default_vectors(tpath),
                           cache_experts=req.cache_experts)
    ids = torch.tensor(list((req.prompt if req.prompt is not None else DEFAULT_PROMPT).encode())).view(1, -1)
    with stop_on_interrupt():  # Ctrl-C keeps and writes the finished verification steps
        prefill, records, produced = speculative_generate(dec, d, predictor, ids, st)
        trace = build_sd_trace(target, ids, records, prefill, hw, st, pol.name, req.cache_experts, "cpu", False,
                               str(tpath), str(dpath))
        write_trace(trace, out)
    steps = len(records)
    wall = sum(r.draft_s + r.verify.tpot_s for r in records)
    summary = SpeculateSummary(len(produced), steps, wall / max(len(produced), 1) * 1e3,
                               float(np.mean([sum(len(u) for u in r.true_union) for r in records])))
    return Recorded(trace, out, steps, req.tokens), summary
