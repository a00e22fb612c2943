"""Zamba 2 on the vLLM backend (issue 20 item 5).

Every Zamba 2 layer is one block around a Mamba 2 mixer whose output the layer adds to the stream itself. On its
"hybrid" layers a transformer block shared across layers (its weights tied between every num_mem_blocks-th hybrid
layer, with per-layer adapters) reads the stream concatenated with the embeddings, and its output, through the
layer's own linear, joins the mixer's input before the input norm rather than the stream. Eager binds each layer's
one sublayer as the mixer (quirks.SINGLE_SUBLAYER_BLOCKS) and refuses the shared block's attention and MLP points;
vLLM serves the same points at the same modules (sites._zamba2_layer). Built with three hybrid layers over two shared
blocks (so one block serves two layers), rotary embedding and attention adapters on, each served point equals eager's
at its own scale; the previous layer's tensor, the layer that shares the block, the other side of the mixer's add and
the mixer's input without the shared block's contribution (all shape-correct) do not; greedy tokens equal
transformers', steering equals eager's, graph mode reads and steers the same sites, and a config vLLM cannot load
(fewer key/value heads than query heads) is refused before vLLM starts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab import coverage  # noqa: E402
from ie_lab.arch import quirks  # noqa: E402
from ie_lab.eager.lens import logit_lens  # noqa: E402
from tests.vllm_helpers import (  # noqa: E402
    TEXT,
    assert_graph_mode_equals_eager,
    assert_steering_equals_eager,
    near,
    served_addresses,
    tiny_session,
)

# attention head_dim 32 (2 * hidden_size / heads) and Mamba heads of 32 for vLLM's CPU kernels; a Mamba layer, then
# three hybrid layers over two shared blocks (layers 1 and 3 share block 0, each with its own adapters); weights drawn
# wider than the default 0.02 so that greedy tokens vary and the shared block's share of the mixer input is large
ZAMBA2 = {
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 32,
    "mamba_headdim": 32,
    "layer_types": ["mamba", "hybrid", "hybrid", "hybrid"],
    "hybrid_layer_ids": [1, 2, 3],
    "num_hidden_layers": 4,
    "num_mem_blocks": 2,
    "use_mem_rope": True,
    "use_shared_attention_adapter": True,
    "initializer_range": 0.05,
}
_PER_LAYER = ("resid_pre", "mixer_in", "mixer_out", "mixer_out_post", "resid_post")
# family -> (config overrides, steered addresses): the shape tests/vllm_tp_script.py reads hybrid configs in
SERVED = {
    "zamba2": (
        ZAMBA2,
        ("mixer_out.0", "mixer_in.1", "mixer_out_post.2", "mixer_out.3", "resid_pre.0", "resid_pre.2", "resid_post.1"),
    )
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_session("zamba2", ZAMBA2, tmp_path_factory) as (s, eager, path):
        yield s, eager, path


def test_points_equal_eager_and_neighbours_do_not(served):
    s, eager, _ = served
    hf = eager.hf.model
    kinds = [type(x).__name__ for x in hf.layers]
    assert kinds == ["Zamba2MambaDecoderLayer"] + ["Zamba2HybridLayer"] * 3
    # the build ties the shared block of layers 1 and 3 (what makes the pair below a neighbour worth refusing)
    w1, w3 = (hf.layers[i].shared_transformer.self_attn.q_proj.weight for i in (1, 3))
    assert w1.data_ptr() == w3.data_ptr()
    assert hf.layers[1].shared_transformer.self_attn.q_proj.weight.data_ptr() != (
        hf.layers[2].shared_transformer.self_attn.q_proj.weight.data_ptr()
    )
    n = s.facts.n_layers
    addrs = served_addresses(s)
    # what eager serves on Zamba 2 that vLLM reads (mixer states live in vLLM's paged cache; lm_head is folded)
    assert sorted(addrs) == sorted(["embeddings", "final_norm"] + [f"{p}.{L}" for p in _PER_LAYER for L in range(n)])
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not near(c[a], ce[a])] == []
    pairs = [(p, L, p, (L - 1) % n) for L in range(n) for p in _PER_LAYER]  # the previous layer's
    pairs += [(p, 3, p, 1) for p in ("mixer_in", "mixer_out")]  # the other layer on the same shared block
    pairs += [("mixer_out", L, "resid_post", L) for L in range(n)]  # the other side of the layer's add
    for p, i, q, j in pairs:
        mine, theirs = f"{p}.{i}", f"{q}.{j}"
        assert c[theirs].shape == ce[mine].shape
        assert not near(c[theirs], ce[mine]), (mine, theirs)
    # the other branch: a hybrid layer's mixer input is the norm of the stream plus the shared block's output; the
    # norm of the stream alone (shape-correct) must not pass, or the shared block's share would go unchecked
    with torch.no_grad():
        for L in (1, 2, 3):
            alone = hf.layers[L].mamba_decoder.input_layernorm(ce[f"resid_pre.{L}"])
            assert not near(c[f"mixer_in.{L}"], alone), L
    lens, want_lens = s.logit_lens(TEXT, k=3), logit_lens(eager, TEXT, k=3)
    assert torch.equal(lens.top_ids, want_lens.top_ids)
    assert torch.allclose(lens.top_probs, want_lens.top_probs, atol=1e-4)
    g = s.generate(TEXT, 12)
    with torch.no_grad():
        want = eager.hf.generate(g.prompt_ids.reshape(1, -1), max_new_tokens=12, do_sample=False)
    assert g.ids == want[0, g.prompt_ids.numel() :].tolist()
    assert len(set(g.ids)) > 3  # tokens that vary: a constant stream would hide a wrong logit
    assert s.worker_state()[0]["specs"] == []


@pytest.mark.parametrize("point", ["attn_in", "attn_out", "resid_mid", "mlp_in", "mlp_out"])
def test_shared_block_points_are_refused_as_on_eager(served, point):
    """The shared block's attention and MLP are bound on neither backend: vLLM refuses them in eager's words (the
    hybrid layer's kind), and on the Mamba layer as a mixer-only block."""
    s, eager, _ = served
    for L in (0, 1):
        with pytest.raises(ie_lab.PointAbsent) as want:
            ie_lab.capture(eager, TEXT, [f"{point}.{L}"])
        with pytest.raises(ie_lab.PointAbsent) as got:
            s.capture(TEXT, [f"{point}.{L}"])
        # the same reason and fix (eager names the point, vLLM the address)
        assert str(got.value).partition(" does not exist")[2] == str(want.value).partition(" does not exist")[2]
    assert "shared across layers" in str(got.value)


def test_mixer_state_is_refused_with_why(served):
    s, eager, _ = served
    ie_lab.capture(eager, TEXT, ["mixer_state.1"])  # eager reads it from transformers' cache
    with pytest.raises(ie_lab.CapabilityUnsupported, match="paged state cache"):
        s.capture(TEXT, ["mixer_state.1"])


def test_steering_equals_eager(served):
    """Steering a mixer's input or output, or the stream before or after a layer (a hybrid layer's input feeds its
    shared block and its mixer alike; the embeddings the shared block also reads stay as they were), gives eager's
    downstream stream."""
    s, eager, _ = served
    assert_steering_equals_eager(s, eager, SERVED["zamba2"][1], f"resid_post.{s.facts.n_layers - 1}", same=near)


def test_graph_mode_reads_and_steers_the_same_sites(served):
    """Graph mode's static taps and steering buffers sit on the same sites inside the compiled trunk."""
    _, eager, path = served
    pts = ["mixer_out.1", "mixer_in.3", "resid_pre.2", "mixer_out_post.0", "resid_post.3"]
    assert_graph_mode_equals_eager(path, eager, pts, same=near)


def test_fewer_key_value_heads_are_refused_before_vllm_starts(tmp_path):
    """transformers' Zamba 2 runs grouped-query attention; vLLM's loads no such checkpoint (its error is quoted)."""
    key, other, why = quirks.VLLM_CONFIG_EQUAL["zamba2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(coverage.OVERRIDES, "zamba2", {**coverage.OVERRIDES["zamba2"], **ZAMBA2, key: 4})
        cfg = coverage.tiny_config("zamba2")
    assert getattr(cfg, key) == 4 and getattr(cfg, other) == 8
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        ie_lab.Session(str(tmp_path), backend="vllm", progress=False, replace=False)
    assert why in str(e.value) and "backend='eager'" in str(e.value)
