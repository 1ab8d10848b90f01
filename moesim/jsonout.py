"""Strict JSON for every ``--json``: what ``moesim.cli.app.print_json`` prints.

Kept out of the CLI module so the command layer stays thin (tests/test_layers.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def strict_json(obj: Any) -> Any:
    """``obj`` with what strict JSON cannot hold made explicit: a NaN or infinite number
    becomes null and, inside an object, a ``<key>_reason`` beside it says why (``NaN``:
    not defined for this input, e.g. no samples or the baseline itself; ``Infinity``:
    unbounded); numpy scalars and arrays become numbers and lists, tuples lists, anything
    else its ``str`` (as ``default=str`` did)."""
    import math

    def plain(v: Any) -> Any:
        return v.tolist() if type(v).__module__ == "numpy" and hasattr(v, "tolist") else v

    def walk(v: Any) -> Any:
        v = plain(v)
        if isinstance(v, dict):
            out: dict[str, Any] = {}
            for k, x in v.items():
                x = plain(x)
                out[str(k)] = walk(x)
                if isinstance(x, float) and not math.isfinite(x):
                    out.setdefault(f"{k}_reason", "not defined for this input (NaN)" if math.isnan(x)
                                   else "unbounded (infinite)")
            return out
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        return str(v)

    return walk(obj)


def print_json(obj: Any) -> None:
    """Strict JSON on stdout and nothing else (no NaN or Infinity: :func:`strict_json`);
    progress and notes go to stderr."""
    sys.stdout.write(json.dumps(strict_json(obj), indent=2, allow_nan=False) + "\n")
