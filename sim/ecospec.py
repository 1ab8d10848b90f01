"""EcoSpec at scale: the speculative what-if for any catalogue model on synthetic trees.

For a model, a tree shape and an acceptance model, :func:`ecospec_whatif` draws synthetic
verification steps (:mod:`moesim.traces.synthetic_speculative`), re-runs each selection
(confidence-only, EcoSpec ratio, EcoSpec Lagrangian) at each verification budget gamma
with the shared decisions of :mod:`moesim.selection`, and times the verified rows on each
deployment (:mod:`moesim.sim.deployment`) with the draft's cost from a draft profile
(:mod:`moesim.sim.draft`). Because every synthetic node's true experts and acceptance are
known, each re-selection is exact for the drawn steps; what is synthetic is the steps.

EcoSpec: cost-aware draft-tree selection for MoE speculative decoding (the EcoSpec paper,
which reports up to 1.62x over standard speculative decoding on Qwen3-235B-A22B, 1.50x on
gpt-oss-120b and 1.47x on DeepSeek-V3.1, GPU-resident). This module answers the same
questions in the model: tokens per step, distinct experts per verification, verification
latency, TPOT, and the speed-ups against no speculation and against confidence-only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moesim.budget import Estimate
from moesim.errors import MoesimError
from moesim.models import ModelSpec, get_model
from moesim.selection import lambda_ok
from moesim.sim.deployment import Deployment, get_deployment, seconds_per_distinct_expert, time_steps
from moesim.sim.draft import DraftProfile
from moesim.sim.plan import Step
from moesim.traces.synthetic_speculative import (
    SpecSynthParams,
    SynthSpec,
    check_selection,
    count,
    generate,
    generate_cost,
)


@dataclass(frozen=True)
class Selection:
    strategy: str  # confidence or ecospec
    score: str = "ratio"
    lam_per_layer_k: float = 0.0  # Lagrangian lambda x moe_layers x top_k (see lam)

    def __post_init__(self) -> None:
        check_selection(self.strategy, self.score)

    def lam(self, spec: ModelSpec) -> float:
        """The score's lambda. A candidate whose experts are all new adds moe_layers x top_k
        to the buffer; ``lam_per_layer_k`` is the probability it must then beat, so one value
        means the same trade on a 4-layer and a 58-layer model."""
        return self.lam_per_layer_k / (spec.n_moe_layers * spec.top_k)

    @property
    def label(self) -> str:
        if self.strategy == "confidence":
            return "confidence"
        return f"ecospec {self.score}" + (f" {self.lam_per_layer_k:g}" if self.score == "lagrangian" else "")


DEFAULT_PARAMS = SpecSynthParams()
DEFAULT_DRAFT = DraftProfile()
SELECTIONS_DEFAULT = (Selection("confidence"), Selection("ecospec", "ratio"), Selection("ecospec", "lagrangian", 1.0))


def parse_selections(text: str) -> tuple[Selection, ...]:
    """``confidence,ecospec:ratio,ecospec:lagrangian:0.5`` -> selections (``ecospec`` alone is
    the ratio score; a Lagrangian's number is ``lam_per_layer_k``, see :meth:`Selection.lam`)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        parts = item.split(":")
        try:
            lam = float(parts[2]) if len(parts) == 3 else 0.0
        except ValueError:
            raise MoesimError(f"--selection {item!r}: lambda {parts[2]!r} is not a number") from None
        if (len(parts) > 3 or not parts[0] or (parts[0] == "confidence" and len(parts) > 1) or not lambda_ok(lam)
                or (len(parts) == 3 and parts[1] != "lagrangian")):  # only the Lagrangian score has a lambda
            raise MoesimError(f"--selection {item!r}: write confidence, ecospec, ecospec:ratio or "
                              "ecospec:lagrangian:LAMBDA (LAMBDA >= 0)")
        out.append(Selection(parts[0], parts[1] if len(parts) > 1 else "ratio", lam))
    if not out:
        raise MoesimError("--selection: give at least one selection")
    return tuple(out)


def selection_orders(synth: SynthSpec, gamma: int, sel: Selection) -> list[list[int]]:
    """Per step, the nodes ``sel`` verifies at budget ``gamma`` in the order it chooses them.
    Greedy selection is a prefix rule, so the first g of these are its choice at any g <= gamma."""
    spec = synth.spec
    return [st.order(gamma, sel.strategy, sel.score, sel.lam(spec), spec.n_experts) for st in synth.steps]


def selected_steps(synth: SynthSpec, gamma: int, sel: Selection, orders: list[list[int]] | None = None) -> list[Step]:
    """The drawn steps as ``sel`` at budget ``gamma`` verifies them (exact: every node's
    true experts and acceptance are known). Gamma 0 is no speculation. ``orders``: the
    selection's orders at a budget >= gamma (:func:`selection_orders`), to select once."""
    spec = synth.spec
    if orders is None:
        orders = selection_orders(synth, gamma, sel) if gamma else [[] for _ in synth.steps]
    out = []
    for st, order in zip(synth.steps, orders, strict=True):
        chosen = order[:gamma]
        on, produced = set(chosen), 1
        for p in st.path:
            if p not in on:
                break
            produced += 1
        rows = [0] + [1 + c for c in chosen]
        true_ids, pred_ids = st.true_ids[rows], st.pred_ids[rows]  # [rows, M, k]
        true = [set(true_ids[:, m].ravel().tolist()) for m in range(spec.n_moe_layers)]
        pred = [set(pred_ids[:, m].ravel().tolist()) - {-1} for m in range(spec.n_moe_layers)]
        out.append(Step(1 + len(chosen), true, pred, produced))
    return out


def ecospec_whatif(model: str | ModelSpec, deployments: list[str | Deployment], gammas: list[int],
                   selections: tuple[Selection, ...] = SELECTIONS_DEFAULT,
                   params: SpecSynthParams = DEFAULT_PARAMS, draft: DraftProfile = DEFAULT_DRAFT,
                   context: int = 1024, synth: SynthSpec | None = None,
                   sd_gamma: int | None = None) -> list[dict[str, Any]]:
    """One row per deployment x selection x gamma (and one no-speculation row per
    deployment): tokens a step, distinct experts a verification, verification and draft
    latency, TPOT and the speed-ups against each baseline (:data:`BASELINES`; ``sd_gamma``
    names the budget of the standard-speculative-decoding baseline, confidence-only, when it
    is one of ``gammas``). Deterministic for a seed; marked synthetic."""
    spec = get_model(model) if isinstance(model, str) else model
    if any(g < 0 for g in gammas):
        raise MoesimError("gamma must be >= 0")
    if draft.kind == "recorded":
        raise MoesimError("a synthetic what-if has no recorded draft time: use eagle, dense or none")
    deps = [get_deployment(d) for d in deployments]
    synth = synth or generate(spec, params)
    params = synth.params
    base_steps = selected_steps(synth, 0, Selection("confidence"))
    top = max(gammas, default=0)
    orders = {sel: selection_orders(synth, top, sel) for sel in selections} if top else {}
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for d, dep in enumerate(deps):
        none = time_steps(spec, base_steps, dep, 0.0, context)
        found[d, -1] = _row(spec, dep, params, "none", Selection("confidence"), 0, none, draft)
    for c, (g, sel) in enumerate((g, sel) for g in gammas for sel in selections):
        steps = selected_steps(synth, g, sel, orders[sel]) if g else base_steps  # one case's steps at a time
        for d, dep in enumerate(deps):
            d_s = draft.tree_seconds(dep.cost_model(spec), params.branch, params.depth,
                                     sel.strategy == "ecospec", params.expand) if g else 0.0
            found[d, c] = _row(spec, dep, params, sel.label, sel, g, time_steps(spec, steps, dep, d_s, context), draft)
    return add_speedups([found[key] for key in sorted(found)], sd_gamma)


#: What a speed-up is measured against (every row has one column per baseline).
BASELINES = {
    "speedup_vs_none": "no speculation (one token a target pass)",
    "speedup_vs_confidence": "confidence-only selection at the same gamma",
    "speedup_vs_best_confidence": "confidence-only selection at its own best gamma (on the same tree)",
    "speedup_vs_sd": "standard speculative decoding: confidence-only at the SD baseline's gamma (sd_gamma)",
}


def add_speedups(rows: list[dict[str, Any]], sd_gamma: int | None = None) -> list[dict[str, Any]]:
    """Fill every row's speed-up columns (:data:`BASELINES`) from the rows of its model and
    deployment; a baseline that is not among the rows gives NaN."""
    nan = float("nan")
    for key in dict.fromkeys((r["model"], r["deployment"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["deployment"]) == key]
        none = next((r["tpot_ms"] for r in mine if r["gamma"] == 0), nan)
        conf = {r["gamma"]: r["tpot_ms"] for r in mine if r["strategy"] == "confidence" and r["gamma"] > 0}
        best = min(conf.values(), default=nan)
        for r in mine:
            t = r["tpot_ms"]
            r["speedup_vs_none"] = none / t
            r["speedup_vs_confidence"] = conf[r["gamma"]] / t if r["gamma"] in conf else nan
            r["speedup_vs_best_confidence"] = best / t if r["gamma"] > 0 else nan
            r["sd_gamma"] = sd_gamma if sd_gamma in conf else None
            r["speedup_vs_sd"] = conf[sd_gamma] / t if sd_gamma in conf and r["gamma"] > 0 else nan
    return rows


def _row(spec, dep, params, label, sel, gamma, r, draft) -> dict[str, Any]:
    return {
        "model": spec.name, "deployment": dep.name, "selection": label, "strategy": sel.strategy, "score": sel.score,
        "lambda": sel.lam(spec), "gamma": gamma, "branch": params.branch, "depth": params.depth,
        "expand": params.expand, "accept": ",".join(f"{a:g}" for a in params.accept), "draft": draft.label,
        "tokens_per_step": float(r["produced"].mean()), "rows_per_step": float(r["rows"].mean()),
        "distinct_experts_per_step": float(r["distinct"].mean()),
        "verify_ms": float(r["verify_s"].mean() * 1e3), "draft_ms": float(r["draft_s"].mean() * 1e3),
        "tpot_ms": r["tpot_ms"], "synthetic": True,
    }


def latency_fit(spec: ModelSpec, dep: str | Deployment, synth: SynthSpec, gammas: list[int],
                selections: tuple[Selection, ...] = SELECTIONS_DEFAULT, context: int = 1024) -> dict[str, Any]:
    """Verification latency against distinct experts over every step of every selection
    and gamma: the least-squares slope per expert, next to the analytic expert bytes /
    bandwidth (:func:`moesim.sim.deployment.seconds_per_distinct_expert`)."""
    dep = get_deployment(dep)
    xs, ys = [], []
    top = max(gammas, default=0)
    orders = {sel: selection_orders(synth, top, sel) for sel in selections} if top else {}
    for g in gammas:
        for sel in selections:
            r = time_steps(spec, selected_steps(synth, g, sel, orders.get(sel)), dep, 0.0, context)
            xs.append(r["distinct"])
            ys.append(r["verify_s"])
    x, y = np.concatenate(xs), np.concatenate(ys)
    slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (float("nan"), float(y.mean()))
    fit = slope * x + intercept
    r2 = 1 - ((y - fit) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30)
    return {"model": spec.name, "deployment": dep.name, "x": x, "y": y, "slope_ms_per_expert": float(slope * 1e3),
            "intercept_ms": float(intercept * 1e3), "r2": float(r2),
            "analytic_ms_per_expert": seconds_per_distinct_expert(spec, dep) * 1e3}


# What the what-if costs, per unit, on top of drawing the steps
# (:func:`moesim.traces.synthetic_speculative.generate_cost`): central figures measured on a
# shared 2-core Xeon (Python 3.11, numpy 2.4), so an estimate lands within 3x of the real
# time on this kind of machine (tests/test_ecospec_scale.py holds it there).
SELECT_S_PER_ITER = 1.5e-5  # one greedy choice (an open-set scan)
SELECT_S_PER_WORD = 4e-9  # EcoSpec: one node x layer x 64-expert word of marginal-cost update per choice
STEPS_S_PER_ROW_LAYER = 1.2e-6  # building a selected step's expert sets
TIME_S_PER_LAYER = 4.5e-5  # timing one step on one deployment, per model layer (roofline, plan, fast path)
WHATIF_FIXED_S = 1.0  # imports, the compiled fast path's load
SET_BYTES_PER_ID = 72  # a Python int in a set


def whatif_cost(spec: ModelSpec, n_deployments: int, gammas: list[int], selections: tuple[Selection, ...],
                params: SpecSynthParams) -> tuple[float, float]:
    """(seconds, peak bytes) of :func:`ecospec_whatif` for one model, before it runs: drawing
    the steps, each selection once at the largest gamma, each (gamma, selection) case's
    steps, and timing each case on each deployment."""
    seconds, peak = generate_cost(spec, params)
    nodes, steps, m = params.nodes, params.steps, spec.n_moe_layers
    top = min(max(gammas, default=0), nodes)
    words = -(-spec.n_experts // 64)
    for sel in selections if top else ():
        per = SELECT_S_PER_ITER + (SELECT_S_PER_WORD * nodes * m * words if sel.strategy == "ecospec" else 0.0)
        seconds += steps * top * per
    widest = 0
    for g in gammas:
        rows = 1 + min(g, nodes)
        widest = max(widest, rows)
        seconds += len(selections) * steps * rows * m * STEPS_S_PER_ROW_LAYER
    cases = 1 + len(gammas) * len(selections)
    seconds += n_deployments * cases * steps * spec.n_layers * TIME_S_PER_LAYER
    peak += steps * (1 + nodes) * m * words * 8  # the selections' bit masks, kept per step
    peak += steps * m * widest * spec.top_k * SET_BYTES_PER_ID * 2  # one case's true and predicted sets
    return seconds, peak


def whatif_estimate(models: list[ModelSpec], n_deployments: int, gammas: list[int], selections: tuple[Selection, ...],
                    params: SpecSynthParams, extra_runs: int = 0):
    """A :class:`moesim.budget.Estimate` of the what-if over ``models`` (``extra_runs``: further
    what-ifs of the same size, such as a report's latency fits and variants)."""
    costs = [whatif_cost(spec, n_deployments, gammas, selections, params) for spec in models]
    seconds = WHATIF_FIXED_S + sum(c[0] for c in costs) * (1 + extra_runs)
    return Estimate(f"the EcoSpec what-if: {len(models)} model(s) x {params.steps} steps x {len(gammas)} gamma(s) x "
                    f"{len(selections)} selection(s) x {n_deployments} deployment(s), {count(params.nodes)} candidates "
                    "a tree", max((c[1] for c in costs), default=0.0), seconds)


def with_shape(params: SpecSynthParams, branch: int, depth: int) -> SpecSynthParams:
    return replace(params, branch=branch, depth=depth)
