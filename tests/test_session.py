"""Session in plain Python (threads, async, lifecycle, bad input). Kernel behaviour: test_session_kernel.py."""

import asyncio
import threading

import pytest
import torch

import ie_lab
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean, hook_count


@pytest.fixture()
def session():
    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False)
    yield s
    s.close()


def test_sync_and_async_twins_agree(session):
    c = session.capture("Mary went to the park", ["resid_post.1", "attn_probs.0"])

    async def main():
        return await session.acapture("Mary went to the park", ["resid_post.1", "attn_probs.0"])

    a = asyncio.run(main())
    for k in c:
        assert torch.equal(c[k], a[k])
    g = session.generate("Mary went to", 5)

    async def gen():
        r = await session.agenerate("Mary went to", 5)
        steps = [s async for s in session.agenerate_stream("Mary went to", 5)]
        return r, steps

    r, steps = asyncio.run(gen())
    assert g.ids == r.ids == [s.token_id for s in steps] == [s.token_id for s in session.generate_stream("Mary went to", 5)]


def test_every_operation_has_an_async_twin():
    from ie_lab.session import ASYNC_TWINS, Session

    for name in ASYNC_TWINS:
        assert callable(getattr(Session, name)) and callable(getattr(Session, "a" + name)), name


def test_sync_call_from_the_loop_thread_is_refused(session):
    with pytest.raises(RuntimeError, match="would deadlock"):
        session.run(lambda lm: session.capture("Mary", ["resid_post.0"]))
    assert session.capture("Mary", ["resid_post.0"])["resid_post.0"].shape[1] == 1


def test_plain_calls_compute_on_the_calling_thread_and_awaited_ones_on_the_loop(session):
    # Why it matters: a second OpenMP pool on the loop thread made every CPU call from a notebook slower
    # (ie_lab/session.py, module note). The forward itself must run where the plain call was made.
    seen = []
    h = session.model.register_forward_hook(lambda m, a, o: seen.append(threading.current_thread()))
    try:
        session.capture("Mary went", ["resid_post.0"])
        session.generate("Mary went", 3)
        steps = list(session.generate_stream("Mary went", 3))
        assert len(steps) == 3
        assert seen and all(t is threading.main_thread() for t in seen), {t.name for t in seen}
        seen.clear()
        asyncio.run(session.agenerate("Mary went", 2))
        assert seen and all(t is session._thread for t in seen)
        seen.clear()
        worker_seen = []
        th = threading.Thread(target=lambda: worker_seen.append(session.run(lambda lm: threading.current_thread())))
        th.start()
        th.join()
        assert worker_seen == [th]
    finally:
        h.remove()
    assert session.run(lambda lm: threading.current_thread()) is threading.main_thread()


def test_nested_plain_call_inside_run_is_refused_not_deadlocked(session):
    with pytest.raises(RuntimeError, match="would deadlock"):
        session.run(lambda lm: list(session.generate_stream("Mary", 2)))
    assert not session.model._forward_hooks and len(session.generate("Mary", 2).ids) == 2


def test_concurrent_threads_queue_and_get_their_own_answers(session):
    prompts = [f"Mary went to the {w}" for w in ("park", "store", "school", "house", "garden", "day")]
    expected = {p: session.capture(p, ["resid_post.1"])["resid_post.1"] for p in prompts}
    out, errors = {}, []

    def worker(p):
        try:
            out[p] = session.capture(p, ["resid_post.1"])["resid_post.1"]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for p in prompts:
        assert torch.equal(out[p], expected[p])


def test_async_tasks_at_once_do_not_interleave_a_stream_with_a_steered_capture(session):
    v = torch.randn(128) * 10
    plain = session.generate("Mary went to the", 8).ids

    async def main():
        async def stream():
            return [s.token_id async for s in session.agenerate_stream("Mary went to the", 8)]

        async def steered():
            spec = session.steer("resid_post.0", v)
            return await session.agenerate("Mary went to the", 8, steer=spec)

        return await asyncio.gather(stream(), steered(), stream())

    a, st, b = asyncio.run(main())
    assert a == b == plain and st.ids != plain
    assert_clean(session._lm)


