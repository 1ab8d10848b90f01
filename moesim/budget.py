"""How much memory and time a run will take, estimated before it starts.

A run that cannot fit in this machine's memory is refused with the estimate in the
message (instead of a ``MemoryError`` or the kernel's OOM killer minutes later); a run
that will take very long is announced with its estimate, and one that would take more
than :data:`REFUSE_S` is refused. One function per command kind, all returning an
:class:`Estimate`; :func:`check` applies the policy.

The per-unit constants are deliberately rough upper bounds (an order of magnitude is
what the decision needs). Memory constants are peak Python heap per routing cell
(one token x MoE layer x sequence x top-k slot), measured with ``tracemalloc`` on
Qwen3-30B-A3B synthetic traces (synthesis: about 45 B/cell beyond a fixed ~240 MB of
chunk buffers, from runs of 2048 and 8192 steps; reading a trace: about 18 B/cell;
replay: about 25 B/cell, from runs of 128 and 512 steps) and rounded up. Time constants are
measured per-unit costs of the SimPy engine and the fast path (replays and sweeps, counted
as cells of work: within 3x of the real time on a shared 2-core machine, idle or loaded)
and, for the executor, generous costs of bytes over the (emulated) link and host memory.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from moesim.errors import MoesimError
from moesim.fmt import number, plural
from moesim.host_detect import available_memory  # noqa: F401 (part of this module's API)
from moesim.models import ModelSpec
from moesim.policy import as_policy

REPLAY_BYTES_PER_CELL = 64  # per policy simulated at once, plus the trace itself
TRACE_BYTES_PER_CELL = 8  # true ids (int16), gates (float32), predicted ids (int16)
#: A synthetic trace in memory holds its arrays and no more (the compiled sampler's tables are
#: layers x experts); drawn into a file, it holds two chunks (moesim.traces.synthetic).
SYNTH_BYTES_PER_CELL = TRACE_BYTES_PER_CELL
SYNTH_FIXED_BYTES = 256 * 2**20
# Seconds per decode step x MoE layer x sequence x top-k slot of a synthetic trace, drawn and
# written (fsync included). Measured by bench/bench_estimates.py (bench/estimates.json): about
# 9e-8 on an idle 2-core machine and 2.6e-7 with three other processes busy; the middle, so
# the estimate is within 3x either way (it was 5e-6, from before the sampler was
# compiled: 19 s said for a 1.2 s trace).
SYNTH_S_PER_CELL = 1.5e-7
# One replay of one policy, per decode step x MoE layer x sequence (bench/bench_estimates.py):
# SimPy 1.2e-5 s with one other process busy and 5e-5 s with three (256 and 1,024 steps of
# Qwen3-30B-A3B); the fast path 1e-7 s and 2.6e-7 s (10,000 and 40,000 steps; it was 2e-6, from
# before the planner was compiled: 15 s said for 2 s). Each the middle of the two.
SIMPY_S_PER_STEP_LAYER = 2.4e-5
FAST_S_PER_STEP_LAYER = 2e-7
# A sweep's rows (moesim whatif): one row (a profile and link of a group) costs, per decode step
# x MoE layer x sequence, what the way it is timed costs, plus a fixed cost per group (its plan
# and compute times). Three ways (:func:`row_kind`): the copy policies on the chosen simulator
# (SimPy 3.2e-5 s measured, the fast path 2.6e-7), the static CPU placements priced from token
# counts at once (cpu-static, gpu-layers, hot-experts, weight-streaming: 3e-6 to 9e-6 on either
# simulator), and cpu-on-miss's per-layer recurrence in Python (8e-5 with one other process busy,
# 2.7e-4 fast and 3.3e-4 SimPy with three; the middle). Measured on OLMoE sweeps of 128 and 512
# steps (bench/bench_estimates.py's whatif cases check the sum). Counted as copy rows only, a fast sweep of
# the default policies was said to take 3.9 s and took 18 s, and a cpu-on-miss replay of 100,000
# Qwen3-30B-A3B steps was said to take 10 s (at the measured cost it takes about 20 minutes).
SWEEP_S_PER_ROW_CELL = {"copy-simpy": 2.5e-5, "copy-fast": 3e-7, "static": 6e-6, "miss": 1.5e-4}
SWEEP_S_PER_GROUP = 0.05
HOST_COPY_GBS = 2.0  # a CPU executor's expert compute and weight reads, conservatively
# The reference executor's own time per expert it runs in a decode step (its forward hooks, the
# emulated link's copy thread handing each copy over and pacing it, the expert's small
# matmuls): a tiny model's step is this, not its bytes. Measured by bench/bench_estimates.py
# (the tiny catalogue model and the shipped moe-stdlib checkpoint, on-demand and prefetch-fom,
# 16 and 64 steps): 1 to 4 ms an expert with one other process busy, 4 to 12 ms with three (it
# was left out: 0.02 s said for a 2.5 s run).
EXECUTOR_S_PER_EXPERT = 3e-3
WARN_S = 600.0  # announce runs longer than this
REFUSE_S = 24 * 3600.0  # refuse runs longer than a day: almost always a typo
MEMORY_HEADROOM = 0.8  # of the memory available now


@dataclass(frozen=True)
class Estimate:
    """A run's estimated peak memory (bytes) and duration (seconds), and what it is."""

    what: str
    bytes: float
    seconds: float
    #: what to ask for instead, in a refusal for time (the sizes that drive this estimate)
    smaller: str = "check the sizes asked for"

    def describe(self) -> str:
        return f"{self.what}: about {human_bytes(self.bytes)} of memory and {human_seconds(self.seconds)}"


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{number(n / size)} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s >= 86400 * 365:
        return f"{number(s / (86400 * 365))} years"
    if s >= 86400:
        return f"{number(s / 86400)} days"
    if s >= 3600:
        return f"{number(s / 3600)} h"
    if s >= 60:
        return f"{number(s / 60)} min"
    return f"{s:.2g} s"


