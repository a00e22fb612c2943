import pytest
import torch

import ie_lab
from tests.conftest import SUPPORTED, assert_clean, lm_for

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
OTHER = torch.tensor([[5, 6, 7, 30, 9, 10, 11]])


@pytest.mark.parametrize("fam", SUPPORTED)
def test_last_layer_lens_is_the_models_own_prediction(fam):
    lm = lm_for(fam)
    last = lm.facts.n_layers - 1
    res = ie_lab.logit_lens(lm, PROMPT, layers=[0, last], k=3, keep_logits=True)
    with torch.no_grad():
        logits = lm.hf(input_ids=PROMPT).logits[0]
    torch.testing.assert_close(res.logits[-1], logits, atol=2e-4, rtol=1e-4)
    assert torch.equal(res.top_ids[-1, :, 0], logits.argmax(-1))
    assert res.top_probs.shape == (2, PROMPT.shape[1], 3)
    assert_clean(lm)


def test_lens_states_the_post_processing():
    assert "soft-capped at 2.0" in ie_lab.logit_lens(lm_for("gemma2"), PROMPT).note
    assert "divided by" in ie_lab.logit_lens(lm_for("granite"), PROMPT).note
    assert "no further" in ie_lab.logit_lens(lm_for("llama"), PROMPT).note


def test_identity_transport_changes_nothing_and_a_real_one_does():
    lm = lm_for("llama")
    d = lm.facts.d_model
    plain = ie_lab.logit_lens(lm, PROMPT, layers=[0], keep_logits=True)
    ident = ie_lab.logit_lens(lm, PROMPT, layers=[0], keep_logits=True, transports={0: (torch.eye(d), torch.zeros(d))})
    torch.testing.assert_close(plain.logits, ident.logits)
    other = ie_lab.logit_lens(lm, PROMPT, layers=[0], keep_logits=True, transports={0: lambda h: -h})
    assert not torch.allclose(plain.logits, other.logits)


def test_fitted_tuned_lens_beats_the_plain_lens_on_held_out_text():
    lm = lm_for("llama")
    g = torch.Generator().manual_seed(0)
    corpus = [torch.randint(4, 512, (1, 32), generator=g) for _ in range(60)]
    held = torch.randint(4, 512, (1, 24), generator=g)
    tuned = ie_lab.fit_tuned_lens(lm, corpus, layers=[0])
    with torch.no_grad():
        target = torch.log_softmax(lm.hf(input_ids=held).logits[0], -1)

    def kl(res):
        lp = torch.log_softmax(res.logits[0], -1)
        return float((target.exp() * (target - lp)).sum(-1).mean())

    plain = ie_lab.logit_lens(lm, held, layers=[0], keep_logits=True)
    fitted = ie_lab.logit_lens(lm, held, layers=[0], keep_logits=True, transports=tuned.transports)
    assert kl(fitted) < kl(plain)


def test_lens_of_a_point_without_readout_is_refused():
    with pytest.raises(ie_lab.AddressError, match="no read-out"):
        ie_lab.logit_lens(lm_for("llama"), PROMPT, point="mlp_act")


@pytest.mark.parametrize("fam", ["llama", "gemma2", "mistral_sliding", "gemma3_text", "bloom"])
def test_attention_function(fam):
    lm = lm_for(fam) if fam != "bloom" else lm_for(fam, "eager")
    res = ie_lab.attention(lm, PROMPT, layers=[0, 1])
    assert res.probs[0].shape == (lm.facts.n_heads, 7, 7)
    assert res.value[1].shape == (7, lm.facts.n_kv_heads, lm.facts.head_dim)
    assert len(res.str_tokens) == 7
    if fam == "bloom":
        assert res.scores[0] is None and "scores unavailable" in res.notes[0]
    else:
        torch.testing.assert_close(torch.softmax(res.scores[0], -1), res.probs[0], atol=1e-5, rtol=1e-4)
    if lm.facts.sliding_window and lm.facts.layer_kinds[0] == "sliding":
        w = lm.facts.sliding_window
        assert torch.all(res.probs[0][:, 6, : 7 - w] == 0), "keys outside the window get no attention"


