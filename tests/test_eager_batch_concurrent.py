"""Concurrent requests on one eager Session share a batch (issue 16 items 2 and 5), each equal to its solo run.

The requests are held back behind an operation (s.run waiting on an event) until all of them are queued, so they
meet in the batch deterministically; a forward pre-hook on the embedding records every forward's [rows, tokens],
which shows they really ran together (one request at a time would show 8 x 13 forwards of one row). Each result
is compared with the same request run alone by the free function (its own decode loop, no batch): greedy tokens
identical, logits within 1e-4, captures within 1e-5 and of the solo shape (a pad row or column left in a capture
changes its shape). The prompts are 3 to 30 tokens long, so the short ones carry 27 pads in the shared prefill.
"""

import asyncio
import threading
import time

import pytest
import torch

import ie_lab
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean

LENGTHS = (3, 30, 7, 12, 4, 25, 9, 15)
N = 12
CAPTURE = ["resid_post.1", "attn_probs.0", "mlp_out.0"]


@pytest.fixture()
def s():
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False) as session:
        yield session


def _prompt(i, n):
    return torch.tensor([[5 + (7 * i + 3 * j) % 400 for j in range(n)]])


def _steers(s):
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(0))
    return [
        None,
        s.steer("resid_post.0", v, scale=2.0),
        s.steer("resid_post.1", v, method="ablate"),
        s.steer("resid_pre.1", v, scale=-3.0, positions="generated"),
        s.steer("mlp_out.0", v, method="cap", max=0.1),
        s.steer("resid_post.0", v, scale=1.5, positions=[0, 2, 35]),
        s.steer("attn_out.1", v, method="orthogonal", scale=0.5, positions="prompt"),
        [s.steer("resid_mid.0", v, method="norm_scaled_add", scale=0.3), s.steer("resid_post.1", v, scale=-1.0)],
    ]


def _solo(s, prompt, steer, n=N, **kw):
    return ie_lab.generate(s._lm, prompt, n, steer=steer, ignore_eos=True, capture=CAPTURE, **kw)


def _same(solo, got):
    assert got.ids == solo.ids
    assert got.stop_reason == solo.stop_reason
    torch.testing.assert_close(got.prompt_ids, solo.prompt_ids, rtol=0, atol=0)
    assert len(got.steps) == len(solo.steps)
    for a, b in zip(solo.steps, got.steps):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
        assert b.captured_positions == a.captured_positions
    assert set(got.cache.keys()) == set(solo.cache.keys())
    for k in solo.cache.keys():
        assert got.cache[k].shape == solo.cache[k].shape, k  # no pad row or position left in
        torch.testing.assert_close(got.cache[k], solo.cache[k], atol=1e-5, rtol=0)


class _Forwards:
    """[rows, new tokens] of every forward the model runs."""

    def __init__(self, s):
        self.shapes = []
        self.h = s._lm.binding.embed.register_forward_pre_hook(
            lambda mod, args: self.shapes.append(tuple(args[0].shape))
        )

    def remove(self):
        self.h.remove()


def _hold(s):
    """Hold the session's operation lock on another thread until the event is set."""
    go, held = threading.Event(), threading.Event()

    def hold(lm):
        held.set()
        return go.wait(30)

    t = threading.Thread(target=lambda: s.run(hold))
    t.start()
    assert held.wait(60), "the holder never got the operation lock"  # returns once it holds it, not after a guess
    return go, t


