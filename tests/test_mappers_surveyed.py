"""ie_lab.mappers on the families the validator's surveyed sweep found giving other engines names that hold other
tensors (validator/README.md): each such name is refused, saying why, or mapped to the point it really holds."""

from __future__ import annotations

from functools import cache

import pytest
import torch

import ie_lab
from ie_lab import Address, AddressError, coverage
from ie_lab.mappers import from_engine, to_engine


@cache
def _lm(model_type: str):
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny(model_type), coverage._tokenizer(), quiet=True)


def _attn_layer(lm) -> int:
    return next(lb.index for lb in lm.binding.layers if not lb.mixer_kind)


@pytest.mark.parametrize(
    "family,point,engine,fragment",
    [
        ("mpt", "mlp_out", "transformerlens_bridge", "adds the residual"),
        ("bitnet", "z", "transformerlens", "attn_sub_norm"),
        ("bitnet", "z", "transformerlens_bridge", "attn_sub_norm"),
        ("dbrx", "attn_in", "nnterp", "norm_attn_norm wrapper"),
        ("dbrx", "attn_out", "nnterp", "norm_attn_norm wrapper"),
        ("granitemoeshared", "mlp_out", "nnterp", "shared MLP beside its MoE block"),
        ("granitemoe_swa", "mlp_out", "transformerlens_bridge", "shared MLP beside its MoE block"),
        ("granitemoehybrid", "mlp_out_post", "nnterp", "shared MLP beside its MoE block"),
        ("mpt", "mlp_out_post", "transformerlens_bridge", "adds the residual"),
        ("mpt", "mlp_out", "nnterp", "adds the residual"),
        ("nanochat", "q_norm_in", "transformerlens", "after RoPE"),
        ("nanochat", "k_norm_in", "transformerlens", "after RoPE"),
        ("qwen3_next", "q_norm_in", "transformerlens", "query and output gate"),
        ("qwen3_5_text", "q_norm_in", "transformerlens", "query and output gate"),
        ("gemma4_unified_text", "value", "transformerlens", "v_norm"),
        ("gemma4_unified_text", "value", "transformerlens_bridge", "v_norm"),
        ("olmo_hybrid", "attn_out", "transformerlens", "other tensors"),
        ("olmo_hybrid", "attn_out_post", "transformerlens_bridge", "other tensors"),
        ("olmo_hybrid", "mlp_out", "transformerlens", "other tensors"),
        ("olmo_hybrid", "mlp_out_post", "transformerlens_bridge", "other tensors"),
    ],
)
def test_surveyed_findings_are_refused(family, point, engine, fragment):
    lm = _lm(family)
    with pytest.raises(AddressError, match=fragment):
        to_engine(f"{point}.{_attn_layer(lm)}", lm, engine)


@pytest.mark.parametrize(
    "family,name,engine,fragment",
    [
        ("nanochat", "blocks.{L}.attn.hook_q", "transformerlens", "before RoPE"),
        ("qwen3_next", "blocks.{L}.attn.hook_q", "transformerlens", "query and output gate"),
        ("qwen3_next", "blocks.{L}.attn.q.hook_out", "transformerlens_bridge", "query and output gate"),
        ("gemma4_unified_text", "blocks.{L}.attn.hook_v", "transformerlens", "v_norm"),
        ("gemma4_unified_text", "blocks.{L}.attn.v.hook_out", "transformerlens_bridge", "v_norm"),
        ("olmo_hybrid", "blocks.{L}.hook_attn_out", "transformerlens", "another tensor"),
        ("bitnet", "blocks.{L}.attn.hook_z", "transformerlens", "attn_sub_norm"),
        ("dbrx", "attentions_output[{L}]", "nnterp", "norm_attn_norm wrapper"),
        ("granitemoeshared", "mlps_output[{L}]", "nnterp", "shared MLP beside it"),
        ("olmo_hybrid", "blocks.{L}.mlp.hook_out", "transformerlens_bridge", "another tensor"),
    ],
)
def test_their_names_are_refused_back(family, name, engine, fragment):
    lm = _lm(family)
    with pytest.raises(AddressError, match=fragment):
        from_engine(name.replace("{L}", str(_attn_layer(lm))), lm, engine)


def test_mpt_mlp_module_output_is_resid_post():
    """MPT's MLP module returns MLP + residual: its names map to resid_post, which that module's output equals
    (read with a plain hook); mlp_out (the contribution alone) does not."""
    lm = _lm("mpt")
    assert from_engine("blocks.1.mlp.hook_out", lm, "transformerlens_bridge") == Address("resid_post", 1)
    assert from_engine("mlps_output[0]", lm, "nnterp") == Address("resid_post", 0)
    assert to_engine("mlp_out.1", lm, "transformerlens") == "blocks.1.hook_mlp_out"  # the legacy name is right
    x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
    seen = {}
    mlp = lm.hf.transformer.blocks[1].ffn
    h = mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.detach().clone()))
    try:
        c = ie_lab.capture(lm, x, ["resid_post.1", "mlp_out.1"])
    finally:
        h.remove()
    torch.testing.assert_close(seen["out"], c["resid_post.1"], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(seen["out"], c["mlp_out.1"], atol=2e-4, rtol=1e-4)


def test_names_that_stay_faithful_still_translate():
    assert to_engine("q_norm_in.1", _lm("qwen3_next"), "transformerlens_bridge") == "blocks.1.attn.q_norm.hook_in"
    assert to_engine("k_norm_in.1", _lm("qwen3_next"), "transformerlens") == "blocks.1.attn.hook_k"
    assert to_engine("attn_out.0", _lm("mpt"), "transformerlens_bridge") == "blocks.0.attn.hook_out"