def test_patching_a_prompt_into_itself_changes_nothing():
    lm = lm_for("llama")
    metric = ie_lab.logit_diff(40, 41)
    grid = ie_lab.patch_sweep(lm, PROMPT, PROMPT, metric, progress=False)
    assert torch.allclose(grid.values, torch.full_like(grid.values, grid.clean), atol=1e-5)
    heads = ie_lab.patch_sweep(lm, PROMPT, PROMPT, metric, over="layer_head", progress=False)
    assert heads.values.shape == (2, lm.facts.n_heads)
    assert torch.allclose(heads.values, torch.full_like(heads.values, heads.clean), atol=1e-5)
    assert_clean(lm)


def test_patching_clean_into_corrupted():
    lm = lm_for("llama")
    metric = ie_lab.logit_diff(40, 41)
    grid = ie_lab.patch_sweep(lm, PROMPT, OTHER, metric, progress=False)
    assert grid.clean != pytest.approx(grid.corrupted)
    # Before the differing token nothing depends on it: patching there changes nothing.
    torch.testing.assert_close(grid.values[:, :3], torch.full((2, 3), grid.corrupted), atol=1e-5, rtol=0)
    # Patching the whole residual at layer 0 restores the clean run exactly.
    logits = ie_lab.patch(lm, OTHER, PROMPT, ["resid_pre.0"])
    assert float(metric(logits)) == pytest.approx(grid.clean, abs=1e-5)
    # the differing position at layer 0 carries all the information: also exactly clean
    assert float(grid.values[0, 3]) == pytest.approx(grid.clean, abs=1e-4)
    assert_clean(lm)


def test_patch_sources_of_the_wrong_shape_are_refused():
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match="same length"):
        ie_lab.run_with_patches(lm, PROMPT, {"resid_pre.0": torch.zeros(1, 5, 128)})
    with pytest.raises(ie_lab.InputError, match="same token length"):
        ie_lab.patch_sweep(lm, PROMPT, PROMPT[:, :5], ie_lab.logit_diff(1, 2), progress=False)
    with pytest.raises(ie_lab.CapabilityUnsupported):
        ie_lab.run_with_patches(lm, PROMPT, {"attn_probs.0": torch.zeros(1, 7, 7)})
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["llama", "gemma2", "gpt_neox"])
def test_gradient_matches_a_finite_difference(fam):
    lm = lm_for(fam)
    metric = ie_lab.logit_diff(40, 41)
    g = ie_lab.gradients(lm, PROMPT, metric, ["resid_post.0", "z.1"])
    assert g["resid_post.0"].shape == (1, 7, lm.facts.d_model)
    direction = torch.zeros(lm.facts.d_model)
    direction[:] = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(0))
    eps = 1e-2
    with ie_lab.steer(lm, "resid_post.0", direction, scale=eps, positions=[4]):
        with torch.no_grad():
            up = float(metric(lm.hf(input_ids=PROMPT).logits))
    with ie_lab.steer(lm, "resid_post.0", direction, scale=-eps, positions=[4]):
        with torch.no_grad():
            down = float(metric(lm.hf(input_ids=PROMPT).logits))
    fd = (up - down) / (2 * eps)
    analytic = float(g["resid_post.0"][0, 4] @ direction)
    assert analytic == pytest.approx(fd, rel=2e-2, abs=1e-4)
    assert float(g["z.1"].abs().sum()) > 0
    assert_clean(lm)


def test_attribution_patching_approximates_the_sweep_direction():
    lm = lm_for("llama")
    metric = ie_lab.logit_diff(40, 41)
    est = ie_lab.attribution_patch(lm, PROMPT, OTHER, metric)
    assert est.values.shape == (2, 7)
    torch.testing.assert_close(est.values[:, :3], torch.full((2, 3), est.corrupted), atol=1e-5, rtol=0)


def test_chat_helpers():
    lm = ie_lab.load(*__import__("ie_lab.toy", fromlist=["tiny_model"]).tiny_model("llama"))
    msgs = [{"role": "user", "content": "Mary went to the store"}, {"role": "assistant", "content": "John gave a book"}]
    with pytest.raises(ie_lab.InputError, match="no chat template"):
        ie_lab.apply_chat_template(lm, msgs)
    lm.tokenizer.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant :{% endif %}"
    )
    ids = ie_lab.apply_chat_template(lm, msgs)
    spans = ie_lab.message_spans(lm, msgs)
    assert [s.role for s in spans] == ["user", "assistant"]
    assert spans[0].start == 0 and spans[0].end == spans[1].start
    toks = lm.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    assert toks[spans[1].start : spans[1].end][1] == "assistant"
    assert toks[-2:] == ["assistant", ":"]  # the generation prompt


