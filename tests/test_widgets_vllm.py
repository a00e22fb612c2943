"""The three panels on a vLLM session: they use only the Session's public API, so they work on either backend."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import ie_lab  # noqa: E402
from ie_lab.widgets import AttentionViewer, Picker, SteeringPanel  # noqa: E402
from tests.vllm_helpers import vllm_session  # noqa: E402


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    session = vllm_session("llama", tmp_path_factory.mktemp("widgets_vllm"))
    yield session
    session.close()


def test_picker_and_cheatsheet_of_a_vllm_session(s):
    # vLLM binds the model in its worker: the diagram comes from the config, with the vLLM backend's verdicts
    for p in (s.picker(layer=0), ie_lab.cheatsheet(s, layer=0)):
        assert (
            isinstance(p, Picker)
            and p.spec["backend"] == "vllm"
            and p.spec["handle"] == {"var": "s", "kind": "session"}
        )
        pts = {q["name"]: q for q in p.spec["points"]}
        assert pts["resid_post"]["served"] == "1" * s.facts.n_layers
        assert p.select("resid_post.0") == ie_lab.Address("resid_post", 0)


def test_attention_viewer_of_a_vllm_session(s):
    a = s.show_attention("Mary went to the park", layers=[0])
    assert isinstance(a, AttentionViewer) and a.n_heads == s.facts.n_heads
    pattern = a.head_pattern()
    assert ((pattern.sum(-1) - 1).abs() < 1e-3).all()


def test_steering_panel_streams_on_the_vllm_session_loop(s):
    sp = s.steering_panel("Mary went to the", positive=["happy good day"], negative=["sad bad night"], max_new_tokens=3)
    assert isinstance(sp, SteeringPanel) and len(sp.baseline) == 3
    sp.update(scale=0.0)  # submitted to the session's loop (Session.submit), then awaited
    assert sp.status == "ready" and not sp.error and sp.steered_ids == sp.baseline_ids
