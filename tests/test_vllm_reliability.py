"""The vLLM backend under bad input and failures: one bad request never kills the engine, engine arguments that
would silently change results are refused, `with spec:` steers only its own context, streamed steps carry
their captures, and closing a Session leaves none of ours behind."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.errors import CapabilityUnsupported, InputError, RequestFailed  # noqa: E402
from tests.vllm_helpers import PROMPTS, TEXT, close, eager_for, vllm_session  # noqa: E402


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    sess = vllm_session("llama", tmp_path_factory.mktemp("vllm_rel"))
    yield sess
    sess.close()


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(seed)) * 3


def _clean(s) -> None:
    st = s.worker_state()[0]
    assert st["specs"] == [] and st["steering"] == 0 and not st["rows_in_flight"], st
    assert not s._backend._inflight


# ---- A: bad arguments never reach the engine; a failure inside it fails one request -----------------------

BAD = [
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": -1}, "seed"),
    ({"stop": [123]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 10**9}, "top_k"),
    ({"n_logprobs": -1}, "n_logprobs"),
    ({"n_logprobs": 21}, "max_logprobs"),
    ({"n_logprobs": 1.5}, "n_logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


def test_bad_sampling_arguments_are_refused_and_requests_in_flight_survive(s):
    solo = s.generate(PROMPTS[1], 24)

    async def scenario():
        long = asyncio.ensure_future(s.agenerate(PROMPTS[1], 24))  # in flight while the bad calls come
        await asyncio.sleep(0.05)
        for kw, name in BAD:
            with pytest.raises(InputError, match=name):
                await s.agenerate(TEXT, 4, **{"temperature": 1.0, **kw})
        for n in (0, -3, 2.0, True):
            with pytest.raises(InputError, match="max_new_tokens"):
                await s.agenerate(TEXT, n)
        return await long

    assert asyncio.run(scenario()).ids == solo.ids
    with pytest.raises(InputError, match="seed"):  # and through the stream
        list(s.generate_stream(TEXT, 4, temperature=1.0, seed="abc"))
    assert s.generate(TEXT, 4).ids == s.generate(TEXT, 4).ids  # the engine still serves
    top = 2**64 - 1  # the largest seed torch takes, as on eager
    assert s.generate(TEXT, 6, temperature=1.0, seed=top).ids == s.generate(TEXT, 6, temperature=1.0, seed=top).ids
    _clean(s)


def test_a_step_that_fails_inside_vllm_fails_its_request_and_the_engine_goes_on(s):
    # A sampling value ie_lab would refuse, handed straight to the driver: vLLM fails inside its step.
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    base = s.generate(TEXT, 6).ids

    async def bad():
        ids = s.tokenizer(TEXT)["input_ids"]
        async for _ in s._backend._driver.generate(
            TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=4, temperature=1.0, seed="abc"), "bad-seed"
        ):
            pass

    with pytest.raises(RequestFailed, match="manual_seed"):
        s._call(bad())
    assert s.generate(TEXT, 6).ids == base  # the next call is served by the same engine
    _clean(s)


def test_a_hook_that_fails_in_the_worker_fails_only_its_request(s):
    # A steering payload that cannot apply (a 7-wide vector on a 128-wide stream) fails inside the worker's hook
    # during the forward, batched together with good requests.
    from vllm import SamplingParams

    from ie_lab.vllm.checks import _Work
    from ie_lab.vllm.wire import pack

    good_spec = s.steer("resid_post.0", _vec(1), scale=3.0)
    want_steered = s.generate(PROMPTS[2], 12, steer=good_spec, capture=["resid_post.1"])
    want_plain = s.generate(PROMPTS[3], 12)
    bad_payload = {
        "address": "resid_post.0",
        "method": "add",
        "kwargs": {"scale": 1.0},
        "vector": pack(torch.zeros(7)),
        "positions": "all",
    }

    async def broken():
        box: dict = {}
        ids = s.tokenizer(PROMPTS[0])["input_ids"]
        async for _ in s._backend._request(
            ids, SamplingParams(max_tokens=12, temperature=0.0), _Work([], [], [bad_payload]), box
        ):
            pass

    async def scenario():
        return await asyncio.gather(
            asyncio.wrap_future(asyncio.run_coroutine_threadsafe(broken(), s._loop)),
            s.agenerate(PROMPTS[2], 12, steer=good_spec, capture=["resid_post.1"]),
            s.agenerate(PROMPTS[3], 12),
            return_exceptions=True,
        )

    err, steered, plain = asyncio.run(scenario())
    assert isinstance(err, RequestFailed) and "steering resid_post.0" in str(err), err
    assert steered.ids == want_steered.ids and close(steered.cache["resid_post.1"], want_steered.cache["resid_post.1"])
    assert plain.ids == want_plain.ids
    assert s.generate(PROMPTS[3], 12).ids == want_plain.ids
    _clean(s)


# ---- B: engine arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"enforce_eager": False}, "graph_points"),
        ({"compilation_config": {"mode": 3}}, "graph_points"),
        ({"kv_cache_dtype": "fp8"}, "KV cache"),
        ({"speculative_config": {"method": "ngram"}}, "draft"),
        ({"enable_prefix_caching": False}, "enable_prefix_caching="),
        ({"seed": 3}, "Session"),
        ({"worker_extension_cls": "x.Y"}, "ie_lab sets it"),
        ({"max_num_seq": 4}, "max_num_seqs"),  # a typo: not checked, and the near name is suggested
        ({"swap_space": 4}, "has not been checked"),
    ],
)
def test_engine_arguments_that_would_change_results_are_refused_before_the_engine_starts(kw, match, tmp_path):
    from tests.families import saved_model_dir

    path = saved_model_dir("llama", tmp_path)
    with pytest.raises(CapabilityUnsupported, match=match):
        ie_lab.Session(path, backend="vllm", progress=False, replace=False, engine_kwargs=kw)
    with pytest.raises(InputError, match="engine_kwargs"):
        ie_lab.Session(path, backend="vllm", progress=False, replace=False, engine_kwargs=[("enforce_eager", False)])


def test_allowed_engine_arguments_keep_steering_and_capture_exact(s, tmp_path):
    # A small batch and an 8-token forward budget: prompts are split into chunks and requests into several
    # forwards, which the hooks must not notice.
    from ie_lab.eager.steer import make_spec

    eager = eager_for("llama")
    other = s.generate(TEXT, 6).ids  # a second in-process engine beside the module's, then closed
    sess = vllm_session(
        "llama",
        tmp_path,
        engine_kwargs={
            "max_num_seqs": 2,
            "max_num_batched_tokens": 8,
            "enable_chunked_prefill": True,
            "max_logprobs": 30,
        },
    )
    try:
        v = _vec(4)
        got = sess.generate(TEXT, 8, steer=sess.steer("resid_mid.1", v, scale=3.0), capture=["resid_post.1"])
        want = ie_lab.generate(
            eager, TEXT, 8, steer=make_spec(eager, "resid_mid.1", v, scale=3.0), capture=["resid_post.1"]
        )
        assert got.ids == want.ids and got.ids != ie_lab.generate(eager, TEXT, 8).ids
        assert close(got.cache["resid_post.1"], want.cache["resid_post.1"])
        assert len(sess.generate(TEXT, 2, n_logprobs=25).steps[0].top_logprobs) == 25  # max_logprobs passed on
    finally:
        sess.close()
    # vLLM's shutdown tears down the process-wide parallel groups; the live engine must keep serving
    assert s.generate(TEXT, 6).ids == other


# ---- C: `with spec:` steers its own context only ---------------------------------------------------------------


def test_with_blocks_in_concurrent_tasks_each_steer_only_their_own_requests(s):
    specs = [s.steer(f"resid_post.{i % 2}", _vec(20 + i), scale=3.0) if i % 3 != 2 else None for i in range(8)]
    caps = ["resid_post.1"]
    solo = [s.generate(p, 8, capture=caps, steer=sp) for p, sp in zip(PROMPTS, specs)]

    async def one(i):
        if specs[i] is None:
            return await s.agenerate(PROMPTS[i], 8, capture=caps)
        with specs[i]:
            await asyncio.sleep(0.01 * (i % 3))  # the blocks overlap in time
            return await s.agenerate(PROMPTS[i], 8, capture=caps)

    async def together():
        return await asyncio.gather(*(one(i) for i in range(8)))

    conc = asyncio.run(together())
    for i, (a, b) in enumerate(zip(solo, conc)):
        assert a.ids == b.ids, i
        assert close(a.cache["resid_post.1"], b.cache["resid_post.1"]), i
    assert solo[0].ids != s.generate(PROMPTS[0], 8).ids  # the steering does change the tokens
    _clean(s)


def test_with_block_nested_twice_applies_once_and_other_threads_are_untouched(s):
    spec = s.steer("resid_post.0", _vec(31), scale=2.0)
    once = s.generate(TEXT, 8, steer=spec).ids
    plain = s.generate(TEXT, 8).ids
    assert once != plain
    from_thread: list = []
    with spec:
        with spec:
            twice = s.generate(TEXT, 8).ids
            also = s.generate(TEXT, 8, steer=spec).ids
        inner_left = s.generate(TEXT, 8).ids  # the outer block is still on
        t = threading.Thread(target=lambda: from_thread.append(s.generate(TEXT, 8).ids))
        t.start()
        t.join(120)
        assert not t.is_alive(), "hung"
    assert twice == once and also == once and inner_left == once
    assert from_thread == [plain]
    assert s.generate(TEXT, 8).ids == plain  # nothing left on after the blocks
    _clean(s)


# ---- D: streamed captures ------------------------------------------------------------------------------------


def test_streamed_steps_carry_their_captures_and_the_last_the_whole_cache(s):
    caps = ["resid_post.1", "z.0.head-1", "mlp_out.0", "attn_probs.1"]
    spec = s.steer("resid_mid.0", _vec(41), scale=2.0)
    want = s.generate(TEXT, 7, capture=caps, steer=spec, ignore_eos=True)
    steps = list(s.generate_stream(TEXT, 7, capture=caps, steer=spec, ignore_eos=True))
    assert [x.token_id for x in steps] == want.ids
    P = want.prompt_ids.shape[1]
    assert steps[0].captured_positions == range(0, P)
    assert [x.captured_positions for x in steps[1:-1]] == [range(P + i - 1, P + i) for i in range(1, 6)]
    assert steps[-1].captured_positions == range(P + 5, P + 7)  # its fed-in token and its own
    for a in caps[:3]:
        joined = torch.cat([x.captured[a] for x in steps], dim=1)
        assert close(joined, want.cache[a]), a
        assert close(steps[-1].cache[a], want.cache[a]), a
    # attention rows: [1, heads, new queries, keys so far]; padded (masked) to every key they join up
    T = P + 7
    assert [x.captured["attn_probs.1"].shape[-1] for x in steps] == [P + i for i in range(6)] + [T]
    joined = torch.cat(
        [
            torch.nn.functional.pad(x.captured["attn_probs.1"], (0, T - x.captured["attn_probs.1"].shape[-1]))
            for x in steps
        ],
        dim=2,
    )
    assert close(joined, want.cache["attn_probs.1"])
    assert close(steps[-1].cache["attn_probs.1"], want.cache["attn_probs.1"])
    assert all(x.cache is None for x in steps[:-1])
    assert torch.equal(steps[-1].cache.tokens[0, P:], torch.tensor(want.ids))
    _clean(s)


# ---- E: closing leaves nothing of ours -------------------------------------------------------------------------


def test_closed_sessions_leave_no_object_of_ours_behind(tmp_path):
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.llm_engine import LLMEngine

    from ie_lab.vllm import checks as vchecks
    from ie_lab.vllm import engine as vengine
    from ie_lab.vllm import worker as vworker

    # Ours, and what our hooks and drivers would keep alive if they leaked: the engine, and any module (the
    # served model's layers hold its weights).
    kinds = (
        ie_lab.Session,
        vchecks.VLLMModel,
        vengine.InprocDriver,
        vengine.AsyncDriver,
        vworker.IELabWorker,
        LLMEngine,
        EngineCore,
        torch.nn.Module,
    )

    def count():
        gc.collect()
        return {k.__name__: sum(1 for o in gc.get_objects() if isinstance(o, k)) for k in kinds}

    def cycle():
        sess = vllm_session("llama", tmp_path)
        sess.generate(TEXT, 4, capture=["resid_post.0", "attn_probs.1"], steer=sess.steer("resid_post.0", _vec(0)))
        list(sess.generate_stream(TEXT, 3, capture=["resid_post.0"]))
        sess.close()

    cycle()  # the first engine in a process creates a few lazy singletons (a torch.fx GraphModule) that stay
    before = count()
    cycle()
    cycle()
    after = count()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}


def test_a_dropped_vllm_session_is_freed_with_its_thread(tmp_path):
    # The loop thread used to run a bound method of the session, so a session nobody referred to (a re-bound name
    # in a notebook) kept its thread, its engine and the model's memory until the process ended.
    import weakref

    sess = vllm_session("llama", tmp_path)
    assert sess.generate(TEXT, 2).ids
    ref, thread = weakref.ref(sess), sess._thread
    del sess
    gc.collect()
    thread.join(timeout=60)  # a bound on a hang only
    assert ref() is None, "the dropped session is still referenced"
    assert not thread.is_alive(), "the dropped session's loop thread is still running"


def test_mean_difference_on_vllm_equals_eager(s):
    # Session.mean_difference came to the eager Session this stop; the vLLM session inherits the name, so it must
    # compute the same vector (concurrent requests), not run eager code on a vLLM handle.
    lm = eager_for("llama")
    pos = [TEXT, "Mary went to the park with John"]
    neg = ["The weather was cold", "A dog ran across the road and barked"]
    want = ie_lab.mean_difference(lm, pos, neg, "resid_post.1")
    got = s.mean_difference(pos, neg, "resid_post.1", batch_size=1)
    assert got.shape == want.shape and close(got, want, atol=1e-3)
    assert not close(got, ie_lab.mean_difference(lm, pos, neg, "resid_post.0"), atol=1e-3)  # another layer fails
    assert close(asyncio.run(s.amean_difference(pos, neg, "resid_post.1")), got, atol=1e-5)
    with pytest.raises(InputError):
        s.mean_difference([], neg, "resid_post.1")
    with pytest.raises(InputError):
        s.mean_difference(pos, neg, "attn_probs.0")
    _clean(s)
