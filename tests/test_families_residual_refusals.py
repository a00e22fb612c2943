"""Families whose layer does more than resid_pre + sublayer outputs (issue 20 item 2) are refused by the measurement
itself, and the refusal names the structure it found, with the measured factors where there are some: each was
refused with the generic "the residual identities ... do not hold".
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, tiny
from ie_lab.errors import StructureError

REFUSED = {
    # learned per-channel vectors scale the residual before each add
    "doge": r"per channel by its learned vector input_residual",
    # the per-layer-input branch after the MLP
    "gemma4_text": r"per_layer_input_gate \(Linear\), per_layer_projection \(Linear\), post_per_layer_input_norm",
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_the_refusal_names_the_structure(family):
    torch.set_num_threads(1)
    model = coverage.build_tiny(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StructureError, match=REFUSED[family]) as e:
        ie_lab.load(model, coverage._tokenizer(), quiet=True)
    assert "Instead:" in str(e.value)
    # the probe left the model as it was: no hook, the same weights
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gemma4_without_the_per_layer_branch_binds_and_a_layer_scalar_is_named():
    """Gemma 4 without per-layer inputs binds while its layer_scalar buffer is 1 (every invariant holds); a
    layer_scalar away from 1 rescales the whole stream, and the refusal names it with its value."""

    torch.set_num_threads(1)
    config = coverage.tiny_config("gemma4_text")
    config.hidden_size_per_layer_input = 0
    model = tiny.build(config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm gains away from 1
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    model.eval()
    coverage.check_invariants(ie_lab.load(model, coverage._tokenizer(), quiet=True))
    for layer in model.model.layers:
        layer.layer_scalar.fill_(0.5)
    with pytest.raises(StructureError, match=r"multiplies its whole output by layer_scalar \(0.5\)"):
        ie_lab.load(model, coverage._tokenizer(), quiet=True)
