"""patch_sweep with several cells per forward vs one forward per cell, as a ratio in the same run.

    python benchmarks/patch_sweep_batch.py [--repeats 3] [--threads 2] [--tokens 16]

Model: the ~20M random Llama of capture_overhead.py (hidden 512, 8 layers, fp32). A clean and a corrupted
prompt of --tokens random ids that differ at two positions; the sweep covers every layer x position of
resid_pre. Variants, interleaved: batch_size=1 (one forward per cell, what patch_sweep did before it batched)
and batch_size=None (sized by ie_lab.sizing.batch_size_for). Before timing the two grids must agree to 1e-5,
or the script reports nothing. Prints JSON (no results file).
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from capture_overhead import build_model  # noqa: E402
from timing import interleaved_medians, parser  # noqa: E402


def main() -> int:
    ap = parser(repeats=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import ie_lab
    from ie_lab.eager.means import auto_batch_size

    lm = ie_lab.load(build_model())
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
    t = interleaved_medians({"per_cell": lambda: sweep(1), "batched": lambda: sweep(None)}, args.repeats)
    cells = lm.facts.n_layers * args.tokens
    print(
        json.dumps(
            {
                "cells": cells,
                "auto_batch_size": auto_batch_size(lm, args.tokens, 0),
                "threads": args.threads,
                "per_cell_s": round(t["per_cell"], 3),
                "batched_s": round(t["batched"], 3),
                "speedup": round(t["per_cell"] / t["batched"], 2),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
