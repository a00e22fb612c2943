"""The feature panel on a vLLM session (issue 17 item 5): its scores are the worker's project() scores, through the
Session's public API only; a refused argument leaves the session serving as before."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.widgets import FeaturePanel  # noqa: E402
from tests.vllm_helpers import close, vllm_session  # noqa: E402

TEXT = "When Mary and John went to the store"


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    session = vllm_session("llama", tmp_path_factory.mktemp("features_vllm"))
    yield session
    session.close()


def test_feature_panel_of_a_vllm_session_shows_the_workers_scores(s):
    d = s.facts.d_model
    g = torch.Generator().manual_seed(2)
    enc = {"W_enc": torch.randn(d, 32, generator=g) / d**0.5, "b_enc": torch.randn(32, generator=g) * 0.1}
    with pytest.raises(ie_lab.InputError, match="top=65"):
        s.feature_panel(TEXT, "resid_post.1", enc, top=65)
    fp = s.feature_panel(TEXT, "resid_post.1", enc, activation="relu", top=8)
    ref = s.project(TEXT, "resid_post.1", enc, activation="relu").scores.float()
    assert isinstance(fp, FeaturePanel) and fp.n_features == 32 and len(fp.tokens) == ref.shape[0]
    for f in (fp.feature, 31):
        fp._on_front_end_msg(fp, {"cmd": "select", "feature": f}, [])
        assert fp.feature == f and close(fp.feature_values(), ref[:, f], atol=1e-5)
        assert not close(fp.feature_values(), ref[:, f - 1], atol=1e-4)
