"""The Jacobian lens (ie_lab/eager/jacobian_lens.py): J_L = d resid_post.{last}[t] / d point.L[t], the same
position's block, averaged over every position of every prompt, as transports logit_lens takes.

The reference is independent of ie_lab's hooks: central finite differences on the raw transformers model in float64,
a hook of the test's own adding eps * e_j to one layer's output at one position and another reading the last
layer's output at that position. The neighbours a wrong implementation would return (the transpose, another
layer's Jacobian, the final norm's output instead of the residual, the derivative summed over every position of
the output) are shown to be far from the reference, so the comparison can fail.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

import ie_lab
from ie_lab import tiny
from ie_lab.eager.jacobian_lens import JacobianLens
from tests import families
from tests.conftest import assert_clean

# Llama's RMSNorm computes in float32 whatever the model's dtype (transformers casts), so a difference quotient
# carries ~1e-7 / EPS of rounding besides its EPS**2 truncation: 3e-3 keeps both near 1e-6 of the Jacobian's size.
EPS = 3e-3
DIRS = (0, 5, -1)  # basis directions probed by finite differences
PROMPTS = [torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[40, 41, 42, 43]])]


def _lm(family: str, layers: int = 3):
    """The tests' discriminating tiny model of the family, three layers deep, in float64."""
    config = families.make_config(family)
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, layers)
    model = tiny.build(config, gains="discriminating").double()
    return ie_lab.load(model, families.make_tokenizer(), quiet=True)


def _decoder_layers(hf) -> torch.nn.ModuleList:
    return hf.model.layers if hasattr(hf, "model") else hf.transformer.h


def _final_norm(hf) -> torch.nn.Module:
    return hf.model.norm if hasattr(hf, "model") else hf.transformer.ln_f


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run(hf, ids, layer: int, pos: int, delta: torch.Tensor, read: str = "residual") -> torch.Tensor:
    """[seq, d] of the last layer's output (read="residual") or the final norm's (read="norm"), with delta added to
    layer `layer`'s output at position `pos`; raw torch hooks, removed before returning."""
    seen = {}

    def add(mod, args, out):
        h = _first(out).clone()
        h[0, pos] += delta
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def keep(mod, args, out):
        seen["h"] = _first(out)[0].clone()

    layers = _decoder_layers(hf)
    handles = [layers[layer].register_forward_hook(add)]  # first: on the last layer, the read sees the change
    handles.append((layers[-1] if read == "residual" else _final_norm(hf)).register_forward_hook(keep))
    try:
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["h"]


def _fd_columns(lm, layer: int, read: str = "residual", same_position: bool = True) -> torch.Tensor:
    """[d, len(DIRS)]: column j of mean_t d read[t] / d resid_post.layer[t] by central differences (same_position
    False: the read summed over every position, the derivative a cotangent on all positions at once would give)."""
    d = lm.facts.d_model
    cols = torch.zeros(d, len(DIRS), dtype=torch.float64)
    n = 0
    for ids in PROMPTS:
        for t in range(ids.shape[1]):
            for c, j in enumerate(DIRS):
                e = torch.zeros(d, dtype=torch.float64)
                e[j] = EPS
                up, down = _run(lm.hf, ids, layer, t, e, read), _run(lm.hf, ids, layer, t, -e, read)
                diff = (up - down) / (2 * EPS)
                cols[:, c] += diff[t] if same_position else diff.sum(0)
            n += 1
    return cols / n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_jacobian_is_the_finite_difference_of_the_final_residual(family):
    lm = _lm(family)
    jl = ie_lab.fit_jacobian_lens(lm, PROMPTS, progress=False)
    last = lm.facts.n_layers - 1
    assert sorted(jl.transports) == [0, 1, 2] and jl.tokens == sum(p.shape[1] for p in PROMPTS) and jl.prompts == 2
    cols = list(DIRS)
    for L in (0, 1):
        want = _fd_columns(lm, L)
        J = jl.jacobian(L)
        assert J.dtype == torch.float64 and J.shape == (lm.facts.d_model, lm.facts.d_model)
        assert _rel(J[:, cols], want) < 1e-4, (family, L)
        # the neighbours a wrong implementation would return are far from the reference
        assert _rel(J.T[:, cols], want) > 1e-2, "the transpose"
        assert _rel(jl.jacobian(1 - L)[:, cols], want) > 1e-2, "another layer's Jacobian"
        if L == 0:  # the two other definitions are far from this one (one layer shows it; each costs a sweep)
            assert _rel(want, _fd_columns(lm, L, read="norm")) > 1e-2, "the final norm's output, not the residual"
            assert _rel(want, _fd_columns(lm, L, same_position=False)) > 1e-2, "every output position summed"
        # the transport is h -> h @ J^T: it maps a change of the layer's residual to the final residual's change
        A, b = jl.transports[L]
        torch.testing.assert_close(A, J.T) and torch.testing.assert_close(b, torch.zeros_like(b))
    # the final residual with respect to itself: exactly the identity
    assert torch.equal(jl.jacobian(last), torch.eye(lm.facts.d_model, dtype=torch.float64))
    assert_clean(lm)


