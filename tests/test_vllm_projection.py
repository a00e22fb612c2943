"""project() on vLLM: scores computed in the worker equal eager's (tests/test_vllm_parity.py's tolerance) for
probes and ReLU / JumpReLU / TopK encoders, on the prompt, during generation, for concurrent requests and in
graph mode; only the scores come back; bad inputs are refused before a request is made.

One engine for the whole module (vLLM engines are slow to start here); graph mode's projection is checked in
tests/test_vllm_graph_steer.py, on the graph-mode engine of the same model that module starts."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.errors import IELabError  # noqa: E402
from tests.vllm_helpers import TEXT, close, eager_for, vllm_session  # noqa: E402

FAMILY = "llama"


@pytest.fixture(scope="module")
def eager():
    return eager_for(FAMILY)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    with vllm_session(FAMILY, tmp_path_factory.mktemp("vllm_proj")) as s:
        yield s


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _encoders(f):
    d, dm = f.d_model, f.d_mlp
    probe = torch.randn(8, d, generator=_g(0))
    sae = {
        "W_enc": torch.randn(dm, 32, generator=_g(1)) / dm**0.5,
        "b_enc": torch.randn(32, generator=_g(2)) * 0.1,
        "b_dec": torch.randn(dm, generator=_g(3)) * 0.1,
    }
    jump = {
        "W_enc": torch.randn(f.head_dim, 12, generator=_g(4)),
        "b_enc": torch.randn(12, generator=_g(5)),
        "threshold": torch.rand(12, generator=_g(6)),
    }
    topk = {"W_enc": torch.randn(d, 20, generator=_g(7)), "b_enc": torch.randn(20, generator=_g(8))}
    return [
        ("resid_post.1", probe, {"bias": torch.randn(8, generator=_g(9))}),
        ("mlp_act.0", sae, {}),
        ("z.1.head-2", jump, {}),
        ("mlp_out.1", topk, {"activation": "topk", "k": 4}),
    ]


def test_scores_equal_eager_prompt_generation_and_concurrent(session, eager):
    for addr, enc, kw in _encoders(eager.facts):
        v = session.project(TEXT, addr, enc, **kw)
        e = ie_lab.project(eager, TEXT, addr, enc, **kw)
        assert v.scores.dtype == torch.float32 and v.scores.shape == e.scores.shape, addr
        assert close(v.scores, e.scores), f"{addr}: {(v.scores - e.scores).abs().max()}"
        assert torch.equal(v.tokens, e.tokens)
        # the comparison can fail: the same encoder on the neighbouring layer's point is far off
        other = addr.replace(".1", ".0") if ".1" in addr else addr.replace(".0", ".1")
        assert not close(ie_lab.project(eager, TEXT, other, enc, **kw).scores, v.scores), addr
    # during generation: the same greedy tokens, scores of prompt + generated[:-1]
    addr, enc, kw = _encoders(eager.facts)[1]
    v = session.project(TEXT, addr, enc, max_new_tokens=6, ignore_eos=True, **kw)
    e = ie_lab.project(eager, TEXT, addr, enc, max_new_tokens=6, ignore_eos=True, **kw)
    assert v.generated == e.generated and len(v.generated) == 6
    assert v.scores.shape == e.scores.shape == (e.tokens.shape[0], 32)
    assert close(v.scores, e.scores)

    # concurrent requests with different encoders, batched by vLLM: each equals eager
    async def many():
        return await asyncio.gather(*(session.aproject(TEXT, a, en, **k) for a, en, k in _encoders(eager.facts)))

    outs = asyncio.run(many())
    for (a, en, k), got in zip(_encoders(eager.facts), outs):
        assert close(got.scores, ie_lab.project(eager, TEXT, a, en, **k).scores), a
    assert session.worker_state()[0]["specs"] == []


def test_only_scores_cross_the_process_boundary(session, eager):
    """What the worker hands back for a projection is the [tokens, k] float32 scores, no activation rows."""
    seen = []
    rpc = session._backend._driver.rpc

    async def spy(method, *args):
        out = await rpc(method, *args)
        if method == "ie_collect":
            seen.append(out[0])
        return out

    session._backend._driver.rpc = spy
    try:
        D = torch.randn(16, eager.facts.d_model, generator=_g(12))
        v = session.project(TEXT, "resid_post.1", D)
    finally:
        session._backend._driver.rpc = rpc
    (res,) = seen
    assert res["points"] == {} and res["attn"] == {}
    (sc,) = res["project"].values()
    assert sc["scores"]["shape"] == list(v.scores.shape) and len(sc["scores"]["data"]) == v.scores.numel() * 4


def test_bad_inputs_refused_before_a_request(session, eager):
    d = eager.facts.d_model
    cases = [
        (dict(directions=torch.randn(3, d + 1)), "directions"),
        (dict(directions={"W_enc": torch.randn(d, 4)}, activation="topk", k=5), "k="),
        (dict(directions=torch.full((3, d), float("nan"))), "directions"),
        (dict(directions=torch.randn(3, d), activation="softplus"), "activation"),
    ]
    for kw, needle in cases:
        kw = dict(kw)
        with pytest.raises(IELabError, match=needle):
            session.project(TEXT, "resid_post.1", kw.pop("directions"), **kw)
    with pytest.raises(IELabError, match="attn_probs"):
        session.project(TEXT, "attn_probs.0", torch.randn(3, d))
    st = session.worker_state()[0]
    assert st["specs"] == [] and st["steering"] == 0
