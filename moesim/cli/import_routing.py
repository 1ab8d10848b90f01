"""``moesim import FORMAT FILE``. Python: ``moesim.traces.importers.import_routing(fmt, path, model, out)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err


@app.command("import")
def import_routing(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help="vllm, jsonl or npz (docs/routing.md).")],
    path: Annotated[Path, typer.Argument(metavar="FILE", help="The routing dump.")],
    model: Annotated[str, typer.Option(help="Catalogue name or model directory the dump was recorded on.")],
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("imported.npz"),
) -> None:
    """Import routing that another engine recorded: vLLM's per-completion routed experts
    (`--enable-return-routed-experts`), or the plain JSON-lines / npz format any tool can
    write (docs/routing.md). A dump that does not match the model is one line.

    Example: `moesim import jsonl routing.jsonl --model ./moe-stdlib --out imported.npz` (needs a dump file:
    traces/examples/ in the source tree has one of each format)
    """
    from moesim.traces.importers import import_routing as run_import

    trace = run_import(fmt, path, model, out_path)
    err.print(f"wrote {out_path}: {trace.n_tokens} steps x {trace.model.n_moe_layers} MoE layers of "
              f"{trace.model.name}, batch {trace.batch} (imported from {fmt})")
