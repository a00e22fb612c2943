"""Projection inside the vLLM worker vs a full capture projected on the client (issue 17's benchmark): bytes the
worker hands back per request and time per request, for k = 16 and k = 4,096 directions, in one run.

    python benchmarks/vllm_projection.py [--repeats 7] [--tokens 256] [--out DIR]

Model: the random Llama of vllm_generate.py (4 layers, d_model 512, fp32), one vLLM Session (hooks mode). One
prompt of --tokens tokens; the point is resid_post at the middle layer. Variants, interleaved each round after one
warm-up round:

  capture           s.capture(prompt, [point]) -> [tokens, d_model] comes back, then scores = x @ D.T on the client
  project           s.project(prompt, point, D) -> only the [tokens, k] float32 scores come back

Bytes are what the worker returns to the client for the request, counted on the driver's rpc replies (every tensor
and bytes object in them), and, separately, what the rpc calls send to the worker (the directions travel with a
projecting request): the payload that crosses the process boundary when vLLM runs its engine in another
process (here the engine runs in-process, so the count is the same payload without the copy). The scores are
checked equal to the client-side product (atol 1e-4, fp32) before any time is reported. Writes
results/vllm_projection-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from timing import interleaved_medians, write_result  # noqa: E402
from vllm_generate import build  # noqa: E402


def payload_bytes(obj: Any) -> int:
    """Bytes of every tensor and bytes object inside an rpc reply (dicts, lists and tuples walked)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    import torch

    import ie_lab

    tmp = tempfile.mkdtemp(prefix="ie_lab-bench-proj-")
    try:
        build(tmp)
        s = ie_lab.Session(tmp, backend="vllm", progress=False, replace=False, dtype="float32")
        d, point = s.facts.d_model, f"resid_post.{s.facts.n_layers // 2}"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 500, (1, args.tokens), generator=g)
        dirs = {k: torch.randn(k, d, generator=g) for k in (16, 4096)}

        # What crosses: the driver's rpc replies, summed per request (the backend reaches the worker only there).
        driver = s._backend._driver
        rpc, seen, sent = driver.rpc, [0], [0]

        async def counting_rpc(method: str, *a: Any) -> list:
            sent[0] += payload_bytes(a)
            out = await rpc(method, *a)
            seen[0] += payload_bytes(out)
            return out

        driver.rpc = counting_rpc

        def capture_then(k: int):
            x = s.capture(ids, [point])[point][0].float()
            return x @ dirs[k].T

        def project(k: int):
            return s.project(ids, point, dirs[k]).scores

        for k in dirs:  # correctness first: a wrong projection reports no time
            torch.testing.assert_close(project(k), capture_then(k), atol=1e-4, rtol=1e-4)
        bytes_per, bytes_sent = {}, {}
        for k in dirs:
            for name, fn in (("capture", capture_then), ("project", project)):
                seen[0] = sent[0] = 0
                fn(k)
                bytes_per[f"{name}_k{k}"] = seen[0]
                bytes_sent[f"{name}_k{k}"] = sent[0]
        variants = {
            f"{name}_k{k}": (lambda fn=fn, k=k: fn(k))
            for k in dirs
            for name, fn in (("capture", capture_then), ("project", project))
        }
        med = interleaved_medians(variants, args.repeats)
        s.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ratio = {
        f"k{k}": {
            "time_project_over_capture": round(med[f"project_k{k}"] / med[f"capture_k{k}"], 3),
            "bytes_project_over_capture": round(bytes_per[f"project_k{k}"] / bytes_per[f"capture_k{k}"], 4),
        }
        for k in dirs
    }
    result = {
        "benchmark": "vllm_projection",
        "model": "random Llama, d_model 512, 4 layers, fp32 (vllm_generate.build)",
        "point": point,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "device": device,
        "threads": torch.get_num_threads(),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "bytes_per_request": bytes_per,
        "bytes_sent_per_request": bytes_sent,  # to the worker over rpc: the encoder travels with the request
        "ratio": ratio,
        "date": datetime.date.today().isoformat(),
    }
    return write_result(args.out, f"vllm_projection-{device}", result, result)


if __name__ == "__main__":
    raise SystemExit(main())
