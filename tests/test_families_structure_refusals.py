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


def test_kv_sharing_layer_binds_reading_the_earlier_layers_keys():
    """Kolibri 1.1 (transformers 5.25): a layer with a query projection and norm but no key or value projection reads
    an earlier layer's keys and values. The binder measures which layer (its kernel is handed that layer's very keys),
    binds its query norm alone and refuses its key norm naming the layer it reads; its value is the shared one, and
    its sparse (indexed) pattern is the one the eager kernel computes."""
    if "kolibri1_1" not in coverage.causal_lm_types():
        pytest.skip("kolibri1_1 is not in this transformers' causal-LM mapping")
    model = coverage.build_tiny("kolibri1_1")
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    sources = model.config.kv_source_layers
    assert [lb.kv_source for lb in lm.binding.layers] == [s if s != i else None for i, s in enumerate(sources)]
    L, S = 2, sources[2]
    assert S == 1 and lm.binding.layers[L].q_norm is not None and lm.binding.layers[L].k_norm is None
    with pytest.raises(ie_lab.PointAbsent, match=rf"reads those of layer {S} \(KV sharing\).*k_norm_out\.{S}"):
        ie_lab.capture(lm, torch.zeros(1, 4, dtype=torch.long), [f"k_norm_out.{L}"])
    x = torch.randint(4, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    names = [f"q_norm_out.{L}", f"value.{L}", f"value.{S}", "value.0", f"z.{L}", f"attn_probs.{L}"]
    c = ie_lab.capture(lm, x, names)
    # q_norm_out is that layer's own query norm's output (not the source layer's)
    seen = {}
    hooks = [
        lm.hf.model.layers[i].self_attn.q_norm.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o))
        for i in (S, L)
    ]
    try:
        with torch.no_grad():
            lm.hf(input_ids=x)
    finally:
        for h in hooks:
            h.remove()
    d = lm.facts.head_dim
    mine = seen[L].transpose(1, 2).reshape(2, 12, -1)
    torch.testing.assert_close(c[f"q_norm_out.{L}"], mine)
    assert not torch.allclose(c[f"q_norm_out.{L}"], seen[S].transpose(1, 2).reshape(2, 12, -1))
    # the value it mixes is the source layer's, and probs x value = z with it; the sliding layer's value does not fit
    assert torch.equal(c[f"value.{L}"], c[f"value.{S}"])
    rep = lm.facts.n_heads // lm.facts.n_kv_heads

    def mixed(value):
        v = value.reshape(2, 12, -1, d).transpose(1, 2).repeat_interleave(rep, 1)
        return (c[f"attn_probs.{L}"] @ v).transpose(1, 2).reshape(2, 12, -1)

    torch.testing.assert_close(mixed(c[f"value.{L}"]), c[f"z.{L}"], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(mixed(c["value.0"]), c[f"z.{L}"], atol=2e-5, rtol=1e-4)
    # sparse: keys inside the causal triangle left out by the indexer, and the pattern is the eager kernel's own
    p = c[f"attn_probs.{L}"]
    assert int(((p == 0) & torch.ones(12, 12, dtype=torch.bool).tril()).sum()) > 0
    eager = coverage.build_tiny("kolibri1_1")
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        want = eager(input_ids=x, output_attentions=True).attentions
    torch.testing.assert_close(p, want[L], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(p, want[S], atol=2e-5, rtol=1e-4)
