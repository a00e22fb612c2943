"""SAE splicing on the eager backend (issue 31 item 2): s.splice(sae, error=) replaces the SAE's point by its
reconstruction, checked against a hand-written forward hook that computes decode(encode(x)) from the SAE's weights;
error=True leaves every output as the plain run and turns a clamp into exactly (clamp - act) * W_dec[f]; the
features read as 'sae.<name>.acts' are encode() of the point. A neighbouring point (another layer's) gives other
numbers, so a splice placed or read at the wrong point fails these tests. Bad input is refused before any hook
exists, and no hook is left after any error."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

import ie_lab
from ie_lab import tiny
from ie_lab.capabilities import SPLICING, require
from ie_lab.errors import AddressError, CapabilityUnsupported, InputError
from tests.families import make_config, make_tokenizer

TEXT = "the cat sat on the mat and then it ran away"
LAYER = 1  # the SAE's point: resid_post.1 (the model has 3 layers)


@pytest.fixture(scope="module")
def s():
    config = make_config("llama")
    config.num_hidden_layers = 3
    sess = ie_lab.Session(
        tiny.build(config, gains="discriminating"), tokenizer=make_tokenizer(), progress=False, replace=False
    )
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def sae(s, tmp_path_factory):
    """A random ReLU SAE at resid_post.1, scaled so that a fair share of its features fire."""
    d, n = s.facts.d_model, 64
    g = torch.Generator().manual_seed(0)
    w = {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "W_dec": torch.randn(n, d, generator=g) / n**0.5,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }
    folder = tmp_path_factory.mktemp("sae") / "res1"
    folder.mkdir()
    save_file(w, str(folder / "sae_weights.safetensors"))
    cfg = dict(architecture="standard", hook_name=f"blocks.{LAYER}.hook_resid_post", d_in=d, d_sae=n)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return ie_lab.load_sae(str(folder), s)


def _encode(sae, x: torch.Tensor) -> torch.Tensor:
    """The ReLU SAE's encoder written out: relu((x - b_dec) @ W_enc + b_enc)."""
    return torch.relu((x.float() - sae.b_dec) @ sae.W_enc + sae.b_enc)


def _decode(sae, f: torch.Tensor) -> torch.Tensor:
    return f @ sae.W_dec + sae.b_dec