def _cells(spec: ModelSpec, tokens: int, batch: int) -> float:
    return float(tokens) * spec.n_moe_layers * batch * spec.top_k


def synth_estimate(spec: ModelSpec, tokens: int, batch: int, prompt_len: int = 0,
                   held_cells: float | None = None) -> Estimate:
    """Synthesising a trace (``moesim synth``, ``whatif`` without ``--trace``) holding
    ``held_cells`` of it at once (None: all of it, in memory); its prompt's and tokens' ids
    are int32 a sequence (a prompt of 10^9 tokens was a MemoryError after 15 s)."""
    cells = _cells(spec, tokens, batch)
    held = cells if held_cells is None else min(cells, held_cells)
    ids = 4.0 * batch * (max(0, prompt_len) + tokens)
    return Estimate(f"a synthetic trace of {tokens} steps x batch {batch} of {spec.name}"
                    + (f" after a {prompt_len}-token prompt" if prompt_len else ""),
                    SYNTH_FIXED_BYTES + held * SYNTH_BYTES_PER_CELL + ids, cells * SYNTH_S_PER_CELL)


def row_kind(policy) -> str:
    """How a policy's rows are timed, for their cost (:data:`SWEEP_S_PER_ROW_CELL`): ``copy``
    (on the chosen simulator: the copy family, all-resident), ``static`` (a static layout
    with the host, priced from token counts at once) or ``miss`` (cpu-on-miss, a per-layer
    recurrence)."""
    pol = as_policy(policy)
    if not pol.uses_host:
        return "copy"
    return "static" if pol.static_on(1) else "miss"


def runs_by_kind(policies) -> dict[str, int]:
    """How many of ``policies`` (names or :class:`~moesim.policy.Policy` objects) are timed each way
    (:func:`row_kind`)."""
    kinds: dict[str, int] = {}
    for policy in policies:
        k = row_kind(policy)
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def _per_cell(kind: str, engine: str) -> float:
    return SWEEP_S_PER_ROW_CELL[f"copy-{engine}" if kind == "copy" else kind]


