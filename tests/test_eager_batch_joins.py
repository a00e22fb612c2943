"""What joins the eager batch besides single prompts (issue 16 item 2): lists of prompts, grad captures, streams.

As in test_eager_batch_concurrent.py (whose helpers these tests reuse): the requests are held back behind an
operation until all of them are queued, a forward pre-hook on the embedding records every forward's [rows,
tokens] (so a request that silently ran alone shows up as forwards of its own), and each result is compared with
the same request run alone by the free function: greedy tokens identical, logits within 1e-4, captures and
gradients within 1e-5 and of the solo shape. Two of the prompts have the same length, so handing one request its
neighbour's row (a shape-correct wrong answer) is caught too.
"""

import asyncio
import concurrent.futures
import threading

import pytest
import torch

import ie_lab
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean
from tests.test_eager_batch_concurrent import CAPTURE, N, _Forwards, _hold, _prompt, _same, _solo, _steers, _wait_for


@pytest.fixture()
def s():
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False) as session:
        yield session


def _held(s, queued, n, issue):
    """Issue the coroutines `issue()` makes while the lock is held; release once `queued()` counts n of them."""
    go, holder = _hold(s)

    async def main():
        tasks = [asyncio.ensure_future(c) for c in issue()]
        while queued() < n:
            await asyncio.sleep(0.01)
        go.set()
        return await asyncio.gather(*tasks)

    try:
        return asyncio.run(main())
    finally:
        go.set()
        holder.join()


# ---- lists of prompts join the batch as rows ----------------------------------------------------------------
def test_lists_and_single_prompts_coalesce_each_prompt_equal_to_its_solo_run(s):
    steers = _steers(s)
    a = [_prompt(0, 3), _prompt(1, 30), _prompt(2, 7)]
    b = [_prompt(3, 12), _prompt(4, 12)]  # sampled, a seed each; same length: a swapped row would still fit
    c, d = _prompt(5, 25), _prompt(6, 9)
    sampled = dict(temperature=1.0, top_k=20)
    solo_a = [_solo(s, p, steers[1]) for p in a]
    solo_b = [_solo(s, p, steers[3], seed=seed, **sampled) for p, seed in zip(b, (11, 12))]
    solo_c, solo_d = _solo(s, c, steers[4]), _solo(s, d, None)
    assert solo_b[0].ids != solo_b[1].ids
    batcher = s._backend._batcher
    seen = _Forwards(s)
    kw = dict(ignore_eos=True, capture=CAPTURE)
    try:
        got_a, got_b, got_c, got_d = _held(
            s,
            lambda: len(batcher.pending),
            7,
            lambda: [
                s.agenerate(a, N, steer=steers[1], **kw),
                s.agenerate(b, N, steer=steers[3], seed=[11, 12], **sampled, **kw),
                s.agenerate(c, N, steer=steers[4], **kw),
                s.agenerate(d, N, **kw),
            ],
        )
    finally:
        seen.remove()
    assert isinstance(got_a, list) and len(got_a) == 3 and isinstance(got_b, list) and len(got_b) == 2
    for want, got in zip([*solo_a, *solo_b, solo_c, solo_d], [*got_a, *got_b, got_c, got_d]):
        _same(want, got)
    for i, g in enumerate(got_a):
        assert {st.prompt_index for st in g.steps} == {i}
    # the seven prompts of four calls: one prefill, then every token of all seven in one forward
    assert seen.shapes == [(7, 30)] + [(7, 1)] * N
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_a_plain_generate_over_a_list_drives_the_batch_for_requests_that_join_it(s):
    steers = _steers(s)
    mine, joiner = [_prompt(0, 5), _prompt(1, 11)], _prompt(2, 8)
    solo = [_solo(s, p, steers[2], n=N) for p in mine]
    solo_joiner = _solo(s, joiner, steers[1], n=6)
    batcher = s._backend._batcher
    seen = _Forwards(s)
    box = {}
    started = threading.Event()

    def on_forward(mod, args):  # the joiner is issued from another thread during the list's first forward
        if not started.is_set():
            started.set()
            box["fut"] = s.submit(s.agenerate(joiner, 6, steer=steers[1], ignore_eos=True, capture=CAPTURE))
            _wait_for(lambda: batcher.pending, "the joiner to be queued")

    h = s._lm.binding.layers[0].layer.register_forward_pre_hook(on_forward)
    try:
        got = s.generate(mine, N, steer=steers[2], ignore_eos=True, capture=CAPTURE)
    finally:
        h.remove()
        seen.remove()
    got_joiner = box["fut"].result(timeout=60)
    for want, g in zip(solo, got):
        _same(want, g)
    _same(solo_joiner, got_joiner)
    assert seen.shapes[:2] == [(2, 11), (1, 8)]  # the list's prefill, then the joiner's prompt
    assert seen.shapes.count((3, 1)) == 6  # the joiner's six tokens (and its last capture) ride along
    assert_clean(s._lm)


