"""The notebook panels in plain Python: traits, front-end messages (good and hostile), reprs. No browser."""

import os
import re

import numpy as np
import pytest
import torch

import ie_lab
from ie_lab.toy import tiny_model
from ie_lab.widgets import AttentionViewer, Picker, SteeringPanel, _static
from tests.conftest import assert_clean


@pytest.fixture(scope="module")
def session():
    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False)
    yield s
    s.close()


def _outbox(w, monkeypatch):
    sent = []
    monkeypatch.setattr(w, "send", lambda content, buffers=None: sent.append(content))
    return sent


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


HOSTILE = [
    "not a dict", 42, None, [], {"cmd": "rm -rf /"}, {"cmd": 7}, {"nocmd": True}, {"cmd": "__init__"},
    {"cmd": "select", "address": "x" * 10_000, "multi": False}, {"cmd": "select", "address": ["resid_post.0"], "multi": False},
    {"cmd": "select", "layer": "0", "head": 1}, {"cmd": "select", "layer": 10**12, "head": 0},
    {"cmd": "select", "layer": 0, "head": 0, "extra": "x"}, {"cmd": "steer", "seq": 1, "scale": float("nan")},
    {"cmd": "steer", "seq": 1, "scale": 1e300}, {"cmd": "steer", "seq": 1, "method": "exec"},
    {"cmd": "steer", "seq": -1}, {"cmd": "contrast", "seq": 1, "positive": ["a"] * 10_000, "negative": ["b"]},
    {"cmd": "prompt", "seq": 1, "prompt": "x" * 100_000}, {"cmd": "address", "seq": 1, "address": "lm_head"},
    {"cmd": "address", "seq": 1, "address": "resid_post.99"}, {"cmd": "select", "address": "attn_probs.0.head-1", "multi": True},
    {f"k{i}": i for i in range(100)},
]


# ---- sources and packaging --------------------------------------------------------------------------------
def test_modules_are_self_contained_and_offline():
    for name in ("picker", "attention", "steering"):
        text = _static.esm(name)
        assert "export default" in text
        assert not re.search(r'^\s*import\s', text, re.M), f"{name}.js still imports something after inlining"
        urls = set(re.findall(r"https?://[^\s\"']+", text)) - {"http://www.w3.org/2000/svg"}  # the SVG namespace
        assert not urls and "fetch(" not in text, f"no network at runtime: {urls}"
    assert ".iel-root" in _static.css() and "--jp-layout-color1" in _static.css()


# ---- picker ---------------------------------------------------------------------------------------------
def test_cheatsheet_needs_no_weights_and_draws_the_structure():
    g = ie_lab.cheatsheet("gemma2")
    assert isinstance(g, Picker) and g.spec["structure"]["sandwich_norms"] and not g.spec["structure"]["parallel_block"]
    pts = {p["name"]: p for p in g.spec["points"]}
    assert pts["mlp_out"]["warnings"] == [
        "TransformerLens / TransformerBridge: blocks.{L}.hook_mlp_out is mlp_out_post on gemma2, not mlp_out as on "
        "plain pre-norm families (Llama): same name, different tensor."]
    assert pts["mlp_out"]["names"]["transformerlens"] == ""  # no faithful legacy name for the raw output here
    assert pts["mlp_out_post"]["names"]["transformerlens"] == "blocks.{L}.hook_mlp_out"
    assert "26 × q × k" not in pts["attn_probs"]["width"] and "8 × q × k" in pts["attn_probs"]["width"]
    llama = {p["name"]: p for p in ie_lab.cheatsheet("llama").spec["points"]}
    assert llama["mlp_out"]["warnings"] == [] and llama["mlp_out"]["names"]["transformerlens"] == "blocks.{L}.hook_mlp_out"
    assert set(llama["q_norm_in"]["served"]) == {"0"}  # no QK-norm on Llama
    par = ie_lab.cheatsheet("phi")
    assert par.spec["structure"]["parallel_block"]
    assert set({p["name"]: p for p in par.spec["points"]}["resid_mid"]["served"]) == {"0"}
    moe = {p["name"]: p for p in ie_lab.cheatsheet({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 3,
                                                    "num_attention_heads": 4, "num_local_experts": 8}).spec["points"]}
    assert moe["router_logits"]["served"] == "111" and moe["mlp_act"]["served"] == "000"
    vllm = {p["name"]: p for p in ie_lab.cheatsheet("llama", backend="vllm").spec["points"]}
    assert set(vllm["lm_head"]["served"]) == {"0"} and "eager" in vllm["lm_head"]["why"]["0"]
    big = ie_lab.cheatsheet({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 40, "num_attention_heads": 4})
    assert big.spec["n_layers"] == 40 and len(big.spec["points"][1]["served"]) == 40