def test_the_batch_size_does_not_change_the_result_and_other_points_fit():
    lm = _lm("llama", layers=2)
    a = ie_lab.fit_jacobian_lens(lm, PROMPTS, [0], progress=False, batch_size=7)
    b = ie_lab.fit_jacobian_lens(lm, PROMPTS, [0], progress=False, batch_size=1000)
    torch.testing.assert_close(a.jacobian(0), b.jacobian(0), rtol=1e-10, atol=1e-12)
    # resid_pre of layer 1 is resid_post of layer 0: the same map
    pre = ie_lab.fit_jacobian_lens(lm, PROMPTS, [1], point="resid_pre", progress=False)
    torch.testing.assert_close(pre.jacobian(1), a.jacobian(0), rtol=1e-10, atol=1e-12)
    assert "resid_pre" in repr(pre) and "9 positions of 2 prompts" in repr(pre)


def test_the_transports_go_to_the_logit_lens():
    lm = _lm("llama", layers=2)
    jl = ie_lab.fit_jacobian_lens(lm, PROMPTS, progress=False)
    plain = ie_lab.logit_lens(lm, PROMPTS[0], keep_logits=True)
    lensed = ie_lab.logit_lens(lm, PROMPTS[0], keep_logits=True, transports=jl.transports)
    assert lensed.logits.shape == plain.logits.shape and "transports" in lensed.note
    torch.testing.assert_close(lensed.logits[1], plain.logits[1])  # the last layer's transport is the identity
    assert not torch.allclose(lensed.logits[0], plain.logits[0])
    assert_clean(lm)


def test_a_session_fits_it_and_refuses_bad_input_before_any_hook(session):
    jl = session.fit_jacobian_lens(["The cat sat", "A dog"], [0], progress=False)
    assert isinstance(jl, JacobianLens) and list(jl.transports) == [0]
    awaited = asyncio.run(session.afit_jacobian_lens(["The cat sat", "A dog"], [0], progress=False))
    torch.testing.assert_close(awaited.jacobian(0), jl.jacobian(0))  # the twin computes on the loop thread
    free = ie_lab.fit_jacobian_lens(session._lm, ["The cat sat", "A dog"], [0], progress=False)
    torch.testing.assert_close(free.jacobian(0), jl.jacobian(0))
    lm = session._lm
    with pytest.raises(ie_lab.InputError, match="prompt 1"):
        session.fit_jacobian_lens([[5, 6, 7], [1, 10**6]], progress=False)
    with pytest.raises(ie_lab.AddressError, match="takes the name alone"):
        session.fit_jacobian_lens("The cat", point="resid_post.0", progress=False)
    with pytest.raises(ie_lab.AddressError, match="d_model-wide"):
        session.fit_jacobian_lens("The cat", point="mlp_act", progress=False)
    with pytest.raises(ie_lab.IELabError, match="layers contains 9"):
        session.fit_jacobian_lens("The cat", [9], progress=False)
    with pytest.raises(ie_lab.InputError, match="batch_size"):
        session.fit_jacobian_lens("The cat", batch_size=0, progress=False)
    assert_clean(lm)


def test_hooks_are_gone_after_an_error_inside_the_forward():
    lm = _lm("llama", layers=2)
    calls = []

    def fail_on_the_second_forward(mod, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    h = lm.binding.embed.register_forward_pre_hook(fail_on_the_second_forward)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            ie_lab.fit_jacobian_lens(lm, PROMPTS, progress=False, batch_size=8)
    finally:
        h.remove()
    assert_clean(lm)


def test_an_interrupt_stops_it_and_leaves_no_hook(session, ctrl_c_raises):
    forwards = []

    def interrupt_on_the_second_forward(mod, args):
        forwards.append(1)
        if len(forwards) == 2:
            signal.raise_signal(signal.SIGINT)

    h = session._lm.binding.embed.register_forward_pre_hook(interrupt_on_the_second_forward)
    try:
        with pytest.raises(KeyboardInterrupt):
            session.fit_jacobian_lens("The cat sat on the mat", progress=False, batch_size=4)
    finally:
        h.remove()
    assert len(forwards) == 2  # stopped at the next layer, not after the 6 * 128 / 4 forwards it would run
    assert_clean(session._lm)
    assert list(session.fit_jacobian_lens("The cat", [1], progress=False).transports) == [1]  # the session goes on


def test_vllm_and_remote_refuse_it_by_name():
    from ie_lab import capabilities
    from ie_lab.core import calls
    from ie_lab.remote.client import RemoteBackend
    from ie_lab.remote.ops import OPS

    with pytest.raises(ie_lab.CapabilityUnsupported, match="gradients is not supported on backend='vllm'.*eager"):
        capabilities.require("gradients", "vllm")
    assert "fit_jacobian_lens" not in OPS  # a server takes no such request
    backend = RemoteBackend.__new__(RemoteBackend)  # no server: the refusal needs none
    with pytest.raises(ie_lab.CapabilityUnsupported, match="fit_jacobian_lens on a remote Session.*backend='eager'"):
        backend.fit_jacobian_lens(calls.FitJacobianLens("The cat"))
