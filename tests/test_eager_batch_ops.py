"""Lens fitting in memory-bounded batches (issue 16 item 3): the fit equals the one-prompt-per-forward fit.

The corpus is ragged (3 to 31 tokens), so a batch pads its short prompts; a pad row that entered the fit would
change the least-squares solution (and the token count), which the comparison with batch_size=1 would catch. A
forward pre-hook on the embedding records each forward's [rows, tokens], which shows the batching happened.
"""

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

CORPUS = [[5 + (11 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate((3, 31, 7, 12, 4, 25, 9, 15, 6))]


def _forwards(lm, fn):
    shapes = []
    h = lm.binding.embed.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
    try:
        return fn(), shapes
    finally:
        h.remove()


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_tuned_lens_fit_in_batches_equals_one_prompt_per_forward(fam):
    lm = lm_for(fam)
    layers = [0, 1]
    one, one_shapes = _forwards(lm, lambda: ie_lab.fit_tuned_lens(lm, CORPUS, layers, batch_size=1))
    auto, auto_shapes = _forwards(lm, lambda: ie_lab.fit_tuned_lens(lm, iter(CORPUS), layers))
    four, four_shapes = _forwards(lm, lambda: ie_lab.fit_tuned_lens(lm, CORPUS, layers, batch_size=4))
    assert len(one_shapes) == len(CORPUS)
    assert auto_shapes == [(len(CORPUS), 31)]  # the toy model's whole corpus fits one forward
    assert [s[0] for s in four_shapes] == [4, 4, 1]
    for got in (auto, four):
        assert got.train_tokens == one.train_tokens == sum(len(p) for p in CORPUS)
        for L in layers:
            for a, b in zip(got.transports[L], one.transports[L]):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert_clean(lm)


def test_tuned_lens_batch_size_is_checked_before_any_forward():
    lm = lm_for("llama")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ie_lab.InputError, match="batch_size"):
            ie_lab.fit_tuned_lens(lm, CORPUS, [0], batch_size=bad)
    with pytest.raises(ie_lab.InputError, match="corpus item 1 is a list"):
        ie_lab.fit_tuned_lens(lm, [CORPUS[0], CORPUS[1:3]], [0])


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_attribution_patch_reads_both_prompts_in_one_forward_and_equals_the_unbatched_estimate(fam):
    """The points and metrics of clean and corrupted come from one 2-row forward (then the gradient pass): two
    forwards where there were five, and the grid equal to the one computed from separate reads."""
    from ie_lab.eager.patch_checks import plain_forward as _forward
    from ie_lab.eager.patch_checks import scalar as _scalar
    from ie_lab.eager.patching import capture_batch, gradients

    lm = lm_for(fam)
    clean = torch.tensor([[5, 9, 14, 20, 33, 41, 57]])
    corrupted = torch.tensor([[5, 9, 14, 21, 33, 41, 57]])
    metric = ie_lab.logit_diff(60, 61)
    grid, shapes = _forwards(lm, lambda: ie_lab.attribution_patch(lm, clean, corrupted, metric))
    assert shapes == [(2, 7), (1, 7)]  # the fused read, then the gradient pass
    addrs = [f"resid_pre.{L}" for L in range(lm.facts.n_layers)]
    c, x = capture_batch(lm, clean, addrs), capture_batch(lm, corrupted, addrs)
    g = gradients(lm, corrupted, metric, addrs)
    with torch.no_grad():
        corr_m = _scalar(metric(_forward(lm, corrupted, None)))
        clean_m = _scalar(metric(_forward(lm, clean, None)))
    want = torch.stack([((c[a] - x[a]) * g[a]).sum(-1)[0] for a in addrs]) + corr_m
    torch.testing.assert_close(grid.values, want, atol=1e-5, rtol=1e-5)
    assert grid.clean == pytest.approx(clean_m, abs=1e-5)
    assert grid.corrupted == pytest.approx(corr_m, abs=1e-5)
    assert_clean(lm)
