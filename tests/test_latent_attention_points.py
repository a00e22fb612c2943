"""Latent attention's own tensors (issue 20 item 4): q_latent (the compressed query), kv_latent (the compressed
key/value latent the cache holds) and k_nope (each head's position-free key, decompressed from kv_latent) on
DeepSeek-V2/V3 and MiniCPM 3; refused naming the structure where a family has none. project() takes z at its real
width there (heads x v_head_dim, not d_model nor heads x head_dim).

Every identity is checked against a shape-correct neighbour (the previous layer's tensor, the other half of the
up-projection's block): it must fail there.
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
MLA = ["deepseek_v2", "deepseek_v3", "minicpm3"]


@pytest.fixture(scope="module", params=MLA)
def lm(request):
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny(request.param), coverage._tokenizer(), quiet=True)


def _split(lm, L: int, c) -> tuple[torch.Tensor, torch.Tensor]:
    """The key/value up-projection of kv_latent, split per head into (k_nope, value), each flattened over heads."""
    f, lb = lm.facts, lm.binding.layers[L]
    with torch.no_grad():
        up = lb.kv_up(c[f"kv_latent.{L}"])
    b, s, _ = up.shape
    blocks = up.reshape(b, s, f.n_heads, f.qk_nope_head_dim + f.value_head_dim)
    return blocks[..., : f.qk_nope_head_dim].reshape(b, s, -1), blocks[..., f.qk_nope_head_dim :].reshape(b, s, -1)


def test_latents_are_measured_and_the_invariants_hold(lm):
    assert all(lb.q_latent is not None and lb.kv_latent is not None for lb in lm.binding.layers)
    coverage.check_invariants(lm)
    assert_clean(lm)


def test_k_nope_and_value_are_the_up_projection_of_kv_latent(lm):
    """kv_b_proj(kv_latent) holds each head's position-free key then its value: k_nope is the first part, value (what
    the kernel mixes) the second. The previous layer's kv_latent, and the halves swapped, do not give them."""
    n = lm.facts.n_layers
    names = [f"{p}.{L}" for L in range(n) for p in ("kv_latent", "k_nope", "value")]
    c = ie_lab.capture(lm, X, names)
    for L in range(n):
        k, v = _split(lm, L, c)
        torch.testing.assert_close(k, c[f"k_nope.{L}"], **TOL)
        torch.testing.assert_close(v, c[f"value.{L}"], **TOL)
        prev = dict(c)
        prev[f"kv_latent.{L}"] = c[f"kv_latent.{(L - 1) % n}"]
        k_prev, v_prev = _split(lm, L, prev)
        assert not torch.allclose(k_prev, c[f"k_nope.{L}"], **TOL)
        assert not torch.allclose(v_prev, c[f"value.{L}"], **TOL)
        if k.shape == v.shape:
            assert not torch.allclose(v, c[f"k_nope.{L}"], **TOL)
    one = ie_lab.capture(lm, X, ["k_nope.1", "k_nope.1.head-2"])
    d = lm.facts.qk_nope_head_dim
    torch.testing.assert_close(one["k_nope.1.head-2"], one["k_nope.1"][..., 2 * d : 3 * d])


def test_latents_are_the_normed_down_projections_of_attn_in(lm):
    """q_latent = norm(q_a_proj(attn_in)); kv_latent = norm(the latent part of kv_a_proj_with_mqa(attn_in)); the
    previous layer's attn_in does not give them."""
    n = lm.facts.n_layers
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in ("attn_in", "q_latent", "kv_latent")])
    r = lm.facts.kv_lora_rank
    for lb in lm.binding.layers:
        L, a = lb.index, lb.attn
        with torch.no_grad():
            for h, ok in ((c[f"attn_in.{L}"], True), (c[f"attn_in.{(L - 1) % n}"], False)):
                q = lb.q_latent(a.q_a_proj(h))
                kv = lb.kv_latent(a.kv_a_proj_with_mqa(h)[..., :r])
                assert torch.allclose(q, c[f"q_latent.{L}"], **TOL) == ok
                assert torch.allclose(kv, c[f"kv_latent.{L}"], **TOL) == ok


