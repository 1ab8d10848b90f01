"""Numbers as people read them: no ``9.73e+03`` in a table or a sentence.

Shared by the CLI tables and the HTML reports so a figure reads the same in both.
"""

from __future__ import annotations

import math
from decimal import Decimal


def number(v: float, digits: int = 3) -> str:
    """``digits`` significant digits, never an exponent (``9,730``, ``12.3``, ``0.0412``,
    ``0.0000983``); below 10^-12 it reads ``<0.000000000001``."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e15:  # its significant digits, then zeros (a float's 1e20 is 100000000000000000000, not ...0001)
        return format(Decimal(f"{v:.{digits}g}"), ",f")
    if a >= 10 ** (digits - 1):
        return f"{v:,.0f}"
    if a < 1e-12:
        return ("-" if v < 0 else "") + "<0.000000000001"
    decimals = max(0, digits - 1 - math.floor(math.log10(a)))
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration_ms(ms: float) -> str:
    """A duration given in ms, in ms below a second and in s from there (``412 ms``, ``9.73 s``)."""
    if not isinstance(ms, int | float) or not math.isfinite(ms):
        return str(ms)
    return f"{number(ms / 1e3)} s" if abs(ms) >= 1e3 else f"{number(ms)} ms"


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``: a count and its noun (a regular plural, ``s`` added)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def link(gbps: float | None) -> str:
    """``link 25 GB/s``, or ``no GPU link`` for a machine without a GPU (``--hw none``)."""
    return "no GPU link" if gbps is None else f"link {number(gbps)} GB/s"


def printable(text: str) -> str:
    """``text`` as a terminal may show it: each control character (an escape sequence in a
    GGUF's ``general.name`` or a GPU's NVML name would recolour the table) becomes ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def nearest_hint(name: str, known) -> str:
    """``" (nearest: 'epyc-7343')"`` for an unknown ``name`` close to one of ``known``, else ``""``:
    a way forward from a typo or a neighbouring part. Nearest: the longest common prefix (a
    part's family and generation: epyc-7302 is nearer epyc-7343 than epyc-7742), then difflib's
    ratio, which must be at least 0.6."""
    import difflib
    import os

    given = str(name).strip().lower()
    scored = [(len(os.path.commonprefix([given, k.lower()])), difflib.SequenceMatcher(None, given, k.lower()).ratio(), k)
              for k in known]
    scored = [s for s in scored if s[1] >= 0.6]
    return f" (nearest: {max(scored)[2]!r})" if scored else ""
