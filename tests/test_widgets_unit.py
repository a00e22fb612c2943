"""The notebook panels in plain Python: traits, front-end messages (good and hostile), reprs. No browser."""

import os
import re
import threading

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
    "not a dict",
    42,
    None,
    [],
    {"cmd": "rm -rf /"},
    {"cmd": 7},
    {"nocmd": True},
    {"cmd": "__init__"},
    {"cmd": "select", "address": "x" * 10_000, "multi": False},
    {"cmd": "select", "address": ["resid_post.0"], "multi": False},
    {"cmd": "select", "layer": "0", "head": 1},
    {"cmd": "select", "layer": 10**12, "head": 0},
    {"cmd": "select", "layer": 0, "head": 0, "extra": "x"},
    {"cmd": "steer", "seq": 1, "scale": float("nan")},
    {"cmd": "steer", "seq": 1, "scale": 1e300},
    {"cmd": "steer", "seq": 1, "method": "exec"},
    {"cmd": "steer", "seq": -1},
    {"cmd": "contrast", "seq": 1, "positive": ["a"] * 10_000, "negative": ["b"]},
    {"cmd": "prompt", "seq": 1, "prompt": "x" * 100_000},
    {"cmd": "address", "seq": 1, "address": "lm_head"},
    {"cmd": "address", "seq": 1, "address": "resid_post.99"},
    {"cmd": "select", "address": "attn_probs.0.head-1", "multi": True},
    {f"k{i}": i for i in range(100)},
    # JSON can carry lone surrogates; the tokenizer fails on them later (a TypeError), so they are refused on arrival
    {"cmd": "prompt", "seq": 1, "prompt": "Mary \ud800"},
    {"cmd": "contrast", "seq": 1, "positive": ["\udfff"], "negative": ["b"]},
    # an integer literal too long for a float (JSON may carry one; float() raised OverflowError into the kernel)
    {"cmd": "steer", "seq": 1, "scale": 10**400},
    {"cmd": "steer", "seq": 10**400, "scale": 1.0},
]

# Whole comm messages as ipywidgets receives them, malformed below the level of a panel's commands.
MALFORMED_COMM = [
    {
        "content": {"data": {"method": "update", "state": {"layer": 1}, "buffer_paths": [["layer", "x"]]}},
        "buffers": [memoryview(b"1234")],
    },
    {"content": {"data": {"method": "update", "state": {"a": {}}, "buffer_paths": [["a", "b", "c"]]}}, "buffers": []},
    {"content": {"data": {"method": "update", "state": "junk"}}, "buffers": []},
    {"content": {"data": {"method": "custom", "content": {"cmd": "cancel"}}}, "buffers": "not a list"},
    {"content": {"data": {"method": "exec", "code": "import os"}}, "buffers": []},
    {"content": {"data": {"method": 5}}},
    {"content": {"data": ["update"]}},
    {"content": "x"},
    {},
    "junk",
]


# ---- sources and packaging --------------------------------------------------------------------------------
def test_modules_are_self_contained_and_offline():
    for cls in (Picker, AttentionViewer, SteeringPanel):
        text = str(cls._esm)  # what anywidget sends: the bundle's text
        assert re.search(r"^export \{[^}]*\bas default\b", text, re.M), cls.__name__
        assert not re.search(r"^\s*import\s", text, re.M), f"{cls.__name__}'s bundle still imports something"
        urls = set(re.findall(r"https?://[^\s\"']+", text)) - {"http://www.w3.org/2000/svg"}  # the SVG namespace
        assert not urls and "fetch(" not in text, f"no network at runtime: {urls}"
    css = str(Picker._css)
    assert ".iel-root" in css and "--jp-layout-color1" in css


