"""``moesim whatif`` as one call: build the traces, sweep, pick the best, explain it.

Without a trace each model gets a **synthetic** trace (moesim.traces.synthetic) of the
given shape; the result says so (``synthetic``). The best configuration fits in device
memory and is never the oracle (:func:`moesim.sim.whatif.best`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesim import budget
from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.sim.analysis import bound
from moesim.sim.whatif import GOALS, Sweep, best, run_sweep
from moesim.traces.format import read_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

DEFAULT_MODELS = ("qwen3-30b-a3b",)
DEFAULT_HWS = ("a6000", "h100-sxm", "gh200")
DEFAULT_POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle", "all-resident")
DEFAULT_CACHE_GIB = (0.0, 8.0, 16.0)


@dataclass
class WhatIf:
    sweep: Sweep
    goal: str
    rows: list[dict[str, Any]]  # every configuration, with its "bound" (copy or compute)
    winner: dict[str, Any] | None  # best over everything (None: nothing fits)
    best_by_hw: dict[str, dict[str, Any] | None]
    synthetic: bool  # some trace is synthetic

    def ranked(self) -> list[dict[str, Any]]:
        """Fitting configurations first, then by the goal's figure."""
        key = GOALS[self.goal][0]
        return sorted(self.rows, key=lambda r: (not r["fits"], r[key]))


def check_unique_names(given: list[str] | tuple[str, ...], profiles: list) -> None:
    """Rows are keyed by profile name: two profiles with one name would report one's results twice."""
    seen: dict[str, str] = {}
    for g, p in zip(given, profiles):
        if p.name in seen:
            raise MoesimError(f"--hw: {seen[p.name]} and {g} are both named {p.name!r}; profile names must be unique in "
                              "a run (change `name` in the .toml, or `moesim fit --name`)")
        seen[p.name] = g


def whatif(trace: str | Path | None = None, models: tuple[str, ...] | list[str] = DEFAULT_MODELS,
           hws: tuple[str, ...] | list[str] = DEFAULT_HWS, policies: tuple[str, ...] | list[str] = DEFAULT_POLICIES,
           link_gbps: list[float] | None = None, cache_gib: tuple[float, ...] | list[float] = DEFAULT_CACHE_GIB,
           eviction: str = "lru", tokens: int = 256, prompt_len: int = 128, batch: int = 1, goal: str = "tpot",
           engine: str = "fast", jobs: int | None = None,
           progress: Callable[[int, int], None] | None = None, *, backend: str = "local",
           address: str | None = None, rows_csv: str | Path | None = None) -> WhatIf:
    """Sweep models x hardware x policies x link bandwidth (None: each profile's own) x cache size.

    ``backend``/``address``: where the groups run (:func:`moesim.sim.whatif.run_sweep`);
    ``rows_csv``: stream every row to this CSV as its group finishes, and resume an
    interrupted sweep from it (the same sweep run again skips the finished groups).
    """
    if jobs is not None and jobs < 0:
        raise MoesimError(f"--jobs {jobs}: a number of worker processes (0 = all cores)")
    if goal not in GOALS:
        raise MoesimError(f"unknown goal {goal!r}; known: {', '.join(GOALS)}")
    if trace is not None:
        t = read_trace(trace)
        if t.speculative:
            raise MoesimError(f"{trace} records speculative decoding: sweep it with "
                              "`moesim replay TRACE --gamma ... --policy ...`")
        traces = {t.model.name: t}
    else:
        params = SyntheticParams(tokens=tokens, batch=batch, prompt_len=prompt_len)
        traces = {}
        specs = [get_model(m) for m in models]
        for spec in specs:  # all sizes checked before any trace is made
            budget.check(budget.synth_estimate(spec, tokens, batch), warn=None)
        for spec in specs:
            traces[spec.name] = synthetic_trace(spec, params)
    profiles = [get_profile(h) for h in hws]
    check_unique_names(hws, profiles)
    sweep = Sweep(traces, profiles, list(policies), list(link_gbps) if link_gbps else [None],
                  list(cache_gib), eviction, engine)
    runs = sweep.size // max(1, len(sweep.traces))
    for t in traces.values():
        budget.check(budget.replay_estimate(t.model, t.n_tokens, t.batch, runs, engine,
                                            f"{runs} simulations of {t.n_tokens} steps of {t.model.name}"))
    rows = run_sweep(sweep, jobs, progress, backend=backend, address=address, out=rows_csv)
    for r in rows:
        r["bound"] = bound(r)
    by_hw = {h.name: best([r for r in rows if r["hw"] == h.name], goal) for h in sweep.hws}
    return WhatIf(sweep, goal, rows, best(rows, goal), by_hw, any(t.synthetic for t in traces.values()))
