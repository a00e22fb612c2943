"""ie_lab.load_transcoders: SAELens' per-layer transcoder folders (ReLU, JumpReLU, TopK), one or a parent of them,
attached to mlp_in.L -> mlp_out.L and checked like SAEs; the reconstruction error per layer (the demo transcoders
fit their own layer and not another's); what is refused, with the reason."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import ie_lab
from ie_lab import Address
from tests.conftest import lm_for
from tests.transcoder_files import write_transcoders


@pytest.fixture(scope="module")
def lm():
    return lm_for("llama")


@pytest.mark.parametrize(
    "arch,act", [("transcoder", "relu"), ("jumprelu_transcoder", "jumprelu"), ("topk_transcoder", "topk")]
)
def test_each_architecture_loads_onto_the_mlp_points(lm, tmp_path, arch, act):
    d = lm.facts.d_model
    root = write_transcoders(str(tmp_path), d, [0, 1], arch=arch)
    tcs = ie_lab.load_transcoders(root, lm)
    assert tcs.layers == [0, 1] and len(tcs) == 2
    t = tcs[1]
    assert (t.activation, t.address_in, t.address_out) == (act, Address.parse("mlp_in.1"), Address.parse("mlp_out.1"))
    one = ie_lab.load_transcoders(os.path.join(root, "layer_0"), lm)  # one layer's folder alone
    assert one.layers == [0]
    # the encoding is SAELens': x @ W_enc + b_enc (b_dec never subtracted), then the activation
    w = load_file(os.path.join(root, "layer_1", "sae_weights.safetensors"))
    x = torch.randn(5, d)
    pre = x @ w["W_enc"] + w["b_enc"]
    want = {
        "relu": torch.relu(pre),
        "jumprelu": pre * (pre > 0.3),
        "topk": torch.zeros_like(pre).scatter(-1, pre.topk(4).indices, torch.relu(pre.topk(4).values)),
    }[act]
    assert torch.allclose(t.encode(x), want, atol=1e-6)
    assert torch.allclose(t.decode(want), want @ w["W_dec"] + w["b_dec"], atol=1e-5)
    with pytest.raises(ie_lab.InputError, match="no transcoder at layer 5"):
        tcs[5]


def _edit_cfg(folder, **changes):
    path = os.path.join(folder, "cfg.json")
    cfg = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architecture": "clt"}, "cross-layer transcoder"),
        ({"architecture": "jumprelu_clt", "n_layers": 2}, "cross-layer transcoder"),  # SAELens' JumpReLUCLTConfig
        ({"architecture": "skip_transcoder"}, "skip transcoder"),
        ({"architecture": "gated"}, "transcoder architectures"),
        ({"hook_name_out": None}, "no 'hook_name_out'"),
        ({"hook_name_out": "blocks.1.hook_mlp_out"}, "two layers"),
        ({"hook_name": "blocks.0.nonsense"}, "names no ie_lab point"),
        ({"d_out": 64}, "d_out is 64"),
        ({"d_sae": 7}, "'d_sae'"),
    ],
)
def test_bad_folders_are_refused_with_the_reason(lm, tmp_path, change, match):
    root = write_transcoders(str(tmp_path), lm.facts.d_model, [0])
    _edit_cfg(os.path.join(root, "layer_0"), **change)
    with pytest.raises((ie_lab.InputError, ie_lab.AddressError), match=match):
        ie_lab.load_transcoders(root, lm)


def test_bad_weights_and_layouts_are_refused(lm, tmp_path):
    d = lm.facts.d_model
    root = write_transcoders(str(tmp_path / "a"), d, [0])
    f = os.path.join(root, "layer_0", "sae_weights.safetensors")
    w = load_file(f)
    save_file({**w, "W_skip": torch.zeros(d, d)}, f)
    with pytest.raises(ie_lab.InputError, match="W_skip"):
        ie_lab.load_transcoders(root, lm)
    save_file({k: v for k, v in w.items() if k != "threshold"}, f)
    with pytest.raises(ie_lab.InputError, match="threshold"):
        ie_lab.load_transcoders(root, lm)
    save_file({**w, "W_dec": w["W_dec"].T.contiguous()}, f)
    with pytest.raises(ie_lab.InputError, match="transposed"):
        ie_lab.load_transcoders(root, lm)
    twice = str(tmp_path / "b")
    write_transcoders(twice, d, [0])
    os.rename(os.path.join(twice, "layer_0"), os.path.join(twice, "x"))
    write_transcoders(twice, d, [0])
    with pytest.raises(ie_lab.InputError, match="both replace layer 0"):
        ie_lab.load_transcoders(twice, lm)
    os.makedirs(tmp_path / "ct")
    save_file({"W_enc": torch.zeros(d, 4)}, str(tmp_path / "ct" / "W_enc_0.safetensors"))
    with pytest.raises(
        ie_lab.InputError, match="one decoder file per layer"
    ):  # circuit-tracer's CLT layout, half of it
        ie_lab.load_transcoders(str(tmp_path / "ct"), lm)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ie_lab.InputError, match="no cfg.json"):
        ie_lab.load_transcoders(str(tmp_path / "empty"), lm)
    with pytest.raises(ie_lab.InputError, match="needs the model"):
        ie_lab.load_transcoders(root, None)


def test_the_demo_transcoders_fit_their_own_layer_and_not_another():
    s = ie_lab.Session(ie_lab.DEMO_MODEL)
    try:
        tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
        prompts = ["Once upon a time there was a little cat .", "Mary and John went to the park . John gave a ball to"]
        errs = tcs.reconstruction_errors(s, prompts)
        assert set(errs) == {0, 1, 2, 3} and max(errs.values()) < 0.3
        report = tcs.check(s, prompts)
        assert report.count("fits") == 4
        # layer 1's transcoder on layer 2's MLP: the error says so
        moved = ie_lab.Transcoders(
            [dataclasses.replace(tcs[1], address_in=Address.parse("mlp_in.2"), address_out=Address.parse("mlp_out.2"))]
        )
        assert moved.reconstruction_errors(s, prompts)[2] > 0.8
        assert "does not fit" in moved.check(s, prompts)
    finally:
        s.close()
