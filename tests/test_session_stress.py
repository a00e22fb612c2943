"""Interrupts at random moments, a few hundred of them, against every kind of Session call.

Each trial loops one kind of call (captures, generations, gradients, streams whose loop body does work, awaited
twins under asyncio.run, awaited twins also cancelled by timeouts at random moments) and interrupts the main thread
once at a random moment, the way Ctrl-C and the notebook's Interrupt do: `_thread.interrupt_main()` runs the
SIGINT handler at the main thread's next bytecode boundary, which is where a real SIGINT lands too (and where an
asynchronous exception would). The moment is drawn uniformly over about two calls, so it falls in hand-offs and
cleanups as well as in the forward.

After every trial: the exception is KeyboardInterrupt, OperationCancelled or CancelledError (nothing foreign, no
InvalidStateError), the model has no hook and no attention tap left (tests/conftest.py `assert_clean`), its lock
is free for another thread, and the next calls equal a clean run's. A trial that does not end is a deadlock or
a lost interrupt: a watchdog prints every thread's stack and ends the process, so the suite fails instead of hanging.

It runs in a child process: the trials own the main thread's signal handling and would wedge pytest on a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIALS_PER_KIND = 40  # 7 kinds: 280 interrupts, 15-40 s on a loaded 2-core machine
N_KINDS = 7


def test_random_interrupts_leave_no_deadlock_no_foreign_error_and_no_trace():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-c", f"from tests.test_session_stress import main; main({TRIALS_PER_KIND})"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (
        f"the stress run died (rc {r.returncode}; a hang ends it with the stacks):\n"
        f"{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    )
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["trials"] == N_KINDS * TRIALS_PER_KIND
    assert report["foreign"] == [], report["foreign"]
    assert report["dirty"] == [], report["dirty"]
    assert report["lock_held"] == [], report["lock_held"]
    assert report["differs"] == [], report["differs"]
    # the interrupts really landed in calls of every kind and were reported as interrupts
    for kind, seen in report["outcomes"].items():
        assert seen.get("KeyboardInterrupt", 0) + seen.get("CancelledError", 0) > 0, (kind, seen)


# ---- the child process ------------------------------------------------------------------------------------------


def main(per_kind: int, seed: int = 0) -> None:
    import _thread
    import asyncio
    import faulthandler
    import random
    import signal
    import threading
    import time
    import traceback

    import torch

    import ie_lab
    from ie_lab.session import OperationCancelled
    from ie_lab.toy import tiny_model
    from tests.conftest import assert_clean

    # A child inherits SIGINT ignored when the test run is a background job; the stress test needs Ctrl-C as a
    # kernel has it (interrupt_main does nothing under SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    torch.set_num_threads(1)
    rng = random.Random(seed)
    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False)
    lm = s._lm
    P = "Mary went to the park with John and the big red ball"
    addrs = ["resid_post.0", "resid_post.1", "attn_probs.1", "mlp_out.0"]
    spec = s.steer("resid_post.0", torch.randn(128, generator=torch.Generator().manual_seed(1)) * 4)
    metric = ie_lab.logit_diff(20, 21)

    def check_calls():
        return {
            "capture": s.capture(P, addrs),
            "generate": s.generate(P, 10, capture=["resid_post.1"]),
            "steered": s.generate(P, 10, steer=spec).ids,
            "gradients": s.gradients(P, metric, ["resid_post.0"]),
        }

    ref = check_calls()

    def same(now) -> list[str]:
        bad = [a for a in addrs if not torch.equal(ref["capture"][a], now["capture"][a])]
        if now["generate"].ids != ref["generate"].ids:
            bad.append("generate ids")
        if not torch.equal(now["generate"].cache["resid_post.1"], ref["generate"].cache["resid_post.1"]):
            bad.append("generate capture")
        if now["steered"] != ref["steered"]:
            bad.append("steered ids")
        if not torch.equal(now["gradients"]["resid_post.0"], ref["gradients"]["resid_post.0"]):
            bad.append("gradients")
        return bad

    def body_work():
        x = torch.randn(96, 96)
        for _ in range(4):
            x = torch.tanh(x @ x.T / 96)

    async def awaited_loop():
        while True:
            await s.agenerate(P, 10, steer=spec)
            await s.acapture(P, addrs)

    async def awaited_with_timeouts():  # task cancellation at random moments too (a timeout), until the interrupt
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops an outer cancel that lands as the inner
            # call finishes (CPython gh-86296, fixed in 3.12 by building wait_for on timeout), which would lose the
            # interrupt in the interpreter, not in ie_lab
            try:
                async with asyncio.timeout(rng.uniform(0.0, 1.5 * span["await"])):
                    await s.agenerate(P, 10, steer=spec)
            except TimeoutError:
                pass
            await s.acapture(P, addrs)

    async def awaited_stream_loop():
        while True:
            async for _st in s.agenerate_stream(P, 10, steer=spec):
                await asyncio.sleep(0)

    def streams():
        while True:
            for _st in s.generate_stream(P, 10, steer=spec, capture=["resid_post.1"]):
                body_work()

    kinds = {
        "capture": lambda: [s.capture(P, addrs) for _ in iter(int, 1)],
        "generate": lambda: [s.generate(P, 10, capture=["resid_post.1"], steer=spec) for _ in iter(int, 1)],
        "gradients": lambda: [s.gradients(P, metric, ["resid_post.0"]) for _ in iter(int, 1)],
        "stream": streams,
        "await": lambda: asyncio.run(awaited_loop()),
        "await_timeout": lambda: asyncio.run(awaited_with_timeouts()),
        "await_stream": lambda: asyncio.run(awaited_stream_loop()),
    }
    once = {
        "capture": lambda: s.capture(P, addrs),
        "generate": lambda: s.generate(P, 10, capture=["resid_post.1"], steer=spec),
        "gradients": lambda: s.gradients(P, metric, ["resid_post.0"]),
        "stream": lambda: [body_work() for _ in s.generate_stream(P, 10, steer=spec, capture=["resid_post.1"])],
        "await": lambda: asyncio.run(s.agenerate(P, 10, steer=spec)),
        "await_timeout": lambda: asyncio.run(s.agenerate(P, 10, steer=spec)),
        "await_stream": lambda: asyncio.run(_drain(s.agenerate_stream(P, 10, steer=spec))),
    }
    span = {}
    for k, fn in once.items():  # how long one call takes here: interrupts are drawn over about two of them
        fn()
        t0 = time.perf_counter()
        fn()
        span[k] = time.perf_counter() - t0

    def lock_free() -> bool:
        box = []

        def take():
            ok = lm.lock.acquire(timeout=20)  # a re-entrant lock: only the thread that took it may give it back
            if ok:
                lm.lock.release()
            box.append(ok)

        th = threading.Thread(target=take)
        th.start()
        th.join()
        return box[0]

    report = {
        "trials": 0,
        "outcomes": {k: {} for k in kinds},
        "foreign": [],
        "dirty": [],
        "lock_held": [],
        "differs": [],
    }
    order = [k for k in kinds for _ in range(per_kind)]
    rng.shuffle(order)
    main_ident = threading.main_thread().ident

    def watchdog(trial_over: threading.Event, what: str) -> None:
        # A trial that does not end is a deadlock or a lost interrupt: every thread's Python stack, then exit. Read
        # from Python (sys._current_frames): faulthandler's dump of a thread that is running crashed the process
        # once (SIGSEGV mid-dump) and lost the main thread's stack. faulthandler stays as the backstop for a hang
        # that holds the GIL.
        if trial_over.wait(90):
            return
        out = [f"trial {what} did not end in 90 s; stacks:"]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            label = "main" if ident == main_ident else names.get(ident, ident)
            out.append(f"--- thread {label}\n" + "".join(traceback.format_stack(frame)))
        print("\n".join(out), file=sys.stderr, flush=True)
        os._exit(3)

    for i, kind in enumerate(order):
        delay = rng.uniform(0.0, 2.0 * span[kind])
        trial_over = threading.Event()
        threading.Thread(target=watchdog, args=(trial_over, f"{kind} #{i}"), daemon=True).start()
        faulthandler.dump_traceback_later(180, exit=True)
        timer = threading.Timer(delay, _thread.interrupt_main)
        try:
            timer.start()
            kinds[kind]()
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except OperationCancelled:
            outcome = "OperationCancelled"
        except asyncio.CancelledError:
            outcome = "CancelledError"
        except BaseException as e:  # noqa: BLE001 - a foreign exception is what this test looks for
            outcome = type(e).__name__
            report["foreign"].append(f"{kind} #{i}: {''.join(traceback.format_exception(e))[-1500:]}")
        timer.join()
        seen = report["outcomes"][kind]
        seen[outcome] = seen.get(outcome, 0) + 1
        report["trials"] += 1
        try:
            assert_clean(lm)
        except AssertionError as e:
            report["dirty"].append(f"{kind} #{i}: {e}")
        if not lock_free():
            report["lock_held"].append(f"{kind} #{i}")
        bad = same(check_calls())
        if bad:
            report["differs"].append(f"{kind} #{i}: {bad}")
        trial_over.set()
        faulthandler.cancel_dump_traceback_later()
    s.close()
    print(json.dumps(report))


async def _drain(agen):
    return [x async for x in agen]
