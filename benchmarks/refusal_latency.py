"""How long `ie-lab serve` takes to refuse an over-limit request, as a ratio to a tiny accepted one (issue 28).

    python benchmarks/refusal_latency.py [--repeats 15] [--threads 1]

`ie-lab serve demo` runs in a subprocess on 127.0.0.1 with small limits (--max-capture-bytes 64 KiB,
--max-request-tokens 2048). The server counts a request's costs from its arguments before the Session sees it
(ie_lab/remote/costs.py), so a refusal should cost about one round trip plus tokenizing the prompts, whatever
the work it would have done. Variants, interleaved, median after a warm-up:

  accepted_tiny      generate: an 8-token prompt, 1 new token (the yardstick: the cheapest request that runs)
  refused_capture    a capture of every layer's resid_post over 120 tokens: 240 KiB of answer, over the bytes limit
  refused_tokens     generate: 64 prompts x (8 + 64) tokens = 4,608 tokens, over the tokens limit

Before the costs were counted up front, the first of these ran the capture (17 s on a larger model) and then
answered 413. Every refused call is checked to raise the limit's IELabError, and the accepted one to run, before
any time is reported.
"""

from __future__ import annotations

import datetime
import os
import secrets
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote import start_server  # noqa: E402
from timing import interleaved_medians, parser, write_result  # noqa: E402

LIMITS = ["--max-capture-bytes", str(64 << 10), "--max-request-tokens", "2048"]


def main() -> int:
    ap = parser(repeats=15)
    ap.set_defaults(threads=1)  # as remote.py: the comparison is about the server's door, not the compute
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import ie_lab

    load_before = os.getloadavg()
    token = secrets.token_urlsafe(24)
    proc, url = start_server({"u0": token}, args.threads, extra=LIMITS)
    try:
        remote = ie_lab.connect(url, token=token, replace=False)
        f = remote.facts
        g = torch.Generator().manual_seed(0)
        short = torch.randint(3, f.vocab_size, (1, 8), generator=g)
        long = torch.randint(3, f.vocab_size, (1, 120), generator=g)  # the demo model's context is 128
        points = [f"resid_post.{i}" for i in range(f.n_layers)]
        kw = dict(keep_logits=False, ignore_eos=True)

        def refused(call, limit: str):
            def run():
                try:
                    call()
                except ie_lab.IELabError as e:
                    if limit not in str(e):
                        raise
                    return limit
                raise AssertionError(f"not refused: the request over {limit} ran")

            return run

        variants = {
            "accepted_tiny": lambda: remote.generate(short, 1, **kw).ids,
            "refused_capture": refused(lambda: remote.capture(long, points), "max_capture_bytes"),
            "refused_tokens": refused(lambda: remote.generate([short] * 64, 64, **kw), "max_request_tokens"),
        }
        out = {k: fn() for k, fn in variants.items()}  # warm-up, and the checks
        if len(out["accepted_tiny"]) != 1:
            print("the accepted request did not run, not reporting speed:", out, file=sys.stderr)
            return 1
        med = interleaved_medians(variants, args.repeats, warm=False)
        remote.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    ratios = {f"{k}_over_accepted_tiny": med[k] / med["accepted_tiny"] for k in med if k.startswith("refused_")}
    result = {
        "benchmark": "refusal_latency",
        "device": "cpu",
        "threads": args.threads,
        "date": datetime.date.today().isoformat(),
        "model": "the demo model, eager, `ie-lab serve` on 127.0.0.1 in a subprocess, limits " + " ".join(LIMITS),
        "repeats": args.repeats,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],  # 1/5/15 min, before and after
        "median_s": med,
        "ratio": ratios,
    }
    shown = {
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio": {k: round(v, 3) for k, v in ratios.items()},
    }
    return write_result(args.out, "refusal_latency-cpu", result, shown)


if __name__ == "__main__":
    raise SystemExit(main())
