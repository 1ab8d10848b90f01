"""Offloaded decoding: the model, a transport and the shared policy decisions, timed.

Experts live in host memory (pinned on CUDA); non-expert weights on the device. A pool of
device expert slots holds, at any moment, the current layer's experts, the next layer's
prefetched experts and the cross-token cache. What to copy, execute and keep is decided
by :class:`moesim.policy.Planner`, the same object the simulator times.

Per MoE layer ``l`` of a step (batch rows decode one token each):

1. attention, router (true top-k), and the prediction for layer ``l+1``:
   ``quasi`` applies layer l+1's router to ``LN_{l+1}(r_l + d_l)`` with default vectors,
   ``stale`` applies it to layer l's own router input, ``oracle`` reads the true ids of a
   routing pre-pass;
2. one device-to-host copy of (true ids, predicted ids) - the only host synchronisation
   of a layer, needed because the host plans the copies;
3. issue layer ``l``'s on-demand copies, then layer ``l+1``'s prefetch;
4. wait for layer ``l``'s copies (on CUDA the compute stream waits on events) and run
   the executed experts (the prediction, with its gates, under speculative execution).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from moesim.errors import MoesimError
from moesim.executor.model import MoEModel, TreeMask, expert_forward, route
from moesim.executor.transport import CudaTransport, EmulatedLink, Transfer
from moesim.policy import Planner, get_policy

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


@dataclass
class StepRecord:
    """What one decode step did and how long each part took (seconds)."""

    true_ids: np.ndarray  # [L, B, k]
    true_gates: np.ndarray
    pred_ids: np.ndarray  # -1 where no prediction
    pred_gates: np.ndarray
    exec_ids: np.ndarray
    attn_s: np.ndarray  # [L] attention, router, prediction and planning
    expert_s: np.ndarray
    stall_s: np.ndarray
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
        p = model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.planner = Planner(self.policy, cache_experts if self.policy.offload else 0, eviction)
        per_layer = s.n_experts  # prefill may touch a whole layer; decode uses up to 2 * batch * k
        n_slots = (2 * per_layer + (cache_experts if self.policy.offload else 0)) if self.policy.offload else 0
        self.pool = torch.empty((n_slots, s.expert_weights), device=self.device, dtype=self.dtype)
        self.free = list(range(n_slots))
        self.freed_after: dict[int, object] = {}  # CUDA: slot -> event after the last kernel that read it
        self.where: dict[tuple[int, int], int] = {}
        self.loaded: dict[int, list[int]] = defaultdict(list)
        self.oracle_routes: list[tuple[np.ndarray, np.ndarray]] | None = None  # per step (ids, gates) [L, B, k]
        self.timer = Timer(self.device)
        self.resident = model.experts
        if not self.policy.offload and model.experts and model.experts[0][0].device != self.device:
            self.resident = [[w.to(self.device) for w in row] for row in model.experts]  # resident means resident

    # -- expert placement ---------------------------------------------------------------
    def _issue(self, layer: int, experts: list[int], kind: int, out: list[Transfer]) -> None:
        src = self.model.experts[layer]
        batch = []
        for e in experts:
            if not self.free:
                raise RuntimeError("expert slot pool exhausted (planner and pool disagree)")
            slot = self.free.pop()
            self.where[(layer, e)] = slot
            self.loaded[layer].append(e)
            t = Transfer(layer, e, src[e].numel() * src[e].element_size(), kind)
            batch.append((self.pool[slot], src[e], t, self.freed_after.pop(slot, None)))
        out += self.transport.copy_batch(batch)

    def _weights(self, layer: int) -> dict[int, Tensor] | list[Tensor]:
        if not self.policy.offload:
            return self.resident[layer]
        return {e: self.pool[slot] for (lay, e), slot in self.where.items() if lay == layer}

    def _release(self, layer: int, evicted: list[tuple[int, int]]) -> None:
        """Return the slots the planner no longer needs. On CUDA a slot is reused only after
        the kernels that read it (queued on the compute stream) are done: the next copy
        into it waits on this event."""
        cache = self.planner.cache
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        freed = [self.where.pop((layer, e)) for e in self.loaded.pop(layer, [])
                 if cache is None or (layer, e) not in cache]
        freed += [self.where.pop(key) for key in evicted if key in self.where]
        for slot in freed:
            if done is not None:
                self.freed_after[slot] = done
            self.free.append(slot)

    # -- prediction -----------------------------------------------------------------------
    def _predict(self, layer: int, resid: Tensor, x: Tensor, ids: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
        """Predicted (ids, gates) of ``layer + 1`` from layer ``layer``'s state."""
        nxt = self.model.layers[layer + 1]
        s = self.model.spec
        if self.predictor == "stale":
            return route(nxt.gate(x), s.top_k, s.norm_topk_prob)
        d = (self.dv[layer][ids] * gates[..., None].to(self.dv.dtype)).sum(1)  # router-weighted default vectors
        q = nxt.post_attention_layernorm(resid + d.to(resid.dtype))
        use = self.predictor if self.predictor != "hybrid" else self.estimator[1][layer]
        if use == "estimator":
            return route(self.estimator[0](q.to(self.est_dtype), layer), s.top_k, s.norm_topk_prob)
        return route(nxt.gate(q), s.top_k, s.norm_topk_prob)

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
        verification of a candidate tree (``tree``; ``predicted``: per layer, the union of
        the experts predicted for its tokens, which prefetching policies copy ahead)."""
        m, s, tm = self.model, self.model.spec, self.timer
        L, (b, t), k = s.n_layers, tokens.shape, s.top_k
        tm.marks.clear()
        if isinstance(self.transport, CudaTransport):
            self.transport.start_step(tm.mark())
            t_start = tm.marks[-1]
        else:
            t_start = tm.mark()
        shape = (L, b * t, k)
        rec = StepRecord(np.full(shape, -1, np.int16), np.zeros(shape, np.float32), np.full(shape, -1, np.int16),
                         np.zeros(shape, np.float32), np.full(shape, -1, np.int16), np.zeros(L), np.zeros(L), np.zeros(L),
                         np.zeros(L))
        true_gates: list[Tensor] = []  # kept on the device, copied once at the end of the step
        pred_gates: dict[int, Tensor] = {}
        h = m.embed_tokens(tokens)
        t_embed = tm.mark()
        pending: list[Transfer] = []  # prefetched copies for the current layer
        pred_next: tuple[Tensor, Tensor] | None = None
        pred_next_host: np.ndarray | None = None
        marks = []
        for layer, blk in enumerate(m.layers):
            t0 = tm.mark()
            h = h + blk.self_attn(blk.input_layernorm(h), cache, layer, pos, tree)
            x = blk.post_attention_layernorm(h).reshape(b * t, -1)
            ids, gates = route(blk.gate(x), k, s.norm_topk_prob)
            pred_here, pred_host = pred_next, pred_next_host
            pred_next = pred_next_host = None
            tp0 = tm.mark()
            # Offloading policies all run the predictor: prefetchers use it, on-demand records
            # it (its cost stays in attn_s) so its trace can predict the prefetching policies.
            if predicted is not None or prefill:
                pass  # verification brings its own predictions; prefill predicts nothing
            elif self.policy.offload and layer + 1 < L and (self.policy.prefetch or self.can_predict):
                if self.predictor == "oracle":
                    ids_o, gates_o = self.oracle_routes[step_index]
                    pred_next = (torch.as_tensor(ids_o[layer + 1].astype(np.int64), device=self.device),
                                 torch.as_tensor(gates_o[layer + 1], device=self.device))
                else:
                    pred_next = self._predict(layer, h.reshape(b * t, -1), x, ids, gates)
            tp1 = tm.mark()
            # The one host synchronisation of the layer: true ids and the next layer's prediction.
            both = torch.cat([ids, pred_next[0]], 1) if pred_next is not None else ids
            host = both.cpu().numpy()
            true_host = host[:, :k]
            if pred_next is not None:
                pred_next_host = host[:, k:]
            rec.true_ids[layer] = true_host
            true_gates.append(gates)
            if pred_here is not None:
                rec.pred_ids[layer] = pred_host
                pred_gates[layer] = pred_here[1]
            here = _union(pred_host) if pred_host is not None else None
            if predicted is not None:
                here = predicted[layer] if layer > 0 else None
            plan = self.planner.route(layer, _union(true_host), here)
            demand: list[Transfer] = []
            self._issue(layer, list(plan.demand), 1, demand)
            prefetch: list[Transfer] = []
            if pred_next is not None:
                self._issue(layer + 1, self.planner.prefetch(layer + 1, _union(pred_next_host)), 0, prefetch)
            elif predicted is not None and layer + 1 < L:
                self._issue(layer + 1, self.planner.prefetch(layer + 1, predicted[layer + 1]), 0, prefetch)
            t1 = tm.mark()
            self.transport.wait(pending + demand)
            t2 = tm.mark()
            speculative = self.policy.speculative and pred_here is not None and predicted is None
            run_ids, run_gates = (pred_host, pred_here[1]) if speculative else (true_host, gates)
            rec.exec_ids[layer] = run_ids
            h = h + _apply_experts(x, run_ids, run_gates, self._weights(layer), s.hidden, s.expert_inter).view_as(h)
            t3 = tm.mark()
            _, evicted = self.planner.finish(layer, plan)
            self._release(layer, evicted)
            rec.copies += demand + prefetch
            pending = prefetch
            marks.append((t0, t1, t2, t3, tp0, tp1))
        if tree is not None:
            rec.all_logits = m.lm_head(m.norm(h))
            logits = rec.all_logits[:, -1]
        else:
            logits = m.lm_head(m.norm(h))[:, -1]
        t_end = tm.mark()
        rec.true_gates[:] = torch.stack(true_gates).float().cpu().numpy()
        for layer, g in pred_gates.items():
            rec.pred_gates[layer] = g.float().cpu().numpy()
        if tm.cuda:
            t_end.synchronize()
            self.transport.finish_step(rec.copies)
        for layer, (t0, t1, t2, t3, tp0, tp1) in enumerate(marks):
            rec.predict_s[layer] = tm.seconds(tp0, tp1)
            rec.attn_s[layer] = tm.seconds(t0, t1)
            rec.stall_s[layer] = tm.seconds(t1, t2)
            rec.expert_s[layer] = tm.seconds(t2, t3)
        rec.other_s = tm.seconds(t_start, t_embed) + tm.seconds(marks[-1][3], t_end)
        rec.tpot_s = tm.seconds(t_start, t_end)
        if not tm.cuda:
            for c in rec.copies:
                c.issue, c.start, c.end = c.issue - t_start, c.start - t_start, c.end - t_start
        rec.logits = logits
        return rec


def _union(ids: np.ndarray) -> list[int]:
    return list(dict.fromkeys(int(e) for e in ids.reshape(-1) if e >= 0))


def _apply_experts(x: Tensor, ids: np.ndarray, gates: Tensor, weights, hidden: int, inter: int) -> Tensor:
    """Mix experts per row: ``ids`` [rows, k] on the host (so no device sync), ``gates`` [rows, k]."""
    out = torch.zeros_like(x)
    if x.shape[0] == 1:  # decode at batch 1: every expert sees the single row
        for c, e in enumerate(ids[0].tolist()):
            out += gates[:, c, None].to(x.dtype) * expert_forward(weights[e], x, hidden, inter)
        return out
    groups: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for r, row in enumerate(ids.tolist()):
        for c, e in enumerate(row):
            groups[e][0].append(r)
            groups[e][1].append(c)
    for e, (rows, cols) in groups.items():
        r = torch.tensor(rows, device=x.device)
        y = expert_forward(weights[e], x[r], hidden, inter)
        out.index_add_(0, r, y * gates[r, torch.tensor(cols, device=x.device), None].to(y.dtype))
    return out


def make_transport(device: torch.device, link_bw: float, latency: float):
    """CUDA: the real link. CPU: an emulated link paced to ``link_bw`` B/s and ``latency`` s."""
    if device.type == "cuda":
        return CudaTransport(device)
    return EmulatedLink(link_bw, latency)
