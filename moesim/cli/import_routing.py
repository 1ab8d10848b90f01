"""``moesim import FORMAT FILE``. Python: ``moesim.traces.importers.import_routing(fmt, path, model, out)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err
from moesim.cli.options import holding
from moesim.fmt import plural
from moesim.outputs import check_output_file
from moesim.traces.importers import import_routing as run_import


@app.command("import")
def import_routing(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help="vllm, sglang, jsonl or npz (docs/routing.md).")],
    path: Annotated[Path, typer.Argument(metavar="FILE", help="The routing dump.")],
    model: Annotated[str, typer.Option(help="Catalogue name or model directory the dump was recorded on.")],
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("imported.npz"),
    prompt_tokens: Annotated[int | None, typer.Option(help="vllm, plain .npy: the prompt's length (its first rows "
                                                           "are prefill).")] = None,
) -> None:
    """Import routing that another engine recorded: vLLM's per-completion routed experts
    (`--enable-return-routed-experts`: a .npz, a plain .npy with `--prompt-tokens`, or the
    OpenAI-compatible server's JSON response), SGLang's /generate JSON, or the plain
    JSON-lines / npz format any tool can write (docs/routing.md). vLLM's rows for dense
    layers are dropped using the model's MoE layers. A dump that does not match the model is
    one line.

    Example: `moesim import vllm vllm-synthetic-deepseek-v2-lite.json --model deepseek-v2-lite --out imported.npz`
    (needs a dump file: traces/examples/ in the source tree has one file of each format)
    """

    check_output_file(out_path, (".npz",))  # before the model's config.json (transformers: seconds), not after
    if prompt_tokens is not None and fmt in ("jsonl", "npz", "sglang"):
        err.print(f"note: --prompt-tokens applies to vllm's plain .npy dumps; a {fmt} dump carries its own prompt: "
                  "changed nothing", markup=False, soft_wrap=True)
    with holding(out_path, "--out"):  # two runs on one file: the second refused, not a trace lost
        trace = run_import(fmt, path, model, out_path, prompt_tokens=prompt_tokens)
    err.print(f"wrote {out_path}: {plural(trace.n_tokens, 'step')} x {trace.model.n_moe_layers} MoE layers of "
              f"{trace.model.name}, batch {trace.batch} (imported from {fmt})")
