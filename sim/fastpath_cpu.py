"""The fast path of the CPU-compute policies: :mod:`moesim.sim.cpu_compute`'s step model as a
per-layer recurrence, no event queue. Static placements timed by the cost model copy
nothing, so their layers are independent: ``moesim.sim.static`` prices them all at once
from token counts; the recurrence here serves cpu-on-miss and measured timings.

Two clocks: ``t``, when the device stream is next free, and ``link_free``, when the copy
engine is next free. The CPU needs no clock of its own: a layer waits for its CPU work,
so the CPU is idle whenever a router runs. A property test holds this to the SimPy
reference (``sim.engine.run_simpy_cpu``) decision for decision.
"""

from __future__ import annotations

import numpy as np

from moesim.policy import cpu_or_copy
from moesim.policy.placement import HostPlanner
from moesim.sim.cpu_run import CpuRun


def run_fast_cpu(w, planner: HostPlanner):
    """Simulate every step of ``w`` (a :class:`moesim.sim.cpu_compute.CpuWork`)."""
    times, per = w.times, w.times.copy
    n_t, n_layers = w.attn.shape
    m_of = {layer: i for i, layer in enumerate(w.moe)}
    shape = (n_t, len(w.moe))
    n_gpu, n_cpu, n_copied, n_hits = (np.zeros(shape, np.int32) for _ in range(4))
    ends, copy_s, stall_s, wait_s, busy_s = (np.zeros(n_t) for _ in range(5))
    t = link_free = 0.0
    for step, (attn, routed, other) in enumerate(zip(w.attn.tolist(), w.routed, w.other.tolist())):
        for layer in range(n_layers):
            t += attn[layer]
            m = m_of.get(layer)
            if m is None:
                continue
            tokens = dict(routed[m])
            hits, misses = planner.split(m, list(tokens))
            hit_a = sum(tokens[e] for e in hits)
            miss_a = [tokens[e] for e in misses]
            c = cpu_or_copy(miss_a, hit_a, len(hits), now=t, link_free=link_free, times=times) if planner.copies else 0
            gpu_start = t
            if c:
                link_free = max(link_free, t) + c * per
                copy_s[step] += c * per
                stall_s[step] += link_free - t
                gpu_start = link_free
            n_dev, n_cpu_ = len(hits) + c, len(misses) - c
            gpu_end = gpu_start + _measured(w.dev_per, step, m, n_dev, times.gpu(n_dev, hit_a + sum(miss_a[:c])))
            cpu = _measured(w.cpu_per, step, m, n_cpu_, times.cpu(n_cpu_, sum(miss_a[c:])))
            cpu_end = t + cpu
            busy_s[step] += cpu
            if cpu_end > gpu_end:
                wait_s[step] += cpu_end - gpu_end
            t = max(gpu_end, cpu_end)
            planner.finish(m, hits, misses[:c])
            n_gpu[step, m], n_cpu[step, m] = len(hits) + c, len(misses) - c
            n_copied[step, m], n_hits[step, m] = c, len(hits)
        t += other
        ends[step] = t
    return CpuRun(ends, copy_s, stall_s, wait_s, busy_s, n_gpu, n_cpu, n_copied, n_hits)


def _measured(per, step: int, m: int, n: int, roofline: float) -> float:
    """``n`` experts at a measured seconds-per-expert where the trace has one, else the roofline's time."""
    if per is not None and n:
        v = per[step, m]
        if v == v:  # not NaN
            return n * float(v)
    return roofline
