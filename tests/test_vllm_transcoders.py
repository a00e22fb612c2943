"""Transcoder splicing and intervene= on vLLM (issue 32 item 6; docs/CIRCUITS.md, "Interventions"): the worker
encodes a transcoder's features from the rows mlp_in.L handed the MLP and writes (value - act) x W_dec[f] at
mlp_out.L, so intervened captures, generations (prompt and generated positions) and streams equal eager's run of
the same checkpoint; the clamp changes the run (a no-op fails), a graph node's ablation moves its position's
mlp_out by -act x W_dec[f] and no other position; a prompt chunked over several forwards (an 8-token budget) and a
plain request batched beside an intervened one change nothing of that. One engine for the module, on the tiny
Llama, with random JumpReLU transcoders written for the test."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402
from tests.transcoder_files import write_circuit_tracer, write_transcoders  # noqa: E402
from tests.vllm_helpers import TEXT, close, eager_for, vllm_session  # noqa: E402

CHUNKED = {"max_num_batched_tokens": 8, "enable_chunked_prefill": True}  # the prompt runs in several forwards


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tc")
    path = saved_model_dir("llama", root)
    torch.set_num_threads(1)
    e = ie_lab.Session(path, device="cpu", progress=False)
    tdir = write_transcoders(str(root / "tc"), e.facts.d_model, list(range(e.facts.n_layers)), n=32)
    te = ie_lab.load_transcoders(tdir, e)
    g = ie_lab.attribution_graph(e, TEXT, te, max_features=40)
    with vllm_session("llama", root, engine_kwargs=CHUNKED) as v:
        yield v, e, ie_lab.load_transcoders(tdir, v), te, g
    e.close()


def _node(g, tv):
    """A layer-0 feature node past the first chunk, with a sizeable write (so its ablation moves mlp_out.0)."""
    feats = [n for n in g.of_kind("feature") if n.layer == 0 and n.position >= 8]
    return max(feats, key=lambda n: n.activation * float(tv[0].W_dec[n.index].norm()))


def test_a_nodes_ablation_equals_eager_and_moves_its_position_only(setup):
    v, e, tv, te, g = setup
    f = _node(g, tv)
    p, W = f.position, tv[0].W_dec
    pts = ["mlp_out.0", "mlp_out.1", "resid_post.1"]
    plain = v.capture(TEXT, [*pts, "mlp_in.0"])
    got = v.capture(TEXT, pts, intervene={f: 0.0})
    want = e.capture(TEXT, pts, intervene={f: 0.0})
    for a in pts:
        assert close(got[a], want[a]), a
    moved = (got["mlp_out.0"] - plain["mlp_out.0"])[0]
    expected = -f.activation * W[f.index]
    assert float(expected.norm()) > 0.1
    assert torch.allclose(moved[p], expected, atol=1e-4 * float(expected.norm()))
    others = torch.cat([moved[:p], moved[p + 1 :]])
    assert float(others.abs().max()) == 0.0  # no other position's mlp_out moves
    assert not torch.allclose(moved[p], -f.activation * W[f.index + 1], atol=1e-2)  # the neighbouring feature's row
    assert not close(got["resid_post.1"], plain["resid_post.1"], atol=1e-3)  # later layers react
    # a clamp to its own activation, and a splice with the error term and no clamp, are the plain run
    own = v.capture(TEXT, pts, intervene={f: f.activation})
    kept = v.capture(TEXT, pts, splice=v.splice(tv, error=True))
    for a in pts:
        assert close(own[a], plain[a], atol=1e-5) and torch.equal(kept[a], plain[a]), a
    # without the error term the MLP's output is the transcoders' reconstruction, as on eager
    rec = v.capture(TEXT, ["mlp_out.0", "resid_post.1"], splice=v.splice(tv[0]))
    ref = e.capture(TEXT, ["mlp_out.0", "resid_post.1"], splice=e.splice(te[0]))
    assert close(rec["mlp_out.0"], ref["mlp_out.0"]) and close(rec["resid_post.1"], ref["resid_post.1"])
    assert close(rec["mlp_out.0"][0], te[0].decode(te[0].encode(plain["mlp_in.0"][0])), atol=1e-3)


def test_pair_clamps_in_generation_and_stream_equal_eager(setup):
    v, e, tv, te, g = setup
    f = _node(g, tv)
    iv = {(0, f.index): 6.0, (1, 3): 4.0}  # every position, prompt and generated
    caps = ["mlp_out.0", "mlp_out.1"]
    got = v.generate(TEXT, 8, intervene=iv, splice=v.splice(tv, error=True), capture=caps)
    want = e.generate(TEXT, 8, intervene=iv, splice=e.splice(te, error=True), capture=caps)
    assert got.ids == want.ids
    for a in caps:
        assert close(got.cache[a], want.cache[a]), a
    plain = v.generate(TEXT, 8, capture=caps)
    assert got.ids != plain.ids  # the clamp acts
    n = got.prompt_ids.shape[-1]
    grown = (got.cache["mlp_out.0"] - plain.cache["mlp_out.0"])[0, n:]  # generated positions are clamped too
    assert grown.shape[0] > 0 and bool((grown.norm(dim=-1) > 0).all())
    assert [st.token_id for st in v.generate_stream(TEXT, 8, intervene=iv, splice=v.splice(tv, error=True))] == got.ids
    # a node clamps the prompt's forward only; the generation then reads the changed states through the cache
    nf = v.generate(TEXT, 6, intervene={f: 8.0})
    assert nf.ids == e.generate(TEXT, 6, intervene={f: 8.0}).ids

    async def both():  # an intervened request and a plain one in the same forwards: each as alone
        return await asyncio.gather(
            v.agenerate(TEXT, 8, intervene=iv, splice=v.splice(tv, error=True)), v.agenerate(TEXT, 8)
        )

    a, b = asyncio.run(both())
    assert a.ids == got.ids and b.ids == plain.ids
    state = v.worker_state()[0]
    assert state["specs"] == [] and state["steering"] == 0


def test_refusals_name_the_fix(setup, tmp_path):
    v, e, tv, te, g = setup
    other = eager_for("llama")  # a model object (the same weights, but nothing says it is this checkpoint)
    tdir = write_transcoders(str(tmp_path), other.facts.d_model, [0])
    foreign = ie_lab.attribution_graph(other, "the cat sat", ie_lab.load_transcoders(tdir, other), max_features=5)
    with pytest.raises(ie_lab.InputError, match="another model.*same checkpoint"):
        v.capture(TEXT, ["mlp_out.0"], intervene={foreign.of_kind("feature")[0]: 0.0})
    with pytest.raises(ie_lab.InputError, match="does not begin with that prompt"):
        v.capture("the dog ran", ["mlp_out.0"], intervene={_node(g, tv): 0.0})
    with pytest.raises(ie_lab.InputError, match="no transcoder this call knows"):
        v.capture(TEXT, ["mlp_out.0"], intervene={(0, 1): 0.0})
    # what the worker cannot pair or encode is refused before a request is built, naming eager
    wide = dataclasses.replace(tv[0], W_dec=tv[0].W_dec[:, None, :].expand(-1, 2, -1))  # one that writes two layers
    with pytest.raises(ie_lab.CapabilityUnsupported, match="cross-layer.*backend='eager'"):
        v.splice(wide, error=True)
    # real cross-layer and skip transcoders in circuit-tracer's files, loaded as users load them: the worker would
    # leave out a CLT feature's writes into later layers, and a skip transcoder's x @ W_skip without the error term
    d = tv[0].W_dec.shape[1]
    clt = ie_lab.load_transcoders(write_circuit_tracer(str(tmp_path / "clt"), d, 2), v)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="cross-layer.*backend='eager'"):
        v.splice(clt, error=True)
    skip = ie_lab.load_transcoders(write_circuit_tracer(str(tmp_path / "skip"), d, 2, clt=False, skip=True), v)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="skip transcoder.*error=False.*error=True"):
        v.splice(skip, error=False)
    v.splice(skip, error=True)  # the skip path cancels with the error term kept: served (no refusal)
    odd = dataclasses.replace(tv[0], activation="gelu", threshold=None)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="activation 'gelu'.*backend='eager'"):
        v.splice(odd)
    assert v.worker_state()[0]["specs"] == []
