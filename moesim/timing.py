"""Wall-clock timing for benchmarks: the best of a few runs after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeat: int = 5, warmup: bool = True) -> float:
    """Seconds of the fastest of ``repeat`` calls (the least disturbed by the machine)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
