"""How sure an answer is: an interval on every predicted tokens/s and TPOT.

A prediction's error depends far more on what kind of deployment it is and which engine
runs it than on anything else moesim knows (``moesim validate --published``: an all-GPU
vLLM row is typically within 20%, a llama.cpp layer split off by 3x). So the interval
comes from moesim's own errors on published measurements of the same class, judged as
the accuracy claim is, **leaving one source out** (:mod:`moesim.sim.engine_fit`): the
residuals ``ln(predicted / measured)`` that ``python bench/fit_engines.py --write``
stores in ``hwprofiles/published/residuals.toml``.

The interval is split-conformal (Lei, G'Sell, Rinaldo, Tibshirani and Wasserman,
"Distribution-Free Predictive Inference for Regression", JASA 2018): with n residuals of
the class, the bounds are the ``ceil((n + 1)(1 - a/2))``-th and ``floor((n + 1) a/2)``-th
order statistics, for a nominal coverage of ``1 - a`` (:data:`NOMINAL`), valid when the
new prediction's error is exchangeable with the class's. A class (deployment kind x
engine) with fewer than :data:`MIN_CLASS` residuals, or from fewer than :data:`MIN_SOURCES`
sources, is pooled toward its deployment kind (every engine), and a kind too small toward
every entry; the interval says which (:attr:`Interval.basis`). A calibrated answer (``moesim fit --measured``) takes its
interval from the leave-one-row-out residuals of its own calibration instead
(:func:`calibrated`).

:func:`coverage` checks the claim: each published entry's interval built from the other
sources' residuals only, and how often it holds the measurement.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from moesim.engines import ENGINE_ALIASES
from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.policy import family_range_kind
from moesim.sim import targets

#: The interval's nominal coverage: it should hold this share of measurements.
NOMINAL = 0.8
#: The fewest residuals a class is used with alone: with fewer, the conformal order
#: statistic for a two-sided 80% interval does not exist ((n + 1) x 0.9 > n), so it pools.
MIN_CLASS = 9
#: The fewest sources a class (kind x engine) is used alone with: one source's entries share its
#: author's machine, engine build and habits, so they err together and count as one draw more
#: than as several; a class of few sources is pooled toward its kind.
MIN_SOURCES = 8
#: The fewest entries a deployment kind is scored with on its own by :func:`coverage`.
PER_KIND_MIN = 8
#: Where the residuals are shipped (package data, beside the measurements they came from).
RESIDUALS_FILE = "residuals.toml"



@dataclass(frozen=True)
class Residual:
    """One published entry's leave-one-source-out error."""

    id: str
    source: str
    kind: str
    engine: str
    ln_error: float  # ln(predicted / measured)


@dataclass(frozen=True)
class Interval:
    """Where the measured value is expected to fall, as factors on the predicted tokens/s:
    measured tokens/s in ``[low x predicted, high x predicted]`` with :data:`NOMINAL` coverage."""

    low: float
    high: float
    basis: str  # what the residuals were: "llama.cpp, experts on the CPU: 24 published entries", ...
    entries: int

    def tps(self, tps: float) -> tuple[float, float]:
        return tps * self.low, tps * self.high

    def tpot_ms(self, ms: float) -> tuple[float, float]:
        """The TPOT range (a slower measurement is a longer TPOT)."""
        return ms / self.high, ms / self.low

    def contains(self, ln_error: float) -> bool:
        """Whether a measurement whose prediction erred by ``ln_error`` falls inside."""
        return math.log(self.low) <= -ln_error <= math.log(self.high)

    def words(self) -> str:
        return f"{NOMINAL:.0%} range x{self.low:.2f}..x{self.high:.2f} ({self.basis})"


def conformal(ln_errors: Sequence[float], basis: str, nominal: float = NOMINAL) -> Interval:
    """The split-conformal interval of ``ln_errors`` (see the module docstring)."""
    e = sorted(-x for x in ln_errors)  # ln(measured / predicted)
    n = len(e)
    tail = (1.0 - nominal) / 2
    hi_k = math.ceil(round((n + 1) * (1 - tail), 9))  # rounded: (9 + 1) x 0.9 is 9.000000000000002 in floats
    lo_k = math.floor(round((n + 1) * tail, 9))
    if n == 0 or hi_k > n or lo_k < 1:
        raise MoesimError(f"{basis}: {n} residuals are too few for a {nominal:.0%} interval")
    return Interval(math.exp(e[lo_k - 1]), math.exp(e[hi_k - 1]), basis, n)


