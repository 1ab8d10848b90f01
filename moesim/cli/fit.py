"""``moesim fit TRACE``. Python: ``moesim.sim.fit.fit_profile(trace, base, name)``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moesim.atomic import atomic_write_text
from moesim.cli.app import app, err, out, table
from moesim.cli.options import holding
from moesim.errors import MoesimError
from moesim.hardware import DEFAULT_PROFILE, get_machine
from moesim.outputs import check_output_file
from moesim.sim.fit import fit_profile
from moesim.sim.replay import trace_profile
from moesim.traces.format import read_trace


@app.command()
def fit(
    trace_path: Annotated[Path, typer.Argument(metavar="TRACE", help="An executor trace with measured timings (batch 1).")],
    hw_name: Annotated[str | None, typer.Option("--hw", help="Base profile (default: the one the trace was recorded on, "
                                                         f"else {DEFAULT_PROFILE}).")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the fitted profile here (.toml).")] = None,
    name: Annotated[str | None, typer.Option(help="Name of the fitted profile.")] = None,
) -> None:
    """Fit the simulator's compute model (achievable bandwidth, launch cost, per-layer
    overhead) to a trace's measured times and report the quality of the fit.

    Example: `moesim fit run.npz --out mybox-fitted.toml`, then `--hw mybox-fitted.toml`
    makes any command predict for this machine without measured times.
    """

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
                    [[f"{quality['mem_bw_achievable_gbs']:.3g}", f"{quality['kernel_launch_us']:.3g}",
                      f"{quality['layer_overhead_us']:.3g}", f"{quality['r2']:.3f}", f"{quality['block_mae_us']:.3g}",
                      f"{quality['block_mape']:.1%}", f"{quality['tpot_error_with_fitted_profile']:+.2%}"]], "right"))
    if not quality["bandwidth_fitted"]:
        err.print(f"warning: the trace's times do not grow with bytes, so its bandwidth cannot be fitted; kept "
                  f"{base.name}'s {quality['mem_bw_achievable_gbs']:.3g} GB/s and fitted the fixed costs only")
