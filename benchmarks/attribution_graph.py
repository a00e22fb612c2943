"""ie_lab.attribution_graph against circuit-tracer's attribute() on the same prompt, model and transcoders (CPU).

    python benchmarks/attribution_graph.py [--repeats 6] [--threads 2]

Needs .venvs/circuit_tracer (`bash validator/envs/setup.sh circuit_tracer`): circuit-tracer 0.5 runs there, in a
subprocess (validator/engines/circuit_tracer_worker.py, its nnsight backend), since its transformers pin is not
ie_lab's. The demo model (ie_lab.DEMO_MODEL, 4 layers, d_model 128) with the demo transcoders (4 x 256 JumpReLU
features), one prompt, fp32, both with torch.set_num_threads(--threads), max 10 logits, desired_logit_prob 0.95,
no feature cap, at two batch sizes: the same for both (128) and each tool's default (ie_lab 32, circuit-tracer 512).
Timed: the whole call (ie_lab: attribution_graph, completeness check included; circuit-tracer: attribute(), graph
packaging included), model and transcoders loaded beforehand. Each side's first call is a warm-up; the rounds
alternate ie_lab and circuit-tracer (half the repeats each time) so a slow spell hits both. Before any time is
reported the two graphs are checked to agree (validator/circuits.py: same logits and features, edges within
EDGE_TOL).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import parser, write_result  # noqa: E402

PROMPT = "Mary and John went to the park . John gave a ball to"
BATCHES = {"same_batch_128": (128, 128), "defaults_32_512": (32, 512)}  # (ie_lab, circuit-tracer)


def main() -> int:
    ap = parser(repeats=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from safetensors.torch import load_file

    import ie_lab
    from validator import circuits as C

    py, why = C.ct_python()
    if py is None:
        print(why, file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
    ids = s.tokenizer(PROMPT)["input_ids"]
    work = tempfile.mkdtemp(prefix="ie_lab_bench_attribution_")
    settings = {k: C.SETTINGS[k] for k in ("max_n_logits", "desired_logit_prob", "node_threshold", "edge_threshold")}
    half = max(1, args.repeats // 2)
    med, all_times, checks = {}, {}, {}
    for name, (b_ie, b_ct) in BATCHES.items():
        job = {
            "model": ie_lab.DEMO_MODEL,
            "transcoders": C.folders(ie_lab.DEMO_TRANSCODERS),
            "prompts": [ids],
            "threads": args.threads,
            **settings,
            "batch_size": b_ct,
        }
        t_ie: list[float] = []
        t_ct: list[float] = []
        ref = None
        for rnd in range(2):
            # circuit-tracer: a warm-up call, then `half` timed calls, in its own process
            res = C.run_worker(py, {**job, "repeats": half + 1}, work)
            ref = res["graphs"][0]
            t_ct += ref["seconds"][1:]
            x = torch.tensor([ref["input_tokens"]])
            if rnd == 0:
                g = ie_lab.attribution_graph(s, x, tcs, batch_size=b_ie)  # warm-up
            for _ in range(half):
                t0 = time.perf_counter()
                g = ie_lab.attribution_graph(s, x, tcs, batch_size=b_ie)
                t_ie.append(time.perf_counter() - t0)
        assert ref is not None
        chk = C.compare(g, load_file(ref["file"]), ref)
        if not (chk["logits_equal"] and chk["feature_sets_equal"] and chk["edge_rel"] <= C.EDGE_TOL):
            print("the graphs disagree, not reporting speed:", chk, file=sys.stderr)
            return 1
        checks[name] = {k: chk[k] for k in ("tokens", "features_circuit_tracer", "n_logits", "edge_rel")}
        med[f"ie_lab_{name}"] = statistics.median(t_ie)
        med[f"circuit_tracer_{name}"] = statistics.median(t_ct)
        all_times[name] = {"ie_lab": t_ie, "circuit_tracer": t_ct}
        ct_threads = res["threads"]
        versions = res["versions"]
    s.close()
    ratios = {name: med[f"ie_lab_{name}"] / med[f"circuit_tracer_{name}"] for name in BATCHES}
    result = {
        "benchmark": "attribution_graph",
        "device": "cpu",
        "threads": args.threads,
        "circuit_tracer_threads": ct_threads,
        "date": datetime.date.today().isoformat(),
        "model": "the demo model (4 layers, d_model 128) + the demo transcoders (4 x 256 JumpReLU), fp32",
        "prompt": PROMPT,
        "batch_sizes": {k: {"ie_lab": v[0], "circuit_tracer": v[1]} for k, v in BATCHES.items()},
        "repeats": 2 * half,
        "load_average": [round(v, 2) for v in (*load_before, *os.getloadavg())],
        "median_s": med,
        "times_s": all_times,
        "ratio_ie_lab_over_circuit_tracer": ratios,
        "target": "ie_lab at least as fast: ratio <= 1",
        "checked": checks,
        "circuit_tracer_versions": versions,
    }
    shown = {
        "median_ms": {k: round(v * 1e3, 1) for k, v in med.items()},
        "ratio": {k: round(v, 3) for k, v in ratios.items()},
    }
    return write_result(args.out, f"attribution_graph-{args.threads}t-cpu", result, shown)


if __name__ == "__main__":
    raise SystemExit(main())