def test_a_stream_over_a_list_hands_out_each_tokens_steps_in_prompt_order_with_joiners(s):
    steers = _steers(s)
    mine = [_prompt(0, 5), _prompt(1, 9), _prompt(2, 9)]
    joiners = [_prompt(3, 14), [_prompt(4, 4), _prompt(5, 20)]]
    solo = [_solo(s, p, steers[6]) for p in mine]
    solo_j = [_solo(s, joiners[0], steers[1], n=6)] + [_solo(s, p, None, n=6) for p in joiners[1]]
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        stream = s.generate_stream(mine, N, steer=steers[6], ignore_eos=True, capture=CAPTURE)
        steps = [next(stream) for _ in range(6)]  # two tokens of each prompt
        futs = [
            s.submit(s.agenerate(joiners[0], 6, steer=steers[1], ignore_eos=True, capture=CAPTURE)),
            s.submit(s.agenerate(joiners[1], 6, ignore_eos=True, capture=CAPTURE)),
        ]
        _wait_for(lambda: len(batcher.pending) == 3, "three queued prompts")
        steps += list(stream)
        got_j = [futs[0].result(timeout=60), *futs[1].result(timeout=60)]
    finally:
        seen.remove()
    assert [(st.index, st.prompt_index) for st in steps] == [(i, r) for i in range(N) for r in range(3)]
    for r, want in enumerate(solo):
        mine_r = [st for st in steps if st.prompt_index == r]
        assert [st.token_id for st in mine_r] == want.ids
        for x, y in zip(want.steps, mine_r):
            torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
        for k in want.cache.keys():
            assert mine_r[-1].cache[k].shape == want.cache[k].shape
            torch.testing.assert_close(mine_r[-1].cache[k], want.cache[k], atol=1e-5, rtol=0)
    for want, got in zip(solo_j, got_j):
        _same(want, got)
    assert (6, 1) in seen.shapes  # the three joining prompts decoded with the stream's three
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_cancelling_a_list_request_removes_all_its_rows_and_leaves_the_others_correct(s):
    steers = _steers(s)
    victim, other = [_prompt(0, 6), _prompt(1, 13)], _prompt(2, 9)
    solo = _solo(s, other, steers[1])
    batcher = s._backend._batcher
    box = {}
    ready = threading.Event()

    def requests():
        async def main():
            box["loop"] = asyncio.get_running_loop()
            box["tasks"] = [
                asyncio.ensure_future(s.agenerate(victim, N, ignore_eos=True)),
                asyncio.ensure_future(s.agenerate(other, N, steer=steers[1], ignore_eos=True, capture=CAPTURE)),
            ]
            ready.set()
            return await asyncio.gather(*box["tasks"], return_exceptions=True)

        box["results"] = asyncio.run(main())

    stream = s.generate_stream(_prompt(3, 4), N, ignore_eos=True)
    next(stream)
    t = threading.Thread(target=requests)
    t.start()
    ready.wait(30)
    _wait_for(lambda: len(batcher.pending) == 3, "three queued prompts")
    next(stream)
    assert len(batcher.rows) == 4
    box["loop"].call_soon_threadsafe(box["tasks"][0].cancel)
    _wait_for(lambda: sum(r.cancelled for r in batcher.rows) == 2, "the cancel to reach both rows")
    next(stream)
    assert len(batcher.rows) == 2  # both of the list's rows left at this step boundary
    stream.close()
    t.join(60)
    cancelled, got = box["results"]
    assert isinstance(cancelled, asyncio.CancelledError)
    _same(solo, got)
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


# ---- captures over lists, and grad captures -------------------------------------------------------------
def _same_capture(want, got):
    assert [str(k) for k in got.keys()] == [str(k) for k in want.keys()]
    torch.testing.assert_close(got.tokens, want.tokens, rtol=0, atol=0)
    for k in want.keys():
        assert got[k].shape == want[k].shape, k  # no pad row or position left in
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0)


