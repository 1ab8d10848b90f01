"""Engine figures fitted to published measurements, and the leave-one-source-out score.

A few engine figures stand in for what the cost model cannot know from a datasheet (how
much of the memory bandwidth an engine's CPU kernels draw, its KV-read efficiency, ...):
:data:`FIT` names them. :func:`fit` chooses them, per engine, to minimise a robust loss
(Cauchy, scale :data:`LOSS_SCALE`, the best of :data:`STARTS`) of ln(predicted / measured)
over the given entries of ``hwprofiles/published`` (:mod:`moesim.sim.published`: the same
prediction ``moesim validate --published`` makes). A figure no given entry informs keeps
its :data:`UNFITTED` value.

:func:`leave_one_source_out` is the accuracy claim: each entry is predicted with figures
fitted on every entry *except those of its own source* (a source is one issue thread, one
article, one tutorial page: :func:`moesim.sim.published.source_id`), so no figure is judged
on the rows it was tuned on, nor on rows that share their author's hardware, engine
version and measuring habits. ``bench/fit_engines.py --write`` fits on every source and
writes the shipped figures (what ``whatif`` and ``replay`` use).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from moesim.engines import EngineProfile, get_engine
from moesim.sim.pool import run_pool, worker_ignores_stops
from moesim.sim.published import Entry, entries, run_published

#: engine -> [(figure, lower bound, upper bound)]: what a fit may change, per engine. Only
#: what the engine's software decides and no datasheet gives; a GPU's kernel launch cost is
#: not here (it ran to its bound whenever its one GPU-bound source was left out).
FIT: dict[str, list[tuple[str, float, float]]] = {
    "ktransformers": [("cpu_weight_efficiency.default", 0.05, 1.0), ("numa_efficiency", 0.0, 1.0)],
    "llama.cpp": [("cpu_weight_efficiency.default", 0.05, 1.0), ("cpu_weight_efficiency.iq1_s", 0.02, 1.0),
                  ("gpu_weight_efficiency.default", 0.05, 1.0)],
    "mixtral-offloading": [("link_efficiency", 0.02, 1.0)],
    "moe-infinity": [("link_efficiency", 0.02, 1.0)],
    "vllm": [("gpu_weight_efficiency.default", 0.05, 1.0)],
}
#: engine -> (figure, the engine whose fitted figure it takes): ik_llama.cpp's CPU kernels
#: are llama.cpp's lineage, and it has too few CPU entries of its own; SGLang's fused MoE
#: kernel is adapted from vLLM's (hwprofiles/engines/sglang.toml says where).
INHERIT = {"ik_llama.cpp": (("cpu_weight_efficiency.default", "llama.cpp"), ("gpu_weight_efficiency.default", "llama.cpp")),
           "sglang": (("gpu_weight_efficiency.default", "vllm"),)}
#: What the cost model assumes of a fitted figure that no entry informs: kernels at the full
#: bandwidth, a second socket adding nothing, the link at its rate, every layer kind at its
#: roofline. (KV-cache reads are not fitted: attention reads the bytes it holds through the
#: engine's GPU kernels, at their bf16 efficiency; moesim.costmodel.CostModel.kv_efficiency.)
UNFITTED = {"cpu_weight_efficiency": 1.0, "gpu_weight_efficiency": 1.0, "numa_efficiency": 0.0,
            "link_efficiency": 1.0, "layer_efficiency": 1.0}
LOSS_SCALE = 0.2
#: The fits' convergence tolerances (scipy's defaults are 1e-8): a figure is used to three
#: significant digits, and stopping there takes about a third fewer predictions of every entry.
TOL = 1e-3
#: Where each fit starts, as a share of each figure's range: a robust loss has local minima
#: (it may "explain" the well-fitted points by calling the rest outliers), so the best of these.
STARTS = (0.15, 0.5, 0.85)


def unfitted_value(key: str) -> float:
    return UNFITTED[key.split(".")[0]]


@dataclass(frozen=True)
class Fitted:
    """One engine's profile with its fitted figures, and what they were fitted on."""

    engine: EngineProfile
    figures: dict[str, float]
    entries: tuple[str, ...]
    uninformed: tuple[str, ...] = field(default=())


def _with(engine: EngineProfile, values: dict[str, float], kind: str, source: str) -> EngineProfile:
    for key, v in values.items():
        engine = engine.with_figure(key, float(v), kind, source)
    return engine


def unfitted(name: str) -> EngineProfile:
    """The engine's profile with every figure of :data:`FIT` (and :data:`INHERIT`) at its
    :data:`UNFITTED` value: what a prediction has where no other source informs a figure."""
    keys = [k for k, _, _ in FIT.get(name, ())] + [k for k, _ in INHERIT.get(name, ())]
    return _with(get_engine(name), {k: unfitted_value(k) for k in keys}, "estimate",
                 "unfitted: no measurement of another source informs it (moesim.sim.engine_fit.UNFITTED)")


#: (engine, entry ids) -> its fit, for this process: leave-one-source-out fits an engine on the
#: same entries for every source that has none of them, and a second run (``--json`` after the
#: table) refits nothing. Workers send theirs back (:func:`leave_one_source_out`).
_FITS: dict[tuple[str, tuple[str, ...]], Fitted] = {}


def _fit_one(name: str, ids: tuple[str, ...]) -> Fitted:
    """``name`` fitted on the entries ``ids`` (memoised in :data:`_FITS`)."""
    if (name, ids) not in _FITS:
        _FITS[name, ids] = _fit_uncached(name, ids)
    return _FITS[name, ids]


