"""Latent attention (DeepSeek-V2 and its kin): a value head is wider than a query head, so z is n_heads value heads
wide and z.L.head-H is the H-th of those blocks. Slicing by the query head width (the old answer) is a shape-correct
wrong tensor: it fails here. Capturing, projecting and writing one head all use the same block."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage
from ie_lab.address import Address
from ie_lab.eager.writers import Writers

X = torch.randint(4, 500, (2, 7), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["deepseek_v2", "axk2"])
def lm(request):
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny(request.param), coverage._tokenizer(), quiet=True)


def test_one_head_of_z_is_its_value_block(lm):
    H = lm.facts.n_heads
    c = ie_lab.capture(lm, X, ["z.1", "z.1.head-1"])
    d = c["z.1"].shape[-1] // H
    assert d != lm.facts.head_dim, "this fixture's value heads are as wide as its query heads"
    torch.testing.assert_close(c["z.1.head-1"], c["z.1"][..., d : 2 * d])


def test_writing_one_head_of_z_moves_only_that_block(lm):
    lb = lm.binding.layers[1]
    clean = ie_lab.capture(lm, X, ["z.1"])["z.1"]
    d = clean.shape[-1] // lm.facts.n_heads
    seen = {}
    h = lb.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0].detach().clone()))
    try:
        with torch.no_grad(), Writers(lm, [(Address("z", 1, head=1), lambda t, off: t * 0)]):
            lm.hf(input_ids=X, use_cache=False)
    finally:
        h.remove()
    want = clean.clone()
    want[..., d : 2 * d] = 0
    torch.testing.assert_close(seen["in"], want, **TOL)