# ---- picker ---------------------------------------------------------------------------------------------
def test_cheatsheet_needs_no_weights_and_draws_the_structure():
    g = ie_lab.cheatsheet("gemma2")
    assert isinstance(g, Picker) and g.spec["structure"]["sandwich_norms"] and not g.spec["structure"]["parallel_block"]
    pts = {p["name"]: p for p in g.spec["points"]}
    assert pts["mlp_out"]["warnings"] == [
        "TransformerLens / TransformerBridge: blocks.{L}.hook_mlp_out is mlp_out_post on gemma2, not mlp_out as on "
        "plain pre-norm families (Llama): same name, different tensor."
    ]
    assert pts["mlp_out"]["names"]["transformerlens"] == ""  # no faithful legacy name for the raw output here
    assert pts["mlp_out_post"]["names"]["transformerlens"] == "blocks.{L}.hook_mlp_out"
    assert "26 × q × k" not in pts["attn_probs"]["width"] and "8 × q × k" in pts["attn_probs"]["width"]
    llama = {p["name"]: p for p in ie_lab.cheatsheet("llama").spec["points"]}
    assert (
        llama["mlp_out"]["warnings"] == [] and llama["mlp_out"]["names"]["transformerlens"] == "blocks.{L}.hook_mlp_out"
    )
    assert set(llama["q_norm_in"]["served"]) == {"0"}  # no QK-norm on Llama
    par = ie_lab.cheatsheet("phi")
    assert par.spec["structure"]["parallel_block"]
    assert set({p["name"]: p for p in par.spec["points"]}["resid_mid"]["served"]) == {"0"}
    moe = {
        p["name"]: p
        for p in ie_lab.cheatsheet(
            {
                "model_type": "mixtral",
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_local_experts": 8,
            }
        ).spec["points"]
    }
    assert moe["router_logits"]["served"] == "111" and moe["mlp_act"]["served"] == "000"
    vllm = {p["name"]: p for p in ie_lab.cheatsheet("llama", backend="vllm").spec["points"]}
    assert set(vllm["lm_head"]["served"]) == {"0"} and "eager" in vllm["lm_head"]["why"]["0"]
    big = ie_lab.cheatsheet(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 40, "num_attention_heads": 4}
    )
    assert big.spec["n_layers"] == 40 and len(big.spec["points"][1]["served"]) == 40


def test_picker_on_a_session_uses_the_measured_structure(session):
    p = session.picker()
    assert p.spec["backend"] == "eager" and p.spec["handle"] == {"var": "session", "kind": "session"}
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
        w._handle_msg(
            {
                "content": {
                    "data": {
                        "method": "update",
                        "state": {"layer": 999, "spec": {}, "scale": 1e9, "pattern": "AAAA", "_esm": "alert(1)"},
                    }
                }
            }
        )
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


def test_malformed_comm_messages_are_refused_in_the_panel(session, monkeypatch):
    """Below the commands: ipywidgets would apply buffer_paths (and fail on bad ones) before set_state refuses."""
    p = session.picker()
    a = session.show_attention("Mary went to the park")
    sp = session.steering_panel("Mary went to the", vector=torch.ones(128), max_new_tokens=4)
    for w in (p, a, sp):
        state = {k: v for k, v in w.get_state().items() if k != "error"}
        out = _outbox(w, monkeypatch)
        for msg in MALFORMED_COMM:
            n = len(out)
            w._handle_msg(msg)
            assert len(out) == n + 1 and out[-1]["type"] == "error", (type(w).__name__, msg, out[n:])
            assert w.error == out[-1]["message"]  # on screen, and in the kernel's state
        assert {k: v for k, v in w.get_state().items() if k != "error"} == state
        # a well-formed message still works afterwards
        w._handle_msg(
            {
                "content": {
                    "data": {
                        "method": "custom",
                        "content": {"cmd": "cancel"}
                        if w is sp
                        else {"cmd": "clear"}
                        if w is p
                        else {"cmd": "select", "layer": 1, "head": 3},
                    }
                },
                "buffers": [],
            }
        )
    assert (a.layer, a.head) == (1, 3) and a.error == ""
    assert_clean(session._lm)


def test_picker_error_is_cleared_by_the_next_valid_selection(session):
    p = session.picker()
    p._on_front_end_msg(p, {"cmd": "select", "address": "q_norm_in.0", "multi": False}, [])
    assert "not served" in p.error and p.address is None  # the refusal is on screen and in the kernel's state
    p._on_front_end_msg(p, {"cmd": "select", "address": "mlp_out.0", "multi": False}, [])
    assert p.error == "" and str(p.address) == "mlp_out.0"
    p._on_front_end_msg(p, {"cmd": "select", "address": "resid_post.9", "multi": True}, [])
    assert "out of range" in p.error and [str(x) for x in p.addresses] == ["mlp_out.0"]
    p.select("resid_post.1")  # a selection from Python (or a linked cell) clears it too
    assert p.error == "" and str(p.address) == "resid_post.1"
    p._on_front_end_msg(p, {"cmd": "select", "address": "lm_head.3", "multi": False}, [])
    assert p.error
    p._on_front_end_msg(p, {"cmd": "clear"}, [])
    assert p.error == "" and p.address is None


