"""Experts computed on the CPU, from the host store, while the device keeps working.

The executor half of the CPU-compute policies (``cpu-static``, ``hot-experts``,
``cpu-on-miss``; docs/policies.md). The layer itself is split in ONE place, the runtime's
``OffloadedDecoder._host_layer``: after a layer's router it splits the routed experts
(``moesim.policy.placement.HostPlanner``), hands the CPU's share to :meth:`HostExperts.submit`
and goes on issuing the device's experts; the job copies the rows' hidden states to the
host, a thread pool multiplies each expert from its host buffer (torch releases the GIL
inside its kernels, so the device stream's Python thread is not blocked), and
:meth:`HostJob.result` returns the gated partial output on the device for the runtime
to add. The layer ends when both are done, as the step model (``moesim.sim.cpu_compute``)
says.

Weights are the runtime's host buffers (flat ``[gate; up; down]``, as
``executor.model.expert_forward`` reads them) or quantised experts from
``executor.quant_experts`` (dequantise-and-multiply): the runtime passes the same
per-expert forward it runs on the device, and the gated sum is the one
``executor.model.mix_experts``.
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

from moesim.executor.model import expert_forward, mix_experts

ExpertFn = Callable[[int, int, Tensor], Tensor]  # (layer, expert, x rows) -> y rows


@dataclass
class HostJob:
    """One layer's CPU experts in flight."""

    futures: dict[int, Future]  # expert -> (its output on its routed rows, end time)
    ids: np.ndarray  # [rows, k] routed ids (host)
    gates: Tensor | _Lazy  # [rows, k] on the host (read after the futures: on CUDA they waited for its copy)
    shape: tuple[int, int]
    device: torch.device
    dtype: torch.dtype
    started: float  # time.perf_counter() at submit
    ended: float = 0.0  # perf_counter() when the last expert finished (set by result())

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())

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
        done = {e: f.result() for e, f in self.futures.items()}  # expert -> (output rows, end time)
        self.ended = max([self.started, *(t for _, t in done.values())])
        # The one mix, with each expert's output already computed on its rows (in the order
        # mix_experts groups them: increasing row).
        mix_experts(out, self.ids, self.gates, {e: y for e, (y, _) in done.items()}, lambda y, rows: y.float(),
                    only=set(done), out=out)
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
        futures = {}
        for e in sorted(set(int(e) for e in experts)):
            rows = np.unique(np.nonzero(ids == e)[0])  # a row routed to e once (top-k ids are distinct)
            if rows.size:
                futures[e] = self._pool.submit(self._timed, layer, e, x_host, torch.from_numpy(rows.astype(np.int64)),
                                               ready)
        return HostJob(futures, ids, g_host, (x.shape[0], x.shape[1]), x.device, x.dtype, started)

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
