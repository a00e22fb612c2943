"""vLLM Session modes as ratios measured in one run: generation-only (compiled, no hooks) vs hooks mode, and graph-mode
steering (compiled trunk, static steering buffers) vs graph-mode plain generation vs hooks-mode steering.

    python benchmarks/vllm_modes.py [--repeats 5] [--new 32] [--model PATH] [--out DIR]

Model: the random Llama of vllm_generate.py (4 layers, d_model 512, ~12M parameters, fp32), or --model (a folder or
HF id; fp32). Three Sessions on the same folder: mode='hooks' (the default, eager engine), mode='generate' (vLLM's
compiled model, nothing of ie_lab's inside) and graph mode with steer_points=[resid_post at the middle layer]. Each
round times 8 concurrent 32-token greedy agenerate calls per variant, variants interleaved (the order turned each
round), after one warm-up round each:

  hooks             hooks mode, plain
  generate          generation-only mode
  graph             graph mode, plain (the steering buffers are in the trunk, every row left alone)
  graph_steer       graph mode, the 8 requests each steered with its own method and vector
  hooks_steer       hooks mode, the same 8 steered requests

Greedy ids are checked before any time is reported: generate's equal hooks', graph's equal hooks', graph_steer's
equal hooks_steer's. Prints JSON with the medians and ratios (targets from issue 17: graph_steer / graph <= 1.10,
graph_steer faster than hooks_steer) and writes results/vllm_modes-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
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

METHODS = [
    ("add", {"scale": 4.0}),
    ("orthogonal", {"scale": 0.5}),
    ("cap", {"min": -0.5, "max": 0.5}),
    ("norm_scaled_add", {"scale": 0.5}),
    ("ablate", {}),
    ("swap", {"target": 3.0}),
    ("add", {"scale": -4.0, "normalize": True}),
    ("orthogonal", {"scale": 0.0}),
]


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--model", default=None, help="a folder or HF id (default: the random Llama, built here)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    import torch

    import ie_lab

    tmp = tempfile.mkdtemp(prefix="ie_lab-bench-modes-")
    sessions: list = []
    try:
        path = args.model
        if path is None:
            build(tmp)
            path = tmp
        kw: dict = dict(backend="vllm", progress=False, replace=False, dtype="float32")
        if torch.cuda.is_available():  # three engines share the GPU (vLLM's default would give the first 90%)
            kw["engine_kwargs"] = {"gpu_memory_utilization": 0.25}
        load_s = {}
        for name, extra in (("hooks", {}), ("generate", {"mode": "generate"}), ("graph", None)):
            if extra is None:  # graph mode: one steering site, in the middle of the trunk
                layer = sessions[0].facts.n_layers // 2
                site = f"resid_post.{layer}"
                extra = {"steer_points": [site]}
            t0 = time.perf_counter()
            sessions.append(ie_lab.Session(path, **kw, **extra))
            load_s[name] = round(time.perf_counter() - t0, 1)
        hooks, gen, graph = sessions
        d = hooks.facts.d_model
        vecs = [torch.randn(d, generator=torch.Generator().manual_seed(i)) * 3 for i in range(len(PROMPTS))]

        def specs(s):
            return [s.steer(site, v, method=m, **k) for v, (m, k) in zip(vecs, METHODS)]

        steer = {"graph_steer": specs(graph), "hooks_steer": specs(hooks)}

        def batch(s, spec_list=None):
            async def many():
                return await asyncio.gather(
                    *(
                        s.agenerate(p, args.new, ignore_eos=True, **({"steer": spec_list[i]} if spec_list else {}))
                        for i, p in enumerate(PROMPTS)
                    )
                )

            t = time.perf_counter()
            out = asyncio.run(many())
            return time.perf_counter() - t, [g.ids for g in out]

        variants = {
            "hooks": lambda: batch(hooks),
            "generate": lambda: batch(gen),
            "graph": lambda: batch(graph),
            "graph_steer": lambda: batch(graph, steer["graph_steer"]),
            "hooks_steer": lambda: batch(hooks, steer["hooks_steer"]),
        }
        ids = {k: fn()[1] for k, fn in variants.items()}  # the warm-up round, and the checks
        for a, b in (("generate", "hooks"), ("graph", "hooks"), ("graph_steer", "hooks_steer")):
            if ids[a] != ids[b]:
                print(f"{a}'s greedy ids differ from {b}'s: no figures reported", file=sys.stderr)
                return 1
        if ids["graph_steer"] == ids["graph"]:
            print("the steering changed no token: no figures reported", file=sys.stderr)
            return 1
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(variants[name]()[0])
        for s in sessions:
            s.close()
        sessions.clear()
        med = {k: statistics.median(v) for k, v in times.items()}
        tokens = len(PROMPTS) * args.new
        cuda = torch.cuda.is_available()
        result = {
            "benchmark": "vllm_modes",
            "device": "cuda" if cuda else "cpu",
            "date": datetime.date.today().isoformat(),
            "model": args.model or "random Llama, 4 layers, d_model 512, 8x64 heads, vocab 512",
            "dtype": "float32",
            "workload": f"{len(PROMPTS)} concurrent x {args.new} greedy tokens",
            "steering": f"{site}, each request its own method and vector (add, orthogonal, cap, norm_scaled_add, "
            "ablate, swap, add normalized, orthogonal 0)",
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "tok_per_s": {k: round(tokens / v, 1) for k, v in med.items()},
            "ratios": {
                "hooks / generate (time)": round(med["hooks"] / med["generate"], 3),
                "graph_steer / graph (time)": round(med["graph_steer"] / med["graph"], 3),
                "graph_steer / generate (time)": round(med["graph_steer"] / med["generate"], 3),
                "hooks_steer / graph_steer (time)": round(med["hooks_steer"] / med["graph_steer"], 3),
            },
            "targets": {
                "graph_steer / graph (time)": "<= 1.10",
                "hooks_steer / graph_steer (time)": "> 1 (graph-mode steering faster than hooks-mode steering)",
            },
            "load_s": load_s,
            "repeats": args.repeats,
            "threads": os.environ.get("OMP_NUM_THREADS"),
            # kept for readers of the first version of this script
            "hooks_s": round(med["hooks"], 4),
            "generate_s": round(med["generate"], 4),
            "speedup_generate_vs_hooks": round(med["hooks"] / med["generate"], 3),
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"vllm_modes-{result['device']}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
        return 0
    finally:
        for s in sessions:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