def test_picker_on_a_session_uses_the_measured_structure(session):
    p = session.picker()
    assert p.spec["backend"] == "eager" and p.spec["handle"] == "s"
    pts = {q["name"]: q for q in p.spec["points"]}
    assert pts["resid_post"]["width"] == "d_model = 128" and pts["z"]["width"].endswith("= 128")
    table = {r.name: r for r in session.points().rows}
    for name, q in pts.items():  # greyed exactly where Session.points() refuses
        assert (q["served"][1 if q["scope"] == "layer" else 0] == "1") == table[name].served, name


def test_picker_selection_is_an_observable_address(session):
    p = session.picker()
    seen = []
    p.observe(lambda ch: seen.append(ch["new"]), "address")
    p._on_front_end_msg(p, {"cmd": "select", "address": "mlp_out.0", "multi": False}, [])
    assert p.address == ie_lab.Address("mlp_out", 0) and p.addresses == (ie_lab.Address("mlp_out", 0),)
    assert seen == [ie_lab.Address("mlp_out", 0)] and p.layer == 0 and p.selected == ["mlp_out.0"]
    p._on_front_end_msg(p, {"cmd": "select", "address": "resid_post.1", "multi": True}, [])
    assert [str(a) for a in p.addresses] == ["mlp_out.0", "resid_post.1"] and str(p.address) == "resid_post.1"
    p._on_front_end_msg(p, {"cmd": "select", "address": "resid_post.1", "multi": True}, [])  # shift-click again: off
    assert [str(a) for a in p.addresses] == ["mlp_out.0"]
    with pytest.raises(ie_lab.AddressError, match="not served"):
        p.select("q_norm_in.0")
    p.clear()
    assert p.address is None and p.addresses == ()
    assert repr(p) == "Picker(llama, 2 layers, backend=eager; layer 1; selected: none)"