def _path():
    return resources.files("moesim.hwprofiles").joinpath("published", RESIDUALS_FILE)


@functools.lru_cache(maxsize=1)
def _shipped() -> dict[str, Any]:
    return tomllib.loads(_path().read_text(encoding="utf-8"))


def _read(key: str) -> tuple[Residual, ...]:
    return tuple(Residual(r["id"], r["source"], r["kind"], r["engine"], float(r["ln_error"])) for r in _shipped()[key])


def residuals() -> tuple[Residual, ...]:
    """The shipped leave-one-source-out residuals (``bench/fit_engines.py --write`` writes them)."""
    return _read("entry")


def calibrated_residuals() -> tuple[Residual, ...]:
    """The shipped residuals of the published rows predicted after calibrating on one other row
    of the same source and machine (:func:`moesim.sim.calibrate.published_calibration`)."""
    return _read("calibrated")


def residuals_toml(rows: Iterable[dict[str, Any]], calibrated: Iterable[dict[str, Any]], made_by: str,
                   shipped: Iterable[dict[str, Any]] = ()) -> str:
    """The residual file: leave-one-source-out rows (:func:`moesim.sim.engine_fit.leave_one_source_out`'s),
    the calibrated ones (:func:`moesim.sim.calibrate.published_calibration`'s), and each entry's
    prediction with the shipped figures (``shipped``: :func:`moesim.sim.published.run_published`'s
    rows), so that ``moesim validate --published`` can name every prediction a change moved."""
    import tomli_w  # a well-kept writer: the sources' addresses quoted and escaped right

    def entry(r: dict[str, Any]) -> dict[str, Any]:
        return {"id": r["id"], "source": r["source_id"], "kind": r["kind"], "engine": r["engine"],
                "ln_error": round(float(r["ln_error"]), 6)}

    with_shipped = {r["id"]: round(float(r["ln_error"]), 6) for r in shipped}
    entries = [entry(r) | ({"shipped_ln_error": with_shipped[r["id"]]} if r["id"] in with_shipped else {})
               for r in rows]
    head = ("# Leave-one-source-out residuals ln(predicted / measured) of moesim's predictions of the published\n"
            "# measurements (hwprofiles/published): each entry predicted with engine figures fitted on the other\n"
            "# sources only; [[calibrated]]: the rows of a source's machine predicted after calibrating on its first\n"
            "# row. moesim.sim.intervals turns them into the range printed beside every answer.\n"
            f"# Written by {made_by}; do not edit by hand.\n")
    return head + tomli_w.dumps({"nominal": NOMINAL, "entry": entries, "calibrated": [entry(r) for r in calibrated]})


#: A prediction that moved by more than this factor against the committed one is named.
MOVED = 1.10


def moved(rows: Sequence[dict[str, Any]], key: str = "ln_error") -> list[dict[str, Any]]:
    """The rows whose prediction moved by more than :data:`MOVED` against the committed file's
    (``key``: ``ln_error``, leave one source out, or ``shipped_ln_error``), and entries new to it."""
    before = {r["id"]: r.get(key) for r in _shipped()["entry"]}
    out = []
    for r in rows:
        old = before.get(r["id"])
        if old is None:
            out.append({"id": r["id"], "was": None, "now": r["ratio"], "change": None})
        elif abs(float(r["ln_error"]) - old) > math.log(MOVED):
            out.append({"id": r["id"], "was": math.exp(old), "now": r["ratio"],
                        "change": math.exp(float(r["ln_error"]) - old)})
    return out


