"""Experts computed on the CPU, from the host store, while the device keeps working.

The executor half of the CPU-compute policies (``cpu-static``, ``hot-experts``,
``cpu-on-miss``; docs/policies.md): after a layer's router the runtime splits the
routed experts (``moesim.placement.HybridPlanner``), hands the CPU's share to
:meth:`HostExperts.submit` and goes on issuing the device's experts; the job copies the
rows' hidden states to the host, a thread pool multiplies each expert from its host
buffer (torch releases the GIL inside its kernels, so the device stream's Python thread
is not blocked), and :meth:`HostJob.result` returns the gated partial output on the
device for the runtime to add. The layer ends when both are done, as the step model
(``moesim.sim.hybrid``) says.

Weights are the runtime's host buffers (flat ``[gate; up; down]``, as
``executor.model.expert_forward`` reads them) or quantised experts from
``executor.quant_experts`` (dequantise-and-multiply).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moesim.executor.model import expert_forward

ExpertFn = Callable[[int, int, Tensor], Tensor]  # (layer, expert, x rows) -> y rows


@dataclass
class HostJob:
    """One layer's CPU experts in flight."""

    futures: list[tuple[Future, Tensor, Tensor]]  # ((expert output, end time), rows, top-k slots of those rows)
    gates: Tensor | _Lazy  # [rows, k] on the host (read after the futures: on CUDA they waited for its copy)
    shape: tuple[int, int]
    device: torch.device
    dtype: torch.dtype
    started: float  # time.perf_counter() at submit
    ended: float = 0.0  # perf_counter() when the last expert finished (set by result())

    def done(self) -> bool:
        return all(f.done() for f, _, _ in self.futures)

    @property
    def seconds(self) -> float:
        """Submit to the last expert's end (after :meth:`result`): the CPU's share of the
        layer, hidden states down included."""
        return max(self.ended - self.started, 0.0)

    def result(self) -> Tensor:
        """The gated sum of the CPU experts' outputs, ``[rows, hidden]`` on the device.

        On CUDA the sum is built in pinned memory, so the copy up is a true asynchronous
        copy on the current stream (the caching host allocator keeps the buffer alive until
        it has run): the host does not wait for the device here."""
        pin = self.device.type == "cuda"
        out = torch.zeros(self.shape, dtype=torch.float32, pin_memory=pin)
        end = self.started
        for fut, rows, cols in self.futures:
            y, t = fut.result()
            end = max(end, t)
            out.index_add_(0, rows, y.float() * self.gates[rows, cols][:, None])
        self.ended = end
        return out.to(self.device, self.dtype, non_blocking=True)


