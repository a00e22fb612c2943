"""Hyper-connection trunks (issue 20 item 4): DeepSeek-V4 and HY-V4 carry a [batch, seq, n_streams, d_model] stack of
residual streams. The residual points are served per stream (`resid_pre.L.stream-S`), the stack as resid_streams, and
the hyper-connection modules' own outputs as the collapse / write / mix points; the sublayer points exchange one
vector per token as on any trunk.

Every identity is also checked with a shape-correct neighbour (another stream's tensor, the previous layer's, the
other sublayer's, the matrix transposed): it must fail there.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, points
from ie_lab.address import Address
from ie_lab.eager.writers import Writers
from ie_lab.errors import IELabError
from tests.conftest import assert_clean

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)
EXACT = dict(atol=1e-6, rtol=1e-5)
N = 4  # hc_mult of both families' configs


def _tiny(family: str):
    """The coverage instance, with its hyper-connection weights re-drawn large: at their initial scale every stream
    gets nearly the same weight, so a neighbour stream's tensor would pass where the right one must."""
    model = coverage.build_tiny(family)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("HyperConnection"):
                m.fn.copy_(torch.randn(m.fn.shape, generator=gen) * 3 / m.fn.shape[1] ** 0.5)
                m.base.copy_(torch.rand(m.base.shape, generator=gen) * 2 - 1)
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


@pytest.fixture(scope="module", params=["deepseek_v4", "hy_v4"])
def lm(request):
    torch.set_num_threads(1)
    return _tiny(request.param)


def _stack(c, point: str, L: int) -> torch.Tensor:
    return torch.stack([c[f"{point}.{L}.stream-{s}"] for s in range(N)], dim=-2)


def _capture_layer(lm, L: int):
    names = [f"{p}.{L}.stream-{s}" for p in ("resid_pre", "resid_mid", "resid_post") for s in range(N)]
    names += [f"{p}.{L}" for p in ("resid_streams", "attn_in", "attn_out", "mlp_in", "mlp_out")]
    names += [f"{k}_stream_{r}.{L}" for k in ("attn", "mlp") for r in ("collapse", "write")]
    if lm.binding.layers[L].stream_mix:
        names += [f"attn_stream_mix.{L}", f"mlp_stream_mix.{L}"]
    return ie_lab.capture(lm, X, names)


