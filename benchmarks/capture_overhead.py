"""Capture overhead on the eager backend, as ratios against a bare forward measured in the same run.

    python benchmarks/capture_overhead.py [--repeats 15] [--threads 2]

Model: a ~20M-parameter random Llama (hidden 512, 8 layers), one 512-token prompt. Variants, run
interleaved so machine noise hits them alike: the bare forward; the same forward with one
hand-written forward hook that clones the middle layer's output (the floor any hook-based tool
pays); ie_lab capturing resid_post at the middle layer; ie_lab capturing resid_post at every layer.
Writes benchmarks/results/capture_overhead-<device>.json; `python benchmarks/render.py` turns the
JSON files into benchmarks/results-latest.md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import interleaved_medians, parser  # noqa: E402


def build_model():
    from transformers import LlamaConfig

    from ie_lab import tiny

    cfg = LlamaConfig(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=4096,
        max_position_embeddings=1024,
    )
    return tiny.build(cfg)  # the one builder: seed 0, fp32, eval (the same weights LlamaForCausalLM(cfg) drew)


def main() -> int:
    ap = parser(repeats=15)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import ie_lab

    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    lm = ie_lab.load(model)
    mid = lm.facts.n_layers // 2
    x = torch.randint(0, lm.facts.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
    all_addrs = [f"resid_post.{i}" for i in range(lm.facts.n_layers)]

    def bare():
        with torch.no_grad():
            model(input_ids=x, use_cache=False)

    def one_hook():
        kept = []
        h = model.model.layers[mid].register_forward_hook(lambda m, a, o: kept.append(o.detach().clone()))
        try:
            with torch.no_grad():
                model(input_ids=x, use_cache=False)
        finally:
            h.remove()
        return kept[0]

    def capture_mid():
        return ie_lab.capture(lm, x, [f"resid_post.{mid}"])

    def capture_all():
        return ie_lab.capture(lm, x, all_addrs)

    # Correctness inside the benchmark: the captured tensor must be the hooked one.
    ref = one_hook()
    if not torch.equal(capture_mid()[f"resid_post.{mid}"], ref) or not torch.equal(
        capture_all()[f"resid_post.{mid}"], ref
    ):
        print("capture does not equal the hand-written hook: refusing to report speed", file=sys.stderr)
        return 1

    variants = {"bare_forward": bare, "one_hook": one_hook, "capture_mid": capture_mid, "capture_all": capture_all}
    med = interleaved_medians(variants, args.repeats)
    result = {
        "benchmark": "capture_overhead",
        "model": f"random Llama, hidden 512, 8 layers, {n_params / 1e6:.1f}M params",
        "prompt_tokens": args.seq,
        "threads": args.threads,
        "repeats": args.repeats,
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "median_s": med,
        "ratio_vs_bare": {k: med[k] / med["bare_forward"] for k in med},
        "target": {"capture_all": 1.10},
        "date": time.strftime("%Y-%m-%d"),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "capture_overhead-cpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["ratio_vs_bare"], indent=2))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
