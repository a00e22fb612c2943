"""Families ie_lab does not bind are refused naming the structure the probe measured (issue 20 item 2), where they
used to get a generic "residual identities fail", "no attention module" or "no ModuleList" refusal; and a multimodal
wrapper whose vision tower has as many layers as its text trunk binds the text trunk."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage

REFUSALS = {
    # n = ln_1(x + attn), h = ln_2(n + mlp): the stream itself is normalised after each add
    "openai-gpt": r"post-norm block: ln_1 normalises the residual stream itself",
    # heads routed to experts, each with its own output projection (experts.map / experts.reduce)
    "jetmoe": r"routes each token's heads to experts.*self_attention\.experts.*mixture of attention heads",
    # (attn + b_h) * s_h + (resid + b_r) * s_r, in a module of its own
    "zaya": r"residual add is itself a learned module: post_attention_residual_scale \(ZayaResidualScaling\)",
    # a short convolution on the attention output before the residual add
    "inkling_text": r"attn_sconv \(InklingShortConvolution\) transforms the attention output before the residual add",
    # two layer stacks run in cycles, none as long as num_hidden_layers
    "hrm_text": r"several layer stacks instead \(model\.L_module\.layers \(2\), model\.H_module\.layers \(2\)\)",
    # each decoder layer holds two attention and two MLP sublayers
    "longcat_flash": r"self_attn is a ModuleList of 2 attention sublayers",
    # later tokens change earlier logits as loaded (permutation LM; CPM-Ant's bidirectional context)
    "xlnet": r"xlnet is not causal as loaded: changing the last of 7 tokens changes the logits at earlier positions",
    "cpmant": r"cpmant is not causal as loaded",
    # (transformers 5.24) its output gate adds a per-head gate_bias before the sigmoid (measured, so the gate no longer
    # refuses it), then each residual add scales the stream: resid_mid = sqrt(1/2) * resid_pre + sqrt(1/2) * attn
    "beam": r"beam layer 0: the residual add scales the stream itself \(resid_mid = 0\.7071 \* resid_pre",
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_refusal_names_the_measured_structure(model_type):
    if model_type not in coverage.causal_lm_types():
        pytest.skip(f"{model_type} is not in this transformers' causal-LM mapping")
    model = coverage.build_tiny(model_type)
    with pytest.raises(ie_lab.StructureError, match=REFUSALS[model_type]) as e:
        ie_lab.load(model, coverage._tokenizer(), quiet=True)
    assert "Instead:" in str(e.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # the model as before


def test_not_causal_is_what_the_model_does():
    """The evidence behind the xlnet refusal, measured outside ie_lab: the first position's logits depend on the last
    token. A causal family (llama) is not affected by the same change."""
    for model_type, leaks in (("xlnet", True), ("llama", False)):
        model = coverage.build_tiny(model_type)
        x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
        y = x.clone()
        y[0, -1] = (y[0, -1] + 1) % 500
        with torch.no_grad():
            a, b = model(input_ids=x).logits, model(input_ids=y).logits
        assert (not torch.allclose(a[0, 0], b[0, 0], atol=1e-5, rtol=0)) is leaks, model_type


def test_multimodal_wrapper_binds_its_text_trunk_not_its_vision_tower():
    """GOT-OCR 2's vision tower has as many layers as its text trunk (and sits first): the binder took it and refused
    ("no output projection"). The layer list beside the token embedding is the text trunk."""
    model = coverage.build_tiny("got_ocr2")
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    assert lm.binding.layers_path == "model.language_model.layers"
    vision = model.model.vision_tower.layers
    assert len(vision) == len(lm.binding.layers)
    assert not any(lb.layer is v for lb in lm.binding.layers for v in vision)
    coverage.check_invariants(lm)
