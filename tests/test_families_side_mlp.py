"""A shared expert the layer sums beside its MoE block outside any module (GraniteMoE-shared, GraniteMoE-SWA, the
Granite hybrid): mlp_out is that sum, measured (both read the MLP's input, the identities hold with it), read where
the later of the two returns and written through it. Each family was refused ("residual identities do not hold").

The neighbouring tensors (the MoE block's output alone, the shared expert's alone, the previous layer's mlp_out_post:
each shape-correct) must break resid_mid + mlp_out_post = resid_post.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage
from ie_lab.arch.binder import first_tensor
from tests.conftest import assert_clean

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)
SIDE_MLP_FAMILIES = ["granitemoeshared", "granitemoe_swa", "granitemoehybrid"]


def _tiny(family: str, residual_multiplier: float, **config_keys):
    """The coverage survey's tiny instance, with Granite's residual multiplier away from 1 (released checkpoints
    scale both branches by about 0.2), so the measured multiplier is exercised on the summed branch too."""
    return coverage.build_tiny(family, residual_multiplier=residual_multiplier, **config_keys)


@pytest.fixture(scope="module", params=SIDE_MLP_FAMILIES)
def lm(request):
    torch.set_num_threads(1)
    lm = ie_lab.load(_tiny(request.param, 0.25), coverage._tokenizer(), quiet=True)
    assert all(lb.mlp_multiplier == 0.25 for lb in lm.binding.layers)  # measured, and the config's
    return lm


def _outputs(lm, L: int) -> tuple[dict[str, torch.Tensor], ie_lab.Cache]:
    """One capture of the layer's MLP points, with the MoE block's and the shared expert's own outputs beside it."""
    lb = lm.binding.layers[L]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o, k=k: seen.setdefault(k, first_tensor(o).detach().clone()))
        for k, m in (("moe", lb.mlp_out_module), ("side", lb.mlp_side))
    ]
    try:
        names = ("resid_mid", "mlp_out", "mlp_out_post", "resid_post")
        c = ie_lab.capture(lm, X, [f"{p}.{L}" for p in names] + [f"mlp_out_post.{(L - 1) % lm.facts.n_layers}"])
    finally:
        for h in hooks:
            h.remove()
    return seen, c


def test_the_side_mlp_is_measured_and_the_invariants_hold(lm):
    assert all(lb.mlp_side is not None and lb.sparse_moe for lb in lm.binding.layers)
    assert all(lb.names["mlp_side"] == "shared_mlp" for lb in lm.binding.layers)
    coverage.check_invariants(lm)


def test_mlp_out_is_the_sum_and_each_branch_alone_fails(lm):
    n = lm.facts.n_layers
    for L in range(n):
        lb = lm.binding.layers[L]
        mult = lb.mlp_multiplier or 1.0
        seen, c = _outputs(lm, L)
        moe, side = seen["moe"].reshape(c[f"mlp_out.{L}"].shape), seen["side"]
        torch.testing.assert_close(c[f"mlp_out.{L}"], moe + side, **TOL)
        torch.testing.assert_close(c[f"mlp_out_post.{L}"], (moe + side) * mult, **TOL)
        torch.testing.assert_close(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
        for wrong in (moe * mult, side * mult, c[f"mlp_out_post.{(L - 1) % n}"]):
            assert wrong.shape == c[f"mlp_out_post.{L}"].shape
            assert not torch.allclose(c[f"resid_mid.{L}"] + wrong, c[f"resid_post.{L}"], **TOL)
    assert_clean(lm)


@pytest.mark.parametrize("point", ["mlp_out", "mlp_out_post"])
def test_steering_the_sum_moves_the_stream_by_the_vector(lm, point):
    L = lm.facts.n_layers - 1
    mult = 1.0 if point == "mlp_out_post" else (lm.binding.layers[L].mlp_multiplier or 1.0)
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1))
    before = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_post.{L}"])
    with ie_lab.steer(lm, f"{point}.{L}", v):
        after = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_post.{L}"])
    torch.testing.assert_close(after[f"{point}.{L}"], before[f"{point}.{L}"] + v, **TOL)
    torch.testing.assert_close(after[f"resid_post.{L}"], before[f"resid_post.{L}"] + mult * v, **TOL)
    assert_clean(lm)
    again = ie_lab.capture(lm, X, [f"resid_post.{L}"])
    torch.testing.assert_close(again[f"resid_post.{L}"], before[f"resid_post.{L}"])


