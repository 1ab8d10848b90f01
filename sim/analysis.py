"""What bounds a simulated configuration, in words: the one place a result row is explained.

A row is a :meth:`moesim.sim.simulate.SimResult.summary` (or a what-if row): per-token
means of compute, copy and stall. A configuration is *copy-bound* when its expert copies
take longer than its compute (a faster link or a bigger cache helps), else
*compute-bound* (overlap is already as good as it gets).
"""

from __future__ import annotations

from typing import Any

from moesim.fmt import number
from moesim.policy import get_policy


def bound(row: dict[str, Any]) -> str:
    """``copy`` or ``compute``: which of the two per-token times is larger."""
    return "copy" if row["copy_ms"] > row["compute_ms"] else "compute"


#: The parts a TPOT is split into (:func:`tpot_parts`), in the order a chart stacks them.
PARTS = ("GPU", "CPU", "copies", "other")


def _ms(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and v == v else 0.0


def tpot_parts(row: dict[str, Any]) -> dict[str, float]:
    """The row's TPOT split into what the step waits on, summing to ``tpot_ms``: the GPU's own
    work (``compute_ms``), expert copies it waits for (``stall_ms``), the CPU past both (its
    layers, or its experts beyond the GPU's: the part of ``cpu_ms`` not hidden under the GPU's
    work), and the rest (activations crossing between devices)."""
    tpot = _ms(row, "tpot_ms")
    gpu, copies = min(_ms(row, "compute_ms"), tpot), _ms(row, "stall_ms")
    copies = min(copies, tpot - gpu)
    rest = tpot - gpu - copies
    cpu = min(_ms(row, "cpu_ms"), rest)
    return {"GPU": gpu, "CPU": cpu, "copies": copies, "other": rest - cpu}


def why(row: dict[str, Any]) -> str:
    """One sentence on what bounds a configuration: the part of :func:`tpot_parts` that
    dominates its TPOT (and a caveat for speculative policies)."""
    exact = get_policy(row["policy"]).exact
    caveat = "" if exact else " (speculative execution: outputs may differ from exact decoding)"
    parts = tpot_parts(row)
    top = max(PARTS, key=lambda p: parts[p])
    tpot = row["tpot_ms"]
    if top == "CPU":
        return (f"CPU-bound: {number(parts['CPU'])} of its {number(tpot)} ms per token wait on the host CPU "
                f"({number(_ms(row, 'cpu_ms'))} ms of CPU work; the GPU's own {number(parts['GPU'])} ms){caveat}")
    if top == "other":
        return (f"transfer-bound: {number(parts['other'])} of its {number(tpot)} ms per token move activations between "
                f"devices{caveat}")
    if row["copy_ms"] == 0 and parts["CPU"] + parts["other"] > 0.01 * tpot:
        return (f"GPU-bound: {number(parts['GPU'])} of its {number(tpot)} ms per token are the GPU's own work (no expert "
                f"copies; {number(parts['CPU'] + parts['other'])} ms wait on the CPU and transfers){caveat}")
    if row["copy_ms"] == 0:
        return f"compute-bound: no expert copies; {number(row['compute_ms'])} ms of compute per token{caveat}"
    share = row["stall_ms"] / row["tpot_ms"]
    return (f"{bound(row)}-bound: copies take {number(row['copy_ms'])} ms and compute {number(row['compute_ms'])} ms "
            "per token; "
            f"{share:.0%} of the step waits on the link (ideal overlap would give {number(row['overlap_bound_ms'])} ms)"
            f"{caveat}")
