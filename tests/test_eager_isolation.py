"""A request that fails on the eager backend fails alone (issue 28): the batch and the Session serve every other.

The hostile request steers by 1e48 (a float32 inf), so its logits turn non-finite at its first generated token and
sampling has no distribution. It must raise an IELabError naming that, leave no hook behind, and leave the batch
serving: later calls, and the well-behaved requests that shared its batch, equal what they compute alone. The
requests are held behind the session's operation lock until all of them are queued (tests/test_eager_batch_*), so
they meet in one batch whatever the machine's speed.
"""

import pytest
import torch

import ie_lab
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean
from tests.test_eager_batch_concurrent import _Forwards
from tests.test_eager_batch_joins import _held

HOSTILE = "John gave a drink to"
OTHERS = ["The cat sat on the", "Mary and John went", "A drink of water is", "When the day ends"]


@pytest.fixture(scope="module")
def fresh():
    """An untouched session on the same toy model (same seed): what a request computes where nothing failed."""
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False) as session:
        yield session


@pytest.fixture()
def s():
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False) as session:
        yield session


def _hostile(s):
    d = s.facts.d_model
    return s.steer("resid_post.1", torch.full((d,), 1e38), scale=1e10, positions="generated")


def test_non_finite_logits_fail_that_request_alone_and_the_session_serves_on(s, fresh):
    with pytest.raises(ie_lab.IELabError, match="non-finite") as err:
        s.generate(HOSTILE, 6, steer=_hostile(s), temperature=1.0, seed=0)
    assert "step 1" in str(err.value) and "scale" in str(err.value)  # where, and what to change
    assert_clean(s._lm)
    for i, p in enumerate(OTHERS[:3]):
        kw = {"temperature": 0.8, "seed": i} if i % 2 else {}
        assert s.generate(p, 6, **kw).ids == fresh.generate(p, 6, **kw).ids
    batcher = s._backend._batcher
    assert not batcher.rows and not batcher.pending and batcher.cache is None
    assert_clean(s._lm)


def _calls(s, spec=None):
    """The well-behaved neighbours (sampled with seeds, and greedy) and the hostile one among them."""
    kws = [{"temperature": 0.9, "seed": 1}, {}, {"temperature": 1.0, "seed": 7, "top_k": 50}, {}]
    hostile = spec if spec is not None else _hostile(s)
    calls = [(p, kw) for p, kw in zip(OTHERS, kws)]
    calls.insert(2, (HOSTILE, {"steer": hostile, "temperature": 1.0, "seed": 0}))
    return calls


def _neighbours(s, calls, decoded_together=True):
    """Every call awaited at once, queued behind the held lock so they share one batch: their results (the hostile
    one's error in its place)."""
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        got = _held(
            s,
            lambda: len(batcher.pending),
            len(calls),
            lambda: [_gathered(s.agenerate(p, 8, ignore_eos=True, **kw)) for p, kw in calls],
        )
    finally:
        seen.remove()
    n = len(calls)
    assert seen.shapes[0][0] == n  # one prefill of all of them
    assert ((n, 1) in seen.shapes) == decoded_together  # and decode steps of all, unless it failed in the prefill
    assert seen.shapes[-1] == (n - 1, 1)  # the others ran on together once the hostile one had left
    return got


async def _gathered(coro):
    try:
        return await coro
    except ie_lab.IELabError as e:  # the hostile one's error, returned so gather still hands back every result
        return e


def test_a_hostile_request_leaves_its_batch_neighbours_equal_to_their_solo_runs(s):
    calls = _calls(s)
    solo = {p: ie_lab.generate(s._lm, p, 8, ignore_eos=True, **kw) for p, kw in calls if p != HOSTILE}
    got = _neighbours(s, calls)
    assert isinstance(got[2], ie_lab.IELabError) and "non-finite" in str(got[2])
    for (p, _), g in zip(calls, got):
        if p != HOSTILE:
            assert g.ids == solo[p].ids, p
    batcher = s._backend._batcher
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)


@pytest.mark.parametrize("at", [1, 3])  # its prompt's forward (shared with the others), a decode step mid-batch
def test_an_exception_raised_in_one_requests_hook_fails_that_request_alone(s, at):
    spec = s.steer("resid_post.0", torch.ones(s.facts.d_model), scale=0.5)
    ops = {"n": 0}

    def broken_edit(state, special):
        def apply(h, offset):
            ops["n"] += 1
            if ops["n"] == at:  # the at-th forward it steers
                raise RuntimeError("boom in a steering hook")
            return h

        return apply

    spec.edit = broken_edit  # this one spec's hook raises; every other request's hooks are the real ones
    calls = _calls(s, spec)
    solo = {p: ie_lab.generate(s._lm, p, 8, ignore_eos=True, **kw) for p, kw in calls if p != HOSTILE}
    got = _neighbours(s, calls, decoded_together=at > 1)
    assert isinstance(got[2], ie_lab.IELabError) and "boom in a steering hook" in str(got[2])
    for (p, _), g in zip(calls, got):
        if p != HOSTILE:
            assert g.ids == solo[p].ids, p
    assert s.generate(OTHERS[0], 4).ids == ie_lab.generate(s._lm, OTHERS[0], 4).ids
    assert_clean(s._lm)


def test_a_capture_whose_steering_hook_raises_fails_alone_in_its_shared_forward(s):
    from tests.test_eager_batch_joins import _same_capture

    good = s.steer("resid_post.0", torch.ones(s.facts.d_model), scale=0.5)
    bad = s.steer("resid_post.0", torch.ones(s.facts.d_model), scale=0.5)

    def broken_edit(state, special):
        def apply(h, offset):
            raise RuntimeError("boom in a capture's hook")

        return apply

    bad.edit = broken_edit
    points = ["resid_post.1", "attn_probs.0"]
    solo = [s.capture(OTHERS[0], points, steer=good), s.capture(OTHERS[1], points)]
    batcher = s._backend._batcher
    seen = _Forwards(s)
    try:
        got = _held(
            s,
            lambda: len(batcher.captures),
            3,
            lambda: [
                s.acapture(OTHERS[0], points, steer=good),
                _gathered(s.acapture(HOSTILE, points, steer=bad)),
                s.acapture(OTHERS[1], points),
            ],
        )
    finally:
        seen.remove()
    assert len(seen.shapes) == 1 and seen.shapes[0][0] == 3  # the three read in one forward
    assert isinstance(got[1], ie_lab.IELabError) and "boom in a capture's hook" in str(got[1])
    _same_capture(solo[0], got[0])
    _same_capture(solo[1], got[2])
    assert not batcher.captures
    assert_clean(s._lm)


def test_a_failure_no_request_is_to_blame_for_ends_that_step_and_the_next_call_starts_a_new_batch(s, monkeypatch):
    batcher = s._backend._batcher
    real, calls = batcher._decode, []

    def breaks_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("internal failure in the decode step")
        real()

    monkeypatch.setattr(batcher, "_decode", breaks_once)
    with pytest.raises(RuntimeError, match="internal failure"):
        s.generate(OTHERS[0], 6, ignore_eos=True)
    assert not batcher.rows and batcher.cache is None  # no row of it left to carry
    assert s.generate(OTHERS[1], 6).ids == ie_lab.generate(s._lm, OTHERS[1], 6).ids
    assert not batcher.rows and not batcher.pending
    assert_clean(s._lm)
