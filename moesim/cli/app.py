"""The typer ``app``, the consoles and the small parse helpers every command module shares.

Commands live one per module (``moesim/cli/<command>.py``): parse, call one library
function, print; a Python user does the same with that call (docs/cli.md names it).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moesim import __version__
from moesim.cli.lists import auto_or, floats, ints, split  # noqa: F401 (re-exported: every command imports them from here)
from moesim.fmt import number
from moesim.jsonout import print_json as print_json  # strict JSON (no NaN or Infinity); re-exported

HELP = """How fast will this MoE decode on this hardware, with which offloading policy, and why?

moesim models MoE decoding with expert weights in host memory: it replays routing traces
against hardware profiles (SimPy discrete-event model, plus a fast path for sweeps).
Commands write their outputs into the current directory unless told otherwise.

**Your machine:** `moesim whatif --model qwen3-30b-a3b --expert-dtype q4_k_m --hw rtx4090 --host ryzen-7950x --engine llama.cpp --tokens 64 --jobs 1`:
how fast Qwen3-30B-A3B at Q4_K_M decodes on an RTX 4090 and a Ryzen 9 7950X under llama.cpp,
with the winning placement's llama-server arguments and the range measurements of such
deployments fell in (your GGUF: `--model FILE.gguf`; this machine: `--hw this --host this`).

**Start here:** `moesim whatif` (long-running: no arguments) sweeps Qwen3-30B-A3B on three GPUs under
every policy and writes a report to ./moesim-whatif/.

**Examples:**

* `moesim models` - the model catalogue with byte accounting
* `moesim hw h200` - a hardware profile, every figure with its source
* `moesim synth --model olmoe-1b-7b --tokens 64 --out olmoe.npz` - a synthetic trace
* `moesim replay olmoe.npz --hw a6000 --policy on-demand,prefetch,oracle --out olmoe-report`
* `moesim whatif --model olmoe-1b-7b --hw a6000,gh200 --link-gbps 16,32 --cache-gib 0,1 --tokens 32 --jobs 1`
* `moesim profile --model tiny --policy prefetch-fom --link-gbps 0.5 --tokens 4 --out run.npz` - decode with the reference executor
* `moesim replay run.npz --validate` - the simulator against that measurement
* `moesim validate` (long-running) - the validation suite on this machine
"""

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown", help=HELP)


def _columns() -> int | None:
    """The width COLUMNS gives, or None when it gives none: unset, not a whole number, or under
    20 (rich would print nothing at all at ``COLUMNS=0``)."""
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return width if width >= 20 else None


if "COLUMNS" in os.environ and _columns() is None:
    del os.environ["COLUMNS"]  # rich reads it too: a terminal's own width (or 200) instead
# Pipes and files get whole tables (200 columns) unless COLUMNS says otherwise; a terminal its width.
out = Console(width=_columns() or (None if sys.stdout is not None and sys.stdout.isatty() else 200))
err = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"moesim {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


#: ``--json`` and ``--csv`` of the commands that print a table, declared once.
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
AsCsv = Annotated[bool, typer.Option("--csv", help="Print CSV (every field) instead of a table.")]


def print_csv(rows: list[dict[str, Any]]) -> None:
    """Rows as CSV on stdout, every field (the union of the rows' keys, in first-seen order)."""
    fields: dict[str, None] = {}
    for r in rows:
        fields.update(dict.fromkeys(r))
    w = csv.DictWriter(sys.stdout, list(fields), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()})


def _fit_columns(columns: list[str], rows: list[list[str]], width: int) -> list[int]:
    """Indices of the columns to show so the table fits ``width``: all if they fit, else the
    first ones in order (a table's columns are listed most important first)."""
    need = [max([len(c)] + [len(r[i]) for r in rows]) + 3 for i, c in enumerate(columns)]  # padding and rule
    keep, used = [], 4
    for i, n in enumerate(need):
        if used + n <= width or not keep:
            keep.append(i)
            used += n
    return keep


def table(title: str, columns: tuple[str, ...] | list[str], rows: list[list[str]],
          justify: str | list[str] = "left", width: int | None = None) -> Table:
    """A rich table; ``justify`` for all columns or one per column. Columns that do not fit
    the console (``width``, default the stdout console's) are left out, most important
    kept (the leftmost), and the caption names them: ``--json`` / ``--csv`` have all."""
    columns = list(columns)
    width = width or out.width
    keep = _fit_columns(columns, rows, width)
    t = Table(title=Text(title))  # Text: a file or profile name's [brackets] are shown, not read as markup
    for i in keep:
        t.add_column(columns[i], justify=justify if isinstance(justify, str) else justify[i])
    for r in rows:
        t.add_row(*[Text(str(r[i])) for i in keep])
    dropped = [columns[i] for i in range(len(columns)) if i not in keep]
    if dropped:
        t.caption = f"not shown at {width} columns: {', '.join(dropped)} (all in --json / --csv, or a wider terminal)"
    return t


def results_table(rows: list[dict[str, Any]], title: str, cols: tuple[tuple[str, str], ...]) -> Table:
    """Result rows, floats to 3 significant digits without exponents (moesim.fmt.number); a
    value a row does not have (None: no CPU in an all-GPU layout; NaN: a selection without a
    confidence threshold has none) is shown as ``-``."""

    def cell(v: Any) -> str:
        return "-" if v is None or v != v else number(v) if isinstance(v, float) else str(v)

    return table(title, [label for _, label in cols], [[cell(r[k]) for k, _ in cols] for r in rows], "right")


