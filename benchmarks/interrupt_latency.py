"""How long the notebook's Interrupt takes to stop a Session call, against stopping `time.sleep`, in a real kernel.

    python benchmarks/interrupt_latency.py [--repeats 7] [--threads 2]

A real ipykernel (jupyter_client, as a notebook front end drives it). Each variant's cell is started, left running
for a random 0.5-1.5 s, interrupted with `interrupt_kernel()` (SIGINT to the kernel, as the Interrupt button), and
timed from the interrupt to the cell's execute reply. The baseline is a cell in `time.sleep`, which Python
interrupts at once: what remains is the kernel's own round trip. Variants, all on a long-context 4-layer random
Llama (hidden 512, so one layer is a measurable step):

  sleep              time.sleep(600)                                      (the baseline)
  generate           s.generate(prompt, 100000)  (plain call, computed on the kernel's main thread)
  stream             for step in s.generate_stream(prompt, 100000): pass  (the loop body is the cell's code)
  await_generate     await s.agenerate(prompt, 100000)  (computed on the session thread; ipykernel cancels the cell)
  capture_loop       while True: s.capture(long prompt, every resid_post)

Every reply must be KeyboardInterrupt (CancelledError for the awaited cell, which is how ipykernel stops an
`await`), and after each one the model must have no hook left and the next call must work, or nothing is reported.
Reported: median and worst latency per variant, and median minus the sleep baseline (what the Session adds).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import parser, write_result  # noqa: E402

SETUP = textwrap.dedent("""
    import sys; sys.path.insert(0, %r)
    import torch; torch.set_num_threads(%d)
    import ie_lab
    from ie_lab.toy import tokenizer
    from tests.conftest import hook_count
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, intermediate_size=1024, vocab_size=512,
                           max_position_embeddings=200000)).eval()
    big.generation_config.eos_token_id = None
    s = ie_lab.Session(big, tokenizer=tokenizer(), progress=False)
    P = "Mary went to the park"
    LONG = torch.randint(4, 512, (1, 256))
    EVERY = [f"resid_post.{i}" for i in range(4)]
    s.generate(P, 4)
    print('ready')
""")

CELLS = {
    "sleep": "import time\ntime.sleep(600)",
    "generate": "s.generate(P, 100000)",
    "stream": "for step in s.generate_stream(P, 100000):\n    pass",
    "await_generate": "await s.agenerate(P, 100000)",
    "capture_loop": "while True:\n    s.capture(LONG, EVERY)",
}
EXPECTED = {"await_generate": ("KeyboardInterrupt", "CancelledError")}
CHECK = "(hook_count(big), ie_lab.arch.attention_tap.is_installed(), len(s.generate(P, 3).ids))"


def _reply(kc, msg_id, timeout):
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply


def _run(kc, code, timeout=300):
    return _reply(kc, kc.execute(code), timeout)


def main() -> int:
    from jupyter_client.manager import start_new_kernel

    args = parser(repeats=7).parse_args()
    rng = random.Random(0)
    km, kc = start_new_kernel(kernel_name="python3", cwd=ROOT)
    lat: dict[str, list[float]] = {k: [] for k in CELLS}
    try:
        assert _run(kc, SETUP % (ROOT, args.threads))["content"]["status"] == "ok"
        for _ in range(args.repeats):
            for name, code in CELLS.items():  # interleaved: a slow spell hits every variant
                msg_id = kc.execute(code, stop_on_error=False)
                time.sleep(rng.uniform(0.5, 1.5))
                t0 = time.perf_counter()
                km.interrupt_kernel()
                reply = _reply(kc, msg_id, 120)
                lat[name].append(time.perf_counter() - t0)
                ename = reply["content"].get("ename")
                if reply["content"]["status"] != "error" or ename not in EXPECTED.get(name, ("KeyboardInterrupt",)):
                    print(
                        f"{name}: the interrupt ended the cell with {reply['content']}, not reporting", file=sys.stderr
                    )
                    return 1
                check = kc.execute("check = " + CHECK, user_expressions={"check": "check"}, stop_on_error=False)
                r = _reply(kc, check, 120)["content"]
                value = r.get("user_expressions", {}).get("check", {}).get("data", {}).get("text/plain")
                if r["status"] != "ok" or value != "(0, False, 3)":
                    print(
                        f"{name}: after the interrupt the session was not clean: {r.get('status')} {value}",
                        file=sys.stderr,
                    )
                    return 1
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    med = {k: statistics.median(v) for k, v in lat.items()}
    base = med["sleep"]
    shown = {
        k: {
            "median_ms": round(med[k] * 1e3, 1),
            "worst_ms": round(max(lat[k]) * 1e3, 1),
            "median_minus_sleep_ms": round((med[k] - base) * 1e3, 1),
        }
        for k in CELLS
    }
    result = {
        "benchmark": "interrupt_latency",
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "model": "random Llama, 4 layers, hidden 512, in a real ipykernel",
        "latency_s": lat,
        "shown": shown,
        "date": time.strftime("%Y-%m-%d"),
    }
    return write_result(args.out, "interrupt_latency-cpu", result, shown)


if __name__ == "__main__":
    sys.exit(main())
