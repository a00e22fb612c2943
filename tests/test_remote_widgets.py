"""The attention viewer and the steering panel on a remote Session (issue 18): the same panels, driven kernel-side
by the same front-end messages as tests/test_widgets_unit.py, draw what the same panel on a local Session of the
same model draws; every model-side call they make goes to the server (its operation counter moves, and the calls
the remote backend issued are the ones named here).

One `ie-lab serve demo` subprocess on loopback (tests/test_remote.py's Server), one local eager Session.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("anywidget")

import ie_lab  # noqa: E402
from ie_lab.widgets import AttentionViewer, SteeringPanel  # noqa: E402
from tests.remote_fixtures import local_fixture, remote_fixture, server_fixture, token_fixture  # noqa: E402, F401 (pytest fixtures: local, remote, server, token)
from tests.test_remote import stats  # noqa: E402

PROMPT = "When Mary and John went to the store"


@pytest.fixture
def issued(remote, monkeypatch):
    """The operations the remote backend sends, by name, in order (each call still goes to the server)."""
    names: list[str] = []
    b = remote._backend
    post, astream = b._post, b.astream

    def recorded_post(name, body):
        names.append(name)
        return post(name, body)

    def recorded_astream(*args, **kwargs):
        names.append("generate_stream")
        return astream(*args, **kwargs)

    monkeypatch.setattr(b, "_post", recorded_post)
    monkeypatch.setattr(b, "astream", recorded_astream)
    return names


def _outbox(w, monkeypatch):
    sent: list = []
    monkeypatch.setattr(w, "send", lambda content, buffers=None: sent.append(content))
    return sent


def test_the_attention_viewer_on_a_remote_session_draws_what_the_local_one_does(remote, local, server, token, issued):
    before = stats(server, token)["operations"]
    a, b = remote.show_attention(PROMPT, layers=[0, 2]), local.show_attention(PROMPT, layers=[0, 2])
    assert isinstance(a, AttentionViewer)
    assert (a.tokens, a.layers, a.n_heads, a.layer, a.head) == (b.tokens, b.layers, b.n_heads, b.layer, b.head)
    assert repr(a) == repr(b)
    for msg in ({"cmd": "select", "layer": 2, "head": 3}, {"cmd": "select", "layer": 0, "head": 1}):
        a._on_front_end_msg(a, msg, [])
        b._on_front_end_msg(b, msg, [])
        assert (a.layer, a.head) == (b.layer, b.head) == (msg["layer"], msg["head"])
        torch.testing.assert_close(a.head_pattern(), b.head_pattern(), atol=1e-6, rtol=0)
        assert np.array_equal(np.frombuffer(a.thumbs, np.uint8), np.frombuffer(b.thumbs, np.uint8))
        np.testing.assert_allclose(
            np.frombuffer(a.pattern, np.float32), np.frombuffer(b.pattern, np.float32), atol=1e-6
        )
    # the neighbouring head is told apart
    assert not torch.allclose(a.head_pattern(), local.capture(PROMPT, "attn_probs.0")["attn_probs.0"][0, 2], atol=1e-3)
    # its probabilities came from the server: one capture per layer shown
    assert issued and set(issued) == {"capture"}
    assert stats(server, token)["operations"] >= before + len(issued)
    with pytest.raises(ie_lab.InputError) as there:
        remote.show_attention("Mary", layers=[7])
    with pytest.raises(ie_lab.InputError) as here:
        local.show_attention("Mary", layers=[7])
    assert str(there.value) == str(here.value)


CONTRAST = {"positive": ["happy good day", "good morning", "a lovely time"], "negative": ["sad bad night", "awful"]}


def test_the_steering_panel_on_a_remote_session_steers_as_the_local_one_does(
    remote, local, server, token, issued, monkeypatch
):
    v = torch.randn(local.facts.d_model, generator=torch.Generator().manual_seed(11))
    before = stats(server, token)["operations"]
    r = remote.steering_panel("Mary went to the", vector=v, max_new_tokens=8)
    r.wait()
    lp = local.steering_panel("Mary went to the", vector=v, max_new_tokens=8)
    lp.wait()
    assert isinstance(r, SteeringPanel)
    assert r.baseline_ids == lp.baseline_ids and r.steered_ids == lp.steered_ids
    out_r, out_l = _outbox(r, monkeypatch), _outbox(lp, monkeypatch)
    for msg in (
        {"cmd": "steer", "seq": 1, "method": "add", "scale": 6.0},
        {"cmd": "address", "seq": 2, "address": "resid_post.2"},
        {"cmd": "contrast", "seq": 3, **CONTRAST},
        {"cmd": "steer", "seq": 4, "scale": 30.0},
        {"cmd": "prompt", "seq": 5, "prompt": "The cat sat on the"},
    ):
        r._on_front_end_msg(r, msg, [])
        r.wait()
        lp._on_front_end_msg(lp, msg, [])
        lp.wait()
        assert (r.seq, r.status, r.error) == (lp.seq, lp.status, lp.error) == (msg["seq"], "ready", ""), msg
        assert r.baseline_ids == lp.baseline_ids and r.steered_ids == lp.steered_ids, msg
        torch.testing.assert_close(r.vector, lp.vector, atol=1e-5, rtol=0)
    assert r.vector_source == lp.vector_source and r.address == lp.address == "resid_post.2"
    assert r.steered_ids != r.baseline_ids  # the steering did something

    # what the front end saw: the same tokens of each continuation, in order (the baseline and the steered stream
    # run together, so how their messages interleave is the scheduler's), and the same jobs started and finished
    def seen(out: list) -> tuple:
        tokens: dict = {}
        for m in out:
            if m["type"] == "token":
                tokens.setdefault((m["seq"], m["which"]), []).append(m["token"])
        return tokens, sorted((m["type"], m["seq"]) for m in out if m["type"] in ("start", "done"))

    assert seen(out_r) == seen(out_l)
    # the panel's result is the plain call's, on the server
    spec = remote.steer("resid_post.2", r.vector, scale=30.0)
    assert r.steered_ids == remote.generate("The cat sat on the", 8, steer=spec).ids
    assert {"generate_stream", "capture"} <= set(issued)
    assert stats(server, token)["operations"] >= before + len(issued)


def test_a_remote_panel_cancels_its_generation_when_a_newer_value_arrives(remote, server, token, monkeypatch):
    v = torch.randn(remote.facts.d_model, generator=torch.Generator().manual_seed(2))
    sp = remote.steering_panel("Mary went to the", vector=v, max_new_tokens=100)
    sp.wait()
    out = _outbox(sp, monkeypatch)
    for i, scale in enumerate([1.0, 2.0, 3.0], start=1):
        sp._on_front_end_msg(sp, {"cmd": "steer", "seq": i, "scale": scale}, [])
    sp.wait()
    assert sp.seq == 3 and sp.scale == 3.0
    assert [m["seq"] for m in out if m["type"] == "done"] == [3]
    assert (
        sp.steered_ids
        == remote.generate("Mary went to the", 100, steer=remote.steer(sp.address, sp.vector, scale=3.0)).ids
    )
    for _ in range(100):  # the cancelled streams were freed on the server
        if stats(server, token)["running"] == 0:
            break
        time.sleep(0.1)
    assert stats(server, token)["running"] == 0
