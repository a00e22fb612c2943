"""Batched operations (issue 16 item 3): difference of means and patch sweeps run several rows per forward and
give exactly the answer of one prompt (or one cell) per forward."""

import pytest
import torch

import ie_lab
from ie_lab import sizing
from tests.conftest import assert_clean, lm_for

POS = ["I love this, it is wonderful", "Great", "What a happy and bright sunny day it is today", "joy"]
NEG = ["I hate this", "Terrible, awful and sad, a grey miserable day", "bad"]


def _one_at_a_time(lm, prompts, a):
    return torch.stack([ie_lab.capture(lm, p, [a])[a][0].float().mean(0) for p in prompts]).mean(0)


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_mean_difference_equals_one_prompt_at_a_time(fam):
    lm = lm_for(fam)
    a = "resid_post.1"
    want = _one_at_a_time(lm, POS, a) - _one_at_a_time(lm, NEG, a)
    assert want.abs().max() > 1e-3  # the two sides differ, so a wrong mean cannot pass by accident
    for bs in (1, 2, None):
        got = ie_lab.mean_difference(lm, POS, NEG, a, batch_size=bs)
        assert got.shape == (lm.facts.d_model,)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_clean(lm)


def test_mean_difference_counts_each_prompt_once_not_each_token():
    # A token-weighted mean (what pooling all rows of a padded batch gives) differs from the per-prompt mean.
    lm = lm_for("llama")
    a = "resid_post.0"
    caps = [ie_lab.capture(lm, p, [a])[a][0] for p in POS]
    token_weighted = torch.cat(caps).mean(0)
    got = ie_lab.mean_difference(lm, POS, NEG, a) + _one_at_a_time(lm, NEG, a)
    assert not torch.allclose(got, token_weighted, atol=1e-5)
    torch.testing.assert_close(got, _one_at_a_time(lm, POS, a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_mean_difference_refuses_a_bad_batch_size(bad):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.IELabError, match="batch_size"):
        ie_lab.mean_difference(lm, POS, NEG, "resid_post.0", batch_size=bad)
    assert_clean(lm)


def test_mean_difference_refuses_bad_sides_and_points_before_any_forward():
    lm = lm_for("llama")
    with pytest.raises(ie_lab.IELabError, match="negative is empty"):
        ie_lab.mean_difference(lm, POS, [], "resid_post.0")
    with pytest.raises(ie_lab.IELabError, match="one point"):
        ie_lab.mean_difference(lm, POS, NEG, ["resid_post.0", "resid_post.1"])
    with pytest.raises(ie_lab.IELabError, match="attention matrix"):
        ie_lab.mean_difference(lm, POS, NEG, "attn_probs.0")
    assert_clean(lm)


def test_batch_size_for_shrinks_with_tokens_and_points_and_respects_bounds():
    lm = lm_for("llama")
    f = lm.facts
    per = sizing.forward_bytes_per_row(f, 16, 1)
    assert sizing.batch_size_for(f, 16, 1, budget_bytes=per * 5) == 5
    assert sizing.batch_size_for(f, 16, 1, budget_bytes=per * 0.5) == 1  # never below one row
    assert sizing.batch_size_for(f, 16, 1, budget_bytes=per * 1000, cap=8) == 8
    assert sizing.forward_bytes_per_row(f, 32, 1) > per and sizing.forward_bytes_per_row(f, 16, 3) > per
    with pytest.raises(ie_lab.IELabError, match="n_tokens"):
        sizing.batch_size_for(f, 0)
    with pytest.raises(ie_lab.IELabError, match="budget_bytes"):
        sizing.batch_size_for(f, 8, budget_bytes=-1)


CLEAN = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
CORRUPT = torch.tensor([[5, 6, 7, 30, 9, 10, 41]])


def _metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean()


def _reference_positions(lm, layers):
    """One forward per (layer, position) cell, through run_with_patches (the unbatched sweep's own path)."""
    src = ie_lab.capture(lm, CLEAN, [f"resid_pre.{L}" for L in layers])
    return torch.tensor(
        [
            [
                float(
                    _metric(
                        ie_lab.run_with_patches(lm, CORRUPT, {f"resid_pre.{L}": src[f"resid_pre.{L}"]}, positions=[j])
                    )
                )
                for j in range(CORRUPT.shape[1])
            ]
            for L in layers
        ]
    )


def _reference_heads(lm, layers):
    """Head h of z patched = z of the corrupted run with head h's slice taken from the clean run."""
    d, H = lm.facts.head_dim, lm.facts.n_heads
    c = ie_lab.capture(lm, CLEAN, [f"z.{L}" for L in layers])
    x = ie_lab.capture(lm, CORRUPT, [f"z.{L}" for L in layers])
    out = torch.zeros(len(layers), H)
    for i, L in enumerate(layers):
        for h in range(H):
            mixed = x[f"z.{L}"].clone()
            mixed[..., h * d : (h + 1) * d] = c[f"z.{L}"][..., h * d : (h + 1) * d]
            out[i, h] = float(_metric(ie_lab.run_with_patches(lm, CORRUPT, {f"z.{L}": mixed})))
    return out


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_batched_patch_sweep_equals_one_forward_per_cell(fam):
    lm = lm_for(fam)
    layers = list(range(lm.facts.n_layers))
    want = _reference_positions(lm, layers)
    assert want.std() > 1e-4  # cells differ, so a row patched at the wrong cell would show
    for bs in (1, 3, 5, None):  # 3 and 5 do not divide the cell count: ragged last batch, batches across layers
        grid = ie_lab.patch_sweep(lm, CLEAN, CORRUPT, _metric, layers=layers, progress=False, batch_size=bs)
        torch.testing.assert_close(grid.values, want, atol=1e-5, rtol=1e-5)
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_batched_head_sweep_equals_one_forward_per_cell(fam):
    lm = lm_for(fam)
    layers = list(range(lm.facts.n_layers))
    want = _reference_heads(lm, layers)
    assert want.std() > 1e-5
    for bs in (1, 3, None):
        grid = ie_lab.patch_sweep(
            lm, CLEAN, CORRUPT, _metric, over="layer_head", layers=layers, progress=False, batch_size=bs
        )
        torch.testing.assert_close(grid.values, want, atol=1e-5, rtol=1e-5)
    assert_clean(lm)


@pytest.mark.parametrize("bad", [0, -2, 2.0, False])
def test_patch_sweep_refuses_a_bad_batch_size(bad):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.IELabError, match="batch_size"):
        ie_lab.patch_sweep(lm, CLEAN, CORRUPT, _metric, progress=False, batch_size=bad)
    assert_clean(lm)