def _fit_uncached(name: str, ids: tuple[str, ...]) -> Fitted:
    """``name`` fitted on the entries ``ids``."""
    by_id = {e.id: e for e in entries()}
    mine = tuple(by_id[i] for i in ids)
    figures = FIT.get(name, [])
    if not mine or not figures:
        return Fitted(unfitted(name), {}, ())
    keys = [k for k, _, _ in figures]
    ids = tuple(e.id for e in mine)
    n_sources = len({e.source for e in mine})
    source = (f"fitted by moesim.sim.engine_fit on {len(ids)} published entries from {n_sources} sources "
              f"({', '.join(ids)}); robust least squares on ln(predicted / measured)")
    base = unfitted(name)

    def residuals(x):
        eng = _with(base, dict(zip(keys, x)), "fitted", source)
        return np.array([r["ln_error"] for r in run_published({name: eng}, list(mine))])

    lo, hi = np.array([f[1] for f in figures]), np.array([f[2] for f in figures])
    fits = [least_squares(residuals, lo + (hi - lo) * q, bounds=(lo, hi), loss="cauchy", f_scale=LOSS_SCALE,
                          diff_step=1e-3, ftol=TOL, xtol=TOL, gtol=TOL) for q in STARTS]
    best = min(fits, key=lambda r: r.cost)
    # A figure none of these entries depends on (its Jacobian column is zero: an iq1_s
    # efficiency with no iq1_s entry) is not fitted: it keeps its unfitted value.
    informed = np.abs(best.jac).sum(axis=0) > 1e-9
    values = {k: float(v) for k, v, ok in zip(keys, best.x, informed) if ok}
    uninformed = tuple(k for k, ok in zip(keys, informed) if not ok)
    return Fitted(_with(base, values, "fitted", source), values, ids, uninformed)


def fit(train: Sequence[Entry], names: Iterable[str] | None = None) -> dict[str, Fitted]:
    """Each engine of ``names`` (default: every engine of :data:`FIT` and :data:`INHERIT`) fitted on its entries
    of ``train``; an engine of :data:`INHERIT` also takes its donor's figure."""
    def ids(name: str) -> tuple[str, ...]:
        return tuple(e.id for e in train if e.setting["engine"] == name)

    out = {}
    for name in names if names is not None else dict.fromkeys([*FIT, *INHERIT]):
        f = _fit_one(name, ids(name))
        for key, donor in INHERIT.get(name, ()):
            d = _fit_one(donor, ids(donor))
            if key in d.figures:
                src = (f"fitted: {donor}'s figure, the same kernel lineage (fitted on {len(d.entries)} "
                       f"{donor} entries: {', '.join(d.entries)})")
                f = Fitted(f.engine.with_figure(key, d.figures[key], "fitted", src), {**f.figures, key: d.figures[key]},
                           f.entries + tuple(e for e in d.entries if e not in f.entries), f.uninformed)
        out[name] = f
    return out


def leave_one_source_out(which: Sequence[Entry] | None = None,
                         progress: Callable[[int, int], None] | None = None, jobs: int | None = None) -> list[dict]:
    """One row per entry (:func:`moesim.sim.published.run_published`'s), predicted with
    engine figures fitted on every entry of the other sources; each row adds how many
    entries and sources those figures were fitted on (0: the unfitted defaults). The
    sources' folds run on ``jobs`` worker processes (default: one a core, at most one a
    source; 1: in this process), each fit made once and sent back to this process's memo."""
    every = entries()
    which = list(which) if which is not None else list(every)
    sources = list(dict.fromkeys(e.source for e in which))
    jobs = min(len(sources), os.cpu_count() or 1) if jobs is None else jobs
    rows: list[dict] = []
    if jobs <= 1 or len(sources) <= 1:
        for i, src in enumerate(sources):
            rows += _fold(src, which, every)
            if progress:
                progress(i + 1, len(sources))
    else:
        for done, (_, out) in enumerate(run_pool(_fold_in_worker, sources, jobs, _init_fold, (which, every)), 1):
            if isinstance(out, BaseException):
                raise out
            fold_rows, fits = out
            rows += fold_rows
            _FITS.update(fits)
            if progress:
                progress(done, len(sources))
    order = {e.id: k for k, e in enumerate(which)}
    return sorted(rows, key=lambda r: order[r["id"]])


def _fold(src: str, which: Sequence[Entry], every: Sequence[Entry]) -> list[dict]:
    """The rows of ``which`` from source ``src``, predicted with figures fitted without it."""
    held = [e for e in which if e.source == src]
    train = tuple(e for e in every if e.source != src)
    fitted = fit(train, {e.setting["engine"] for e in held})
    rows = []
    for row, e in zip(run_published({n: f.engine for n, f in fitted.items()}, held), held):
        f = fitted[e.setting["engine"]]
        row["fitted_on_entries"] = len(f.entries)
        row["fitted_on_sources"] = len({t.source for t in train if t.id in set(f.entries)})
        row["fitted_figures"] = dict(f.figures)
        rows.append(row)
    return rows


_FOLD_INPUT: tuple | None = None  # a worker's (which, every), set by its initializer


def _init_fold(which: Sequence[Entry], every: Sequence[Entry]) -> None:
    global _FOLD_INPUT
    worker_ignores_stops()
    _FOLD_INPUT = (which, every)


def _fold_in_worker(src: str) -> tuple[list[dict], dict]:
    """A worker's fold, and the fits it made (for the parent's memo)."""
    assert _FOLD_INPUT is not None
    before = set(_FITS)
    rows = _fold(src, *_FOLD_INPUT)
    return rows, {k: v for k, v in _FITS.items() if k not in before}