def test_capture_lists_and_single_captures_are_read_in_one_forward(s):
    steers = _steers(s)
    a, b, c = [_prompt(0, 3), _prompt(1, 30), _prompt(2, 7)], _prompt(3, 12), [_prompt(4, 12), _prompt(5, 4)]
    solo = [s.capture(p, CAPTURE, steer=steers[1]) for p in a]
    solo += [s.capture(b, CAPTURE, steer=steers[2])] + [s.capture(p, CAPTURE) for p in c]
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        got_a, got_b, got_c = _held(
            s,
            lambda: len(batcher.captures),
            6,
            lambda: [
                s.acapture(a, CAPTURE, steer=steers[1]),
                s.acapture(b, CAPTURE, steer=steers[2]),
                s.acapture(c, CAPTURE),
            ],
        )
    finally:
        seen.remove()
    assert seen.shapes == [(6, 30)]
    for want, got in zip(solo, [*got_a, got_b, *got_c]):
        _same_capture(want, got)
    assert not batcher.captures
    assert_clean(s._lm)


def test_grad_captures_each_keep_a_graph_of_their_own(s):
    """grad=True captures are not batched: the caller's backward frees its graph's saved tensors, so requests
    sharing one forward could not each take their own backward (nor free their neighbours' activations)."""
    prompts = [_prompt(0, 8), _prompt(1, 8)]
    seen = _Forwards(s)
    try:
        got = _held(
            s, lambda: 0, 0, lambda: [s.acapture(p, ["resid_post.0", "resid_post.1"], grad=True) for p in prompts]
        )
        listed = s.capture(prompts, ["resid_post.0", "resid_post.1"], grad=True)
    finally:
        seen.remove()
    assert seen.shapes == [(1, 8)] * 4
    for a, b in zip(got, listed):  # a backward each, without retain_graph
        ga = torch.autograd.grad(a["resid_post.1"].sum(), a["resid_post.0"])[0]
        gb = torch.autograd.grad(b["resid_post.1"].sum(), b["resid_post.0"])[0]
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)
    assert_clean(s._lm)


# ---- gradients(): one forward and one backward for concurrent calls ---------------------------------------
POINTS = ["resid_post.0", "z.0.head-1", "attn_out.1"]


def _grad_calls(s):
    """(prompt, metric, of) of five concurrent gradients() calls; the first two prompts have the same length."""
    return [
        (_prompt(0, 9), lambda t: t[0, -1, 5] - t[0, -1, 9], None),
        (_prompt(1, 9), lambda t: t[0, -1].norm(), "resid_post.1"),
        (
            _prompt(2, 3),
            lambda c: c["attn_probs.1"][0, :, -1, 0].sum() + c["resid_post.1"][0, 1].sum(),
            ["attn_probs.1", "resid_post.1"],
        ),
        (_prompt(3, 17), lambda t: t.log_softmax(-1)[0, :, 7].mean(), None),
        (_prompt(4, 6), lambda t: t.sum(), "resid_pre.0"),  # upstream of every point: zeros
    ]


def test_concurrent_gradients_share_one_forward_and_backward_each_equal_its_solo_run(s):
    from ie_lab.eager.patching import gradients

    calls = _grad_calls(s)
    solo = [gradients(s._lm, p, m, POINTS, of=of) for p, m, of in calls]
    assert (solo[0]["resid_post.0"] - solo[1]["resid_post.0"]).abs().max() > 1e-3  # a neighbour's would not pass
    assert not solo[4]["resid_post.0"].any()
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        got = _held(
            s,
            lambda: len(batcher.captures),
            len(calls),
            lambda: [s.agradients(p, m, POINTS, of=of) for p, m, of in calls],
        )
    finally:
        seen.remove()
    assert seen.shapes == [(5, 17)]  # one forward (and its one backward) for all five
    for want, g in zip(solo, got):
        _same_capture(want, g)
    assert not batcher.captures
    assert_clean(s._lm)


