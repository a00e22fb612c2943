"""Granite SWA's eager kernel scales its output by sigmoid(logsumexp(scores) - sink) after the softmax: a learned
per-head sink logit joins the denominator, so the pattern that mixed the values is the returned weights times that
factor (rows sum below 1). ie_lab's attn_probs is that pattern, rebuilt with the sink (commit 4a840d8, a deliberate
choice the validator records as known), so attn_probs @ value is the kernel's output (z); the weights the model
returns (what plain hooks and interp-engine read) are not: mixed with the values they miss the sink's share."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny("granite_swa"), coverage._tokenizer(), quiet=True)


def _mix(lm, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    b, s, _ = value.shape
    H, d = lm.facts.n_heads, lm.facts.head_dim
    v = value.reshape(b, s, -1, d).transpose(1, 2).repeat_interleave(H // (value.shape[-1] // d), dim=1)
    return (probs @ v).transpose(1, 2).reshape(b, s, H * d)


def test_attn_probs_explain_the_kernels_output_and_the_returned_weights_do_not(lm):
    assert any(not lb.kernel_weights_ok for lb in lm.binding.layers), "the binder did not measure the sink"
    with torch.no_grad():
        returned = lm.hf(input_ids=X, use_cache=False, output_attentions=True).attentions
    for lb in lm.binding.layers:
        L = lb.index
        c = ie_lab.capture(lm, X, [f"attn_probs.{L}", f"value.{L}", f"z.{L}"])
        probs, value, z = c[f"attn_probs.{L}"], c[f"value.{L}"], c[f"z.{L}"]
        torch.testing.assert_close(_mix(lm, probs, value), z, **TOL)  # ie_lab's pattern is what mixed the values
        model_w = returned[L]
        assert model_w.shape == probs.shape
        assert not torch.allclose(_mix(lm, model_w, value), z, **TOL)  # the model's returned weights are not
        # the same distribution over keys, less the sink's share of each row
        torch.testing.assert_close(model_w * probs.sum(-1, keepdim=True), probs, **TOL)
        assert torch.all(probs.sum(-1) < 1)
