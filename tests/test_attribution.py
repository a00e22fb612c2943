"""attn_result (each head's write through the output projection) and logit_attribution (direct logit attribution).

attn_result is checked head by head against the output projection's own forward on z with every other head zeroed
(an independent reference: the module, not the einsum), and summed over heads plus the bias against attn_out; a
neighbour (heads rolled, another layer's heads) must fail. logit_attribution's pieces must sum to the logit the model
itself computed (its own forward's logits), and one piece must equal a hand computation through the final norm at the
run's scale; a wrong freezing (the norm recomputed per piece, or another position's scale) must fail that check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ie_lab
from ie_lab import capabilities, points
from ie_lab.eager.head_results import heads_bias
from tests.conftest import assert_clean, lm_for
from tests.remote_fixtures import local_fixture, remote_fixture, server_fixture, token_fixture  # noqa: F401

TEXT = "The cat sat on the table with a dog"
TARGETS = ("dog", "cat")


def _zeroed_heads(z: torch.Tensor, h: int, n: int) -> torch.Tensor:
    zh = z.reshape(*z.shape[:-1], n, -1).clone()
    keep = torch.zeros(n, dtype=torch.bool)
    keep[h] = True
    zh[..., ~keep, :] = 0
    return zh.reshape(z.shape)


# llama (plain), gpt2 (Conv1D with a bias), qwen2, gemma2 (a post-attention norm: the sum is attn_out, not
# attn_out_post), phi (a dense with a bias, parallel block), gpt_neox_japanese (a bias the layer adds on its last layer),
# granite (a residual multiplier)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "gemma2", "phi", "gpt_neox_japanese", "granite"])
def test_attn_result_is_each_heads_write_and_sums_to_attn_out(family):
    lm = lm_for(family)
    f = lm.facts
    L = f.n_layers - 1
    c = ie_lab.capture(lm, TEXT, [f"attn_result.{L}", f"attn_result.{L}.head-1", f"z.{L}", f"attn_out.{L}"])
    r = c[f"attn_result.{L}"]
    assert r.shape == (1, c.tokens.shape[1], f.n_heads, f.d_model)
    assert torch.equal(c[f"attn_result.{L}.head-1"], r[:, :, 1])
    lb = lm.binding.layers[L]
    bias = heads_bias(lb)
    total = r.sum(-2) + (bias if bias is not None else 0)
    torch.testing.assert_close(total, c[f"attn_out.{L}"], atol=1e-5, rtol=1e-5)
    # per head: the projection's own forward on z with the other heads zeroed, less its bias
    proj_bias = getattr(lb.o_proj, "bias", None)
    with torch.no_grad():
        ref = torch.stack(
            [
                lb.o_proj(_zeroed_heads(c[f"z.{L}"], h, f.n_heads)) - (proj_bias if proj_bias is not None else 0)
                for h in range(f.n_heads)
            ],
            dim=-2,
        )
    torch.testing.assert_close(r, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(r.roll(1, dims=-2), ref, atol=1e-3)  # the heads in the wrong order fail
    other = ie_lab.capture(lm, TEXT, [f"attn_result.{L - 1}"])[f"attn_result.{L - 1}"]
    assert not torch.allclose(other.sum(-2) + (bias if bias is not None else 0), c[f"attn_out.{L}"], atol=1e-3)
    if lb.post_attn_norm is not None:  # what attention adds to the residual is the normed sum, not the sum
        post = ie_lab.capture(lm, TEXT, [f"attn_out_post.{L}"])[f"attn_out_post.{L}"]
        assert not torch.allclose(total, post, atol=1e-3)
    assert_clean(lm)


class _DoubledLinear(nn.Linear):
    """A linear that computes something else from its weight (as a quantized or adapted projection would)."""

    def forward(self, x):
        return nn.functional.linear(x, 2 * self.weight, self.bias)


def test_attn_result_is_refused_where_the_projection_is_not_a_plain_linear():
    from tests.families import make_model, make_tokenizer

    lm = ie_lab.load(make_model("llama"), make_tokenizer())
    lb = lm.binding.layers[0]
    lb.o_proj.__class__ = _DoubledLinear
    with pytest.raises(ie_lab.CapabilityUnsupported, match="_DoubledLinear, not a plain torch Linear"):
        ie_lab.capture(lm, TEXT, ["attn_result.0"])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="_DoubledLinear"):
        ie_lab.logit_attribution(lm, TEXT, "dog", by="head")
    assert_clean(lm)
    lb.o_proj.__class__ = nn.Linear
    lb.z_sub_norm = lm.binding.layers[0].input_norm  # as if a norm across heads fed the projection (BitNet)
    with pytest.raises(ie_lab.PointAbsent, match="no slice of its weight is one head's write"):
        ie_lab.capture(lm, TEXT, ["attn_result.0"])
    lb.z_sub_norm = None
    assert_clean(lm)


def test_attn_result_has_its_own_head_axis_and_vllm_refuses_it_naming_eager():
    p = points.get("attn_result")
    assert p.head_axis and not p.writable and not p.steerable
    assert points.width_of(p.width, lm_for("llama").facts) == lm_for("llama").facts.n_heads * 128
    v = p.verdict("vllm")
    assert not v.verdict.ok and "backend='eager'" in v.reason
    with pytest.raises(ie_lab.AddressError, match="has 4 heads"):
        ie_lab.capture(lm_for("llama"), TEXT, ["attn_result.0.head-4"])


def _model_logit(lm, result) -> torch.Tensor:
    """The target logit (difference) from the model's own forward, no hook placed."""
    ids = result_ids(lm)
    with torch.no_grad():
        logits = lm.hf(input_ids=ids).logits[0, result.positions].float()
    t = result.target_ids
    return logits[:, t[0]] - logits[:, t[1]] if len(t) == 2 else logits[:, t[0]]


