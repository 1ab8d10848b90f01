"""Decode under a policy and record a trace (format version 2): routing, predictions, timings, metrics.

Also the default-vector calibration the quasi-hidden predictor needs, and the output
fidelity of speculative execution (next-token agreement and KL against exact execution).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from moesim import __version__
from moesim.atomic import atomic_write, atomic_write_text
from moesim.errors import MoesimError
from moesim.executor.corpus import held_out_split
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.loading import shipped_model  # noqa: F401 (re-exported for bench/ scripts)
from moesim.executor.model import MoEModel, ResidentExperts, log_softmax_kl
from moesim.executor.runtime import OffloadedDecoder, StepRecord, make_transport
from moesim.hardware import HardwareProfile
from moesim.traces.format import COPY_KINDS, Trace
from moesim.traces.header import make_header
from moesim.traces.metrics import routing_metrics
from moesim.traces.records import copy_arrays

DEFAULT_VECTORS = "default_vectors.safetensors"
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
# Default vectors
# --------------------------------------------------------------------------------------


@torch.no_grad()
def calibrate(model: MoEModel, tokens: torch.Tensor, chunk: int = 256,
              progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Per layer and expert, the mean output of the expert over the tokens routed to it
    (zero for an expert never chosen): the default vectors ``d_{l,e}``. [L, E, hidden], fp32.
    ``progress(done, total)`` counts tokens."""
    s = model.spec
    sums = torch.zeros(s.n_layers, s.n_experts, s.hidden)
    counts = torch.zeros(s.n_layers, s.n_experts)

    def accumulate(layer: int, e: int, rows: torch.Tensor, y: torch.Tensor) -> None:  # y [rows, hidden], ungated
        sums[layer, e] += y.float().sum(0).cpu()
        counts[layer, e] += rows.numel()

    capture = ResidentExperts(model, each=accumulate)
    for i in range(0, tokens.numel() - 1, chunk):
        model.hidden_states(tokens[i:i + chunk].view(1, -1).to(model.embed_tokens.weight.device), capture)
        if progress is not None:
            progress(min(i + chunk, tokens.numel() - 1), tokens.numel() - 1)
    return sums / counts.clamp(min=1)[..., None]


def save_default_vectors(model_dir: Path, dv: torch.Tensor, description: dict) -> None:
    from safetensors.torch import save

    data = save({"default_vectors": dv.contiguous()})
    atomic_write(model_dir / DEFAULT_VECTORS, lambda f: f.write(data))
    atomic_write_text(model_dir / "calibration.json", json.dumps(description, indent=2) + "\n")


def load_default_vectors(model_dir: Path) -> torch.Tensor | None:
    path = Path(model_dir) / DEFAULT_VECTORS
    if not path.exists():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))["default_vectors"]


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
    hybrid: object = None  # runtime.HybridSetup: the CPU-compute policies' placement and expert times
    expert_dtype: str | None = None  # quantised routed experts (executor.quant_experts); None = the model's dtype
    hybrid_params: dict = field(default_factory=dict)  # what the header records of the CPU-compute setup
    prefetch_top: int | None = None  # prefetch only each sequence's m most confident predicted experts
    copy_queue: str = "fifo"  # the link's queue discipline (moesim.policy.QUEUES; not fifo: emulated link only)


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    probs = (logits.float() / temperature).softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=gen).to(logits.device)