def _mixed(before: torch.Tensor, mix: torch.Tensor | None, write: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """stream j = sum_i mix[.., i, j] * before stream i (unmixed without a matrix) + write[.., j] * out."""
    x = before if mix is None else torch.einsum("bsij,bsid->bsjd", mix, before)
    return x + write.unsqueeze(-1) * out.unsqueeze(-2)


def test_binds_with_every_invariant(lm):
    assert lm.facts.n_streams == N
    assert all(lb.attn_hc is not None and lb.mlp_hc is not None for lb in lm.binding.layers)
    # DeepSeek-V4 mixes the streams by a (Sinkhorn-normalised) matrix; HY-V4 carries them on unmixed
    assert all(lb.stream_mix == (lm.facts.model_type == "deepseek_v4") for lb in lm.binding.layers)
    coverage.check_invariants(lm)
    assert_clean(lm)


def test_stream_identities_fail_with_neighbour_tensors(lm):
    """resid_mid and resid_post per stream from the mix, the write weights and the sublayer output: another stream's
    weight, the other sublayer's weights, the previous layer's output and the transposed matrix all break them."""
    n = lm.facts.n_layers
    caps = {L: _capture_layer(lm, L) for L in range(n)}
    for L in range(n):
        c, prev = caps[L], caps[(L - 1) % n]
        mix = c.get(f"attn_stream_mix.{L}") if lm.binding.layers[L].stream_mix else None
        pre, mid = _stack(c, "resid_pre", L), _stack(c, "resid_mid", L)
        w = c[f"attn_stream_write.{L}"]
        torch.testing.assert_close(_mixed(pre, mix, w, c[f"attn_out.{L}"]), mid, **TOL)
        mlp_mix = c.get(f"mlp_stream_mix.{L}") if mix is not None else None
        torch.testing.assert_close(
            _mixed(mid, mlp_mix, c[f"mlp_stream_write.{L}"], c[f"mlp_out.{L}"]), _stack(c, "resid_post", L), **TOL
        )
        wrong = {
            "another stream's write weight": _mixed(pre, mix, w.roll(1, dims=-1), c[f"attn_out.{L}"]),
            "the MLP's write weights": _mixed(pre, mix, c[f"mlp_stream_write.{L}"], c[f"attn_out.{L}"]),
            "the previous layer's attn_out": _mixed(pre, mix, w, prev[f"attn_out.{(L - 1) % n}"]),
        }
        # layer 0 reads the embedding copied into every stream: the streams (and so their order and the matrix's
        # orientation, which is doubly stochastic) only tell apart from layer 1 on
        if L > 0:
            wrong["another stream's resid_pre"] = _mixed(pre.roll(1, dims=-2), mix, w, c[f"attn_out.{L}"])
        if mix is not None and L > 0:
            wrong["the matrix transposed"] = _mixed(pre, mix.transpose(-1, -2), w, c[f"attn_out.{L}"])
            wrong["the MLP's matrix"] = _mixed(pre, c[f"mlp_stream_mix.{L}"], w, c[f"attn_out.{L}"])
        for what, t in wrong.items():
            assert t.shape == mid.shape
            assert not torch.allclose(t, mid, **TOL), f"layer {L}: {what} explains resid_mid"


def test_stream_slices_are_the_stack_and_chain_across_layers(lm):
    n = lm.facts.n_layers
    caps = {L: _capture_layer(lm, L) for L in range(n)}
    emb = ie_lab.capture(lm, X, ["embeddings"])["embeddings"]
    for L in range(n):
        c = caps[L]
        stack = c[f"resid_streams.{L}"]
        assert stack.shape == (*X.shape, N, lm.facts.d_model)
        for s in range(N):
            torch.testing.assert_close(c[f"resid_pre.{L}.stream-{s}"], stack[..., s, :])
            if L > 0:  # streams differ once a layer has written them with different weights
                # (the sublayers' contributions are small beside the embedding here: compare at float precision)
                assert not torch.allclose(c[f"resid_pre.{L}.stream-{s}"], stack[..., (s + 1) % N, :], **EXACT)
        if L + 1 < n:
            torch.testing.assert_close(_stack(caps[L + 1], "resid_pre", L + 1), _stack(c, "resid_post", L))
            assert not torch.allclose(_stack(caps[L + 1], "resid_pre", L + 1), _stack(c, "resid_mid", L), **EXACT)
    # the trunk copies the embedding into every stream before layer 0
    for s in range(N):
        torch.testing.assert_close(caps[0][f"resid_pre.0.stream-{s}"], emb)


def test_collapses_are_what_the_sublayers_read(lm):
    """attn_in is the input norm of attn_stream_collapse (mlp_in: the pre-MLP norm of mlp_stream_collapse); the other
    sublayer's collapse and the previous layer's do not give it."""
    n = lm.facts.n_layers
    caps = {L: _capture_layer(lm, L) for L in range(n)}
    for lb in lm.binding.layers:
        L, c, prev = lb.index, caps[lb.index], caps[(lb.index - 1) % n]
        with torch.no_grad():
            for k, other, norm in (("attn", "mlp", lb.input_norm), ("mlp", "attn", lb.pre_mlp_norm)):
                assert norm is not None
                torch.testing.assert_close(norm(c[f"{k}_stream_collapse.{L}"]), c[f"{k}_in.{L}"], **TOL)
                for wrong in (c[f"{other}_stream_collapse.{L}"], prev[f"{k}_stream_collapse.{(L - 1) % n}"]):
                    assert not torch.allclose(norm(wrong), c[f"{k}_in.{L}"], **TOL)


def test_unstreamed_and_absent_points_are_refused_naming_the_structure(lm):
    fam = lm.facts.model_type
    for name in ("resid_pre.0", "resid_mid.1", "resid_post.1"):
        with pytest.raises(ie_lab.PointAbsent, match=r"4 parallel residual streams.*stream-0 \.\.\. .*stream-3"):
            ie_lab.capture(lm, X, [name])
    for name in ("attn_out_post.0", "mlp_out_post.1"):
        with pytest.raises(ie_lab.PointAbsent, match="stream_write"):
            ie_lab.capture(lm, X, [name])
    with pytest.raises(ie_lab.AddressError, match="4 residual stream"):
        ie_lab.capture(lm, X, ["resid_post.0.stream-4"])
    with pytest.raises(ie_lab.AddressError, match="already spans every stream"):
        ie_lab.capture(lm, X, ["resid_streams.0.stream-1"])
    if fam == "hy_v4":
        with pytest.raises(ie_lab.PointAbsent, match="unmixed"):
            ie_lab.capture(lm, X, ["attn_stream_mix.0"])
    # every point at every layer is served or refused with an IELabError, with or without a stream
    for p in points.all_points():
        for L in range(lm.facts.n_layers) if p.scope is points.Scope.LAYER else [None]:
            for stream in (None, 1) if p.per_stream else (None,):
                try:
                    ie_lab.capture(lm, X[:1], [Address(p.name, L, stream=stream)])
                except IELabError:
                    pass
    assert_clean(lm)


def test_a_stream_on_a_single_stream_trunk_is_refused_with_the_fix():
    from ie_lab.toy import tiny_model

    single = ie_lab.load(*tiny_model("llama"))
    with pytest.raises(ie_lab.AddressError, match="single residual stream: drop '.stream-1'"):
        ie_lab.capture(single, X, ["resid_post.0.stream-1"])
    with pytest.raises(ie_lab.PointAbsent, match="single residual stream"):
        ie_lab.capture(single, X, ["resid_streams.0"])


@pytest.mark.parametrize("point", ["resid_pre", "resid_post"])
def test_steering_one_stream_moves_only_that_stream(lm, point):
    """Adding v at resid_pre.1.stream-2 adds exactly v to that stream and leaves the other streams of the stack as
    they were; the layer's output moves. The hooks are gone afterwards."""
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3))
    names = [f"{point}.1.stream-{s}" for s in range(N)] + ["resid_post.1.stream-0", "attn_in.1"]
    before = ie_lab.capture(lm, X, names)
    with ie_lab.steer(lm, f"{point}.1.stream-2", v):
        after = ie_lab.capture(lm, X, names)
    torch.testing.assert_close(after[f"{point}.1.stream-2"], before[f"{point}.1.stream-2"] + v, **TOL)
    for s in (0, 1, 3):
        torch.testing.assert_close(after[f"{point}.1.stream-{s}"], before[f"{point}.1.stream-{s}"])
    if point == "resid_pre":  # attention reads the collapse of the edited stack
        assert not torch.allclose(after["attn_in.1"], before["attn_in.1"], **TOL)
    assert_clean(lm)
    again = ie_lab.capture(lm, X, names)
    torch.testing.assert_close(again[f"{point}.1.stream-2"], before[f"{point}.1.stream-2"])


