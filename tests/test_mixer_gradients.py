"""grad=True on a mixer layer's own points (issue 20, item 3): mixer_in, mixer_out and mixer_out_post are
differentiable inputs of everything after them, as attn_in / attn_out are. Each derivative is checked against a
finite difference taken by moving transformers' own module boundary (a hook of the test's own), on a mixer in place
of attention (Mamba 2, Qwen3-Next's gated delta net, Jamba's Mamba) and one beside it (Falcon-H1, whose
mixer_out_post carries the ssm output multiplier)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

import ie_lab
from ie_lab import Address, coverage
from ie_lab.arch.binder import hidden_arg
from ie_lab.eager.taps import resolve

FAMILIES = ["mamba2", "qwen3_next", "jamba", "falcon_h1"]


@cache
def _lm(family: str):
    torch.set_num_threads(1)
    # dense MLPs: a tiny random router's top-k flips under the finite difference's nudge (a kink the derivative
    # does not see), which is not what this checks
    keys = {"falcon_h1": {"ssm_out_multiplier": 3.0}, "qwen3_next": {"mlp_only_layers": [0, 1, 2, 3]}}.get(family, {})
    return ie_lab.load(coverage.build_tiny(family, **keys), coverage._tokenizer(), quiet=True)


def _mixer_layer(lm) -> int:
    return next(lb.index for lb in lm.binding.layers if lb.mixer_kind or getattr(lb, "par_mixer", None) is not None)


def _moved(lm, address: str, ids, u, eps: float, target: str) -> torch.Tensor:
    """target captured with the point moved by eps * u, at transformers' module boundary (the point's inverse
    transform applied: a scaled point is moved by eps * u / scale at the module)."""
    src = resolve(lm, Address.parse(address))
    probe = src.transform(torch.ones(1))
    scale = float(probe.reshape(-1)[0])  # identity or a multiplier
    d = eps * u / scale
    if src.kind == "pre":

        def pre(mod, args, kwargs):
            h = hidden_arg(args, kwargs)
            new = h + d
            kwargs = {k: (new if v is h else v) for k, v in kwargs.items()}
            return tuple(new if a is h else a for a in args), kwargs

        handle = src.module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(mod, args, out):
            return (out[0] + d, *out[1:]) if isinstance(out, tuple) else out + d

        handle = src.module.register_forward_hook(post)
    try:
        return ie_lab.capture(lm, ids, [target])[target]
    finally:
        handle.remove()


@pytest.mark.parametrize("point", ["mixer_in", "mixer_out", "mixer_out_post"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixer_points_are_differentiable_inputs(family, point):
    lm = _lm(family)
    L = _mixer_layer(lm)
    target = f"resid_post.{lm.facts.n_layers - 1}"
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, lm.facts.vocab_size, (1, 7), generator=g)
    c = ie_lab.capture(lm, ids, [f"{point}.{L}", target], grad=True)
    x = c[f"{point}.{L}"]
    assert x.requires_grad
    w = torch.randn(c[target].shape, generator=g)
    u = torch.randn(x.shape, generator=g)
    (grad,) = torch.autograd.grad((c[target] * w).sum(), x)
    analytic = float((grad * u).sum())
    eps = 1e-3
    up = _moved(lm, f"{point}.{L}", ids, u, eps, target)
    down = _moved(lm, f"{point}.{L}", ids, u, -eps, target)
    numeric = float(((up - down) * w).sum()) / (2 * eps)
    assert abs(analytic - numeric) < 3e-2 * max(1.0, abs(numeric)), (family, point, analytic, numeric)
    assert abs(numeric) > 1e-3  # the check can fail: the point moves what follows
    for lb in lm.binding.layers:  # nothing left registered
        for m in (lb.layer,):
            assert not m._forward_hooks and not m._forward_pre_hooks
