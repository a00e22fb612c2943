"""Falcon-H1 (issue 20 item 3): every layer runs a Mamba mixer and attention side by side on the same normed input and
adds both, each times its own multiplier, to the residual stream, then an MLP. The binder measures the mixer beside
attention and both factors (least squares, then verified exactly): the attention points and the mixer points are
served on the same layer, resid_mid = resid_pre + attn_out_post + mixer_out_post. It was refused ("the residual
identities ... do not hold").

The neighbours must fail: the identity without the mixer's share, with the previous layer's mixer_out_post, or with
the mixer's share unscaled (mixer_out in place of mixer_out_post).
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, points
from ie_lab.arch.binder import first_tensor
from tests.conftest import assert_clean

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)
# Released Falcon-H1 configs scale every branch (muP multipliers); the tiny instance's Mamba output is small, so its
# factor is large enough here for the mixer's share to count in every identity.
MULTIPLIERS = dict(
    attention_out_multiplier=0.5,
    ssm_out_multiplier=40.0,
    attention_in_multiplier=1.5,
    mlp_multipliers=[1.0, 0.75],
    lm_head_multiplier=0.5,
)


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny("falcon_h1", **MULTIPLIERS), coverage._tokenizer(), quiet=True)


def test_the_mixer_beside_attention_and_its_factors_are_measured(lm):
    for lb in lm.binding.layers:
        assert lb.par_mixer is lb.layer.mamba and lb.attn is lb.layer.self_attn and not lb.mixer_kind
        assert lb.par_mixer_multiplier == pytest.approx(40.0, rel=1e-4)
        assert lb.attn_multiplier == pytest.approx(0.5, rel=1e-4)
        assert lb.mlp_multiplier == pytest.approx(0.75, rel=1e-4)  # the MLP's down multiplier, after down_proj
    s = points.Structure.from_binding(lm.binding)
    n = lm.facts.n_layers
    assert s.parallel_mixer_layers == s.mixer_layers == tuple(range(n))
    for L in range(n):  # both kinds of point exist on every layer
        assert points.absence("attn_out", s, L) is None and points.absence("mixer_out", s, L) is None
    coverage.check_invariants(lm)  # includes resid_pre + attn_out_post + mixer_out_post = resid_mid, the logits


def test_resid_mid_is_both_shares_and_the_neighbours_fail(lm):
    n = lm.facts.n_layers
    names = ("resid_pre", "attn_out_post", "mixer_out", "mixer_out_post", "resid_mid")
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in names])
    for L in range(n):
        other = (L - 1) % n
        pre, attn, mid = c[f"resid_pre.{L}"], c[f"attn_out_post.{L}"], c[f"resid_mid.{L}"]
        torch.testing.assert_close(pre + attn + c[f"mixer_out_post.{L}"], mid, **TOL)
        for wrong in (0 * mid, c[f"mixer_out_post.{other}"], c[f"mixer_out.{L}"]):
            assert not torch.allclose(pre + attn + wrong, mid, **TOL)
    assert_clean(lm)


def test_the_mixer_points_are_the_mamba_modules_tensors(lm):
    L = 1
    lb = lm.binding.layers[L]
    seen: dict[str, torch.Tensor] = {}

    def keep_in(mod, args, kwargs):
        seen.setdefault("in", kwargs["hidden_states"].clone())

    def keep_out(mod, args, kwargs, out):
        seen.setdefault("out", first_tensor(out).clone())

    hooks = [
        lb.par_mixer.register_forward_hook(keep_out, with_kwargs=True),
        lb.par_mixer.register_forward_pre_hook(keep_in, with_kwargs=True),
    ]
    try:
        c = ie_lab.capture(lm, X, [f"mixer_in.{L}", f"mixer_out.{L}", f"attn_in.{L}"])
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(c[f"mixer_out.{L}"], seen["out"])
    torch.testing.assert_close(c[f"mixer_in.{L}"], seen["in"])
    # attention reads the same normed input times attention_in_multiplier: its input is not the mixer's
    torch.testing.assert_close(c[f"attn_in.{L}"], 1.5 * c[f"mixer_in.{L}"], **TOL)


@pytest.mark.parametrize(("point", "factor"), [("mixer_out_post", 1.0), ("mixer_out", 40.0), ("resid_mid", 1.0)])
def test_steering_moves_resid_mid_by_the_measured_factor(lm, point, factor):
    L = 0
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1)) * 0.01
    before = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_mid.{L}", f"attn_out_post.{L}"])
    with ie_lab.steer(lm, f"{point}.{L}", v):
        after = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_mid.{L}", f"attn_out_post.{L}"])
    torch.testing.assert_close(after[f"{point}.{L}"], before[f"{point}.{L}"] + v, **TOL)
    torch.testing.assert_close(after[f"resid_mid.{L}"], before[f"resid_mid.{L}"] + factor * v, **TOL)
    torch.testing.assert_close(
        after[f"attn_out_post.{L}"], before[f"attn_out_post.{L}"] + (v if point == "resid_mid" else 0), **TOL
    )
    assert_clean(lm)


def test_the_picker_shows_both_kinds_on_every_layer(lm):
    from ie_lab.widgets.picker import describe

    live = {p["name"]: p for p in describe(lm.facts, "eager", lm=lm)["points"]}
    n = lm.facts.n_layers
    for name in ("attn_out", "z", "mixer_out", "mixer_in", "resid_mid", "mlp_out"):
        assert all(live[name]["served"][L] == "1" for L in range(n)), name
