"""Families bound through structures measured inside wrappers (issue 20 item 2): DBRX keeps its input norm,
attention, residual add and pre-MLP norm in one norm_attn_norm module; CTRL calls its attention as (x, x, x) and
builds its MLP as an nn.Sequential. Every invariant runs on each (coverage.check_invariants), the config-only answers
equal the measured ones, every registry point is served or refused as the registry says, and each newly bound
boundary is checked against a shape-correct neighbour tensor, which must fail.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage
from tests import test_arch_facts, test_mappers, test_points_registry
from tests.conftest import assert_clean, lm_for
from tests.families import WRAPPED_FAMILIES, make_tokenizer

TOL = dict(atol=2e-4, rtol=1e-4)
A = "When Mary and John went to the store"
B = "The capital of France is Paris and the"  # as many words as A: the same token count


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("family", WRAPPED_FAMILIES)
def test_every_invariant_holds(family):
    coverage.check_invariants(lm_for(family))
    assert_clean(lm_for(family))


@pytest.mark.parametrize("family", WRAPPED_FAMILIES)
def test_the_config_answers_what_the_binder_measures(family):
    """The all-family sweeps of the config-only structure, the registry and the engine-name mappers, on these."""
    test_arch_facts.test_config_structure_agrees_with_the_binder(family)
    test_points_registry.test_a_point_resolves_on_eager_iff_the_registry_finds_nothing_missing(family)
    test_points_registry.test_the_config_says_what_the_binder_measures(family)
    test_mappers.test_family_name_and_config_translate_as_the_live_model_does(family)
    test_mappers.test_attention_in_module_quirk_matches_the_binder(family)


def test_dbrx_norms_inside_the_wrapper_are_measured():
    """norm_1 (inside norm_attn_norm) is the input norm, norm_2 the pre-MLP norm: resid_mid is norm_2's input, the
    sum norm_attn_norm forms itself. norm_2's output (the MLP input, same shape) is not resid_mid, and the other
    layer's attention output does not complete the residual identity."""
    lm = lm_for("dbrx")
    wrap = lm.hf.transformer.blocks[0].norm_attn_norm
    lb = lm.binding.layers[0]
    assert lb.wrapper is wrap and lb.input_norm is wrap.norm_1 and lb.pre_mlp_norm is wrap.norm_2
    assert lb.names["attn"] == "norm_attn_norm.attn"
    names = ["resid_pre.0", "attn_in.0", "attn_out_post.0", "attn_out_post.1", "resid_mid.0", "mlp_in.0"]
    c = ie_lab.capture(lm, A, names)
    with torch.no_grad():
        torch.testing.assert_close(c["attn_in.0"], wrap.norm_1(c["resid_pre.0"]), **TOL)
        torch.testing.assert_close(c["mlp_in.0"], wrap.norm_2(c["resid_mid.0"]), **TOL)
    torch.testing.assert_close(c["resid_pre.0"] + c["attn_out_post.0"], c["resid_mid.0"], **TOL)
    assert c["mlp_in.0"].shape == c["resid_mid.0"].shape
    assert not torch.allclose(c["mlp_in.0"], c["resid_mid.0"], **TOL)
    assert not torch.allclose(c["resid_pre.0"] + c["attn_out_post.1"], c["resid_mid.0"], **TOL)


def test_dbrx_written_resid_mid_flows_on_the_residual_and_into_the_mlp():
    """norm_attn_norm hands the residual on beside norm_2's output: a resid_mid written at norm_2's input alone
    would reach the MLP and not the residual. Written through the attention output, both see it."""
    lm = lm_for("dbrx")
    other = ie_lab.capture(lm, B, ["resid_mid.0"])["resid_mid.0"]
    logits = ie_lab.run_with_patches(lm, A, {"resid_mid.0": other})
    with torch.no_grad():
        ref = ie_lab.run_with_patches(lm, B, {})
    torch.testing.assert_close(logits[:, 1:], ref[:, 1:], **TOL)  # layer 1 sees B's residual at every position
    assert_clean(lm)


