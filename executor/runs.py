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
from moesim.bounds import check_rate
from moesim.errors import MoesimError
from moesim.executor.default_vectors import load_default_vectors
from moesim.executor.defaults import DECODE_THREADS, DRAFT_MODEL, SHIPPED_MODEL
from moesim.executor.families import ExecConfig
from moesim.executor.interrupt import stop_on_interrupt, stop_requested
from moesim.executor.loading import (
    checkpoint_dir,
    load_model,
    model_spec,
    parse_prompt_ids,
    predictor_files,
    prompt_ids,
)
from moesim.executor.model import load_checkpoint
from moesim.executor.profile import (
    DEFAULT_PROMPT,
    ProfileSettings,
    build_trace,
    check_device,
    eval_text,
    fidelity,
    generate,
)
from moesim.executor.quant_experts import FORMATS
from moesim.executor.runtime import (
    Offload,
    OffloadedDecoder,
    Origin,
    check_lookahead_for,
    check_prefetch_top,
    host_setup,
    make_transport,
)
from moesim.executor.speculative import SDSettings, build_sd_trace, load_expert_predictor, sd_generate
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, get_host, get_profile
from moesim.models import cache_capacity
from moesim.outputs import check_output_file
from moesim.policy import QUEUES, get_policy
from moesim.policy.placement import cpu_layers as check_layers
from moesim.setting import Setting
from moesim.traces.format import Trace, load_calibration, write_trace


def link_profile(hw: str, link_gbps: float | None) -> HardwareProfile:
    """The profile whose link the emulated link imitates, with an optional bandwidth override."""
    profile = get_profile(hw)
    if link_gbps is None:
        return profile
    check_rate(link_gbps, "--link-gbps")  # moesim.bounds: the range whatif and replay take
    return profile.with_figure("h2d_pinned_gbs", link_gbps, "estimate", "--link-gbps")


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
    # CPU-compute policies (docs/policies.md): host profile (default: the --hw profile's host),
    # cpu-static's layer count, the calibration trace that places hot experts (hot-experts;
    # warms cpu-on-miss's cache), and how many experts the device holds (hot-experts)
    host: str | None = None
    cpu_layers: int | str | None = None
    placement_from: Path | None = None
    gpu_experts: int | None = None
    # Routed experts quantised (executor.quant_experts): int8, int4-g32, int4-g128; None = --dtype
    expert_dtype: str | None = None
    prefetch_top: int | None = None  # prefetch only each sequence's m most confident predicted experts
    copy_queue: str = "fifo"  # the emulated link's queue discipline (moesim.policy.QUEUES)
    lookahead: int = 1  # prefetching policies: the MoE layer m + N's prefetch is issued at m's router
    prompt_ids: str | list[int] | None = None  # token ids instead of text ("1,2,3"), checked against the vocabulary


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
    spec = _request_spec(req)
    ExecConfig(spec)  # a model the executor cannot run says so first
    capacity = cache_capacity(spec, min(req.cache_gib, 2.0**40), req.cache_experts)
    budget.check(budget.decode_estimate(spec, req.tokens, req.batch, 4 if req.dtype == "fp32" else 2,
                                        hw["h2d_pinned_gbs"], capacity, offload, req.prompt_len))


