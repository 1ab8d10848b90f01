"""Decode under a policy and record a trace (format version 2): routing, predictions, timings, metrics.

Also the output fidelity of speculative execution (next-token agreement and KL against
exact execution). The default vectors the quasi-hidden predictor reads are
:mod:`moesim.executor.default_vectors` (re-exported here).
"""

from __future__ import annotations

import gc
import os
import platform
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import torch

from moesim import __version__
from moesim.errors import MoesimError
from moesim.executor.corpus import held_out_split
from moesim.executor.default_vectors import (  # noqa: F401 (re-exported: their long-standing home)
    DEFAULT_VECTORS,
    calibrate,
    load_default_vectors,
    save_default_vectors,
)
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.loading import shipped_model  # noqa: F401 (re-exported for bench/ scripts)
from moesim.executor.model import MoEModel, log_softmax_kl
from moesim.executor.runtime import Offload, OffloadedDecoder, Origin, StepRecord, make_transport
from moesim.hardware import HardwareProfile
from moesim.traces.format import COPY_KINDS, Trace
from moesim.traces.header import make_header
from moesim.traces.metrics import routing_metrics
from moesim.traces.records import copy_arrays

DEFAULT_PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"


def eval_text(vocab: int, n: int, seed: int) -> torch.Tensor:
    """A fixed evaluation text [1, n] for fidelity: for byte-level models the start of the
    held-out tail of the Python standard library corpus (never trained on; the same for a
    given Python version), else seeded random ids."""
    if vocab == 256:
        data = held_out_split()[0][:n]
        return torch.tensor(list(data), dtype=torch.long).view(1, -1)
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed + 7))


# --------------------------------------------------------------------------------------
# Decoding and recording
# --------------------------------------------------------------------------------------


@dataclass
class ProfileSettings:
    policy: str = "on-demand"
    predictor: str = "quasi"
    cache_experts: int = 0
    eviction: str = "lru"
    tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    host_setup: object = None  # runtime.HostSetup: the CPU-compute policies' placement and expert times
    expert_dtype: str | None = None  # quantised routed experts (executor.quant_experts); None = the model's dtype
    host_params: dict = field(default_factory=dict)  # what the header records of the CPU-compute setup
    prefetch_top: int | None = None  # prefetch only each sequence's m most confident predicted experts
    copy_queue: str = "fifo"  # the link's queue discipline (moesim.policy.QUEUES; not fifo: emulated link only)
    lookahead: int = 1  # prefetching policies: MoE layers ahead a prefetch is issued (Planner.prefetch_target)


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    probs = (logits.float() / temperature).softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=gen).to(logits.device)


