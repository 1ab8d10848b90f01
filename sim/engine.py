"""The reference discrete-event model (SimPy): a compute stream and a copy engine.

Entities, each one long-lived SimPy process:

- :class:`CopyEngine` serves host-to-device transfers first in, first out;
- :class:`ComputeStream` walks the decode steps layer by layer: attention and router,
  then it issues layer l's on-demand copies and layer l+1's prefetch, waits for layer
  l's copies to land and runs its experts.

Double-buffered expert slots need no resource of their own: layer l+1's prefetch is
issued after layer l's router, which runs after layer l-1's experts finished with the
slot set l+1 reuses. The model can record every interval it simulates (``record=True``)
for timelines and Chrome traces.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from moesim.sim.workload import Link, Workload


@dataclass
class Span:
    """One simulated interval on a resource, for timelines and Chrome traces."""

    lane: str  # "compute" or "copy"
    name: str
    start: float
    end: float
    step: int
    layer: int


class CopyEngine:
    """A DMA engine: transfers queue FIFO and each takes ``n * link.per_expert`` seconds."""

    def __init__(self, env: simpy.Environment, link: Link, spans: list[Span] | None) -> None:
        self.env, self.link, self.spans = env, link, spans
        self.queue: deque[tuple[int, simpy.Event, str, int, int]] = deque()
        self.issued = 0.0  # seconds of transfer work submitted so far
        self.busy_until = 0.0  # when the last queued transfer will end (FIFO, fixed durations)
        self._wake: simpy.Event | None = None
        env.process(self._serve())

    def submit(self, n_experts: int, name: str, step: int, layer: int) -> simpy.Event:
        done = self.env.event()
        self.issued += self.link.copy_time(n_experts)
        self.busy_until = max(self.busy_until, self.env.now) + self.link.copy_time(n_experts)
        self.queue.append((n_experts, done, name, step, layer))
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return done

    def _serve(self):
        env = self.env
        while True:
            if not self.queue:
                self._wake = env.event()
                yield self._wake
            n, done, name, step, layer = self.queue.popleft()
            duration = self.link.copy_time(n)
            start = env.now
            yield env.timeout(duration)
            if self.spans is not None:
                self.spans.append(Span("copy", name, start, env.now, step, layer))
            done.succeed()


@dataclass
class ComputeStream:
    """The GPU compute stream: serial, in program order."""

    env: simpy.Environment
    work: Workload
    copier: CopyEngine
    spans: list[Span] | None
    ends: list[float] = field(default_factory=list)
    copy_busy: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)

    def run(self):
        """Walk the steps. Without recording, compute with no decision point in between
        (layer l's experts, layer l+1's attention) is one timeout: the same times, fewer events."""
        env, w, copier, spans = self.env, self.work, self.copier, self.spans
        demand, prefetch = w.demand.tolist(), w.prefetch_next.tolist()
        rows = zip(w.attn.tolist(), demand, prefetch, w.experts.tolist(), w.other.tolist())
        pending = 0.0  # compute issued to the stream but not yet simulated

        timeout = env.timeout
        if copier.link.interference:
            def timeout(work: float):
                """``work`` seconds of compute, slowed while the copy engine is busy."""
                return env.timeout(copier.link.compute_end(env.now, work, copier.busy_until) - env.now)

        next_ready: simpy.Event | None = None
        for step, (attn, dem, pf, experts, other) in enumerate(rows):
            issued0, stalled = copier.issued, 0.0
            for layer in range(len(attn)):
                ready, next_ready = next_ready, None
                pending += attn[layer]
                if dem[layer] or pf[layer] or ready is not None or spans is not None:
                    start = env.now
                    yield timeout(pending)  # to the end of layer's router
                    pending = 0.0
                    if spans is not None:
                        spans.append(Span("compute", f"attn L{layer}", start, env.now, step, layer))
                if dem[layer]:
                    ready = copier.submit(dem[layer], f"demand L{layer} x{dem[layer]}", step, layer)
                if pf[layer]:
                    next_ready = copier.submit(pf[layer], f"prefetch L{layer + 1} x{pf[layer]}", step, layer + 1)
                if ready is not None and not ready.processed:
                    waited = env.now
                    yield ready
                    if copier.link.wakeup:  # the stream resumes a moment after the copy lands
                        yield env.timeout(copier.link.wakeup)
                    stalled += env.now - waited
                pending += experts[layer]
                if spans is not None and experts[layer]:
                    start = env.now
                    yield timeout(pending)
                    pending = 0.0
                    spans.append(Span("compute", f"experts L{layer}", start, env.now, step, layer))
            pending += other
            start = env.now
            yield timeout(pending)
            pending = 0.0
            if spans is not None:
                spans.append(Span("compute", "lm head", start, env.now, step, -1))
            self.ends.append(env.now)
            self.copy_busy.append(copier.issued - issued0)
            self.stalls.append(stalled)


def run_simpy(w: Workload, link: Link, record: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Span]]:
    """Simulate every step; returns per-step (end time, copy seconds issued, stall seconds)
    and the recorded spans (empty unless ``record``)."""
    env = simpy.Environment()
    spans: list[Span] | None = [] if record else None
    copier = CopyEngine(env, link, spans)
    stream = ComputeStream(env, w, copier, spans)
    env.run(env.process(stream.run()))
    return np.array(stream.ends), np.array(stream.copy_busy), np.array(stream.stalls), spans or []