def _kinds(runs: int | Mapping[str, int]) -> dict[str, int]:
    return {"copy": runs} if isinstance(runs, int) else dict(runs)


def replay_estimate(spec: ModelSpec, tokens: int, batch: int, runs: int | Mapping[str, int] = 1,
                    engine: str = "simpy", what: str | None = None) -> Estimate:
    """Simulating a trace ``runs`` times (policies x configurations), one at a time; ``runs``
    a count of copy-policy runs, or runs by :func:`row_kind` (``{"copy": 3, "miss": 1}``)."""
    cells = _cells(spec, tokens, batch)
    kinds = _kinds(runs)
    copy = SIMPY_S_PER_STEP_LAYER if engine == "simpy" else FAST_S_PER_STEP_LAYER
    per = sum(n * (copy if k == "copy" else _per_cell(k, engine)) for k, n in kinds.items())
    return Estimate(what or f"{sum(kinds.values())} simulation(s) of {tokens} steps of {spec.name} ({engine} engine)",
                    cells * (TRACE_BYTES_PER_CELL + REPLAY_BYTES_PER_CELL),
                    float(tokens) * spec.n_moe_layers * max(1, batch) * per)


def sweep_estimate(shapes: list[tuple[ModelSpec, int, int]], groups_per_trace: int | Mapping[str, int],
                   rows_per_group: int, engine: str = "fast", workers: int = 1) -> Estimate:
    """A sweep (``moesim whatif``): ``shapes`` = (model, steps, batch) of each trace, each
    timed in ``groups_per_trace`` groups of ``rows_per_group`` rows (a count of copy-policy
    groups, or groups by :func:`row_kind`), on ``workers`` processes. Memory: every trace and
    one group's replay at a time per worker."""
    kinds = _kinds(groups_per_trace)
    n_groups = sum(kinds.values())
    per = sum(n * _per_cell(k, engine) for k, n in kinds.items())  # seconds a row-cell, summed over the groups
    cells = sum(float(t) * spec.n_moe_layers * max(1, b) for spec, t, b in shapes)
    seconds = (cells * per * rows_per_group + SWEEP_S_PER_GROUP * len(shapes) * n_groups) / max(1, workers)
    peak = max((_cells(spec, t, b) for spec, t, b in shapes), default=0.0)
    memory = sum(_cells(spec, t, b) for spec, t, b in shapes) * TRACE_BYTES_PER_CELL
    n = n_groups * rows_per_group * len(shapes)
    return Estimate(f"{n} configurations ({engine} simulator, {workers} worker(s))",
                    memory + peak * REPLAY_BYTES_PER_CELL * max(1, workers), seconds)


def decode_estimate(spec: ModelSpec, tokens: int, batch: int, dtype_bytes: int, link_gbps: float,
                    cache_experts: int, offload: bool, prompt_len: int = 0) -> Estimate:
    """The reference executor decoding ``tokens`` steps (``moesim profile``): every weight in
    host memory (at ``dtype_bytes`` a parameter), the device-side cache, the KV cache of
    ``batch`` sequences and each step's logits and routing records; per step, the routed
    experts cross the link (when offloaded), every weight a step uses is read once, and each
    expert it runs costs the executor's own overhead (:data:`EXECUTOR_S_PER_EXPERT`)."""
    scale = dtype_bytes / 2  # the catalogue's byte accounting is bf16
    context = prompt_len + tokens
    kv = float(spec.kv_cache_bytes(batch, context)) * scale
    per_seq = float(batch) * (spec.vocab * 4 * 2 + spec.hidden * 4 * 16  # logits, activations
                              + tokens * spec.n_moe_layers * spec.top_k * 16)  # routing records
    weights = (spec.non_expert_bytes + spec.all_expert_bytes) * scale
    expert = spec.expert_bytes * scale
    cache = min(cache_experts, spec.n_moe_layers * spec.n_experts) * expert
    run = spec.n_moe_layers * min(spec.n_experts, spec.top_k * batch)  # experts a step runs, at most
    moved = run * expert if offload else 0.0
    per_step = (moved / (link_gbps * 1e9) + (spec.non_expert_bytes * scale + moved + run * expert) / (HOST_COPY_GBS * 1e9)
                + run * EXECUTOR_S_PER_EXPERT)
    return Estimate(f"decoding {tokens} steps of {spec.name} ({human_bytes(weights)} of weights"
                    + (f", link {link_gbps:g} GB/s" if offload else "") + ")",
                    weights + cache + kv + per_seq, tokens * per_step, "check the sizes and the link bandwidth")