def test_writes_that_no_boundary_carries_are_refused(lm):
    with pytest.raises(ie_lab.CapabilityUnsupported, match="mixing sum"):
        with Writers(lm, [(Address("resid_mid", 0, stream=1), lambda t, off: t)]):
            pass
    if lm.facts.model_type == "deepseek_v4":  # z is the kernel's output, rotated back before a two-step projection
        with pytest.raises(ie_lab.CapabilityUnsupported, match="another width"):
            with Writers(lm, [(Address("z", 0), lambda t, off: t)]):
                pass
    assert_clean(lm)


def test_compressed_attention_layers_refuse_per_token_attention_points():
    """DeepSeek-V4's compressed layers attend to entries their compressor builds after the tokens' own: value and
    the pattern are refused there naming the compressor; its sliding layer serves them (probs @ value = z). The
    config-only picker greys the same layers."""
    lm = _tiny("deepseek_v4")
    kinds = [lb.kv_compressor for lb in lm.binding.layers]
    assert kinds == ["", "compressed_sparse_attention", "heavily_compressed_attention"]
    from ie_lab.widgets.picker import describe

    config = {p["name"]: p["served"] for p in describe(lm.facts, "eager")["points"]}
    assert config["value"] == config["attn_probs"] == "100"
    for L in range(1, len(kinds)):
        for name in ("value", "attn_probs", "attn_scores"):
            with pytest.raises(ie_lab.PointAbsent, match="compressor builds from blocks of tokens"):
                ie_lab.capture(lm, X, [f"{name}.{L}"])
        assert ie_lab.capture(lm, X, [f"z.{L}"])[f"z.{L}"].shape == (*X.shape, lm.facts.n_heads * lm.facts.head_dim)
    c = ie_lab.capture(lm, X, ["attn_probs.0", "value.0", "z.0", "z.1"])
    z = (c["attn_probs.0"] @ c["value.0"].unsqueeze(1)).transpose(1, 2).reshape(c["z.0"].shape)
    torch.testing.assert_close(z, c["z.0"], **TOL)
    assert not torch.allclose(z, c["z.1"], **TOL)  # the next layer's z (same shape) is not this mix