def test_cancelling_a_capture_between_layers_leaves_nothing_behind(session):
    from ie_lab.session import OperationCancelled, _CancelToken

    token = _CancelToken()
    token.cancelled = True
    with pytest.raises(OperationCancelled):
        session._call(session._run(lambda: ie_lab.capture(session._lm, "Mary", ["resid_post.1", "attn_probs.1"]),
                                   token), token)
    assert_clean(session._lm)
    assert session.capture("Mary", ["resid_post.1"])["resid_post.1"].shape == (1, 1, 128)


def test_recreating_replaces_and_close_releases():
    m, t = tiny_model("llama")
    s1 = ie_lab.Session(m, tokenizer=t, progress=False)
    thread = s1._thread
    s2 = ie_lab.Session(m, tokenizer=t, progress=False)
    assert s1._closed and not thread.is_alive()
    with pytest.raises(ie_lab.SessionClosed, match="create a new one"):
        s1.capture("Mary", ["resid_post.0"])
    with ie_lab.Session(m, tokenizer=t, progress=False) as s3:
        assert s2._closed
        assert "family=llama" in repr(s3)
    assert s3._closed and not s3._thread.is_alive()


def test_session_surface(session):
    assert session.tokens("Mary went").shape == (1, 2)
    assert session.to_str_tokens("Mary went") == ["Mary", "went"]
    assert "2 layers" in session.describe()
    table = session.points()
    assert "resid_post" in table.served() and "q_norm_in" not in table.served()
    assert "no QK-norm" in repr(table)
    lens = session.logit_lens("Mary went to the")
    assert lens.top_ids.shape[0] == 2 and lens.plot() is not None
    att = session.attention("Mary went to the", layers=[1])
    assert att.probs[1].shape == (4, 4, 4)
    grid = session.patch_sweep("Mary went to the", "John went to the", ie_lab.logit_diff(20, 21), progress=False)
    assert grid.values.shape == (2, 4)
    g = session.gradients("Mary went to the", ie_lab.logit_diff(20, 21), ["resid_post.0"])
    assert g["resid_post.0"].shape == (1, 4, 128)
    assert "Session(" in repr(session) and "<b>ie_lab Session</b>" in session._repr_html_()


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(ie_lab.InputError, match="no folder"):
        ie_lab.Session(str(tmp_path / "missing"))
    m, t = tiny_model("llama")
    with pytest.raises(ie_lab.InputError, match="unknown dtype"):
        ie_lab.Session(m, tokenizer=t, dtype="float7")
    if not torch.cuda.is_available():
        with pytest.raises(ie_lab.InputError, match="no CUDA device"):
            ie_lab.Session(m, tokenizer=t, device="cuda")
    with pytest.raises(ie_lab.InputError, match="unknown backend"):
        ie_lab.Session(m, tokenizer=t, backend="tpu")
    with pytest.raises(ie_lab.CapabilityUnsupported, match="backend='eager'"):
        ie_lab.Session(m, tokenizer=t, backend="vllm")
    assert not [th for th in threading.enumerate() if th.name == "ie_lab-session" and th.is_alive()
                and not getattr(th, "_ie_lab_owner_alive", True)]


def test_sizing_against_measured_parameters():
    for fam in ("llama", "gpt2", "gemma2", "mixtral"):
        m, _ = tiny_model(fam)
        measured = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
        est = ie_lab.sizing.estimate(m.config, "float32")
        assert est.weights_bytes == pytest.approx(measured, rel=0.1), fam
        f = est.facts
        assert est.kv_bytes_per_token == 2 * f.n_layers * f.n_kv_heads * f.head_dim * 4
    t = ie_lab.sizing.table({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                             "vocab_size": 128256}, "bfloat16", 8192)
    text = repr(t)
    assert "8.0" in text.splitlines()[0] or "~8" in text  # ~8B params (Llama-3-8B shape)
    assert "does not fit" in text.split("T4")[1].splitlines()[0]
    assert "does not fit" not in text.split("H100")[1].splitlines()[0]