def test_a_bad_metric_fails_its_own_gradients_call_only(s):
    from ie_lab.eager.patching import gradients

    good = (_prompt(0, 7), lambda t: t[0, -1, 3])
    solo = gradients(s._lm, good[0], good[1], POINTS)
    batcher = s._backend._batcher

    def boom(t):
        raise ValueError("the metric's own bug")

    async def both():
        return await asyncio.gather(
            s.agradients(_prompt(1, 5), lambda t: t[0, -1], POINTS),  # not a scalar
            s.agradients(_prompt(2, 4), boom, POINTS),
            s.agradients(*good, POINTS),
            return_exceptions=True,
        )

    seen = _Forwards(s)
    try:
        not_scalar, raised, got = _held(s, lambda: len(batcher.captures), 3, lambda: [both()])[0]
    finally:
        seen.remove()
    assert seen.shapes == [(3, 7)]
    assert isinstance(not_scalar, ie_lab.InputError) and "scalar" in str(not_scalar)
    assert isinstance(raised, ValueError)
    _same_capture(solo, got)
    assert_clean(s._lm)


# ---- bad input is refused at the call, before any request is queued ---------------------------------------
def test_bad_lists_are_refused_naming_the_prompt_before_any_request_starts(s):
    batcher = s._backend._batcher
    go, holder = _hold(s)  # the model is busy: a refusal that waited for it would come only after go
    try:
        for name in ("generate", "capture"):
            call = getattr(s, name)
            args = (CAPTURE,) if name == "capture" else (4,)
            with pytest.raises(ie_lab.InputError, match="empty input"):
                call([], *args)
            with pytest.raises(ie_lab.InputError, match="prompt 1 is ids but prompt 0 is text"):
                call(["Mary went", [5, 6, 7]], *args)
        with pytest.raises(ie_lab.InputError, match="prompt 2 is text"):
            s.capture([[5, 6], [7, 8, 9], "Mary"], CAPTURE)
        limit = s.facts.max_positions
        with pytest.raises(ie_lab.InputError, match=rf"prompt 1 \({limit - 2} tokens\)"):
            s.generate([[5, 6], [7] * (limit - 2)], 10)
        with pytest.raises(ie_lab.InputError, match="prompt 2: .*context"):
            s.capture([[5, 6], [7, 8], [9] * (limit + 1)], CAPTURE)

        async def awaited():
            with pytest.raises(ie_lab.InputError, match="prompt 1 is ids"):
                await s.agenerate(["Mary went", [5, 6]], 4)
            with pytest.raises(ie_lab.InputError, match=r"prompt 1 \("):
                await s.agenerate([[5, 6], [7] * (limit - 2)], 10)
            with pytest.raises(ie_lab.InputError, match="prompt 1 is text"):
                await s.acapture([[5, 6], "Mary"], CAPTURE, grad=True)

        asyncio.run(awaited())
        assert holder.is_alive()  # all of that while the model was still busy
        assert not batcher.pending and not batcher.captures
    finally:
        go.set()
        holder.join()
    assert_clean(s._lm)


# ---- a stream issued while another request drives the batch joins it ----------------------------------------
class _Pace:
    """A forward pre-hook on the driver's thread: before each forward, the joined stream's steps produced so far
    must have reached its consumer (within 5 s). A stream whose consumer waited for the operation lock instead
    would get none of them until the driver is done: the wait times out, and `stalled` says so."""

    def __init__(self, s, received):
        self.batcher, self.received, self.stalled = s._backend._batcher, received, False
        self.h = s._lm.binding.embed.register_forward_pre_hook(self)

    def __call__(self, mod, args):
        produced = sum(len(r.steps) for r in self.batcher.rows if r.stream)
        for _ in range(500):
            if self.stalled or len(self.received) >= produced:
                return
            threading.Event().wait(0.01)
        self.stalled = True

    def remove(self):
        self.h.remove()


