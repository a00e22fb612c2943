"""`project` (probe directions) and SAE encoding where the activation is, against a capture projected on the client,
on the eager backend or the vLLM backend, as ratios measured in one run.

    python benchmarks/projection.py --backend eager|vllm [--repeats 7] [--tokens 256] [--out DIR]

Model: the random Llama of vllm_generate.py (4 layers, d_model 512, fp32), the same on both backends; one prompt of
--tokens tokens; the point is resid_post at the middle layer. Variants, interleaved each round after a warm-up:

  capture_k16 / project_k16      s.capture then x @ D.T here, vs s.project(prompt, point, D): 16 directions
  capture_k4096 / project_k4096  the same with 4,096 directions (wider than d_model)
  capture_sae / sae_encode       s.capture then sae.encode(x) here, vs sae.project(s, prompt) (encoded in the hook or
                                 the worker): a random ReLU SAE of 16 x d_model features (8,192)

On eager the hook computes the scores in this process, so the ratio is what the projection costs against keeping
the activation; on vLLM only [tokens, k] crosses back from the worker. Scores are checked equal to the client-side
product (1e-4) before any time is reported. Writes results/projection-<backend>-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from timing import interleaved_times, write_result  # noqa: E402
from vllm_generate import build  # noqa: E402


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("eager", "vllm"), required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    import statistics

    import torch

    import ie_lab
    from ie_lab.sae import SAE

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="ie_lab-bench-projection-")
    try:
        build(tmp)
        s = ie_lab.Session(tmp, backend=args.backend, progress=False, replace=False, dtype="float32")
        d, point = s.facts.d_model, f"resid_post.{s.facts.n_layers // 2}"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 500, (1, args.tokens), generator=g)
        dirs = {k: torch.randn(k, d, generator=g) for k in (16, 4096)}
        n = 16 * d
        sae = SAE(
            W_enc=torch.randn(d, n, generator=g) / d**0.5,
            b_enc=torch.zeros(n),
            W_dec=torch.randn(n, d, generator=g) / n**0.5,
            b_dec=torch.randn(d, generator=g) * 0.01,
            activation="relu",
            address=ie_lab.Address.parse(point),
        )

        def captured():
            return s.capture(ids, [point])[point][0].float()

        variants = {}
        for k, D in dirs.items():
            variants[f"capture_k{k}"] = lambda D=D: captured() @ D.T
            variants[f"project_k{k}"] = lambda D=D: s.project(ids, point, D).scores
        variants["capture_sae"] = lambda: sae.encode(captured())
        variants["sae_encode"] = lambda: sae.project(s, ids).scores

        def rows(t):
            t = torch.as_tensor(t)
            return t[0] if t.dim() == 3 else t

        for a, b in (("project_k16", "capture_k16"), ("project_k4096", "capture_k4096"), ("sae_encode", "capture_sae")):
            torch.testing.assert_close(rows(variants[a]()), rows(variants[b]()), atol=1e-4, rtol=1e-4)
        times = interleaved_times(variants, args.repeats)
        s.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    pairs = {"k16": ("project_k16", "capture_k16"), "k4096": ("project_k4096", "capture_k4096")}
    pairs["sae"] = ("sae_encode", "capture_sae")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "benchmark": "projection",
        "backend": args.backend,
        "model": "random Llama, d_model 512, 4 layers, fp32 (vllm_generate.build)",
        "point": point,
        "tokens": args.tokens,
        "sae_features": n,
        "repeats": args.repeats,
        "device": device,
        "threads": args.threads,
        "median_s": {k: round(v, 5) for k, v in med.items()},
        "times_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
        "ratio_project_over_capture": {p: round(med[a] / med[b], 3) for p, (a, b) in pairs.items()},
        "date": datetime.date.today().isoformat(),
    }
    return write_result(args.out, f"projection-{args.backend}-{device}", result, result["ratio_project_over_capture"])


if __name__ == "__main__":
    raise SystemExit(main())