def kind_of(family: str, n_gpus: int, row: dict[str, Any] | None = None) -> str:
    """The deployment kind a configuration belongs to (the published suite's classes): by what
    the deployment does as predicted (``row``: its CPU time and the bytes it moves over the
    link), so that two spellings of one deployment get one range (``cpu-static`` with no layer
    on the CPU, ``gpu-layers`` with every layer on the GPU and ``all-resident`` are all-GPU);
    by the family where no prediction says."""
    if n_gpus == 0:
        return "all-CPU"
    if n_gpus > 1:
        return "multi-GPU"
    kind = family_range_kind(family)  # the family's own (moesim.policy), where the prediction does not say
    if not row or not row.get("tokens_per_s"):
        return kind
    cpu = (row.get("cpu_ms") or 0) > 0
    moved = (row.get("gb_moved_per_token") or 0) > 0
    if not cpu and not moved:
        return "all-GPU"  # every weight on the GPU, whatever the label
    if cpu:
        return kind if kind in ("layer split", "experts on the CPU") else "experts on the CPU"
    return "copy offload"


def interval_for(kind: str, engine: str, pool: Sequence[Residual] | None = None,
                 exclude_source: str | None = None) -> Interval:
    """The interval of a prediction of ``kind`` under ``engine``: from its class's residuals,
    pooled toward the kind, then every entry, when a class has fewer than :data:`MIN_CLASS`
    (``exclude_source``: leave that source's residuals out, as :func:`coverage` does)."""
    if pool is None and exclude_source is None:
        return _shipped_interval(kind, engine)
    pool = residuals() if pool is None else pool
    if exclude_source is not None:
        pool = [r for r in pool if r.source != exclude_source]
    return _interval(kind, engine, tuple(pool))


@functools.lru_cache(maxsize=64)
def _shipped_interval(kind: str, engine: str) -> Interval:
    """:func:`_interval` over the shipped residuals, once per class (a sweep asks per row)."""
    return _interval(kind, engine, residuals())


@functools.lru_cache(maxsize=256)
def _interval(kind: str, engine: str, pool: tuple[Residual, ...]) -> Interval:
    own = [r for r in pool if r.kind == kind and r.engine == engine]
    n_src = len({r.source for r in own})
    if len(own) >= MIN_CLASS and n_src >= MIN_SOURCES:
        return conformal([r.ln_error for r in own], f"{engine}, {kind}: {len(own)} published entries from {n_src} "
                                                    "sources, leave one source out")
    why = f"{engine}: {len(own)} of the kind, from {n_src} sources"
    for basis, keep in ((f"{kind}, any engine", lambda r: r.kind == kind), ("every deployment kind", lambda r: True)):
        sel = [r for r in pool if keep(r)]
        if len(sel) >= MIN_CLASS:
            return conformal([r.ln_error for r in sel], f"{basis}: {len(sel)} published entries from "
                                                        f"{len({r.source for r in sel})} sources, leave one source "
                                                        f"out; pooled, too few of {why}")
        why = f"{kind}: {len(sel)}"
    raise MoesimError(f"too few published residuals for an interval ({len(pool)})")


def row_interval(row: dict[str, Any], calibration: dict[str, Any] | None = None,
                 kind: str | None = None) -> Interval | None:
    """The interval of a what-if or replay row (None where it has no prediction): its deployment
    ``kind`` (default: from the row's family, GPUs and split), its engine; under a calibrated
    engine profile (its ``calibration``), the calibration's own interval (:func:`calibrated`)."""
    if not row.get("tokens_per_s"):
        return None
    if calibration:
        return calibrated(calibration)
    if kind is None:
        n_gpus = 0 if str(row.get("hw", "")) == "none" else (2 if row.get("split") not in (None, "-") else 1)
        kind = kind_of(str(row.get("family", "")), n_gpus, row)
    engine = str(row.get("engine", ""))
    return interval_for(kind, ENGINE_ALIASES.get(engine, engine))  # Ollama's rows are llama.cpp's class


def calibrated(cal: dict[str, Any] | None) -> Interval | None:
    """A calibrated engine profile's interval (its ``[calibration]``: ``low``, ``high``, ``rows``,
    ``basis``), else None."""
    if not cal:
        return None
    return Interval(float(cal["low"]), float(cal["high"]), str(cal["basis"]), int(cal["rows"]))