def test_hostile_messages_are_rejected_without_side_effects(session, monkeypatch):
    before = _weights(session.model)
    p = session.picker()
    a = session.show_attention("Mary went to the park")
    sp = session.steering_panel("Mary went to the", vector=torch.ones(128), max_new_tokens=4)
    states = {w: (repr(w), dict(w.get_state())) for w in (p, a, sp)}
    for w in (p, a, sp):
        out = _outbox(w, monkeypatch)
        for msg in HOSTILE:
            w._on_front_end_msg(w, msg, [])
        w._on_front_end_msg(w, {"cmd": "select", "address": "resid_post.0", "multi": False}, [memoryview(b"x" * 10)])
        w._handle_msg({"content": {"data": {"method": "update", "state": {"layer": 999, "spec": {}, "scale": 1e9,
                                                                           "pattern": "AAAA", "_esm": "alert(1)"}}}})
        sp.wait()
        assert out and all(m["type"] == "error" for m in out), out
        assert len(w.rejected) >= 5
        r, st = states[w]
        assert repr(w) == r
        now = dict(w.get_state())
        assert {k: v for k, v in now.items() if k != "error"} == {k: v for k, v in st.items() if k != "error"}
    after = _weights(session.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert_clean(session._lm)


# ---- attention viewer -------------------------------------------------------------------------------------
def test_attention_viewer_sends_one_head_at_a_time(session):
    a = session.show_attention("When Mary and John went to the store", layers=[0, 1])
    n = len(a.tokens)
    assert isinstance(a, AttentionViewer) and a.n_heads == 4 and a.layers == [0, 1]
    assert len(a.pattern) == n * n * 4 and len(a.thumbs) == 4 * a.thumb_side ** 2
    ref = session.capture("When Mary and John went to the store", ["attn_probs.1"])["attn_probs.1"][0]
    a._on_front_end_msg(a, {"cmd": "select", "layer": 1, "head": 2}, [])
    assert (a.layer, a.head) == (1, 2)
    assert torch.allclose(a.head_pattern(), ref[2].float(), atol=1e-6)
    thumbs = np.frombuffer(a.thumbs, dtype=np.uint8).reshape(4, a.thumb_side, a.thumb_side)
    assert thumbs.max() == 255
    assert repr(a) == f"AttentionViewer(llama, {n} tokens: {n} tokens, layers [0, 1], 4 heads; showing layer 1 head 2)"
    with pytest.raises(ie_lab.InputError):
        session.show_attention("Mary", layers=[5])
    assert_clean(session._lm)


# ---- steering panel -----------------------------------------------------------------------------------------
def test_steering_panel_regenerates_and_the_kernel_sees_it(session, monkeypatch):
    sp = session.steering_panel("Mary went to the", positive=["happy good day", "good morning"],
                                negative=["sad bad night", "bad evening"], scale=0.0, max_new_tokens=8)
    assert sp.steered_ids == sp.baseline_ids  # scale 0 is a no-op
    assert sp.vector_source.startswith("difference of means at resid_post.1 (2 vs 2")
    out = _outbox(sp, monkeypatch)
    sp._on_front_end_msg(sp, {"cmd": "steer", "seq": 5, "method": "add", "scale": 40.0}, [])
    sp.wait()
    assert sp.seq == 5 and sp.scale == 40.0 and sp.steered_ids != sp.baseline_ids
    kinds = [m["type"] for m in out]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("token") == 8
    assert "".join(m["token"] for m in out if m["type"] == "token") == "".join(sp.steered)
    ref = session.generate("Mary went to the", 8, steer=session.steer("resid_post.1", sp.vector, scale=40.0))
    assert sp.steered_ids == ref.ids and sp.steered_text == ref.text
    assert_clean(session._lm)


def test_a_newer_value_cancels_the_generation_in_flight(session, monkeypatch):
    sp = session.steering_panel("Mary went to the", vector=torch.randn(128, generator=torch.Generator().manual_seed(1)),
                                max_new_tokens=200)
    out = _outbox(sp, monkeypatch)
    for i, scale in enumerate([1.0, 2.0, 3.0, 4.0], start=1):
        sp._on_front_end_msg(sp, {"cmd": "steer", "seq": i, "scale": scale}, [])
    sp.wait()
    assert sp.seq == 4 and sp.scale == 4.0 and len(sp.steered_ids) == 200
    done = [m["seq"] for m in out if m["type"] == "done"]
    assert done == [4], f"older generations finished: {done}"
    assert sum(1 for m in out if m["type"] == "token" and m["seq"] < 4) < 3 * 200
    assert_clean(session._lm)


def test_vector_sources_and_methods(session, tmp_path):
    v = torch.randn(128, generator=torch.Generator().manual_seed(2))
    torch.save(v, tmp_path / "v.pt")
    np.save(tmp_path / "v.npy", v.numpy())
    cache = session.capture(["Mary went home"], ["resid_post.0"])
    for src, label in ((v, "given tensor"), (str(tmp_path / "v.pt"), "saved tensor v.pt"),
                       (tmp_path / "v.npy", "saved tensor v.npy"), (cache, "capture of resid_post.0")):
        sp = session.steering_panel("Mary went to the", address="resid_post.0", vector=src, max_new_tokens=3)
        assert sp.vector_source.startswith(label) and sp.vector.shape == (128,)
    sp.update(method="cap", cap_min=-0.5, cap_max=0.5)
    assert sp.method == "cap" and len(sp.steered) == 3 and "min=-0.5, max=0.5" in repr(sp)
    sp.update(method="ablate")
    sp.update(method="cap", cap_min=2.0, cap_max=1.0)  # min > max: shown as an error, nothing raised
    assert sp.status == "error" and "above max" in sp.error
    sp.update(cap_min=-1.0, cap_max=1.0)
    assert sp.status == "ready" and sp.error == ""
    sp.set_address("mlp_out.1")
    assert sp.address == "mlp_out.1" and sp.status == "ready"
    p = session.picker()
    sp.link(p)
    p.select("resid_mid.0")
    sp.wait()
    assert sp.address == "resid_mid.0"
    with pytest.raises(ie_lab.AddressError):
        session.steering_panel("Mary", address="attn_probs.0", vector=v)
    with pytest.raises(ie_lab.InputError):
        session.steering_panel("Mary", vector=torch.ones(7))
    assert "0x" not in repr(sp) and repr(sp).startswith("SteeringPanel(cap at resid_mid.0")
    assert_clean(session._lm)


def test_static_state_holds_what_is_on_screen(session):
    """A saved notebook's widget state is enough to draw each panel again (no kernel)."""
    a = session.show_attention("Mary went to the park")
    st = a.get_state()
    assert {"tokens", "thumbs", "pattern", "layer", "head", "_esm", "_css"} <= set(st)
    sp = session.steering_panel("Mary went to the", vector=torch.ones(128), max_new_tokens=4)
    assert sp.get_state()["steered"] == sp.steered and sp.get_state()["baseline"]
    assert os.path.basename(_static.folder()) == "widgets"