# ---- attention viewer -------------------------------------------------------------------------------------
def test_attention_viewer_sends_one_head_at_a_time(session):
    a = session.show_attention("When Mary and John went to the store", layers=[0, 1])
    n = len(a.tokens)
    assert isinstance(a, AttentionViewer) and a.n_heads == 4 and a.layers == [0, 1]
    assert len(a.pattern) == n * n * 4 and len(a.thumbs) == 4 * a.thumb_side**2
    ref = session.capture("When Mary and John went to the store", ["attn_probs.1"])["attn_probs.1"][0]
    a._on_front_end_msg(a, {"cmd": "select", "layer": 1, "head": 2}, [])
    assert (a.layer, a.head) == (1, 2)
    assert torch.allclose(a.head_pattern(), ref[2].float(), atol=1e-6)
    thumbs = np.frombuffer(a.thumbs, dtype=np.uint8).reshape(4, a.thumb_side, a.thumb_side)
    assert thumbs.max() == 255
    assert repr(a) == f"AttentionViewer(llama: {n} tokens, layers [0, 1], 4 heads; showing layer 1 head 2)"
    with pytest.raises(ie_lab.InputError):
        session.show_attention("Mary", layers=[5])
    assert_clean(session._lm)


# ---- steering panel -----------------------------------------------------------------------------------------
def test_steering_panel_regenerates_and_the_kernel_sees_it(session, monkeypatch):
    sp = session.steering_panel(
        "Mary went to the",
        address="resid_post.1",
        positive=["happy good day", "good morning"],
        negative=["sad bad night", "bad evening"],
        scale=0.0,
        max_new_tokens=8,
    )
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
    sp = session.steering_panel(
        "Mary went to the", vector=torch.randn(128, generator=torch.Generator().manual_seed(1)), max_new_tokens=200
    )
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
    cache = session.capture("Mary went home", ["resid_post.0"])
    for src, label in (
        (v, "given tensor"),
        (str(tmp_path / "v.pt"), "saved tensor v.pt"),
        (tmp_path / "v.npy", "saved tensor v.npy"),
        (cache, "capture of resid_post.0"),
    ):
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
    assert _static.bundle("attention.js").read_text(encoding="utf-8") == st["_esm"]


def test_a_prompt_the_model_cannot_continue_is_refused_and_the_last_one_keeps_working(session, monkeypatch):
    v = torch.randn(128, generator=torch.Generator().manual_seed(3))
    sp = session.steering_panel("Mary went to the", address="resid_post.1", vector=v, max_new_tokens=8)
    limit = session.facts.max_positions
    fits_alone = "word " * (limit - 6)  # inside the context, but not with 8 new tokens
    assert session.tokens(fits_alone).shape[-1] == limit - 6
    with pytest.raises(ie_lab.InputError, match=f"context of {limit}"):
        session.steering_panel(fits_alone, vector=v, max_new_tokens=8)
    out = _outbox(sp, monkeypatch)
    for seq, prompt in ((1, fits_alone), (2, "word " * (limit + 40))):
        sp._on_front_end_msg(sp, {"cmd": "prompt", "seq": seq, "prompt": prompt}, [])
        sp.wait()
        assert sp.prompt == "Mary went to the", "a prompt over the context replaced the working one"
        assert re.search(f"context (of|is) {limit}", sp.error) and out[-1] == {"type": "error", "message": sp.error}
    # every later command works with the previous prompt
    sp._on_front_end_msg(sp, {"cmd": "steer", "seq": 3, "scale": 8.0}, [])
    sp.wait()
    assert sp.status == "ready" and sp.error == "" and sp.seq == 3
    ref = session.generate("Mary went to the", 8, steer=session.steer("resid_post.1", v, scale=8.0))
    assert sp.steered_ids == ref.ids
    sp._on_front_end_msg(sp, {"cmd": "prompt", "seq": 4, "prompt": "John went to the"}, [])
    sp.wait()
    assert sp.prompt == "John went to the" and sp.baseline_ids == session.generate("John went to the", 8).ids
    assert_clean(session._lm)


def _gate_progress(panel, at=1):
    """Hold the vector job when it reports `at` prompts done (on the session's loop thread), until released."""
    reached, release, seen = threading.Event(), threading.Event(), []

    def gate(change):
        seen.append((change["new"][0], threading.get_ident()))
        if change["new"][0] == at:
            reached.set()
            release.wait(60)

    panel.observe(gate, "progress")
    return reached, release, seen