def test_capture_with_grad_stays_on_the_graph_and_survives_in_place_updates():
    lm = lm_for("falcon")  # Falcon adds attention into the MLP output in place after the MLP returns
    c = ie_lab.capture(lm, PROMPT, ["mlp_out.0", "resid_post.1"], grad=True)
    assert c["resid_post.1"].requires_grad
    ref = ie_lab.capture(lm, PROMPT, ["mlp_out.0"])["mlp_out.0"]
    torch.testing.assert_close(c["mlp_out.0"].detach(), ref)
    c["resid_post.1"].sum().backward()
    assert any(p.grad is not None for p in lm.hf.parameters())
    lm.hf.zero_grad(set_to_none=True)
    assert_clean(lm)


# ---- gradients between captured points (issue 13.5) ------------------------------------------------------


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _hand_grad(lm, at, u, read, *, pre=False, head=None):
    """Reference d(sum(u * read's output)) / d(at's output, or input with pre=True), by swapping a leaf in by hand."""
    box = {}

    def leaf_for(t):
        base = t.detach().clone()
        if head is None:
            box["x"] = base.requires_grad_()
            return box["x"].clone()  # a clone, so in-place updates later in the forward are allowed
        d = lm.facts.head_dim
        box["x"] = base[..., head * d : (head + 1) * d].clone().requires_grad_()
        return torch.cat([base[..., : head * d], box["x"], base[..., (head + 1) * d :]], -1)

    if pre:
        h1 = at.register_forward_pre_hook(lambda m, args: (leaf_for(args[0]),) + tuple(args[1:]))
    else:
        h1 = at.register_forward_hook(
            lambda m, args, out: (leaf_for(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else leaf_for(out)
        )
    h2 = read.register_forward_hook(lambda m, args, out: box.__setitem__("y", _first(out)))
    try:
        with torch.enable_grad():
            lm.hf(input_ids=PROMPT, use_cache=False)
        return torch.autograd.grad((box["y"] * u).sum(), box["x"])[0]
    finally:
        h1.remove()
        h2.remove()


@pytest.mark.parametrize("fam", ["llama", "falcon", "gpt2", "opt"])
def test_capture_grad_links_points_through_the_model(fam):
    lm = lm_for(fam)
    b = lm.binding
    c = ie_lab.capture(lm, PROMPT, ["resid_post.0", "mlp_out.0", "z.1.head-1", "resid_post.1"], grad=True)
    plain = ie_lab.capture(lm, PROMPT, ["resid_post.0", "mlp_out.0", "z.1.head-1", "resid_post.1"])
    for a in plain:  # linking changes no number
        assert torch.equal(c[a].detach(), plain[a]), a
    u = torch.randn(c["resid_post.1"].shape, generator=torch.Generator().manual_seed(0))
    y = (c["resid_post.1"] * u).sum()
    g_resid, g_mlp, g_head = torch.autograd.grad(y, [c["resid_post.0"], c["mlp_out.0"], c["z.1.head-1"]])
    torch.testing.assert_close(g_resid, _hand_grad(lm, b.layers[0].layer, u, b.layers[1].layer), atol=1e-5, rtol=1e-4)
    ref_mlp = _hand_grad(lm, b.layers[0].mlp_out_module, u, b.layers[1].layer)
    torch.testing.assert_close(g_mlp, ref_mlp.reshape(g_mlp.shape), atol=1e-5, rtol=1e-4)  # OPT: [tokens, width]
    torch.testing.assert_close(
        g_head, _hand_grad(lm, b.layers[1].o_proj, u, b.layers[1].layer, pre=True, head=1), atol=1e-5, rtol=1e-4
    )
    assert float(g_resid.abs().sum()) > 0 and float(g_head.abs().sum()) > 0
    lm.hf.zero_grad(set_to_none=True)
    assert_clean(lm)


def test_capture_grad_through_a_residual_multiplier():
    lm = lm_for("granite")  # mlp_out_post = 0.22 * the MLP's output
    lb = lm.binding.layers[0]
    c = ie_lab.capture(lm, PROMPT, ["mlp_out_post.0", "resid_post.1"], grad=True)
    torch.testing.assert_close(
        c["mlp_out_post.0"].detach(), ie_lab.capture(lm, PROMPT, ["mlp_out_post.0"])["mlp_out_post.0"], atol=0, rtol=0
    )
    u = torch.randn(c["resid_post.1"].shape, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((c["resid_post.1"] * u).sum(), [c["mlp_out_post.0"]])
    ref = _hand_grad(lm, lb.mlp_out_module, u, lm.binding.layers[1].layer) / lb.mlp_multiplier
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)
    lm.hf.zero_grad(set_to_none=True)
    assert_clean(lm)


def test_capture_grad_on_frozen_weights_still_links_points():
    lm = lm_for("llama")
    flags = [p.requires_grad for p in lm.hf.parameters()]
    for p in lm.hf.parameters():
        p.requires_grad_(False)
    try:
        c = ie_lab.capture(lm, PROMPT, ["resid_post.0", "final_norm"], grad=True)
        (g,) = torch.autograd.grad(c["final_norm"].sum(), [c["resid_post.0"]])
    finally:
        for p, f in zip(lm.hf.parameters(), flags):
            p.requires_grad_(f)
    ones = torch.ones_like(c["final_norm"])
    torch.testing.assert_close(g, _hand_grad(lm, lm.binding.layers[0].layer, ones, lm.binding.final_norm))
    assert_clean(lm)


def test_gradients_of_a_metric_on_any_point():
    lm = lm_for("llama")
    u = torch.randn(1, PROMPT.shape[1], lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    g = ie_lab.gradients(lm, PROMPT, lambda t: (t * u).sum(), ["resid_post.0"], of="resid_post.1")
    ref = _hand_grad(lm, lm.binding.layers[0].layer, u, lm.binding.layers[1].layer)
    torch.testing.assert_close(g["resid_post.0"], ref, atol=1e-5, rtol=1e-4)
    # A Cache of several points; one upstream of the point differentiated contributes nothing.
    g2 = ie_lab.gradients(
        lm,
        PROMPT,
        lambda c: (c["resid_post.1"] * u).sum() + c["resid_pre.0"].sum(),
        ["resid_post.0"],
        of=["resid_post.1", "resid_pre.0"],
    )
    torch.testing.assert_close(g2["resid_post.0"], ref, atol=1e-5, rtol=1e-4)
    # Attention patterns are measurable too: d(attention of layer 1 to token 0) / d resid_post.0.
    g3 = ie_lab.gradients(lm, PROMPT, lambda p: p[0, :, -1, 0].sum(), ["resid_post.0"], of="attn_probs.1")
    assert float(g3["resid_post.0"].abs().sum()) > 0
    with pytest.raises(ie_lab.InputError, match="scalar"):
        ie_lab.gradients(lm, PROMPT, lambda t: t, ["resid_post.0"], of="resid_post.1")
    with pytest.raises(ie_lab.AddressError):
        ie_lab.gradients(lm, PROMPT, lambda t: t.sum(), ["resid_post.0"], of="resid_pist.1")
    with pytest.raises(ie_lab.InputError, match="metric"):
        ie_lab.gradients(lm, PROMPT, "logits", ["resid_post.0"])
    lm.hf.zero_grad(set_to_none=True)
    assert_clean(lm)


def test_capture_grad_sees_steering_and_chains_points_on_one_module():
    lm = lm_for("granite")  # attn_out and attn_out_post (0.22 x attn_out) are read at the same o_proj output
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3))
    addrs = ["resid_post.0", "attn_out.1", "attn_out_post.1", "resid_post.1"]
    u = torch.randn(1, PROMPT.shape[1], lm.facts.d_model, generator=torch.Generator().manual_seed(4))
    lb = lm.binding.layers[1]
    with ie_lab.steer(lm, "resid_post.0", v, scale=2.0):
        c = ie_lab.capture(lm, PROMPT, addrs, grad=True)
        plain = ie_lab.capture(lm, PROMPT, addrs)
        ref = _hand_grad(lm, lb.o_proj, u, lb.layer)  # d / d attn_out (attn_out_post = m * attn_out), steered
    for a in addrs:  # the steered value, as a capture without grad returns it
        assert torch.equal(c[a].detach(), plain[a]), a
    g_out, g_post = torch.autograd.grad((c["resid_post.1"] * u).sum(), [c["attn_out.1"], c["attn_out_post.1"]])
    torch.testing.assert_close(g_out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_post, ref / lb.attn_multiplier, atol=1e-5, rtol=1e-4)
    lm.hf.zero_grad(set_to_none=True)
    assert_clean(lm)