def test_a_stream_joins_the_batch_another_request_drives_and_gets_its_steps_as_they_come(s):
    steers = _steers(s)
    long, mine = _prompt(0, 7), [_prompt(1, 12), _prompt(2, 5)]
    solo_long = _solo(s, long, steers[1], n=40)
    solo = [_solo(s, p, steers[2], n=8) for p in mine]
    batcher = s._backend._batcher
    seen = _Forwards(s)
    received = []
    fut = s.submit(s.agenerate(long, 40, steer=steers[1], ignore_eos=True, capture=CAPTURE))  # drives on the loop
    _wait_for(lambda: batcher.rows, "the first request to be driving the batch")
    pace = _Pace(s, received)
    try:
        for st in s.generate_stream(mine, 8, steer=steers[2], ignore_eos=True, capture=CAPTURE):
            received.append((st, fut.done()))
        got_long = fut.result(timeout=60)
    finally:
        pace.remove()
        seen.remove()
    assert not pace.stalled
    assert not any(done for _, done in received)  # every step came while the other request still drove
    steps = [st for st, _ in received]
    assert [(st.index, st.prompt_index) for st in steps] == [(i, r) for i in range(8) for r in range(2)]
    for r, want in enumerate(solo):
        mine_r = [st for st in steps if st.prompt_index == r]
        assert [st.token_id for st in mine_r] == want.ids
        for x, y in zip(want.steps, mine_r):
            torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
        for k in want.cache.keys():
            torch.testing.assert_close(mine_r[-1].cache[k], want.cache[k], atol=1e-5, rtol=0)
    _same(solo_long, got_long)
    assert (2, 12) in seen.shapes and seen.shapes.count((3, 1)) >= 8  # its prefill, then decoded with the other
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_an_awaited_stream_joins_a_batch_a_plain_call_drives(s):
    steers = _steers(s)
    long, mine = _prompt(0, 9), _prompt(1, 14)
    solo_long, solo = _solo(s, long, None, n=40), _solo(s, mine, steers[4], n=10)
    batcher = s._backend._batcher
    box = {}
    t = threading.Thread(target=lambda: box.update(got=s.generate(long, 40, ignore_eos=True, capture=CAPTURE)))
    t.start()  # a plain call: it drives the batch on its own thread, the session loop stays free
    _wait_for(lambda: batcher.rows, "the plain call to be driving the batch")
    received = []
    pace = _Pace(s, received)

    async def consume():
        async for st in s.agenerate_stream(mine, 10, steer=steers[4], ignore_eos=True, capture=CAPTURE):
            received.append((st, "got" in box))

    try:
        asyncio.run(consume())
        t.join(60)
    finally:
        pace.remove()
    assert not pace.stalled
    assert not any(done for _, done in received)
    steps = [st for st, _ in received]
    assert [st.token_id for st in steps] == solo.ids
    for x, y in zip(solo.steps, steps):
        torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
    for k in solo.cache.keys():
        torch.testing.assert_close(steps[-1].cache[k], solo.cache[k], atol=1e-5, rtol=0)
    _same(solo_long, box["got"])
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_a_joined_stream_closed_early_leaves_the_driver_correct(s):
    long, mine = _prompt(0, 6), _prompt(1, 10)
    solo_long = _solo(s, long, None, n=30)
    batcher = s._backend._batcher
    fut = s.submit(s.agenerate(long, 30, ignore_eos=True, capture=CAPTURE))
    _wait_for(lambda: batcher.rows, "the first request to be driving the batch")
    stream = s.generate_stream(mine, 20, ignore_eos=True)
    first = next(stream)
    assert not fut.done()
    stream.close()  # closed while a passenger: its row leaves at the driver's next step boundary
    got = fut.result(timeout=60)
    assert first.token_id == _solo(s, mine, None, n=1).ids[0]
    _same(solo_long, got)
    _wait_for(lambda: not batcher.rows and not batcher.pending, "the batch to empty")
    assert_clean(s._lm)


def test_bad_stream_input_is_refused_before_the_stream_waits_for_the_model(s):
    go, holder = _hold(s)
    try:
        with pytest.raises(ie_lab.InputError, match="empty input"):
            next(s.generate_stream([], 4))
        with pytest.raises(ie_lab.InputError, match="prompt 1 is ids but prompt 0 is text"):
            next(s.generate_stream(["Mary went", [5, 6, 7]], 4))
        limit = s.facts.max_positions
        with pytest.raises(ie_lab.InputError, match=rf"prompt 1 \({limit - 2} tokens\)"):
            next(s.generate_stream([[5, 6], [7] * (limit - 2)], 10))

        async def awaited():
            with pytest.raises(ie_lab.InputError, match="prompt 1 is ids"):
                async for _ in s.agenerate_stream(["Mary went", [5, 6]], 4):
                    pass

        asyncio.run(awaited())
        assert holder.is_alive()
        assert not s._backend._batcher.pending
    finally:
        go.set()
        holder.join()
    assert_clean(s._lm)


