"""The reference discrete-event model (SimPy): a compute stream and a copy engine.

Entities, each one long-lived SimPy process:

- :class:`CopyEngine` serves host-to-device transfers first in, first out;
- :class:`ComputeStream` walks the decode steps layer by layer: attention and router,
  then it issues layer l's on-demand copies and the prefetch issued there (for the layer
  the workload names, ``Workload.target``), waits for layer l's copies to land and runs
  its experts.

Expert slots need no resource of their own: the planner holds one slot set per layer
in flight (``moesim.policy.expert_slots``), and a prefetch is issued after a router, which
runs after the previous layer's experts finished with the slot set it reuses. The model can record every interval it simulates (``record=True``)
for timelines and Chrome traces.

Two more references live here: :func:`run_simpy_cpu`, the CPU-compute policies' step
model (device stream, copy engine and CPU; see ``moesim.sim.cpu_compute``), and
:func:`run_simpy_queued`, the copy-queue disciplines that serve demand before prefetch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from moesim.policy import QUEUES, cpu_or_copy
from moesim.sim.cpu_run import CpuRun
from moesim.sim.workload import Link, Workload


@dataclass
class Span:
    """One simulated interval on a resource, for timelines and Chrome traces."""

    lane: str  # "compute", "copy" or "cpu"
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
        demand, prefetch, target = w.demand.tolist(), w.prefetch.tolist(), w.target.tolist()
        rows = zip(w.attn.tolist(), demand, prefetch, w.experts.tolist(), w.other.tolist())
        pending = 0.0  # compute issued to the stream but not yet simulated

        timeout = env.timeout
        if copier.link.interference:
            def timeout(work: float):
                """``work`` seconds of compute, slowed while the copy engine is busy."""
                return env.timeout(copier.link.compute_end(env.now, work, copier.busy_until) - env.now)

        for step, (attn, dem, pf, experts, other) in enumerate(rows):
            issued0, stalled = copier.issued, 0.0
            inflight: dict[int, simpy.Event] = {}  # target layer -> its prefetch's completion
            for layer in range(len(attn)):
                ready = inflight.pop(layer, None)
                pending += attn[layer]
                if dem[layer] or pf[layer] or ready is not None or spans is not None:
                    start = env.now
                    yield timeout(pending)  # to the end of layer's router
                    pending = 0.0
                    if spans is not None:
                        spans.append(Span("compute", f"attn L{layer}", start, env.now, step, layer))
                if dem[layer]:  # FIFO: it lands after everything issued before it, this layer's prefetch too
                    ready = copier.submit(dem[layer], f"demand L{layer} x{dem[layer]}", step, layer)
                if pf[layer]:
                    to = target[layer]
                    inflight[to] = copier.submit(pf[layer], f"prefetch L{to} x{pf[layer]}", step, to)
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


# ---------------------------------------------------------------------------------------
# CPU-compute policies (cpu-static, hot-experts, cpu-on-miss): see moesim.sim.cpu_compute
# ---------------------------------------------------------------------------------------


def run_simpy_cpu(w, planner, link: Link, record: bool = False):
    """Reference run of a :class:`moesim.sim.cpu_compute.CpuWork`: the device stream, the copy
    engine and the CPU as SimPy entities. At each MoE layer's router the stream asks the
    planner for the device/CPU split (and, under cpu-on-miss, :func:`moesim.policy.cpu_or_copy`
    how many misses to copy, given the copy engine's queue), starts the CPU job, waits for
    its copies, runs its experts and then waits for the CPU."""
    env = simpy.Environment()
    spans: list[Span] | None = [] if record else None
    copier = CopyEngine(env, link, spans)
    cpu = simpy.Resource(env, capacity=1)
    times = w.times
    n_t, n_layers = w.attn.shape
    m_of = {layer: i for i, layer in enumerate(w.moe)}
    shape = (n_t, len(w.moe))
    n_gpu, n_cpu, n_copied, n_hits = (np.zeros(shape, np.int32) for _ in range(4))
    ends, copy_s, stall_s, wait_s, busy_s = (np.zeros(n_t) for _ in range(5))

    def cpu_job(seconds: float, step: int, layer: int):
        with cpu.request() as req:
            yield req
            start = env.now
            yield env.timeout(seconds)
            if spans is not None:
                spans.append(Span("cpu", f"cpu experts L{layer}", start, env.now, step, layer))

    def stream():
        for step, (attn, routed, other) in enumerate(zip(w.attn.tolist(), w.routed, w.other.tolist())):
            for layer in range(n_layers):
                start = env.now
                yield env.timeout(attn[layer])
                if spans is not None:
                    spans.append(Span("compute", f"attn L{layer}", start, env.now, step, layer))
                m = m_of.get(layer)
                if m is None:
                    continue
                now = env.now
                tokens = dict(routed[m])
                hits, misses = planner.split(m, list(tokens))
                hit_a = sum(tokens[e] for e in hits)
                miss_a = [tokens[e] for e in misses]
                c = 0
                if planner.copies:
                    c = cpu_or_copy(miss_a, hit_a, len(hits), now=now, link_free=copier.busy_until, times=times)
                landed = copier.submit(c, f"miss L{layer} x{c}", step, layer) if c else None
                cpu_s = times.cpu(len(misses) - c, sum(miss_a[c:]))
                cpu_done = env.process(cpu_job(cpu_s, step, layer)) if cpu_s else None
                if landed is not None:
                    copy_s[step] += link.copy_time(c)
                    yield landed
                    stall_s[step] += env.now - now
                gpu_s = times.gpu(len(hits) + c, hit_a + sum(miss_a[:c]))
                start = env.now
                yield env.timeout(gpu_s)
                if spans is not None and gpu_s:
                    spans.append(Span("compute", f"experts L{layer}", start, env.now, step, layer))
                if cpu_done is not None:
                    gpu_end = env.now
                    yield cpu_done
                    wait_s[step] += env.now - gpu_end
                busy_s[step] += cpu_s
                planner.finish(m, hits, misses[:c])
                n_gpu[step, m], n_cpu[step, m] = len(hits) + c, len(misses) - c
                n_copied[step, m], n_hits[step, m] = c, len(hits)
            start = env.now
            yield env.timeout(other)
            if spans is not None:
                spans.append(Span("compute", "lm head", start, env.now, step, -1))
            ends[step] = env.now

    env.run(env.process(stream()))
    return CpuRun(ends, copy_s, stall_s, wait_s, busy_s, n_gpu, n_cpu, n_copied, n_hits, spans or [])


# ---------------------------------------------------------------------------------------
# Copy-queue disciplines (moesim.policy.QUEUES): demand before prefetch (SimPy only)
# ---------------------------------------------------------------------------------------


class _Group:
    """One submitted transfer of ``n`` experts, copied one expert at a time. ``need`` is how
    many of its first experts a layer waits for (a prefetch's useful ones)."""

    def __init__(self, env: simpy.Environment, n: int, need: int, name: str, step: int, layer: int) -> None:
        self.n, self.need, self.name, self.step, self.layer = n, need, name, step, layer
        self.landed = 0
        self.queued = n
        self.needed = env.event()
        if need == 0:
            self.needed.succeed()


class QueuedCopyEngine:
    """A copy engine that serves demand copies before queued prefetch copies, one expert at
    a time, and can drop a prefetch's unstarted useless experts (``cancel``)."""

    def __init__(self, env: simpy.Environment, link: Link, spans: list[Span] | None) -> None:
        self.env, self.link, self.spans = env, link, spans
        self.demand: deque[_Group] = deque()
        self.prefetch: deque[_Group] = deque()
        self.issued = 0.0
        self.busy_until = 0.0
        self._wake: simpy.Event | None = None
        env.process(self._serve())

    def submit(self, n: int, need: int, demand: bool, name: str, step: int, layer: int) -> _Group:
        g = _Group(self.env, n, need, name, step, layer)
        work = self.link.copy_time(n)
        self.issued += work
        self.busy_until = max(self.busy_until, self.env.now) + work
        (self.demand if demand else self.prefetch).append(g)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return g

    def cancel(self, g: _Group) -> int:
        """Drop ``g``'s experts beyond the ones its layer needs that have not started."""
        drop = max(0, min(g.queued, g.n - g.need))  # unstarted items are the last ``queued``; useless ones are past ``need``
        if drop:
            g.queued -= drop
            g.n -= drop
            work = self.link.copy_time(drop)
            self.issued -= work
            self.busy_until -= work
            if g.queued == 0 and g in self.prefetch:
                self.prefetch.remove(g)
        return drop

    def _serve(self):
        env, per = self.env, self.link.per_expert
        while True:
            if not self.demand and not self.prefetch:
                self._wake = env.event()
                yield self._wake
            q = self.demand if self.demand else self.prefetch
            g = q[0]
            g.queued -= 1
            if g.queued == 0:
                q.popleft()
            start = env.now
            yield env.timeout(per)
            g.landed += 1
            if self.spans is not None:
                self.spans.append(Span("copy", f"{g.name} #{g.landed}", start, env.now, g.step, g.layer))
            if g.landed == g.need:
                g.needed.succeed()


def run_simpy_queued(w: Workload, link: Link, queue: str = "demand-first",
                     record: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Span]]:
    """:func:`run_simpy` with demand before prefetch.

    ``w.need[t, l]``: how many of the first experts prefetched for model layer l at step t
    the layer waits for, in the order the prefetch issued them (the plan's
    ``prefetch_need``: 1 + the position of the last one it executes). A layer waits for its
    demand copies and those only, as the executor's queued link does
    (``moesim.executor.transport.QueuedEmulatedLink``). ``demand-first`` serves demand copies
    before any queued prefetch expert; ``cancel-unstarted`` also drops, at the layer's
    router, the prefetched experts it will not wait for that have not started copying.
    """
    if queue not in QUEUES or queue == "fifo":
        raise ValueError(f"queue {queue!r}: use run_simpy for fifo; known: {', '.join(QUEUES)}")
    env = simpy.Environment()
    spans: list[Span] | None = [] if record else None
    copier = QueuedCopyEngine(env, link, spans)
    ends, busy, stalls = [], [], []
    slow = link.interference
    target = w.target.tolist()

    def timeout(work: float):
        if slow:
            return env.timeout(link.compute_end(env.now, work, copier.busy_until) - env.now)
        return env.timeout(work)

    def stream():
        for step in range(w.shape[0]):
            issued0, stalled = copier.issued, 0.0
            inflight: dict[int, _Group] = {}  # target layer -> its prefetch, issued at an earlier layer
            for layer in range(w.shape[1]):
                here = inflight.pop(layer, None)
                start = env.now
                yield timeout(float(w.attn[step, layer]))
                if spans is not None:
                    spans.append(Span("compute", f"attn L{layer}", start, env.now, step, layer))
                if here is not None and queue == "cancel-unstarted":
                    copier.cancel(here)
                dem = int(w.demand[step, layer])
                d = copier.submit(dem, dem, True, f"demand L{layer}", step, layer) if dem else None
                pf = int(w.prefetch[step, layer])
                if pf:
                    to = target[layer]
                    wait_for = min(pf, int(w.need[step, to]))
                    inflight[to] = copier.submit(pf, wait_for, False, f"prefetch L{to}", step, to)
                waits = [g.needed for g in (d, here) if g is not None and not g.needed.processed]
                if waits:
                    waited = env.now
                    yield simpy.AllOf(env, waits)
                    if link.wakeup:
                        yield env.timeout(link.wakeup)
                    stalled += env.now - waited
                g_s = float(w.experts[step, layer])
                if g_s:
                    start = env.now
                    yield timeout(g_s)
                    if spans is not None:
                        spans.append(Span("compute", f"experts L{layer}", start, env.now, step, layer))
            start = env.now
            yield timeout(float(w.other[step]))
            if spans is not None:
                spans.append(Span("compute", "lm head", start, env.now, step, -1))
            ends.append(env.now)
            busy.append(copier.issued - issued0)
            stalls.append(stalled)

    env.run(env.process(stream()))
    return np.array(ends), np.array(busy), np.array(stalls), spans or []