def check_cpu_options(req: DecodeRequest, spec) -> tuple[np.ndarray | None, int | str]:
    """One-line errors, before any work, for options that do not fit the policy; returns the
    calibration routing (``--placement-from``, checked against the model) and the
    cpu-static layer count (``auto`` or a number)."""
    pol = get_policy(req.policy)
    if not pol.executed:  # whole-layer placements: the simulator's (moesim.sim.static)
        raise MoesimError(f"{pol.name} is simulated, not executed: try it with moesim replay or whatif --policy "
                          f"{pol.name}; the executor runs the copy policies, cpu-static, hot-experts and cpu-on-miss")
    if req.expert_dtype is not None and req.expert_dtype not in FORMATS:
        raise MoesimError(f"--expert-dtype {req.expert_dtype!r}: the executor quantises experts to "
                          f"{', '.join(FORMATS)} (leave it out for --dtype)")
    given = [name for name, v in (("--host", req.host), ("--cpu-layers", req.cpu_layers),
                                  ("--placement-from", req.placement_from), ("--gpu-experts", req.gpu_experts))
             if v is not None]
    if not pol.uses_host:
        if given:
            raise MoesimError(f"{', '.join(given)} apply to the CPU-compute policies (cpu-static, hot-experts, "
                              f"cpu-on-miss), not {pol.name}")
        return None, "auto"
    for name in given:
        if name not in pol.knobs:
            raise MoesimError(f"{name} does not apply to {pol.name}")
    if pol.places_hot_set and req.placement_from is None:
        raise MoesimError("hot-experts needs a calibration trace to count expert frequencies: "
                          "--placement-from TRACE (e.g. an on-demand run's trace)")
    if pol.needs_cache and req.cache_gib <= 0 and req.cache_experts <= 0:
        raise MoesimError("cpu-on-miss needs a device expert cache: --cache-gib or --cache-experts > 0")
    n: int | str = "auto"
    if req.cpu_layers is not None:
        n = req.cpu_layers
        if isinstance(n, str):
            n = int(n) if n.strip().isdigit() else n.strip()
        check_layers(spec, n, 1e30)  # "auto" or 0..M: the count alone, memory comes later
    if req.gpu_experts is not None and not 0 <= req.gpu_experts <= spec.n_moe_layers * spec.n_experts:
        raise MoesimError(f"--gpu-experts {req.gpu_experts}: 0 to {spec.n_moe_layers * spec.n_experts} "
                          f"(the routed experts of {spec.name})")
    calibration = None
    if req.placement_from is not None:
        calibration = load_calibration(str(req.placement_from), spec)
    return calibration, n


def check_copy_queue(req: DecodeRequest, pol) -> None:
    """Before the model loads: a queue discipline other than FIFO needs the emulated link
    (a CUDA stream cannot reorder or withdraw copies) and a copy policy."""
    q = req.copy_queue
    if q not in QUEUES:
        raise MoesimError(f"unknown copy queue {q!r}; known: {', '.join(QUEUES)}")
    if q == "fifo":
        return
    if req.device != "cpu":
        raise MoesimError(f"--copy-queue {q} runs on the emulated link only (--device cpu): a CUDA copy stream copies "
                          "in the order queued and cannot withdraw a copy")
    if not pol.copies_experts:
        raise MoesimError(f"--copy-queue {q} applies to the copy policies (on-demand, prefetch-fom, prefetch-spec, "
                          f"oracle), not {pol.name}")


def _request_spec(req: DecodeRequest):
    return model_spec(req.model, req.layers)


def check_prompt_and_lookahead(req: DecodeRequest, pol, spec) -> list[int] | None:
    """Before the model loads: ``--prompt-ids`` (integers in the vocabulary, and not with
    ``--prompt``) and ``--lookahead`` (a prefetching policy, a MoE layer left to prefetch,
    a predictor that looks that far); returns the prompt ids."""
    if req.prompt_ids is not None and req.prompt is not None:
        raise MoesimError("--prompt and --prompt-ids: give one (text, or token ids)")
    ids = parse_prompt_ids(req.prompt_ids, spec.vocab)
    check_lookahead_for(pol, req.lookahead, spec.n_moe_layers, req.predictor)
    return ids