def _wait_for(cond, what):
    for _ in range(1000):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_eight_concurrent_differently_steered_requests_each_equal_their_solo_run(s):
    steers = _steers(s)
    prompts = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
    solo = [_solo(s, p, sp) for p, sp in zip(prompts, steers)]
    batcher = s._backend._batcher
    go, holder = _hold(s)
    seen = _Forwards(s)

    async def main():
        tasks = [
            asyncio.ensure_future(s.agenerate(p, N, steer=sp, ignore_eos=True, capture=CAPTURE))
            for p, sp in zip(prompts, steers)
        ]
        while len(batcher.pending) < len(prompts):  # every request queued behind the held lock
            await asyncio.sleep(0.01)
        go.set()
        return await asyncio.gather(*tasks)

    try:
        got = asyncio.run(main())
    finally:
        go.set()
        holder.join()
        seen.remove()
    for a, b in zip(solo, got):
        _same(a, b)
    # one prefill of all eight (left-padded to the longest), then one decode forward per token for all eight
    # (the last one reads every request's last token for its capture)
    assert seen.shapes == [(8, 30)] + [(8, 1)] * N
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_a_request_that_joins_mid_batch_equals_its_solo_run(s):
    steers = _steers(s)
    first, joiner = _prompt(0, 6), _prompt(1, 20)
    solo_first = _solo(s, first, steers[1], n=8)
    solo_joiner = _solo(s, joiner, steers[3], n=N, seed=None)
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        stream = s.generate_stream(first, 8, steer=steers[1], ignore_eos=True, capture=CAPTURE)
        steps = [next(stream) for _ in range(3)]
        fut = s.submit(s.agenerate(joiner, N, steer=steers[3], ignore_eos=True, capture=CAPTURE))
        _wait_for(lambda: batcher.pending, "the joining request to be queued")
        steps += list(stream)
        got_joiner = fut.result(timeout=60)
    finally:
        seen.remove()
    # the stream alone for three tokens, the joiner's prompt, then both together until the stream's capture is
    # complete, then the joiner alone (driven by its own call once the stream gave the lock back)
    assert seen.shapes[:4] == [(1, 6), (1, 1), (1, 1), (1, 20)]
    assert (2, 1) in seen.shapes
    assert seen.shapes[-1] == (1, 1)
    assert [st.token_id for st in steps] == solo_first.ids
    for a, b in zip(solo_first.steps, steps):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
    for k in solo_first.cache.keys():
        torch.testing.assert_close(steps[-1].cache[k], solo_first.cache[k], atol=1e-5, rtol=0)
    _same(solo_joiner, got_joiner)
    assert_clean(s._lm)


def test_cancelling_one_request_leaves_the_others_running_and_correct(s):
    steers = _steers(s)
    prompts = [_prompt(i, n) for i, n in enumerate((5, 14, 3, 9))]
    solo = [_solo(s, p, sp) for p, sp in zip(prompts[1:], steers[1:4])]
    batcher = s._backend._batcher
    seen = _Forwards(s)
    ready = threading.Event()
    box = {}

    def requests():  # three awaited requests from another event loop, the way a notebook's tasks arrive
        async def main():
            box["loop"] = asyncio.get_running_loop()
            box["tasks"] = [
                asyncio.ensure_future(s.agenerate(p, N, steer=sp, ignore_eos=True, capture=CAPTURE))
                for p, sp in zip(prompts[1:], steers[1:4])
            ]
            ready.set()
            return await asyncio.gather(*box["tasks"], return_exceptions=True)

        box["results"] = asyncio.run(main())

    try:
        # the driver: a stream that holds the lock between its steps, and is closed early
        stream = s.generate_stream(prompts[0], N, ignore_eos=True)
        next(stream)
        t = threading.Thread(target=requests)
        t.start()
        ready.wait(30)
        _wait_for(lambda: len(batcher.pending) == 3, "three queued requests")
        next(stream)  # they join here
        assert len(batcher.rows) == 4
        next(stream)
        victim = box["tasks"][1]
        box["loop"].call_soon_threadsafe(victim.cancel)
        _wait_for(lambda: any(r.cancelled for r in batcher.rows), "the cancel to reach its request")
        next(stream)  # the cancelled request leaves at this step boundary; the others run on
        assert len(batcher.rows) == 3
        stream.close()  # the driver leaves too; the two left are driven by their own calls
        t.join(60)
    finally:
        seen.remove()
    first, cancelled, third = box["results"]
    assert isinstance(cancelled, asyncio.CancelledError)
    _same(solo[0], first)
    _same(solo[2], third)
    assert seen.shapes[-1] == (2, 1)  # the two survivors finished together
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_an_interrupted_lone_request_stops_inside_its_forward_and_leaves_no_batch(s):
    """A request alone in its forward still stops at the next layer (the batch does not delay an interrupt)."""
    batcher = s._backend._batcher
    calls = []

    def cancel_in_forward(mod, args):
        calls.append(1)
        if len(calls) == 3:
            batcher.in_forward[0].token.cancelled = True

    h = s._lm.binding.layers[0].layer.register_forward_pre_hook(cancel_in_forward)
    try:
        with pytest.raises(ie_lab.OperationCancelled):
            s.generate(_prompt(0, 5), N, ignore_eos=True)
    finally:
        h.remove()
    assert len(calls) == 3  # stopped in the third forward
    assert batcher.cache is None and not batcher.rows
    assert (
        s.generate(_prompt(0, 5), 4, ignore_eos=True).ids
        == ie_lab.generate(s._lm, _prompt(0, 5), 4, ignore_eos=True).ids
    )
    assert_clean(s._lm)