def result_ids(lm) -> torch.Tensor:
    from ie_lab.core.inputs import prepare

    return prepare(lm, TEXT)[0]


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi", "granite", "qwen2"])
@pytest.mark.parametrize("by", ["layer", "point", "head"])
def test_the_pieces_sum_to_the_models_own_logit(family, by):
    lm = lm_for(family)
    r = ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by=by, positions=[3, -1])
    want = _model_logit(lm, r)
    torch.testing.assert_close(r.total, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r.logit, want, rtol=1e-4, atol=1e-5)
    assert r.values.shape == (len(r.labels), 2) and r.positions == [3, result_ids(lm).shape[1] - 1]
    assert r.labels[0] == "embed" and len(set(r.labels)) == len(r.labels)
    one = ie_lab.logit_attribution(lm, TEXT, TARGETS[0], by=by)  # one token: its logit, at the last position
    torch.testing.assert_close(one.total, _model_logit(lm, one), rtol=1e-4, atol=1e-5)
    assert_clean(lm)


def test_a_piece_is_the_hand_computation_through_the_frozen_layernorm_and_a_wrong_freezing_fails():
    """gpt2: centre the MLP's output, divide by the run's std of the final residual, times the gain, through
    W_U[dog] - W_U[cat]. Recomputing the norm per piece, or another position's scale, does not sum to the logit."""
    lm = lm_for("gpt2")
    b, L = lm.binding, lm.facts.n_layers - 1
    r = ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by="point")
    c = ie_lab.capture(lm, TEXT, [f"resid_post.{L}", f"mlp_out_post.{L}", "resid_pre.0", f"attn_out_post.{L}"])
    x = c[f"resid_post.{L}"][0, -1]
    ln = b.final_norm
    ids = r.target_ids
    with torch.no_grad():
        sigma = torch.sqrt(x.var(unbiased=False) + ln.eps)
        d = b.lm_head.weight[ids[0]] - b.lm_head.weight[ids[1]]
        m = c[f"mlp_out_post.{L}"][0, -1]
        hand = float(((m - m.mean()) / sigma * ln.weight) @ d)
        assert abs(float(r[f"mlp_out_post.{L}"][0]) - hand) < 1e-5
        assert abs(float(r["final_norm.bias"][0]) - float(ln.bias @ d)) < 1e-5
        want = float(_model_logit(lm, r)[0])
        pieces = _point_pieces(c, lm)
        right = sum(float(((p - p.mean()) / sigma * ln.weight) @ d) for p in pieces) + float(ln.bias @ d)
        assert abs(right - want) < 1e-4 * abs(want) + 1e-5  # the hand computation itself adds up
        # the norm applied to each piece on its own (its own scale): the pieces no longer sum to the logit
        per_piece = sum(float((ln(p) - ln.bias) @ d) for p in pieces) + float(ln.bias @ d)
        assert abs(per_piece - want) > 1e-2 * abs(want) + 1e-3
        # frozen at another position's scale
        wrong = torch.sqrt(c[f"resid_post.{L}"][0, 2].var(unbiased=False) + ln.eps)
        shifted = sum(float(((p - p.mean()) / wrong * ln.weight) @ d) for p in pieces) + float(ln.bias @ d)
        assert abs(shifted - want) > 1e-2 * abs(want) + 1e-3
    assert_clean(lm)


