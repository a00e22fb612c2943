"""Identities a wrong-but-plausible tensor cannot satisfy, on every supported family."""

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, ids, lm_for

TOL = dict(atol=2e-4, rtol=1e-4)


def _layers(lm):
    return range(lm.facts.n_layers)


def test_residual_identities(family):
    lm = lm_for(family)
    x = ids()
    for L in _layers(lm):
        lb = lm.binding.layers[L]
        names = ["resid_pre", "attn_out_post", "mlp_out_post", "resid_post"] + ([] if lb.parallel else ["resid_mid"])
        c = ie_lab.capture(lm, x, [f"{n}.{L}" for n in names])
        if lb.parallel:
            torch.testing.assert_close(
                c[f"resid_pre.{L}"] + c[f"attn_out_post.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL
            )
        else:
            torch.testing.assert_close(c[f"resid_pre.{L}"] + c[f"attn_out_post.{L}"], c[f"resid_mid.{L}"], **TOL)
            torch.testing.assert_close(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
            if lb.pre_mlp_norm is None:
                continue  # post-norm-only families (OLMo 2) feed the raw residual to the MLP
            # The identity is discriminating: the MLP's normalised input is not the residual.
            mlp_in = ie_lab.capture(lm, x, [f"mlp_in.{L}"])[f"mlp_in.{L}"]
            assert not torch.allclose(c[f"resid_pre.{L}"] + c[f"attn_out_post.{L}"], mlp_in, **TOL)
    assert_clean(lm)


def _z_from(probs, value, n_heads, head_dim, interleave=True):
    b, s, _ = value.shape
    v = value.reshape(b, s, -1, head_dim).transpose(1, 2)
    rep = n_heads // v.shape[1]
    v = v.repeat_interleave(rep, dim=1) if interleave else v.repeat(1, rep, 1, 1)
    return (probs @ v).transpose(1, 2).reshape(b, s, n_heads * head_dim)


def lm_attn(family):
    """Families that compute attention in their own module serve probs only when running eager."""
    lm = lm_for(family)
    return lm if lm.binding.layers[0].uses_attention_interface else lm_for(family, "eager")


def test_probs_times_value_is_z(family):
    lm = lm_attn(family)
    f = lm.facts
    x = ids()
    for L in _layers(lm):
        c = ie_lab.capture(lm, x, [f"attn_probs.{L}", f"value.{L}", f"z.{L}"])
        z = _z_from(c[f"attn_probs.{L}"], c[f"value.{L}"], f.n_heads, f.head_dim)
        torch.testing.assert_close(z, c[f"z.{L}"], **TOL)
        if 1 < f.n_kv_heads < f.n_heads:
            # The wrong GQA layout (tiling key/value heads instead of grouping them) must fail.
            wrong = _z_from(c[f"attn_probs.{L}"], c[f"value.{L}"], f.n_heads, f.head_dim, interleave=False)
            assert not torch.allclose(wrong, c[f"z.{L}"], **TOL)
        # A neighbouring head's value must not reproduce z either.
        rolled = torch.roll(c[f"value.{L}"], shifts=f.head_dim, dims=-1)
        if f.n_kv_heads > 1:
            assert not torch.allclose(_z_from(c[f"attn_probs.{L}"], rolled, f.n_heads, f.head_dim), c[f"z.{L}"], **TOL)
    assert_clean(lm)


def test_down_proj_of_mlp_act_is_mlp_out(family):
    lm = lm_for(family)
    x = ids()
    checked = 0
    for lb in lm.binding.layers:
        if lb.sparse_moe:
            with pytest.raises(ie_lab.PointAbsent):
                ie_lab.capture(lm, x, [f"mlp_act.{lb.index}"])
            continue
        c = ie_lab.capture(lm, x, [f"mlp_act.{lb.index}", f"mlp_out.{lb.index}"])
        with torch.no_grad():
            torch.testing.assert_close(lb.down_proj(c[f"mlp_act.{lb.index}"]), c[f"mlp_out.{lb.index}"], **TOL)
        checked += 1
    assert checked or lm.facts.is_moe
    assert_clean(lm)


def test_final_norm_then_unembedding_is_the_logits(family):
    lm = lm_for(family)
    f = lm.facts
    x = ids()
    c = ie_lab.capture(lm, x, ["final_norm", "lm_head"])
    with torch.no_grad():
        torch.testing.assert_close(lm.binding.lm_head(c["final_norm"]), c["lm_head"], **TOL)
        logits = lm.hf(input_ids=x).logits
    # Families post-process the unembedding (scaling, soft-capping); the lens module owns that knowledge.
    from ie_lab.ops.lens import postprocess_logits

    torch.testing.assert_close(postprocess_logits(f, c["lm_head"]), logits, **TOL)


def test_attention_rows_and_scores(family):
    lm = lm_attn(family)
    x = ids()
    for L in _layers(lm):
        probs = ie_lab.capture(lm, x, [f"attn_probs.{L}"])[f"attn_probs.{L}"]
        assert probs.shape == (2, lm.facts.n_heads, x.shape[1], x.shape[1])
        if lm.binding.layers[L].attn_sinks:
            assert torch.all(probs.sum(-1) < 1 - 1e-3), "a sink takes part of every row's mass"
        else:
            torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), **TOL)
        assert torch.all(probs.triu(1) == 0), "causal: no query may attend to a later key"
        lb = lm.binding.layers[L]
        if lb.uses_attention_interface or lb.scores_divisor is not None:  # GPT-J: read at its own attention step
            scores = ie_lab.capture(lm, x, [f"attn_scores.{L}"])[f"attn_scores.{L}"]
            if not lb.attn_sinks:
                torch.testing.assert_close(torch.softmax(scores, -1), probs, **TOL)
        else:
            with pytest.raises(ie_lab.CapabilityUnsupported, match="attn_probs"):
                ie_lab.capture(lm, x, [f"attn_scores.{L}"])
    assert_clean(lm)


