"""The ranges a rate, a size or a share a user gives must lie in, checked before any work.

A value that is positive and finite can still overflow or underflow what is made of it:
``--tensor-split 1e308,1e308`` sums to infinity (every share then reads 0), ``--link-gbps
1e-9`` times a copy at 10^12 ms. Each kind of number has one range here, far beyond any
real machine and far inside what a float carries, and one line names the option and the range.
"""

from __future__ import annotations

import math

from moesim.errors import MoesimError
from moesim.fmt import number

#: GB/s of a host-to-device link: 1 MB/s (a USB stick) to 100 TB/s (no link is near it).
LINK_GBPS = (1e-3, 1e5)
#: GiB of a cache, a GPU's expert budget or weights streamed: up to a zettabyte (10^12 GiB).
SIZE_GIB_MAX = 1e12
#: One GPU's share of a split (llama.cpp --tensor-split: proportions): up to 10^6 each.
SHARE_MAX = 1e6


def _real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_rate(v, option: str = "--link-gbps", low: float = LINK_GBPS[0], high: float = LINK_GBPS[1]) -> float:
    """A bandwidth in GB/s within [low, high]."""
    if not _real(v) or not low <= v <= high:
        raise MoesimError(f"{option} {_shown(v)}: a bandwidth in GB/s from {number(low)} to {number(high)}")
    return v


def check_size(v, option: str, unit: str = "GiB", auto: bool = False) -> float | str:
    """A size from 0 to :data:`SIZE_GIB_MAX` (``auto`` where the option takes it)."""
    if auto and v == "auto":
        return v
    if not _real(v) or not 0 <= v <= SIZE_GIB_MAX:
        head = "'auto' or a size" if auto else "a size"
        raise MoesimError(f"{option} {_shown(v)}: {head} in {unit} from 0 to {number(SIZE_GIB_MAX)}")
    return v


def check_shares(ratios) -> list[float]:
    """``--tensor-split`` shares: each from 0 to :data:`SHARE_MAX`, their sum above 0."""
    rs = list(ratios)
    if not rs or not all(_real(r) and 0 <= r <= SHARE_MAX for r in rs) or not sum(rs) > 0:
        raise MoesimError(f"--tensor-split {','.join(_shown(r) for r in rs)}: shares from 0 to {number(SHARE_MAX)} "
                          "with a positive sum")
    return rs


def check_count(v, option: str, low: int = 0, auto: bool = False, what: str = "a count") -> int | str:
    """A whole number >= ``low`` (``auto`` where the option takes it)."""
    if auto and v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise MoesimError(f"{option} {_shown(v)}: {'auto or ' if auto else ''}{what} >= {low}")
    return v


def _shown(v) -> str:
    """``v`` as the message shows it: a number without an exponent, else as given."""
    if _real(v) and abs(v) >= 1e15:  # 1e308 in full would be 400 characters
        return f"{'-' if v < 0 else ''}above {number(1e15)}"
    return number(v) if _real(v) else str(v)
