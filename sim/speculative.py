"""Speculative-decoding traces in the simulator: replay, and what-if over selection.

A verification step is timed like a decode step whose "token" is the verified row set:
per layer, attention over the rows, the union of their experts through the link (on
demand, or prefetched from the predicted union when the policy prefetches) or device
memory (all-resident), and the draft's measured time on top. TPOT is the sum of step
times over the tokens the steps produced.

What-if over gamma, strategy, score and lambda re-runs the selection on the recorded
candidate trees with the recorded per-node expert predictions. Two things a recording
cannot know are approximated, and every result says so: a node the recording did not
verify is assumed to route to its *predicted* experts, and acceptance is known only along
the target's greedy path as far as the recording saw it (deeper nodes count as rejected).
Draft probabilities are stored in float32, so near-ties may order differently than live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moesim.costmodel import CostModel
from moesim.errors import MoesimError
from moesim.hardware import DEFAULT_PROFILE, HardwareProfile, get_profile
from moesim.policy import get_policy
from moesim.selection import Tree, check_lambda, select
from moesim.sim.deployment import Deployment, time_steps
from moesim.sim.fastpath import run_fast
from moesim.sim.plan import Step, plan_sets  # noqa: F401 (Step: the verification step, re-exported)
from moesim.sim.validate import recorded_profile
from moesim.sim.workload import Link, lay_out
from moesim.traces.format import Trace
from moesim.traces.records import NOT_CHOSEN, PAD_EXPERT, ROOT_PARENT, SDStep, sd_steps


def _sets(mask: np.ndarray) -> list[set[int]]:
    return [set(np.flatnonzero(row).tolist()) for row in mask]


def sd_measured(trace: Trace) -> bool:
    """Whether the speculative records hold measured times (synthetic ones are all zero)."""
    return bool(trace.timings["sd_verify_s"].any())


def recorded_steps(trace: Trace) -> list[Step]:
    steps = []
    for t in sd_steps(trace.timings):
        rows = 1 + len(t.chosen)
        true = [set() for _ in range(t.root_pred.shape[0])]
        for r in range(rows):
            for layer, ids in enumerate(t.row_true[r]):
                true[layer] |= {int(e) for e in ids if e != PAD_EXPERT}
        pred = _sets(t.root_pred)
        for c in t.chosen:
            for layer, es in enumerate(_sets(t.node_pred[c])):
                pred[layer] |= es
        steps.append(Step(rows, true, pred, t.accepted))
    return steps


def _subtree(t: SDStep, depth: int | None, branch: int | None) -> list[int]:
    """Nodes of a recorded tree within ``depth`` levels whose rank among their siblings (by
    draft probability) is below ``branch``: the tree a smaller shape would have drafted."""
    keep: list[int] = []
    level = {ROOT_PARENT: 0}
    for i, p in enumerate(t.parents):
        if p != ROOT_PARENT and p not in level:
            continue
        siblings = sorted((j for j, q in enumerate(t.parents) if q == p), key=lambda j: -t.prob[j])
        if (depth is None or level[p] < depth) and (branch is None or siblings.index(i) < branch):
            level[i] = level[p] + 1
            keep.append(i)
    return keep


def reselected_steps(trace: Trace, gamma: int, strategy: str, score: str = "ratio", lam: float = 0.1,
                     depth: int | None = None, branch: int | None = None,
                     acceptance: float | None = None) -> list[Step]:
    """The steps as they would have been under another selection, on the recorded trees cut
    to ``depth`` and ``branch`` (see the module docstring). With ``acceptance`` the tokens a
    step produces are not read off the recording but expected: 1 + the sum over chosen
    nodes of min(1, acceptance x the node's cumulative draft probability) (1 = trust the
    draft's own probabilities; higher = a better-aligned draft)."""
    steps = []
    trees = sd_steps(trace.timings)
    starts = np.concatenate([[0], np.cumsum([t.accepted for t in trees])])  # first token row of each step
    for s_, t in enumerate(trees):
        n_layers = t.root_pred.shape[0]
        keep = _subtree(t, depth, branch) if depth is not None or branch is not None else list(range(len(t.tokens)))
        index = {old: new for new, old in enumerate(keep)}
        node_pred_all = [_sets(t.node_pred[i]) for i in range(len(t.tokens))]
        tree = Tree([t.tokens[i] for i in keep], [index.get(t.parents[i], ROOT_PARENT) for i in keep],
                    [t.prob[i] for i in keep], [node_pred_all[i] for i in keep])
        node_pred = tree.experts
        # The target's greedy path through the tree, as far as the recording saw it: the
        # tokens this step accepted (after its root), then the next step's root (the bonus).
        known_next = trace.token_ids[0, starts[s_] + 1: starts[s_] + t.accepted].tolist()
        if s_ + 1 < len(trees):
            known_next.append(int(trace.token_ids[0, starts[s_ + 1]]))
        chosen = select(tree, gamma, strategy, _sets(t.root_pred), score, lam)
        # Acceptance: follow the known path while the chosen set contains it.
        produced, node = 1, ROOT_PARENT
        for tok in known_next:
            child = next((c for c in chosen if tree.parents[c] == node and tree.tokens[c] == tok), None)
            if child is None:
                break
            produced += 1
            node = child
        if acceptance is not None:
            produced = 1 + sum(min(1.0, acceptance * tree.prob[c]) for c in chosen)
        true = [set() for _ in range(n_layers)]
        verified = {index[c]: r + 1 for r, c in enumerate(t.chosen) if c in index}
        for layer in range(n_layers):
            true[layer] |= {int(e) for e in t.row_true[0][layer] if e != PAD_EXPERT}
        for c in chosen:
            for layer in range(n_layers):
                if c in verified:
                    true[layer] |= {int(e) for e in t.row_true[verified[c]][layer] if e != PAD_EXPERT}
                else:
                    true[layer] |= node_pred[c][layer]
        pred = _sets(t.root_pred)
        for c in chosen:
            for layer in range(n_layers):
                pred[layer] |= node_pred[c][layer]
        steps.append(Step(1 + len(chosen), true, pred, produced))
    return steps


def simulate_steps(trace: Trace, steps: list[Step], hw: HardwareProfile, policy: str, cache_experts: int = 0,
                   eviction: str = "lru", timing: str = "measured", link_gbps: float | None = None) -> dict[str, Any]:
    """Time verification steps with the fast path; ``timing`` measured (the trace's own
    per-layer times, charged per row and per expert) or profile (the cost model, as a
    one-GPU deployment of :func:`moesim.sim.deployment.time_steps`)."""
    spec = trace.model
    pol = get_policy(policy)
    if not pol.verifies_drafts:
        raise MoesimError("speculative decoding verifies exactly: all-resident, on-demand or prefetch-fom")
    if link_gbps is not None:
        hw = hw.with_figure("h2d_pinned_gbs", link_gbps)
    tm = trace.timings
    if spec.dense_layers:  # below, step sets (per MoE layer) are indexed by model layer
        raise MoesimError(f"{spec.name} has dense layers; time its speculative steps with "
                          "moesim.sim.deployment.time_steps (the EcoSpec what-if)")
    n_steps = len(steps)
    if len(tm["sd_accepted"]) != n_steps:
        raise MoesimError("steps do not match the trace")
    rows = np.array([st.rows for st in steps])
    produced = np.array([st.produced for st in steps], float)
    distinct = np.array([sum(len(u) for u in st.true_union) for st in steps])
    if timing == "measured" and not sd_measured(trace):
        raise MoesimError("a synthetic speculative trace has no measured times; use timing='profile'")
    if timing == "profile":
        copies = pol.copies_experts
        dep = Deployment(f"1 x {hw.name}", hw, offload=copies, policy=pol.name if copies else "on-demand",
                         cache_experts=cache_experts if copies else 0)
        r = time_steps(spec, steps, dep, tm["sd_draft_s"], trace.prompt_len, check=False)
        step_s, copy, stall, source = r["step_s"], r["copy_s"], r["stall_s"], f"roofline ({hw.name})"
    elif timing == "measured":
        plan = plan_sets([st.true_union for st in steps], [st.pred_union for st in steps], pol, cache_experts,
                         eviction)
        rec_rows = np.array([1 + int((tm["sd_chosen"][i] != NOT_CHOSEN).sum()) for i in range(n_steps)])
        rec_union = np.array([[len({int(e) for r in range(rec_rows[i]) for e in tm["sd_row_true"][i, r, layer]
                                    if e != PAD_EXPERT})
                               for layer in range(spec.n_layers)] for i in range(n_steps)])
        per_expert = tm["sd_expert_s"] / np.maximum(rec_union, 1)
        attn = tm["sd_attn_s"] * (rows / rec_rows)[:, None]  # attention work grows with the rows verified
        rest = tm["sd_verify_s"] - tm["sd_attn_s"].sum(1) - tm["sd_expert_s"].sum(1) - tm["sd_stall_s"].sum(1)
        other = np.maximum(rest, 0) + tm["sd_draft_s"]  # the draft runs before verification
        source = "measured (trace)"
        work = lay_out(spec, plan, attn, plan.execute * per_expert, other, source)
        ends, copy, stall = run_fast(work, Link.of(CostModel(spec, hw)))
        step_s = np.diff(ends, prepend=0.0)
    else:
        raise MoesimError(f"unknown timing {timing!r}; use measured or profile")
    return {
        "policy": pol.name, "hw": hw.name, "link_gbps": hw["h2d_pinned_gbs"], "timing": source,
        "steps": n_steps, "tokens": float(produced.sum()), "accepted_per_step": float(produced.mean()),
        "rows_per_step": float(rows.mean()), "distinct_experts_per_step": float(distinct.mean()),
        "tpot_ms": float(step_s.sum() / produced.sum() * 1e3), "step_ms": float(step_s.mean() * 1e3),
        "copy_ms_per_step": float(copy.mean() * 1e3), "stall_ms_per_step": float(stall.mean() * 1e3),
    }


def measured_summary(trace: Trace) -> dict[str, Any]:
    """What the executor measured, and the verification latency against distinct experts
    (least squares: the 'expert dispersion' cost of a step)."""
    tm = trace.timings
    steps = recorded_steps(trace)
    distinct = np.array([sum(len(u) for u in st.true_union) for st in steps], float)
    verify = tm["sd_verify_s"]
    slope, intercept = np.polyfit(distinct, verify, 1) if np.ptp(distinct) > 0 else (np.nan, float(verify.mean()))
    fit = slope * distinct + intercept
    r2 = 1 - ((verify - fit) ** 2).sum() / max(((verify - verify.mean()) ** 2).sum(), 1e-30)
    total = tm["sd_draft_s"] + verify
    produced = tm["sd_accepted"]
    return {"steps": len(produced), "tokens": int(produced.sum()), "accepted_per_step": float(produced.mean()),
            "distinct_experts_per_step": float(distinct.mean()), "tpot_ms": float(total.sum() / produced.sum() * 1e3),
            "draft_ms_per_step": float(tm["sd_draft_s"].mean() * 1e3), "verify_ms_per_step": float(verify.mean() * 1e3),
            "verify_ms_per_distinct_expert": float(slope * 1e3), "verify_ms_intercept": float(intercept * 1e3),
            "verify_vs_experts_r2": float(r2)}


def replay_sd(trace: Trace, hw: HardwareProfile, policy: str | None = None, **kw) -> dict[str, Any]:
    """Replay a speculative trace as recorded and compare with what was measured."""
    if not trace.speculative:
        raise MoesimError("not a speculative-decoding trace (no sd_* records)")
    measured = sd_measured(trace)
    if not measured and kw.get("timing", "measured") == "measured":
        raise MoesimError("this speculative trace (synthetic, or routing recorded without timings) has no "
                          "measurements to replay; use the EcoSpec what-if (moesim.sim.ecospec) or timing='profile'")
    meta = trace.meta
    kw.setdefault("cache_experts", meta.cache_experts)
    sim = simulate_steps(trace, recorded_steps(trace), hw, policy or meta.replay_policy, **kw)
    if not measured:  # routing only: simulated with the profile's compute times, nothing to compare with
        return {"simulated": sim, "measured": None, "error": None}
    meas = measured_summary(trace)
    return {"simulated": sim, "measured": meas, "error": sim["tpot_ms"] / meas["tpot_ms"] - 1}


@dataclass(frozen=True)
class TreeCut:
    """How a what-if re-reads the recorded draft trees (each None: as recorded): cut to
    ``depth``, keep ``branch`` children a node, and take a node's expected acceptance as
    ``acceptance`` x its draft probability instead of the recorded path."""

    depth: int | None = None
    branch: int | None = None
    acceptance: float | None = None


AS_DRAFTED = TreeCut()


def speculative_whatif(trace: Trace, hw: HardwareProfile | None = None, policies: list[str] | None = None,
                       gammas: list[int] | None = None, selections: tuple[str, ...] = ("confidence", "ecospec"),
                       score: str = "ratio", lambdas: tuple[float, ...] = (0.05,), link_gbps: float | None = None,
                       timing: str = "measured", cut: TreeCut = AS_DRAFTED) -> dict[str, Any]:
    """``moesim replay`` of a speculative trace: measured against simulated as recorded
    (under each policy; ``error`` compares the measurement with the recorded policy's simulation), then, with
    ``gammas``, the selection re-run on the recorded trees for every policy x gamma x
    selection (x lambda for the Lagrangian EcoSpec score). ``hw`` defaults to the
    recording profile with the link the trace measured, and to ``DEFAULT_PROFILE`` for a
    trace that names none (synthetic, or routing recorded without timings); ``timing``
    ``auto`` is measured when the trace holds measured times, else profile. Returns
    ``measured`` and ``error`` (of the first policy as recorded; None without measured
    times) and ``rows`` (each with its ``case``); ``cut``: how the what-ifs re-read the trees."""
    depth, branch, acceptance = cut.depth, cut.branch, cut.acceptance
    for lam in lambdas:  # as ecospec's --selection ecospec:lagrangian:LAMBDA
        check_lambda(lam)
    if bad := [g for g in gammas or () if isinstance(g, bool) or not isinstance(g, int) or g < 0]:
        raise MoesimError(f"--gamma {bad[0]}: verification budgets are whole numbers >= 0")
    for name, v in (("--depth", depth), ("--branch", branch)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise MoesimError(f"{name} {v}: a whole number >= 1 (it cuts the recorded trees)")
    if acceptance is not None and not 0 < acceptance < float("inf"):
        raise MoesimError(f"--acceptance {acceptance:g}: a positive number (it scales the draft's probabilities)")
    if timing == "auto":
        timing = "measured" if sd_measured(trace) else "profile"
    if hw is None and not trace.meta.hw_profile:
        hw = get_profile(DEFAULT_PROFILE)
    hw = recorded_profile(trace, hw)
    recorded = trace.meta.replay_policy
    policies = policies or [recorded]
    # The measurement is compared with the simulation of the policy that was measured,
    # never with another policy's (whichever --policy lists first).
    base = replay_sd(trace, hw, recorded, link_gbps=link_gbps, timing=timing)
    rows = []
    for p in policies:
        sim = base["simulated"] if get_policy(p).name == base["simulated"]["policy"] else \
            simulate_steps(trace, recorded_steps(trace), hw, p, link_gbps=link_gbps, timing=timing)
        rows.append({"case": "as recorded", **sim})
    shape = (depth, branch, acceptance)
    for p in policies if gammas else []:
        for g in gammas:
            for sel in selections:
                for lam in (lambdas if sel == "ecospec" and score == "lagrangian" else [0.0]):
                    steps = reselected_steps(trace, g, sel, score, lam, *shape)
                    label = "" if sel != "ecospec" else f" {score}" + (f" {lam:g}" if score == "lagrangian" else "")
                    label += "".join(f" {k} {v:g}" for k, v in zip(("depth", "branch", "acceptance"), shape,
                                                                    strict=True) if v is not None)
                    rows.append({"case": f"what-if gamma {g} {sel}{label}",
                                 **simulate_steps(trace, steps, hw, p, link_gbps=link_gbps, timing=timing)})
    return {"measured": base["measured"], "error": base["error"], "error_policy": base["simulated"]["policy"],
            "error_tpot_ms": base["simulated"]["tpot_ms"], "rows": rows}
