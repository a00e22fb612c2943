"""The feature panel in plain Python (issue 17 item 5): what it puts on screen is the session's own project() scores
(an SAE loaded from SAELens' on-disk layout, and probe directions), driven by front-end messages as the browser sends
them; a neighbouring feature's scores differ; bad input is refused naming the fix and leaves the model as it was."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ie_lab
from ie_lab.errors import AddressError, InputError
from ie_lab.sae import load_sae
from ie_lab.widgets import FeaturePanel
from ie_lab.widgets.features import MAX_HOVER, MAX_TOP
from tests.conftest import assert_clean

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def s():
    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    sess = ie_lab.Session(m, tokenizer=t, progress=False, replace=False)
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def sae(s, tmp_path_factory):
    d, n = s.facts.d_model, 96
    g = torch.Generator().manual_seed(5)
    w = {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "W_dec": torch.randn(n, d, generator=g) / n**0.5,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }
    folder = tmp_path_factory.mktemp("sae")
    save_file(w, str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": "standard", "hook_name": "blocks.1.hook_resid_post", "d_in": d, "d_sae": n}
    (folder / "cfg.json").write_text(json.dumps(cfg | {"apply_b_dec_to_input": True, "normalize_activations": "none"}))
    return load_sae(str(folder), s)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _select(panel: FeaturePanel, feature) -> None:
    panel._on_front_end_msg(panel, {"cmd": "select", "feature": feature}, [])


def test_the_selected_features_colours_are_the_sessions_projection(s, sae):
    panel = s.feature_panel(TEXT, None, sae, top=8, hover=4)
    ref = sae.project(s, TEXT).scores.float()  # [tokens, 96]
    assert isinstance(panel, FeaturePanel) and panel.n_features == 96 and len(panel.tokens) == ref.shape[0]
    assert panel.address == "resid_post.1" and panel.tokens == s.to_str_tokens(s.tokens(TEXT))[0]
    # the picker: the 8 features with the largest activation over the prompt, the first one shown
    top = np.frombuffer(panel.top_ids, dtype="<i4")
    assert top.tolist() == ref.abs().amax(0).topk(8).indices.tolist() and panel.feature == int(top[0])
    # a click in the picker, then any index typed in the number box
    for f in (int(top[3]), 95, 0):
        _select(panel, f)
        assert panel.feature == f and panel.error == ""
        assert torch.equal(panel.feature_values(), ref[:, f])
        neighbour = ref[:, f + 1 if f < 95 else f - 1]  # same shape, another feature: must not pass
        assert not torch.allclose(panel.feature_values(), neighbour, atol=1e-4)
    # hover: each token's strongest features, as Projection.top says
    ids = np.frombuffer(panel.tok_ids, dtype="<i4").reshape(-1, 4)
    vals = np.frombuffer(panel.tok_vals, dtype="<f4").reshape(-1, 4)
    p = sae.project(s, TEXT)
    assert [[(int(i), float(v)) for i, v in zip(ri, rv)] for ri, rv in zip(ids, vals)] == p.top(4)
    assert repr(panel) == (
        f"FeaturePanel(SAE (relu, 96 features) at resid_post.1: {len(panel.tokens)} tokens, 96 features; "
        "showing feature 0)"
    )
    assert_clean(s._lm)


def test_probe_directions_show_signed_scores(s):
    D = torch.randn(6, s.facts.d_model, generator=torch.Generator().manual_seed(1))
    panel = s.feature_panel(TEXT, "resid_post.0", D, feature=2)
    ref = s.project(TEXT, "resid_post.0", D).scores.float()
    assert panel.feature == 2 and torch.equal(panel.feature_values(), ref[:, 2])
    assert (panel.feature_values() < 0).any()  # probes are signed: the panel colours negatives too
    wrong = s.project(TEXT, "resid_post.1", D).scores.float()[:, 2]  # the same probe one layer on
    assert not torch.allclose(panel.feature_values(), wrong, atol=1e-4)
    assert np.frombuffer(panel.top_ids, dtype="<i4").size == 6  # top= is capped at the number of features


def test_front_end_messages_outside_the_panel_are_refused_and_change_nothing(s, sae):
    panel = s.feature_panel(TEXT, None, sae, feature=7)
    before = panel.values
    for bad in (96, 10**12, -1, "3", 2.5, None, True):
        _select(panel, bad)
        assert panel.feature == 7 and panel.values == before and panel.error
    _select(panel, 96)
    assert "features run from 0 to 95" in panel.error
    panel._on_front_end_msg(panel, {"cmd": "select", "feature": 1, "extra": 1}, [])
    assert "unexpected field" in panel.error
    panel.set_state({"feature": 3})  # the front end never writes state
    assert panel.feature == 7
    _select(panel, 4)
    assert panel.feature == 4 and panel.error == ""  # a valid click clears the message


def test_bad_arguments_are_refused_naming_the_fix_and_the_model_is_as_before(s, sae):
    w0 = _weights(s._lm.hf)
    D = torch.randn(3, s.facts.d_model)
    cases = [
        (dict(features=sae, top=MAX_TOP + 1), InputError, f"from 1 to {MAX_TOP}"),
        (dict(features=sae, top=0), InputError, "s.project(...).top(n)"),
        (dict(features=sae, hover=MAX_HOVER + 1), InputError, f"from 1 to {MAX_HOVER}"),
        (dict(features=sae, feature=96), InputError, "from 0 to 95"),
        (dict(features=sae, feature="3"), InputError, "from 0 to 95"),
        (dict(features=None), InputError, "load_sae"),
        (dict(features=sae, k=4), InputError, "come from the SAE itself"),
        (dict(features=D), InputError, "address="),
        (dict(features=D, address="resid_post.9"), AddressError, "0..1"),
        (dict(features=torch.randn(3, 5), address="resid_post.0"), InputError, "the point's width"),
    ]
    for kwargs, err, words in cases:
        address = kwargs.pop("address", None)
        with pytest.raises(err, match=re.escape(words)):
            s.feature_panel(TEXT, address, **kwargs)
        assert_clean(s._lm)
    w1 = _weights(s._lm.hf)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # and the session still works as before the errors
    panel = s.feature_panel(TEXT, "resid_post.1", sae, top=3)
    assert torch.equal(panel.feature_values(), sae.project(s, TEXT).scores[:, panel.feature].float())


def test_a_prompt_over_the_token_limit_is_refused():
    from ie_lab.widgets.features import MAX_TOKENS

    with pytest.raises(InputError, match="shorter prompt"):
        FeaturePanel(torch.zeros(MAX_TOKENS + 1, 4), ["a"] * (MAX_TOKENS + 1))
