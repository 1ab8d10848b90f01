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

import numpy as np
import torch
from torch import Tensor

from moesim.errors import MoesimError
from moesim.executor.model import MoEModel, TreeMask, mix_experts, quasi_hidden
from moesim.executor.transport import CudaTransport, EmulatedLink, Transfer
from moesim.policy import Planner, expert_slots, get_policy

PREDICTORS = ("quasi", "stale", "oracle", "estimator", "hybrid")


def predictor_inputs(policy: str, predictor: str) -> tuple[bool, bool]:
    """What ``predictor`` reads under ``policy``: (default vectors, a trained estimator).

    Nothing is predicted without offloading, and the oracle policy reads true ids. Every
    other offloading policy predicts, on-demand too (its trace records the predictions so
    that it can stand in for the prefetching policies); only a prefetching policy cannot
    run without them (checked in :class:`OffloadedDecoder`)."""
    pol = get_policy(policy)
    if not pol.offload or pol.oracle:
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
    other_s: float = 0.0
    tpot_s: float = 0.0
    copies: list[Transfer] = field(default_factory=list)
    logits: Tensor | None = None  # [B, vocab] after the last token
    all_logits: Tensor | None = None  # [B, t, vocab] after every token (tree verification only)


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
    """

    def __init__(self, model: MoEModel, policy: str, transport, *, predictor: str = "quasi",
                 default_vectors: Tensor | None = None, cache_experts: int = 0, eviction: str = "lru",
                 batch: int = 1, estimator: tuple[torch.nn.Module, list[str]] | None = None) -> None:
        self.model, self.policy, self.transport = model, get_policy(policy), transport
        if predictor not in PREDICTORS:
            raise MoesimError(f"unknown predictor {predictor!r}; known: {', '.join(PREDICTORS)}")
        if self.policy.oracle:
            predictor = "oracle"
        uses_dv, uses_est = predictor_inputs(self.policy.name, predictor)
        if self.policy.prefetch and uses_dv and default_vectors is None:
            raise MoesimError(f"the {predictor} predictor needs default vectors (moesim calibrate)")
        if self.policy.prefetch and uses_est and estimator is None:
            raise MoesimError(f"the {predictor} predictor needs a trained estimator (moesim train-estimator)")
        self.estimator = estimator
        self.predictor, self.dv = predictor, default_vectors
        self.can_predict = predictor == "stale" or (default_vectors is not None and (
            predictor == "quasi" or (predictor in ("estimator", "hybrid") and estimator is not None)))
        s = model.spec
        if s.dense_layers and self.policy.offload and predictor in ("estimator", "hybrid"):
            # estimator.py pairs layer l's quasi-hidden state with layer l+1: not the next MoE layer
            raise MoesimError(f"the {predictor} predictor is not trained for models with dense layers ({s.name}); "
                              "use quasi or stale")
        self.layers = _Layers.of(s)
        p = model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.planner = Planner(self.policy, cache_experts if self.policy.offload else 0, eviction)
        n_slots = expert_slots(s, self.policy, cache_experts if self.policy.offload else 0)  # what the what-if counts
        self.pool = torch.empty((n_slots, s.expert_weights), device=self.device, dtype=self.dtype)
        self.free = list(range(n_slots))
        self.freed_after: dict[int, object] = {}  # CUDA: slot -> event after the last kernel that read it
        self.where: dict[tuple[int, int], int] = {}
        self.loaded: dict[int, list[int]] = defaultdict(list)
        self.oracle_routes: list[tuple[np.ndarray, np.ndarray]] | None = None  # per step (ids, gates) [M, B, k]
        self.timer = Timer(self.device)
        self.resident = model.experts
        if not self.policy.offload and model.experts[self.layers.moe[0]][0].device != self.device:
            self.resident = [[w.to(self.device) for w in row] for row in model.experts]  # resident means resident

    # -- expert placement ---------------------------------------------------------------
    def _issue(self, m: int, experts: list[int], kind: int, out: list[Transfer]) -> None:
        """Copy ``experts`` of MoE layer ``m`` into free slots (records name the model layer)."""
        layer = self.layers.moe[m]
        src = self.model.experts[layer]
        batch = []
        for e in experts:
            if not self.free:
                raise RuntimeError("expert slot pool exhausted (planner and pool disagree)")
            slot = self.free.pop()
            self.where[(m, e)] = slot
            self.loaded[m].append(e)
            t = Transfer(layer, e, src[e].numel() * src[e].element_size(), kind)
            batch.append((self.pool[slot], src[e], t, self.freed_after.pop(slot, None)))
        out += self.transport.copy_batch(batch)

    def _weights(self, m: int) -> dict[int, Tensor] | list[Tensor]:
        if not self.policy.offload:
            return self.resident[self.layers.moe[m]]
        return {e: self.pool[slot] for (lay, e), slot in self.where.items() if lay == m}

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
            self.free.append(slot)

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
        tm, s = self.timer, self.model.spec
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
        self.transport.wait(st.pending + demand)
        t2 = tm.mark()
        speculative = self.policy.speculative and pred_here is not None and st.predicted is None
        run_ids, run_gates = (pred_here_host, pred_here[1]) if speculative else (true_host, gates)
        st.rec.exec_ids[m] = run_ids
        y = mix_experts(x, run_ids, run_gates, self._weights(m), s.hidden, s.expert_inter)  # [rows, hidden]
        t3 = tm.mark()
        _, evicted = self.planner.finish(m, plan)
        self._release(m, evicted)
        st.rec.copies += demand + prefetch
        st.pending = prefetch
        st.marks.append((st.t_layer, t1, t2, t3, tp0, tp1))
        st.t_layer = t3
        return y

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
        here = _union(pred_here_host) if pred_here_host is not None else None
        if st.predicted is not None:
            here = st.predicted[m] if m > 0 else None
        plan = self.planner.route(m, _union(true_host), here)
        demand: list[Transfer] = []
        self._issue(m, list(plan.demand), 1, demand)
        prefetch: list[Transfer] = []
        nxt = self.layers.next_moe(m)
        if st.pred_next_host is not None:
            self._issue(nxt, self.planner.prefetch(nxt, _union(st.pred_next_host)), 0, prefetch)
        elif st.predicted is not None and nxt is not None:
            self._issue(nxt, self.planner.prefetch(nxt, st.predicted[nxt]), 0, prefetch)
        return plan, demand, prefetch

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
        for m, (t0, t1, t2, t3, tp0, tp1) in enumerate(st.marks):
            layer = self.layers.moe[m]
            rec.predict_s[layer] = tm.seconds(tp0, tp1)
            rec.attn_s[layer] = tm.seconds(t0, t1)
            rec.stall_s[m] = tm.seconds(t1, t2)
            rec.expert_s[m] = tm.seconds(t2, t3)
        for layer, t0, t1 in st.dense_marks:
            rec.attn_s[layer] = tm.seconds(t0, t1)
        rec.other_s = tm.seconds(st.t_start, st.t_embed) + tm.seconds(st.t_layer, t_end)
        rec.tpot_s = tm.seconds(st.t_start, t_end)
        if not tm.cuda:
            for c in rec.copies:
                c.issue, c.start, c.end = c.issue - st.t_start, c.start - st.t_start, c.end - st.t_start


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
    marks: list = field(default_factory=list)  # per MoE layer (t0, t1, t2, t3, tp0, tp1)
    dense_marks: list = field(default_factory=list)  # per dense layer (layer, start, end)


def _union(ids: np.ndarray) -> list[int]:
    return list(dict.fromkeys(int(e) for e in ids.reshape(-1) if e >= 0))


def make_transport(device: torch.device, link_bw: float, latency: float):
    """CUDA: the real link. CPU: an emulated link paced to ``link_bw`` B/s and ``latency`` s."""
    if device.type == "cuda":
        return CudaTransport(device)
    return EmulatedLink(link_bw, latency)