def test_an_interrupt_in_a_joined_streams_cell_cancels_only_that_stream(s, ctrl_c_raises):
    """Ctrl-C while this cell's stream rides in a batch an awaited request drives: the stream ends with
    KeyboardInterrupt, its row leaves, and the driving request runs on to its solo result."""
    import signal

    long, mine = _prompt(0, 6), _prompt(1, 9)
    solo_long = _solo(s, long, None, n=30)
    batcher = s._backend._batcher
    sent = []

    def stream_request():
        return next((r for r in batcher.pending + batcher.in_forward + batcher.rows if r.stream), None)

    def interrupt(mod, args):  # on the driver's thread; the handler runs on the main thread, in the stream
        if sent:
            return
        mine_r = stream_request()
        if mine_r is None:
            # The driver waits in its forward until the cell's stream is queued: on a fast machine the first request
            # had finished its 30 tokens before the stream was opened, and the stream then ran alone.
            _wait_for(lambda: stream_request() is not None, "the cell's stream to be queued")
        elif mine_r in batcher.rows and len(mine_r.steps) >= 3:
            # The cell reads its steps on the main thread, as they are handed out: on a loaded machine it had read
            # none of the three when the interrupt was taken, so wait until it has read one (it needs no forward).
            _wait_for(lambda: len(got) >= 1, "the cell to have read a step of its stream")
            sent.append(threading.current_thread())
            signal.raise_signal(signal.SIGINT)
            # The main thread takes a signal raised on this thread when it next runs Python: the forward waits
            # until it has (its handler cancelled the stream's token, or the loop body raised and closed the
            # stream), so no further step of either request is produced before the interrupt is taken.
            _wait_for(lambda: mine_r.cancelled, "the main thread to take the interrupt")

    h = s._lm.binding.embed.register_forward_pre_hook(interrupt)
    got = []
    try:
        fut = s.submit(s.agenerate(long, 30, ignore_eos=True, capture=CAPTURE))
        _wait_for(lambda: batcher.in_forward, "the first request to be driving the batch (held in its first forward)")
        with pytest.raises(KeyboardInterrupt):
            for st in s.generate_stream(mine, 25, ignore_eos=True):
                got.append(st)
        result = fut.result(timeout=60)
    finally:
        h.remove()
    assert sent and sent[0] is not threading.main_thread()  # sent from the awaited request's driver
    assert 1 <= len(got) < 25
    assert [st.token_id for st in got] == _solo(s, mine, None, n=len(got)).ids
    _same(solo_long, result)
    _wait_for(lambda: not batcher.rows and not batcher.pending, "the batch to empty")
    assert_clean(s._lm)


@pytest.mark.parametrize("fam", ["gpt2", "mistral_sliding", "qwen3_moe"])
def test_a_list_joining_mid_batch_equals_its_solo_runs_on_other_families(fam):
    """Learned positions (gpt2), a sliding-window cache (the list waits for an empty batch, then starts as one),
    top-k experts (qwen3_moe)."""
    from tests.families import make_model, make_tokenizer

    with ie_lab.Session(make_model(fam), tokenizer=make_tokenizer(), progress=False) as s:
        v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(0))
        spec = s.steer("resid_post.0", v, scale=2.0)
        first, joiners = _prompt(0, 5), [_prompt(1, 21), _prompt(2, 3), _prompt(3, 9)]
        solo_first = _solo(s, first, None, n=8)
        solo = [_solo(s, p, spec, n=6) for p in joiners]
        batcher = s._backend._batcher
        seen = _Forwards(s)
        try:
            stream = s.generate_stream(first, 8, ignore_eos=True, capture=CAPTURE)
            steps = [next(stream), next(stream)]
            fut = s.submit(s.agenerate(joiners, 6, steer=spec, ignore_eos=True, capture=CAPTURE))
            _wait_for(lambda: len(batcher.pending) == 3, "the list's three prompts to be queued")
            steps += list(stream)
            got = fut.result(timeout=120)
        finally:
            seen.remove()
        assert [st.token_id for st in steps] == solo_first.ids
        for k in solo_first.cache.keys():
            torch.testing.assert_close(steps[-1].cache[k], solo_first.cache[k], atol=1e-5, rtol=1e-5)
        for want, g in zip(solo, got):
            _same(want, g)
        assert (3, 21) in seen.shapes  # the list's three prompts in one prefill
        if fam == "mistral_sliding":
            assert (4, 1) not in seen.shapes  # waited for the stream to finish
        else:
            assert (4, 1) in seen.shapes  # decoded with the stream
        assert not batcher.rows and not batcher.pending
        assert_clean(s._lm)


