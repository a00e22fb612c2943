"""patch_sweep as it runs now vs one forward per cell vs the previous batched sweep, as ratios in the same run.

    python benchmarks/patch_sweep_batch.py [--model bench20m|demo] [--repeats 5] [--threads 2] [--tokens N]

Model (--model, as in eager_batch.py): bench20m, the ~20M random Llama of capture_overhead.py (hidden 512,
8 layers, fp32; --tokens 16 by default), or demo, the trained model shipped in the package (hidden 128,
4 layers; --tokens 32 by default, so both grids have 128 cells). A clean and a corrupted prompt of --tokens
random ids that differ at two positions; the sweep covers every layer x every position of resid_pre.
Variants, interleaved:

- per_cell: one forward of the whole prompt per cell (batch_size=1 without reusing the prefix: what patch_sweep
  did before it batched);
- batched: several cells per forward, each over the whole prompt (batch_size=None without reusing the prefix:
  the previous implementation);
- prefix: patch_sweep as it runs now (batch_size=None): each forward computes only the positions from its first
  patched one on, on the corrupted run's cached prefix (ie_lab/eager/sweep.py).

Before timing the three grids must agree to 1e-5, or the script reports nothing. After timing each variant runs
once more for its peak memory (the process's RSS growth, measured as eager_batch.peak_rss_growth says). The load
average (os.getloadavg) before and after is recorded beside the figures: on a shared machine read only quiet runs.
Prints JSON and writes benchmarks/results/patch_sweep_batch-<model>-cpu.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from eager_batch import MODELS, _rss_kb, load_model, peak_rss_growth  # noqa: E402
from timing import interleaved_times, parser, write_result  # noqa: E402

DEFAULT_TOKENS = {"bench20m": 16, "demo": 32}


def main() -> int:
    ap = parser(repeats=5)
    ap.add_argument("--model", choices=MODELS, default="bench20m")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (16 on bench20m, 32 on demo)")
    args = ap.parse_args()
    args.tokens = args.tokens or DEFAULT_TOKENS[args.model]
    torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]

    import ie_lab
    from ie_lab.eager import sweep
    from ie_lab.eager.means import auto_batch_size

    model, model_desc = load_model(args.model)
    lm = ie_lab.load(model)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, lm.facts.vocab_size, (1, args.tokens), generator=g)
    corrupt = clean.clone()
    corrupt[0, [1, args.tokens // 2]] = torch.randint(4, lm.facts.vocab_size, (2,), generator=g)
    metric = ie_lab.logit_diff(5, 6)

    def whole_prompt(bs):
        return sweep._patch_sweep(
            lm,
            clean,
            corrupt,
            metric,
            point="resid_pre",
            over="layer_position",
            layers=None,
            progress=False,
            batch_size=bs,
            reuse_prefix=False,
        )

    variants = {
        "per_cell": lambda: whole_prompt(1),
        "batched": lambda: whole_prompt(None),
        "prefix": lambda: ie_lab.patch_sweep(lm, clean, corrupt, metric, progress=False),
    }
    grids = {k: fn().values for k, fn in variants.items()}
    for k in ("batched", "prefix"):
        if not torch.allclose(grids["per_cell"], grids[k], atol=1e-5, rtol=1e-5):
            print(f"the {k} grid differs from one forward per cell; nothing measured", file=sys.stderr)
            return 1
    times = interleaved_times(variants, args.repeats)
    t = {k: statistics.median(v) for k, v in times.items()}
    load_after = [round(x, 2) for x in os.getloadavg()]
    base_rss_mb = round(_rss_kb("VmRSS") / 1024, 1)
    peak = {k: peak_rss_growth(fn) for k, fn in variants.items()}
    cells = lm.facts.n_layers * args.tokens
    bs = auto_batch_size(lm, args.tokens, 0)
    result = {
        "benchmark": "patch_sweep_batch",
        "model": model_desc,
        "model_key": args.model,
        "grid": f"resid_pre, {lm.facts.n_layers} layers x {args.tokens} positions",
        "cells": cells,
        "auto_batch_size": bs,
        "prefix_forwards": len(sweep._prefix_chunks(lm.facts.n_layers, args.tokens, bs, 1, 64.0)),
        "threads": args.threads,
        "repeats": args.repeats,
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "per_cell_s": round(t["per_cell"], 3),
        "batched_s": round(t["batched"], 3),
        "prefix_s": round(t["prefix"], 3),
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        # speedup: patch_sweep as it runs now over one forward per cell (issue 16's target); the others beside it
        "speedup": round(t["per_cell"] / t["prefix"], 2),
        "batched_speedup": round(t["per_cell"] / t["batched"], 2),
        "prefix_over_batched": round(t["batched"] / t["prefix"], 2),
        "target_speedup": 3.0,
        "rss_before_mb": base_rss_mb,
        "peak_rss_growth_mb": peak,
        "date": time.strftime("%Y-%m-%d"),
    }
    return write_result(args.out, f"patch_sweep_batch-{args.model}-cpu", result, result)


if __name__ == "__main__":
    raise SystemExit(main())
