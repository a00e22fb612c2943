"""The remote wire's compression and protocol versions (issue 18).

Compression pays only for large frames that shrink: a frame is sent zlib-compressed when it is at least
COMPRESS_MIN bytes, the receiver said it reads compressed frames, and it shrinks to COMPRESS_KEEP or less; results
are the same either way. A compressed request that would inflate past the server's max_request_bytes is refused
before it is inflated. A client and a server of different protocol versions refuse each other with both versions
and the fix named. Closing a session (or a script ending with one open) closes its HTTP client, with no warning.
"""

from __future__ import annotations

import gc
import os
import re
import struct
import subprocess
import sys
import warnings
import zlib

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

import ie_lab  # noqa: E402
import ie_lab.remote.client as client_module  # noqa: E402
from ie_lab.errors import InputError, RequestFailed  # noqa: E402
from ie_lab.remote.wire import (  # noqa: E402
    COMPRESS_HEADER,
    COMPRESS_MIN,
    CONTENT_TYPE,
    MAGIC,
    PROTOCOL,
    PROTOCOL_HEADER,
    VERSION_HEADER,
    ZMAGIC,
    LimitExceeded,
    WireError,
    compress,
    decode,
    decompress,
    encode,
)
from tests.remote_fixtures import local_fixture, server_fixture, token_fixture  # noqa: E402, F401 (pytest fixtures: local, server, token)
from tests.test_remote import REQUEST_LIMIT, stats  # noqa: E402

# ---- the frames alone --------------------------------------------------------------------------------------


def test_large_frames_that_shrink_are_compressed_and_others_are_not():
    ids = torch.arange(200_000, dtype=torch.long) % 50  # token ids: mostly zero bytes
    big = encode({"x": ids})
    packed = compress(big)
    assert packed[:4] == ZMAGIC and len(packed) < len(big) // 4
    assert torch.equal(decode(packed, results=True)["x"], ids)
    small = encode({"x": torch.zeros(100)})
    assert len(small) < COMPRESS_MIN and compress(small) == small  # too small to pay
    noise = encode({"x": torch.randn(100_000, generator=torch.Generator().manual_seed(0))})
    assert compress(noise) == noise  # random float32 hardly shrinks: sent as it is
    assert decode(noise, results=True)["x"].shape == (100_000,)


def test_a_compressed_frame_is_bounded_and_checked_before_it_is_trusted():
    bomb = ZMAGIC + struct.pack(">Q", 10**12) + zlib.compress(b"\0" * 1000)
    with pytest.raises(LimitExceeded, match="max_request_bytes=1000000"):
        decompress(bomb, 1_000_000)
    inner = encode({"x": torch.zeros(50_000)})
    lying = ZMAGIC + struct.pack(">Q", 100) + zlib.compress(inner)  # states fewer bytes than it holds
    with pytest.raises(WireError, match="not the 100 bytes"):
        decompress(lying, 1_000_000)
    with pytest.raises(WireError, match="not a zlib stream"):
        decompress(ZMAGIC + struct.pack(">Q", 10) + b"not zlib at all", 1_000_000)
    with pytest.raises(WireError, match="without its length"):
        decompress(ZMAGIC + b"\0", 1_000_000)


# ---- on a server -------------------------------------------------------------------------------------------


def _post(server, token, op, body, **headers):
    h = {"content-type": CONTENT_TYPE, "authorization": f"Bearer {token}", **headers}
    return httpx.post(f"{server.url}/v1/op/{op}", content=body, headers=h, timeout=120)


PROBS = [f"attn_probs.{L}" for L in range(4)]  # causal patterns: half zeros, so they shrink
PROMPT = list(range(5, 105))