CONTRAST = {
    "positive": [f"happy good day {i}" for i in range(64)],  # the largest message: 64 prompts a side
    "negative": [f"sad bad night {i}" for i in range(64)],
}


def test_the_largest_contrast_runs_in_the_background_with_progress(session, monkeypatch):
    sp = session.steering_panel("Mary went to the", address="resid_post.1", vector=torch.ones(128), max_new_tokens=4)
    assert sp.has_trait("progress"), "the panel has no progress to show"
    reached, release, seen = _gate_progress(sp, at=64)  # progress moves once a batch: 64 prompts on this model
    out = _outbox(sp, monkeypatch)
    try:
        sp._on_front_end_msg(sp, {"cmd": "contrast", "seq": 3, **CONTRAST}, [])
        # the handler has returned while the job is held after its first batch: the kernel's shell is free
        assert reached.wait(60), "the vector job never reported progress"
        assert sp.status == "vector" and sp.progress == [64, 128]
        assert torch.equal(sp.vector, torch.ones(128)) and sp.vector_source == "given tensor"  # nothing committed yet
    finally:
        release.set()
    sp.wait()
    assert all(tid != threading.get_ident() for n, tid in seen if n > 0), "prompts were captured on the kernel's thread"
    assert [n for n, _ in seen if n > 0] == [64, 128]  # one batch a side (tests/test_steering_panel_batches.py)

    def mean(prompts):
        return torch.stack(
            [session.capture(p, ["resid_post.1"])["resid_post.1"][0].float().mean(0) for p in prompts]
        ).mean(0)

    ref = mean(CONTRAST["positive"]) - mean(CONTRAST["negative"])
    assert torch.allclose(sp.vector, ref, atol=1e-5)
    assert sp.vector_source == "difference of means at resid_post.1 (64 vs 64 prompts)"
    assert sp.status == "ready" and sp.seq == 3 and sp.progress == [128, 128] and sp.error == ""
    gen = session.generate("Mary went to the", 4, steer=session.steer("resid_post.1", sp.vector, scale=sp.scale))
    assert sp.steered_ids == gen.ids
    assert [m["type"] for m in out][-1] == "done" and out[-1]["seq"] == 3
    assert_clean(session._lm)


@pytest.mark.parametrize("how", ["newer message", "close"])
def test_a_newer_message_or_close_cancels_the_contrast(session, monkeypatch, how):
    v = torch.randn(128, generator=torch.Generator().manual_seed(4))
    sp = session.steering_panel("Mary went to the", address="resid_post.1", vector=v, max_new_tokens=4)
    reached, release, seen = _gate_progress(sp, at=64)
    out = _outbox(sp, monkeypatch)
    try:
        sp._on_front_end_msg(sp, {"cmd": "contrast", "seq": 3, **CONTRAST}, [])
        assert reached.wait(60), "the vector job never reported progress"
        if how == "close":
            sp.close()
        else:
            sp._on_front_end_msg(sp, {"cmd": "steer", "seq": 4, "scale": 2.0}, [])
    finally:
        release.set()
    sp.wait()
    assert max(n for n, _ in seen) < 128, "the cancelled job captured every prompt"
    assert torch.equal(sp.vector, v) and sp.vector_source == "given tensor" and sp.positive == []
    if how == "close":
        assert sp._future.cancelled() and sp.status == "ready"
    else:
        assert sp.seq == 4 and sp.status == "ready"
        assert [m["seq"] for m in out if m["type"] == "done"] == [4]
        ref = session.generate("Mary went to the", 4, steer=session.steer("resid_post.1", v, scale=2.0))
        assert sp.steered_ids == ref.ids
    assert session.capture("Mary", ["resid_post.0"])["resid_post.0"].shape[-1] == 128  # the session still works
    assert_clean(session._lm)