def _awaited_from_another_loop(s, coros):
    """Await the generates on another thread's event loop, as a notebook's `await` does: each joins the batch as
    it is issued there and computes on the session's loop thread. Returns once they all drive the batch."""
    batcher = s._backend._batcher
    go, holder = _hold(s)
    fut = concurrent.futures.Future()

    def main():
        async def gathered():
            return await asyncio.gather(*coros)

        try:
            fut.set_result(asyncio.run(gathered()))
        except BaseException as e:  # noqa: BLE001 - raised by fut.result() in the test
            fut.set_exception(e)

    threading.Thread(target=main).start()
    try:
        _wait_for(lambda: len(batcher.pending) == len(coros), "the generates to be queued")
    finally:
        go.set()
        holder.join()
    _wait_for(lambda: len(batcher.rows) == len(coros), "the generates to be driving the batch")
    return fut


def test_an_awaited_stream_joins_a_batch_awaited_generates_drive_on_the_busy_loop(s):
    # awaited generates compute on the session's loop thread and block it: the awaited stream joins from its
    # caller's side, gets its steps from their driver as they come, and drives the rest itself once its turn comes
    steers = _steers(s)
    others = [_prompt(i, 4 + 3 * i) for i in range(8)]
    mine = _prompt(9, 11)
    solo_others = [_solo(s, p, steers[i % 4], n=24) for i, p in enumerate(others)]
    solo = _solo(s, mine, steers[2], n=30)
    batcher = s._backend._batcher
    seen = _Forwards(s)
    received = []

    fut = _awaited_from_another_loop(
        s, [s.agenerate(p, 24, steer=steers[i % 4], ignore_eos=True, capture=CAPTURE) for i, p in enumerate(others)]
    )  # they compute on the session's loop thread: it is busy until they are done
    pace = _Pace(s, received)

    async def consume():
        async for st in s.agenerate_stream(mine, 30, steer=steers[2], ignore_eos=True, capture=CAPTURE):
            received.append((st, fut.done()))

    try:
        asyncio.run(consume())
        got_others = fut.result(timeout=120)
    finally:
        pace.remove()
        seen.remove()
    assert not pace.stalled
    assert not received[0][1]  # its first step came while the generates still ran
    assert any(done for _, done in received)  # and it drove its last steps itself
    assert (1, 11) in seen.shapes and (9, 1) in seen.shapes  # its prefill joined, then decoded in the shared batch
    steps = [st for st, _ in received]
    assert [st.token_id for st in steps] == solo.ids
    for x, y in zip(solo.steps, steps):
        torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
    for k in solo.cache.keys():
        torch.testing.assert_close(steps[-1].cache[k], solo.cache[k], atol=1e-5, rtol=0)
    for want, got in zip(solo_others, got_others):
        _same(want, got)
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


def test_an_awaited_stream_cancelled_while_it_rides_on_a_busy_loop_leaves_the_others_correct(s):
    others = [_prompt(i, 5 + 2 * i) for i in range(3)]
    mine = _prompt(7, 10)
    solo_others = [_solo(s, p, None, n=24) for p in others]
    want = _solo(s, mine, None, n=3)
    batcher = s._backend._batcher
    seen = _Forwards(s)
    received = []

    fut = _awaited_from_another_loop(s, [s.agenerate(p, 24, ignore_eos=True, capture=CAPTURE) for p in others])

    async def consume():
        async for st in s.agenerate_stream(mine, 20, ignore_eos=True):
            received.append((st, fut.done()))
            if len(received) == 3:
                raise asyncio.CancelledError  # the consumer's task is cancelled mid-way: the stream closes

    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(consume())
        left_early = not fut.done()  # the cancel did not wait for the busy loop
        got_others = fut.result(timeout=120)
    finally:
        seen.remove()
    assert left_early
    assert not any(done for _, done in received)
    assert [st.token_id for st, _ in received] == want.ids
    for x, (y, _) in zip(want.steps, received):
        torch.testing.assert_close(y.logits, x.logits, atol=1e-4, rtol=0)
    assert (4, 1) in seen.shapes and seen.shapes.count((4, 1)) < 20  # rode along, then its row left
    for w, g in zip(solo_others, got_others):
        _same(w, g)
    _wait_for(lambda: not batcher.rows and not batcher.pending, "the batch to empty")
    assert_clean(s._lm)
