"""Generation, capture-during-generation and steering costs, as ratios measured in one run.

    python benchmarks/generation.py [--repeats 5] [--threads 2]

Model: the ~25M random Llama of capture_overhead.py. Variants (interleaved, median after a warm-up):
  hf_generate        HF `generate`, greedy, 128-token prompt, 128 new tokens (the baseline)
  ie_stream          ie_lab.generate_stream, same prompt and length          target >= 0.90x HF tok/s
  gen_then_rerun     HF generate 32 tokens, then one forward over prompt+generated capturing every resid_post
  capture_gen        ie_lab.generate 32 tokens capturing every resid_post     target >= 1.5x faster than gen_then_rerun
  gen_then_rerun_512 / capture_gen_512   the same two with a 512-token prompt (the re-run grows with the prompt)
  unsteered_32 / steered_32   32 tokens without / with additive steering at two layers   target <= 1.10x
Each variant's output is checked against HF's greedy tokens before any time is reported.
"""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from timing import interleaved_medians, parser, write_result  # noqa: E402


def main() -> int:
    args = parser(repeats=5).parse_args()
    torch.set_num_threads(args.threads)

    from capture_overhead import build_model

    import ie_lab

    model = build_model()
    lm = ie_lab.load(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, lm.facts.vocab_size, (1, 128), generator=g)
    all_res = [f"resid_post.{i}" for i in range(lm.facts.n_layers)]
    v = torch.randn(lm.facts.d_model, generator=g) * 1e-3  # tiny: steering must not change greedy tokens here

    def hf(n):
        with torch.no_grad():
            return model.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, prompt.shape[1] :].tolist()

    ref128, ref32 = hf(128), hf(32)
    lm.hf.generation_config.eos_token_id = None

    def ie_stream():
        return [s.token_id for s in ie_lab.generate_stream(lm, prompt, 128, keep_logits=False)]

    def gen_then_rerun():
        toks = hf(32)
        full = torch.cat([prompt, torch.tensor([toks])], 1)
        return toks, ie_lab.capture(lm, full, all_res)

    def capture_gen():
        r = ie_lab.generate(lm, prompt, 32, capture=all_res, keep_logits=False)
        return r.ids, r.cache

    prompt512 = torch.randint(3, lm.facts.vocab_size, (1, 512), generator=g)

    def gen_then_rerun_512():
        with torch.no_grad():
            toks = model.generate(
                prompt512, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, 512:].tolist()
        return toks, ie_lab.capture(lm, torch.cat([prompt512, torch.tensor([toks])], 1), all_res)

    def capture_gen_512():
        r = ie_lab.generate(lm, prompt512, 32, capture=all_res, keep_logits=False)
        return r.ids, r.cache

    def unsteered():
        return ie_lab.generate(lm, prompt, 32, keep_logits=False).ids

    spec = ie_lab.steer(lm, ["resid_post.2", "resid_post.5"], v, scale=1.0)

    def steered():
        return ie_lab.generate(lm, prompt, 32, steer=spec, keep_logits=False).ids

    checks = {
        "ie_stream": ie_stream() == ref128,
        "capture_gen": capture_gen()[0] == ref32,
        "unsteered_32": unsteered() == ref32,
        "steered_32": steered() == ref32,
    }
    a, b = gen_then_rerun()[1], capture_gen()[1]
    checks["capture_gen_tensors"] = all(torch.allclose(a[k], b[k], atol=1e-4) for k in all_res)
    (ta, a5), (tb, b5) = gen_then_rerun_512(), capture_gen_512()
    checks["capture_gen_512"] = ta == tb and all(torch.allclose(a5[k], b5[k], atol=1e-4) for k in all_res)
    if not all(checks.values()):
        print("correctness check failed, not reporting speed:", checks, file=sys.stderr)
        return 1

    variants = {
        "hf_generate": lambda: hf(128),
        "ie_stream": ie_stream,
        "gen_then_rerun": gen_then_rerun,
        "capture_gen": capture_gen,
        "gen_then_rerun_512": gen_then_rerun_512,
        "capture_gen_512": capture_gen_512,
        "unsteered_32": unsteered,
        "steered_32": steered,
    }
    med = interleaved_medians(variants, args.repeats)
    ratios = {
        "ie_stream_tok_s_vs_hf": med["hf_generate"] / med["ie_stream"],
        "capture_gen_speedup_vs_rerun": med["gen_then_rerun"] / med["capture_gen"],
        "capture_gen_512_speedup_vs_rerun": med["gen_then_rerun_512"] / med["capture_gen_512"],
        "steered_time_vs_unsteered": med["steered_32"] / med["unsteered_32"],
    }
    result = {
        "benchmark": "generation",
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "model": "random Llama, hidden 512, 8 layers",
        "median_s": med,
        "ratios": ratios,
        "targets": {
            "ie_stream_tok_s_vs_hf": ">= 0.90",
            "capture_gen_speedup_vs_rerun": ">= 1.5",
            "capture_gen_512_speedup_vs_rerun": ">= 1.5",
            "steered_time_vs_unsteered": "<= 1.10",
        },
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    return write_result(args.out, "generation-cpu", result, ratios)


if __name__ == "__main__":
    sys.exit(main())
