"""ie_lab.attribution_graph: completeness (every feature's and logit's incoming edges sum to its value) on tiny Llama
(no biases), GPT-2 (LayerNorm and attention biases) and OLMo 2 (transcoders predicting the MLP after its post-norm)
with random transcoders and on the demo model with its
shipped transcoders; the check's teeth (an unfrozen norm or pattern, one perturbed edge); one edge against an
independent hand-written forward with the recorded patterns and norm scales; the graph's lookups and pruning; no
hook left after an error."""

from __future__ import annotations

import json

import pytest
import torch

import ie_lab
from ie_lab.eager.attribution_graph import build_graph, completeness
from tests.conftest import assert_clean, lm_for
from tests.transcoder_files import write_transcoders

PROMPT = "the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    lm = lm_for("llama")
    root = write_transcoders(str(tmp_path_factory.mktemp("tc_llama")), lm.facts.d_model, list(range(lm.facts.n_layers)))
    return lm, ie_lab.load_transcoders(root, lm)


@pytest.fixture(scope="module")
def llama_graph(llama):
    lm, tcs = llama
    return ie_lab.attribution_graph(lm, PROMPT, tcs, batch_size=48)


@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2"])
def test_every_row_sums_to_its_value_and_unfrozen_edges_do_not(family, tmp_path, llama, llama_graph):
    if family == "llama":
        (lm, tcs), g = llama, llama_graph
    else:
        lm = lm_for(family)
        root = write_transcoders(str(tmp_path), lm.facts.d_model, list(range(lm.facts.n_layers)))
        tcs = ie_lab.load_transcoders(root, lm)
        g = ie_lab.attribution_graph(lm, PROMPT, tcs, batch_size=64)
        if family == "gpt2":
            assert any(n.name.endswith("ln_1.bias") for n in g.of_kind("bias"))  # LayerNorm biases are nodes
            assert any(n.name.endswith("c_proj.bias") and ".attn." in n.name for n in g.of_kind("bias"))
        else:  # OLMo 2's hook_mlp_out is the MLP after its post-norm: the transcoder replaces both
            assert tcs[0].address_out == ie_lab.Address.parse("mlp_out_post.0")
    feats = g.of_kind("feature")
    assert len(feats) > 20 and len(g.of_kind("logit")) >= 1
    assert float(completeness(g).max()) < 1e-3
    f = feats[-1]
    assert sum(g.edges_into(f).values()) == pytest.approx(f.value, rel=1e-3, abs=1e-4)
    # the wrong answers: a norm whose scale moves with its input, a pattern that moves, one edge off by 1 % of its row
    assert float(completeness(build_graph(lm, PROMPT, tcs, freeze_norms=False)).max()) > 0.05
    assert float(completeness(build_graph(lm, PROMPT, tcs, freeze_patterns=False)).max()) > 0.05
    bad = build_graph(lm, PROMPT, tcs)
    i = bad.index(f)
    j = int(bad.adjacency[i].abs().argmax())
    bad.adjacency[i, j] += 0.01 * float(bad.adjacency[i].abs().sum())
    assert float(completeness(bad).max()) > 3e-3
    assert_clean(lm)


