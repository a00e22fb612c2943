"""A request that fails on vLLM fails alone (issue 28): nothing it wrote reaches another request.

The hostile request steers resid_post.0 by 1e38 x 1e10 (a float32 inf) at its generated positions (layer 0 of this
two-layer model: layer 1's keys and values are computed from what it hands on). Before the fix,
vLLM returned NaN logprobs from its second token with no error, and the next unsteered requests (other prompts) also
came back with NaN logprobs and other tokens: the NaN rows went into KV blocks that were freed and handed to the
next requests, whose attention multiplies a masked slot's weight 0 by NaN. Now the worker sees the non-finite rows
where the steering makes them (a hook in hooks mode, the compiled site's own check in graph mode), keeps them out of
the KV cache, and fails that request with an IELabError naming the site and step; every other request equals its
solo run, token for token and logprob for logprob.

One hooks-mode and one graph-mode engine serve the whole module (engine start-ups are the gate's biggest cost).
At tensor_parallel_size=2 the reproduction runs on the engines tests/test_vllm_tp.py already starts (every TP
family, hooks and graph mode): the request fails naming the site, and the next requests equal their solo runs.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402

HOSTILE = "John gave a drink to"
OTHERS = ["the cat", "Mary went", "Paris is the capital of France and"]  # short ones live among the freed slots
N = 6
SITE = "resid_post.0"
# two edits that are each finite (2e38 < float32's 3.4e38) and whose sum, the residual add of layer 0, is not
SUM_SITES = ["attn_out.0", "mlp_out.0"]
# greedy, and sampled with a seed (each request its own, so a solo run is reproducible)
KWS = [{}, {"temperature": 0.9, "seed": 3}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved_model_dir("llama", tmp_path_factory.mktemp("isolation"))


@pytest.fixture(scope="module")
def hooks(folder):
    s = ie_lab.Session(folder, backend="vllm", progress=False, replace=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def graph(folder):
    s = ie_lab.Session(
        folder, backend="vllm", progress=False, replace=False, graph_points=[SITE], steer_points=[SITE, *SUM_SITES]
    )
    yield s
    s.close()


@pytest.fixture(params=["hooks", "graph"])
def s(request):
    return request.getfixturevalue(request.param)


def _hostile(s):
    return s.steer(SITE, torch.full((s.facts.d_model,), 1e38), scale=1e10, positions="generated")


def _out(r) -> tuple[list[int], list[float]]:
    return list(r.ids), [st.logprob for st in r.steps]


def _solo(s, kw) -> list[tuple[list[int], list[float]]]:
    return [_out(s.generate(p, N, ignore_eos=True, **kw)) for p in OTHERS]


@pytest.mark.parametrize("kw", KWS, ids=["greedy", "sampled"])
def test_overflowing_steer_fails_alone_and_later_requests_equal_their_solo_runs(s, kw):
    before = _solo(s, kw)
    assert all(lp == lp for _, lps in before for lp in lps)  # finite to begin with (NaN != NaN)
    with pytest.raises(ie_lab.IELabError, match="non-finite") as err:
        s.generate(HOSTILE, N, ignore_eos=True, steer=_hostile(s), **kw)
    msg = str(err.value)
    # where it went wrong: the site (graph mode: the compiled site's own flag, not the check of the output), and the
    # first generated position
    assert f"steering made {SITE} non-finite" in msg and "step 1" in msg, msg
    after = _solo(s, kw)
    assert after == before  # token ids and logprobs, exactly: a NaN anywhere fails this
    assert s.worker_state()[0]["specs"] == []


def test_finite_edits_that_overflow_later_fail_alone_and_the_cache_is_cleared(s):
    """Each edit is finite where it is made, so no site's check sees anything; their sum overflows in the residual
    add, and layer 1's keys and values are computed from it. The check on the model's output fails the request and
    clears the cache of non-finite values before its blocks are reused: the next requests equal their solo runs."""
    before = _solo(s, {})
    v = torch.zeros(s.facts.d_model)
    v[0] = 2e38
    spec = [s.steer(a, v, positions="generated") for a in SUM_SITES]
    with pytest.raises(ie_lab.IELabError, match="non-finite") as err:
        s.generate(HOSTILE, N, ignore_eos=True, steer=spec)
    msg = str(err.value)
    assert "model's output" in msg and "step 1" in msg and "cleared from the KV cache" in msg, msg
    assert _solo(s, {}) == before
    assert s.worker_state()[0]["specs"] == []


def _together(s, jobs):
    async def many():
        return await asyncio.gather(*(job(s) for job in jobs), return_exceptions=True)

    return asyncio.run(many())


def _well(p, kw):
    async def job(s):
        return _out(await s.agenerate(p, N, ignore_eos=True, **kw))

    return job


def _bad(kind):
    async def job(s):
        if kind == "overflow":
            return await s.agenerate(HOSTILE, N, ignore_eos=True, steer=_hostile(s))
        if kind == "address":
            return await s.agenerate(HOSTILE, N, capture=["resid_post.99"])
        return await s.alogit_lens(HOSTILE, k=10**9)

    return job


@pytest.mark.parametrize("kw", KWS, ids=["greedy", "sampled"])
def test_hostile_neighbour(s, kw):
    """Three well-behaved users run concurrently while a hostile one sends each failing request in turn: each
    hostile request raises an IELabError, and the well-behaved outputs equal their solo runs, token for token."""
    solo = _solo(s, kw)
    for kind in ["overflow", "address", "lens_k"]:
        got = _together(s, [_well(p, kw) for p in OTHERS] + [_bad(kind)])
        assert isinstance(got[-1], ie_lab.IELabError), (kind, got[-1])
        for p, g, want in zip(OTHERS, got, solo):
            assert not isinstance(g, BaseException), (kind, p, g)
            assert g[0] == want[0], (kind, p)
            assert torch.allclose(torch.tensor(g[1]), torch.tensor(want[1]), atol=1e-4), (kind, p)
    assert s.worker_state()[0]["specs"] == []


def test_logit_lens_k_out_of_range_is_refused_before_the_engine(hooks):
    """A k past the vocabulary used to reach torch's topk inside the worker (a raw engine error): refused up front,
    naming the range, and the engine serves on."""
    vocab = hooks.facts.vocab_size
    for k in [0, -3, vocab + 1, 10**9, True, 2.5, "3"]:
        with pytest.raises(ie_lab.InputError, match="vocabulary size"):
            hooks.logit_lens(HOSTILE, k=k)
    assert hooks.logit_lens(HOSTILE, k=vocab).top_ids.shape[-1] == vocab
    assert hooks.worker_state()[0]["specs"] == []
