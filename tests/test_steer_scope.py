"""Where steering applies: a `with` block steers what its own task or thread issues, nothing else.

Every concurrent run is compared with the same code run alone (each in its own thread or event loop, so the
numerics are computed under the same conditions): exactly equal, unsteered runs included.
"""

import asyncio
import threading

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for
from tests.numerics import assert_batched_close, batched_close

PROMPT = "Mary went to the park and"
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
N = 8


def _vectors(d):
    # Two of the eight are unsteered (None); the others differ in direction, scale and method.
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N):
        if i in (2, 5):
            out.append(None)
        else:
            out.append(
                (
                    torch.randn(d, generator=g) * (4 + i),
                    {"scale": 1.0 + i / 4} if i % 3 else {"method": "norm_scaled_add", "scale": 2.0},
                )
            )
    return out


def _same(a, b):
    assert a["ids"] == b["ids"]
    for k in a:
        if k in ("gen_cache", "capture"):
            # concurrent generations share one batched decode loop, and captures queued together read in one
            # padded forward (ie_lab/eager/batcher.py): the same numbers up to a batched matmul's float32 rounding
            # (tests/numerics.py), not bit for bit on every CPU
            assert_batched_close(a[k], b[k], k)
        elif k != "ids":
            assert torch.equal(a[k], b[k]), k


def _check(solo, together):
    for i in range(N):
        _same(together[i], solo[i])
    # the comparison means something: steering changes the answer, and the steered runs differ from each other
    plain = solo[2]
    for i in range(N):
        if i not in (2, 5):
            assert not batched_close(solo[i]["capture"], plain["capture"]), i
    assert len({tuple(solo[i]["ids"]) for i in range(N) if i not in (2, 5)}) > 1


def _in_threads(fn, n, barrier):
    out, errors = [None] * n, []

    def work(i):
        try:
            out[i] = fn(i, barrier)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "hung"
    if errors:
        raise errors[0]
    return out


def _solo(fn):
    """Each case alone, in a thread of its own (the same numerics as the concurrent threads)."""
    return [_in_threads(lambda _, b, i=i: fn(i, None), 1, None)[0] for i in range(N)]


def test_async_tasks_each_steer_only_their_own_requests(session):
    specs = [None if v is None else session.steer("resid_post.0", v[0], **v[1]) for v in _vectors(128)]

    async def one(i, barrier):
        block = specs[i] if specs[i] is not None else _nothing()
        with block:
            if barrier is not None:
                await barrier.wait()  # every block is open before any request is issued
            cap = await session.acapture(PROMPT, ["resid_post.1"])
            gen = await session.agenerate(PROMPT, 6, capture=["resid_post.1"])
            steps = [st async for st in session.agenerate_stream(PROMPT, 4)]
            lens = await session.alogit_lens(PROMPT)
            if barrier is not None:
                await barrier.wait()  # and still open while the others run
        return {
            "ids": gen.ids,
            "capture": cap["resid_post.1"],
            "gen_cache": gen.cache["resid_post.1"],
            "stream": torch.tensor([st.token_id for st in steps]),
            "lens": lens.top_ids,
        }

    async def together():
        barrier = asyncio.Barrier(N)
        return await asyncio.gather(*(one(i, barrier) for i in range(N)))

    solo = [asyncio.run(one(i, None)) for i in range(N)]
    _check(solo, asyncio.run(together()))
    assert_clean(session._lm)


def test_threads_each_steer_only_their_own_requests(session):
    specs = [None if v is None else session.steer("resid_post.0", v[0], **v[1]) for v in _vectors(128)]

    def one(i, barrier):
        with specs[i] if specs[i] is not None else _nothing():
            if barrier is not None:
                barrier.wait(timeout=120)
            cap = session.capture(PROMPT, ["resid_post.1"])
            gen = session.generate(PROMPT, 6, capture=["resid_post.1"])
            stream = [st.token_id for st in session.generate_stream(PROMPT, 4)]
            ran = session.run(_raw)
            if barrier is not None:
                barrier.wait(timeout=120)
        return {
            "ids": gen.ids,
            "capture": cap["resid_post.1"],
            "gen_cache": gen.cache["resid_post.1"],
            "stream": torch.tensor(stream),
            "run": ran,
        }

    _check(_solo(one), _in_threads(one, N, threading.Barrier(N)))
    assert_clean(session._lm)


