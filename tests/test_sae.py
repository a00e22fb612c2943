"""SAEs as users have them (issue 17 item 4): random SAEs written in SAELens' on-disk layout (cfg.json and
sae_weights.safetensors) and as plain safetensors dicts, loaded with load_sae, attached through the mappers to the
point their hook name means on this model, and checked against the arithmetic written out by hand on a capture
(exact at fp32). A neighbouring point gives other numbers, so attaching to the wrong point fails these tests."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import ie_lab
from ie_lab.errors import AddressError, InputError
from ie_lab.sae import load_sae
from tests.families import make_model, make_tokenizer

TEXT = "the cat sat on the mat and then it ran away"


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(make_model("llama"), tokenizer=make_tokenizer(), progress=False, replace=False)
    yield sess
    sess.close()


def _weights(d: int, n: int, seed: int = 0, threshold: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "W_dec": torch.randn(n, d, generator=g) / n**0.5,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }
    if threshold:
        w["threshold"] = torch.rand(n, generator=g) * 0.2
    return w


def _saelens(folder, weights: dict, **cfg) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def _x(s, addr: str) -> torch.Tensor:
    return s.capture(TEXT, [addr])[addr][0].float()


def test_a_saelens_folder_attaches_to_its_point_and_encodes_like_saelens_arithmetic(s, tmp_path):
    d = s.facts.d_model
    w = _weights(d, 48)
    path = _saelens(
        tmp_path / "relu",
        w,
        architecture="standard",
        hook_name="blocks.1.hook_resid_post",
        d_in=d,
        d_sae=48,
        apply_b_dec_to_input=True,
        normalize_activations="none",
    )
    sae = load_sae(path, s)
    assert str(sae.address) == "resid_post.1" and sae.activation == "relu"
    p = sae.project(s, TEXT)
    x = _x(s, "resid_post.1")
    want = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    assert torch.allclose(p.scores, want, atol=1e-5)
    assert torch.allclose(sae.encode(x), want, atol=1e-5)
    wrong = torch.relu((_x(s, "resid_post.0") - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    assert not torch.allclose(p.scores, wrong, atol=1e-3)
    top = p.top(3)  # top features per token
    assert len(top) == x.shape[0] and top[0][0][1] == float(want[0].max())
    assert torch.allclose(sae.decode(want), want @ w["W_dec"] + w["b_dec"])


def test_jumprelu_and_topk_in_the_newer_layout(s, tmp_path):
    d = s.facts.d_model
    w = _weights(d, 32, seed=1, threshold=True)
    jr = load_sae(
        _saelens(tmp_path / "jr", w, architecture="jumprelu", metadata={"hook_name": "blocks.0.hook_mlp_out"}), s
    )
    assert str(jr.address) == "mlp_out.0" and jr.activation == "jumprelu"
    z = (_x(s, "mlp_out.0") - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    assert torch.allclose(
        jr.project(s, TEXT).scores, torch.where(z > w["threshold"], z, torch.zeros_like(z)), atol=1e-5
    )
    tk = load_sae(
        _saelens(
            tmp_path / "tk",
            {k: v for k, v in w.items() if k != "threshold"},
            architecture="topk",
            k=4,
            apply_b_dec_to_input=False,
            hook_name="blocks.1.hook_resid_pre",
        ),
        s,
    )
    z = _x(s, "resid_pre.1") @ w["W_enc"] + w["b_enc"]  # b_dec not applied to the input
    vals, idx = z.topk(4, dim=-1)
    want = torch.zeros_like(z).scatter(-1, idx, torch.relu(vals))
    assert torch.allclose(tk.project(s, TEXT).scores, want, atol=1e-5)


def test_a_plain_safetensors_dict_needs_its_address(s, tmp_path):
    d = s.facts.d_model
    w = _weights(d, 16, seed=2)
    save_file(w, str(tmp_path / "enc.safetensors"))
    with pytest.raises(AddressError, match="address="):
        load_sae(tmp_path / "enc.safetensors", s)
    sae = load_sae(tmp_path / "enc.safetensors", s, address="attn_out.1")
    want = torch.relu((_x(s, "attn_out.1") - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    assert torch.allclose(sae.project(s, TEXT).scores, want, atol=1e-5)


def test_the_gemma2_mlp_out_trap_is_resolved_through_the_mapper(tmp_path):
    """TransformerLens' hook_mlp_out on Gemma 2 is the MLP output after its post-norm: ie_lab's mlp_out_post."""
    g = ie_lab.Session(
        make_model("gemma2", attn_implementation="eager"), tokenizer=make_tokenizer(), progress=False, replace=False
    )
    try:
        d = g.facts.d_model
        w = _weights(d, 16, seed=3)
        sae = load_sae(_saelens(tmp_path / "g2", w, hook_name="blocks.0.hook_mlp_out"), g)
        assert str(sae.address) == "mlp_out_post.0"
        want = torch.relu((_x(g, "mlp_out_post.0") - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
        assert torch.allclose(sae.project(g, TEXT).scores, want, atol=1e-5)
        assert not torch.allclose(want, torch.relu((_x(g, "mlp_out.0") - w["b_dec"]) @ w["W_enc"] + w["b_enc"]))
    finally:
        g.close()


def test_reconstruction_error_tells_a_fitting_point_from_a_wrong_one(s, tmp_path):
    d = s.facts.d_model
    eye = torch.eye(d)
    # relu(x) - relu(-x) = x: this SAE reconstructs resid_post.1 exactly, up to its b_dec
    exact = {"W_enc": torch.cat([eye, -eye], 1), "b_enc": torch.zeros(2 * d)}
    exact |= {"W_dec": torch.cat([eye, -eye], 0), "b_dec": torch.zeros(d)}
    good = load_sae(_saelens(tmp_path / "ok", exact, hook_name="blocks.1.hook_resid_post"), s)
    assert good.reconstruction_error(s, [TEXT, "Mary went to the store"]) < 1e-6
    assert "the point fits" in good.check(s, TEXT)
    bad = load_sae(_saelens(tmp_path / "bad", _weights(d, 8, seed=4), hook_name="blocks.1.hook_resid_post"), s)
    assert "most likely attached to the wrong point" in bad.check(s, TEXT)


def test_feature_steering_adds_the_decoder_direction(s, tmp_path):
    d = s.facts.d_model
    w = _weights(d, 16, seed=5)
    sae = load_sae(_saelens(tmp_path / "st", w, hook_name="blocks.0.hook_resid_post"), s)
    got = s.generate(TEXT, 6, steer=sae.steer(s, 7, scale=8.0))
    want = s.generate(TEXT, 6, steer=s.steer("resid_post.0", w["W_dec"][7], scale=8.0))
    assert got.ids == want.ids and got.ids != s.generate(TEXT, 6).ids
    with pytest.raises(InputError, match="feature"):
        sae.steer(s, 16)


@pytest.mark.parametrize(
    "cfg,weights_change,match",
    [
        ({"architecture": "gated"}, {}, "gated"),
        ({"normalize_activations": "expected_average_only_in"}, {}, "normalize_activations"),
        ({"architecture": "topk"}, {}, "needs its k"),
        ({"architecture": "jumprelu"}, {}, "threshold"),
        ({}, {"W_enc": torch.randn(7, 16), "W_dec": torch.randn(16, 7), "b_dec": torch.randn(7)}, "7-wide"),
        ({}, {"r_mag": torch.randn(16)}, "unknown weight"),
        ({"hook_name": "blocks.9.hook_resid_post"}, {}, "layer"),
    ],
)
def test_what_cannot_be_loaded_faithfully_is_refused(s, tmp_path, cfg, weights_change, match):
    d = s.facts.d_model
    w = _weights(d, 16, seed=6) | weights_change
    with pytest.raises((InputError, AddressError), match=match):
        load_sae(_saelens(tmp_path / "x", w, **({"hook_name": "blocks.0.hook_resid_post"} | cfg)), s)
