"""A remote session over loopback against a local Session of the same model, as ratios measured in one run.

    python benchmarks/remote.py [--repeats 7] [--threads 1] [--clients 16] [--requests 8]

`ie-lab serve demo` runs in a subprocess on 127.0.0.1 (its own OpenMP pool of --threads); the local Session runs
in this process. Variants are interleaved (one computes at a time), median after a warm-up:

  local_* / remote_*   generate (64-token prompt, 64 greedy tokens), the same steered at the middle layer,
                       generate_stream consumed to the end, and a capture of every layer's resid_post over 128
                       tokens (the "full resid_post stack"; its bytes / the remote time give the capture MB/s)
  remote_capture_zlib  the same capture with compress=True (float32 activations hardly shrink: it shows the
                       cost of trying, which is why loopback connections do not compress by default)

Targets (issue 18): remote generate and steer at most 1.15x local. Then the many-clients phase: --clients
connections, each its own user, send --requests generations of 16 tokens at once (threads), against one local
Session running the same requests one after another; aggregate tok/s both ways (the server's eager backend
batches concurrent generations in one decode loop, ie_lab/eager/batcher.py, so this measures batching through
the HTTP layer against none).

Every remote output is checked equal to the local one before any time is reported.
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import interleaved_medians, parser, write_result  # noqa: E402

TARGET = 1.15


def start_server(tokens: dict[str, str], threads: int, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`ie-lab serve demo` on a free loopback port, with `extra` options (limits) after the defaults here."""
    env = {k: v for k, v in os.environ.items() if k not in ("IE_LAB_TOKEN",)}
    env.update(
        IE_LAB_SERVE_TOKENS=",".join(f"{u}:{t}" for u, t in tokens.items()),
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-m", "ie_lab.cli", "serve", "demo", "--port", "0", "--max-concurrent", "64", *(extra or [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r" at (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def main() -> int:
    ap = parser(repeats=7)
    # One thread each side by default: the comparison is about the transport, and on a shared, loaded CPU two
    # OpenMP threads per process wait on each other's barriers (10x and more), swamping what is measured.
    ap.set_defaults(threads=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import ie_lab

    load_before = os.getloadavg()
    tokens = {f"u{i}": secrets.token_urlsafe(24) for i in range(max(1, args.clients))}
    proc, url = start_server(tokens, args.threads)
    try:
        local = ie_lab.Session(ie_lab.DEMO_MODEL, backend="eager", progress=False, replace=False)
        remote = ie_lab.connect(url, token=tokens["u0"], replace=False)
        zipped = ie_lab.connect(url, token=tokens["u0"], replace=False, compress=True)
        f = local.facts
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, f.vocab_size, (1, 64), generator=g)
        text = torch.randint(3, f.vocab_size, (1, 128), generator=g)
        points = [f"resid_post.{i}" for i in range(f.n_layers)]
        v = torch.randn(f.d_model, generator=g)
        mid = f"resid_post.{f.n_layers // 2}"
        n = 64
        kw = dict(keep_logits=False, ignore_eos=True)

        def steered(s):
            return s.generate(prompt, n, steer=s.steer(mid, v, scale=4.0), **kw).ids

        variants = {
            "local_generate": lambda: local.generate(prompt, n, **kw).ids,
            "remote_generate": lambda: remote.generate(prompt, n, **kw).ids,
            "local_steer": lambda: steered(local),
            "remote_steer": lambda: steered(remote),
            "local_stream": lambda: [s.token_id for s in local.generate_stream(prompt, n, **kw)],
            "remote_stream": lambda: [s.token_id for s in remote.generate_stream(prompt, n, **kw)],
            "local_capture": lambda: local.capture(text, points),
            "remote_capture": lambda: remote.capture(text, points),
            "remote_capture_zlib": lambda: zipped.capture(text, points),
        }
        out = {k: fn() for k, fn in variants.items()}  # warm-up, and the outputs checked
        checks = {
            k: out[k] == out[k.replace("remote", "local")] for k in ("remote_generate", "remote_steer", "remote_stream")
        }
        checks["steer_differs"] = out["local_steer"] != out["local_generate"]
        for k in ("remote_capture", "remote_capture_zlib"):
            checks[k] = all(torch.equal(out[k][p], out["local_capture"][p]) for p in points)
        if not all(checks.values()):
            print("correctness check failed, not reporting speed:", checks, file=sys.stderr)
            return 1
        capture_bytes = sum(t.numel() * t.element_size() for t in out["local_capture"].values())

        med = interleaved_medians(variants, args.repeats, warm=False)
        ratios = {
            k.replace("remote_", "") + "_remote_over_local": med[k]
            / med[k.replace("remote", "local").replace("_zlib", "")]
            for k in med
            if k.startswith("remote_")
        }

        # many clients at once against one local session running the same requests in turn
        short = 16
        reqs = [
            torch.randint(3, f.vocab_size, (1, 16 + (i % 8) * 4), generator=g)
            for i in range(args.clients * args.requests)
        ]
        clients = [ie_lab.connect(url, token=tokens[f"u{i}"], replace=False) for i in range(args.clients)]
        want = [local.generate(r, short, **kw).ids for r in reqs]  # warm, and the reference
        t0 = time.perf_counter()
        for r in reqs:
            local.generate(r, short, **kw)
        local_s = time.perf_counter() - t0
        got: list = [None] * len(reqs)
        errors: list = []

        def client(i: int) -> None:
            try:
                for j in range(args.requests):
                    k = i * args.requests + j
                    got[k] = clients[i].generate(reqs[k], short, **kw).ids
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        remote_s = time.perf_counter() - t0
        for c in clients:
            c.close()
        if errors or got != want:
            print("many-clients check failed, not reporting speed:", errors[:3], file=sys.stderr)
            return 1
        total_tokens = len(reqs) * short
        many = {
            "clients": args.clients,
            "requests_per_client": args.requests,
            "new_tokens": short,
            "local_tok_per_s": total_tokens / local_s,
            "remote_tok_per_s": total_tokens / remote_s,
            "remote_over_local_time": remote_s / local_s,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    result = {
        "benchmark": "remote",
        "device": "cpu",
        "threads": args.threads,
        "date": datetime.date.today().isoformat(),
        "model": "the demo model (4 layers, d_model 128), eager, server on 127.0.0.1 in a subprocess",
        "repeats": args.repeats,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],  # 1/5/15 min, before and after
        "median_s": med,
        "ratio": ratios,
        "capture_bytes": capture_bytes,
        "capture_mb_s": {
            "local": capture_bytes / med["local_capture"] / 1e6,
            "remote": capture_bytes / med["remote_capture"] / 1e6,
            "remote_zlib": capture_bytes / med["remote_capture_zlib"] / 1e6,
        },
        "target": {"generate_remote_over_local": TARGET, "steer_remote_over_local": TARGET},
        "verdict": {
            k: ("met" if ratios[k] <= TARGET else "missed")
            for k in ("generate_remote_over_local", "steer_remote_over_local")
        },
        "many_clients": many,
    }
    shown = {
        "ratio": {k: round(v, 3) for k, v in ratios.items()},
        "capture_mb_s": {k: round(v, 1) for k, v in result["capture_mb_s"].items()},
        "verdict": result["verdict"],
        "many_clients": {k: round(v, 3) if isinstance(v, float) else v for k, v in many.items()},
    }
    return write_result(args.out, "remote-cpu", result, shown)


if __name__ == "__main__":
    sys.exit(main())
