"""Offloaded decoding: the model, a transport and the shared policy decisions, timed.

Experts live in host memory (pinned on CUDA); non-expert weights on the device. A pool of
device expert slots holds, at any moment, the current layer's experts, the next layer's
prefetched experts and the cross-token cache. What to copy, execute and keep is decided
by :class:`moesim.policy.Planner`, the same object the simulator times.

Per MoE layer ``l`` of a step (batch rows decode one token each; dense layers, such as
DeepSeek's leading ones or Qwen2-MoE's ``mlp_only_layers``, run resident and are only
timed; "layer ``l+1``" below is the NEXT MoE layer):

The layer pass is the model's own (``Block.forward``); the decoder supplies the expert
hook that does steps 1-4 below, split into small methods (prediction, the host sync,
planning and copies, the step's timing).

1. attention, router (true top-k), and the prediction for layer ``l+1``:
   ``quasi`` applies layer l+1's router to ``LN_{l+1}(r_l + d_l)`` with default vectors,
   ``stale`` applies it to layer l's own router input, ``oracle`` reads the true ids of a
   routing pre-pass;
2. one device-to-host copy of (true ids, predicted ids) - the only host synchronisation
   of a layer, needed because the host plans the copies;
3. issue layer ``l``'s on-demand copies, then layer ``l+1``'s prefetch;
4. wait for layer ``l``'s copies (on CUDA the compute stream waits on events) and run
   the executed experts (the prediction, with its gates, under speculative execution).

Indexing, mapped once here (:class:`_Layers`) as in the trace and the simulator: routing
records, ``expert_s``/``stall_s``, the planner and its cache, and the expert slots are per
MoE layer ``m`` (``spec.moe_layers[m]`` is its model layer); ``attn_s``/``predict_s`` and
copy records (``Transfer.layer``) are per model layer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moesim.errors import MoesimError
from moesim.executor.model import MoEModel, TreeMask, expert_forward, mix_experts, quasi_hidden
from moesim.executor.transport import CudaTransport, EmulatedLink, QueuedEmulatedLink, Transfer
from moesim.placement import HybridPlanner, Placement
from moesim.policy import QUEUES, ExpertTimes, Planner, cpu_or_copy, expert_slots, get_policy

PREDICTORS = ("quasi", "stale", "oracle", "estimator", "hybrid")


def predictor_inputs(policy: str, predictor: str) -> tuple[bool, bool]:
    """What ``predictor`` reads under ``policy``: (default vectors, a trained estimator).

    Nothing is predicted without offloading, and the oracle policy reads true ids. Every
    other offloading policy predicts, on-demand too (its trace records the predictions so
    that it can stand in for the prefetching policies); only a prefetching policy cannot
    run without them (checked in :class:`OffloadedDecoder`)."""
    pol = get_policy(policy)
    if not pol.offload or pol.oracle or pol.cpu:  # the CPU-compute policies predict nothing
        return False, False
    return predictor in ("quasi", "estimator", "hybrid"), predictor in ("estimator", "hybrid")


@dataclass(frozen=True)
class _Layers:
    """Model layer <-> MoE layer index, computed once from ``ModelSpec.moe_layers``."""

    moe: tuple[int, ...]  # moe[m]: the model layer of MoE layer m
    index: dict[int, int]  # model layer -> m (MoE layers only)

    @classmethod
    def of(cls, spec) -> _Layers:
        return cls(tuple(spec.moe_layers), {layer: m for m, layer in enumerate(spec.moe_layers)})

    def next_moe(self, m: int) -> int | None:
        """The MoE index after ``m``, or None after the last."""
        return m + 1 if m + 1 < len(self.moe) else None


@dataclass
class StepRecord:
    """What one decode step did and how long each part took (seconds). M: MoE layers, L:
    model layers (equal unless the model has dense layers)."""

    true_ids: np.ndarray  # [M, B, k]
    true_gates: np.ndarray
    pred_ids: np.ndarray  # -1 where no prediction
    pred_gates: np.ndarray
    exec_ids: np.ndarray
    attn_s: np.ndarray  # [L] attention, router, prediction and planning (a dense layer: all of it)
    expert_s: np.ndarray  # [M]
    stall_s: np.ndarray  # [M]
    predict_s: np.ndarray  # [L] the prediction alone (part of attn_s)
    cpu_s: np.ndarray | None = None  # [M] CPU-compute policies: the layer's CPU experts past the end of attn_s
    cpu_wait_s: np.ndarray | None = None  # [M] the layer's end waiting for the CPU past the device's experts
    cpu_experts: np.ndarray | None = None  # [M] experts the CPU ran
    other_s: float = 0.0
    tpot_s: float = 0.0
    copies: list[Transfer] = field(default_factory=list)
    logits: Tensor | None = None  # [B, vocab] after the last token
    all_logits: Tensor | None = None  # [B, t, vocab] after every token (tree verification only)


@dataclass(frozen=True)
class HybridSetup:
    """What a CPU-compute policy needs beyond a copy policy: the static placement it starts
    from (None: cpu-on-miss with a cold cache) and the expert times cpu-on-miss decides
    with. Built by :func:`hybrid_setup` from the same functions the simulator calls."""

    placement: Placement | None
    times: ExpertTimes
    host: str  # the host profile as get_host reads it back: a built-in name, or its .toml path
    device_memory_gb: float  # the device memory the placement filled (the profile's, or sized by gpu_experts)
    cpu_layers: int | None = None  # cpu-static: the resolved count
    workers: int | None = None  # host expert threads (default: HostExperts' own)

    def params(self, placement_from: str | Path | None = None, gpu_experts: int | None = None) -> dict:
        """What a trace header records of this setup (its policy params), so that
        ``moesim replay --validate`` rebuilds the same placement (moesim.sim.validate)."""
        p = self.placement
        return {"host_profile": self.host, "cpu_layers": self.cpu_layers, "device_memory_gb": self.device_memory_gb,
                "placement": p.source if p is not None else "cold cache",
                "resident_experts": p.n_resident if p is not None else 0,
                "placement_from": str(Path(placement_from).resolve()) if placement_from is not None else None,
                "gpu_experts": gpu_experts}


def hybrid_setup(spec, policy: str, hw, host=None, *, batch: int = 1, context: int = 0, cpu_layers: int | str = "auto",
                 calibration: np.ndarray | None = None, gpu_experts: int | None = None, amx: bool = True,
                 workers: int | None = None) -> HybridSetup:
    """The placement (``moesim.placement.make_placement``, device memory from ``hw``) and the
    roofline expert times (``moesim.placement.expert_times`` on ``hw``'s link and ``host``)
    exactly as ``moesim.sim.hybrid.simulate_hybrid`` builds them, so the executor and the
    simulator start from the same placement and decide cpu-on-miss with the same figures.

    ``gpu_experts`` (KTransformers' ``--kt-num-gpu-experts``) sizes the device memory so
    that exactly that many routed experts fit beside the resident weights, the KV cache
    and the workspace (a small model on a real profile would otherwise hold every expert)."""
    from moesim.hardware import HostProfile, builtin_hosts, get_host
    from moesim.placement import cpu_layers as resolve_cpu_layers
    from moesim.placement import expert_times, make_placement

    pol = get_policy(policy)
    if not pol.cpu:
        raise MoesimError(f"policy {pol.name!r} computes no experts on the CPU")
    host_p = host if isinstance(host, HostProfile) else get_host(host, hw)
    mem = hw["device_memory_gb"] * 1e9
    if gpu_experts is not None:
        from moesim.placement import WORKSPACE_BYTES, kv_bytes

        if gpu_experts < 0:
            raise MoesimError(f"--gpu-experts must be >= 0, got {gpu_experts}")
        mem = spec.non_expert_bytes + kv_bytes(spec, batch, context) + WORKSPACE_BYTES + gpu_experts * spec.expert_bytes
    placement = make_placement(pol, spec, mem, batch=batch, context=context, cpu_layers_n=cpu_layers,
                               calibration=calibration)
    n_cpu = resolve_cpu_layers(spec, cpu_layers, mem, batch, context) if pol.cpu == "layers" else None
    times = expert_times(spec, hw, host_p, batch, amx)
    named = host_p.name if host_p.name.lower() in builtin_hosts() or not host_p.path else str(Path(host_p.path).resolve())
    return HybridSetup(placement, times, named, mem / 1e9, n_cpu, workers)


class Timer:
    """Wall-clock marks on CPU; CUDA events on the compute stream (read after the step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
            return e
        t = time.perf_counter()
        self.marks.append(t)
        return t

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class OffloadedDecoder:
    """Runs a model under a policy, with experts in host memory moved by ``transport``.

    ``policy`` is a simulator policy name; ``predictor`` feeds the prefetching policies:
    ``quasi`` (needs ``default_vectors`` [layers, experts, hidden]), ``stale``, or ``oracle``
    (``oracle_routes``: the true ids and gates of every step from an exact pre-pass; the
    ``oracle`` policy always uses it).

    ``copy_queue`` (``moesim.policy.QUEUES``) is the transport's discipline: ``fifo`` waits
    for a layer's whole prefetch; ``demand-first`` and ``cancel-unstarted`` need a
    :class:`QueuedEmulatedLink` and wait only for the prefetched copies the layer executes
    (up to the plan's ``prefetch_need``). A slot whose unneeded copy is still queued or
    copying is reused only after that copy ended (:meth:`_take_slot`).
    """

    def __init__(self, model: MoEModel, policy: str, transport, *, predictor: str = "quasi",
                 default_vectors: Tensor | None = None, cache_experts: int = 0, eviction: str = "lru",
                 batch: int = 1, estimator: tuple[torch.nn.Module, list[str]] | None = None,
                 hybrid: HybridSetup | None = None, expert_dtype: str | None = None,
                 prefetch_top: int | None = None, copy_queue: str = "fifo") -> None:
        self.model, self.policy, self.transport = model, get_policy(policy), transport
        if copy_queue not in QUEUES:
            raise MoesimError(f"unknown copy queue {copy_queue!r}; known: {', '.join(QUEUES)}")
        if copy_queue != "fifo" and self.policy.cpu:
            raise MoesimError(f"{self.policy.name} copies at most its misses; copy queues apply to the copy policies")
        if (copy_queue != "fifo") != isinstance(transport, QueuedEmulatedLink):
            raise MoesimError(f"copy queue {copy_queue}: the transport is {type(transport).__name__} "
                              "(make_transport(..., copy_queue) builds the matching one)")
        self.copy_queue = copy_queue
        self._copy_into: dict[int, Transfer] = {}  # queued link: slot -> the last copy issued into it
        self._retiring: list[int] = []  # queued link: freed slots whose copy has not ended yet
        self._unsettled: list[tuple[StepRecord, Transfer, float]] = []  # copies still queued at their step's end
        if prefetch_top is not None:
            k = model.spec.top_k
            if not self.policy.prefetch or self.policy.speculative:
                raise MoesimError(f"--prefetch-top applies to prefetch-fom and oracle (it cuts what is copied ahead; "
                                  f"{self.policy.name} {'executes the predicted experts' if self.policy.speculative else 'prefetches nothing'})")
            if isinstance(prefetch_top, bool) or not 1 <= prefetch_top <= k:
                raise MoesimError(f"--prefetch-top must be an integer from 1 to top_k ({k}), got {prefetch_top!r}")
        self.prefetch_top = prefetch_top  # prefetch only each sequence's first m predicted experts (most confident)
        if predictor not in PREDICTORS:
            raise MoesimError(f"unknown predictor {predictor!r}; known: {', '.join(PREDICTORS)}")
        if self.policy.oracle:
            predictor = "oracle"
        if self.policy.cpu:
            predictor = "none"  # the CPU-compute policies predict nothing (docs/policies.md)
        uses_dv, uses_est = predictor_inputs(self.policy.name, predictor)
        if self.policy.prefetch and uses_dv and default_vectors is None:
            raise MoesimError(f"the {predictor} predictor needs default vectors (moesim calibrate)")
        if self.policy.prefetch and uses_est and estimator is None:
            raise MoesimError(f"the {predictor} predictor needs a trained estimator (moesim train-estimator)")
        self.estimator = estimator
        self.predictor, self.dv = predictor, default_vectors
        self.can_predict = not self.policy.cpu and (predictor == "stale" or (default_vectors is not None and (
            predictor == "quasi" or (predictor in ("estimator", "hybrid") and estimator is not None))))
        s = model.spec
        if s.dense_layers and self.policy.offload and predictor in ("estimator", "hybrid"):
            # estimator.py pairs layer l's quasi-hidden state with layer l+1: not the next MoE layer
            raise MoesimError(f"the {predictor} predictor is not trained for models with dense layers ({s.name}); "
                              "use quasi or stale")
        self.layers = _Layers.of(s)
        p = model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.store = _ExpertStore(model, expert_dtype, self.device)
        cache_experts = cache_experts if self.policy.offload else 0
        self.hybrid = hybrid
        if self.policy.cpu:
            if hybrid is None:
                raise MoesimError(f"{self.policy.name} needs its placement and expert times (runtime.hybrid_setup)")
            self.planner = None
            self.hplanner = HybridPlanner(self.policy, s, hybrid.placement, cache_experts, eviction)
            self.host = self.store.host_pool(hybrid.workers)
            self._link_free = 0.0  # perf_counter() seconds when the link has copied everything issued
        else:
            self.planner = Planner(self.policy, cache_experts, eviction)
            self.hplanner = self.host = None
        n_slots = expert_slots(s, self.policy, cache_experts)  # what the what-if counts
        self.pool = torch.empty((n_slots, self.store.width), device=self.device, dtype=self.store.pool_dtype)
        self.free = list(range(n_slots))
        self.freed_after: dict[int, object] = {}  # CUDA: slot -> event after the last kernel that read it
        self.where: dict[tuple[int, int], int] = {}
        self.loaded: dict[int, list[int]] = defaultdict(list)
        self.oracle_routes: list[tuple[np.ndarray, np.ndarray]] | None = None  # per step (ids, gates) [M, B, k]
        self.timer = Timer(self.device)
        self.resident = self.store.host
        if not self.policy.offload:
            self.resident = [self.store.on_device(layer) for layer in range(s.n_layers)]  # resident means resident
        self.placed: dict[tuple[int, int], object] = {}  # static placements: (m, e) -> device weights
        if self.policy.cpu:
            self._place_static()

    def _place_static(self) -> None:
        """Before the first step (untimed, like loading the model): the static placement's
        resident experts go to the device; a warmed cpu-on-miss cache gets its experts
        copied into slots."""
        hp = self.hplanner
        if hp.cache is not None:
            warm = hp.cache.keys()  # a list (ExpertCache), coldest first
            for key in warm:
                slot = self.free.pop()
                src = self.store.src[self.layers.moe[key[0]]][key[1]]
                self.pool[slot, :src.numel()].copy_(src)
                self.where[key] = slot
            return
        for m, e in zip(*np.nonzero(hp.resident)):
            self.placed[(int(m), int(e))] = self.store.device_weight(self.layers.moe[int(m)], int(e))

    def close(self) -> None:
        """Stop the link (a queued link first finishes the copies it holds, so every
        recorded copy gets its times) and the host expert threads."""
        self.transport.close()
        self._settle()
        if self.host is not None:
            self.host.close()

    def _settle(self) -> None:
        """Times of copies that were still queued when their step ended (queued link):
        relative to their step's start once they have ended; a copy that never ran (the
        link stopped first) leaves its step's record."""
        waiting = []
        for rec, c, t0 in self._unsettled:
            if c.done.is_set():
                c.issue, c.start, c.end = c.issue - t0, c.start - t0, c.end - t0
            elif self.transport.closed():
                rec.copies.remove(c)
            else:
                waiting.append((rec, c, t0))
        self._unsettled = waiting

    # -- expert placement ---------------------------------------------------------------
    def _issue(self, m: int, experts: list[int], kind: int, out: list[Transfer]) -> None:
        """Copy ``experts`` of MoE layer ``m`` into free slots (records name the model layer)."""
        layer = self.layers.moe[m]
        src = self.store.src[layer]
        batch = []
        for e in experts:
            slot = self._take_slot()
            self.where[(m, e)] = slot
            self.loaded[m].append(e)
            t = Transfer(layer, e, src[e].numel() * src[e].element_size(), kind)
            if self.copy_queue != "fifo":
                self._copy_into[slot] = t
            batch.append((self.pool[slot, :src[e].numel()], src[e], t, self.freed_after.pop(slot, None)))
        out += self.transport.copy_batch(batch)

    def _take_slot(self) -> int:
        """A free slot. Under a queued copy discipline a released slot may still have an
        unneeded prefetch copy queued or copying into it: it is reused once that copy has
        ended, waiting for the oldest such copy when no other slot is free (the device
        memory the discipline really needs; ``expert_slots`` sizes the pool for FIFO)."""
        if not self.free and self._retiring:
            self._reclaim()
            if not self.free:
                self.transport.wait([self._copy_into[self._retiring[0]]])
                self._reclaim()
        if not self.free:
            raise RuntimeError("expert slot pool exhausted (planner and pool disagree)")
        return self.free.pop()

    def _free_slot(self, slot: int) -> None:
        t = self._copy_into.get(slot)
        if t is not None and not t.cancelled and not t.done.is_set():
            self._retiring.append(slot)
        else:
            self.free.append(slot)

    def _reclaim(self) -> None:
        done = [s for s in self._retiring if self._copy_into[s].done.is_set()]
        self._retiring = [s for s in self._retiring if s not in done]
        self.free += done

    def _weights(self, m: int) -> dict[int, object] | list:
        """MoE layer ``m``'s experts on the device: resident, placed, or in slots (a packed
        quantised expert is read through views of its slot)."""
        if not self.policy.offload:
            return self.resident[self.layers.moe[m]]
        layer = self.layers.moe[m]
        w = {e: self.store.view(layer, e, self.pool[slot]) for (lay, e), slot in self.where.items() if lay == m}
        w.update({e: v for (lay, e), v in self.placed.items() if lay == m})
        return w

    def _release(self, m: int, evicted: list[tuple[int, int]]) -> None:
        """Return the slots the planner no longer needs. On CUDA a slot is reused only after
        the kernels that read it (queued on the compute stream) are done: the next copy
        into it waits on this event."""
        cache = self.planner.cache
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        freed = [self.where.pop((m, e)) for e in self.loaded.pop(m, [])
                 if cache is None or (m, e) not in cache]
        freed += [self.where.pop(key) for key in evicted if key in self.where]
        for slot in freed:
            if done is not None:
                self.freed_after[slot] = done
            self._free_slot(slot)

    # -- prediction -----------------------------------------------------------------------
    def _predict(self, layer: int, nxt_layer: int, resid: Tensor, x: Tensor, ids: Tensor,
                 gates: Tensor) -> tuple[Tensor, Tensor]:
        """Predicted (ids, gates) of the next MoE layer (model layer ``nxt_layer``) from
        model layer ``layer``'s state."""
        nxt = self.model.layers[nxt_layer]
        if self.predictor == "stale":
            return self.model.route(nxt.router_logits(x), nxt_layer)
        q = quasi_hidden(self.model, layer, resid, ids, gates, self.dv, nxt_layer)
        use = self.predictor if self.predictor != "hybrid" else self.estimator[1][layer]
        if use == "estimator":
            return self.model.route(self.estimator[0](q.to(self.est_dtype), layer), nxt_layer)
        return self.model.route(nxt.router_logits(q), nxt_layer)

    def _predict_next(self, st: _StepState, m: int, resid: Tensor, x: Tensor, ids: Tensor,
                      gates: Tensor) -> tuple[Tensor, Tensor] | None:
        """The next MoE layer's (``m + 1``) predicted (ids, gates) on the device, or None.
        Offloading policies all run the predictor: prefetchers use it, on-demand records it
        (its cost stays in attn_s) so its trace can predict the prefetching policies.
        Verification brings its own predictions; prefill predicts nothing."""
        nxt = self.layers.next_moe(m)
        if st.predicted is not None or st.prefill or nxt is None:
            return None
        if not (self.policy.offload and (self.policy.prefetch or self.can_predict)):
            return None
        if self.predictor == "oracle":
            ids_o, gates_o = self.oracle_routes[st.step_index]
            return (torch.as_tensor(ids_o[nxt].astype(np.int64), device=self.device),
                    torch.as_tensor(gates_o[nxt], device=self.device))
        return self._predict(self.layers.moe[m], self.layers.moe[nxt], resid, x, ids, gates)

    @property
    def est_dtype(self) -> torch.dtype:
        return next(self.estimator[0].parameters()).dtype

    # -- one step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: Tensor, cache, pos: int, step_index: int = 0, prefill: bool = False,
             tree: TreeMask | None = None, predicted: list[list[int]] | None = None) -> StepRecord:
        """Run ``tokens`` [B, t] at position ``pos``: one decode step (t = 1), or the prefill
        of a prompt (``prefill``: no prediction; each layer copies the union of the experts
        the prompt routes to, which for a long prompt is nearly the whole layer), or the
        verification of a candidate tree (``tree``; ``predicted``: per MoE layer, the union of
        the experts predicted for its tokens, which prefetching policies copy ahead).

        The model's own layer pass runs the step; this decoder only supplies the expert
        hook (:meth:`_layer_experts`), so the block is the same one every other caller runs."""
        m = self.model
        if predicted is not None and len(predicted) != m.spec.n_moe_layers:
            raise MoesimError(f"predicted experts are given for {len(predicted)} layers; {m.spec.name} has "
                              f"{m.spec.n_moe_layers} MoE layers")
        st = self._begin_step(tokens.numel(), step_index, prefill, predicted)
        h = m.embed_tokens(tokens)  # [B, t, hidden]
        st.t_embed = st.t_layer = self.timer.mark()
        h = m.blocks(h, lambda *a: self._layer_experts(st, *a), cache, pos, tree,
                     after=lambda layer: self._dense_end(st, layer))
        hn = m.norm(h)  # [B, t, hidden]
        if tree is not None:
            st.rec.all_logits = m.lm_head(hn)  # [B, t, vocab]
            logits = st.rec.all_logits[:, -1]
        else:
            logits = m.lm_head(hn)[:, -1]  # [B, vocab]
        self._end_step(st, self.timer.mark())
        st.rec.logits = logits
        return st.rec

    def _begin_step(self, rows: int, step_index: int, prefill: bool, predicted) -> _StepState:
        tm = self.timer
        tm.marks.clear()
        t_start = tm.mark()
        if isinstance(self.transport, CudaTransport):
            self.transport.start_step(t_start)
        s = self.model.spec
        L, M = s.n_layers, s.n_moe_layers
        shape = (M, rows, s.top_k)
        rec = StepRecord(np.full(shape, -1, np.int16), np.zeros(shape, np.float32), np.full(shape, -1, np.int16),
                         np.zeros(shape, np.float32), np.full(shape, -1, np.int16), np.zeros(L), np.zeros(M), np.zeros(M),
                         np.zeros(L))
        if self.hplanner is not None:
            rec.cpu_s, rec.cpu_wait_s, rec.cpu_experts = np.zeros(M), np.zeros(M), np.zeros(M, np.int32)
        return _StepState(rec, step_index, prefill, predicted, t_start)

    def _dense_end(self, st: _StepState, layer: int) -> None:
        """End of a block: a dense layer's whole time (attention and MLP) is its attn_s."""
        if layer not in self.layers.index:
            t = self.timer.mark()
            st.dense_marks.append((layer, st.t_layer, t))
            st.t_layer = t

    def _layer_experts(self, st: _StepState, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor:
        """The expert hook of one MoE layer (model layer ``layer``): route, predict the next
        MoE layer, sync once, plan and issue copies, wait for this layer's, run the executed
        experts. ``x``, ``resid`` [rows, hidden]; ``logits`` [rows, experts]. Marks: attn_s
        runs from the end of the previous layer (its attention, router, prediction,
        planning) to t1; stall_s t1-t2; expert_s t2-t3."""
        if self.hplanner is not None:
            return self._hybrid_layer(st, layer, x, logits)
        tm = self.timer
        m = self.layers.index[layer]
        ids, gates = self.model.route(logits, layer)  # [rows, k] each, on the device
        pred_here, pred_here_host = st.pred_next, st.pred_next_host
        tp0 = tm.mark()
        st.pred_next = self._predict_next(st, m, resid, x, ids, gates)
        tp1 = tm.mark()
        true_host, st.pred_next_host = self._to_host(ids, st.pred_next)
        self._record_routing(st, m, true_host, gates, pred_here, pred_here_host)
        plan, demand, prefetch = self._plan_copies(st, m, true_host, pred_here_host)
        t1 = tm.mark()
        self.transport.wait(st.pending + demand)  # fifo; a queued link: the needed prefix (_plan_copies)
        t2 = tm.mark()
        speculative = self.policy.speculative and pred_here is not None and st.predicted is None
        run_ids, run_gates = (pred_here_host, pred_here[1]) if speculative else (true_host, gates)
        st.rec.exec_ids[m] = run_ids
        y = self.store.mix(x, run_ids, run_gates, self._weights(m))  # [rows, hidden]
        t3 = tm.mark()
        _, evicted = self.planner.finish(m, plan)
        self._release(m, evicted)
        st.rec.copies += demand + prefetch
        st.pending = prefetch
        st.marks.append((st.t_layer, t1, t2, t3, tp0, tp1, t3))
        st.t_layer = t3
        return y

    def _hybrid_layer(self, st: _StepState, layer: int, x: Tensor, logits: Tensor) -> Tensor:
        """The expert hook under a CPU-compute policy (MoE layer of model layer ``layer``).

        Route; one host sync for the ids; the shared :class:`~moesim.placement.HybridPlanner`
        splits the routed experts into those the device holds and misses; cpu-on-miss asks
        :func:`~moesim.policy.cpu_or_copy` (with this decoder's link queue) how many misses
        to copy, heaviest first, as the simulator does; the CPU's share is submitted to the
        host pool, then the device waits for its copies and runs its share while the CPU
        works; the layer ends when both are done. Marks: attn_s to t1 (routing, the sync,
        the decision, issuing copies and the CPU job), stall_s t1-t2, expert_s t2-t3 (the
        device's experts), cpu_wait_s t3-t4 (the CPU result past the device's end); cpu_s
        from t1 to the last CPU expert's end (what the CPU adds past attn_s, as the step
        model counts it: the hand-off before t1 is in attn_s)."""
        tm, rec = self.timer, st.rec
        m = self.layers.index[layer]
        ids, gates = self.model.route(logits, layer)  # [rows, k] each, on the device
        tp = tm.mark()
        ids_host = ids.cpu().numpy()  # the one host synchronisation of the layer
        self._record_routing(st, m, ids_host, gates, None, None)
        count: dict[int, int] = {}
        for e in ids_host.reshape(-1).tolist():
            count[e] = count.get(e, 0) + 1
        routed = sorted(count, key=lambda e: (-count[e], e))  # heaviest first, as moesim.sim.hybrid.routed_sets
        hits, misses = self.hplanner.split(m, routed)
        copied: list[int] = []
        demand: list[Transfer] = []
        if self.hplanner.copies and misses:
            now, times = time.perf_counter(), self.hybrid.times
            c = cpu_or_copy([count[e] for e in misses], sum(count[e] for e in hits), len(hits), now=now,
                            link_free=self._link_free, times=times)
            copied = misses[:c]
            if c:
                self._link_free = max(self._link_free, now) + c * times.copy
                self._issue(m, copied, 1, demand)
        on_cpu = [e for e in misses if e not in copied]
        job = self.host.submit(layer, x, ids_host, gates, on_cpu) if on_cpu else None
        t1 = tm.mark()
        cpu_from = time.perf_counter()  # the step model starts a layer's CPU share where its attn_s ends
        self.transport.wait(demand)
        t2 = tm.mark()
        weights = self._weights(m)
        y = self.store.mix_subset(x, ids_host, gates, weights, hits + copied)  # [rows, hidden]
        t3 = tm.mark()
        if job is not None:
            y = y + job.result()
        t4 = tm.mark()
        rec.exec_ids[m] = ids_host
        rec.cpu_experts[m] = len(on_cpu)
        rec.cpu_s[m] = max(job.ended - cpu_from, 0.0) if job is not None else 0.0
        self.hplanner.finish(m, hits, copied)
        self._release_hybrid(m)
        rec.copies += demand
        st.marks.append((st.t_layer, t1, t2, t3, tp, tp, t4))
        st.t_layer = t4
        return y

    def _release_hybrid(self, m: int) -> None:
        """cpu-on-miss: free the slots of experts the cache does not hold after layer ``m``
        (copied misses it did not admit, and its evictions, of any layer). On CUDA a freed
        slot is reused only after the kernels that read it (as :meth:`_release`)."""
        cache = self.hplanner.cache
        if cache is None:
            return
        gone = [key for key in self.where if key not in cache]
        if not gone:
            return
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        for key in gone:
            slot = self.where.pop(key)
            if done is not None:
                self.freed_after[slot] = done
            self.free.append(slot)
        self.loaded.pop(m, None)

    @staticmethod
    def _to_host(ids: Tensor, pred: tuple[Tensor, Tensor] | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The one host synchronisation of a layer: true ids and the next layer's predicted
        ids in one device-to-host copy (the host plans the copies)."""
        k = ids.shape[1]
        host = (torch.cat([ids, pred[0]], 1) if pred is not None else ids).cpu().numpy()
        return host[:, :k], (host[:, k:] if pred is not None else None)

    @staticmethod
    def _record_routing(st: _StepState, m: int, true_host: np.ndarray, gates: Tensor, pred: tuple | None,
                        pred_host: np.ndarray | None) -> None:
        """Ids go into the record now (MoE layer ``m``); gates stay on the device until the step's end."""
        st.rec.true_ids[m] = true_host
        st.true_gates.append(gates)
        if pred is not None:
            st.rec.pred_ids[m] = pred_host
            st.pred_gates[m] = pred[1]

    def _plan_copies(self, st: _StepState, m: int, true_host: np.ndarray, pred_here_host: np.ndarray | None):
        """Ask the shared planner (which, as in the simulator, indexes MoE layers), then
        issue MoE layer ``m``'s on-demand copies and the next MoE layer's prefetch.
        Returns (plan, demand copies, prefetch copies)."""
        if pred_here_host is not None and self.prefetch_top:
            pred_here_host = pred_here_host[:, :self.prefetch_top]  # what was prefetched for this layer
        here = _union(pred_here_host) if pred_here_host is not None else None
        if st.predicted is not None:
            here = st.predicted[m] if m > 0 else None
        plan = self.planner.route(m, _union(true_host), here)
        if self.copy_queue != "fifo":
            self._trim_pending(st, plan.prefetch_need)
        demand: list[Transfer] = []
        self._issue(m, list(plan.demand), 1, demand)
        prefetch: list[Transfer] = []
        nxt = self.layers.next_moe(m)
        if st.pred_next_host is not None:
            ahead = st.pred_next_host[:, :self.prefetch_top] if self.prefetch_top else st.pred_next_host
            self._issue(nxt, self.planner.prefetch(nxt, _union(ahead)), 0, prefetch)
        elif st.predicted is not None and nxt is not None:
            self._issue(nxt, self.planner.prefetch(nxt, st.predicted[nxt]), 0, prefetch)
        return plan, demand, prefetch

    def _trim_pending(self, st: _StepState, need: int) -> None:
        """Queued link, at the layer's router: wait only for the prefetch's first ``need``
        copies (those up to the last expert the layer executes); ``cancel-unstarted`` drops
        the unstarted rest, which then never moved a byte and leave the record."""
        rest, st.pending = st.pending[need:], st.pending[:need]
        if self.copy_queue != "cancel-unstarted" or not rest:
            return
        for t in self.transport.cancel(rest):
            st.rec.copies.remove(t)
            m = self.layers.index[t.layer]
            self.loaded[m].remove(t.expert)
            self.free.append(self.where.pop((m, t.expert)))

    def _end_step(self, st: _StepState, t_end) -> None:
        """Copy the step's gates to the host (once), then turn marks into seconds: on CUDA
        after the step's last event has completed."""
        rec, tm = st.rec, self.timer
        rec.true_gates[:] = torch.stack(st.true_gates).float().cpu().numpy()
        for layer, g in st.pred_gates.items():
            rec.pred_gates[layer] = g.float().cpu().numpy()
        if tm.cuda:
            t_end.synchronize()
            self.transport.finish_step(rec.copies)
        for m, (t0, t1, t2, t3, tp0, tp1, t4) in enumerate(st.marks):
            layer = self.layers.moe[m]
            rec.predict_s[layer] = tm.seconds(tp0, tp1)
            rec.attn_s[layer] = tm.seconds(t0, t1)
            rec.stall_s[m] = tm.seconds(t1, t2)
            rec.expert_s[m] = tm.seconds(t2, t3)
            if rec.cpu_wait_s is not None:
                rec.cpu_wait_s[m] = tm.seconds(t3, t4)
        for layer, t0, t1 in st.dense_marks:
            rec.attn_s[layer] = tm.seconds(t0, t1)
        rec.other_s = tm.seconds(st.t_start, st.t_embed) + tm.seconds(st.t_layer, t_end)
        rec.tpot_s = tm.seconds(st.t_start, t_end)
        if not tm.cuda:
            for c in rec.copies:
                if c.done.is_set():
                    c.issue, c.start, c.end = c.issue - st.t_start, c.start - st.t_start, c.end - st.t_start
                else:  # a queued link still holds it (only prefetch copies the step did not wait for)
                    self._unsettled.append((rec, c, st.t_start))
            self._settle()


@dataclass
class _StepState:
    """What the layer hook threads from one layer to the next within a step."""

    rec: StepRecord
    step_index: int
    prefill: bool
    predicted: list[list[int]] | None  # per MoE layer, a verification pass's predicted union
    t_start: object
    t_embed: object = None
    t_layer: object = None  # mark where the current layer began (the previous layer's end)
    true_gates: list[Tensor] = field(default_factory=list)  # kept on the device, copied once at the end
    pred_gates: dict[int, Tensor] = field(default_factory=dict)
    pending: list[Transfer] = field(default_factory=list)  # the current layer's prefetched copies
    pred_next: tuple[Tensor, Tensor] | None = None
    pred_next_host: np.ndarray | None = None
    marks: list = field(default_factory=list)  # per MoE layer (t0, t1, t2, t3, tp0, tp1, t4)
    dense_marks: list = field(default_factory=list)  # per dense layer (layer, start, end)


class _ExpertStore:
    """Where the routed experts' weights come from, in one of two representations.

    Dense: the model's flat ``[gate; up; down]`` host buffers (``executor.model``).
    Quantised (``expert_dtype`` int8 / int4-g32 / int4-g128): each expert quantised once on
    the host (``executor.quant_experts``) and packed into one uint8 buffer of exactly the
    byte accounting's size (``moesim.models``): that buffer is what a copy moves, and a
    device slot holding it is read through views (dequantise-and-multiply). ``host`` feeds
    the CPU experts, ``src`` the copies, ``view``/``mix`` the device."""

    def __init__(self, model: MoEModel, expert_dtype: str | None, device: torch.device) -> None:
        s = model.spec
        self.model, self.device, self.fmt = model, device, expert_dtype
        self.hidden, self.inter = s.hidden, s.expert_inter
        if expert_dtype is None:
            self.host = model.experts
            self.src = model.experts
            self.width, self.pool_dtype = s.expert_weights, model.embed_tokens.weight.dtype
            return
        from moesim.executor.quant_experts import quantize_experts

        self.host = quantize_experts(model.experts, s.hidden, s.expert_inter, expert_dtype)
        pin = device.type == "cuda"
        self.src = [[q.pack().pin_memory() if pin else q.pack() for q in row] for row in self.host]
        # A slot starts on a 16-byte boundary, so the packed fp16 scales keep their alignment
        # in every slot (a dtype view needs it); copies move the packed bytes only.
        self.width = -(-next(len(row[0]) for row in self.src if row) // 16) * 16
        self.pool_dtype = torch.uint8

    def view(self, layer: int, e: int, buf: Tensor):
        """Expert ``e`` of model layer ``layer`` read from ``buf`` (a slot or a device copy)."""
        return buf if self.fmt is None else self.host[layer][e].view(buf)

    def device_weight(self, layer: int, e: int):
        """A device copy of one expert (placing it, untimed)."""
        return self.view(layer, e, self.src[layer][e].to(self.device))

    def on_device(self, layer: int) -> list:
        """Every expert of ``layer`` on the device (all-resident); the host buffers
        themselves when they already are there (CPU)."""
        row = self.src[layer]
        if self.fmt is None and (not row or row[0].device == self.device):
            return row
        return [self.device_weight(layer, e) for e in range(len(row))]

    def host_pool(self, workers: int | None):
        from moesim.executor.host_experts import HostExperts

        if self.fmt is None:
            return HostExperts(self.hidden, self.inter, weights=self.host, workers=workers)
        return HostExperts(self.hidden, self.inter, workers=workers,
                           expert_fn=lambda layer, e, x: self.host[layer][e].forward(x))

    def forward(self, w, x: Tensor) -> Tensor:
        if self.fmt is None:
            return expert_forward(w.to(x.device), x, self.hidden, self.inter)
        return w.forward(x).to(x.dtype)

    def mix(self, x: Tensor, ids: np.ndarray, gates: Tensor, weights) -> Tensor:
        """All of a layer's executed experts (``executor.model.mix_experts`` for dense ones)."""
        if self.fmt is None:
            return mix_experts(x, ids, gates, weights, self.hidden, self.inter)
        from moesim.executor.quant_experts import mix_quant

        return mix_quant(x, ids, gates, weights)

    def mix_subset(self, x: Tensor, ids: np.ndarray, gates: Tensor, weights, experts: list[int]) -> Tensor:
        """The gated sum over the (row, slot) pairs routed to ``experts`` only (the device's
        share of a layer split with the CPU), experts in increasing id order."""
        out = torch.zeros_like(x)
        for e in sorted(experts):
            rows, cols = np.nonzero(ids == e)
            r = torch.from_numpy(rows.astype(np.int64)).to(x.device)
            c = torch.from_numpy(cols.astype(np.int64)).to(x.device)
            y = self.forward(weights[e], x[r])  # [n_e, hidden]
            out.index_add_(0, r, y * gates[r, c, None].to(y.dtype))
        return out


def _union(ids: np.ndarray) -> list[int]:
    return list(dict.fromkeys(int(e) for e in ids.reshape(-1) if e >= 0))


def make_transport(device: torch.device, link_bw: float, latency: float, copy_queue: str = "fifo"):
    """CUDA: the real link. CPU: an emulated link paced to ``link_bw`` B/s and ``latency`` s,
    FIFO or, for the other ``copy_queue`` disciplines, demand-first with cancellation."""
    if copy_queue not in QUEUES:
        raise MoesimError(f"unknown copy queue {copy_queue!r}; known: {', '.join(QUEUES)}")
    if device.type == "cuda":
        if copy_queue != "fifo":
            raise MoesimError(f"--copy-queue {copy_queue} runs on the emulated link only (--device cpu): a CUDA copy "
                              "stream copies in the order queued and cannot withdraw a copy")
        return CudaTransport(device)
    return QueuedEmulatedLink(link_bw, latency) if copy_queue != "fifo" else EmulatedLink(link_bw, latency)