def _drawn_blocks(structures: dict) -> dict:
    """The picker's own layout code (widgets/util.js) run under node: per key, the module labels of the block."""
    import json
    import shutil
    import subprocess

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    util = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "widgets", "util.js")
    script = (
        f"import {{ layoutBlock }} from {json.dumps('file://' + util)};\n"
        "let d = ''; process.stdin.on('data', (c) => d += c); process.stdin.on('end', () => {\n"
        "  const out = {}; for (const [k, [st, layer]] of Object.entries(JSON.parse(d))) {\n"
        "    const lay = layoutBlock(st, st.moe_layers.includes(layer), null, layer);\n"
        "    out[k] = lay.items.filter((i) => i.kind === 'module' || i.kind === 'trunk').map((i) => i.label); }\n"
        "  process.stdout.write(JSON.stringify(out)); });\n"
    )
    r = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        input=json.dumps(structures),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _truth(family: str) -> dict:
    """What the real module tree of the family's tiny model says: positions per layer, and the block's norms."""
    from torch import nn

    from tests.families import MAX_POS, is_norm_module, make_model

    model = make_model(family)
    tok_emb = model.get_input_embeddings()
    learned = any(
        isinstance(m, nn.Embedding) and m is not tok_emb and MAX_POS <= m.num_embeddings <= MAX_POS + 2
        for m in model.modules()
    )
    # a rotary-embedding module, or rotary dims kept on the attention itself (GPT-J computes its sin/cos there)
    rotary = any("rotary" in type(m).__name__.lower() or getattr(m, "rotary_dim", None) for m in model.modules())
    layers = next(
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == model.config.num_hidden_layers
    )
    sinusoidal = any("Sinusoidal" in type(m).__name__ or hasattr(m, "pos_encoding") for m in model.modules())
    positions = []
    for layer in layers:
        attn = next((m for n, m in layer.named_children() if "attn" in n or "attention" in n), None)
        if learned:
            positions.append("learned")
        elif sinusoidal:  # CTRL: fixed sin/cos positions added to the embedding
            positions.append("sinusoidal")
        elif not rotary:
            positions.append("alibi")
        elif attn is not None and not getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers
            positions.append("none")
        else:
            positions.append("rope")
    # the block's own norms (not q/k norms); a child that holds the attention is a wrapper around it and its norms
    # (DBRX's norm_attn_norm), not a norm itself
    norms = []
    for n, m in layers[0].named_children():
        holds_attn = any("attn" in c or "attention" in c for c, _ in m.named_children())
        norms += [f"{n}.{c}" for c, cm in m.named_children() if is_norm_module(cm)] if holds_attn else []
        norms += [n] if is_norm_module(m) and not holds_attn else []
    return {"positions": positions, "norms": norms}


def test_cheatsheet_labels_are_the_models_own_facts_for_every_family():
    """Issue 19: GPT-NeoX drew a shared norm plus a second one; GPT-2 was labelled RoPE. The drawn labels of
    every family's block are checked against its real module tree (positions, and how many norms a block has)."""
    from ie_lab.arch.config_facts import ArchFacts
    from ie_lab.widgets.picker import describe
    from tests.families import FAMILIES, make_config

    specs, truths = {}, {}
    for fam in FAMILIES:
        facts = ArchFacts.from_config(make_config(fam))
        st = describe(facts, "eager")["structure"]
        truths[fam] = _truth(fam)
        for L in range(facts.n_layers):
            specs[f"{fam}/{L}"] = [st, L]
    drawn = _drawn_blocks(specs)
    bad = []
    for key, labels in drawn.items():
        fam, L = key.split("/")
        if int(L) in specs[key][0]["mixer_layers"]:  # draws its mixer, not attention: test_picker_layer_kinds.py
            continue
        t = truths[fam]
        pos = t["positions"][int(L)]
        attn = [x for x in labels if x.startswith("attention (")]
        emb = labels[0]
        ok_pos = (
            len(attn) == 1
            and {
                "rope": "RoPE" in attn[0] and "NoPE" not in attn[0],
                "learned": "RoPE" not in attn[0] and "ALiBi" not in attn[0] and "position" in emb,
                "alibi": "ALiBi" in attn[0],
                "sinusoidal": "RoPE" not in attn[0] and "ALiBi" not in attn[0] and "sinusoidal" in emb,
                "none": "NoPE" in attn[0],
            }[pos]
            and (pos in ("learned", "sinusoidal")) == ("position" in emb)
        )
        # the block's own norms: not the final norm, nor the attention-internal ones (QK-norm, a latent's norm)
        block_norms = [
            x for x in labels if "norm" in x and x not in ("final norm", "q_norm · k_norm") and "proj" not in x
        ]
        ok_norms = len(block_norms) == len(t["norms"])
        if not (ok_pos and ok_norms):
            bad.append(f"{key}: truth {pos}, norms {t['norms']}; drawn {emb!r}, {attn}, {block_norms}")
    assert not bad, "\n".join(bad)
    # the two reported cases, spelled out
    assert [x for x in drawn["gpt_neox/0"] if "norm" in x][:2] == [
        "input norm (attention branch)",
        "input norm (MLP branch)",
    ]
    assert not any("shared" in x for x in drawn["gpt_neox/0"])
    assert "input norm (shared)" in drawn["gptj/0"]
    assert drawn["gpt2/0"][0] == "token + position embedding" and "attention (q·kᵀ, softmax)" in drawn["gpt2/0"]


