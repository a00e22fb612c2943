"""What a Session costs over calling ie_lab's functions directly, on CPU, as ratios measured in one process.

    python benchmarks/session_threads.py [--repeats 9] [--threads 2]

Why it exists: torch's OpenMP pool belongs to the thread that runs an op. A notebook's main thread already has
one; a Session that computed on its loop thread grew a second, and libgomp cuts its spin-waits once a process
holds more pool threads than CPUs, so small ops (decoding) paid a futex wake each. Plain Session calls now lend
their own thread to the loop for the model work (ie_lab/session.py, `_Lease`); awaited twins still compute on the
loop thread. The main thread gets a pool first, as in a notebook. Phase 1 (interleaved, median after a warm-up):

  direct_generate    ie_lab.generate(lm, ...) on the main thread (the baseline), demo model, 64 tokens
  session_generate   Session.generate (plain call)                          target <= 1.10x direct
  session_stream     Session.generate_stream, consumed to the end (computed on the caller's thread, step by step)   reported
  direct_capture / session_capture   every resid_post over 128 tokens (a ~5 ms call: the fixed hand-off
                     cost of a call shows, also given in ms)                reported

Phase 2, awaited calls interleaved: direct_generate, session_generate and await Session.agenerate (computed on the
loop thread). The Session hands the caller's OpenMP pool back as it hands the loop an awaited call, and the loop
its own once none is left (ie_lab/session.py, `_OmpPool`), so no phase-2 call should find a second pool.
Phase 3, the same with that hand-back switched off: the loop's pool stays for good beside the main thread's (what
every call paid before plain calls lent their thread, and awaited calls before the hand-back). Both reported
against phase 1's direct_generate. Tokens and tensors are checked equal before any time is reported.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import interleaved_medians, parser, write_result  # noqa: E402


def main() -> int:
    args = parser(repeats=9).parse_args()
    torch.set_num_threads(args.threads)
    torch.randn(512, 512) @ torch.randn(512, 512)  # the main thread's pool exists, as after any notebook cell

    import ie_lab

    lm = ie_lab.load(ie_lab.DEMO_MODEL, quiet=True)
    lm.hf.generation_config.eos_token_id = None
    S = ie_lab.Session(ie_lab.DEMO_MODEL, backend="eager", progress=False)
    S.model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, lm.facts.vocab_size, (1, 64), generator=g)
    text = torch.randint(3, lm.facts.vocab_size, (1, 128), generator=g)
    points = [f"resid_post.{i}" for i in range(lm.facts.n_layers)]
    n = 64

    variants = {
        "direct_generate": lambda: ie_lab.generate(lm, prompt, n, keep_logits=False).ids,
        "session_generate": lambda: S.generate(prompt, n, keep_logits=False).ids,
        "session_stream": lambda: [s.token_id for s in S.generate_stream(prompt, n, keep_logits=False)],
        "direct_capture": lambda: ie_lab.capture(lm, text, points),
        "session_capture": lambda: S.capture(text, points),
    }
    agen = {"session_agenerate": lambda: asyncio.run(S.agenerate(prompt, n, keep_logits=False)).ids}
    out = {k: fn() for k, fn in variants.items()}  # warm-up, and the outputs checked
    ref = out["direct_generate"]
    checks = {k: out[k] == ref for k in ("session_generate", "session_stream")}
    checks["session_capture"] = all(torch.equal(out["direct_capture"][p], out["session_capture"][p]) for p in points)
    if not all(checks.values()):
        print("correctness check failed, not reporting speed:", checks, file=sys.stderr)
        return 1

    # Phase 1: only the main thread has computed (plain calls lend it to the session).
    one = interleaved_medians(variants, args.repeats, warm=False)
    # Phase 2: awaited calls compute on the loop thread; each side hands its pool back (session._OmpPool).
    if agen["session_agenerate"]() != ref:
        print("correctness check failed: agenerate tokens differ", file=sys.stderr)
        return 1
    mixed = {"direct_generate": variants["direct_generate"], "session_generate": variants["session_generate"], **agen}
    handed = interleaved_medians(mixed, args.repeats, warm=False)
    # Phase 3: the hand-back off, so the loop's pool stays beside the main thread's for good (the old design).
    from ie_lab import session as session_module

    session_module._OmpPool.release = classmethod(lambda cls: None)  # type: ignore[method-assign]
    agen["session_agenerate"]()
    two = interleaved_medians(mixed, args.repeats, warm=False)
    S.close()
    med = {
        **{f"{k} (one pool)": v for k, v in one.items()},
        **{f"{k} (awaited calls, pools handed back)": v for k, v in handed.items()},
        **{f"{k} (two pools)": v for k, v in two.items()},
    }
    ratios = {
        "session_generate / direct_generate": one["session_generate"] / one["direct_generate"],
        "session_stream / direct_generate": one["session_stream"] / one["direct_generate"],
        "session_capture / direct_capture": one["session_capture"] / one["direct_capture"],
        "direct_generate, awaited calls between / one pool": handed["direct_generate"] / one["direct_generate"],
        "session_agenerate, pools handed back / direct_generate, one pool": handed["session_agenerate"]
        / one["direct_generate"],
        "direct_generate, two pools / one pool": two["direct_generate"] / one["direct_generate"],
        "session_agenerate, two pools / direct_generate, one pool": two["session_agenerate"] / one["direct_generate"],
    }
    ratios["session_capture - direct_capture (ms per call)"] = (one["session_capture"] - one["direct_capture"]) * 1e3
    targets = {
        "session_generate / direct_generate": "<= 1.10",
        "session_stream / direct_generate": "reported",
        "session_capture / direct_capture": "reported",
        "session_capture - direct_capture (ms per call)": "reported",
        "direct_generate, awaited calls between / one pool": "reported",
        "session_agenerate, pools handed back / direct_generate, one pool": "<= 1.10",
        "direct_generate, two pools / one pool": "reported",
        "session_agenerate, two pools / direct_generate, one pool": "reported",
    }
    result = {
        "benchmark": "session_threads",
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "model": f"ie_lab demo model, {n} greedy tokens from a 64-token prompt; capture of every resid_post "
        "over 128 tokens",
        "median_s": med,
        "ratios": ratios,
        "targets": targets,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    return write_result(args.out, "session_threads-cpu", result, ratios)


if __name__ == "__main__":
    sys.exit(main())
