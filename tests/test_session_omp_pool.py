"""One OpenMP pool at a time: a thread that hands work to the session loop gives its pool back, and the loop gives
its own back once no awaited operation is left (ie_lab/session.py, `_OmpPool`).

Why: libgomp keeps a pool of workers per thread that ran a parallel op and, once the process holds more pool
threads than CPUs, cuts every spin-wait short, so awaited requests computed on the loop thread beside the caller's
pool ran 1.4x-3.6x slower on 2 CPUs (benchmarks/eager_batch.py). The pools are read as the process's threads
(/proc/self/task): a thread's pool workers are the threads that appear when it first runs a parallel op.
"""

import asyncio
import os
import threading
import time

import pytest
import torch

import ie_lab
from ie_lab.session import _OmpPool
from ie_lab.toy import tiny_model

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or _OmpPool.runtime() is None,
    reason="torch's OpenMP runtime here is not libgomp (or /proc is absent): nothing is handed back",
)

# The pools are read off this process's threads, so the tests run in a process of their own: once a vLLM engine
# has run in a process (the suite's vLLM tests share pytest workers with these), a parallel op there no longer
# starts a pool worker (measured: "no pool worker appeared"), and every check below would read nothing.
_CHILD = "IE_LAB_OMP_POOL_CHILD"
_in_child = pytest.mark.skipif(
    os.environ.get(_CHILD) != "1", reason="runs in a fresh process (test_the_pool_tests_in_a_fresh_process)"
)


@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="this is the fresh process")
def test_the_pool_tests_in_a_fresh_process():
    import subprocess
    import sys

    env = {**os.environ, _CHILD: "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-p", "no:randomly", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


def _tids() -> set:
    return set(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    torch.ones(4_000_000).mul_(2.0)  # at::parallel_for over 4M elements: an OpenMP region with every thread


def _gone(tids: set, timeout: float = 5.0) -> bool:
    """True once none of tids is a thread of this process (a freed pool's workers exit just after the call)."""
    end = time.monotonic() + timeout
    while tids & _tids():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool has a worker only with 2 threads or more (the suite runs with 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def s(two_threads):
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False, replace=False) as sess:  # its loop thread starts at 2
        yield sess


def _in_fresh_thread(fn):
    """fn(own_pool) on a new thread that has run a parallel op first; own_pool: its pool's worker thread ids."""
    box: dict = {}

    def body():
        try:
            me = str(threading.get_native_id())
            before = _tids()
            _parallel_op()
            own = _tids() - before - {me}
            assert own, "no pool worker appeared: the parallel op did not run on 2 threads"
            box["out"] = fn(own)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["err"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(120)
    assert not th.is_alive(), "the call did not finish"
    if "err" in box:
        raise box["err"]
    return box["out"]


@_in_child
def test_an_awaited_call_computes_on_the_loop_beside_no_other_pool(s):
    def caller(own):
        seen = {}

        def work(lm):
            seen["thread"] = threading.current_thread()
            seen["caller_pool_alive"] = _tids() & own  # the caller's workers, while the loop computes
            before = _tids()
            _parallel_op()
            seen["loop_pool"] = _tids() - before
            return lm.facts.n_layers

        assert asyncio.run(s.arun(work)) == s.facts.n_layers
        return seen

    seen = _in_fresh_thread(caller)
    assert seen["thread"] is s._thread  # awaited twins compute on the loop thread
    assert not seen["caller_pool_alive"], "the caller's pool was kept while the loop computed"
    # the loop had no pool before this call (an earlier one was handed back) and made one for it ...
    assert seen["loop_pool"], "the loop thread's pool already existed: it was kept after its last awaited call"
    # ... which it hands back once nothing awaited is left, so the caller's next plain call finds no second pool
    assert _gone(seen["loop_pool"]), "the loop thread kept its pool after the awaited call ended"


@_in_child
def test_plain_calls_keep_their_pool_and_compute_on_the_caller(s):
    def caller(own):
        r = s.run(lambda lm: (threading.current_thread(), _tids() & own))
        _parallel_op()
        return r, own & _tids()

    (thread, during), after = _in_fresh_thread(caller)
    assert thread is not s._thread and during and after  # computed here, with this thread's own pool kept


@_in_child
def test_concurrent_awaited_generations_and_a_stream_hand_the_loop_pool_back(s):
    prompts = ["Mary went to", "When John and Mary", "The park", "A"]
    alone = [s.generate(p, 4, keep_logits=False).ids for p in prompts]

    def caller(own):
        pools = []

        async def main():
            before = set(_tids())
            got = await asyncio.gather(*(s.agenerate(p, 4, keep_logits=False) for p in prompts))
            pools.append(_tids() - before)
            steps = [st.token_id async for st in s.agenerate_stream(prompts[0], 4)]
            return [g.ids for g in got], steps, own & _tids()

        return asyncio.run(main()), pools

    (got, steps, caller_pool), pools = _in_fresh_thread(caller)
    assert got == alone and steps == alone[0]  # the same tokens as plain calls
    assert not caller_pool
    loop_pool = {t for p in pools for t in p}
    assert _gone(loop_pool), "the loop thread kept its pool after the generations and the stream"


@_in_child
def test_a_cancelled_awaited_call_still_hands_the_pool_back(s):
    def caller(own):
        started = threading.Event()
        pool: set = set()

        def slow(lm):
            before = _tids()
            _parallel_op()
            pool.update(_tids() - before)
            started.set()
            for _ in range(200):  # a long operation, stopped by the cancel at its next layer
                lm.hf(torch.tensor([[1, 2, 3]]))
            return "finished"

        async def main():
            task = asyncio.ensure_future(s.arun(slow))
            while not started.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        return pool

    pool = _in_fresh_thread(caller)
    assert pool and _gone(pool)
    assert s.generate("Mary went to", 3).ids == s.generate("Mary went to", 3).ids  # the session still works