def _decoder(model: MoEModel, st: ProfileSettings, hw: HardwareProfile, batch: int, dv, policy: str | None = None,
             estimator=None):
    policy = policy or st.policy
    own = policy == st.policy  # a pre-pass or reference run is a plain copy policy: FIFO, one layer ahead
    queue = st.copy_queue if own else "fifo"
    transport = make_transport(model.embed_tokens.weight.device, hw.link_bw, hw.transfer_latency, queue)
    offload = Offload(st.cache_experts, st.eviction, queue, st.lookahead if own else 1,
                      st.prefetch_top if own else None, st.expert_dtype)
    return OffloadedDecoder(model, policy, transport, offload, predictor=st.predictor, default_vectors=dv,
                            batch=batch, estimator=estimator, host_setup=st.host_setup if own else None)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while steps are timed (collected just before).

    Why: a collection pauses the decoding thread for a few ms at moments set by allocation
    counts, not by the model: one lands inside a step's measured compute at random and
    makes two runs of the same policy differ (the validation suite's run-to-run noise).
    Decoding creates no reference cycles worth collecting (tensors are freed by reference
    counting), so memory does not grow; the collector runs again when the loop ends."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def generate(model: MoEModel, prompt: torch.Tensor, st: ProfileSettings, hw: HardwareProfile,
             dv: torch.Tensor | None = None, forced: torch.Tensor | None = None, policy: str | None = None,
             progress: Callable[[int, int], None] | None = None,
             estimator=None) -> tuple[float, list[StepRecord], list[torch.Tensor]]:
    """Prefill ``prompt`` [B, P], then decode ``st.tokens`` steps (or feed ``forced`` [B, T]
    tokens: teacher forcing). Returns (prefill seconds, step records, the token each step
    consumed). Ctrl-C at any instant returns the finished steps, records and tokens always
    of equal length (a step's record and token are committed together, after the step);
    before the first finished step it raises :class:`Interrupted`."""
    policy = policy or st.policy
    b, p = prompt.shape
    n = forced.shape[1] if forced is not None else st.tokens
    dec = _decoder(model, st, hw, b, dv, policy, estimator)
    if dec.policy.prefetches and dec.predictor == "oracle":  # the true routing of every step, from an exact, untimed pre-pass
        _, pre, _ = generate(model, prompt, st, hw, dv, forced, "on-demand")
        dec.oracle_routes = [(r.true_ids, r.true_gates) for r in pre]
    gen = torch.Generator().manual_seed(st.seed)
    cache = model.new_cache(b, p + n + 1)
    done: list[tuple[StepRecord, torch.Tensor]] = []  # (record, the token it consumed): one append a step
    cut = False
    with stop_on_interrupt(), collector_paused():
        try:
            pre_rec = dec.step(prompt.to(dec.device), cache, 0, prefill=True)
            tok = _next_token(pre_rec.logits, st.temperature, gen)
            for i in range(n):
                if stop_requested():
                    cut = True
                    break
                if forced is not None:
                    tok = forced[:, i:i + 1].to(dec.device)
                rec = dec.step(tok, cache, p + i, i)
                done.append((rec, tok.cpu()))
                tok = _next_token(rec.logits, st.temperature, gen)
                if progress:
                    progress(i + 1, n)
        except KeyboardInterrupt:
            cut = True
        finally:
            dec.close()
    if cut and not done:
        raise Interrupted("interrupted before the first decode step finished: nothing to keep")
    return pre_rec.tpot_s, [r for r, _ in done], [t for _, t in done]


