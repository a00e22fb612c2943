"""intervene= on an attribution graph's features, and transcoder splicing (docs/CIRCUITS.md, "Interventions"), on the
demo model with its shipped transcoders: an empty intervention and a clamp to a feature's own activation are the
plain run; an ablation moves its layer's MLP output by exactly -act x W_dec[f], at the node's position only (every
position for a (layer, feature) pair), and a neighbouring feature or position fails that check; the graph's edge
into the top logit predicts the ablation's effect on it; bad input is refused naming the fix; no hook is left."""

from __future__ import annotations

import math

import pytest
import torch

import ie_lab
from ie_lab.capabilities import TRANSCODER_SPLICING, require
from ie_lab.core import transcoder_splice
from ie_lab.core.graph import Node
from tests.conftest import assert_clean, lm_for
from tests.transcoder_files import write_transcoders

PROMPT = "One Monday , Mary went to the park . Mary felt sad and"


@pytest.fixture(scope="module")
def demo():
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
    g = ie_lab.attribution_graph(s, PROMPT, tcs, batch_size=128, max_features=60)
    yield s, tcs, g
    s.close()


def _strongest(g):
    """The feature with the largest edge into the top logit: at the last layer and position, so no feature is
    downstream of it."""
    top = g.of_kind("logit")[0]
    into = g.edges_into(top)
    f = max((n for n in into if n.kind == "feature"), key=lambda n: abs(into[n]))
    return top, f, into


def test_no_intervention_and_a_clamp_to_its_own_value_are_the_plain_run(demo):
    s, tcs, g = demo
    _, f, _ = _strongest(g)
    pts = [f"mlp_out.{f.layer}", "resid_post.3"]
    plain = s.capture(PROMPT, pts)
    for iv in ({}, {f: f.activation}):
        got = s.capture(PROMPT, pts, intervene=iv)
        for p in pts:
            assert torch.equal(got[p], plain[p]), (iv, p)
    a = s.generate(PROMPT, 6)
    b = s.generate(PROMPT, 6, intervene={f: f.activation})
    assert b.text == a.text and torch.equal(b.steps[0].logits, a.steps[0].logits)
    assert_clean(s._lm)


def test_ablating_a_node_moves_its_mlp_output_by_its_decoder_row_at_its_position_only(demo):
    s, tcs, g = demo
    _, f, _ = _strongest(g)
    L, p, W = f.layer, f.position, tcs[f.layer].W_dec
    pt = f"mlp_out.{L}"
    plain = s.capture(PROMPT, [pt, f"mlp_in.{L}"])
    moved = (s.capture(PROMPT, [pt], intervene={f: 0.0})[pt] - plain[pt])[0]
    expected = -f.activation * W[f.index]
    assert torch.allclose(moved[p], expected, atol=1e-4 * float(expected.norm()))
    assert bool((moved[:p] == 0).all()) and bool((moved[p + 1 :] == 0).all())
    # on a continuation of the graph's prompt the node is clamped at its position only: layer L's MLP output at the
    # later positions reads nothing of layer L's MLP at p (attention L runs before it), so it does not move at all
    longer = PROMPT + " lonely . Mary cried"
    cont = (s.capture(longer, [pt], intervene={f: 0.0})[pt] - s.capture(longer, [pt])[pt])[0]
    assert cont.shape[0] > p + 1 and bool((cont[p + 1 :] == 0).all()) and bool((cont[:p] == 0).all())
    assert torch.allclose(cont[p], expected, atol=1e-4 * float(expected.norm()))
    # a neighbouring feature's row, or the same row at the neighbouring position, fails the same check
    assert not torch.allclose(moved[p], -f.activation * W[f.index + 1], atol=1e-4 * float(expected.norm()))
    assert not torch.allclose(moved[p - 1], expected, atol=1e-4 * float(expected.norm()))
    # a (layer, feature) pair clamps every position: each moves by its own activation there
    acts = tcs[L].encode(plain[f"mlp_in.{L}"][0])[:, f.index]
    assert int((acts > 0).sum()) >= 1
    everywhere = s.capture(PROMPT, [pt], splice=s.splice(tcs[L], error=True).ablate(f.index))[pt]
    assert torch.allclose((everywhere - plain[pt])[0], -acts[:, None] * W[f.index], atol=1e-3)
    pair = s.capture(PROMPT, [pt], intervene={(L, f.index): 0.0}, splice=s.splice(tcs, error=True))[pt]
    assert torch.allclose(pair, everywhere, atol=1e-5)
    # clamping to a value moves by (value - act) x W_dec[f]
    up = (s.capture(PROMPT, [pt], intervene={f: f.activation + 2.0})[pt] - plain[pt])[0, p]
    assert torch.allclose(up, 2.0 * W[f.index], atol=1e-4)
    # without the error term the MLP output is the transcoder's reconstruction
    rec = s.capture(PROMPT, [pt], splice=s.splice(tcs[L]))[pt][0]
    assert torch.allclose(rec, tcs[L].decode(tcs[L].encode(plain[f"mlp_in.{L}"][0])), atol=1e-4)
    assert_clean(s._lm)


