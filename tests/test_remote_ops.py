"""Remote patching, sweeps and gradients (issue 18): closed operations whose arguments are data (addresses,
positions, layers, a metric of ie_lab.remote.metrics), each equal to the local Session's result; code (a metric
function, run(fn)) is refused on the client with the fix named, and a hand-made metric payload that is not one
of the served kinds is refused by the server, which goes on serving.

One `ie-lab serve demo` subprocess on loopback (tests/test_remote.py's Server), one local eager Session.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import ie_lab  # noqa: E402
from ie_lab.remote import metrics  # noqa: E402
from ie_lab.remote.wire import MetricPayload, encode  # noqa: E402
from tests.remote_fixtures import local_fixture, remote_fixture, server_fixture, token_fixture  # noqa: E402, F401 (pytest fixtures: local, remote, server, token)
from tests.test_remote import _until_running, _write_tokens, post, stats, wait_until_idle  # noqa: E402

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"  # the same length: 15 tokens
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def names(local):
    mary, john = int(local.tokens(" Mary")[0, -1]), int(local.tokens(" John")[0, -1])
    return mary, john


def test_patch_equals_local_and_a_neighbour_point_does_not(remote, local):
    got = remote.patch(CORRUPTED, CLEAN, "mlp_out.1")
    want = local.patch(CORRUPTED, CLEAN, "mlp_out.1")
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL)
    # (a whole residual point patched at every position is the clean run at any layer; one MLP's output is not)
    assert not torch.allclose(got, local.patch(CORRUPTED, CLEAN, "mlp_out.2"), atol=1e-3)
    # positions, several addresses, and a Cache captured beforehand (on either side) as the source
    kw = dict(positions=[8, 9])
    torch.testing.assert_close(
        remote.patch(CORRUPTED, CLEAN, ["z.2", "resid_pre.1"], **kw),
        local.patch(CORRUPTED, CLEAN, ["z.2", "resid_pre.1"], **kw),
        **TOL,
    )
    cache = remote.capture(CLEAN, ["mlp_out.1", "mlp_out.0", "attn_probs.2"])
    torch.testing.assert_close(remote.patch(CORRUPTED, cache, "mlp_out.1"), want, **TOL)
    torch.testing.assert_close(
        remote.patch(CORRUPTED, local.capture(CLEAN, ["mlp_out.0"]), "mlp_out.0", positions=range(3, 9)),
        local.patch(CORRUPTED, CLEAN, "mlp_out.0", positions=range(3, 9)),
        **TOL,
    )


def test_patch_sweep_equals_local(remote, local, names):
    mary, john = names
    for metric, kw in (
        (ie_lab.logit_diff(mary, john), {}),  # ie_lab's own metric travels as its three integers
        (metrics.logprob(mary), dict(over="layer_head", layers=range(1, 4))),
        (metrics.logit_diff(mary, john, position=-2), dict(point="resid_mid", batch_size=3)),
    ):
        got = remote.patch_sweep(CLEAN, CORRUPTED, metric, **kw)
        want = local.patch_sweep(CLEAN, CORRUPTED, metric, progress=False, **kw)
        assert (got.rows, got.cols, got.metric) == (want.rows, want.cols, want.metric)
        torch.testing.assert_close(got.values, want.values, **TOL)
        assert abs(got.clean - want.clean) < 1e-4 and abs(got.corrupted - want.corrupted) < 1e-4
    # the neighbour: the same sweep of the next point down differs
    neighbour = local.patch_sweep(CLEAN, CORRUPTED, ie_lab.logit_diff(mary, john), point="resid_post", progress=False)
    base = remote.patch_sweep(CLEAN, CORRUPTED, ie_lab.logit_diff(mary, john))
    assert base.values.shape == neighbour.values.shape
    assert not torch.allclose(base.values, neighbour.values, atol=1e-3)
    assert "logit_diff" in repr(base)


def test_gradients_equal_local(remote, local, names):
    mary, john = names
    addrs = ["resid_pre.1", "z.2", "attn_out.3"]
    got = remote.gradients(CLEAN, ie_lab.logit_diff(mary, john), addrs)
    want = local.gradients(CLEAN, ie_lab.logit_diff(mary, john), addrs)
    assert [str(a) for a in got] == [str(a) for a in want] and got.str_tokens == want.str_tokens
    for a in addrs:
        torch.testing.assert_close(got[a], want[a], **TOL)
        assert float(got[a].abs().max()) > 0  # a real gradient, not the zeros of an unused point
    assert not torch.allclose(
        got["resid_pre.1"],
        local.gradients(CLEAN, ie_lab.logit_diff(mary, john), "resid_pre.2")["resid_pre.2"],
        atol=1e-4,
    )
    # of=: the metric reads a point instead of the logits (a probe direction, the norm)
    v = torch.randn(local.facts.d_model, generator=torch.Generator().manual_seed(1))
    for metric in (metrics.dot(v), metrics.norm(position=4), metrics.logit(john)):
        of = None if metric.kind == "logit" else "resid_post.3"
        g = remote.gradients(CLEAN, metric, ["resid_pre.0", "resid_mid.2"], of=of)
        w = local.gradients(CLEAN, metric, ["resid_pre.0", "resid_mid.2"], of=of)
        for a in ("resid_pre.0", "resid_mid.2"):
            torch.testing.assert_close(g[a], w[a], **TOL)


def test_steering_blocks_reach_the_served_patch_operations(remote, local, names):
    mary, john = names
    v = torch.randn(local.facts.d_model, generator=torch.Generator().manual_seed(7))
    with remote.steer("resid_post.0", v, scale=4.0):
        got = remote.patch(CORRUPTED, CLEAN, "mlp_out.1")
        grads = remote.gradients(CLEAN, ie_lab.logit_diff(mary, john), "resid_pre.3")
    with local.steer("resid_post.0", v, scale=4.0):
        want = local.patch(CORRUPTED, CLEAN, "mlp_out.1")
        grads_l = local.gradients(CLEAN, ie_lab.logit_diff(mary, john), "resid_pre.3")
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(grads["resid_pre.3"], grads_l["resid_pre.3"], **TOL)
    assert not torch.allclose(got, local.patch(CORRUPTED, CLEAN, "mlp_out.1"), atol=1e-3)  # it steered


def test_refusals_arrive_as_the_same_class_and_text(remote, local, names):
    mary, john = names
    for call in (
        lambda s: s.patch(CORRUPTED, CLEAN, "resid_post.9"),
        lambda s: s.patch(CORRUPTED, CLEAN, "attn_probs.1"),
        lambda s: s.patch(CORRUPTED, "Short", "resid_post.1"),
        lambda s: s.patch(CORRUPTED, CLEAN, "resid_post.1", positions=[99]),
        lambda s: s.patch(CORRUPTED, s.capture(CLEAN, "mlp_out.0"), "resid_post.1"),
        lambda s: s.patch_sweep(CLEAN, CORRUPTED, ie_lab.logit_diff(mary, john), over="everything", progress=False),
        lambda s: s.patch_sweep(CLEAN, "Short", ie_lab.logit_diff(mary, john), progress=False),
        lambda s: s.patch_sweep(CLEAN, CORRUPTED, ie_lab.logit_diff(10**6, john), progress=False),
        lambda s: s.patch_sweep(CLEAN, CORRUPTED, metrics.logprob(john, position=40), progress=False),
        lambda s: s.gradients(CLEAN, ie_lab.logit_diff(mary, john), "attn_scores.1"),
        lambda s: s.gradients(CLEAN, metrics.norm(), "resid_pre.1", of=["resid_post.2", "z.1"]),
    ):
        with pytest.raises(ie_lab.IELabError) as here:
            call(local)
        with pytest.raises(ie_lab.IELabError) as there:
            call(remote)
        assert type(there.value) is type(here.value) and str(there.value) == str(here.value), str(here.value)


def test_code_is_refused_with_what_to_use_instead(remote, local, server, token):
    for call in (
        lambda: remote.patch_sweep(CLEAN, CORRUPTED, lambda logits: logits[0, -1, 5]),
        lambda: remote.gradients(CLEAN, lambda logits: logits.sum(), "resid_pre.1"),
    ):
        with pytest.raises(ie_lab.CapabilityUnsupported, match="no code") as e:
            call()
        assert "ie_lab.remote.metrics" in str(e.value) and "ie_lab.logit_diff" in str(e.value)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        remote.run(lambda model: model)
    text = str(e.value)
    assert "backend='remote'" in text and "fn is code" in text
    assert "patch_sweep" in text and "ie_lab.remote.metrics" in text and "backend='eager'" in text
    assert local.run(lambda lm: lm.facts.n_layers) == 4  # the same call runs where the model is

    # what a hand-made request may claim a metric is: refused by the server, which goes on serving
    before = stats(server, token)
    hostile = {
        "unknown kind": MetricPayload("eval", {"position": -1}),
        "code-like parameter": MetricPayload("logit", {"token": "__import__('os')"}),
        "unknown parameter": MetricPayload("logit", {"token": 3, "fn": 1}),
        "params not a map": MetricPayload("norm", [1, 2]),
        "2-D vector": MetricPayload("dot", {"vector": torch.zeros(2, 128)}),
        "a string as the metric": "logits.sum()",
    }
    for name, metric in hostile.items():
        body = _encode_metric({"args": [CLEAN, CORRUPTED, metric], "kwargs": {}})
        r = post(server, "patch_sweep", body, token)
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["class"] == "InputError", (name, r.json())
    after = stats(server, token)
    assert after["operations"] == before["operations"] and after["running"] == 0  # refused before any ran
    torch.testing.assert_close(
        remote.patch(CORRUPTED, CLEAN, "resid_post.1"), local.patch(CORRUPTED, CLEAN, "resid_post.1"), **TOL
    )


def _encode_metric(header: dict) -> bytes:
    """A frame whose metric is a raw payload (as a hostile client could write it): the tag by hand."""
    import json
    import struct

    from safetensors.torch import save

    tensors: dict = {}

    def value(x):
        if isinstance(x, MetricPayload):
            return {"$": "metric", "kind": x.kind, "params": value(x.params)}
        if isinstance(x, torch.Tensor):
            tensors[f"t{len(tensors)}"] = x
            return {"$": "tensor", "id": f"t{len(tensors) - 1}"}
        if isinstance(x, dict):
            return {"$": "map", "v": [[k, value(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return [value(v) for v in x]
        return x

    head = json.dumps({k: value(v) for k, v in header.items()}).encode()
    return b"IEL1" + struct.pack(">I", len(head)) + head + (save(tensors) if tensors else b"")


def test_metrics_match_ie_lab_logit_diff_locally(local, names):
    mary, john = names
    logits = torch.randn(2, 5, local.facts.vocab_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(metrics.logit_diff(mary, john)(logits), ie_lab.logit_diff(mary, john)(logits))
    assert metrics.from_callable(ie_lab.logit_diff(mary, john, 2)).params == {"good": mary, "bad": john, "position": 2}
    assert metrics.logit_diff(mary, john).__name__ == ie_lab.logit_diff(mary, john).__name__
    with pytest.raises(ie_lab.InputError, match="unknown metric kind"):
        metrics.Metric("exec")
    with pytest.raises(ie_lab.InputError, match="must be an integer"):
        metrics.logit(1.5)  # type: ignore[arg-type]
    assert encode({"m": metrics.norm()})  # a Metric travels; a function does not
    with pytest.raises(ie_lab.InputError, match="cannot be sent"):
        encode({"m": lambda t: t})


def test_the_docs_list_every_served_metric_with_its_parameters():
    import inspect
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "REMOTE.md").read_text()
    for kind in metrics.KINDS:
        params = ", ".join(
            f"{n}={p.default}" if p.default is not inspect.Parameter.empty else n
            for n, p in inspect.signature(getattr(metrics, kind)).parameters.items()
        )
        assert f"metrics.{kind}({params})" in doc or f"ie_lab.{kind}({params})" in doc, (kind, params)


def test_graph_points_on_an_eager_server_are_refused_before_loading(tmp_path, token):
    import subprocess
    import sys

    from tests.test_remote import ROOT, _env

    path = tmp_path / "tokens"
    _write_tokens(path, {"alice": token}, ["alice"])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ie_lab.cli",
            "serve",
            "demo",
            "--tokens-file",
            str(path),
            "--graph-points",
            "resid_post.1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "--graph-points is vLLM's graph mode" in r.stderr and "--backend vllm" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "ie_lab.cli", "serve", "demo", "--tokens-file", str(path), "--graph-points", ","],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "names no point" in r.stderr


def test_a_cancelled_sweep_stops_on_the_server_and_frees_its_slot(remote, local, server, token):
    """An interrupted cell or a cancelled task ends a served sweep as it ends a capture: the server cancels the
    operation (hooks gone, the slot given back) and goes on serving."""
    import asyncio

    ids = list(range(5, 125))
    before = stats(server, token)

    async def main() -> None:
        # 4 layers x 120 positions, one forward per cell: seconds of work, so the cancel reaches it running
        task = asyncio.ensure_future(remote.apatch_sweep(ids, ids[::-1], metrics.norm(), batch_size=1))
        await asyncio.to_thread(_until_running, server, token, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    after = wait_until_idle(server, token)
    assert after["running"] == 0 and after["cancelled"] == before["cancelled"] + 1
    # the model is as before: no patch left behind by the cancelled sweep
    torch.testing.assert_close(
        remote.patch(CORRUPTED, CLEAN, "mlp_out.1"), local.patch(CORRUPTED, CLEAN, "mlp_out.1"), **TOL
    )
    torch.testing.assert_close(
        remote.capture(CLEAN, "final_norm")["final_norm"], local.capture(CLEAN, "final_norm")["final_norm"], **TOL
    )


def test_a_chat_generates_remotely_to_its_stop_ids_as_locally(server, token, remote, local):
    """A Chat crosses as its ids and the ids its generation stops at (its turn end): the remote generation stops
    where the local one does, not at the model's EOS only. The demo model has no chat template, so the Chat is made
    from ids, stopping at the third token greedy decoding reaches; a malformed chat is refused before anything runs."""
    from ie_lab.core.chat import Chat
    from ie_lab.core.chat_conventions import ChatConvention

    ids = local.tokens("One Monday , Mary went to the park .")
    free = local.generate(ids, 6).ids
    assert len(free) == 6  # no EOS on the way: only the chat's stop id can end it early
    stop = free[2]
    chat = Chat(ids, (), ChatConvention("plain", (), None, False, False, {}), frozenset({stop}))
    want = local.generate(chat, 6)
    assert want.ids == free[: free.index(stop) + 1] and want.stop_reason == "eos" and len(want.ids) < 6
    got = remote.generate(chat, 6)
    assert (got.ids, got.stop_reason) == (want.ids, want.stop_reason)
    # a batch stops each prompt at the union of their stop ids, remotely as locally
    both = [r.ids for r in local.generate([chat, ids], 6)]
    assert both == [want.ids, want.ids] and [r.ids for r in remote.generate([chat, ids], 6)] == both
    before = stats(server, token)
    for name, bad in {
        "too many stop ids": {"chat_ids": ids[0].tolist(), "stop_ids": list(range(1000))},  # the bound is 64
        "a negative stop id": {"chat_ids": ids[0].tolist(), "stop_ids": [-1]},
        "no ids": {"chat_ids": [], "stop_ids": [stop]},
        "another key": {"chat_ids": ids[0].tolist(), "stop_ids": [stop], "spans": []},
    }.items():
        r = post(server, "generate", encode({"args": [bad, 4], "kwargs": {}}), token)
        assert r.status_code == 400 and r.json()["error"]["class"] == "InputError", (name, r.text[:300])
    assert stats(server, token)["operations"] == before["operations"]
