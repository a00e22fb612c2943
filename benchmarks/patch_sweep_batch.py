"""patch_sweep with several cells per forward vs one forward per cell, as a ratio in the same run.

    python benchmarks/patch_sweep_batch.py [--model bench20m|demo] [--repeats 3] [--threads 2] [--tokens N]

Model (--model, as in eager_batch.py): bench20m, the ~20M random Llama of capture_overhead.py (hidden 512,
8 layers, fp32; --tokens 16 by default), or demo, the trained model shipped in the package (hidden 128,
4 layers; --tokens 32 by default, so both grids have 128 cells). A clean and a corrupted prompt of --tokens
random ids that differ at two positions; the sweep covers every layer x every position of resid_pre.
Variants, interleaved: batch_size=1 (one forward per cell, what patch_sweep did before it batched) and
batch_size=None (sized by ie_lab.sizing.batch_size_for). Before timing the two grids must agree to 1e-5, or
the script reports nothing. After timing each variant runs once more for its peak memory (the process's RSS
growth, measured as eager_batch.peak_rss_growth says). Prints JSON and writes
benchmarks/results/patch_sweep_batch-<model>-cpu.json.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from eager_batch import MODELS, _rss_kb, load_model, peak_rss_growth  # noqa: E402
from timing import interleaved_medians, parser, write_result  # noqa: E402

DEFAULT_TOKENS = {"bench20m": 16, "demo": 32}


def main() -> int:
    ap = parser(repeats=3)
    ap.add_argument("--model", choices=MODELS, default="bench20m")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (16 on bench20m, 32 on demo)")
    args = ap.parse_args()
    args.tokens = args.tokens or DEFAULT_TOKENS[args.model]
    torch.set_num_threads(args.threads)

    import ie_lab
    from ie_lab.eager.means import auto_batch_size

    model, model_desc = load_model(args.model)
    lm = ie_lab.load(model)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, lm.facts.vocab_size, (1, args.tokens), generator=g)
    corrupt = clean.clone()
    corrupt[0, [1, args.tokens // 2]] = torch.randint(4, lm.facts.vocab_size, (2,), generator=g)
    metric = ie_lab.logit_diff(5, 6)

    def sweep(bs):
        return ie_lab.patch_sweep(lm, clean, corrupt, metric, progress=False, batch_size=bs)

    one, auto = sweep(1), sweep(None)
    if not torch.allclose(one.values, auto.values, atol=1e-5, rtol=1e-5):
        print("batched and unbatched grids differ; nothing measured", file=sys.stderr)
        return 1
    variants = {"per_cell": lambda: sweep(1), "batched": lambda: sweep(None)}
    t = interleaved_medians(variants, args.repeats)
    base_rss_mb = round(_rss_kb("VmRSS") / 1024, 1)
    peak = {k: peak_rss_growth(fn) for k, fn in variants.items()}
    cells = lm.facts.n_layers * args.tokens
    result = {
        "benchmark": "patch_sweep_batch",
        "model": model_desc,
        "model_key": args.model,
        "grid": f"resid_pre, {lm.facts.n_layers} layers x {args.tokens} positions",
        "cells": cells,
        "auto_batch_size": auto_batch_size(lm, args.tokens, 0),
        "threads": args.threads,
        "repeats": args.repeats,
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "per_cell_s": round(t["per_cell"], 3),
        "batched_s": round(t["batched"], 3),
        "speedup": round(t["per_cell"] / t["batched"], 2),
        "target_speedup": 3.0,
        "rss_before_mb": base_rss_mb,
        "peak_rss_growth_mb": peak,
        "date": time.strftime("%Y-%m-%d"),
    }
    return write_result(args.out, f"patch_sweep_batch-{args.model}-cpu", result, result)


if __name__ == "__main__":
    raise SystemExit(main())