def fidelity(model: MoEModel, st: ProfileSettings, hw: HardwareProfile, dv, eval_tokens: torch.Tensor,
             estimator=None) -> dict:
    """Speculative execution's output against exact output, teacher-forced over
    ``eval_tokens`` [1, T]: next-token agreement and mean KL(exact || policy) of the output
    distributions. If Ctrl-C cuts it short: over the tokens both runs finished (``tokens``
    says how many), or None if none."""
    prompt, forced = eval_tokens[:, :1], eval_tokens[:, 1:]
    try:
        _, exact, _ = generate(model, prompt, st, hw, dv, forced, "all-resident")
        _, executed, _ = generate(model, prompt, st, hw, dv, forced, estimator=estimator)
    except Interrupted:
        return None
    n = min(len(exact), len(executed))
    a = torch.stack([r.logits for r in exact[:n]]).reshape(-1, model.spec.vocab)
    b = torch.stack([r.logits for r in executed[:n]]).reshape(-1, model.spec.vocab)
    return {"tokens": int(a.shape[0]), "next_token_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "mean_kl": float(log_softmax_kl(a, b).mean())}


def build_trace(model: MoEModel, prompt: torch.Tensor, st: ProfileSettings, hw: HardwareProfile,
                prefill_s: float, records: list[StepRecord], out: list[torch.Tensor], origin: Origin,
                extra: dict | None = None) -> Trace:
    device, synthetic, model_source = origin.device, origin.synthetic, origin.source
    s = model.spec
    b = prompt.shape[0]

    def stack(name: str) -> np.ndarray:  # [T, M, B*1, k] -> [T, M, B, k] (M: MoE layers, as the records)
        return np.stack([getattr(r, name) for r in records]).reshape(len(records), s.n_moe_layers, b, s.top_k)

    true_ids, pred_ids = stack("true_ids"), stack("pred_ids")
    scale = model.cfg.router.scale  # DeepSeek / GLM routed_scaling_factor: divided out, gates lie in [0, 1]
    copies = [(i, c) for i, r in enumerate(records) for c in r.copies]
    timings = {
        "attn_s": np.stack([r.attn_s for r in records]), "expert_s": np.stack([r.expert_s for r in records]),
        "stall_s": np.stack([r.stall_s for r in records]), "predict_s": np.stack([r.predict_s for r in records]),
        "other_s": np.array([r.other_s for r in records]),
        "tpot_s": np.array([r.tpot_s for r in records]),
        **copy_arrays(copies),
    }
    params = {"predictor": "none" if st.host_setup is not None else st.predictor, "cache_experts": st.cache_experts,
              "eviction": st.eviction, "temperature": st.temperature}
    if records and records[0].cpu_s is not None:  # a CPU-compute policy: what its CPU experts did
        timings["cpu_s"] = np.stack([r.cpu_s for r in records])
        timings["cpu_wait_s"] = np.stack([r.cpu_wait_s for r in records])
        timings["cpu_experts"] = np.stack([r.cpu_experts for r in records]).astype(np.int16)
        params.update(st.host_params)
    if st.expert_dtype is not None:  # the routed experts as quantised: every byte count follows (moesim.models)
        s = s.with_expert_dtype(st.expert_dtype)
        params["expert_dtype"] = st.expert_dtype
    header = make_header(
        s, policy=st.policy, params=params,
        prompt_len=int(prompt.shape[1]), n_tokens=len(records), batch=b, seed=st.seed, synthetic=synthetic,
        prefill_s=prefill_s,
        recorded={"tool": f"moesim {__version__}", "how": "moesim profile (reference executor)",
                  "host": socket.gethostname(), "device": _device_name(device), "hw_profile": hw.name,
                  "link_gbps": hw["h2d_pinned_gbs"], "latency_us": hw["transfer_latency_us"],
                  "transport": "cuda copy stream" if device.startswith("cuda") else "emulated link (CPU thread)",
                  "model_source": model_source, "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "created": datetime.now(UTC).isoformat(timespec="seconds"), "copy_kinds": list(COPY_KINDS),
                  **({"routed_scaling_factor": scale} if scale != 1.0 else {})},
        metrics={**routing_metrics(true_ids, pred_ids), **(extra or {})},
        lookahead=st.lookahead,  # pred_ids[:, m] was predicted at MoE layer m - lookahead (written when not 1)
    )
    if st.prefetch_top:  # the predictions stay whole; replays cut them as the run did (sim.prefetch_top)
        header["prefetch_top_m"] = st.prefetch_top
    if st.copy_queue != "fifo":  # replays time it with the same discipline (moesim.sim.validate)
        header["copy_queue"] = st.copy_queue
    token_ids = torch.cat(out, 1).numpy().astype(np.int32) if out else np.zeros((b, 0), np.int32)
    return Trace(header, prompt.cpu().numpy().astype(np.int32), token_ids, true_ids,
                 (stack("true_gates") / scale).astype(np.float32), pred_ids,
                 (stack("pred_gates") / scale).astype(np.float32), stack("exec_ids"), timings)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        try:
            import pynvml  # optional (nvidia-ml-py): the link's PCIe state is an extra

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0)
            gen, width = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
            return f"{name} (PCIe gen {gen} x{width} now)"
        except Exception:  # NVML is optional: the name from torch is enough
            return name
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def check_device(device: str) -> torch.device:
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise MoesimError(f"unknown device {device!r}; use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoesimError("--device cuda, but this machine has no CUDA device (use --device cpu: emulated link)")
    return torch.device(device)