def _hand_value(lm, tcs, clean, target, removed):
    """The target's value in a forward written here from the weights, with attention probabilities and norm scales
    replaced by the recorded ones and each MLP by its recorded output, `removed` (a node) writing nothing."""
    hf, cfg = lm.hf, lm.hf.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    eps = cfg.rms_norm_eps
    h = clean["resid_pre.0"].clone()
    if removed.kind == "embedding":
        h[removed.position] = 0

    def norm(x_clean, x, weight):  # the scale is the clean run's, recomputed here from its residual
        return x / torch.sqrt(x_clean.pow(2).mean(-1, keepdim=True) + eps) * weight

    for L, layer in enumerate(hf.model.layers):
        n1 = norm(clean[f"resid_pre.{L}"], h, layer.input_layernorm.weight)
        v = (n1 @ layer.self_attn.v_proj.weight.T).view(-1, KV, dh)
        A = clean[f"attn_probs.{L}"]  # [H, S, S]
        z = torch.stack([A[hd] @ v[:, hd // (H // KV)] for hd in range(H)], 1).reshape(h.shape[0], -1)
        h = h + z @ layer.self_attn.o_proj.weight.T
        n2 = norm(clean[f"resid_mid.{L}"], h, layer.post_attention_layernorm.weight)
        if target.kind == "feature" and target.layer == L:
            t = tcs[L]
            return float(n2[target.position] @ t.W_enc[:, target.index] + t.b_enc[target.index])
        out = clean[f"mlp_out.{L}"].clone()
        if removed.kind == "feature" and removed.layer == L:
            out[removed.position] -= removed.activation * tcs[L].W_dec[removed.index]
        h = h + out
    last = f"resid_post.{len(hf.model.layers) - 1}"
    logits = norm(clean[last][-1], h[-1], hf.model.norm.weight) @ hf.lm_head.weight.T
    return float(logits[target.index] - logits.mean())


def test_an_edge_is_the_finite_difference_of_a_hand_written_frozen_forward(llama, llama_graph):
    lm, tcs = llama
    g = llama_graph
    n = lm.facts.n_layers
    addrs = ["resid_pre.0"] + [
        f"{p}.{L}" for L in range(n) for p in ("resid_pre", "resid_mid", "mlp_out", "attn_probs")
    ]
    cap = ie_lab.capture(lm, PROMPT, addrs + [f"resid_post.{n - 1}"])
    clean = {str(a): t[0].detach().float() for a, t in cap.items()}
    with torch.no_grad():
        target = max((f for f in g.of_kind("feature") if f.layer == n - 1), key=lambda f: f.position)
        into = g.edges_into(target)
        source = max((s for s in into if s.kind == "feature"), key=lambda s: abs(into[s]))
        full = _hand_value(lm, tcs, clean, target, ie_lab.core.graph.Node("bias", name="none"))
        assert full == pytest.approx(target.value, rel=1e-4, abs=1e-5)
        diff = full - _hand_value(lm, tcs, clean, target, source)
        assert diff == pytest.approx(into[source], rel=1e-3, abs=1e-5)
        logit = g.of_kind("logit")[0]
        emb = g.node("embedding", len(g.tokens) - 1)
        full = _hand_value(lm, tcs, clean, logit, emb)
        diff = _hand_value(lm, tcs, clean, logit, ie_lab.core.graph.Node("bias", name="none")) - full
        assert diff == pytest.approx(g.edges_into(logit)[emb], rel=1e-3, abs=1e-5)


def test_batches_max_features_lookups_and_pruning(llama, llama_graph):
    lm, tcs = llama
    g = llama_graph
    one = build_graph(lm, PROMPT, tcs, batch_size=1)
    assert torch.allclose(one.adjacency, g.adjacency, atol=1e-5)
    few = ie_lab.attribution_graph(lm, PROMPT, tcs, max_features=10)
    assert len(few.of_kind("feature")) == 10 and float(completeness(few).max()) < 1e-3
    top = g.of_kind("logit")[0]
    assert g.node("logit", top.index) == top and top.probability > 0
    f = g.of_kind("feature")[0]
    assert g.node("feature", f.layer, f.position, f.index) == f
    assert all(g.edges_from(s)[f] == w for s, w in g.edges_into(f).items())
    with pytest.raises(ie_lab.InputError, match="no feature node"):
        g.node("feature", 0, 0, 10_000)
    p = g.prune(node_threshold=0.5, edge_threshold=0.9)
    assert 0 < len(p.of_kind("feature")) < len(g.of_kind("feature"))
    assert len(p.of_kind("logit")) == len(g.of_kind("logit"))
    assert int((p.adjacency != 0).sum()) < int((g.adjacency != 0).sum())
    # the kept features are the most influential ones
    infl = g.influence()
    kept = {n.key for n in p.of_kind("feature")}
    worst_kept = min(float(infl[g.index(n)]) for n in p.of_kind("feature"))
    assert all(float(infl[g.index(n)]) <= worst_kept + 1e-12 for n in g.of_kind("feature") if n.key not in kept)
    with pytest.raises(ie_lab.InputError):
        g.prune(node_threshold=0)


def test_edges_of_another_prompt_do_not_sum_to_this_ones_values(llama, llama_graph):
    lm, tcs = llama
    g = llama_graph
    other = ie_lab.attribution_graph(lm, "a dog ran to the big red tree and then", tcs)
    common = [n for n in other.of_kind("feature") if any(m.key == n.key for m in g.of_kind("feature"))]
    assert common
    mine = {n.key: n for n in g.of_kind("feature")}
    misses = [abs(sum(g.edges_into(mine[n.key]).values()) - n.value) / max(abs(n.value), 1e-3) for n in common]
    assert max(misses) > 0.05


def test_no_hook_is_left_after_a_failed_forward(llama, monkeypatch):
    lm, tcs = llama
    calls = []

    def fail_on_second(module, args):
        calls.append(1)
        if len(calls) == 2:  # the clean run passes; the first attribution forward fails mid-stack
            raise RuntimeError("boom")

    h = lm.hf.model.layers[1].register_forward_pre_hook(fail_on_second)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            ie_lab.attribution_graph(lm, PROMPT, tcs)
    finally:
        h.remove()
    assert_clean(lm)
    with pytest.raises(ie_lab.InputError, match="one prompt"):
        ie_lab.attribution_graph(lm, [PROMPT, PROMPT], tcs)
    with pytest.raises(ie_lab.InputError, match="load_transcoders"):
        ie_lab.attribution_graph(lm, PROMPT, [1, 2])
    assert_clean(lm)


def test_the_demo_model_with_its_transcoders_is_complete():
    s = ie_lab.Session(ie_lab.DEMO_MODEL)
    try:
        tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
        assert tcs.layers == [0, 1, 2, 3]
        g = ie_lab.attribution_graph(s, "Mary and John went to the park . John gave a ball to", tcs, batch_size=64)
        assert float(completeness(g).max()) < 1e-3
        assert g.of_kind("logit")[0].token.strip() == "Mary"
        assert (
            float(completeness(build_graph(s, "Mary and John went to the park", tcs, freeze_norms=False)).max()) > 0.05
        )
    finally:
        s.close()


def test_the_graph_file_has_circuit_tracers_layout_and_reads_back(llama_graph, tmp_path):
    g = llama_graph.prune(0.6, 0.9)
    path = g.to_json(tmp_path / "g.json", slug="cat")
    doc = json.load(open(path))
    assert set(doc) == {"metadata", "qParams", "nodes", "links"}
    assert {"slug", "scan", "transcoder_list", "prompt_tokens", "prompt", "node_threshold"} <= set(doc["metadata"])
    node_fields = {"node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob", "is_target_logit", "run_idx"}
    assert all(
        node_fields | {"reverse_ctx_idx", "jsNodeId", "clerp", "influence", "activation"} <= set(n)
        for n in doc["nodes"]
    )
    f = g.of_kind("feature")[0]
    byid = {n["node_id"]: n for n in doc["nodes"]}
    d = byid[f"{f.layer}_{f.index}_{f.position}"]
    assert (d["feature_type"], d["layer"], d["ctx_idx"]) == ("cross layer transcoder", str(f.layer), f.position)
    logits = [n for n in doc["nodes"] if n["feature_type"] == "logit"]
    assert logits[0]["is_target_logit"] and logits[0]["layer"] == str(len(g.info["transcoder_layers"]) + 1)
    # influence as circuit-tracer's viewer reads it: the cumulative share of influence down the ranking (its pruning
    # slider compares it with a threshold), so the most influential node holds the smallest value and the least 1.0
    raw = g.influence()
    plain = [n for n in g.nodes if n.kind != "bias"]
    mine = torch.tensor([float(raw[g.index(n)]) for n in plain], dtype=torch.float64)
    share = torch.tensor([byid_n["influence"] for byid_n in doc["nodes"]], dtype=torch.float64)
    order = torch.sort(mine, descending=True, stable=True).indices
    assert torch.allclose(share[order], torch.cumsum(mine[order], 0) / mine.sum(), rtol=1e-6, atol=1e-9)
    assert float(share.max()) == pytest.approx(1.0) and int(share.argmin()) == int(mine.argmax())
    back = ie_lab.Graph.from_json(path)
    assert [n.key for n in back.nodes] == [n.key for n in plain]
    assert [n.value for n in back.nodes] == pytest.approx([n.value for n in plain])
    keep = [g.index(n) for n in plain]
    assert torch.equal(back.adjacency, g.adjacency[keep][:, keep])
    assert back.tokens == g.tokens