class HostExperts:
    """A thread pool that multiplies experts held in host memory.

    ``weights[layer][expert]`` is a flat host buffer, or ``expert_fn`` computes one expert
    from whatever the caller stores (quantised experts). ``workers`` threads each take
    whole experts; torch's own intra-op threads split the rest of the cores among them.
    """

    def __init__(self, hidden: int, inter: int, weights: Sequence[Sequence[Tensor]] | None = None,
                 expert_fn: ExpertFn | None = None, workers: int | None = None) -> None:
        if (weights is None) == (expert_fn is None):
            raise ValueError("give host weights or an expert function, exactly one")
        self.hidden, self.inter = hidden, inter
        self._weights = weights
        self._fn = expert_fn or self._dense
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="moesim-host-expert")

    def _dense(self, layer: int, expert: int, x: Tensor) -> Tensor:
        w = self._weights[layer][expert]
        return expert_forward(w, x.to(w.dtype), self.hidden, self.inter)

    def submit(self, layer: int, x: Tensor, ids: np.ndarray, gates: Tensor, experts: Sequence[int]) -> HostJob:
        """Start the CPU experts ``experts`` of ``layer`` for tokens ``x`` [rows, hidden].

        ``ids`` [rows, k] are the routed ids on the host (the runtime already has them);
        ``gates`` [rows, k] the router weights. Only the (row, slot) pairs routed to one of
        ``experts`` are computed; the caller computes the others on the device.
        """
        started = time.perf_counter()
        x_host, g_host, ready = _to_host(x, gates)
        wanted = set(int(e) for e in experts)
        futures = []
        for e in sorted(wanted):
            rows, cols = np.nonzero(ids == e)
            if rows.size == 0:
                continue
            r = torch.from_numpy(rows.astype(np.int64))
            c = torch.from_numpy(cols.astype(np.int64))
            futures.append((self._pool.submit(self._timed, layer, e, x_host, r, ready), r, c))
        return HostJob(futures, g_host, (x.shape[0], x.shape[1]), x.device, x.dtype, started)

    def _timed(self, layer: int, e: int, x_host: Tensor, rows: Tensor, ready) -> tuple[Tensor, float]:
        if ready is not None:
            ready.synchronize()  # the hidden states' copy down has landed (a CUDA event; no-op on CPU)
        y = self._fn(layer, e, x_host[rows])
        return y, time.perf_counter()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> HostExperts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_host(x: Tensor, gates: Tensor):
    """(hidden states, gates) as fp32 on the host, and a CUDA event marking their arrival.

    On CUDA both go down with one ``non_blocking`` copy each into pinned memory; the
    threads wait on the event, not the caller (which goes on queueing the device's
    experts). On CPU they are the caller's tensors (cast) and the event is None."""
    if x.device.type != "cuda":
        return x.detach().to(torch.float32), gates.detach().to(torch.float32), None
    xh = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    gh = torch.empty(gates.shape, dtype=gates.dtype, pin_memory=True)
    xh.copy_(x.detach(), non_blocking=True)
    gh.copy_(gates.detach(), non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return _Lazy(xh), _Lazy(gh), ev


class _Lazy:
    """A pinned host tensor read only after its copy's event: indexing casts to fp32 then."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def __getitem__(self, idx):
        return self.t[idx].float()


def hybrid_moe(layer: int, moe_index: int, x: Tensor, ids: np.ndarray, gates: Tensor, planner,
               device_weights: Sequence[Tensor], host: HostExperts, hidden: int, inter: int,
               copied: Sequence[int] = ()) -> Tensor:
    """One MoE layer split between the device and the CPU, as the runtime's layer hook runs it.

    ``planner`` (a ``moesim.placement.HybridPlanner``) says which routed experts the device
    holds; ``copied`` are misses the caller copied this layer (cpu-on-miss, decided with
    ``moesim.policy.cpu_or_copy``) and now holds in ``device_weights``. The CPU's share is
    submitted first so it runs while the device multiplies its own; the result is the
    same gated sum as running every expert in one place.
    """
    experts = list(dict.fromkeys(int(e) for e in ids.reshape(-1) if e >= 0))
    hits, misses = planner.split(moe_index, experts)
    copied = [e for e in copied if e in misses]
    on_cpu = [e for e in misses if e not in copied]
    job = host.submit(layer, x, ids, gates, on_cpu) if on_cpu else None
    out = torch.zeros_like(x)
    for e in hits + copied:
        rows, cols = np.nonzero(ids == e)
        r = torch.from_numpy(rows.astype(np.int64)).to(x.device)
        c = torch.from_numpy(cols.astype(np.int64)).to(x.device)
        y = expert_forward(device_weights[e], x[r], hidden, inter)
        out.index_add_(0, r, y * gates[r, c, None].to(y.dtype))
    if job is not None:
        out = out + job.result()
    planner.finish(moe_index, hits, copied)
    return out


class HybridExperts:
    """An :class:`~moesim.executor.model.ExpertHook` for the CPU-compute policies: routes a
    layer, runs the CPU's share on ``host`` and the device's share from ``weights``
    (``weights[layer][e]``: resident or copied buffers) with :func:`hybrid_moe`.

    ``copy_for(layer, misses)`` (optional) returns the misses to copy this layer; it is
    where the runtime calls ``moesim.policy.cpu_or_copy`` with its clock and link queue
    and performs the copies. Without it no miss is copied (the static policies).
    """

    def __init__(self, model, planner, host: HostExperts, weights=None,
                 copy_for: Callable[[int, list[int]], Sequence[int]] | None = None) -> None:
        self._route = model.route  # the family's router rule (DeepSeek: group limit, gate scale)
        self.spec = model.spec
        self.planner, self.host = planner, host
        self.weights = weights if weights is not None else model.experts
        self.copy_for = copy_for
        self._moe = {layer: i for i, layer in enumerate(self.spec.moe_layers)}

    def __call__(self, layer: int, x: Tensor, logits: Tensor, resid: Tensor) -> Tensor:
        s = self.spec
        ids, gates = self._route(logits, layer)
        ids_host = ids.cpu().numpy()
        m = self._moe[layer]
        copied: Sequence[int] = ()
        if self.copy_for is not None:
            _, misses = self.planner.split(m, list(dict.fromkeys(int(e) for e in ids_host.reshape(-1))))
            copied = self.copy_for(layer, misses)
        return hybrid_moe(layer, m, x, ids_host, gates, self.planner, self.weights[layer], self.host,
                          s.hidden, s.expert_inter, copied)