#: The columns :func:`with_range` adds to a what-if row.
RANGE_COLUMNS = ("tokens_per_s_low", "tokens_per_s_high", "tpot_ms_low", "tpot_ms_high", "range_basis")


def with_range(row: dict[str, Any], calibration: dict[str, Any] | None = None,
               kind: str | None = None) -> dict[str, Any]:
    """``row`` with its interval's columns (:data:`RANGE_COLUMNS`; None / ``-`` without a prediction)."""
    iv = row_interval(row, calibration, kind)
    if iv is None:
        return {**row, **dict.fromkeys(RANGE_COLUMNS[:4]), "range_basis": "-"}
    lo, hi = iv.tps(row["tokens_per_s"])
    tlo, thi = iv.tpot_ms(row["tpot_ms"])
    return {**row, "tokens_per_s_low": lo, "tokens_per_s_high": hi, "tpot_ms_low": tlo, "tpot_ms_high": thi,
            "range_basis": iv.basis}


def range_text(row: dict[str, Any], what: str = "tokens_per_s") -> str:
    """A row's range in words for a terminal: ``14.2-24.0`` (``-`` without one)."""
    lo, hi = row.get(f"{what}_low"), row.get(f"{what}_high")
    if lo is None or hi is None:
        return "-"
    return f"{number(lo)}-{number(hi)}"


#: A range wider than this (high / low) comes with how to narrow it (:func:`how_sure`).
WIDE = 3.0


def how_sure(row: dict[str, Any]) -> str | None:
    """A row's range in words a user acts on, with how to narrow it when it spans more than
    :data:`WIDE` (None without a range)."""
    lo, hi = row.get("tokens_per_s_low"), row.get("tokens_per_s_high")
    if lo is None or hi is None or row.get("range_basis") in (None, "-"):
        return None
    text = (f"{NOMINAL:.0%} of measured deployments like this ran between {number(lo)} and {number(hi)} tok/s "
            f"({row['range_basis']})")
    if lo > 0 and hi / lo > WIDE:
        text += (f"; the range spans x{hi / lo:.0f}: time one run with your engine (llama-bench -n 128, or the "
                 "engine's own timing lines) and `moesim fit --measured FILE` calibrates on it "
                 "(docs/measured-formats.md)")
    return text


def coverage(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How often each leave-one-source-out row's interval, built from the *other* sources'
    residuals, holds its measurement: overall and per kind (kinds of at least
    :data:`MIN_CLASS` entries; the target: :data:`moesim.sim.targets.COVERAGE`)."""
    pool = tuple(Residual(r["id"], r["source_id"], r["kind"], r["engine"], float(r["ln_error"])) for r in rows)
    hits: list[tuple[str, bool, Interval]] = []
    without = 0
    for r in pool:
        try:
            i = interval_for(r.kind, r.engine, pool, exclude_source=r.source)
        except MoesimError:  # too few other residuals for any interval: counted apart, never as covered
            without += 1
            continue
        hits.append((r.kind, i.contains(r.ln_error), i))

    def share(sel: list[tuple[str, bool, Interval]]) -> dict[str, Any]:
        if not sel:
            return {"entries": 0, "covered": 0, "coverage": None, "median_width": None}
        return {"entries": len(sel), "covered": sum(h for _, h, _ in sel), "coverage": sum(h for _, h, _ in sel) / len(sel),
                "median_width": sorted(i.high / i.low for _, _, i in sel)[len(sel) // 2]}

    kinds = sorted({k for k, _, _ in hits})
    by_kind = {k: share([h for h in hits if h[0] == k]) for k in kinds
               if sum(1 for h in hits if h[0] == k) >= PER_KIND_MIN}
    overall = share(hits)
    lo, hi = targets.COVERAGE
    ok = overall["coverage"] is not None and lo <= overall["coverage"] <= hi
    return {"nominal": NOMINAL, "target": [lo, hi], "overall": overall, "by_kind": by_kind,
            "without_range": without, "meets_target": bool(ok and not without
                                                            and all(lo <= k["coverage"] <= hi for k in by_kind.values()))}