def _point_pieces(c, lm):
    L = lm.facts.n_layers - 1
    out = [c["resid_pre.0"][0, -1]]
    got = ie_lab.capture(lm, TEXT, [f"{n}.{i}" for i in range(L + 1) for n in ("attn_out_post", "mlp_out_post")])
    out += [got[f"{n}.{i}"][0, -1] for i in range(L + 1) for n in ("attn_out_post", "mlp_out_post")]
    return out


def test_heads_and_their_bias_add_up_to_the_attention_piece():
    lm = lm_for("gpt2")
    point = ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by="point")
    head = ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by="head")
    for L in range(lm.facts.n_layers):
        parts = [f"attn_result.{L}.head-{h}" for h in range(lm.facts.n_heads)] + [f"attn_bias.{L}"]
        total = sum(float(head[p][0]) for p in parts)
        assert abs(total - float(point[f"attn_out_post.{L}"][0])) < 1e-5
    assert abs(float(head["attn_result.1.head-0"][0]) - float(head["attn_result.1.head-1"][0])) > 1e-6


def test_a_soft_capped_family_attributes_the_logit_before_the_cap_and_says_so():
    lm = lm_for("gemma2")
    r = ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by="point")
    torch.testing.assert_close(r.total, r.logit, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r.capped, _model_logit(lm, r), rtol=1e-4, atol=1e-5)  # the model's own, capped
    assert "soft-caps" in r.note and "before the cap" in repr(r)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="post-attention norm"):
        ie_lab.logit_attribution(lm, TEXT, list(TARGETS), by="head")
    assert_clean(lm)


def test_bad_arguments_are_refused_naming_the_fix():
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match="by must be one of"):
        ie_lab.logit_attribution(lm, TEXT, "dog", by="neuron")
    with pytest.raises(ie_lab.InputError, match="one token .* or a pair"):
        ie_lab.logit_attribution(lm, TEXT, ["dog", "cat", "sat"])
    with pytest.raises(ie_lab.InputError, match="2 tokens"):
        ie_lab.logit_attribution(lm, TEXT, "dog cat")
    with pytest.raises(ie_lab.InputError, match="outside the vocabulary"):
        ie_lab.logit_attribution(lm, TEXT, 10**6)
    with pytest.raises(ie_lab.InputError, match="twice"):
        ie_lab.logit_attribution(lm, TEXT, ["dog", "dog"])
    with pytest.raises(ie_lab.InputError, match="one prompt"):
        ie_lab.logit_attribution(lm, [TEXT, TEXT], "dog")
    with pytest.raises(ie_lab.InputError, match="outside the"):
        ie_lab.logit_attribution(lm, TEXT, "dog", positions=[99])
    with pytest.raises(ie_lab.InputError, match="did you mean 'positions'"):
        ie_lab.logit_attribution(lm, TEXT, "dog", position=3)
    assert_clean(lm)


