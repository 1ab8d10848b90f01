"""``moesim fit TRACE`` and ``moesim fit --measured FILE``. Python:
``moesim.sim.device_fit.fit_profile(trace, base, name)``, ``moesim.sim.calibrate.calibrate(read_measured(path), Given(...), what)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.atomic import atomic_write_text
from moesim.cli.app import app, err, out, table
from moesim.cli.fit_measured import calibrate_and_show
from moesim.cli.options import holding
from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.hardware import DEFAULT_PROFILE, get_machine
from moesim.outputs import check_output_file
from moesim.sim.calibrate import Given
from moesim.sim.device_fit import fit_profile
from moesim.sim.replay import trace_profile
from moesim.traces.format import read_trace


@app.command()
def fit(
    trace_path: Annotated[Path | None, typer.Argument(metavar="[TRACE]", help="An executor trace with measured timings "
                                                                          "(batch 1).")] = None,
    measured: Annotated[Path | None, typer.Option(help="Instead: an engine's own benchmark output to calibrate on "
                                                       "(llama-bench -o md/json/jsonl/csv, llama-server or llama-cli "
                                                       "timing lines, ik_llama.cpp llama-bench / sweep-bench, vllm "
                                                       "bench latency --output-json, or a CSV of moesim options and "
                                                       "tokens_per_s; docs/measured-formats.md).")] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="With --measured: the output's format, when its "
                                                            "content does not say (default: detected).")] = None,
    hw_name: Annotated[str | None, typer.Option("--hw", help="Base profile (default: the one the trace was recorded on, "
                                                         f"else {DEFAULT_PROFILE}). With --measured: the GPUs the rows "
                                                         "ran on ('none' for a CPU-only build; default none).")] = None,
    host: Annotated[str | None, typer.Option(help="With --measured: the CPU the rows ran on (a built-in from "
                                                  "`moesim hw --hosts`, a host profile file, or 'this').")] = None,
    engine: Annotated[str | None, typer.Option(help="With --measured: the engine profile to start from (default: "
                                                    "the rows' engine).")] = None,
    model: Annotated[str | None, typer.Option(help="With --measured: the model the rows ran (a GGUF file, a "
                                                   "config.json folder or a catalogue name); needed where the "
                                                   "output names no file that exists here.")] = None,
    expert_dtype: Annotated[str | None, typer.Option(help="With --measured: the file type the rows ran (Q4_K_M, "
                                                          "MXFP4_MOE, bf16, ...), for outputs that print none (vLLM, "
                                                          "a log line); llama-bench's model column says it.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="With --measured: write the profile even when the fit does "
                                                      "not explain its rows (a figure at the end of its range, a "
                                                      "row missed by more than 15%); its answers keep the "
                                                      "uncalibrated range.")] = False,
    output_len: Annotated[int | None, typer.Option(help="With a vllm bench latency JSON: its --output-len (the "
                                                        "JSON does not hold it).")] = None,
    input_len: Annotated[int | None, typer.Option(help="With a vllm bench latency JSON: its --input-len.")] = None,
    batch: Annotated[int | None, typer.Option(help="With a vllm bench latency JSON: its --batch-size.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the fitted profile here (.toml). With "
                                                                "--measured: a folder for the calibrated engine "
                                                                "profile and the host profile (default "
                                                                "./moesim-calibration).")] = None,
    name: Annotated[str | None, typer.Option(help="Name of the fitted profile.")] = None,
) -> None:
    """Fit the simulator's compute model (achievable bandwidth, launch cost, per-layer
    overhead) to a trace's measured times and report the quality of the fit; or, with
    `--measured`, calibrate the engine's figures on what you measured on your machine.

    Example: `moesim fit run.npz --out mybox-fitted.toml`, then `--hw mybox-fitted.toml`
    makes any command predict for this machine without measured times.

    Example: `llama-bench -m model.gguf -o json > run.json`, then
    `moesim fit --measured run.json --host this --out mybox` (needs a dump file: run.json),
    then `moesim whatif --model model.gguf --hw none --engine mybox/engine.toml --host mybox/host.toml`
    (needs a dump file: mybox's profiles).
    """
    if measured is not None:
        if trace_path is not None:
            raise MoesimError("give a TRACE or --measured FILE, not both")
        if name is not None:
            raise MoesimError("--name names a profile fitted to a trace; a calibrated engine keeps its engine's name")
        calibrate_and_show(measured, fmt, Given(hw_name, host, engine, model, expert_dtype),
                           {"output_len": output_len, "input_len": input_len, "batch": batch},
                           out_path or Path("moesim-calibration"), keep)
        return
    if trace_path is None:
        raise MoesimError("fit needs a TRACE (an executor trace) or --measured FILE (an engine's benchmark output)")
    if unused := [o for o, v in (("--format", fmt), ("--host", host), ("--engine", engine), ("--model", model),
                                 ("--output-len", output_len), ("--input-len", input_len), ("--batch", batch),
                                 ("--expert-dtype", expert_dtype), ("--keep", keep or None))
                  if v is not None]:
        raise MoesimError(f"{', '.join(unused)}: for --measured; a trace says its own model, machine and engine")
    if out_path is not None:
        check_output_file(out_path, (".toml",))
    if hw_name and (n := get_machine(hw_name).n_gpus) != 1:
        raise MoesimError(f"fit needs one GPU profile to fit (the trace was measured on one GPU); --hw {hw_name} "
                          f"names {n or 'no'} GPUs")
    with holding(out_path, "--out"):  # two runs on one file: the second refused, not a profile lost
        trace = read_trace(trace_path)
        base, source = trace_profile(trace, hw_name)
        prof, quality = fit_profile(trace, base, name)
        if out_path is not None:
            atomic_write_text(out_path, f"# {prof.description}\n" + prof.to_toml())
            err.print(f"wrote {out_path} (profile {prof.name!r})", markup=False, highlight=False)
    for w in quality["warnings"]:
        err.print(f"warning: {w}", highlight=False, markup=False, soft_wrap=True)
    out.print(table(f"compute model fitted to {trace_path.name} ({quality['blocks']} blocks; base profile "
                    f"{base.name}, {source})",
                    ("achievable GB/s", "launch us", "layer overhead us", "R^2", "block MAE us", "block MAPE",
                     "TPOT error, fitted profile"),
                    [[f"{number(quality['mem_bw_achievable_gbs'])}", f"{number(quality['kernel_launch_us'])}",
                      f"{number(quality['layer_overhead_us'])}", f"{quality['r2']:.3f}", f"{number(quality['block_mae_us'])}",
                      f"{quality['block_mape']:.1%}", f"{quality['tpot_error_with_fitted_profile']:+.2%}"]], "right"))
    if not quality["bandwidth_fitted"]:
        err.print(f"warning: the trace's times do not grow with bytes, so its bandwidth cannot be fitted; kept "
                  f"{base.name}'s {number(quality['mem_bw_achievable_gbs'])} GB/s and fitted the fixed costs only")