def test_ctrl_attention_input_written_reaches_queries_keys_and_values():
    """CTRL calls its attention with the normed residual three times (v, k, q): writing attn_in must replace all
    three, so attn_in from B gives exactly B's attention output (patching attn_out with B's). Replacing the value
    alone (the first argument, what a writer used to replace) gives another output."""
    lm = lm_for("ctrl")
    assert lm.binding.layers[0].names["attn"] == "multi_head_attention"
    b = ie_lab.capture(lm, B, ["attn_in.0", "attn_out.0"])
    via_in = ie_lab.run_with_patches(lm, A, {"attn_in.0": b["attn_in.0"]})
    via_out = ie_lab.run_with_patches(lm, A, {"attn_out.0": b["attn_out.0"]})
    torch.testing.assert_close(via_in, via_out, **TOL)
    attn = lm.hf.transformer.h[0].multi_head_attention

    def value_only(mod, args, kwargs):
        return (b["attn_in.0"], *args[1:]), kwargs

    h = attn.register_forward_pre_hook(value_only, with_kwargs=True)
    try:
        with torch.no_grad():
            ids = make_tokenizer()(A, return_tensors="pt").input_ids
            wrong = lm.hf(input_ids=ids).logits
    finally:
        h.remove()
    assert wrong.shape == via_in.shape
    assert not torch.allclose(wrong, via_in, **TOL)
    assert_clean(lm)


def test_ctrl_sequential_mlp_is_up_activation_down():
    """The Sequential's first linear is the up projection, its last the down projection: mlp_act is the down
    projection's input (relu of mlp_pre), and the up projection's output is not (its negative entries survive)."""
    lm = lm_for("ctrl")
    ffn = lm.hf.transformer.h[1].ffn
    lb = lm.binding.layers[1]
    assert (lb.up_proj, lb.down_proj, lb.gate_proj) == (ffn[0], ffn[2], None)
    c = ie_lab.capture(lm, A, ["mlp_pre.1", "mlp_act.1", "mlp_out.1"])
    torch.testing.assert_close(c["mlp_act.1"], torch.relu(c["mlp_pre.1"]), **TOL)
    assert not torch.allclose(c["mlp_pre.1"], c["mlp_act.1"], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(ffn[2](c["mlp_act.1"]), c["mlp_out.1"], **TOL)


def test_gpt_neox_japanese_returned_output_bias_is_part_of_attn_out():
    """GPT-NeoX-Japanese's last attention returns dense_bias beside its output and the layer adds it before the
    residual add (skip-bias-add): measured, attn_out is the projection's output plus it. The projection's output
    alone (same shape) does not complete the residual identity, and writing attn_out, attn_out_post or resid_mid with
    their own values leaves the logits as they were (a writer that forgot the bias would add it twice)."""
    lm = ie_lab.load(coverage.build_tiny("gpt_neox_japanese"), coverage._tokenizer(), quiet=True)
    attn = lm.hf.gpt_neox_japanese.layers[1].attention
    assert [lb.o_bias for lb in lm.binding.layers] == [None, attn.dense_bias]
    coverage.check_invariants(lm)
    x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
    names = ["resid_pre.1", "attn_out.1", "attn_out_post.1", "resid_mid.1"]
    c = ie_lab.capture(lm, x, names)
    with torch.no_grad():
        dense = attn.dense(ie_lab.capture(lm, x, ["z.1"])["z.1"])
        torch.testing.assert_close(c["attn_out.1"], dense + attn.dense_bias, **TOL)
        logits = lm.hf(input_ids=x).logits
    torch.testing.assert_close(c["resid_pre.1"] + c["attn_out_post.1"], c["resid_mid.1"], **TOL)
    assert not torch.allclose(c["resid_pre.1"] + dense, c["resid_mid.1"], **TOL)
    for name in ("attn_out.1", "attn_out_post.1", "resid_mid.1"):
        torch.testing.assert_close(ie_lab.run_with_patches(lm, x, {name: c[name]}), logits, **TOL)
    assert_clean(lm)
