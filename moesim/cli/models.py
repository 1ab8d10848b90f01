"""``moesim models``: the catalogue with byte accounting. Python: ``moesim.models.get_model(name)``."""

from __future__ import annotations

from typing import Annotated

import typer

from moesim.cli.app import AsCsv, AsJson, app, err, out, print_csv, print_json, table
from moesim.models import catalogue_in, get_model
from moesim.quant_recipes import store_as  # a weight format or a llama.cpp file type (q4_k_m), as replay takes

COLUMNS = ("model", "layers (MoE)", "experts + shared", "top-k", "hidden / inter", "expert dtype",
           "MB / expert", "GB / layer", "GB experts", "GB non-expert", "GB / token", "B params (active)", "layers by kind")


def _kinds(s) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for i in range(s.n_layers):
        kinds[s.layer_kind(i)] = kinds.get(s.layer_kind(i), 0) + 1
    return kinds


def _row(s) -> dict:
    """One model's figures (every byte exact; the per-layer expert bytes when the artefact gives them)."""
    return {"model": s.name, "family": s.family, "layers": s.n_layers, "moe_layers": s.n_moe_layers,
            "experts": s.n_experts, "shared": s.n_shared, "top_k": s.top_k, "hidden": s.hidden,
            "expert_inter": s.expert_inter, "expert_dtype": s.expert_dtype, "dense_dtype": s.dense_dtype,
            "expert_bytes": s.expert_bytes,
            "expert_bytes_by_layer": list(s.expert_bytes_by_layer) or None,
            "layer_expert_bytes": s.layer_expert_bytes, "all_expert_bytes": s.all_expert_bytes,
            "non_expert_bytes": s.non_expert_bytes, "input_embedding_bytes": s.input_embedding_bytes,
            "embedding_row_bytes": s.embedding_row_bytes, "bytes_per_token": s.bytes_per_token(),
            "total_params": s.total_params, "active_params": s.active_params, "extra_params": s.extra_params,
            "layer_kinds": _kinds(s), "sliding_window": s.sliding_window or None,
            "attention_chunk": s.attention_chunk or None, "kv_cache_bytes_4k_context": s.kv_cache_bytes(1, 4096),
            "n_mtp_layers": s.n_mtp_layers, "mtp_layer_bytes": s.mtp_layer_bytes}


@app.command()
def models(
    model: Annotated[list[str] | None, typer.Argument(help="Catalogue names or model directories (config.json); all if omitted.")] = None,
    expert_dtype: Annotated[str | None, typer.Option(help="Show the routed experts stored in this format: bf16, "
                                                          "fp8-block128, int8, int4-g32, int4-g128, q8_0, q4_k, q5_k, q6_k, ...")] = None,
    as_json: AsJson = False,
    as_csv: AsCsv = False,
) -> None:
    """List MoE models with their geometry and exact byte accounting.

    Sizes in decimal GB/MB. "per token" is what one decoded token touches at batch 1:
    every non-expert weight plus top-k experts in every MoE layer (no KV cache).
    A model directory is read through transformers when it is installed (every MoE
    family it knows), its safetensors headers give exact bytes, and a `.gguf` file (or a
    folder of one, split files followed) is read with every tensor's real ggml type.

    `--expert-dtype` shows every byte figure with the routed experts in that format
    (non-expert weights keep theirs).

    Examples: `moesim models`, `moesim models qwen3-30b-a3b --json`,
    `moesim models qwen3-30b-a3b --expert-dtype int4-g128`; a model directory
    (a Hugging Face folder with its config.json) works as a name too.
    """

    skipped: dict[str, str] = {}
    if model:
        specs = [get_model(m) for m in model]
        if expert_dtype is not None:
            specs = [store_as(s, expert_dtype) for s in specs]  # validates the format (one line, exit 2)
    else:
        specs, skipped = catalogue_in(expert_dtype, store_as)
    rows = [_row(s) for s in specs]
    if as_json:
        print_json({"models": rows, "specs": [s.to_dict() for s in specs]})
        return
    if as_csv:
        print_csv(rows)
        return
    out.print(table("MoE models (sizes in decimal units)", COLUMNS, [
        [r["model"], f"{r['layers']} ({r['moe_layers']})", f"{r['experts']} + {r['shared']}", str(r["top_k"]),
         f"{r['hidden']} / {r['expert_inter']}", r["expert_dtype"], f"{r['expert_bytes'] / 1e6:.2f}",
         f"{r['layer_expert_bytes'] / 1e9:.3f}", f"{r['all_expert_bytes'] / 1e9:.1f}",
         f"{r['non_expert_bytes'] / 1e9:.2f}", f"{r['bytes_per_token'] / 1e9:.2f}",
         f"{r['total_params'] / 1e9:.2f} ({r['active_params'] / 1e9:.2f})",
         ", ".join(f"{n} {k}" for k, n in r["layer_kinds"].items())] for r in rows], ["left"] + ["right"] * 12))
    for name, why in skipped.items():
        err.print(f"not listed: {name}: {why}", highlight=False, markup=False, soft_wrap=True)
