"""ie_lab.qk_attribution: a head's pre-softmax score at (query, key) as a bilinear sum over pairs of the attribution
graph's nodes. Completeness against the score eager's attn_scores point reads (1e-4 relative) on tiny Llama, tiny
Qwen 3 (its q_norm / k_norm frozen) and the demo model, with the neighbouring head's and key position's scores
failing it; one feature's query and key contributions against a hand-written forward from the weights (rotary
applied by hand: the unrotated vector fails); the query norms left live fail the check; ALiBi in the additive mask
is the position_bias term (leaving it out fails); the refusals (soft-capped
scores, ALiBi's own-module attention, a masked entry, a graph without a model or of another model, bad indices),
no hook left after any of them."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import tiny
from ie_lab.eager.qk_attribution import QKAttribution, _attribute, qk_attribution
from tests.conftest import assert_clean, lm_for
from tests.families import make_config, make_tokenizer
from tests.transcoder_files import write_transcoders

PROMPT = "the cat sat on the mat and the dog"


def _setup(family, tmp_path_factory):
    lm = lm_for(family)
    root = write_transcoders(str(tmp_path_factory.mktemp(f"qk_{family}")), lm.facts.d_model, list(range(2)))
    tcs = ie_lab.load_transcoders(root, lm)
    return lm, tcs, ie_lab.attribution_graph(lm, PROMPT, tcs, batch_size=64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _setup("llama", tmp_path_factory)


def _scores(lm, prompt, layer):
    return ie_lab.capture(lm, prompt, [f"attn_scores.{layer}"])[f"attn_scores.{layer}"][0].float()


def _check_complete(r: QKAttribution, scores: torch.Tensor) -> None:
    read = float(scores[r.head, r.query_pos, r.key_pos])
    assert r.score == pytest.approx(read, rel=1e-5, abs=1e-7)
    assert r.total == pytest.approx(read, rel=1e-4)
    assert float(r.matrix().sum()) + r.position_bias == pytest.approx(read, rel=1e-4)
    assert sum(r.query_marginals.values()) == pytest.approx(r.total - r.position_bias, rel=1e-5)
    assert sum(r.key_marginals.values()) == pytest.approx(r.total - r.position_bias, rel=1e-5)
    # the plausible wrong answers: the neighbouring head's score, the neighbouring key position's
    for wrong in (
        scores[(r.head + 1) % scores.shape[0], r.query_pos, r.key_pos],
        scores[r.head, r.query_pos, r.key_pos - 1],
    ):
        assert abs(r.total - float(wrong)) > 1e-2 * abs(float(wrong))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_pairs_sum_to_the_models_score(family, llama, tmp_path_factory):
    lm, tcs, g = llama if family == "llama" else _setup(family, tmp_path_factory)
    S = len(g.tokens)
    r = qk_attribution(lm, g, 1, 1, S - 1, 2, top=8)
    _check_complete(r, _scores(lm, PROMPT, 1))
    assert r.completeness < 1e-4 and r.info["query_norm_frozen"] == (family == "qwen3")
    assert len(r.pairs) == 8 and abs(r.pairs[0][2]) >= abs(r.pairs[-1][2])
    assert r.pair(r.pairs[0][0], r.pairs[0][1]) == pytest.approx(r.pairs[0][2], rel=1e-6)
    # no node writes into a query after its position, nor a key after its own
    assert all(n.position in (None, S - 1) or n.position <= S - 1 for n in r.query_marginals)
    assert all(n.position is None or n.position <= 2 for n in r.key_marginals)
    r0 = qk_attribution(lm, g, 0, 0, 3, 3)  # layer 0: the query and key are the embeddings' (and biases')
    _check_complete(r0, _scores(lm, PROMPT, 0))
    assert {n.kind for n in r0.nodes} <= {"embedding", "bias"}
    if family == "qwen3":  # q_norm / k_norm left live: the sum is no longer the score, and the check refuses it
        with pytest.raises(ie_lab.CapabilityUnsupported, match="miss the score"):
            with lm.lock:
                by_layer = g.of_kind("feature")[0].origin.transcoders
                _attribute(lm, g, torch.tensor([g.tokens]), by_layer, 1, 1, S - 1, 2, 5, 32, freeze_qk_norms=False)
    assert_clean(lm)


def test_a_features_query_and_key_against_a_hand_written_forward(llama):
    """Layer 1's query at position P, from a layer-0 feature at P: its write through layer 1's input norm (the
    recorded scale), q_proj's head rows and the rotation of position P, written here from the weights."""
    lm, tcs, g = llama
    hf, cfg = lm.hf, lm.hf.config
    S, d, H, KV = len(g.tokens), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qp, kp, head = S - 1, 4, 3
    r = qk_attribution(lm, g, 1, head, qp, kp)
    resid = ie_lab.capture(lm, PROMPT, ["resid_pre.1"])["resid_pre.1"][0].float()
    attn = hf.model.layers[1].self_attn
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(resid[None], torch.arange(S)[None])

        def by_hand(node, W, h, p, rotate=True):
            t = tcs[0]
            write = node.activation * t.W_dec[node.index]
            normed = (
                write
                / torch.sqrt(resid[p].pow(2).mean() + cfg.rms_norm_eps)
                * hf.model.layers[1].input_layernorm.weight
            )
            x = normed @ W[h * d : (h + 1) * d].T
            if not rotate:
                return x
            half = torch.cat([-x[d // 2 :], x[: d // 2]])
            return x * cos[0, p] + half * sin[0, p]

        at = {n.key: i for i, n in enumerate(r.nodes)}
        fq = max((n for n in g.of_kind("feature") if n.layer == 0 and n.position == qp), key=lambda n: n.activation)
        fk = max((n for n in g.of_kind("feature") if n.layer == 0 and n.position == kp), key=lambda n: n.activation)
        q_hand = by_hand(fq, attn.q_proj.weight, head, qp)
        k_hand = by_hand(fk, attn.k_proj.weight, head // (H // KV), kp)
        assert torch.allclose(r.query[at[fq.key]], q_hand, rtol=1e-4, atol=1e-5)
        assert torch.allclose(r.key[at[fk.key]], k_hand, rtol=1e-4, atol=1e-5)
        # omitting the rotation is a wrong answer the comparison catches
        assert not torch.allclose(r.query[at[fq.key]], by_hand(fq, attn.q_proj.weight, head, qp, False), atol=1e-2)
        assert r.pair(fq, fk) == pytest.approx(float(q_hand @ k_hand) * d**-0.5, rel=1e-4, abs=1e-6)


def test_demo_model(tmp_path_factory):
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    try:
        tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
        prompt = "One Monday , Mary went to the park . Mary felt sad and"
        g = ie_lab.attribution_graph(s, prompt, tcs, batch_size=128, max_features=60)
        S = len(g.tokens)
        L = s._lm.facts.n_layers - 1
        r = qk_attribution(s, g, L, 2, S - 1, 5)
        _check_complete(r, s.capture(prompt, [f"attn_scores.{L}"])[f"attn_scores.{L}"][0].float())
        pruned = g.prune(0.5, 0.9)  # a pruned graph's dropped features join their layer's error node
        assert len(pruned.of_kind("feature")) < len(g.of_kind("feature"))
        assert qk_attribution(s, pruned, L, 2, S - 1, 5).total == pytest.approx(r.score, rel=1e-4)
        assert_clean(s._lm)
    finally:
        s.close()


def test_refusals_leave_the_model_clean(llama, tmp_path):
    lm, tcs, g = llama
    S = len(g.tokens)
    for bad, match in (
        (dict(head=lm.facts.n_heads), "head must be"),
        (dict(key_pos=S), "key_pos must be"),
        (dict(layer=-1), "layer must be"),
    ):
        args = dict(layer=1, head=0, query_pos=S - 1, key_pos=1) | bad
        with pytest.raises(ie_lab.InputError, match=match):
            qk_attribution(lm, g, **args)
    with pytest.raises(ie_lab.InputError, match="masked"):
        qk_attribution(lm, g, 1, 0, 2, 5)  # a key after its query: causal
    with pytest.raises(ie_lab.InputError, match="no model behind it"):
        qk_attribution(lm, ie_lab.Graph.from_json(g.to_json(str(tmp_path / "g.json"))), 1, 0, S - 1, 1)
    other = lm_for("qwen3")
    with pytest.raises(ie_lab.InputError, match="another model"):
        qk_attribution(other, g, 1, 0, S - 1, 1)
    cfg = make_config("gemma2")
    cfg.final_logit_softcapping = None  # the graph builds; its attention scores stay soft-capped
    gemma = ie_lab.load(tiny.build(cfg, attn_implementation="eager"), make_tokenizer())
    with pytest.raises(ie_lab.CapabilityUnsupported, match="attention scores are soft-capped"):
        qk_attribution(gemma, g, 1, 0, S - 1, 1)
    with pytest.raises(
        ie_lab.CapabilityUnsupported, match="attention interface"
    ):  # ALiBi (Bloom), own-module attention
        qk_attribution(lm_for("bloom"), g, 1, 0, S - 1, 1)
    for m in (lm, other, gemma):
        assert_clean(m)


def test_alibi_in_the_additive_mask_is_the_position_bias_term(monkeypatch, tmp_path):
    """No ALiBi family reaches transformers' attention interface on this transformers (Bloom, MPT, Falcon-RW run
    attention in their own module: refused above), so ALiBi is put where such a family puts it: into the additive
    mask the kernel adds to q . k (a tiny Llama running eager attention, its mask builder wrapped to add -slope x
    distance per head). The pairs then sum to the score less the bias, and the bias is the record's position_bias."""
    from transformers.models.llama import modeling_llama

    lm = lm_for("llama", attn_implementation="eager")
    H = lm.facts.n_heads
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    original = modeling_llama.create_causal_mask

    def with_alibi(*args, **kwargs):
        m = original(*args, **kwargs)
        assert m is not None and m.dtype != torch.bool and m.dim() == 4  # eager's additive float mask
        S = m.shape[-1]
        dist = (torch.arange(S)[:, None] - torch.arange(S)[None, :]).float()
        return m + (-slopes[:, None, None] * dist).to(m.dtype)[None]

    monkeypatch.setattr(modeling_llama, "create_causal_mask", with_alibi)
    tcs = ie_lab.load_transcoders(write_transcoders(str(tmp_path), lm.facts.d_model, [0, 1]), lm)
    g = ie_lab.attribution_graph(lm, PROMPT, tcs, batch_size=64)
    S = len(g.tokens)
    r = qk_attribution(lm, g, 1, 1, S - 1, 2)
    assert r.position_bias == pytest.approx(-float(slopes[1]) * (S - 1 - 2), rel=1e-6)
    _check_complete(r, _scores(lm, PROMPT, 1))
    read = float(_scores(lm, PROMPT, 1)[1, S - 1, 2])
    assert abs((r.total - r.position_bias) - read) > 1e-2 * abs(read)  # the bias left out is a wrong answer
    assert_clean(lm)