def test_writing_kv_latent_reaches_the_decompressed_keys_and_values(lm):
    clean = ie_lab.capture(lm, X, ["kv_latent.1", "k_nope.1", "value.1", "z.1"])
    seen: dict = {}
    with torch.no_grad(), Writers(lm, [(Address("kv_latent", 1), lambda t, off: t * 0.5)]):
        seen = ie_lab.capture(lm, X, ["kv_latent.1", "k_nope.1", "value.1", "z.1"])
    torch.testing.assert_close(seen["kv_latent.1"], clean["kv_latent.1"] * 0.5, **TOL)
    k, v = _split(lm, 1, seen)
    torch.testing.assert_close(k, seen["k_nope.1"], **TOL)
    torch.testing.assert_close(v, seen["value.1"], **TOL)
    assert not torch.allclose(seen["z.1"], clean["z.1"], **TOL)
    assert_clean(lm)


def test_the_points_refuse_naming_the_structure_elsewhere():
    from ie_lab.toy import tiny_model

    dense = ie_lab.load(*tiny_model("llama"))
    for name in ("q_latent.0", "kv_latent.0", "k_nope.0"):
        with pytest.raises(ie_lab.PointAbsent, match="compressed"):
            ie_lab.capture(dense, X, [name])
    # DeepSeek-V4 compresses its queries only: q_latent is served, the key/value latent refused
    v4 = ie_lab.load(coverage.build_tiny("deepseek_v4"), coverage._tokenizer(), quiet=True)
    assert ie_lab.capture(v4, X, ["q_latent.0"])["q_latent.0"].shape == (*X.shape, v4.facts.q_lora_rank)
    with pytest.raises(ie_lab.PointAbsent, match="no compressed key/value latent"):
        ie_lab.capture(v4, X, ["kv_latent.0"])
    assert_clean(dense)


def test_projecting_z_takes_its_real_width(lm):
    """z on latent attention is heads x v_head_dim wide (64 here), not heads x head_dim (32): directions of the real
    width project (scores = capture @ D.T), one head takes v_head_dim, and the old width is refused naming it."""
    f = lm.facts
    width = f.n_heads * f.value_head_dim
    assert width != f.n_heads * f.head_dim and width == ie_lab.capture(lm, X[:1], ["z.1"])["z.1"].shape[-1]
    D = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    p = ie_lab.project(lm, X[:1], "z.1", D)
    z = ie_lab.capture(lm, X[:1], ["z.1"])["z.1"][0]
    torch.testing.assert_close(p.scores, z @ D.T, **TOL)
    other = ie_lab.capture(lm, X[:1], ["z.0"])["z.0"][0]  # the previous layer's z: same shape, other scores
    assert not torch.allclose(p.scores, other @ D.T, **TOL)
    Dh = torch.randn(2, f.value_head_dim, generator=torch.Generator().manual_seed(2))
    ph = ie_lab.project(lm, X[:1], "z.1.head-1", Dh)
    torch.testing.assert_close(ph.scores, z[..., f.value_head_dim : 2 * f.value_head_dim] @ Dh.T, **TOL)
    with pytest.raises(ie_lab.IELabError, match=str(width)):
        ie_lab.project(lm, X[:1], "z.1", torch.randn(3, f.n_heads * f.head_dim))
    for name, w in (("kv_latent.1", f.kv_lora_rank), ("value.1", width)):
        Dw = torch.randn(2, w, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(
            ie_lab.project(lm, X[:1], name, Dw).scores, ie_lab.capture(lm, X[:1], [name])[name][0] @ Dw.T, **TOL
        )
    assert_clean(lm)


def test_the_config_only_picker_knows_the_latents(lm):
    from ie_lab.widgets.picker import describe

    live = {p["name"]: p for p in describe(lm.facts, "eager", lm=lm)["points"]}
    config = {p["name"]: p for p in describe(lm.facts, "eager")["points"]}
    for name in ("q_latent", "kv_latent", "k_nope", "value", "z", "q_norm_in"):
        assert (config[name]["served"], config[name]["why"]) == (live[name]["served"], live[name]["why"]), name
    assert live["kv_latent"]["served"] == "1" * lm.facts.n_layers
    assert live["z"]["shape"].endswith(f"{lm.facts.n_heads * lm.facts.value_head_dim}]")
