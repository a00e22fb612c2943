"""Four points ie_lab used to refuse and now serves on eager (issue 30 item 7), each against a reference computed
another way than the capture path, and each beside a shape-correct wrong answer that must fail:

- attn_scores on GPT-J (transformers before 5.24) and CodeGen, which compute attention in their own module: read from
  the q and k the module's own attention step receives (arch.attention_tap.STEP), divided as that step divides them.
  Reference: the very tensor the module hands its softmax, intercepted there, and (GPT-J) q·k rebuilt from the
  projection weights with the rotary written out as complex multiplication;
- attn_probs (and attn_scores) on DiffLlama, whose two kernel calls share q and k: the one pattern per head. Reference:
  the softmax of q·k rebuilt from the weights; and the pattern, combined over head pairs with lambda as the module
  combines the calls' outputs, reproduces z;
- expert_weights on Llama 4, whose router returns the weights dense and scales the experts' input by them. Reference:
  the top-k sigmoid of the router's linear map, and the MoE output rebuilt from the experts' weights with them.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, tiny
from ie_lab.arch import quirks

TOL = dict(atol=2e-5, rtol=1e-5)
X = torch.randint(4, 500, (2, 7), generator=torch.Generator().manual_seed(0))
S = X.shape[1]
CAUSAL = torch.ones(S, S, dtype=torch.bool).tril()


def _load(model_type: str, **config_keys):
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny(model_type, **config_keys), coverage._tokenizer(), quiet=True)


def _not_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    fin = torch.isfinite(a) & torch.isfinite(b)
    return a.shape == b.shape and not torch.allclose(a[fin], b[fin], atol=1e-3, rtol=1e-3)


# ---- GPT-J and CodeGen: attn_scores at the module's own attention step ------------------------------------------


@pytest.fixture(scope="module", params=["gptj", "codegen"])
def step_lm(request):
    # eager: on any transformers line the scores then pass through a softmax call the test can intercept
    torch.set_num_threads(1)
    model = tiny.build(coverage.tiny_config(request.param), attn_implementation="eager")
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


def _softmax_inputs(lm) -> list[torch.Tensor]:
    """What each layer's attention step hands torch's softmax, in layer order: the module's own pre-softmax tensor
    (GPT-J calls F.softmax, CodeGen an nn.Softmax, whose forward calls it too)."""
    seen, real = [], torch.nn.functional.softmax

    def spy(x, *args, **kwargs):
        if x.dim() == 4:
            seen.append(x.detach().clone())
        return real(x, *args, **kwargs)

    torch.nn.functional.softmax = spy
    try:
        with torch.no_grad():
            lm.hf(input_ids=X, use_cache=False)
    finally:
        torch.nn.functional.softmax = real
    return seen


def test_in_module_scores_are_what_the_step_hands_its_softmax(step_lm):
    lm = step_lm
    f, lbs = lm.facts, lm.binding.layers
    at_step = all(lb.scores_divisor is not None and not lb.uses_attention_interface for lb in lbs)
    if f.model_type in quirks.ATTENTION_IN_MODULE:  # GPT-J before transformers 5.24: the config-only table agrees
        assert (f.model_type in quirks.SCORES_AT_ATTENTION_STEP) == at_step
    assert at_step or all(lb.uses_attention_interface for lb in lbs)  # newer lines: through the registry
    ref = _softmax_inputs(lm)
    assert len(ref) == f.n_layers
    addrs = [f"attn_scores.{L}" for L in range(f.n_layers)] + [f"attn_probs.{L}" for L in range(f.n_layers)]
    c = ie_lab.capture(lm, X, addrs)
    for L in range(f.n_layers):
        got = c[f"attn_scores.{L}"]
        assert got.shape == (2, f.n_heads, S, S)
        assert torch.all(torch.isneginf(got[..., ~CAUSAL])), "masked entries are -inf, as on every family"
        # the module keeps a large finite negative there (its mask is the dtype's minimum), and equals ours elsewhere
        assert torch.all(ref[L][..., ~CAUSAL] < -1e30)
        torch.testing.assert_close(got[..., CAUSAL], ref[L][..., CAUSAL], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.softmax(got, -1), c[f"attn_probs.{L}"], **TOL)
        # shape-correct wrong answers: the other layer's scores, the probabilities, q·k undivided or multiplied
        div = f.head_dim**0.5
        other = c[f"attn_scores.{1 - L}"]
        for wrong in (other, c[f"attn_probs.{L}"], got * div, got * div * div):
            assert _not_close(wrong, ref[L].masked_fill(~CAUSAL, float("-inf")))


def _rotate_pairs(t: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """GPT-J's rotary on [b, s, H, d]: each (even, odd) pair of the first rotary_dim dims is a complex number turned by
    position * 10000^(-2i / rotary_dim); the rest pass unchanged."""
    b, s, h, d = t.shape
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / rotary_dim)  # [s, rotary_dim/2]
    pairs = torch.view_as_complex(t[..., :rotary_dim].double().reshape(b, s, h, -1, 2).contiguous())
    turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[None, :, None, :])
    return torch.cat([turned.reshape(b, s, h, rotary_dim).float(), t[..., rotary_dim:]], dim=-1)


def test_gptj_scores_equal_q_dot_k_rebuilt_from_the_weights():
    lm = _load("gptj")
    f, L = lm.facts, 1
    attn = lm.binding.layers[L].attn
    c = ie_lab.capture(lm, X, [f"attn_in.{L}", f"attn_scores.{L}"])
    with torch.no_grad():
        q, k = (proj(c[f"attn_in.{L}"]).reshape(2, S, f.n_heads, f.head_dim) for proj in (attn.q_proj, attn.k_proj))
        q, k = (_rotate_pairs(t, attn.rotary_dim).transpose(1, 2) for t in (q, k))
    want = (q @ k.transpose(-1, -2) / f.head_dim**0.5).masked_fill(~CAUSAL, float("-inf"))
    torch.testing.assert_close(c[f"attn_scores.{L}"], want, atol=1e-5, rtol=1e-4)
    # without the rotary (the projections' raw q·k): the same shape, another tensor
    with torch.no_grad():
        raw = [p(c[f"attn_in.{L}"]).reshape(2, S, f.n_heads, -1).transpose(1, 2) for p in (attn.q_proj, attn.k_proj)]
    assert _not_close((raw[0] @ raw[1].transpose(-1, -2)) / f.head_dim**0.5, want)


def test_gptj_scores_during_generation_equal_one_forward_and_leave_no_wrapper():
    lm = _load("gptj")
    res = ie_lab.generate(lm, X[:1], 3, capture=["attn_scores.0"])
    full = torch.cat([X[:1], torch.tensor([res.ids])], dim=1)
    one = ie_lab.capture(lm, full, ["attn_scores.0"])
    torch.testing.assert_close(res.cache["attn_scores.0"], one["attn_scores.0"], atol=1e-5, rtol=1e-5)
    assert all("_attn" not in lb.attn.__dict__ for lb in lm.binding.layers)  # the step is the class's again
    att = ie_lab.attention(lm, X[:1], [0, 1])  # the attention view reads them too
    assert not att.notes and att.scores[1] is not None
    torch.testing.assert_close(att.scores[1], ie_lab.capture(lm, X[:1], ["attn_scores.1"])["attn_scores.1"][0])


def test_bloom_still_refuses_its_scores():
    lm = _load("bloom")
    assert all(lb.scores_divisor is None for lb in lm.binding.layers)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="never leaves that module"):
        ie_lab.capture(lm, X, ["attn_scores.0"])


# ---- DiffLlama: the one pattern per head both kernel calls share ------------------------------------------------


def _rotate_half(t: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary on [b, H, s, d]: dims i and i + d/2 turned together by position * theta^(-2i / d)."""
    d = t.shape[-1]
    angle = torch.arange(S, dtype=torch.float32)[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    a, b = t[..., : d // 2], t[..., d // 2 :]
    return t * cos + torch.cat([-b, a], dim=-1) * sin


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_diffllama_pattern_is_the_softmax_of_q_dot_k_and_combined_reproduces_z(impl):
    torch.set_num_threads(1)
    model = tiny.build(coverage.tiny_config("diffllama"), attn_implementation=impl)
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    f, L = lm.facts, 1
    H, KV, d, half = f.n_heads, f.n_kv_heads, f.head_dim, f.n_heads // 2
    attn = lm.hf.model.layers[L].self_attn
    assert [lb.kernel_calls for lb in lm.binding.layers] == [2, 2] and lm.binding.layers[L].kernel_same_qk
    names = [f"attn_in.{L}", f"attn_scores.{L}", f"attn_probs.{L}", f"value.{L}", f"z.{L}", "attn_probs.0"]
    c = ie_lab.capture(lm, X, names)
    theta = model.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        q = _rotate_half(attn.q_proj(c[f"attn_in.{L}"]).reshape(2, S, H, d).transpose(1, 2), theta)
        k = _rotate_half(attn.k_proj(c[f"attn_in.{L}"]).reshape(2, S, KV, d).transpose(1, 2), theta)
    k = k.repeat_interleave(H // KV, dim=1)
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~CAUSAL, float("-inf"))
    probs = c[f"attn_probs.{L}"]
    assert probs.shape == (2, H, S, S)
    torch.testing.assert_close(c[f"attn_scores.{L}"], scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(probs, torch.softmax(scores, -1), atol=1e-5, rtol=1e-4)
    # Head h mixes both halves of its key/value group's value (one per kernel call); the layer combines heads j and
    # j + H/2 as out_j - lambda * out_(j+H/2), normed: pair j's differential map times their shared value is z.
    v = c[f"value.{L}"].reshape(2, S, KV, d).transpose(1, 2)
    v_both = torch.cat([h.repeat(1, 2, 1, 1) for h in v.chunk(2, dim=1)], dim=-1).repeat_interleave(H // KV, 1)
    with torch.no_grad():
        lam = (
            torch.exp((attn.lambda_q1 * attn.lambda_k1).sum())
            - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
            + attn.lambda_init
        )
    assert torch.equal(v_both[:, :half], v_both[:, half:])  # a pair shares its value: one map per pair mixes it

    def z_from(maps: torch.Tensor) -> torch.Tensor:
        out = (maps @ v_both[:, :half]).transpose(1, 2)  # [b, s, H/2, 2d]
        with torch.no_grad():
            return ((1 - attn.lambda_init) * attn.groupnorm(out)).reshape(2, S, -1)

    differential = probs[:, :half] - lam * probs[:, half:]
    torch.testing.assert_close(z_from(differential), c[f"z.{L}"], atol=2e-4, rtol=1e-4)
    # wrong answers: one of the pair's maps alone, the other layer's pattern, the differential map as the pattern
    assert _not_close(z_from(probs[:, :half]), c[f"z.{L}"])
    assert _not_close(z_from(c["attn_probs.0"][:, :half] - lam * c["attn_probs.0"][:, half:]), c[f"z.{L}"])
    assert _not_close(differential.repeat(1, 2, 1, 1), probs)
    assert any("differential attention" in n for n in lm.binding.notes)
    att = ie_lab.attention(lm, X[:1], [L])
    torch.testing.assert_close(att.probs[L], probs[0])


# ---- Llama 4: expert_weights from the router's dense scores ----------------------------------------------------


def test_llama4_expert_weights_are_the_top_k_sigmoid_the_experts_input_is_scaled_by():
    lm = _load("llama4_text", num_experts_per_tok=2)
    f = lm.facts
    k, E = f.experts_per_token, f.n_experts
    assert k == 2
    moe_layers = [lb.index for lb in lm.binding.layers if lb.sparse_moe]
    assert moe_layers
    for L in moe_layers:
        moe = lm.binding.layers[L].mlp_in_module
        names = [f"mlp_in.{L}", f"expert_weights.{L}", f"router_logits.{L}", f"mlp_out.{L}"]
        c = ie_lab.capture(lm, X, names)
        x, w = c[f"mlp_in.{L}"], c[f"expert_weights.{L}"]
        assert w.shape == (2, S, E)
        logits = x @ moe.router.weight.detach().T
        top = logits.topk(k, dim=-1)
        want = torch.zeros_like(logits).scatter(-1, top.indices, top.values.sigmoid())
        torch.testing.assert_close(w, want, **TOL)
        assert torch.all((w != 0).sum(-1) == k)
        # the MoE output rebuilt from the experts' weights: each expert reads the tokens scaled by its weight
        ex = moe.experts
        with torch.no_grad():
            out = moe.shared_expert(x)
            for e in range(E):
                gate, up = (w[..., e : e + 1] * x @ ex.gate_up_proj[e]).chunk(2, dim=-1)
                out = out + (up * ex.act_fn(gate)) @ ex.down_proj[e]
        torch.testing.assert_close(out, c[f"mlp_out.{L}"], atol=2e-4, rtol=1e-4)
        # wrong answers: the unnormalised logits where selected, a softmax over them, the sigmoid of every logit
        for wrong in (
            torch.zeros_like(logits).scatter(-1, top.indices, top.values),
            torch.softmax(logits, -1),
            logits.sigmoid(),
        ):
            assert _not_close(wrong, w)
    if len(moe_layers) > 1:
        c = ie_lab.capture(lm, X, [f"expert_weights.{L}" for L in moe_layers[:2]])
        assert _not_close(c[f"expert_weights.{moe_layers[0]}"], c[f"expert_weights.{moe_layers[1]}"])
    # the selection alone is still refused: the router returns no indices and the experts module is handed none
    with pytest.raises(ie_lab.CapabilityUnsupported, match="routing weights"):
        ie_lab.capture(lm, X, [f"expert_indices.{moe_layers[0]}"])