def test_generation_captures_a_stream(lm):
    out = ie_lab.generate(lm, X[:1, :4], max_new_tokens=2, capture=["resid_post.0.stream-1"])
    assert out is not None
    assert_clean(lm)


def test_the_config_only_picker_knows_what_the_binder_measured(lm):
    """The cheat sheet drawn from the config alone greys the same points on the same layers, for the same reason, as
    the picker on the loaded model: the stream points, the mix where there is none, the compressed layers' patterns,
    the hash-routed MoE layer, HY-V4's attention gate."""
    from ie_lab.widgets.picker import describe

    live = {p["name"]: p for p in describe(lm.facts, "eager", lm=lm)["points"]}
    config = {p["name"]: p for p in describe(lm.facts, "eager")["points"]}
    for name in live:
        assert (config[name]["served"], config[name]["why"]) == (live[name]["served"], live[name]["why"]), name
    assert live["resid_pre"]["served"] == "1" * lm.facts.n_layers  # served with a stream named
    assert live["attn_out_post"]["served"] == "0" * lm.facts.n_layers


def test_alternating_updates_are_refused_naming_them():
    """Gemma 3n's layer reads a (4, batch, seq, d) stack that its AltUp module predicts and corrects inside its own
    methods: refused with an IELabError that names the structure (it crashed with a TypeError once)."""
    with pytest.raises(IELabError, match=r"parallel residual streams.*altup module predicts every stream"):
        ie_lab.load(coverage.build_tiny("gemma3n_text"), coverage._tokenizer(), quiet=True)


def test_the_logit_lens_reads_the_streams_through_the_trunks_own_collapse(lm):
    """On several streams the lens collapses a layer's stack with the module the trunk ends with (measured: it reads
    the last layer's stack and hands the final norm its input): the last layer's lens is the model's logits. One
    stream decoded alone, or the layer before, does not give them."""
    from ie_lab.eager.lens import decode_residual

    x = X[:1]
    assert lm.binding.stream_head is not None
    r = ie_lab.logit_lens(lm, x, keep_logits=True)
    with torch.no_grad():
        logits = lm.hf(input_ids=x, use_cache=False).logits[0]
    n = lm.facts.n_layers
    torch.testing.assert_close(r.logits[n - 1], logits, **TOL)
    assert not torch.allclose(r.logits[n - 2], logits, **TOL)
    one = ie_lab.capture(lm, x, [f"resid_post.{n - 1}.stream-0"])[f"resid_post.{n - 1}.stream-0"][0]
    assert not torch.allclose(decode_residual(lm, one), logits, **TOL)
    assert_clean(lm)
