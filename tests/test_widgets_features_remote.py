"""The feature panel on a remote Session (issue 17 item 5 through issue 18's client): the same panel, driven by the
same front-end messages, draws what the panel on a local Session of the same model draws, and its scores come from
the server's project() (the only model-side call it makes). One `ie-lab serve demo` subprocess on loopback
(tests/test_remote.py's Server), one local eager Session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("anywidget")

from ie_lab.widgets import FeaturePanel  # noqa: E402
from tests.remote_fixtures import local_fixture, remote_fixture, server_fixture, token_fixture  # noqa: E402, F401 (pytest fixtures: local, remote, server, token)

PROMPT = "When Mary and John went to the store"


@pytest.fixture(scope="module")
def pair(remote, local):
    return remote, local


def test_the_feature_panel_on_a_remote_session_draws_what_the_local_one_does(pair, monkeypatch):
    remote, local = pair
    names: list[str] = []
    post = remote._backend._post
    monkeypatch.setattr(remote._backend, "_post", lambda name, body: names.append(name) or post(name, body))
    d = local.facts.d_model
    g = torch.Generator().manual_seed(4)
    enc = {"W_enc": torch.randn(d, 48, generator=g) / d**0.5, "b_enc": torch.randn(48, generator=g) * 0.1}
    a = remote.feature_panel(PROMPT, "resid_post.1", enc, activation="relu", top=6)
    b = local.feature_panel(PROMPT, "resid_post.1", enc, activation="relu", top=6)
    assert isinstance(a, FeaturePanel) and names == ["project"]
    assert (a.tokens, a.n_features, a.feature) == (b.tokens, b.n_features, b.feature)
    assert np.array_equal(np.frombuffer(a.top_ids, "<i4"), np.frombuffer(b.top_ids, "<i4"))
    ref = local.project(PROMPT, "resid_post.1", enc, activation="relu").scores
    for f in (int(np.frombuffer(a.top_ids, "<i4")[2]), 47):
        for p in (a, b):
            p._on_front_end_msg(p, {"cmd": "select", "feature": f}, [])
        torch.testing.assert_close(a.feature_values(), ref[:, f], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.feature_values(), b.feature_values(), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a.feature_values(), ref[:, f - 1], atol=1e-4)  # the neighbouring feature
    assert names == ["project"]  # a click reads the scores the panel holds; no further call to the server
