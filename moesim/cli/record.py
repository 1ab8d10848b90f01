"""``moesim record MODEL_DIR``. Python: ``moesim.executor.record.record_trace(model_dir, out, prompts, ...)``;
with ``--draft``: ``moesim.executor.record_speculative.record_speculative_trace(model_dir, draft, out, prompts, ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import err
from moesim.cli.options import command_of, holding
from moesim.cli.running import keeps_finished_work, progress_bar
from moesim.errors import MoesimError
from moesim.executor.defaults import RECORD_DRAFT as D  # torch-free: --help shows them
from moesim.fmt import plural
from moesim.inputs import read_text


@dataclass
class RecordArgs:
    """``moesim record``'s options as typed."""

    model_dir: Annotated[Path, typer.Argument(metavar="MODEL_DIR", help="A Hugging Face MoE checkpoint folder "
                                                                         "(config.json + safetensors), or a Hugging "
                                                                         "Face cache folder models--ORG--NAME.")]
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("recorded.npz")
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt text (repeat for a batch).")] = None
    prompts_file: Annotated[Path | None, typer.Option(help="A text file, one prompt per line.")] = None
    prompt_ids: Annotated[list[str] | None, typer.Option(help="Token ids instead of text, e.g. 1,2,3 (each in "
                                                              "[0, vocab); repeat for a batch).")] = None
    tokens: Annotated[int, typer.Option(help="Decode steps to record.")] = 64
    batch: Annotated[int | None, typer.Option(help="Sequences decoded together (default: one per prompt).")] = None
    temperature: Annotated[float, typer.Option(help="0 = greedy; else sampling temperature.")] = 0.0
    seed: Annotated[int, typer.Option(help="Seed for sampling and random prompts.")] = 0
    device: Annotated[str, typer.Option(help="cpu, or cuda (large checkpoints: device_map).")] = "cpu"
    draft: Annotated[Path | None, typer.Option(help="A draft checkpoint with the target's vocabulary: record "
                                                    "speculative decoding (trees, every verified node's routing).")] = None
    tree_depth: Annotated[int | None, typer.Option(help=f"--draft: depth of the candidate tree "
                                                        f"[default: {D['depth']}].")] = None
    tree_branch: Annotated[int | None, typer.Option(help=f"--draft: children per node, top by draft probability "
                                                         f"[default: {D['branch']}].")] = None
    budget: Annotated[int | None, typer.Option(help=f"--draft: candidates verified per step besides the root "
                                                    f"[default: {D['budget']}].")] = None
    selection: Annotated[str | None, typer.Option(help=f"--draft: confidence, or ecospec (needs the draft's expert "
                                                       f"predictor) [default: {D['selection']}].")] = None
    score: Annotated[str | None, typer.Option(help=f"--draft, ecospec: ratio or lagrangian "
                                                   f"[default: {D['score']}].")] = None
    lam: Annotated[float | None, typer.Option("--lambda", help=f"--draft, ecospec: lambda of the lagrangian score "
                                                               f"[default: {D['lam']}].")] = None


@command_of(RecordArgs)
@keeps_finished_work
def record(a: RecordArgs) -> None:
    """Record **real routing** from any Hugging Face MoE checkpoint: decode with the
    `transformers` reference classes and capture, per step and MoE layer, the true top-k
    experts and gates, with the stale-gate, quasi-hidden and oracle predictions.

    The trace has routing but no timings: replay it on any profile, or study it with
    moesim stats. Example: `moesim record moe-stdlib --prompt "def f(x):" --tokens 8 --out real.npz`,
    then `moesim stats real.npz`

    With `--draft`, record greedy speculative decoding instead (one prompt): the draft
    proposes a candidate tree, the selection picks `--budget` nodes, the target verifies
    them in one pass and its routers' choice for every verified node is recorded (a
    version-2 trace, like `moesim speculate` writes, with no timings). Example:
    `moesim record moe-stdlib --draft moe-stdlib-draft --tokens 8 --out real-sd.npz`, then
    `moesim replay real-sd.npz --gamma 2,4`
    """

    prompts: object = list(a.prompt) if a.prompt else None
    source = "--prompt" if a.prompt else ""
    if a.prompt_ids and (a.prompt or a.prompts_file is not None):
        raise MoesimError("--prompt-ids and --prompt / --prompts-file: give one (token ids, or text)")
    if a.prompt_ids:
        from moesim.executor.loading import parse_prompt_ids  # torch: loaded when the command runs

        prompts, source = [parse_prompt_ids(text) for text in a.prompt_ids], "--prompt-ids"
    if a.prompts_file is not None:

        prompts = [line for line in read_text(a.prompts_file, "prompts file", expected="text, one prompt a line")
                   .splitlines() if line.strip()]
        if not prompts:
            raise MoesimError(f"prompts file {a.prompts_file} holds no prompt (one a line)")
        source = str(a.prompts_file)
    tree = {"depth": a.tree_depth, "branch": a.tree_branch, "budget": a.budget, "selection": a.selection, "score": a.score,
            "lam": a.lam}
    tree = {k: v for k, v in tree.items() if v is not None}
    if a.draft is None and tree:
        raise MoesimError("--tree-depth, --tree-branch, --budget, --selection, --score and --lambda apply to "
                          "record --draft")
    with holding(a.out_path, "--out"):  # two runs on one file: the second refused, not a trace lost
        if a.draft is not None:
            if a.temperature != 0 or (a.batch or 1) != 1:
                raise MoesimError("record --draft decodes greedily at batch 1 (no --temperature, no --batch)")
            # torch: loaded when the command runs
            from moesim.executor.record_speculative import DraftSettings, record_speculative_trace

            settings = DraftSettings(**tree)  # the defaults live there
            with progress_bar("recording", "tokens") as update:
                trace = record_speculative_trace(a.model_dir, a.draft, a.out_path, prompts, tokens=a.tokens, settings=settings,
                                                 device=a.device, seed=a.seed, progress=update, prompt_source=source)
            acc = trace.timings["sd_accepted"]
            cut = f" (interrupted: kept {trace.n_tokens} of {a.tokens} tokens)" if trace.n_tokens < a.tokens else ""
            err.print(f"wrote {a.out_path}{cut}: {trace.n_tokens} tokens of {trace.model.name} routing in {len(acc)} verification "
                      f"steps ({acc.mean():.2f} a step), {1 + settings.budget} rows verified a step at most (real pair, no "
                      "timings)")
            return
        from moesim.executor.record import record_trace  # torch: loaded when the command runs

        with progress_bar("recording", "steps") as update:
            trace = record_trace(a.model_dir, a.out_path, prompts, tokens=a.tokens, device=a.device, batch=a.batch,
                                 temperature=a.temperature, seed=a.seed, progress=update, prompt_source=source)
        rec = {k: [x for x in v if x == x] for k, v in trace.meta.metrics.get("predictors", {}).items()}
        cut = f" (interrupted: kept {trace.n_tokens} of {a.tokens} steps)" if trace.n_tokens < a.tokens else ""
        err.print(f"wrote {a.out_path}{cut}: {plural(trace.n_tokens, 'step')} of {trace.model.name} routing, batch {trace.batch} (real "
                  "model, no timings); mean prediction recall@k "
                  + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in rec.items() if v))
