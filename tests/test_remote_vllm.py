"""Concurrent clients of a vLLM-backed `ie-lab serve` (issue 18): four notebooks at once, each with its own
prompt, steering and captures, batched together in the one engine; each gets what it got alone on the same server,
and none sees another's steering. Slow (a vLLM engine on CPU), so small: a tiny llama, four clients.
"""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("vllm")

import ie_lab  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402
from tests.test_remote import Server, _write_tokens, stats  # noqa: E402
from tests.vllm_helpers import PROMPTS, close  # noqa: E402

CLIENTS = 4


def test_four_concurrent_clients_of_a_vllm_server_each_equal_their_solo_run(tmp_path):
    tokens = {f"c{i}": f"c{i}-{secrets.token_urlsafe(24)}" for i in range(CLIENTS)}
    path = tmp_path / "tokens"
    _write_tokens(path, tokens, list(tokens))
    server = Server(path, 0, "--backend", "vllm", model=saved_model_dir("llama", tmp_path))
    clients = [ie_lab.connect(server.url, token=tokens[f"c{i}"], replace=False) for i in range(CLIENTS)]
    try:
        d = clients[0].facts.d_model
        vectors = [torch.randn(d, generator=torch.Generator().manual_seed(40 + i)) * 3 for i in range(CLIENTS)]
        points = [[f"resid_post.{i % 2}", "mlp_out.1"] for i in range(CLIENTS)]

        def work(i: int) -> tuple:
            s = clients[i]
            spec = s.steer(f"resid_post.{i % 2}", vectors[i], scale=2.0 + i)
            if i % 2:  # half of them stream, half generate to the end: both kinds batch in the engine
                steps = list(s.generate_stream(PROMPTS[i], 8, steer=spec, capture=points[i]))
                ids, cache = [x.token_id for x in steps], steps[-1].cache
            else:
                g = s.generate(PROMPTS[i], 8, steer=spec, capture=points[i])
                ids, cache = g.ids, g.cache
            return ids, cache, s.capture(PROMPTS[i], "resid_post.1")["resid_post.1"]

        solo = [work(i) for i in range(CLIENTS)]  # one at a time: each alone in the engine
        results: list = [None] * CLIENTS
        errors: list = []
        barrier = threading.Barrier(CLIENTS)

        def run(i: int) -> None:
            try:
                barrier.wait()
                results[i] = work(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(CLIENTS):
            ids, cache, plain = results[i]
            assert ids == solo[i][0], i
            for a in points[i]:
                assert close(cache[a], solo[i][1][a]), (i, a)
            assert close(plain, solo[i][2]), i  # the unsteered capture: no other client's steering reached it
        # each client's steering did something: its run is not the unsteered one
        for i in range(CLIENTS):
            assert results[i][0] != clients[i].generate(PROMPTS[i], 8).ids, i
        assert stats(server, tokens["c0"])["running"] == 0
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_graph_mode_server_serves_its_declared_points_and_refuses_the_rest(tmp_path):
    """`ie-lab serve --backend vllm --graph-points ...`: the compiled trunk's static taps, through the client, equal
    eager transformers on the same weights; a point not declared is refused as a local graph-mode session refuses
    it."""
    from tests.vllm_helpers import TEXT, eager_for

    token = f"alice-{secrets.token_urlsafe(24)}"
    path = tmp_path / "tokens"
    _write_tokens(path, {"alice": token}, ["alice"])
    server = Server(
        path,
        0,
        "--backend",
        "vllm",
        "--graph-points",
        "resid_post.0,resid_post.1",
        model=saved_model_dir("llama", tmp_path),
    )
    s = ie_lab.connect(server.url, token=token, replace=False)
    try:
        eager = eager_for("llama")
        got = s.capture(TEXT, ["resid_post.0", "resid_post.1"])
        want = ie_lab.capture(eager, TEXT, ["resid_post.0", "resid_post.1"])
        assert close(got["resid_post.0"], want["resid_post.0"]) and close(got["resid_post.1"], want["resid_post.1"])
        assert not close(got["resid_post.0"], want["resid_post.1"])
        with pytest.raises(ie_lab.IELabError, match="graph"):
            s.capture(TEXT, "mlp_out.0")
        assert s.generate(TEXT, 6).ids == ie_lab.generate(eager, TEXT, 6).ids
    finally:
        s.close()
        server.stop()
