"""Gated attention (AFMoE, AXK2, Laguna, Qwen3.5 and its MoE / text models, Qwen3-Next): the registry defines z as the
input of the attention output projection, and every other engine (plain hooks, nnsight, TransformerBridge,
interp-engine) reads it there, so z is the gated product; attn_gate is the gate that multiplies the kernel's per-head
output (attn_probs @ value) into it. A write to z acts on that same tensor.

The neighbouring gated layer's o_proj input (same shape, wrong place) and the ungated kernel output (the old z, a
shape-correct wrong answer) must both fail.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage
from ie_lab.address import Address
from ie_lab.eager.writers import Writers
from tests.conftest import assert_clean

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)
GATED = ["afmoe", "axk2", "laguna", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"]


@pytest.fixture(scope="module", params=GATED)
def gated(request):
    torch.set_num_threads(1)
    lm = ie_lab.load(coverage.build_tiny(request.param), coverage._tokenizer(), quiet=True)
    layers = [lb for lb in lm.binding.layers if lb.attn_gate is not None]
    assert layers, "no gate measured"
    return lm, layers


def _o_proj_inputs(lm, layers, writes=()) -> dict[int, torch.Tensor]:
    """What each gated layer's own o_proj module received in a plain forward of the model (writes applied)."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        lb.o_proj.register_forward_pre_hook(lambda m, a, L=lb.index: seen.__setitem__(L, a[0].detach().clone()))
        for lb in layers
    ]
    try:
        with torch.no_grad(), Writers(lm, list(writes)):
            lm.hf(input_ids=X, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _kernel_out(lm, L: int) -> torch.Tensor:
    """attn_probs @ value, heads concatenated: the attention kernel's output before the gate."""
    c = ie_lab.capture(lm, X, [f"attn_probs.{L}", f"value.{L}", f"attn_gate.{L}"])
    probs, value = c[f"attn_probs.{L}"], c[f"value.{L}"]
    b, s, _ = value.shape
    H = lm.facts.n_heads
    d_v = c[f"attn_gate.{L}"].shape[-1] // H
    v = value.reshape(b, s, -1, d_v).transpose(1, 2)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    return (probs @ v).transpose(1, 2).reshape(b, s, H * d_v)


def test_z_is_the_output_projections_input_and_the_gated_kernel_output(gated):
    lm, layers = gated
    seen = _o_proj_inputs(lm, layers)
    for lb in layers:
        L = lb.index
        c = ie_lab.capture(lm, X, [f"z.{L}", f"attn_gate.{L}"])
        z, gate = c[f"z.{L}"], c[f"attn_gate.{L}"]
        torch.testing.assert_close(z, seen[L], **TOL)
        kernel = _kernel_out(lm, L)
        torch.testing.assert_close(kernel * gate, z, **TOL)  # attn_gate multiplies the kernel's output into z
        assert not torch.allclose(kernel, z, **TOL)  # the pre-gate kernel output is not z (the gate matters)
        for other in layers:
            if other.index != L and seen[other.index].shape == z.shape:
                assert not torch.allclose(seen[other.index], z, **TOL)
    assert_clean(lm)


def test_writing_z_acts_on_the_captured_tensor(gated):
    lm, layers = gated
    clean = ie_lab.capture(lm, X, [f"z.{lb.index}" for lb in layers] + ["lm_head"])
    for lb in layers:
        L = lb.index
        delta = torch.randn(clean[f"z.{L}"].shape[-1], generator=torch.Generator().manual_seed(L))
        seen = _o_proj_inputs(lm, [lb], [(Address("z", L), lambda t, off, d=delta: t + d.to(t))])
        torch.testing.assert_close(seen[L], clean[f"z.{L}"] + delta, **TOL)
        # one head: only that head's block of o_proj's input moves (AXK2's latent value heads are wider than head_dim)
        d = clean[f"z.{L}"].shape[-1] // lm.facts.n_heads
        seen = _o_proj_inputs(lm, [lb], [(Address("z", L, head=1), lambda t, off: t * 0)])
        want = clean[f"z.{L}"].clone()
        want[..., d : 2 * d] = 0
        torch.testing.assert_close(seen[L], want, **TOL)
        with torch.no_grad(), Writers(lm, [(Address("z", L), lambda t, off: t)]):
            same = ie_lab.capture(lm, X, ["lm_head"])["lm_head"]
        torch.testing.assert_close(same, clean["lm_head"], **TOL)  # the identity write changes nothing
    assert_clean(lm)
