"""``moesim ecospec``. Python: ``moesim.reports.ecospec.ecospec_report(out, models, deployments, gammas, params,
draft=...)`` (rows alone: ``moesim.sim.ecospec.ecospec_whatif``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim import budget
from moesim.cli.app import err, floats, ints, out, print_json, results_table, split
from moesim.cli.options import command_of, holding
from moesim.cli.running import writing_report
from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.outputs import check_output_dir
from moesim.reports.ecospec import ecospec_report
from moesim.sim.deployment import get_deployment
from moesim.sim.draft import parse_draft
from moesim.sim.ecospec import ecospec_whatif, parse_selections, whatif_estimate
from moesim.traces.synthetic_speculative import SpecSynthParams

COLS = (("model", "model"), ("deployment", "deployment"), ("selection", "selection"), ("gamma", "gamma"),
        ("tokens_per_step", "tok/step"), ("distinct_experts_per_step", "experts/step"), ("verify_ms", "verify ms"),
        ("tpot_ms", "TPOT ms"), ("speedup_vs_none", "x no-spec"), ("speedup_vs_confidence", "x conf."),
        ("speedup_vs_best_confidence", "x best conf."))


@dataclass
class EcospecArgs:
    """``moesim ecospec``'s options as typed."""

    model: Annotated[str, typer.Option(help="Comma-separated catalogue models.")] = "qwen3-235b-a22b,gpt-oss-120b,deepseek-v3"
    deployment: Annotated[str, typer.Option(help="Comma-separated deployments (resident across GPUs or offloaded; "
                                                 "docs/speculative.md).")] = "8xh200-tp,8xh200-ep,1xh200-offload"
    gamma: Annotated[str, typer.Option(help="Verification budgets to try.")] = "1,2,4,8,12,16"
    selection: Annotated[str, typer.Option(help="Selections: confidence, ecospec:ratio, ecospec:lagrangian:LAMBDA "
                                                "(LAMBDA x MoE layers x top-k; docs/speculative.md).")] = "confidence,ecospec:ratio,ecospec:lagrangian:1"
    draft: Annotated[str, typer.Option(help="Draft cost: eagle, eagle:F (F target layers), dense:B (B billion "
                                            "parameters) or none.")] = "eagle"
    steps: Annotated[int, typer.Option(help="Synthetic verification steps per model.")] = 256
    branch: Annotated[int, typer.Option(help="Children per draft-tree node.")] = 2
    depth: Annotated[int, typer.Option(help="Levels of the draft tree.")] = 4
    accept: Annotated[str, typer.Option(help="Acceptance rate per depth (the last repeats).")] = "0.75,0.65,0.6,0.55"
    recall: Annotated[float, typer.Option(help="The expert predictor's recall@k.")] = 0.7
    seed: Annotated[int, typer.Option(help="Random seed of the synthetic trees.")] = 0
    as_json: Annotated[bool, typer.Option("--json", help="Print every row as JSON.")] = False
    out_dir: Annotated[Path | None, typer.Option("--out", help="Report folder (HTML, PNG, CSV, JSON).")] = None


@command_of(EcospecArgs)
def ecospec(a: EcospecArgs) -> None:
    """What does EcoSpec's cost-aware tree selection buy on a large MoE, resident across a
    node's GPUs or offloaded on one? Speculative decoding on **synthetic** draft trees
    (`moesim synth --speculative`), confidence-only against EcoSpec selection, over the
    verification budget gamma: tokens a step, distinct experts a verification,
    verification latency, TPOT and the speed-ups.

    Example: `moesim ecospec --model qwen3-235b-a22b --deployment 8xh200-tp,1xh200-offload --gamma 2,8 --steps 16`
    """

    if a.seed < 0:

        raise MoesimError(f"--seed {a.seed}: a whole number >= 0")
    params = SpecSynthParams(steps=a.steps, branch=a.branch, depth=a.depth, accept=tuple(floats(a.accept, "--accept", repeats=True)),
                             recall=a.recall, seed=a.seed)
    models, deps = split(a.model, "--model"), split(a.deployment, "--deployment")
    gammas = ints(a.gamma, "--gamma")  # whole numbers: 1.5 was cut to 1, nan a traceback
    prof = parse_draft(a.draft)
    selections = parse_selections(a.selection)
    if not any(gammas):  # the best-gamma table compares speculating selections: none here
        err.print("note: --gamma 0 alone is decoding without speculation: no selection to compare (its row: --json)",
                  markup=False, soft_wrap=True)
    over = [g for g in gammas if g > params.nodes]
    if over:  # a budget past the tree verifies all of it: as the tree's size
        err.print(f"note: --gamma {', '.join(map(str, over))} is more than a draft tree's {params.nodes} candidates "
                  f"(--branch {a.branch}, --depth {a.depth}): verifies the whole tree, as --gamma {params.nodes}",
                  markup=False, soft_wrap=True)
    if a.recall != 0.7 and not any(s.startswith("ecospec") for s in split(a.selection, "--selection")):
        err.print("note: --recall is the expert predictor's, which only ecospec selections use: changed nothing",
                  markup=False, soft_wrap=True)
    specs = [get_model(m) for m in models]
    for d in deps:
        get_deployment(d)
    if a.out_dir is None:  # the report checks its own, larger, estimate
        budget.check(whatif_estimate(specs, len(deps), gammas, selections, params))
    if a.out_dir is not None:
        check_output_dir(a.out_dir)  # before its lock file is made
    with holding(a.out_dir, "--out"), writing_report(a.out_dir), err.status("simulating speculative decoding"):
        if a.out_dir is not None:
            rows = ecospec_report(a.out_dir, tuple(models), tuple(deps), tuple(gammas), params, selections, draft=prof,
                                  resident=deps[0])["rows"]
        else:
            rows = [r for m in models for r in ecospec_whatif(m, deps, gammas, selections, params=params, draft=prof)]
    if a.as_json:
        print_json(rows)
        return
    best = []
    for m in dict.fromkeys(r["model"] for r in rows):
        for d in deps:
            mine = [r for r in rows if r["model"] == m and r["deployment"] == d and r["gamma"] > 0]
            # every selection asked for (two ecospec selections are two rows, not the better one)
            best += [max((r for r in mine if r["selection"] == s), key=lambda r: r["speedup_vs_none"])
                     for s in dict.fromkeys(r["selection"] for r in mine)]
    out.print(results_table(best, f"best gamma per model, deployment and selection (synthetic trees; draft "
                                  f"{prof.label}; x conf.: against confidence-only at the same gamma, x best conf.: "
                                  "at its own best gamma); every row: --json or --out", COLS))
    if a.out_dir is not None:
        err.print(f"report: {a.out_dir / 'report.html'}")