def test_sandwich_norm_points_differ(family):
    lm = lm_for(family)
    x = ids()
    lb = lm.binding.layers[0]
    c = ie_lab.capture(lm, x, ["attn_out.0", "attn_out_post.0", "mlp_out.0", "mlp_out_post.0"])
    if lb.post_attn_norm is not None or lb.attn_multiplier is not None:
        rel = (c["attn_out.0"] - c["attn_out_post.0"]).norm() / c["attn_out.0"].norm()
        assert rel > 0.1
    else:
        torch.testing.assert_close(c["attn_out.0"], c["attn_out_post.0"])
    if lb.post_mlp_norm is not None or lb.mlp_multiplier is not None:
        rel = (c["mlp_out.0"] - c["mlp_out_post.0"]).norm() / c["mlp_out.0"].norm()
        assert rel > 0.1
    else:
        torch.testing.assert_close(c["mlp_out.0"], c["mlp_out_post.0"])


@pytest.mark.parametrize("fam", ["gemma2", "gemma3_text", "olmo2"])
def test_sandwich_families_are_detected(fam):
    lm = lm_for(fam)
    assert lm.binding.layers[0].post_attn_norm is not None
    assert lm.binding.layers[0].post_mlp_norm is not None


def test_sdpa_recompute_equals_eager_probabilities(family):
    lm_sdpa = lm_for(family)
    if not lm_sdpa.binding.layers[0].uses_attention_interface:
        pytest.skip(f"{family} computes attention in its own module; its probs come from that module directly")
    lm_eager = lm_for(family, "eager")
    x = ids()
    addrs = [f"attn_probs.{L}" for L in range(lm_sdpa.facts.n_layers)] + ["resid_post.0"]
    a = ie_lab.capture(lm_sdpa, x, addrs)
    b = ie_lab.capture(lm_eager, x, addrs)
    if lm_sdpa.facts.attn_logit_softcap and lm_sdpa.hf.config._attn_implementation == "sdpa":
        # transformers' sdpa kernel ignores the softcap, so the two forwards really differ; each capture must
        # follow its own kernel (test_probs_times_value_is_z checks that on the sdpa model). Newer transformers
        # (>= 5.21) refuse sdpa on Gemma 2 and build it eager: then the two are the same model.
        assert not torch.allclose(a["attn_probs.0"], b["attn_probs.0"], **TOL)
        assert not torch.allclose(a["resid_post.0"], b["resid_post.0"], **TOL)
        return
    for k in addrs:
        torch.testing.assert_close(a[k], b[k], **TOL)


MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("family", MOE)
def test_moe_routing_points(family):
    lm = lm_for(family)
    k, E = lm.facts.experts_per_token, lm.facts.n_experts
    x = ids()
    for L in lm.binding.structure["moe_layers"]:
        c = ie_lab.capture(lm, x, [f"router_logits.{L}", f"expert_weights.{L}", f"expert_indices.{L}"])
        logits, w, sel = c[f"router_logits.{L}"], c[f"expert_weights.{L}"], c[f"expert_indices.{L}"]
        assert logits.shape == w.shape == sel.shape == (2, x.shape[1], E)
        assert torch.all(sel.sum(-1) == k), "each token routes to exactly k experts"
        assert torch.all((w != 0) <= (sel == 1)), "weights only on selected experts"
        if family != "deepseek_v3":  # DeepSeek selects with a bias and expert groups, not by raw logits
            top = logits.topk(k, dim=-1).indices
            assert torch.equal(torch.zeros_like(sel).scatter(-1, top, 1.0), sel)
        # the neighbouring tensor (the router's softmax) is not what expert_weights holds
        assert not torch.allclose(torch.softmax(logits, -1), w, **TOL)
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["falcon", "falcon_mqa"])
def test_legacy_family_on_sdpa_refuses_probs_with_the_fix(fam):
    """Falcon computes attention in its own module before transformers 5.25 (its probabilities leave it only on the
    eager path: refused on sdpa, naming the fix, and the fix serves them); from 5.25 it calls the attention registry,
    and an sdpa model serves the probabilities its kernel used. Which one holds is measured, and must be what
    quirks.ATTENTION_IN_MODULE records for the installed transformers."""
    from ie_lab.arch import quirks

    lm, eager = lm_for(fam), lm_for(fam, "eager")
    assert lm.hf.config._attn_implementation != "eager"
    legacy = not any(lb.uses_attention_interface for lb in lm.binding.layers)
    assert legacy == ("falcon" in quirks.ATTENTION_IN_MODULE)
    x = ids()
    addrs = [f"attn_probs.{L}" for L in range(lm.facts.n_layers)]
    if legacy:
        with pytest.raises(ie_lab.CapabilityUnsupported, match="attn_implementation='eager'"):
            ie_lab.capture(lm, x, ["attn_probs.0"])
        assert_clean(lm)
        got = ie_lab.capture(eager, x, addrs)  # the fix
    else:
        got = ie_lab.capture(lm, x, addrs)
    # the model's own probabilities, read off the eager forward (the legacy path's output_attentions, or the
    # registry's eager kernel): causal, rows summing to 1, each layer its own (not the other layer's pattern)
    with torch.no_grad():
        want = eager.hf(input_ids=x, output_attentions=True).attentions
    for L, a in enumerate(addrs):
        torch.testing.assert_close(got[a], want[L], **TOL)
        assert not torch.allclose(got[a], want[(L + 1) % len(want)], **TOL)
        assert float(got[a].triu(1).abs().max()) == 0.0
        torch.testing.assert_close(got[a].sum(-1), torch.ones(got[a].shape[:-1]), **TOL)
    assert_clean(lm)
    assert_clean(eager)


def test_recompute_with_sinks_and_windows_equals_the_eager_kernel():
    """The sdpa-path rebuild (ops.attention) against GPT-OSS's own eager kernel, sinks and window included."""
    import importlib

    from ie_lab.arch.attention_tap import AttentionCall
    from ie_lab.eager.taps import _recompute

    lm = lm_for("gpt_oss", "eager")
    eager_fn = importlib.import_module(type(lm.binding.layers[0].attn).__module__).eager_attention_forward
    seen = {}
    from ie_lab.arch import attention_tap

    def listen(mod, call):
        seen[id(mod)] = call

    with attention_tap.listening({id(lb.attn): listen for lb in lm.binding.layers}):
        with torch.no_grad():
            lm.hf(input_ids=ids())
    for lb in lm.binding.layers:
        call = seen[id(lb.attn)]
        _, own = eager_fn(lb.attn, call.query, call.key, call.value, call.attention_mask, **call.kwargs)
        as_if_sdpa = AttentionCall(
            call.query,
            call.key,
            call.value,
            None if lb.index == 1 else call.attention_mask,
            {**call.kwargs, "s_aux": lb.attn.sinks},
            call.output,
            None,
            "sdpa",
        )
        scores, probs = _recompute(as_if_sdpa)
        torch.testing.assert_close(probs, own.float(), **TOL)