def test_picker_on_a_session_labels_from_the_measured_block():
    from tests.conftest import lm_for

    for fam, separate in (("gpt_neox", "separate"), ("gptj", "shared"), ("llama", "none")):
        st = Picker(lm_for(fam).facts, "eager", lm=lm_for(fam)).spec["structure"]
        assert st["parallel_norms"] == separate, fam
    assert Picker(lm_for("gpt2").facts, "eager", lm=lm_for("gpt2")).spec["structure"]["positions"][0] == "learned"


def test_a_panel_without_a_vector_says_so_until_it_has_one(session):
    sp = session.steering_panel("Mary went to the", max_new_tokens=3)
    try:
        assert (sp.status, sp.has_vector) == ("no vector", False)
        assert sp.steered_ids == sp.baseline_ids
        sp.update(scale=3.0)  # a knob without a vector: kept, nothing generated, still says what is missing
        assert (sp.status, sp.scale, sp.seq) == ("no vector", 3.0, 0)
        sp.set_contrast(["happy good day"], ["sad bad night"])
        assert sp.has_vector
        sp.update(scale=8.0)
        assert sp.status == "ready" and sp.seq == 1
    finally:
        sp.close()
    assert_clean(session._lm)


def test_snippets_name_the_variable_the_notebook_has(session):
    # issue 33: the picker's snippet called an undefined `lm`; panels now call the session (or model) by the name
    # the user's code holds it under, found from the calling code (a notebook cell's namespace here), or var_name=
    ns = {"mysession": session}
    exec("p = mysession.picker(); sp = mysession.steering_panel('Mary went to the', max_new_tokens=2)", ns)
    assert ns["p"].spec["handle"] == {"var": "mysession", "kind": "session"}
    assert ns["sp"].var_name == "mysession"
    exec("q = ie_lab.cheatsheet(mysession)", {"mysession": session, "ie_lab": ie_lab}, ns)
    assert ns["q"].spec["handle"] == {"var": "mysession", "kind": "session"}
    assert session.picker(var_name="sess").spec["handle"]["var"] == "sess"
    assert ie_lab.cheatsheet("gemma2").spec["handle"] == {"var": "s", "kind": "family"}
    lm = ie_lab.load(*tiny_model("llama"))
    assert ie_lab.cheatsheet(lm).spec["handle"] == {"var": "lm", "kind": "model"}
    with pytest.raises(ie_lab.InputError, match="variable name"):
        session.picker(var_name="not a name")
    for w in (ns["p"], ns["sp"], ns["q"]):
        w.close()


def test_figures_follow_the_theme_jupyterlab_saved(tmp_path, monkeypatch):
    # issue 33: plotly figures stayed white in the dark theme; they are drawn for the theme JupyterLab saved
    import plotly.graph_objects as go
    import plotly.io as pio

    from ie_lab.core.plot_theme import jupyterlab_theme, themed

    monkeypatch.setenv("JUPYTERLAB_SETTINGS_DIR", str(tmp_path))
    assert jupyterlab_theme() == "light"  # no settings saved: JupyterLab's default
    f = tmp_path / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    f.parent.mkdir(parents=True)
    # JSON5 as JupyterLab writes it: the schema's default commented out above the value chosen
    f.write_text('{\n    // "theme": "JupyterLab Light",\n    "theme": "JupyterLab Dark"\n}\n')
    assert jupyterlab_theme() == "dark"
    fig = themed(go.Figure(go.Bar(x=[1], y=[1])))
    assert fig.layout.template.layout.font.color == pio.templates["plotly_dark"].layout.font.color
    assert fig.layout.paper_bgcolor == "rgba(0,0,0,0)" and fig.layout.plot_bgcolor == "rgba(0,0,0,0)"
    f.write_text('{\n    // "theme": "JupyterLab Dark",\n    "theme": "JupyterLab Light"\n}\n')
    assert jupyterlab_theme() == "light"
    monkeypatch.setattr(pio.templates, "default", "seaborn")  # the user's own default template is kept
    assert themed(go.Figure()).layout.template == go.Figure().layout.template