def record_decode(req: DecodeRequest, out: Path, progress: Callable[[int, int], None] | None = None) -> Recorded:
    """Decode with the reference executor under ``req.policy`` and write its trace to ``out``."""
    if req.tokens < 1 or req.batch < 1 or req.threads < 1:
        raise MoesimError("--tokens, --batch and --threads must be >= 1")
    check_output_file(out)
    torch.set_num_threads(req.threads)
    dev = check_device(req.device)
    hw_profile = link_profile(req.hw, req.link_gbps)
    pol = get_policy(req.policy)
    check_decode_budget(req, hw_profile, pol.offload)
    calibration, n_cpu = check_cpu_options(req, _request_spec(req))
    if req.prefetch_top is not None:  # before the model loads (the decoder checks the same)
        check_prefetch_top(pol, req.prefetch_top, _request_spec(req).top_k)
    check_copy_queue(req, pol)
    given_ids = check_prompt_and_lookahead(req, pol, _request_spec(req))
    host_profile = get_host(req.host, hw_profile) if pol.uses_host else None
    loaded = load_model(req.model, req.layers, req.dtype, req.device, req.seed)
    m = loaded.model
    spec = m.spec.with_expert_dtype(req.expert_dtype) if req.expert_dtype else m.spec  # byte accounting
    capacity = pol.cache_capacity(spec, req.cache_gib, req.cache_experts)  # static placements: none (the placement)
    st = ProfileSettings(pol.name, req.predictor, capacity, req.eviction, req.tokens, req.temperature, req.seed,
                         expert_dtype=req.expert_dtype, prefetch_top=req.prefetch_top, copy_queue=req.copy_queue,
                         lookahead=req.lookahead)
    ids = prompt_ids(m, req.prompt if req.prompt is not None else DEFAULT_PROMPT, req.prompt_len, req.batch, req.seed,
                     given_ids)
    if pol.uses_host:
        setup = host_setup(spec, pol.name, hw_profile, Setting(host=host_profile, cpu_layers=n_cpu,
                                                               calibration=calibration),
                           batch=req.batch, context=ids.shape[1] + req.tokens, gpu_experts=req.gpu_experts)
        st.host_setup = setup
        st.host_params = setup.params(req.placement_from, req.gpu_experts)
    dv, est = predictor_files(loaded, req.model, pol.name, req.predictor, req.seed, dev)
    with stop_on_interrupt():  # from here on, Ctrl-C keeps and writes the finished steps
        prefill_s, records, produced = generate(m, ids, st, hw_profile, dv, progress=progress, estimator=est)
        extra = {}
        if not pol.exact and req.fidelity_tokens > 0 and len(records) == req.tokens and not stop_requested():
            text = eval_text(m.spec.vocab, req.fidelity_tokens + 1, req.seed)
            fid = fidelity(m, st, hw_profile, dv, text, est)
            if fid is not None:
                extra["fidelity"] = fid
        trace = build_trace(m, ids, st, hw_profile, prefill_s, records, produced, Origin(req.device, loaded.synthetic, loaded.source), extra)
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
    tokens_per_step: float  # what a verification step commits: its accepted candidates and the target's next token


def record_speculative(req: SpeculateRequest, out: Path,
                       progress: Callable[[int, int], None] | None = None) -> tuple[Recorded, SpeculateSummary]:
    """Greedy (lossless) speculative decoding on the offload engine; writes its trace to ``out``.
    ``progress(tokens done, tokens asked)`` after each verification step."""
    check_output_file(out)
    pol = get_policy(req.policy)
    if not pol.verifies_drafts:
        raise MoesimError("speculative decoding verifies exactly on the copy engine: use all-resident, on-demand "
                          "or prefetch-fom")
    st = SDSettings(req.gamma, req.branch, req.depth, req.selection, req.score, req.lam, req.tokens)
    tpath, dpath = checkpoint_dir(req.model), checkpoint_dir(req.draft)
    torch.set_num_threads(req.threads)
    target, d = load_checkpoint(tpath), load_checkpoint(dpath)
    predictor = load_expert_predictor(dpath)
    if predictor is None and (req.selection == "ecospec" or pol.prefetches):
        raise MoesimError(f"{req.draft} has no expert predictor; run `moesim train-expert-predictor` first")
    hw = link_profile(req.hw, req.link_gbps)
    dec = OffloadedDecoder(target, pol.name, make_transport(torch.device("cpu"), hw.link_bw, hw.transfer_latency),
                           Offload(req.cache_experts), predictor="stale", default_vectors=load_default_vectors(tpath))
    ids = torch.tensor(list((req.prompt if req.prompt is not None else DEFAULT_PROMPT).encode())).view(1, -1)
    with stop_on_interrupt():  # Ctrl-C keeps and writes the finished verification steps
        prefill, records, produced = sd_generate(dec, d, predictor, ids, st, progress)
        trace = build_sd_trace(target, ids, records, prefill, hw, st, pol.name, req.cache_experts, Origin("cpu", False, str(tpath), str(dpath)))
        write_trace(trace, out)
    steps = len(records)
    wall = sum(r.draft_s + r.verify.tpot_s for r in records)
    summary = SpeculateSummary(len(produced), steps, wall / max(len(produced), 1) * 1e3,
                               float(np.mean([sum(len(u) for u in r.true_union) for r in records])),
                               float(np.mean([len(r.accepted_rows) for r in records])))
    return Recorded(trace, out, steps, req.tokens), summary