def test_free_functions_and_raw_forwards_in_threads_each_see_only_their_block():
    lm = lm_for("llama")
    specs = [None if v is None else ie_lab.steer(lm, "resid_post.0", v[0], **v[1]) for v in _vectors(lm.facts.d_model)]

    def one(i, barrier):
        with specs[i] if specs[i] is not None else _nothing():
            if barrier is not None:
                barrier.wait(timeout=120)
            cap = ie_lab.capture(lm, IDS, ["resid_post.1"])
            gen = ie_lab.generate(lm, IDS, 6)
            with torch.no_grad():
                raw = lm.hf(input_ids=IDS).logits  # a raw forward in the block is steered by it, and only it
            if barrier is not None:
                barrier.wait(timeout=120)
        return {"ids": gen.ids, "capture": cap["resid_post.1"], "raw": raw}

    _check(_solo(one), _in_threads(one, N, threading.Barrier(N)))
    assert_clean(lm)


def test_a_thread_started_inside_a_block_is_not_steered_by_it():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model) * 8
    plain = ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"]
    seen = {}
    with ie_lab.steer(lm, "resid_post.0", v):
        t = threading.Thread(target=lambda: seen.update(c=ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"]))
        t.start()
        t.join(timeout=120)
        inside = ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"]
    assert torch.equal(seen["c"], plain)
    assert not torch.equal(inside, plain)
    assert_clean(lm)


@pytest.mark.parametrize("where", ["free", "session"])
def test_entering_the_same_spec_twice_steers_once_and_leaves_nothing(where, session):
    lm = lm_for("llama") if where == "free" else session._lm
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2)) * 6
    if where == "free":
        spec = ie_lab.steer(lm, "resid_post.0", v, scale=2.0)

        def cap():
            return ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"]

        def gen():
            return ie_lab.generate(lm, IDS, 5).ids
    else:
        spec = session.steer("resid_post.0", v, scale=2.0)

        def cap():
            return session.capture(IDS, ["resid_post.1"])["resid_post.1"]

        def gen():
            return session.generate(IDS, 5).ids

    plain, plain_ids = cap(), gen()
    with spec:
        once, once_ids = cap(), gen()
        with torch.no_grad():
            once_raw = lm.hf(input_ids=IDS).logits
    with spec:
        with spec:
            twice, twice_ids = cap(), gen()
            with torch.no_grad():
                twice_raw = lm.hf(input_ids=IDS).logits
        still = cap()  # the outer block is still open after the inner one exits
    assert torch.equal(twice, once) and twice_ids == once_ids and torch.equal(twice_raw, once_raw)
    assert torch.equal(still, once)
    assert not torch.equal(once, plain)
    assert_clean(lm)
    after = cap()
    assert torch.equal(after, plain) and gen() == plain_ids


def test_a_spec_shared_by_two_tasks_ends_only_where_its_block_ends(session):
    v = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 6
    spec = session.steer("resid_post.0", v)
    plain = session.capture(PROMPT, ["resid_post.1"])["resid_post.1"]
    with spec:
        steered = session.capture(PROMPT, ["resid_post.1"])["resid_post.1"]

    async def main():
        a_left, b_inside = asyncio.Event(), asyncio.Event()

        async def a():
            with spec:
                await b_inside.wait()
            a_left.set()
            return await session.acapture(PROMPT, ["resid_post.1"])

        async def b():
            with spec:
                b_inside.set()
                await a_left.wait()
                return await session.acapture(PROMPT, ["resid_post.1"])

        return await asyncio.gather(a(), b())

    after_a, inside_b = asyncio.run(main())
    # the two captures may be queued together and read in one padded forward: float32 rounding apart
    assert not batched_close(steered, plain)
    assert_batched_close(after_a["resid_post.1"], plain, "after a's block")
    assert_batched_close(inside_b["resid_post.1"], steered, "inside b's block")
    assert_clean(session._lm)