# Offline passes over text (calibrate; train-estimator's and train-expert-predictor's teacher
# forwards): the executor's batched forward, per token and layer, measured on moe-stdlib:
# calibrate on 4,096 and 16,384 tokens 2.3e-4 s beside another process, the predictor's draft
# and target over 2,048 and 8,192 tokens 5e-5 s; the middle. Training a small head on what those
# passes produced, per token and epoch: 6e-6 s measured (8,192 tokens, 1 and 41 epochs).
FORWARD_S_PER_TOKEN_LAYER = 1e-4
HEAD_S_PER_TOKEN_EPOCH = 1e-5


def offline_estimate(what: str, layers: int, tokens: int, epochs: int = 0) -> Estimate:
    """A pass of ``tokens`` through ``layers`` layers and, with ``epochs``, training a small
    head on them (``moesim calibrate``, ``train-estimator``, ``train-expert-predictor``): time only."""
    return Estimate(what, 16.0 * tokens,  # the token ids, as bytes and as a tensor of int64
                    float(tokens) * (layers * FORWARD_S_PER_TOKEN_LAYER + epochs * HEAD_S_PER_TOKEN_EPOCH),
                    "ask for fewer tokens or epochs")


CPU_TRAIN_FLOPS = 5e9  # achieved fp32 training FLOP/s of a CPU core or two, conservatively


def train_estimate(spec: ModelSpec, steps: int, batch: int, seq: int) -> Estimate:
    """CPU training (``moesim train``): fp32 parameters with gradients and two Adam moments
    (16 bytes a parameter), activations kept for the backward pass (per token and layer:
    about a dozen hidden-sized vectors, the routed experts' intermediates and the router
    logits; the LM head's logits, three copies), and 6 FLOPs per active parameter per token."""
    params = (spec.non_expert_bytes + spec.all_expert_bytes) / 2  # the byte accounting is bf16
    active = spec.bytes_per_token() / 2
    tokens = float(batch) * seq
    per_token = 4 * (spec.n_layers * (12 * spec.hidden + 3 * spec.top_k * spec.expert_inter + spec.n_experts)
                     + 3 * spec.vocab)
    return Estimate(f"training {plural(steps, 'step')} of batch {batch} x {seq} tokens ({spec.name})",
                    16 * params + 2 * tokens * per_token, steps * 6 * active * tokens / CPU_TRAIN_FLOPS)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")


def check(est: Estimate, warn=_stderr) -> Estimate:
    """Refuse an estimate that cannot fit in memory or would take more than a day; call
    ``warn(line)`` (if given) for one that takes longer than :data:`WARN_S`."""
    avail = available_memory()
    if est.bytes > avail * MEMORY_HEADROOM:
        raise MoesimError(f"{est.describe()}; this machine has {human_bytes(avail)} available: refusing "
                          "(ask for fewer tokens, layers, sequences or a smaller cache)")
    if est.seconds > REFUSE_S:
        raise MoesimError(f"{est.describe()}: refusing a run estimated at more than a day ({est.smaller})")
    if est.seconds > WARN_S and warn is not None:
        warn(f"warning: {est.describe()} (estimate; Ctrl-C stops it)")
    return est
