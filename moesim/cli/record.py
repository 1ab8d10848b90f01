"""``moesim record MODEL_DIR``. Python: ``moesim.executor.record.record_trace(model_dir, out, prompts, ...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.cli.app import app, err
from moesim.cli.running import progress_bar


@app.command()
def record(
    model_dir: Annotated[Path, typer.Argument(metavar="MODEL_DIR", help="A Hugging Face MoE checkpoint folder "
                                                                         "(config.json + safetensors).")],
    out_path: Annotated[Path, typer.Option("--out", help="Trace file to write (.npz).")] = Path("recorded.npz"),
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt text (repeat for a batch).")] = None,
    prompts_file: Annotated[Path | None, typer.Option(help="A text file, one prompt per line.")] = None,
    tokens: Annotated[int, typer.Option(help="Decode steps to record.")] = 64,
    batch: Annotated[int | None, typer.Option(help="Sequences decoded together (default: one per prompt).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy; else sampling temperature.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for sampling and random prompts.")] = 0,
    device: Annotated[str, typer.Option(help="cpu, or cuda (large checkpoints: device_map).")] = "cpu",
) -> None:
    """Record **real routing** from any Hugging Face MoE checkpoint: decode with the
    `transformers` reference classes and capture, per step and MoE layer, the true top-k
    experts and gates, with the stale-gate, quasi-hidden and oracle predictions.

    The trace has routing but no timings: replay it on any profile, or study it with
    moesim stats. Example: `moesim record moe-stdlib --prompt "def f(x):" --tokens 8 --out real.npz`,
    then `moesim stats real.npz`
    """
    from moesim.executor.record import record_trace

    prompts: object = list(prompt) if prompt else None
    source = "--prompt" if prompt else ""
    if prompts_file is not None:
        from moesim.errors import MoesimError

        try:
            prompts = [line for line in prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise MoesimError(f"cannot read prompts from {prompts_file}: {e}") from None
        source = str(prompts_file)
    with progress_bar("recording", "steps") as update:
        trace = record_trace(model_dir, out_path, prompts, tokens=tokens, device=device, batch=batch,
                             temperature=temperature, seed=seed, progress=update, prompt_source=source)
    rec = {k: [x for x in v if x == x] for k, v in trace.meta.metrics.get("predictors", {}).items()}
    err.print(f"wrote {out_path}: {trace.n_tokens} steps of {trace.model.name} routing, batch {trace.batch} (real "
              "model, no timings); mean prediction recall@k "
              + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in rec.items() if v))