def test_a_block_exited_from_another_thread_leaves_nothing():
    lm = lm_for("llama")
    spec = ie_lab.steer(lm, "resid_post.0", torch.randn(lm.facts.d_model) * 6)
    plain = ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"]
    spec.__enter__()
    t = threading.Thread(target=spec.__exit__, args=(None, None, None))
    t.start()
    t.join(timeout=60)
    assert_clean(lm)
    assert torch.equal(ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"], plain)


def _raw(lm):
    with torch.no_grad():
        return lm.hf(input_ids=IDS).logits


class _nothing:  # noqa: N801 - an unsteered task's stand-in for a `with` block
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_block_inside_a_function_run_by_the_session_steers_what_that_function_runs(session):
    v = torch.randn(128, generator=torch.Generator().manual_seed(6)) * 6
    spec = session.steer("resid_post.0", v)
    with spec:
        want_raw = session.run(_raw)
        want_cap = session.capture(IDS, ["resid_post.1"])["resid_post.1"]
        want_ids = session.generate(IDS, 5).ids

    def inside(lm):
        with spec:
            with torch.no_grad():
                raw = lm.hf(input_ids=IDS).logits
            return raw, ie_lab.capture(lm, IDS, ["resid_post.1"])["resid_post.1"], ie_lab.generate(lm, IDS, 5).ids

    raw, cap, ids = session.run(inside)
    assert torch.equal(raw, want_raw) and torch.equal(cap, want_cap) and ids == want_ids
    # and a block around s.run(fn) steers fn's forwards exactly once, even when fn enters it again
    with spec:
        again = session.run(inside)
    assert torch.equal(again[0], want_raw) and torch.equal(again[1], want_cap) and again[2] == want_ids
    assert_clean(session._lm)
    assert not torch.equal(session.capture(IDS, ["resid_post.1"])["resid_post.1"], want_cap)


def test_a_forward_between_hooks_while_another_thread_removes_one_is_not_broken_by_it():
    """torch keeps a hook and its "pass the kwargs" flag in two dicts and reads the flag only when a forward reaches
    the hook, so a forward in flight while another thread's operation removes (or adds) its hooks can call one
    without its kwargs: on CI a raw forward in one thread died with "hook() missing 1 required positional argument:
    'out'" inside another thread's steering hook. Here that moment is held still: two steering blocks and a capture's taps
    are open in this thread with the flags gone (as mid-removal), and another thread's raw forward must
    run, unsteered, as if none of them were there."""
    from ie_lab.eager.taps import Taps

    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3)) * 8
    with torch.no_grad():
        plain = lm.hf(input_ids=IDS).logits
    modules = list(lm.hf.modules())
    with ie_lab.steer(lm, "resid_post.0", v), ie_lab.steer(lm, "resid_mid.1", v):
        with Taps(lm, [ie_lab.Address.parse(a) for a in ("resid_post.0", "mlp_in.1", "attn_out.0")]):
            flags = [(m, dict(m._forward_hooks_with_kwargs), dict(m._forward_pre_hooks_with_kwargs)) for m in modules]
            assert any(f or p for _, f, p in flags)  # the hooks are there
            for m, _, _ in flags:
                m._forward_hooks_with_kwargs.clear()
                m._forward_pre_hooks_with_kwargs.clear()
            got = {}

            def foreign():
                try:
                    with torch.no_grad():
                        got["logits"] = lm.hf(input_ids=IDS).logits
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    got["error"] = e

            t = threading.Thread(target=foreign)
            t.start()
            t.join(timeout=120)
            for m, f, p in flags:  # put the flags back, so the blocks close as usual
                m._forward_hooks_with_kwargs.update(f)
                m._forward_pre_hooks_with_kwargs.update(p)
    assert "error" not in got, got.get("error")
    assert torch.equal(got["logits"], plain)
    assert_clean(lm)
