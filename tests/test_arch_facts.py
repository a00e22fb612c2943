"""Config arithmetic (no torch) against what the binder measures on the live model."""

import ast
import os

import pytest

import ie_lab
from ie_lab.arch.config_facts import ArchFacts
from tests.conftest import SUPPORTED, UNSUPPORTED, lm_for
from tests.families import make_config, make_model


def test_config_facts_module_imports_no_torch():
    for rel in ("ie_lab/arch/config_facts.py", "ie_lab/arch/quirks.py", "ie_lab/points.py", "ie_lab/address.py"):
        tree = ast.parse(open(os.path.join(os.path.dirname(__file__), "..", rel)).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "torch" for n in names), rel


@pytest.mark.parametrize("family", SUPPORTED)
def test_config_structure_agrees_with_the_binder(family):
    f = ArchFacts.from_config(make_config(family))
    lm = lm_for(family)
    measured = lm.binding.structure
    from_config = {
        "parallel_block": f.parallel_block,
        "sandwich_norms": f.sandwich_norms,
        "pre_norms": f.pre_norms,
        "gated_mlp": f.gated_mlp if len(f.moe_layers) < f.n_layers else None,
        "qk_norm": f.qk_norm,
        "moe_layers": f.moe_layers,
    }
    assert from_config == measured
    # Dimensions agree with the live modules.
    lb = lm.binding.layers[0]
    assert lb.o_proj.weight.shape[-1] in (f.n_heads * f.head_dim, f.d_model)
    assert lm.binding.embed.weight.shape == (f.vocab_size, f.d_model)


def test_dimensions_from_a_plain_dict_without_torch_objects():
    cfg = make_config("llama").to_dict()
    f = ArchFacts.from_config(cfg)
    assert (f.d_model, f.n_layers, f.n_heads, f.n_kv_heads, f.head_dim) == (128, 2, 4, 2, 32)
    assert f.layer_kinds == ("global", "global")
    g = ArchFacts.from_config(make_config("gemma3_text"))
    assert "sliding" in g.layer_kinds and "global" in g.layer_kinds
    m = ArchFacts.from_config(make_config("mixtral"))
    assert m.n_experts == 4 and m.experts_per_token == 2 and m.moe_layers == (0, 1)
    assert ArchFacts.from_config(make_config("granite")).residual_multiplier == pytest.approx(0.22)
    assert ArchFacts.from_config(make_config("falcon_mqa")).n_kv_heads == 1


def test_measured_multiplier_matches_config_on_granite():
    lb = lm_for("granite").binding.layers[0]
    assert lb.attn_multiplier == pytest.approx(0.22) and lb.mlp_multiplier == pytest.approx(0.22)


@pytest.mark.parametrize("family", sorted(UNSUPPORTED))
def test_unsupported_families_are_refused_with_a_reason(family):
    with pytest.raises(ie_lab.StructureError, match="no attention module"):
        ie_lab.load(make_model(family))


def test_at_least_25_families_bind():
    assert len(SUPPORTED) >= 25


@pytest.mark.parametrize("family", SUPPORTED)
def test_half_precision_binds_to_the_same_structure(family):
    """bf16 rounding must not fool the binder into another structure (it compares flowing tensors)."""
    import torch

    lm = ie_lab.load(make_model(family).to(torch.bfloat16), quiet=True)
    ref = lm_for(family)
    assert lm.binding.structure == ref.binding.structure
    for a, b in zip(lm.binding.layers, ref.binding.layers):
        assert (a.parallel, a.fused_qkv_layout, a.value_source) == (b.parallel, b.fused_qkv_layout, b.value_source)
        assert (a.attn_multiplier is None) == (b.attn_multiplier is None)