def test_the_session_method_refuses_inside_a_steering_block_and_vllm_refuses_by_name(session):
    r = session.logit_attribution("The cat sat", "cat", by="head")
    assert r.by == "head" and "attn_result.0.head-0" in r.labels and "LogitAttribution(" in repr(r)
    fig = r.plot()
    assert fig.data and "Direct logit attribution" in fig.layout.title.text
    assert session.logit_attribution("The cat sat", "cat").plot().data[0].type == "bar"
    v = torch.ones(session.facts.d_model)
    with session.steer("resid_post.0", v, scale=4.0):
        with pytest.raises(ie_lab.CapabilityUnsupported, match="steering"):
            session.logit_attribution("The cat sat", "cat")
    with pytest.raises(ie_lab.CapabilityUnsupported, match="backend='vllm'.*backend='eager'"):
        capabilities.require("direct logit attribution", "vllm")


def test_a_remote_session_serves_it_as_the_local_one_computes_it(remote, local):
    want = local.logit_attribution("The capital of France is", [5, 7], by="point", positions=[-2, -1])
    got = remote.logit_attribution("The capital of France is", [5, 7], by="point", positions=[-2, -1])
    assert got.labels == want.labels and got.positions == want.positions
    torch.testing.assert_close(got.values, want.values)
    with pytest.raises(ie_lab.InputError, match="by must be one of"):
        remote.logit_attribution("The capital", 5, by="neuron")


def test_vllm_refuses_both_naming_the_eager_backend(tmp_path):
    pytest.importorskip("vllm")
    from tests.vllm_helpers import vllm_session

    with vllm_session("llama", tmp_path) as s:
        with pytest.raises(ie_lab.CapabilityUnsupported, match="backend='eager'"):
            s.capture("The cat sat", "attn_result.0")
        with pytest.raises(ie_lab.CapabilityUnsupported, match="on backend='vllm'.*Instead: use backend='eager'"):
            s.logit_attribution("The cat sat", 5)
        row = next(r for r in s.points().rows if r.name == "attn_result")
        assert not row.served and "backend='eager'" in row.reason


@pytest.mark.parametrize(
    "model_type,refusal",
    [
        ("minimax", "adds each sublayer's output to its input norm's output"),
        ("rwkv", "normalises the stream itself"),
        ("falcon_h1", None),  # a Mamba mixer beside attention on every layer: both are pieces
        ("zamba2", None),  # mixer layers and a shared attention block joining their input
        ("diffllama", None),  # two kernel calls per layer: z is still what the projection reads per head
    ],
)
def test_hybrid_and_unusual_trunks_sum_or_refuse_naming_why(model_type, refusal):
    from ie_lab import coverage
    from ie_lab.toy import tokenizer

    lm = ie_lab.load(coverage.build_tiny(model_type), tokenizer())
    ids = torch.randint(5, 200, (1, 7), generator=torch.Generator().manual_seed(0))
    for by in ("point", "head"):
        if refusal is not None:
            with pytest.raises(ie_lab.CapabilityUnsupported, match=refusal):
                ie_lab.logit_attribution(lm, ids, [5, 7], by=by)
            continue
        r = ie_lab.logit_attribution(lm, ids, [5, 7], by=by)
        with torch.no_grad():
            logits = lm.hf(input_ids=ids, use_cache=False).logits[0, -1].float()
        torch.testing.assert_close(r.total[0], logits[5] - logits[7], rtol=1e-4, atol=1e-5)
    assert_clean(lm)
