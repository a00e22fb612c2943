"""The one timing loop of the in-process benchmarks: variants interleaved, so a slow spell hits them all."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_medians(variants: dict[str, Callable[[], object]], repeats: int, warm: bool = True) -> dict[str, float]:
    """Median seconds per variant over `repeats` rounds, each round running every variant once in turn."""
    if warm:
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
