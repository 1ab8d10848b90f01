"""What bounds a simulated configuration, in words: the one place a result row is explained.

A row is a :meth:`moesim.sim.simulate.SimResult.summary` (or a what-if row): per-token
means of compute, copy and stall. A configuration is *copy-bound* when its expert copies
take longer than its compute (a faster link or a bigger cache helps), else
*compute-bound* (overlap is already as good as it gets).
"""

from __future__ import annotations

from typing import Any

from moesim.policy import get_policy


def bound(row: dict[str, Any]) -> str:
    """``copy`` or ``compute``: which of the two per-token times is larger."""
    return "copy" if row["copy_ms"] > row["compute_ms"] else "compute"


def why(row: dict[str, Any]) -> str:
    """One sentence on what bounds a configuration (and a caveat for speculative policies)."""
    exact = get_policy(row["policy"]).exact
    caveat = "" if exact else " (speculative execution: outputs may differ from exact decoding)"
    if row["copy_ms"] == 0:
        return f"compute-bound: no expert copies; {row['compute_ms']:.3g} ms of compute per token{caveat}"
    share = row["stall_ms"] / row["tpot_ms"]
    return (f"{bound(row)}-bound: copies take {row['copy_ms']:.3g} ms and compute {row['compute_ms']:.3g} ms "
            "per token; "
            f"{share:.0%} of the step waits on the link (ideal overlap would give {row['overlap_bound_ms']:.3g} ms)"
            f"{caveat}")
