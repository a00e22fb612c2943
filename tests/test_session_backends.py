"""A Session is concurrency and lifecycle over a Backend (ie_lab/backend.py): what that contract promises.

A backend is added by implementing the protocol and naming it in BACKENDS; operations it does not support refuse
from the capabilities table before it is called; ie_lab.load returns one kind of handle whatever the backend.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import ie_lab
from ie_lab import backend as backend_mod
from ie_lab import capabilities
from ie_lab.backend import OPERATIONS, CancelToken
from ie_lab.eager.model import EagerModel
from ie_lab.session import Session
from ie_lab.toy import tiny_model


class _Facts:
    model_type, n_layers, d_model = "toy", 1, 4


class _Model:
    facts, tokenizer = _Facts(), None


class ToyBackend:
    """The least a loop-style backend needs: what the protocol lists, and no operation it cannot do (no patch,
    patch_sweep, gradients or run: the capabilities table refuses them first)."""

    name, on_loop, thread_name, extras, collect_on_close = "toy", True, "ie_lab-toy", ("ping",), False
    closed: list[str] = []

    def __init__(
        self,
        model: Any,
        device: Any = None,
        dtype: Any = None,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        progress: bool = True,
    ):
        self.lm = None

    def attach(self, session: Any) -> None:
        self.loop_tokens = session._tokens

    def require(self, capability: str) -> None:
        capabilities.require(capability, "vllm")  # what vLLM can do, in the table's words

    async def _load(self) -> _Model:
        self.lm = _Model()
        return self.lm

    def load(self) -> Any:
        return self._load()

    def stop(self) -> None:
        ToyBackend.closed.append("stop")

    def close(self) -> None:
        ToyBackend.closed.append("close")
        self.lm = None

    async def _where(self, *args: Any) -> tuple:
        return args, threading.current_thread().name

    # each operation receives its record (ie_lab/core/calls.py), built and checked by the Session
    def capture(self, call: Any) -> Any:
        return self._where("capture", call.tokens_or_text, call.addresses)

    def generate(self, call: Any) -> Any:
        return self._where("generate", call.prompt, call.max_new_tokens)

    async def astream(self, token: CancelToken, call: Any):
        for i in range(call.max_new_tokens):
            yield (i, threading.current_thread().name)

    def issued(self, steer: Any) -> Any:
        return steer

    def summary(self) -> str:
        return "backend=toy"

    def grad_support(self) -> Any:
        return capabilities.table_grad_support("vllm")  # no model here to look at: the table's words

    def ping(self) -> str:
        return "pong"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(backend_mod.BACKENDS, "toy", f"{__name__}:ToyBackend")
    ToyBackend.closed = []
    s = Session("toy-model", backend="toy", progress=False, replace=False)
    yield s
    s.close()


def test_a_new_backend_is_the_protocol_alone(toy):
    assert repr(toy) == "Session('toy-model', backend=toy)" and toy.backend == "toy"
    # plain calls and awaited twins both run the backend's coroutines on the session's loop thread
    assert toy.capture("x", ["a"]) == (("capture", "x", ["a"]), "ie_lab-toy")
    assert asyncio.run(toy.acapture("x", ["a"])) == (("capture", "x", ["a"]), "ie_lab-toy")
    assert asyncio.run(toy.agenerate("p", 3)) == (("generate", "p", 3), "ie_lab-toy")
    assert list(toy.generate_stream("p", 3)) == [(i, "ie_lab-toy") for i in range(3)]

    async def consume():
        return [s async for s in toy.agenerate_stream("p", 2)]

    assert asyncio.run(consume()) == [(i, "ie_lab-toy") for i in range(2)]
    assert toy.ping() == "pong"  # a backend's extras read as the Session's own
    # ... and nothing else of it: a backend's internals (public or private) are not the Session's attributes
    for name in ("loop_tokens", "_load", "attach"):
        assert hasattr(toy._backend, name)
        with pytest.raises(AttributeError, match=name):
            getattr(toy, name)
    assert "ping" in dir(toy) and "loop_tokens" not in dir(toy)
    toy.close()
    assert ToyBackend.closed == ["stop", "close"] and not toy._thread.is_alive()
    with pytest.raises(ie_lab.SessionClosed):
        toy.capture("x", ["a"])


@pytest.mark.parametrize(
    "call,row",
    [
        (lambda s: s.patch("p", None, ["resid_post.0"]), "activation patching and sweeps"),
        (lambda s: s.patch_sweep("a", "b", None), "activation patching and sweeps"),
        (lambda s: s.gradients("p", None, ["resid_post.0"]), "gradients"),
        (lambda s: s.fit_jacobian_lens(["p"]), "gradients"),
        (lambda s: asyncio.run(s.afit_jacobian_lens("p")), "gradients"),
        (lambda s: s.run(lambda lm: lm), "run(fn) on the model object"),
        (lambda s: asyncio.run(s.apatch("p", None, ["resid_post.0"])), "activation patching and sweeps"),
        (lambda s: asyncio.run(s.arun(lambda lm: lm)), "run(fn) on the model object"),
    ],
)
def test_unsupported_operations_refuse_from_the_capabilities_table(toy, call, row):
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        call(toy)  # ToyBackend has no such method: only the table can have answered
    with pytest.raises(ie_lab.CapabilityUnsupported) as want:
        capabilities.require(row, "vllm")
    assert str(e.value) == str(want.value)


def test_the_gradient_verdict_is_the_backends_own_and_needs_no_run(toy):
    verdict = toy.grad_support()  # ToyBackend has no model and runs nothing: the table answers for vLLM
    assert not verdict and verdict.available is False and verdict.backend == "vllm"
    row = next(c for c in capabilities.CAPABILITIES if c.name == "gradients")
    assert verdict.reasons == (row.why_not("vllm"),) and "autograd" in verdict.reasons[0]
    assert verdict.instead == "use backend='eager'" and "use backend='eager'" in repr(verdict)
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        verdict.require("gradients")
    with pytest.raises(ie_lab.CapabilityUnsupported) as want:
        capabilities.require("gradients", "vllm")
    assert str(e.value) == str(want.value)


def test_every_operation_is_generated_with_its_twin_and_signature():
    import inspect

    for op in OPERATIONS:
        plain, twin = getattr(Session, op.name), getattr(Session, "a" + op.name)
        assert callable(plain) and inspect.iscoroutinefunction(twin) or op.kind == "stream", op
    assert list(inspect.signature(Session.capture).parameters)[:3] == ["self", "tokens_or_text", "addresses"]


def test_load_returns_an_eager_model_whatever_the_backend():
    m, t = tiny_model("llama")
    assert isinstance(ie_lab.load(m, t, quiet=True), EagerModel)
    assert isinstance(ie_lab.load(m, t, backend="auto", quiet=True), EagerModel)
    # vLLM keeps its model in its engine: its handle is a Session, and load() says so instead of returning one
    with pytest.raises(ie_lab.CapabilityUnsupported, match=r"ie_lab\.Session\(path, backend='vllm'\)"):
        ie_lab.load(m, t, backend="vllm")
    with pytest.raises(ie_lab.CapabilityUnsupported, match=r"ie_lab\.Session\(path, backend='vllm'\)"):
        ie_lab.load("some/folder", backend="vllm")  # refused before anything is read