def _logits(g) -> torch.Tensor:
    return torch.stack([st.logits.float().reshape(-1) for st in g.steps])


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _hand(s, sae, layer: int, read: int) -> torch.Tensor:
    """resid_post.<read> of a raw forward whose layer `layer` output is replaced by decode(encode(x)), by hand."""
    hf = s.model
    got = {}

    def splice(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        new = _decode(sae, _encode(sae, h)).to(h.dtype)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    def keep(mod, args, out):
        got["x"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    handles = [hf.model.layers[layer].register_forward_hook(splice), hf.model.layers[read].register_forward_hook(keep)]
    try:
        with torch.no_grad():
            hf(s._lm.to_tokens(TEXT))
    finally:
        for h in handles:
            h.remove()
    return got["x"]


def test_error_false_is_the_reconstruction_by_hand_and_error_true_is_the_plain_run(s, sae):
    plain = s.capture(TEXT, ["resid_post.2", "resid_post.1"])
    bare = s.capture(TEXT, ["resid_post.2", "resid_post.1"], splice=s.splice(sae))
    kept = s.capture(TEXT, ["resid_post.2", "resid_post.1"], splice=s.splice(sae, error=True))
    ref = _hand(s, sae, LAYER, 2)
    torch.testing.assert_close(bare["resid_post.2"], ref, rtol=1e-5, atol=1e-5)
    x = plain["resid_post.1"]
    torch.testing.assert_close(bare["resid_post.1"], _decode(sae, _encode(sae, x)), rtol=1e-5, atol=1e-5)
    assert (bare["resid_post.2"] - plain["resid_post.2"]).abs().max() > 1e-2  # the splice changes the run
    neighbour = _hand(s, sae, 0, 2)  # the same SAE spliced one layer early: other numbers
    assert not torch.allclose(neighbour, bare["resid_post.2"], atol=1e-3)
    for a in ("resid_post.1", "resid_post.2"):
        torch.testing.assert_close(kept[a], plain[a], rtol=0, atol=1e-6)
    g0 = s.generate(TEXT, 6)
    g1 = s.generate(TEXT, 6, splice=s.splice(sae, error=True))
    assert g1.ids == g0.ids
    torch.testing.assert_close(_logits(g1), _logits(g0), rtol=0, atol=1e-5)
    g2 = s.generate(TEXT, 6, splice=s.splice(sae))
    assert not torch.allclose(_logits(g2)[0], _logits(g0)[0], atol=1e-3)
    steps = list(s.generate_stream(TEXT, 6, splice=s.splice(sae)))
    assert [st.token_id for st in steps] == g2.ids


def test_a_clamp_with_the_error_term_moves_the_point_by_exactly_its_decoder_direction(s, sae):
    plain = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
    act = _encode(sae, plain)
    f, v = 5, 3.0
    spec = s.splice(sae, error=True).clamp([f], v)
    got = s.capture(TEXT, ["resid_post.1"], splice=spec)["resid_post.1"]
    want = (v - act[..., f])[..., None] * sae.W_dec[f]
    torch.testing.assert_close(got - plain, want, rtol=1e-4, atol=1e-5)
    other = (v - act[..., f + 1])[..., None] * sae.W_dec[f + 1]  # a neighbouring feature's direction
    assert not torch.allclose(got - plain, other, atol=1e-3)
    on = act[0, :, f] > 0
    ablated = s.capture(TEXT, ["resid_post.1"], splice=s.splice(sae, error=True).ablate(f))["resid_post.1"]
    torch.testing.assert_close(ablated - plain, -act[..., f, None] * sae.W_dec[f], rtol=1e-4, atol=1e-5)
    assert bool(on.any())  # the ablated feature fires somewhere, so the check above is not 0 == 0


def test_feature_activations_are_encode_of_the_point_with_the_edits(s, sae):
    plain = s.capture(TEXT, ["resid_post.1", "resid_post.0"])
    name = f"sae.{sae.name}.acts"
    assert sae.name == "res1"
    spec = s.splice(sae).clamp([2, 7], 1.5).ablate(7)
    c = s.capture(TEXT, [name], splice=spec)
    want = _encode(sae, plain["resid_post.1"])
    want[..., 2], want[..., 7] = 1.5, 0.0
    assert c[name].shape == (1, plain["resid_post.1"].shape[1], sae.d_sae)
    torch.testing.assert_close(c[name], want, rtol=1e-5, atol=1e-5)
    neighbour = _encode(sae, plain["resid_post.0"])
    neighbour[..., 2], neighbour[..., 7] = 1.5, 0.0
    assert not torch.allclose(c[name], neighbour, atol=1e-3)
    # a list of prompts: one Cache each, its own tokens only
    many = s.capture([TEXT, "the mat"], ["resid_post.1", name], splice=s.splice(sae))
    for cache in many:
        x = s.capture(cache.tokens, ["resid_post.1"])
        torch.testing.assert_close(cache[name], _encode(sae, x["resid_post.1"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="no SAE of that name is spliced"):
        s.capture(TEXT, [name])
    with pytest.raises(InputError, match="read by capture"):
        s.generate(TEXT, 2, capture=[name], splice=spec)


def test_a_with_block_splices_its_own_thread_only(s, sae):
    plain = s.capture(TEXT, ["resid_post.2"])["resid_post.2"]
    spliced = s.capture(TEXT, ["resid_post.2"], splice=s.splice(sae))["resid_post.2"]
    seen = {}
    with s.splice(sae):
        t = threading.Thread(target=lambda: seen.update(other=s.capture(TEXT, ["resid_post.2"])["resid_post.2"]))
        t.start()
        t.join()
        mine = s.capture(TEXT, ["resid_post.2"])["resid_post.2"]
        raw = _plain_ref(s)  # a raw forward inside the block is spliced too
    torch.testing.assert_close(mine, spliced, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen["other"], plain, rtol=0, atol=1e-6)
    assert _hooks(s.model) == 0
    assert not torch.allclose(raw, _plain_ref(s), atol=1e-3)
    # the free functions splice the same way
    lm = s._lm
    free = ie_lab.capture(lm, TEXT, ["resid_post.2"], splice=ie_lab.splice(lm, sae))["resid_post.2"]
    torch.testing.assert_close(free, spliced, rtol=0, atol=1e-6)


def test_bad_input_is_refused_naming_the_fix_and_leaves_no_hook(s, sae, tmp_path):
    spec = s.splice(sae)
    for bad, match in (
        (lambda: spec.clamp([sae.d_sae], 1.0), "not a feature of this SAE"),
        (lambda: spec.ablate([-1]), "not a feature of this SAE"),
        (lambda: spec.clamp([1], float("nan")), "not finite"),
        (lambda: spec.clamp([1], float("inf")), "not finite"),
        (lambda: spec.clamp([1], "big"), "finite real number"),
        (lambda: s.capture(TEXT, ["resid_post.1"], splice="sae"), "make one with s.splice"),
        (lambda: s.splice(sae, error="yes"), "error=True"),
        (lambda: ie_lab.load_sae(str(tmp_path), s, name="a.b"), "name="),
    ):
        with pytest.raises((InputError, AddressError)) as e:
            bad()
        if match:
            assert match in str(e.value)
    # an SAE whose point is not in this model: layer 9 of a 3-layer model, or another width
    far = ie_lab.load_sae(_save(tmp_path / "far", sae), address="resid_post.9")
    with pytest.raises(InputError, match="load the SAE with this model"):
        s.splice(far)
    wide = ie_lab.load_sae(_save(tmp_path / "wide", sae), address="mlp_act.1")
    with pytest.raises((InputError, AddressError), match="load the SAE with this model|wide"):
        s.splice(wide)
    # a failure inside the forward (a broken encoder) leaves the model as before
    broken = s.splice(sae)
    broken._enc = None
    with pytest.raises(Exception):
        s.capture(TEXT, ["resid_post.1"], splice=broken)
    with pytest.raises(Exception):
        with broken:
            s.generate(TEXT, 2)
    assert _hooks(s.model) == 0
    plain = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
    torch.testing.assert_close(plain, _plain_ref(s), rtol=0, atol=1e-6)


def _plain_ref(s) -> torch.Tensor:
    """resid_post.1 of a raw forward (layer 1's output), read by a hook of the test's own."""
    got = {}
    h = s.model.model.layers[1].register_forward_hook(
        lambda m, a, out: got.update(x=out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            s.model(s._lm.to_tokens(TEXT))
    finally:
        h.remove()
    return got["x"]


def _save(folder, sae) -> str:
    folder.mkdir()
    path = str(folder / "w.safetensors")
    save_file({"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}, path)
    return path


def test_a_remote_session_refuses_splicing_naming_the_eager_backend():
    require(SPLICING, "eager")
    require(SPLICING, "vllm")  # the worker splices (tests/test_vllm_splice.py)

    from ie_lab.session.operations import _Operations

    class Remote:  # what a remote Session's backend offers: no splice (its server may well be eager)
        name = "remote"

        def require(self, capability):
            require(capability, "eager")

    class Door(_Operations):
        _backend = Remote()

    with pytest.raises(CapabilityUnsupported, match="on a remote Session.*backend='eager'"):
        Door()._splicing()


def test_a_remote_server_refuses_splice_by_name():
    """splice= does not cross to a server: its record field has no wire check, so a request carrying it is refused."""
    from ie_lab.remote.ops import OPS, ArgError

    for op in ("capture", "generate", "generate_stream"):
        with pytest.raises(ArgError, match="unknown argument 'splice'"):
            OPS[op].bind([TEXT, ["resid_post.0"]] if op == "capture" else [TEXT], {"splice": {"sae": "x"}})
