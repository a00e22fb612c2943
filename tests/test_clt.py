"""Cross-layer and skip transcoders in circuit-tracer's on-disk layout (docs/CIRCUITS.md): read onto the MLP points
with their tensors in ie_lab's orientation; each layer's reconstruction holds every earlier layer's write; the
attribution graph is complete on tiny Llama and the demo model, and a feature's edge into a logit holds its
cross-layer write (hand-computed through the frozen final norm: dropping the cross-layer decoders misses it); an
ablation moves every later layer's MLP output by exactly -act x W_dec[l -> l'][f], and a CLT (or a skip transcoder)
spliced without its error term writes its reconstruction; the graph panel's data and
dashboards take a CLT feature; bad folders are refused with the reason."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import ie_lab
from ie_lab import Address
from ie_lab.eager.attribution_graph import build_graph, completeness
from tests.conftest import assert_clean
from tests.families import make_model, make_tokenizer
from tests.transcoder_files import write_circuit_tracer

PROMPT = "the cat sat on the mat and the dog"
DEMO_PROMPT = "One Monday , Mary went to the park . Mary felt sad and"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    s = ie_lab.Session(make_model("llama"), make_tokenizer(), progress=False)
    lm = s._lm
    root = write_circuit_tracer(str(tmp_path_factory.mktemp("clt")), lm.facts.d_model, lm.facts.n_layers)
    yield lm, root, ie_lab.load_transcoders(root, lm), s
    s.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    f = s._lm.facts
    root = write_circuit_tracer(str(tmp_path_factory.mktemp("democlt")), f.d_model, f.n_layers, n=64, seed=1)
    tcs = ie_lab.load_transcoders(root, s)
    yield s, tcs, ie_lab.attribution_graph(s, DEMO_PROMPT, tcs, batch_size=128, max_features=40)
    s.close()


def test_a_clt_and_a_skip_transcoder_load_from_circuit_tracers_layout(llama, tmp_path):
    lm, root, tcs, _ = llama
    N, d = lm.facts.n_layers, lm.facts.d_model
    assert tcs.cross_layer and tcs.layers == list(range(N)) and "cross-layer" in repr(tcs)
    t0 = tcs[0]
    assert (t0.address_in, t0.address_out, t0.activation) == (
        Address.parse("mlp_in.0"),
        Address.parse("mlp_out.0"),
        "jumprelu",
    )
    enc, dec = (
        load_file(os.path.join(root, "W_enc_0.safetensors")),
        load_file(os.path.join(root, "W_dec_0.safetensors")),
    )
    x = torch.randn(5, d)
    pre = x @ enc["W_enc_0"].T + enc["b_enc_0"]  # circuit-tracer stores W_enc [d_sae, d]
    assert torch.allclose(t0.encode(x), pre * (pre > enc["threshold_0"]), atol=1e-5)
    assert t0.writes_to == list(range(N)) and torch.equal(t0.decoder(1), dec["W_dec_0"][:, 1])
    assert torch.equal(t0.W_dec, dec["W_dec_0"][:, 0]) and tcs[N - 1].writes_to == [N - 1]
    # per-layer files with a skip path: x @ W_skip^T in circuit-tracer, stored as ie_lab's x @ W_skip
    sk = ie_lab.load_transcoders(write_circuit_tracer(str(tmp_path / "sk"), d, N, clt=False, skip=True), lm)
    w = load_file(str(tmp_path / "sk" / "layer_1.safetensors"))
    assert not sk.cross_layer and torch.allclose(sk[1].skip(x), x @ w["W_skip"].T, atol=1e-5)
    # without config.yaml a CLT reads circuit-tracer's default hook_resid_mid
    bare = ie_lab.load_transcoders(write_circuit_tracer(str(tmp_path / "bare"), d, N, hooks=None), lm)
    assert bare[0].address_in == Address.parse("resid_mid.0")


def test_each_layers_reconstruction_holds_the_earlier_layers_writes(llama):
    lm, _, tcs, s = llama
    cap = s.capture(PROMPT, ["mlp_in.0", "mlp_in.1", "mlp_out.1"])
    x0, x1, y1 = (cap[a][0].float() for a in ("mlp_in.0", "mlp_in.1", "mlp_out.1"))
    t0, t1 = tcs[0], tcs[1]
    by_hand = t0.encode(x0) @ t0.decoder(1) + t1.encode(x1) @ t1.W_dec + t1.b_dec
    fvu = float((y1 - by_hand).pow(2).sum() / (y1 - y1.mean(0)).pow(2).sum())
    assert tcs.reconstruction_errors(s, PROMPT)[1] == pytest.approx(fvu, rel=1e-5)
    own_only = t1.encode(x1) @ t1.W_dec + t1.b_dec  # the wrong answer: layer 1's own features alone
    assert float((y1 - own_only).pow(2).sum() / (y1 - y1.mean(0)).pow(2).sum()) != pytest.approx(fvu, rel=1e-3)


def test_clt_graph_is_complete_and_a_feature_to_logit_edge_holds_its_cross_layer_write(llama, demo):
    lm, _, tcs, s = llama
    g = ie_lab.attribution_graph(lm, PROMPT, tcs, batch_size=64)
    assert len(g.of_kind("feature")) > 20 and float(completeness(g).max()) < 1e-3
    assert demo[2].info["completeness_max_relative_error"] < 1e-3 and len(demo[2].of_kind("feature")) > 10
    # a layer-0 feature at the last position writes into mlp_out.1 there, which reaches the logits through the
    # frozen final RMSNorm alone: that part of its edge is act x W_dec[0 -> 1][f] . gain x (W_U[t] - mean W_U) / rms
    S = len(g.tokens)
    f = max((n for n in g.of_kind("feature") if n.layer == 0 and n.position == S - 1), key=lambda n: n.activation)
    top = g.of_kind("logit")[0]
    x = s.capture(PROMPT, [f"resid_post.{lm.facts.n_layers - 1}"])[f"resid_post.{lm.facts.n_layers - 1}"][0, -1].float()
    norm, W_U = lm.hf.model.norm, lm.hf.lm_head.weight.detach().float()
    grad = (
        norm.weight.detach().float()
        * (W_U[top.index] - W_U.mean(0))
        / torch.sqrt(x.pow(2).mean() + norm.variance_epsilon)
    )
    cross = f.activation * float(tcs[0].decoder(1)[f.index] @ grad)
    dropped = ie_lab.Transcoders([dataclasses.replace(t, decoders={}, clt_layers=()) for t in tcs])
    g2 = build_graph(lm, PROMPT, dropped, batch_size=64)
    diff = g.edges_into(top)[f] - g2.edges_into(g2.node("logit", top.index))[g2.node("feature", 0, S - 1, f.index)]
    assert abs(cross) > 1e-3 and diff == pytest.approx(cross, rel=1e-3, abs=1e-6)
    assert_clean(lm)


def test_a_skip_transcoders_graph_is_complete(llama, tmp_path):
    lm = llama[0]
    sk = ie_lab.load_transcoders(
        write_circuit_tracer(str(tmp_path), lm.facts.d_model, lm.facts.n_layers, clt=False, skip=True), lm
    )
    g = ie_lab.attribution_graph(lm, PROMPT, sk, batch_size=64)
    assert len(g.of_kind("feature")) > 20 and float(completeness(g).max()) < 1e-3
    # spliced without the error term, the skip path joins the reconstruction
    s = llama[3]
    got = s.capture(PROMPT, ["mlp_in.1", "mlp_out.1"], splice=s.splice(sk))
    x = got["mlp_in.1"][0].float()
    assert torch.allclose(got["mlp_out.1"][0].float(), sk[1].decode(sk[1].encode(x)) + sk[1].skip(x), atol=1e-4)


def test_ablating_a_clt_node_moves_every_later_mlp_output_by_its_decoder_rows(demo):
    s, tcs, g = demo
    N = s._lm.facts.n_layers
    f = max((n for n in g.of_kind("feature") if n.layer == 0), key=lambda n: n.activation)
    pts = [a for L in range(N) for a in (f"mlp_in.{L}", f"mlp_out.{L}")]
    got = s.capture(DEMO_PROMPT, pts, intervene={f: 0.0})
    plain = s.capture(DEMO_PROMPT, pts)
    for L in range(N):
        # the MLP's own output on this run's input, against what the spliced run wrote
        mlp = s._lm.binding.layers[L].mlp
        with torch.no_grad():
            own = mlp(got[f"mlp_in.{L}"].to(s._lm.dtype)).float()[0]
        moved = got[f"mlp_out.{L}"][0].float() - own
        expected = -f.activation * tcs[0].decoder(L)[f.index]
        tol = 1e-4 * float(expected.norm())
        assert torch.allclose(moved[f.position], expected, atol=tol), L
        others = torch.cat([moved[: f.position], moved[f.position + 1 :]])
        assert float(others.abs().max()) < tol
        if L > 0:  # the wrong answer (no cross-layer write) fails the same check
            assert not torch.allclose(moved[f.position], torch.zeros_like(expected), atol=tol)
    assert not torch.equal(got[f"mlp_out.{N - 1}"], plain[f"mlp_out.{N - 1}"])
    # a (layer, feature) pair on the whole CLT's splice: every position, by its own activation there
    last = f"mlp_out.{N - 1}"
    pair = s.capture(DEMO_PROMPT, pts, splice=s.splice(tcs, error=True).ablate((0, f.index)))
    acts = tcs[0].encode(plain["mlp_in.0"][0].float())[:, f.index]
    with torch.no_grad():
        own = s._lm.binding.layers[N - 1].mlp(pair[f"mlp_in.{N - 1}"].to(s._lm.dtype)).float()[0]
    want = -acts[:, None] * tcs[0].decoder(N - 1)[f.index]
    assert int((acts > 0).sum()) >= 2 and torch.allclose(pair[last][0].float() - own, want, atol=1e-4)
    # without the error term each layer's output is the CLT's reconstruction from this run's inputs
    rec = s.capture(DEMO_PROMPT, pts, splice=s.splice(tcs))
    pred = tcs.reconstruct({L: rec[f"mlp_in.{L}"][0].float() for L in range(N)})
    for L in range(N):
        assert torch.allclose(rec[f"mlp_out.{L}"][0].float(), pred[L], atol=1e-4), L
    with pytest.raises(ie_lab.InputError, match="splices whole"):
        s.splice(tcs[1], error=True)
    assert_clean(s._lm)


def test_the_graph_panels_data_and_dashboards_take_a_clt_feature(demo):
    from ie_lab.widgets.dashboard_data import feature_data
    from ie_lab.widgets.graph_panel_data import graph_data

    s, tcs, g = demo
    d = graph_data(g.prune())
    assert len(d.ids) and int((d.kind == 1).sum()) >= 1
    f = max(g.of_kind("feature"), key=lambda n: n.activation)
    fd = feature_data(s, tcs[f.layer], f.index, [DEMO_PROMPT], top=3)
    assert fd.n_fired >= 1 and fd.address == str(tcs[f.layer].address_in)
    steer = tcs[0].steer(s, f.index, scale=2.0)
    assert isinstance(steer, list) and len(steer) == s._lm.facts.n_layers  # one write per layer it decodes into


@pytest.mark.parametrize(
    "damage,match",
    [
        ("gap", "without gaps"),
        ("no_dec", "W_dec_<L>.safetensors"),
        ("shape", "has shape"),
        ("kind", "keep one kind per folder"),
        ("hub", "layer_0.safetensors not in the Hugging Face cache.*`hf download someone/tcs layer_0.safetensors"),
    ],
)
def test_bad_circuit_tracer_folders_are_refused_with_the_reason(llama, tmp_path, damage, match, monkeypatch):
    lm = llama[0]
    d, N = lm.facts.d_model, lm.facts.n_layers
    root = str(tmp_path)
    if damage == "hub":  # hf:// files come from the hub cache (tests/test_transcoder_release.py); this one is empty
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
        write_circuit_tracer(root, d, N, clt=False)
        with open(os.path.join(root, "config.yaml"), "a") as fh:
            fh.write("transcoders:\n- hf://someone/tcs/layer_0.safetensors\n")
    else:
        write_circuit_tracer(root, d, N)
    if damage == "gap":
        os.remove(os.path.join(root, "W_enc_0.safetensors"))
    elif damage == "no_dec":
        os.remove(os.path.join(root, f"W_dec_{N - 1}.safetensors"))
    elif damage == "shape":
        p = os.path.join(root, "W_dec_0.safetensors")
        save_file({"W_dec_0": load_file(p)["W_dec_0"][:, :1].contiguous()}, p)
    elif damage == "kind":
        with open(os.path.join(root, "config.yaml"), "w") as fh:
            fh.write("model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\nfeature_output_hook: hook_mlp_out\n")
    with pytest.raises(ie_lab.InputError, match=match):
        ie_lab.load_transcoders(root, lm)