# ---- the steering panel (item 4) --------------------------------------------------------------------------
def test_the_steering_panel_computes_baseline_and_steered_in_one_batch(s, monkeypatch):
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(1)) * 4
    seen = _Forwards(s)
    try:
        sp = s.steering_panel("Mary went to the", address="resid_post.0", vector=v, scale=3.0, max_new_tokens=8)
        built = list(seen.shapes)
        seen.shapes.clear()
        sent = []
        monkeypatch.setattr(sp, "send", lambda content, buffers=None: sent.append(content))
        sp._on_front_end_msg(sp, {"cmd": "prompt", "seq": 7, "prompt": "The cat sat on the"}, [])
        sp.wait()
    finally:
        seen.remove()
    spec = s.steer("resid_post.0", v, scale=3.0)
    # built in a cell (a plain stream drives, the baseline joins it) and regenerated from the front end (an
    # awaited stream drives): both times some forwards carry the two rows together
    for shapes in (built, seen.shapes):
        assert (2, 1) in shapes, shapes
    for prompt in ("The cat sat on the",):
        assert sp.baseline_ids == s.generate(prompt, 8, keep_logits=False).ids
        assert sp.steered_ids == s.generate(prompt, 8, steer=spec, keep_logits=False).ids
    assert sp.steered_ids != sp.baseline_ids
    assert [m["token"] for m in sent if m["type"] == "token" and m["which"] == "baseline"] == sp.baseline
    assert sent[-1] == {"type": "done", "seq": 7}
    assert_clean(s._lm)


def test_a_panel_command_cancels_the_stale_pair_and_leaves_nothing_in_the_batch(s, monkeypatch):
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(1)) * 4
    sp = s.steering_panel("Mary went to the", address="resid_post.0", vector=v, max_new_tokens=150)
    sent = []
    monkeypatch.setattr(sp, "send", lambda content, buffers=None: sent.append(content))
    for i, prompt in enumerate(["The cat", "A dog ran", "She said"], start=1):
        sp._on_front_end_msg(sp, {"cmd": "prompt", "seq": i, "prompt": prompt}, [])
    sp.wait()
    assert [m["seq"] for m in sent if m["type"] == "done"] == [3]
    assert sp.baseline_ids == s.generate("She said", 150, keep_logits=False).ids
    batcher = s._backend._batcher
    _wait_for(lambda: not batcher.rows and not batcher.pending, "the stale requests to leave the batch")
    assert_clean(s._lm)


# ---- families ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", ["gpt2", "mistral_sliding", "gemma2", "qwen3_moe"])
def test_concurrent_requests_equal_their_solo_runs_on_other_families(fam):
    """Learned positions (gpt2), a sliding-window cache (no joining mid-batch: newcomers wait for an empty batch),
    sandwich norms and softcaps on the eager kernel (gemma2), top-k experts (qwen3_moe)."""
    from tests.families import make_model, make_tokenizer

    model = make_model(fam, attn_implementation="eager" if fam == "gemma2" else None)
    with ie_lab.Session(model, tokenizer=make_tokenizer(), progress=False) as s:
        v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(0))
        steers = [None, s.steer("resid_post.0", v, scale=2.0), s.steer("resid_post.1", v, method="ablate"), None]
        prompts = [_prompt(i, n) for i, n in enumerate((3, 30, 8, 14))]
        solo = [_solo(s, p, sp, n=8) for p, sp in zip(prompts, steers)]
        batcher = s._backend._batcher
        stream = s.generate_stream(prompts[0], 8, steer=steers[0], ignore_eos=True, capture=CAPTURE)
        steps = [next(stream), next(stream)]
        futs = [
            s.submit(s.agenerate(p, 8, steer=sp, ignore_eos=True, capture=CAPTURE))
            for p, sp in zip(prompts[1:], steers[1:])
        ]
        _wait_for(lambda: len(batcher.pending) == 3, "three queued requests")
        steps += list(stream)
        got = [f.result(timeout=120) for f in futs]
        assert [st.token_id for st in steps] == solo[0].ids
        for k in solo[0].cache.keys():
            torch.testing.assert_close(steps[-1].cache[k], solo[0].cache[k], atol=1e-5, rtol=1e-5)
        for a, b in zip(solo[1:], got):
            _same(a, b)
        assert not batcher.rows and not batcher.pending
        assert_clean(s._lm)