def test_patching_mlp_out_sets_the_sum(lm):
    """Writing mlp_out from another prompt's forward: the patched layer's mlp_out is that prompt's, and the stream
    after it is resid_mid + the patched contribution (the earlier branch's output still flows, the later one's
    is solved for)."""
    from ie_lab.address import Address
    from ie_lab.eager.writers import Writers

    L = 0
    other = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(5))
    donor = ie_lab.capture(lm, other, [f"mlp_out.{L}"])[f"mlp_out.{L}"]
    with Writers(lm, [(Address("mlp_out", L), lambda t, off: donor)]):
        c = ie_lab.capture(lm, X, [f"mlp_out.{L}", f"resid_mid.{L}", f"resid_post.{L}"])
    torch.testing.assert_close(c[f"mlp_out.{L}"], donor, **TOL)
    mult = lm.binding.layers[L].mlp_multiplier or 1.0
    torch.testing.assert_close(c[f"resid_mid.{L}"] + mult * donor, c[f"resid_post.{L}"], **TOL)
    assert_clean(lm)


def test_a_dense_granite_hybrid_binds_its_shared_mlp_as_the_mlp():
    """Granite hybrids without experts (num_local_experts=0) keep their one MLP as shared_mlp, with a fused
    input_linear and an output_linear: it was refused as "an attention block with no MLP". The halves of input_linear
    are measured (act(gate) * up is what output_linear reads), down(mlp_act) = mlp_out, the identities hold, and the
    previous layer's mlp_out_post does not add up here."""
    torch.set_num_threads(1)
    model = _tiny("granitemoehybrid", 0.25, num_local_experts=0)
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    assert all(
        lb.names["mlp"] == "shared_mlp" and lb.mlp_side is None and not lb.sparse_moe for lb in lm.binding.layers
    )
    assert all(lb.fused_gate_up is lb.layer.shared_mlp.input_linear for lb in lm.binding.layers)
    coverage.check_invariants(lm)  # includes down_proj(mlp_act) = mlp_out on every layer
    c = ie_lab.capture(lm, X, ["resid_mid.1", "mlp_out_post.1", "resid_post.1", "mlp_out_post.0"])
    torch.testing.assert_close(c["resid_mid.1"] + c["mlp_out_post.1"], c["resid_post.1"], **TOL)
    assert not torch.allclose(c["resid_mid.1"] + c["mlp_out_post.0"], c["resid_post.1"], **TOL)
    assert_clean(lm)


def test_steering_mlp_in_reaches_both_branches(lm):
    """The MoE block and the side MLP both read mlp_in: a steered mlp_in is what each receives (written at the MoE
    block's input alone, the side MLP kept the unsteered value while mlp_out, the sum, counted both)."""
    L = lm.facts.n_layers - 1
    lb = lm.binding.layers[L]
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    plain = ie_lab.capture(lm, X, [f"mlp_in.{L}"])[f"mlp_in.{L}"]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, k=k: seen.__setitem__(k, a[0].detach().clone()))
        for k, m in (("moe", lb.mlp_in_module), ("side", lb.mlp_side))
    ]
    try:
        with ie_lab.steer(lm, f"mlp_in.{L}", v):
            got = ie_lab.capture(lm, X, [f"mlp_in.{L}"])[f"mlp_in.{L}"]
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(got, plain + v, **TOL)
    for k in ("moe", "side"):
        torch.testing.assert_close(seen[k].reshape(got.shape), got, **TOL)
    assert_clean(lm)
