"""MiniCPM 3 divides the final norm's output by logits_scaling before its unembedding, and nothing after it: the
lm_head point is the unembedding module's output, i.e. the logits the model returns (plain hooks, nnsight, nnterp and
interp-engine read it there), and the logit lens applies the same scale before the head, so its last layer is those
logits. W_U·final_norm (the head fed the unscaled norm, a shape-correct wrong answer) is not lm_head."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage
from ie_lab.eager.lens import decode_residual
from ie_lab.ops.lens import postprocess_logits

X = torch.randint(4, 500, (2, 7), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny("minicpm3"), coverage._tokenizer(), quiet=True)


def test_lm_head_is_the_models_own_logits(lm):
    assert lm.binding.head_input_scale is not None and lm.binding.head_input_scale != 1
    seen = {}
    h = lm.binding.lm_head.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.detach().clone()))
    try:
        with torch.no_grad():
            logits = lm.hf(input_ids=X, use_cache=False).logits
    finally:
        h.remove()
    c = ie_lab.capture(lm, X, ["final_norm", "lm_head"])
    torch.testing.assert_close(c["lm_head"], seen["out"], **TOL)
    torch.testing.assert_close(c["lm_head"], logits, **TOL)
    torch.testing.assert_close(postprocess_logits(lm.facts, c["lm_head"]), logits, **TOL)  # nothing after the head
    with torch.no_grad():
        unscaled = lm.binding.lm_head(c["final_norm"])
    assert not torch.allclose(unscaled, c["lm_head"], **TOL)


def test_logit_lens_last_layer_is_the_logits(lm):
    last = f"resid_post.{lm.facts.n_layers - 1}"
    c = ie_lab.capture(lm, X, [last, "lm_head"])
    with torch.no_grad():
        logits = lm.hf(input_ids=X, use_cache=False).logits
        torch.testing.assert_close(decode_residual(lm, c[last]), logits, **TOL)
        torch.testing.assert_close(decode_residual(lm, c[last]), c["lm_head"], **TOL)
    coverage.check_invariants(lm)


def test_the_lens_says_it_scales_before_the_head(lm):
    res = ie_lab.logit_lens(lm, X[:1], keep_logits=True)
    assert "multiplied by 4 before the unembedding" in res.note
    with torch.no_grad():
        logits = lm.hf(input_ids=X[:1], use_cache=False).logits
    torch.testing.assert_close(res.logits[-1].reshape(logits.shape), logits, **TOL)