def _decoder(model: MoEModel, st: ProfileSettings, hw: HardwareProfile, batch: int, dv, policy: str | None = None,
             estimator=None):
    policy = policy or st.policy
    queue = st.copy_queue if policy == st.policy else "fifo"  # a pre-pass or reference run copies FIFO
    transport = make_transport(model.embed_tokens.weight.device, hw.link_bw, hw.transfer_latency, queue)
    hybrid = st.hybrid if policy == st.policy else None  # a pre-pass or reference run is a copy policy
    return OffloadedDecoder(model, policy, transport, predictor=st.predictor, default_vectors=dv,
                            cache_experts=st.cache_experts, eviction=st.eviction, batch=batch, estimator=estimator,
                            hybrid=hybrid, expert_dtype=st.expert_dtype,
                            prefetch_top=st.prefetch_top if policy == st.policy else None, copy_queue=queue)


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
    if dec.policy.prefetch and dec.predictor == "oracle":  # the true routing of every step, from an exact, untimed pre-pass
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
    """Speculative output against exact output, teacher-forced over ``eval_tokens`` [1, T]:
    next-token agreement and mean KL(exact || policy) of the output distributions. If
    Ctrl-C cuts it short: over the tokens both runs finished (``tokens`` says how many),
    or None if none."""
    prompt, forced = eval_tokens[:, :1], eval_tokens[:, 1:]
    try:
        _, exact, _ = generate(model, prompt, st, hw, dv, forced, "all-resident")
        _, spec, _ = generate(model, prompt, st, hw, dv, forced, estimator=estimator)
    except Interrupted:
        return None
    n = min(len(exact), len(spec))
    a = torch.stack([r.logits for r in exact[:n]]).reshape(-1, model.spec.vocab)
    b = torch.stack([r.logits for r in spec[:n]]).reshape(-1, model.spec.vocab)
    return {"tokens": int(a.shape[0]), "next_token_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "mean_kl": float(log_softmax_kl(a, b).mean())}


def build_trace(model: MoEModel, prompt: torch.Tensor, st: ProfileSettings, hw: HardwareProfile,
                prefill_s: float, records: list[StepRecord], out: list[torch.Tensor], device: str,
                synthetic: bool, model_source: str, extra: dict | None = None) -> Trace:
    s = model.spec
    b = prompt.shape[0]

    def stack(name: str) -> np.ndarray:  # [T, M, B*1, k] -> [T, M, B, k] (M: MoE layers, as the records)
        return np.stack([getattr(r, name) for r in records]).reshape(len(records), s.n_moe_layers, b, s.top_k)

    true_ids, pred_ids = stack("true_ids"), stack("pred_ids")
    copies = [(i, c) for i, r in enumerate(records) for c in r.copies]
    timings = {
        "attn_s": np.stack([r.attn_s for r in records]), "expert_s": np.stack([r.expert_s for r in records]),
        "stall_s": np.stack([r.stall_s for r in records]), "predict_s": np.stack([r.predict_s for r in records]),
        "other_s": np.array([r.other_s for r in records]),
        "tpot_s": np.array([r.tpot_s for r in records]),
        **copy_arrays(copies),
    }
    params = {"predictor": "none" if st.hybrid is not None else st.predictor, "cache_experts": st.cache_experts, "eviction": st.eviction,
              "temperature": st.temperature}
    if records and records[0].cpu_s is not None:  # a CPU-compute policy: what its CPU experts did
        timings["cpu_s"] = np.stack([r.cpu_s for r in records])
        timings["cpu_wait_s"] = np.stack([r.cpu_wait_s for r in records])
        timings["cpu_experts"] = np.stack([r.cpu_experts for r in records]).astype(np.int16)
        params.update(st.hybrid_params)
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
                  "created": datetime.now(UTC).isoformat(timespec="seconds"), "copy_kinds": list(COPY_KINDS)},
        metrics={**routing_metrics(true_ids, pred_ids), **(extra or {})},
    )
    if st.prefetch_top:  # the predictions stay whole; replays cut them as the run did (sim.prefetch_top)
        header["prefetch_top_m"] = st.prefetch_top
    if st.copy_queue != "fifo":  # replays time it with the same discipline (moesim.sim.validate)
        header["copy_queue"] = st.copy_queue
    token_ids = torch.cat(out, 1).numpy().astype(np.int32) if out else np.zeros((b, 0), np.int32)
    return Trace(header, prompt.cpu().numpy().astype(np.int32), token_ids, true_ids,
                 stack("true_gates").astype(np.float32), pred_ids, stack("pred_gates").astype(np.float32),
                 stack("exec_ids"), timings)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        try:
            import pynvml

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