def test_an_interrupt_in_a_cell_cancels_that_cells_request_only(s, ctrl_c_raises):
    """Ctrl-C while this thread's stream drives a shared batch: the stream ends with KeyboardInterrupt once its
    request has left the batch, and the requests of other tasks run on to their solo results."""
    import signal

    steers = _steers(s)
    prompts = [_prompt(i, n) for i, n in enumerate((6, 11, 4))]
    solo = [_solo(s, p, sp) for p, sp in zip(prompts[1:], steers[1:3])]
    batcher = s._backend._batcher
    ready = threading.Event()
    box = {}

    def others():
        async def main():
            tasks = [
                asyncio.ensure_future(s.agenerate(p, N, steer=sp, ignore_eos=True, capture=CAPTURE))
                for p, sp in zip(prompts[1:], steers[1:3])
            ]
            ready.set()
            return await asyncio.gather(*tasks)

        box["results"] = asyncio.run(main())

    forwards = []

    def interrupt_on_the_fourth_forward(mod, args):
        forwards.append(args[0].shape[0])
        if len(forwards) == 4:
            assert batcher.in_forward  # inside the shared forward: the interrupt is deferred, not raised here
            mine = next(r for r in batcher.in_forward if r.stream)
            signal.raise_signal(signal.SIGINT)
            # held here until the handler has cancelled this cell's request: the forward (and so the stream)
            # cannot go on before the interrupt is taken, however fast the machine
            _wait_for(lambda: mine.token.cancelled, "the interrupt to cancel this cell's request")

    stream = s.generate_stream(prompts[0], N, ignore_eos=True)
    got = [next(stream)]
    t = threading.Thread(target=others)
    t.start()
    ready.wait(30)
    _wait_for(lambda: len(batcher.pending) == 2, "two queued requests")
    h = s._lm.binding.embed.register_forward_pre_hook(interrupt_on_the_fourth_forward)
    try:
        with pytest.raises(KeyboardInterrupt):
            for st in stream:
                got.append(st)
    finally:
        h.remove()
    assert forwards[:4] == [2, 3, 3, 3]  # the newcomers' prompts, then the three rows together
    assert len(got) == 3  # this cell's stream stopped at the step boundary after the interrupt
    t.join(60)
    for a, b in zip(solo, box["results"]):
        _same(a, b)
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


# ---- captures ---------------------------------------------------------------------------------------------
def test_concurrent_captures_are_read_in_one_forward_each_equal_its_solo_capture(s):
    steers = _steers(s)
    prompts = [_prompt(i, n) for i, n in enumerate(LENGTHS)]
    solo = [s.capture(p, CAPTURE, steer=sp) for p, sp in zip(prompts, steers)]
    batcher = s._backend._batcher
    go, holder = _hold(s)
    seen = _Forwards(s)

    async def main():
        tasks = [asyncio.ensure_future(s.acapture(p, CAPTURE, steer=sp)) for p, sp in zip(prompts, steers)]
        while len(batcher.captures) < len(prompts):
            await asyncio.sleep(0.01)
        go.set()
        return await asyncio.gather(*tasks)

    try:
        got = asyncio.run(main())
    finally:
        go.set()
        holder.join()
        seen.remove()
    assert seen.shapes == [(8, 30)]  # one right-padded forward for all eight
    for a, b in zip(solo, got):
        assert [str(k) for k in b.keys()] == [str(k) for k in a.keys()]
        torch.testing.assert_close(b.tokens, a.tokens, rtol=0, atol=0)
        for k in a.keys():
            assert b[k].shape == a[k].shape, k  # no pad row or position left in
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0)
    assert not batcher.captures
    assert_clean(s._lm)
