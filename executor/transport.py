"""Moving experts host-to-device: one interface, three transports.

- :class:`CudaTransport`: a dedicated high-priority copy stream, non-blocking copies from
  pinned memory, one CUDA event per copy; the compute stream waits on events on the
  device, so waiting never blocks the host. Timings come from events, read once a step.
- :class:`EmulatedLink` (CPU): a copy worker thread that really copies into the slot
  tensors and paces each transfer to ``latency + bytes / bandwidth`` on an ideal FIFO
  clock, so overlap, stalls and contention are real, measurable behaviour without a GPU.
- :class:`QueuedEmulatedLink` (CPU): the same link serving demand copies before queued
  prefetch copies, expert by expert, and cancelling a prefetch's unstarted tail.

A CUDA copy stream runs its copies in the order they were queued and cannot withdraw one,
so the queued disciplines run on the emulated link only (docs/policies.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Transfer:
    """One expert copy. Times are seconds on the transport's clock (see ``now``)."""

    layer: int
    expert: int
    nbytes: int
    kind: int  # 0 = prefetch, 1 = on demand
    issue: float = 0.0
    start: float = 0.0
    end: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    event: object = None  # CUDA event recorded after the copy
    cancelled: bool = False  # dropped from the queue before it started (cancel-unstarted)


class EmulatedLink:
    """A FIFO copy engine in a thread, paced to a link's bandwidth and per-transfer latency.

    The worker keeps an ideal clock: a transfer starts at ``max(issue, previous end)`` and
    ends ``latency + bytes / bandwidth`` later (or when the real copy finishes, if that is
    later); the worker copies, sleeps until that end and signals. Wake-up and sleep
    overshoot delay the signal but never the clock, so they do not accumulate over
    back-to-back transfers.
    """

    def __init__(self, bandwidth: float, latency: float) -> None:
        if bandwidth <= 0 or latency < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        self.bandwidth, self.latency = bandwidth, latency
        # The link thread must get the interpreter lock promptly when a copy lands; the
        # default 5 ms switch interval would add up to 5 ms to a signal. Process-wide.
        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-5))
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = 0.0
        self._thread = threading.Thread(target=self._run, name="moesim-emulated-link", daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def copy_batch(self, items: list[tuple[Tensor, Tensor, Transfer, object]]) -> list[Transfer]:
        """Queue ``(dst, src, transfer, after)`` copies that are waited for together (one
        layer's experts): one hand-off and one signal for the batch, so the link thread
        takes the interpreter lock a few times a layer, not a few times an expert."""
        if not items:
            return []
        done = threading.Event()
        now = self.now()
        for _, _, t, _ in items:
            t.issue, t.done = now, done
        self._q.put(items)
        return [t for _, _, t, _ in items]

    def wait(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            t.done.wait()

    def _run(self) -> None:
        _tight_timer_slack()
        while True:
            items = self._q.get()
            if items is None:
                return
            for dst, src, t, _ in items:
                t.start = max(t.issue, self._clock)  # the link's clock, not the worker's wake-up
                dst.copy_(src)
                t.end = max(t.start + self.latency + t.nbytes / self.bandwidth, self.now())  # late if memcpy is slower
                self._clock = t.end
            remaining = self._clock - self.now()
            if remaining > 0:
                time.sleep(remaining)
            items[0][2].done.set()

    def finish_step(self, transfers: list[Transfer]) -> None:
        """Nothing to resolve: times were taken on the host clock."""

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


class QueuedEmulatedLink(EmulatedLink):
    """An emulated link that serves demand copies before queued prefetch copies, one expert
    at a time, and can cancel a prefetch's unstarted tail: the copy-queue disciplines
    ``demand-first`` and ``cancel-unstarted`` (``moesim.sim.engine.run_simpy_queued`` is
    their model; ``fifo`` is :class:`EmulatedLink`'s batch queue).

    Same ideal clock as the FIFO link, but the worker decides the next copy only when the
    previous one has ended on that clock (it sleeps to each copy's end), so a demand copy
    issued while a prefetch is copying starts right after it, not after the whole queued
    prefetch. Each copy signals its own event: a layer waits for exactly the copies it
    needs. The cost is a wake-up per expert, not per layer.
    """

    def __init__(self, bandwidth: float, latency: float) -> None:
        if bandwidth <= 0 or latency < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        self.bandwidth, self.latency = bandwidth, latency
        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-5))
        self._cv = threading.Condition()
        self._demand: collections.deque = collections.deque()
        self._prefetch: collections.deque = collections.deque()
        self._closed = False
        self._clock = 0.0
        self._thread = threading.Thread(target=self._run, name="moesim-queued-link", daemon=True)
        self._thread.start()

    def copy_batch(self, items: list[tuple[Tensor, Tensor, Transfer, object]]) -> list[Transfer]:
        """Queue ``(dst, src, transfer, after)`` copies, each with its own done event: demand
        ones (``kind`` 1) behind earlier demand only, prefetch ones behind all queued copies."""
        if not items:
            return []
        with self._cv:  # the issue time is taken under the queue's lock: a copy the link thread took
            now = self.now()  # before it has started (on the link's clock) before this issue, never after
            for item in items:
                t = item[2]
                t.issue, t.done = now, threading.Event()
                (self._demand if t.kind == 1 else self._prefetch).append(item)
            self._cv.notify()
        return [t for _, _, t, _ in items]

    def cancel(self, transfers: list[Transfer]) -> list[Transfer]:
        """Drop those of ``transfers`` that have not started; returns them (their slots are
        free at once: nothing will write into them)."""
        drop = {id(t) for t in transfers}
        with self._cv:
            kept, gone = collections.deque(), []
            for item in self._prefetch:
                (gone if id(item[2]) in drop else kept).append(item)
            self._prefetch = kept
        for _, _, t, _ in gone:
            t.cancelled = True
        return [t for _, _, t, _ in gone]

    def _run(self) -> None:
        _tight_timer_slack()
        while True:
            with self._cv:
                while not (self._demand or self._prefetch or self._closed):
                    self._cv.wait()
                if self._closed and not (self._demand or self._prefetch):
                    return
                dst, src, t, _ = (self._demand or self._prefetch).popleft()
            t.start = max(t.issue, self._clock)
            dst.copy_(src)
            t.end = max(t.start + self.latency + t.nbytes / self.bandwidth, self.now())
            self._clock = t.end
            remaining = t.end - self.now()
            if remaining > 0:
                time.sleep(remaining)  # decide the next copy when this one has ended on the clock
            t.done.set()

    def closed(self) -> bool:
        return self._closed and not self._thread.is_alive()

    def close(self) -> None:
        """Finish what is queued (its copies were recorded), then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)


def _tight_timer_slack() -> None:
    """Ask Linux for 1 us timer slack on this thread (default 50 us) so sleeps end on time."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds


class CudaTransport:
    """Copies on a high-priority side stream; dependencies through events, never host waits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.origin: torch.cuda.Event | None = None

    def start_step(self, origin: torch.cuda.Event) -> None:
        """``origin``: an event on the compute stream marking the step's start (time zero)."""
        self.origin = origin

    def now(self) -> float:
        return time.perf_counter()

    def copy_batch(self, items: list[tuple[Tensor, Tensor, Transfer, torch.cuda.Event | None]]) -> list[Transfer]:
        """Queue ``dst.copy_(src)`` per item on the copy stream; ``after`` (per item): wait for
        the compute stream to finish reading ``dst`` first (a reused slot)."""
        if not items:
            return []
        issue = torch.cuda.Event(enable_timing=True)
        issue.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src, t, after in items:
                if after is not None:
                    self.stream.wait_event(after)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                dst.copy_(src, non_blocking=True)  # src is pinned: a true async DMA
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                t.event = (issue, start, end)
        return [t for _, _, t, _ in items]

    def wait(self, transfers: list[Transfer]) -> None:
        """Make the compute stream wait for the copies (device-side; the host goes on)."""
        compute = torch.cuda.current_stream(self.device)
        for t in transfers:
            compute.wait_event(t.event[2])

    def finish_step(self, transfers: list[Transfer]) -> None:
        """After the step's end event has completed: convert event times to seconds."""
        for t in transfers:
            issue, start, end = t.event
            t.issue = self.origin.elapsed_time(issue) / 1e3
            t.start = self.origin.elapsed_time(start) / 1e3
            t.end = self.origin.elapsed_time(end) / 1e3
            t.event = None

    def close(self) -> None:
        self.stream.synchronize()
