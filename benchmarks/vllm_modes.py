"""vLLM Session modes: generation-only (compiled, no hooks) vs hooks mode, as a ratio measured in one run.

    python benchmarks/vllm_modes.py [--repeats 5] [--new 32]

Model: the random Llama of vllm_generate.py (4 layers, d_model 512, ~12M parameters, fp32). Two Sessions on the same
folder, one in mode='hooks' (the default, eager engine) and one in mode='generate' (vLLM's compiled model, nothing of
ie_lab's inside); each round times 8 concurrent 32-token greedy agenerate calls on both, alternating which goes first,
after one warm-up round each. The greedy ids of both modes are checked equal before any time is reported. Prints
the medians and the ratio (hooks time / generate time: above 1 means generation-only mode is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from vllm_generate import PROMPTS, build  # noqa: E402


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    import ie_lab

    tmp = tempfile.mkdtemp(prefix="ie_lab-bench-modes-")
    try:
        build(tmp)
        t0 = time.perf_counter()
        hooks = ie_lab.Session(tmp, backend="vllm", progress=False, replace=False)
        t_hooks_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen = ie_lab.Session(tmp, backend="vllm", progress=False, replace=False, mode="generate")
        t_gen_load = time.perf_counter() - t0

        def batch(s):
            async def many():
                return await asyncio.gather(*(s.agenerate(p, args.new, ignore_eos=True) for p in PROMPTS))

            t = time.perf_counter()
            out = asyncio.run(many())
            return time.perf_counter() - t, [g.ids for g in out]

        _, ids_h = batch(hooks)
        _, ids_g = batch(gen)
        if ids_h != ids_g:
            print("generation-only mode's greedy ids differ from hooks mode's: no figures reported", file=sys.stderr)
            return 1
        times: dict[str, list[float]] = {"hooks": [], "generate": []}
        for r in range(args.repeats):
            order = [("hooks", hooks), ("generate", gen)]
            for name, s in order if r % 2 == 0 else order[::-1]:
                times[name].append(batch(s)[0])
        hooks.close()
        gen.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        tokens = len(PROMPTS) * args.new
        print(
            json.dumps(
                {
                    "workload": f"{len(PROMPTS)} concurrent x {args.new} greedy tokens",
                    "hooks_s": round(med["hooks"], 4),
                    "generate_s": round(med["generate"], 4),
                    "hooks_tok_s": round(tokens / med["hooks"], 1),
                    "generate_tok_s": round(tokens / med["generate"], 1),
                    "speedup_generate_vs_hooks": round(med["hooks"] / med["generate"], 3),
                    "load_s": {"hooks": round(t_hooks_load, 1), "generate": round(t_gen_load, 1)},
                    "repeats": args.repeats,
                    "threads": os.environ.get("OMP_NUM_THREADS"),
                },
                indent=1,
            )
        )
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