def test_compressed_answers_are_smaller_and_equal(server, token, local):
    body = encode({"args": [PROMPT, PROBS], "kwargs": {}})
    plain = _post(server, token, "capture", body)
    zipped = _post(server, token, "capture", body, **{COMPRESS_HEADER: "zlib"})
    assert plain.status_code == zipped.status_code == 200
    assert plain.content[:4] == MAGIC and zipped.content[:4] == ZMAGIC
    assert len(zipped.content) < 0.8 * len(plain.content)
    a, b = decode(plain.content, results=True)["result"], decode(zipped.content, results=True)["result"]
    for p in PROBS:
        assert torch.equal(a[p], b[p])
    small = _post(server, token, "describe", encode({"args": [], "kwargs": {}}), **{COMPRESS_HEADER: "zlib"})
    assert small.content[:4] == MAGIC  # a small answer travels as it is
    assert plain.headers[PROTOCOL_HEADER] == str(PROTOCOL) and plain.headers[VERSION_HEADER]

    # the client, compressing both ways: the same results as the local session, a stream's frames included
    s = ie_lab.connect(server.url, token=token, replace=False, compress=True)
    try:
        assert s._backend._send_compressed and s._backend.compress
        got, want = s.capture(PROMPT, PROBS), local.capture(PROMPT, PROBS)
        for p in PROBS:
            torch.testing.assert_close(got[p], want[p], atol=1e-6, rtol=0)
        directions = torch.zeros(256, local.facts.d_model)  # a large request body that shrinks
        directions[0] = 1.0
        torch.testing.assert_close(
            s.project("The cat sat", "resid_post.1", directions).scores,
            local.project("The cat sat", "resid_post.1", directions).scores,
            atol=1e-5,
            rtol=0,
        )
        kw = dict(capture=["attn_probs.1"], n_logprobs=2)
        steps, local_steps = list(s.generate_stream(PROMPT, 4, **kw)), list(local.generate_stream(PROMPT, 4, **kw))
        assert [x.token_id for x in steps] == [x.token_id for x in local_steps]
        torch.testing.assert_close(steps[-1].cache["attn_probs.1"], local_steps[-1].cache["attn_probs.1"])
    finally:
        s.close()
    # on loopback the default is not to compress (the bytes cost less than compressing them)
    s = ie_lab.connect(server.url, token=token, replace=False)
    try:
        assert not s._backend.compress and not s._backend._send_compressed
    finally:
        s.close()
    with pytest.raises(InputError, match="compress must be"):
        ie_lab.connect(server.url, token=token, replace=False, compress="zstd")