def test_the_graphs_edge_predicts_the_ablations_effect_on_the_logit(demo):
    s, tcs, g = demo
    top, f, into = _strongest(g)
    assert f.layer == 3 and not any(n.kind == "feature" for n in g.edges_from(f))  # nothing downstream

    def demeaned(r):
        lg = r.steps[0].logits.float()
        return float(lg[top.index] - lg.mean())

    effect = demeaned(s.generate(PROMPT, 1, intervene={f: 0.0})) - demeaned(s.generate(PROMPT, 1))
    edge = into[f]
    # The edge is the linear effect with the final norm's scale frozen; the ablation also changes that scale (the
    # feature's write is a large part of the last residual: |act x W_dec[f]| ~ 100 here), which rescales every
    # other write into the logit. On this prompt that moves the effect by about 7 % of the edge; 25 % allows for it
    # while a neighbouring feature's edge (a few % of this one's) is far outside.
    assert math.copysign(1, effect) == -math.copysign(1, edge)
    assert abs(effect + edge) <= 0.25 * abs(edge), (effect, edge)
    other = max((n for n in into if n.kind == "feature" and n != f), key=lambda n: abs(into[n]))
    assert abs(effect + into[other]) > 0.25 * abs(edge)
    # and the answer changes: the top token loses its place, in a generation and in its stream alike
    ablated = s.generate(PROMPT, 3, intervene={f: 0.0})
    assert ablated.steps[0].token_id != top.index
    assert [st.token_id for st in s.generate_stream(PROMPT, 3, intervene={f: 0.0})] == ablated.ids


def test_bad_interventions_are_refused_naming_the_fix(demo, tmp_path):
    s, tcs, g = demo
    _, f, _ = _strongest(g)
    err = g.node("error", f.layer, f.position)
    cases = [
        ({err: 0.0}, "not a feature"),
        ({f: float("nan")}, "not finite"),
        ({f: float("inf")}, "not finite"),
        ({f: "0"}, "not a number"),
        ({Node("feature", f.layer, f.position, f.index): 0.0}, "carries no model"),
        ({f: 0.0, (f.layer, 10_000): 0.0}, "d_sae"),
        ({(7, 1): 0.0}, "no transcoder this call knows"),
        ({"L3.144": 0.0}, "neither a graph's feature node"),
    ]
    for iv, match in cases:
        with pytest.raises(ie_lab.InputError, match=match):
            s.capture(PROMPT, ["mlp_out.0"], intervene=iv)
    with pytest.raises(ie_lab.InputError, match="takes a dict"):
        s.generate(PROMPT, 2, intervene=[f])
    with pytest.raises(ie_lab.InputError, match="d_sae"):
        s.capture(PROMPT, ["mlp_out.0"], intervene={(f.layer, 10_000): 0.0}, splice=s.splice(tcs, error=True))
    # a node of another prompt's graph: its position names another token here
    other = ie_lab.attribution_graph(s, "Then , Ella and Lena had a long day", tcs, max_features=5)
    with pytest.raises(ie_lab.InputError, match="does not begin with that prompt"):
        s.generate(PROMPT, 2, intervene={other.of_kind("feature")[0]: 0.0})
    # a node of another model's graph
    lm = lm_for("llama")
    root = write_transcoders(str(tmp_path), lm.facts.d_model, list(range(lm.facts.n_layers)))
    foreign = ie_lab.attribution_graph(lm, "the cat sat", ie_lab.load_transcoders(root, lm))
    with pytest.raises(ie_lab.InputError, match="another model"):
        s.capture(PROMPT, ["mlp_out.0"], intervene={foreign.of_kind("feature")[0]: 0.0})
    with pytest.raises(ie_lab.InputError, match="feature index or a .layer, feature. pair"):
        s.splice(tcs[1]).clamp("a", 1.0)
    with pytest.raises(ie_lab.InputError, match="two transcoders for one layer"):
        s.splice([tcs[1], tcs[1]])
    assert_clean(s._lm)
    assert_clean(lm)


def test_no_hook_is_left_after_a_failure_inside_the_forward(demo, monkeypatch):
    s, tcs, g = demo
    _, f, _ = _strongest(g)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(transcoder_splice, "splice_rows", boom)
    with pytest.raises(RuntimeError, match="boom"):
        s.capture(PROMPT, ["mlp_out.0"], intervene={f: 0.0})
    with pytest.raises(RuntimeError, match="boom"):
        s.generate(PROMPT, 3, intervene={f: 0.0})
    assert_clean(s._lm)


def test_a_remote_session_refuses_naming_where_to_intervene():
    require(TRANSCODER_SPLICING, "eager")
    require(TRANSCODER_SPLICING, "vllm")  # the worker splices transcoders (tests/test_vllm_transcoders.py)
    from ie_lab.core import calls
    from ie_lab.session.operations import _Operations

    class Remote:  # what a remote Session's backend offers: no splice (its server may well be eager)
        name = "remote"

        def require(self, capability):
            require(capability, "eager")

    class Door(_Operations):
        _backend = Remote()

        def _bos(self, prepend_bos):
            return None

    with pytest.raises(ie_lab.CapabilityUnsupported, match="transcoder splicing.*remote Session.*weights"):
        Door()._door(calls.Generate, (PROMPT,), {"intervene": {(0, 1): 0.0}})
    from ie_lab.remote.ops import OPS, ArgError

    for op in ("capture", "generate", "generate_stream"):
        with pytest.raises(ArgError, match="unknown argument 'intervene'"):
            OPS[op].bind([PROMPT, ["resid_post.0"]] if op == "capture" else [PROMPT], {"intervene": {"x": 0}})
