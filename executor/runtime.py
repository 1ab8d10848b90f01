"""Offloaded decoding: the model, a transport and the shared policy decisions, timed.

Experts live in host memory (pinned on CUDA); non-expert weights on the device. A pool of
device expert slots holds, at any moment, the current layer's experts, the next layer's
prefetched experts and the cross-token cache. What to copy, execute and keep is decided
by :class:`moesim.policy.Planner`, the same object the simulator times.

Per MoE layer ``l`` of a step (batch rows decode one token each; dense layers, such as
DeepSeek's leading ones or Qwen2-MoE's ``mlp_only_layers``, run resident and are only
timed; "layer ``l+1``" below is the NEXT MoE layer):

The layer pass is the model's own (:meth:`MoEModel.forward`); the decoder supplies its
:class:`~moesim.executor.model.Hooks` (the expert hook that does steps 1-4 below, split
into small methods: prediction, the host sync, planning and copies, the step's timing).
With ``lookahead`` N (``moesim profile --lookahead``) "layer ``l+1``" below is MoE layer
``l+N``: its prefetch is issued at layer ``l``'s router (``Planner.prefetch_target``), the
decoder waits for it at layer ``l+N`` and keeps its slots until that layer ran; the first
N MoE layers of a step load on demand.

1. attention, router (true top-k), and the prediction for layer ``l+1``:
   ``quasi`` applies layer l+1's router to ``LN_{l+1}(r_l + d_l)`` with default vectors
   (lookahead N: the state carried through the MoE layers between, each routing it with
   its own router and adding its default vectors, :func:`~moesim.executor.model.quasi_hidden`),
   ``stale`` applies it to layer l's own router input, ``oracle`` reads the true ids of a
   routing pre-pass;
2. one device-to-host copy of (true ids, predicted ids) - the only host synchronisation
   of a layer, needed because the host plans the copies;
3. issue layer ``l``'s on-demand copies, then layer ``l+1``'s prefetch;
4. wait for layer ``l``'s copies (on CUDA the compute stream waits on events) and run
   the executed experts (the prediction, with its gates, under speculative execution).

The CPU-compute policies (``cpu-static``, ``hot-experts``, ``cpu-on-miss``) run each MoE
layer through :meth:`OffloadedDecoder._host_layer` instead: the device's share from its
slots, the CPU's on the host pool (:class:`~moesim.executor.host_experts.HostExperts`).

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

from moesim.costmodel import ExpertTimes
from moesim.errors import MoesimError
from moesim.executor.host_experts import HostExperts
from moesim.executor.model import Hooks, MoEModel, TreeMask, expert_fn_for, mix_experts, quasi_hidden
from moesim.executor.quant_experts import quantize_experts
from moesim.executor.transport import CudaTransport, EmulatedLink, QueuedEmulatedLink, Transfer
from moesim.hardware import HostProfile, builtin_hosts, get_host
from moesim.memory import device_bytes
from moesim.policy import QUEUES, Planner, check_lookahead, cpu_or_copy, expert_slots, get_policy
from moesim.policy.placement import HostPlanner, Placement, expert_times, make_placement
from moesim.policy.placement import cpu_layers as resolve_cpu_layers
from moesim.setting import DEFAULT_SETTING, Setting

PREDICTORS = ("quasi", "stale", "oracle", "estimator", "hybrid")


def predictor_inputs(policy: str, predictor: str) -> tuple[bool, bool]:
    """What ``predictor`` reads under ``policy``: (default vectors, a trained estimator).

    Nothing is predicted without offloading, and the oracle policy reads true ids. Every
    other offloading policy predicts, on-demand too (its trace records the predictions so
    that it can stand in for the prefetching policies); only a prefetching policy cannot
    run without them (checked in :class:`OffloadedDecoder`)."""
    if not get_policy(policy).records_predictions:  # the CPU-compute policies predict nothing
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
class HostSetup:
    """What a CPU-compute policy needs beyond a copy policy: the static placement it starts
    from (None: cpu-on-miss with a cold cache) and the expert times cpu-on-miss decides
    with. Built by :func:`host_setup` from the same functions the simulator calls."""

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


def host_setup(spec, policy: str, hw, s: Setting = DEFAULT_SETTING, *, batch: int = 1, context: int = 0,
               gpu_experts: int | None = None, workers: int | None = None) -> HostSetup:
    """The placement (``moesim.policy.placement.make_placement``, device memory from ``hw``) and the
    roofline expert times (``moesim.policy.placement.expert_times`` on ``hw``'s link and ``s.host``)
    exactly as ``moesim.sim.cpu_compute.simulate_cpu_compute`` builds them from the same
    :class:`~moesim.setting.Setting` (its ``host``, ``cpu_layers``, ``calibration`` and
    ``amx``), so the executor and the simulator start from the same placement and decide
    cpu-on-miss with the same figures.

    ``gpu_experts`` (KTransformers' ``--kt-num-gpu-experts``) sizes the device memory so
    that exactly that many routed experts fit beside the resident weights, the KV cache
    and the workspace (a small model on a real profile would otherwise hold every expert)."""
    pol = get_policy(policy)
    if not pol.uses_host:
        raise MoesimError(f"policy {pol.name!r} computes no experts on the CPU")
    host, cpu_layers, calibration, amx = s.host, s.cpu_layers, s.calibration, s.amx
    host_p = host if isinstance(host, HostProfile) else get_host(host, hw)
    mem = hw["device_memory_gb"] * 1e9
    if gpu_experts is not None:
        if gpu_experts < 0:
            raise MoesimError(f"--gpu-experts must be >= 0, got {gpu_experts}")
        mem = device_bytes(spec, pol, resident_experts=gpu_experts, batch=batch, context=context)  # the one fit
    placement = make_placement(pol, spec, mem, batch=batch, context=context, cpu_layers_n=cpu_layers,
                               calibration=calibration)
    n_cpu = resolve_cpu_layers(spec, cpu_layers, mem, batch, context) if "--cpu-layers" in pol.knobs else None
    times = expert_times(spec, hw, host_p, batch, amx)
    named = host_p.name if host_p.name.lower() in builtin_hosts() or not host_p.path else str(Path(host_p.path).resolve())
    return HostSetup(placement, times, named, mem / 1e9, n_cpu, workers)


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


@dataclass(frozen=True)
class Offload:
    """How an :class:`OffloadedDecoder` keeps its offloaded experts: a cross-token cache of
    ``cache_experts`` with ``eviction``, the link's ``copy_queue``, prefetches ``lookahead``
    MoE layers ahead of at most ``prefetch_top`` predicted experts a sequence, and the routed
    experts stored as ``expert_dtype`` (None: the model's own), each described on the class."""

    cache_experts: int = 0
    eviction: str = "lru"
    copy_queue: str = "fifo"
    lookahead: int = 1
    prefetch_top: int | None = None
    expert_dtype: str | None = None


PLAIN = Offload()  # no cache, FIFO copies one layer ahead, the model's own expert format


@dataclass(frozen=True)
class Origin:
    """Where a recorded run came from, as its trace's header says: the ``device`` it ran on,
    whether its model is ``synthetic`` (random weights), the model's ``source`` (a path or a
    name) and, for speculative decoding, the ``draft``'s."""

    device: str
    synthetic: bool
    source: str
    draft: str | None = None


class OffloadedDecoder:
    """Runs a model under a policy, with experts in host memory moved by ``transport`` and
    kept as ``offload`` says (:class:`Offload`).

    ``policy`` is a simulator policy name; ``predictor`` feeds the prefetching policies:
    ``quasi`` (needs ``default_vectors`` [layers, experts, hidden]), ``stale``, or ``oracle``
    (``oracle_routes``: the true ids and gates of every step from an exact pre-pass; the
    ``oracle`` policy always uses it).

    ``lookahead`` N (prefetching policies): MoE layer ``m``'s router predicts and prefetches
    MoE layer ``m + N`` (the shared planner's ``prefetch_target``); ``estimator`` and
    ``hybrid`` are trained one layer ahead and refuse N > 1.

    ``copy_queue`` (``moesim.policy.QUEUES``) is the transport's discipline: ``fifo`` waits
    for a layer's whole prefetch; ``demand-first`` and ``cancel-unstarted`` need a
    :class:`QueuedEmulatedLink` and wait only for the prefetched copies the layer executes
    (up to the plan's ``prefetch_need``). A slot whose unneeded copy is still queued or
    copying is reused only after that copy ended (:meth:`_take_slot`).

    ``host_setup`` (:func:`host_setup`): the CPU-compute policies' placement and expert times.
    """

    def __init__(self, model: MoEModel, policy: str, transport, offload: Offload = PLAIN, *,
                 predictor: str = "quasi", default_vectors: Tensor | None = None, batch: int = 1,
                 estimator: tuple[torch.nn.Module, list[str]] | None = None,
                 host_setup: HostSetup | None = None) -> None:
        cache_experts, eviction, copy_queue = offload.cache_experts, offload.eviction, offload.copy_queue
        lookahead, prefetch_top, expert_dtype = offload.lookahead, offload.prefetch_top, offload.expert_dtype
        self.model, self.policy, self.transport = model, get_policy(policy), transport
        s = model.spec
        if copy_queue not in QUEUES:
            raise MoesimError(f"unknown copy queue {copy_queue!r}; known: {', '.join(QUEUES)}")
        if copy_queue != "fifo" and self.policy.uses_host:
            raise MoesimError(f"{self.policy.name} copies at most its misses; copy queues apply to the copy policies")
        if (copy_queue != "fifo") != isinstance(transport, QueuedEmulatedLink):
            raise MoesimError(f"copy queue {copy_queue}: the transport is {type(transport).__name__} "
                              "(make_transport(..., copy_queue) builds the matching one)")
        self.lookahead = check_lookahead_for(self.policy, lookahead, s.n_moe_layers, predictor)
        self.copy_queue = copy_queue
        self._copy_into: dict[int, Transfer] = {}  # queued link: slot -> the last copy issued into it
        self._retiring: list[int] = []  # queued link: freed slots whose copy has not ended yet
        self._unsettled: list[tuple[StepRecord, Transfer, float]] = []  # copies still queued at their step's end
        check_prefetch_top(self.policy, prefetch_top, s.top_k)
        self.prefetch_top = prefetch_top  # prefetch only each sequence's first m predicted experts (most confident)
        if predictor not in PREDICTORS:
            raise MoesimError(f"unknown predictor {predictor!r}; known: {', '.join(PREDICTORS)}")
        predictor = self.policy.predictor(predictor)  # the oracle's truth; nothing for the CPU-compute families
        uses_dv, uses_est = predictor_inputs(self.policy.name, predictor)
        if self.policy.prefetches and uses_dv and default_vectors is None:
            raise MoesimError(f"the {predictor} predictor needs default vectors (moesim calibrate)")
        if self.policy.prefetches and uses_est and estimator is None:
            raise MoesimError(f"the {predictor} predictor needs a trained estimator (moesim train-estimator)")
        self.estimator = estimator
        self.predictor, self.dv = predictor, default_vectors
        self.can_predict = not self.policy.uses_host and (predictor == "stale" or (default_vectors is not None and (
            predictor == "quasi" or (predictor in ("estimator", "hybrid") and estimator is not None))))
        if s.dense_layers and self.policy.copies_experts and predictor in ("estimator", "hybrid"):
            # estimator.py pairs layer l's quasi-hidden state with layer l+1: not the next MoE layer
            raise MoesimError(f"the {predictor} predictor is not trained for models with dense layers ({s.name}); "
                              "use quasi or stale")
        self.layers = _Layers.of(s)
        p = model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.store = _ExpertStore(model, expert_dtype, self.device)
        cache_experts = self.policy.cache_capacity(s, cache_experts=cache_experts)
        self.host_setup = host_setup
        if self.policy.uses_host:
            if host_setup is None:
                raise MoesimError(f"{self.policy.name} needs its placement and expert times (runtime.host_setup)")
            self.planner = None
            self.host_planner = HostPlanner(self.policy, s, host_setup.placement, cache_experts, eviction)
            self.host_pool = self.store.host_pool(host_setup.workers)
            self._link_free = 0.0  # perf_counter() seconds when the link has copied everything issued
        else:
            self.planner = Planner(self.policy, cache_experts, eviction, lookahead=self.lookahead)
            self.host_planner = self.host_pool = None
        n_slots = expert_slots(s, self.policy, cache_experts, self.lookahead)  # what the what-if counts
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
        if self.policy.uses_host:
            self._place_static()

    def _place_static(self) -> None:
        """Before the first step (untimed, like loading the model): the static placement's
        resident experts go to the device; a warmed cpu-on-miss cache gets its experts
        copied into slots."""
        hp = self.host_planner
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
        if self.host_pool is not None:
            self.host_pool.close()

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
        into it waits on this event. A prefetch in flight for a later layer keeps its
        slots until that layer ran (its ``loaded`` entry is its own)."""
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
    def _target(self, st: _StepState, m: int) -> int | None:
        """The MoE layer whose experts MoE layer ``m``'s router predicts, or None.
        Prefetching policies: the shared planner's ``prefetch_target`` (m + lookahead).
        On-demand predicts the next MoE layer too (its cost stays in attn_s) so that its
        trace can stand in for the prefetching policies. Verification brings its own
        predictions; prefill predicts nothing."""
        if st.predicted is not None or st.prefill or not self.policy.copies_experts:
            return None
        if self.policy.prefetches:
            return self.planner.prefetch_target(m, len(self.layers.moe))
        return m + 1 if self.can_predict and m + 1 < len(self.layers.moe) else None

    def _predict(self, st: _StepState, m: int, target: int, resid: Tensor, x: Tensor, ids: Tensor,
                 gates: Tensor) -> tuple[Tensor, Tensor]:
        """MoE layer ``target``'s predicted (ids, gates) on the device from MoE layer ``m``'s
        state: its router input ``x``, residual ``resid`` and routing (``ids``, ``gates``)."""
        if self.predictor == "oracle":
            ids_o, gates_o = self.oracle_routes[st.step_index]
            return (torch.as_tensor(ids_o[target].astype(np.int64), device=self.device),
                    torch.as_tensor(gates_o[target], device=self.device))
        layer, nxt_layer = self.layers.moe[m], self.layers.moe[target]
        router = self.model.layers[nxt_layer].mlp.gate
        if self.predictor == "stale":
            return self.model.route(router(x), nxt_layer)
        q = quasi_hidden(self.model, layer, resid, ids, gates, self.dv, nxt_layer, self.layers.moe[m + 1:target])
        use = self.predictor if self.predictor != "hybrid" else self.estimator[1][layer]
        if use == "estimator":
            return self.model.route(self.estimator[0](q.to(self.est_dtype), layer), nxt_layer)
        return self.model.route(router(q), nxt_layer)

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

        The model's own pass runs the step; this decoder only supplies its hooks (the expert
        hook :meth:`_layer_experts`, and the after-layer marks), so every block is the one
        every other caller runs."""
        s = self.model.spec
        if predicted is not None and len(predicted) != s.n_moe_layers:
            raise MoesimError(f"predicted experts are given for {len(predicted)} layers; {s.name} has "
                              f"{s.n_moe_layers} MoE layers")
        st = self._begin_step(tokens.numel(), step_index, prefill, predicted)
        hooks = Hooks(lambda *a: self._layer_experts(st, *a), lambda layer: self._layer_end(st, layer), tree,
                      "all" if tree is not None else "last")
        logits = self.model.forward(tokens, cache, pos, hooks)  # [B, t, vocab] for a tree, else [B, vocab]
        if tree is not None:
            st.rec.all_logits, logits = logits, logits[:, -1]
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
        if self.host_planner is not None:
            rec.cpu_s, rec.cpu_wait_s, rec.cpu_experts = np.zeros(M), np.zeros(M), np.zeros(M, np.int32)
        return _StepState(rec, step_index, prefill, predicted, t_start)

    def _layer_end(self, st: _StepState, layer: int) -> None:
        """After the embedding (-1): where the first layer's time starts. After a dense layer:
        its whole time (attention and MLP) is its attn_s."""
        if layer < 0:
            st.t_embed = st.t_layer = self.timer.mark()
        elif layer not in self.layers.index:
            t = self.timer.mark()
            st.dense_marks.append((layer, st.t_layer, t))
            st.t_layer = t

    def _layer_experts(self, st: _StepState, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor:
        """The expert hook of one MoE layer (model layer ``layer``): route, predict MoE layer
        ``target`` (m + lookahead), sync once, plan and issue copies, wait for this layer's,
        run the executed experts. ``x``, ``resid`` [rows, hidden]; ``logits`` [rows, experts].
        Marks: attn_s runs from the end of the previous layer (its attention, router,
        prediction, planning) to t1; stall_s t1-t2; expert_s t2-t3."""
        if self.host_planner is not None:
            return self._host_layer(st, layer, x, logits)
        tm = self.timer
        m = self.layers.index[layer]
        ids, gates = self.model.route(logits, layer)  # [rows, k] each, on the device
        here, here_host = st.predictions.pop(m, (None, None))  # made at MoE layer m - lookahead's router
        tp0 = tm.mark()
        target = self._target(st, m)
        pred = self._predict(st, m, target, resid, x, ids, gates) if target is not None else None
        tp1 = tm.mark()
        true_host, pred_host = self._to_host(ids, pred)
        if pred is not None:
            st.predictions[target] = (pred, pred_host)
        self._record_routing(st, m, true_host, gates, here, here_host)
        plan, pending, demand, prefetch = self._plan_copies(st, m, target, true_host, here_host, pred_host)
        t1 = tm.mark()
        self.transport.wait(pending + demand)  # fifo; a queued link: the needed prefix (_plan_copies)
        t2 = tm.mark()
        spec_exec = self.policy.executes_predicted and here is not None and st.predicted is None  # speculative execution
        run_ids, run_gates = (here_host, here[1]) if spec_exec else (true_host, gates)
        st.rec.exec_ids[m] = run_ids
        y = self.store.mix(x, run_ids, run_gates, self._weights(m))  # [rows, hidden]
        t3 = tm.mark()
        _, evicted = self.planner.finish(m, plan)
        self._release(m, evicted)
        st.rec.copies += demand + prefetch
        st.marks.append((st.t_layer, t1, t2, t3, tp0, tp1, t3))
        st.t_layer = t3
        return y

    def _host_layer(self, st: _StepState, layer: int, x: Tensor, logits: Tensor) -> Tensor:
        """The expert hook under a CPU-compute policy (MoE layer of model layer ``layer``): the
        one place where a layer is split between the device and the host CPU.

        Route; one host sync for the ids; the shared :class:`~moesim.policy.placement.HostPlanner`
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
        routed = sorted(count, key=lambda e: (-count[e], e))  # heaviest first, as moesim.sim.cpu_compute.routed_sets
        hits, misses = self.host_planner.split(m, routed)
        copied: list[int] = []
        demand: list[Transfer] = []
        if self.host_planner.copies and misses:
            now, times = time.perf_counter(), self.host_setup.times
            c = cpu_or_copy([count[e] for e in misses], sum(count[e] for e in hits), len(hits), now=now,
                            link_free=self._link_free, times=times)
            copied = misses[:c]
            if c:
                self._link_free = max(self._link_free, now) + c * times.copy
                self._issue(m, copied, 1, demand)
        on_cpu = [e for e in misses if e not in copied]
        job = self.host_pool.submit(layer, x, ids_host, gates, on_cpu) if on_cpu else None
        t1 = tm.mark()
        cpu_from = time.perf_counter()  # the step model starts a layer's CPU share where its attn_s ends
        self.transport.wait(demand)
        t2 = tm.mark()
        y = self.store.mix(x, ids_host, gates, self._weights(m), only=set(hits + copied))  # [rows, hidden]
        t3 = tm.mark()
        if job is not None:
            y = y + job.result()
        t4 = tm.mark()
        rec.exec_ids[m] = ids_host
        rec.cpu_experts[m] = len(on_cpu)
        rec.cpu_s[m] = max(job.ended - cpu_from, 0.0) if job is not None else 0.0
        self.host_planner.finish(m, hits, copied)
        self._release_host(m)
        rec.copies += demand
        st.marks.append((st.t_layer, t1, t2, t3, tp, tp, t4))
        st.t_layer = t4
        return y

    def _release_host(self, m: int) -> None:
        """cpu-on-miss: free the slots of experts the cache does not hold after layer ``m``
        (copied misses it did not admit, and its evictions, of any layer). On CUDA a freed
        slot is reused only after the kernels that read it (as :meth:`_release`)."""
        cache = self.host_planner.cache
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
        """The one host synchronisation of a layer: true ids and the predicted ids in one
        device-to-host copy (the host plans the copies)."""
        k = ids.shape[1]
        host = (torch.cat([ids, pred[0]], 1) if pred is not None else ids).cpu().numpy()
        return host[:, :k], (host[:, k:] if pred is not None else None)

    @staticmethod
    def _record_routing(st: _StepState, m: int, true_host: np.ndarray, gates: Tensor, pred: tuple | None,
                        pred_host: np.ndarray | None) -> None:
        """Ids go into the record now (MoE layer ``m``; ``pred``: the prediction FOR layer m,
        made lookahead layers earlier); gates stay on the device until the step's end."""
        st.rec.true_ids[m] = true_host
        st.true_gates.append(gates)
        if pred is not None:
            st.rec.pred_ids[m] = pred_host
            st.pred_gates[m] = pred[1]

    def _plan_copies(self, st: _StepState, m: int, target: int | None, true_host: np.ndarray,
                     here_host: np.ndarray | None, pred_host: np.ndarray | None):
        """Ask the shared planner (which, as in the simulator, indexes MoE layers), then
        issue MoE layer ``m``'s on-demand copies and MoE layer ``target``'s prefetch.
        Returns (plan, this layer's prefetched copies to wait for, demand copies, the
        prefetch just issued)."""
        if here_host is not None and self.prefetch_top:
            here_host = here_host[:, :self.prefetch_top]  # what was prefetched for this layer
        here = _union(here_host) if here_host is not None else None
        if st.predicted is not None:
            here = st.predicted[m] if self.planner.issue_layer(m) is not None else None
        plan = self.planner.route(m, _union(true_host), here)
        pending = st.pending.pop(m, [])
        if self.copy_queue != "fifo":
            pending = self._trim_pending(st, m, pending, plan.prefetch_need)
        demand: list[Transfer] = []
        self._issue(m, list(plan.demand), 1, demand)
        prefetch: list[Transfer] = []
        if pred_host is not None:
            ahead = pred_host[:, :self.prefetch_top] if self.prefetch_top else pred_host
            self._issue(target, self.planner.prefetch(target, _union(ahead)), 0, prefetch)
        elif st.predicted is not None:
            target = self.planner.prefetch_target(m, len(self.layers.moe))
            if target is not None:
                self._issue(target, self.planner.prefetch(target, st.predicted[target]), 0, prefetch)
        if prefetch:
            st.pending[target] = prefetch
        return plan, pending, demand, prefetch

    def _trim_pending(self, st: _StepState, m: int, pending: list[Transfer], need: int) -> list[Transfer]:
        """Queued link, at MoE layer ``m``'s router: wait only for its prefetch's first
        ``need`` copies (those up to the last expert the layer executes); ``cancel-unstarted``
        drops the unstarted rest, which then never moved a byte and leaves the record."""
        rest, keep = pending[need:], pending[:need]
        if self.copy_queue != "cancel-unstarted" or not rest:
            return keep
        for t in self.transport.cancel(rest):
            st.rec.copies.remove(t)
            self.loaded[m].remove(t.expert)
            self.free.append(self.where.pop((m, t.expert)))
        return keep

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


def check_prefetch_top(policy, prefetch_top: int | None, top_k: int) -> None:
    """``--prefetch-top`` (None: not given) checked for ``policy``: the executor cuts what an
    exact prefetching policy copies ahead (prefetch-fom, oracle), to 1 to ``top_k`` experts.
    One definition: ``moesim profile`` checks before the model loads, the decoder when built."""
    if prefetch_top is None:
        return
    pol = get_policy(policy)
    if not pol.prefetches or not pol.exact:
        why = "prefetches nothing" if not pol.prefetches else "executes the predicted experts"
        raise MoesimError(f"--prefetch-top applies to prefetch-fom and oracle (it cuts what is copied ahead; "
                          f"{pol.name} {why})")
    if isinstance(prefetch_top, bool) or not isinstance(prefetch_top, int) or not 1 <= prefetch_top <= top_k:
        raise MoesimError(f"--prefetch-top {prefetch_top!r}: an integer from 1 to top_k ({top_k})")


def check_lookahead_for(policy, lookahead: int, n_moe_layers: int, predictor: str = "quasi") -> int:
    """``lookahead`` if ``policy`` can run it, else one line: N > 1 needs a prefetching policy
    (it says how far ahead a prefetch is issued), leaves a MoE layer to prefetch, and a
    predictor that can look that far (the estimator and hybrid are trained one layer ahead)."""
    pol = get_policy(policy)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int):
        raise MoesimError(f"--lookahead must be a whole number of MoE layers, got {lookahead!r}")
    if lookahead == 1:
        return 1
    if not pol.prefetches:
        raise MoesimError(f"--lookahead applies to the prefetching policies (prefetch-fom, prefetch-spec, oracle), "
                          f"not {pol.name}: it says how many MoE layers ahead a prefetch is issued")
    check_lookahead(lookahead, n_moe_layers)
    if predictor in ("estimator", "hybrid") and pol.predicts:
        raise MoesimError(f"--lookahead {lookahead}: the {predictor} predictor is trained one MoE layer ahead; "
                          "use quasi, stale or oracle")
    return lookahead


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
    pending: dict[int, list[Transfer]] = field(default_factory=dict)  # MoE layer -> its prefetched copies in flight
    predictions: dict[int, tuple] = field(default_factory=dict)  # MoE layer -> ((ids, gates) on device, ids on host)
    marks: list = field(default_factory=list)  # per MoE layer (t0, t1, t2, t3, tp0, tp1, t4)
    dense_marks: list = field(default_factory=list)  # per dense layer (layer, start, end)


class _ExpertStore:
    """Where the routed experts' weights come from, in one of two representations.

    Dense: the model's flat ``[gate; up; down(; biases)]`` host buffers (``executor.model``).
    Packed quantised (``expert_dtype`` int8 / int4-g32 / int4-g128 / mxfp4, or a checkpoint
    stored packed, gpt-oss's MXFP4): each expert quantised once on the host
    (``executor.quant_experts``; a packed checkpoint as stored) and packed into one uint8
    buffer of exactly the byte accounting's size (``moesim.models``): that buffer is what a
    copy moves, and a device slot holding it is read through views (dequantise-and-
    multiply). ``host`` feeds the CPU experts, ``src`` the copies, ``view``/``mix`` the
    device; both sides use the one per-expert forward (``expert_fn``) and mix."""

    def __init__(self, model: MoEModel, expert_dtype: str | None, device: torch.device) -> None:
        s, cfg = model.spec, model.cfg
        native = model.packed_experts
        if expert_dtype is not None and native is not None and expert_dtype != native:
            raise MoesimError(f"{s.name} stores its experts as {native}; --expert-dtype {expert_dtype} would "
                              "requantise them (leave it out)")
        self.model, self.device, self.fmt = model, device, expert_dtype or native
        self.hidden, self.inter = s.hidden, s.expert_inter
        if self.fmt is None:
            self.host = self.src = model.experts
            self.width, self.pool_dtype = cfg.expert_width, model.embed_tokens.weight.dtype
            self.expert_fn = model.expert_fn
            return
        self.host = model.experts if native else quantize_experts(model.experts, s.hidden, s.expert_inter,
                                                                  self.fmt, s.expert_bias)
        pin = device.type == "cuda"
        self.src = [[q.pack().pin_memory() if pin else q.pack() for q in row] for row in self.host]
        # A slot starts on a 16-byte boundary, so the packed multi-byte parts keep their
        # alignment in every slot (a dtype view needs it); copies move the packed bytes only.
        self.width = -(-next(len(row[0]) for row in self.src if row) // 16) * 16
        self.pool_dtype = torch.uint8
        self.expert_fn = expert_fn_for(cfg, packed=True)

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
        if self.fmt is not None and self.device.type == "cpu":
            return self.host[layer]
        return [self.device_weight(layer, e) for e in range(len(row))]

    def host_pool(self, workers: int | None) -> HostExperts:
        """The thread pool that runs the CPU's share, with the same per-expert forward as the
        device (its rows arrive in fp32 on the host: a dense expert gets them in its dtype)."""
        fn, host = self.expert_fn, self.host
        if self.fmt is None:
            return HostExperts(self.hidden, self.inter, workers=workers,
                               expert_fn=lambda layer, e, x: fn(host[layer][e], x.to(host[layer][e].dtype)))
        return HostExperts(self.hidden, self.inter, workers=workers, expert_fn=lambda layer, e, x: fn(host[layer][e], x))

    def mix(self, x: Tensor, ids: np.ndarray, gates: Tensor, weights, only: set[int] | None = None) -> Tensor:
        """The gated sum of a layer's executed experts (of ``only`` those: the device's share
        of a layer split with the CPU), through :func:`~moesim.executor.model.mix_experts`."""
        return mix_experts(x, ids, gates, weights, self.expert_fn, only=only)


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