def test_batched_sweep_of_a_batched_prompt_equals_one_forward_per_cell():
    lm = lm_for("llama")
    clean, corrupt = CLEAN.repeat(2, 1), torch.cat([CORRUPT, CLEAN.flip(1)])
    layers = [0, 1]
    src = ie_lab.capture(lm, clean, [f"resid_pre.{L}" for L in layers])
    want = torch.tensor(
        [
            [
                float(
                    _metric(
                        ie_lab.run_with_patches(lm, corrupt, {f"resid_pre.{L}": src[f"resid_pre.{L}"]}, positions=[j])
                    )
                )
                for j in range(clean.shape[1])
            ]
            for L in layers
        ]
    )
    for bs in (3, None):
        grid = ie_lab.patch_sweep(lm, clean, corrupt, _metric, layers=layers, progress=False, batch_size=bs)
        torch.testing.assert_close(grid.values, want, atol=1e-5, rtol=1e-5)
    assert_clean(lm)


def test_session_mean_difference_and_its_twin_equal_the_free_function():
    import asyncio

    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False)
    try:
        want = _one_at_a_time(s._lm, POS, "resid_post.0") - _one_at_a_time(s._lm, NEG, "resid_post.0")
        torch.testing.assert_close(
            s.mean_difference(POS, NEG, "resid_post.0", batch_size=2), want, atol=1e-5, rtol=1e-5
        )
        got = asyncio.run(s.amean_difference(POS, NEG, "resid_post.0"))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        s.close()