def test_a_compressed_request_is_bounded_by_max_request_bytes(server, token, local):
    before = stats(server, token)
    inner = encode({"args": ["x", "resid_post.0", torch.zeros(REQUEST_LIMIT // 4 + 1000, 1)], "kwargs": {}})
    body = compress(inner)
    assert body[:4] == ZMAGIC and len(body) < REQUEST_LIMIT // 50  # small on the wire, over the limit inflated
    r = _post(server, token, "project", body)
    assert r.status_code == 413, r.text
    assert "max_request_bytes" in r.json()["error"]["message"] and "decompressed" in r.json()["error"]["message"]
    r = _post(server, token, "capture", ZMAGIC + struct.pack(">Q", 50) + b"junk")
    assert r.status_code == 400 and r.json()["error"]["class"] == "InputError"
    after = stats(server, token)
    assert after["operations"] == before["operations"]  # nothing ran
    r = _post(server, token, "capture", compress(encode({"args": [PROMPT, PROBS[:1]], "kwargs": {}})))
    assert r.status_code == 200  # a compressed request within the limit is served


def test_a_protocol_mismatch_names_both_versions_and_the_fix(server, token, monkeypatch):
    r = _post(
        server,
        token,
        "capture",
        encode({"args": ["x", "resid_post.0"], "kwargs": {}}),
        **{PROTOCOL_HEADER: "999", VERSION_HEADER: "9.9.9"},
    )
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "protocol 999 (ie_lab 9.9.9)" in msg and f"protocol {PROTOCOL} (ie_lab " in msg and "pip install" in msg
    assert r.json()["error"]["class"] == "RequestFailed"
    # a client of another protocol: refused by the server at connect, the text naming both
    monkeypatch.setattr(client_module, "PROTOCOL", PROTOCOL + 1)
    with pytest.raises(RequestFailed) as e:
        ie_lab.connect(server.url, token=token, replace=False)
    text = str(e.value)
    assert f"protocol {PROTOCOL + 1}" in text and f"protocol {PROTOCOL} " in text and "Instead: pip install" in text
    # a server that states no protocol (one from before versions): refused by the client, naming what it saw
    monkeypatch.setattr(client_module, "PROTOCOL", PROTOCOL)
    monkeypatch.setattr(client_module, "PROTOCOL_HEADER", "x-ie-lab-unstated")
    with pytest.raises(RequestFailed, match="no protocol version") as e:
        ie_lab.connect(server.url, token=token, replace=False)
    assert f"speaks protocol {PROTOCOL}" in str(e.value) and server.url in str(e.value)
    # a raw client that states nothing (curl) is read as this version
    assert _post(server, token, "capture", encode({"args": ["x", "resid_post.0"], "kwargs": {}})).status_code == 200


def test_model_facts_survive_the_wire_with_every_tuple_field():
    """JSON turns tuples into lists; every tuple field of ArchFacts must come back a tuple (a hybrid's
    mixer_kinds did not), or the client's facts differ from the server's."""
    import dataclasses
    import json

    from ie_lab.arch.config_facts import ArchFacts
    from ie_lab.remote.wire import facts_dict, facts_from

    tuple_fields = [f.name for f in dataclasses.fields(ArchFacts) if str(f.type).startswith("tuple")]
    assert {"layer_kinds", "moe_layers", "mixer_kinds"} <= set(tuple_fields)
    from ie_lab.core.demo import DEMO_MODEL

    facts = ie_lab.load(DEMO_MODEL).facts
    n = facts.n_layers
    hybrid = dataclasses.replace(facts, mixer_kinds=("linear_attention",) + ("",) * (n - 1))
    back = facts_from(json.loads(json.dumps(facts_dict(hybrid))))
    assert back == hybrid
    assert all(isinstance(getattr(back, k), tuple) for k in tuple_fields if getattr(hybrid, k) is not None)


# ---- closing ------------------------------------------------------------------------------------------------


def test_closing_a_remote_session_closes_its_http_client_without_a_warning(server, token):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s = ie_lab.connect(server.url, token=token, replace=False, progress=False)
        http = s._backend._http  # the client the session's requests went through
        assert s.generate("The cat", max_new_tokens=2).text
        s.close()
        del s
        gc.collect()
    assert http.is_closed
    assert not [w for w in seen if issubclass(w.category, ResourceWarning) or "nclosed" in str(w.message)], [
        str(w.message) for w in seen
    ]


EXIT_SCRIPT = """
import atexit, sys
# Registered before ie_lab is imported, so it runs after ie_lab's own exit hooks: what a script leaves behind.
atexit.register(lambda: print("client closed at exit:", held[0]._backend._http is None and clients[0].is_closed))
import ie_lab
held, clients = [], []
s = ie_lab.connect(sys.argv[1], token=sys.argv[2], replace=False, progress=False)
clients.append(s._backend._http)
s.generate("The cat", max_new_tokens=2)
held.append(s)
closed = ie_lab.connect(sys.argv[1], token=sys.argv[2], replace=False, progress=False)
closed.close()
print("end of script")
"""


def test_a_script_that_ends_with_remote_sessions_open_or_closed_exits_cleanly(server, token):
    """The session left open is closed while the interpreter can still close it (its client's connections shut,
    no "unclosed" warning), and neither session's finalizer prints a traceback at exit (a Session's __del__ ran
    after module globals were torn down: "Exception ignored in ... Session.__del__", for every script)."""
    r = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", EXIT_SCRIPT, server.url, token],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONASYNCIODEBUG": "0"},  # -X dev's asyncio debug logs slow callbacks: noise here
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-2:] == ["end of script", "client closed at exit: True"], r.stdout + r.stderr[-3000:]
    noise = [
        ln for ln in r.stderr.splitlines() if re.search(r"Exception ignored|Traceback|ResourceWarning|nclosed", ln)
    ]
    assert not noise, r.stderr[-3000:]


OWN_LOOP_SCRIPT = """
import sys
import ie_lab
s = ie_lab.connect(sys.argv[1], token=sys.argv[2], replace=False, progress=False)
s.generate("The cat", max_new_tokens=2)
client = s._backend._http
s._loop.call_soon_threadsafe(s.close)  # closed on the session's own loop thread (a callback or coroutine there)
s._thread.join(timeout=60)
print("client closed on the loop thread:", client.is_closed, "thread ended:", not s._thread.is_alive())
"""


def test_a_remote_session_closed_on_its_own_loop_thread_closes_its_client(server, token):
    """Closing on the loop thread cannot wait there for the HTTP client's aclose: the loop runs it as it ends
    (backend.close_with_loop), so the connections shut and no "unclosed" warning is printed."""
    r = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", OWN_LOOP_SCRIPT, server.url, token],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONASYNCIODEBUG": "0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "client closed on the loop thread: True thread ended: True", r.stdout
    noise = [
        ln for ln in r.stderr.splitlines() if re.search(r"Exception ignored|Traceback|ResourceWarning|nclosed", ln)
    ]
    assert not noise, r.stderr[-3000:]


def test_prepend_bos_is_applied_before_the_wire(server, token, local):
    """A remote Session turns text into ids by prepend_bos itself: the server runs what a local Session would."""
    with ie_lab.connect(server.url, token=token, replace=False, progress=False, prepend_bos=False) as s:
        assert s.tokens("The cat").tolist() == local.tokens("The cat", prepend_bos=False).tolist()
        got = s.capture("The cat", ["resid_post.1"])["resid_post.1"]
        want = local.capture("The cat", ["resid_post.1"], prepend_bos=False)["resid_post.1"]
        assert got.shape[1] == local.tokens("The cat").shape[1] - 1  # the demo tokenizer's own BOS left off
        assert torch.allclose(got, want, atol=1e-5)
        assert s.generate("The cat", 3, prepend_bos=True).ids == local.generate("The cat", 3).ids
