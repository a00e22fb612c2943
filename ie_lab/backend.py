"""The contract between a Session and the backend it holds: what a new backend must provide.

A Session (ie_lab/session/) owns the concurrency and the lifecycle: its loop thread, cancellation, the operation lock
and its leases, SIGINT handling, replacing a re-created session, reprs. Everything about the model is the
backend's: loading it, the operations, the facts, closing it. Backends are composed into the Session, never
subclassed from it, and import nothing from ie_lab/session/; this module is what both sides share.

The twin methods of a Session (``s.capture`` and ``await s.acapture``, ...) are generated from OPERATIONS, one row
per operation: its record (ie_lab/core/calls.py: the arguments, their defaults, the signature help() shows), the
backend method it calls, its kind, and the capability row (ie_lab/capabilities.py) a backend must support for it,
so an operation a backend cannot do refuses from that table before the backend is called. A backend receives the
record the Session built and checked, never loose keywords.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .core import calls
from .core.calls import Record
from .errors import IELabError


class OperationCancelled(IELabError, RuntimeError):
    """Raised inside the model's forward to stop an operation the user interrupted."""


class SessionClosed(IELabError, RuntimeError):
    pass


class CancelToken:
    """`cancelled` is a plain attribute: set from any thread or a signal handler, read before every layer."""

    def __init__(self) -> None:
        self.cancelled = False
        self.interrupted = False  # set with cancelled by a SIGINT the caller's event loop did not turn into a cancel


# Coroutines a backend asks its Session's loop to run as that loop ends (ie_lab/session/handoff.py's _serve_loop),
# after its tasks are cancelled: a backend stopped on the loop's own thread cannot wait there for a coroutine (an
# HTTP client's aclose), and a task it started would be cancelled with the rest before it finished.
_LOOP_CLOSERS: weakref.WeakKeyDictionary[Any, list[Callable[[], Any]]] = weakref.WeakKeyDictionary()
_LOOP_CLOSERS_LOCK = threading.Lock()


def close_with_loop(loop: Any, closer: Callable[[], Any]) -> None:
    """Run closer() (a coroutine function) on loop when the Session's loop thread ends."""
    with _LOOP_CLOSERS_LOCK:
        _LOOP_CLOSERS.setdefault(loop, []).append(closer)


def loop_closers(loop: Any) -> list[Callable[[], Any]]:
    """The closers registered for loop, handed over once (the loop thread runs them)."""
    with _LOOP_CLOSERS_LOCK:
        return _LOOP_CLOSERS.pop(loop, [])


@dataclass(frozen=True)
class Operation:
    """One row of OPERATIONS: ``s.<name>(...)`` and ``await s.a<name>(...)`` build the operation's record
    (ie_lab/core/calls.py) and hand it to ``backend.<method>(record)``.

    kind "call": one result. kind "stream": an iterator of steps (a plain stream, and an async iterator for the
    ``a`` twin). capability: the row of ie_lab/capabilities.py a backend needs for it (None: every backend)."""

    record: type[Record]
    method: str
    kind: str = "call"
    capability: str | None = None

    @property
    def name(self) -> str:
        return self.record.op

    @property
    def doc(self) -> str:
        return self.record.doc


OPERATIONS: tuple[Operation, ...] = (
    Operation(calls.Capture, "capture"),
    Operation(calls.Generate, "generate"),
    Operation(calls.GenerateStream, "stream", "stream"),
    Operation(calls.Attention, "attention"),
    Operation(calls.LogitLens, "logit_lens"),
    Operation(calls.Project, "project"),
    Operation(calls.Patch, "patch", capability="activation patching and sweeps"),
    Operation(calls.PatchSweep, "patch_sweep", capability="activation patching and sweeps"),
    Operation(calls.Gradients, "gradients", capability="gradients"),
    Operation(calls.FitJacobianLens, "fit_jacobian_lens", capability="gradients"),
    Operation(calls.MeanDifference, "mean_difference"),
    Operation(calls.LogitAttribution, "logit_attribution", capability="direct logit attribution"),
    Operation(calls.Harvest, "harvest"),
    Operation(calls.Run, "run", capability="run(fn) on the model object"),
)


class Backend(Protocol):
    """What a backend provides. A new backend implements this and registers in BACKENDS; nothing else changes.

    Attributes:
      name         "eager", "vllm", ...: the `backend=` value, and its column in ie_lab/capabilities.py.
      on_loop      False: each operation method returns a plain function of no arguments, which the Session
                   computes holding its operation lock: a plain call on the caller's own thread (the lock is leased
                   to it, SIGINT becomes a cancellation), an awaited twin on the session loop's thread; the Session
                   adds the backend's cancel hooks around it. True: each operation method returns a coroutine that the
                   Session runs on its loop, with no operation lock (vLLM: concurrent calls become one batch), and
                   `astream` replaces `stream`.
      thread_name  the name of the Session's loop thread.
      lm           the backend's model handle once loaded (None before and after): facts, tokenizer, dtype, device,
                   to_tokens, to_str_tokens. The Session's `facts`, `tokenizer`, `tokens()` read it.
      extras       names of backend-specific public members that the Session exposes as its own (vLLM: set_mode).
      collect_on_close  run a full garbage collection when the session is dropped, not only on close().
      replace_key  optional: what else, besides the model and backend name, makes two sessions the same one, so that
                   re-running a creating cell replaces the earlier session (remote: the user, as a hash of the token).

    Lifecycle (the Session calls these in this order):
      attach(session)   once the loop exists, before load: the backend may keep a weak reference, the loop and the
                        session's set of cancel tokens (never a strong reference: a dropped session must be freed).
      load()            a plain function (on_loop False) or a coroutine that loads the model and returns `lm`.
      stop()            the session is closing and its loop still runs: shut engines down (idempotent).
      close()           the loop has stopped: give back what the model held (idempotent).

    Operations (each named by a row of OPERATIONS; each receives the operation's record, ie_lab/core/calls.py,
    built and checked by the Session: `call.prompt`, `call.keywords()`, ...):
      require(capability)  raise CapabilityUnsupported for a capability row (ie_lab/capabilities.py) this backend
                        does not support; called before an operation that names one. Eager and vLLM read their
                        column of the table; a new backend may read a column it adds, or answer for itself.
      capture, generate, attention, logit_lens, project, mean_difference, harvest; patch, patch_sweep, gradients,
      fit_jacobian_lens, logit_attribution and run where `require` lets them through (otherwise they are never
      called, and need not exist).
      stream(call: GenerateStream) -> Iterator[GenStep] (on_loop False), or
      astream(token, call: GenerateStream) -> AsyncIterator[GenStep] (on_loop True).
      issued(steer)     the steering of the caller's context, read where a stream is issued.
      add_cancel_hooks(token) -> handles   (on_loop False) hooks that raise OperationCancelled at the next layer.
      .bind(token)      optional, on a returned function or stream (on_loop False): the Session hands the
                        operation its cancel token as soon as it is queued, before the operation lock is leased
                        (eager: a generation joins the shared batch then, and leaves it when the token is
                        cancelled). An operation without `bind` is handed nothing.
      steer(address, vector, method, **kw) a steering spec on this model.
      check_printable(prompt)  refuse what generate(print_tokens=True) cannot print.

    Facts and reprs: raw_model(), describe(), points(), summary() (the repr's fields after the name), headline()
    (the HTML repr's text), grad_support() (a capabilities.GradSupport: whether gradients are available on this
    model here and what blocks them, answered without a forward; capabilities.table_grad_support(column) for a
    backend with no model in this process to look at).
    """

    name: str
    on_loop: bool
    thread_name: str
    lm: Any
    extras: tuple[str, ...]
    collect_on_close: bool

    def attach(self, session: Any) -> None: ...
    def require(self, capability: str) -> None: ...
    def load(self) -> Any: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...

    # The operations: each takes its record (ie_lab/core/calls.py), whose fields are the arguments.
    def capture(self, call: calls.Capture) -> Any: ...
    def generate(self, call: calls.Generate) -> Any: ...
    def attention(self, call: calls.Attention) -> Any: ...
    def logit_lens(self, call: calls.LogitLens) -> Any: ...
    def project(self, call: calls.Project) -> Any: ...
    def patch(self, call: calls.Patch) -> Any: ...
    def patch_sweep(self, call: calls.PatchSweep) -> Any: ...
    def gradients(self, call: calls.Gradients) -> Any: ...
    def fit_jacobian_lens(self, call: calls.FitJacobianLens) -> Any: ...
    def mean_difference(self, call: calls.MeanDifference) -> Any: ...
    def harvest(self, call: calls.Harvest) -> Any: ...
    def logit_attribution(self, call: calls.LogitAttribution) -> Any: ...
    def run(self, call: calls.Run) -> Any: ...
    def issued(self, steer: Any) -> Any: ...
    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any) -> Any: ...
    def check_printable(self, prompt: Any) -> None: ...

    def raw_model(self) -> Any: ...
    def describe(self) -> str: ...
    def points(self) -> Any: ...
    def summary(self) -> str: ...
    def headline(self) -> str: ...
    def grad_support(self) -> Any: ...

    # on_loop False only (a loop-style backend need not have them):
    def stream(self, call: calls.GenerateStream) -> Iterator[Any]: ...
    def add_cancel_hooks(self, token: CancelToken) -> list: ...

    # on_loop True only:
    def astream(self, token: CancelToken, call: calls.GenerateStream) -> AsyncGenerator[Any, None]: ...


# backend= name -> "module:class". Named, not imported: ie_lab/session/ imports no backend, and a backend whose
# engine is an optional dependency (vLLM) is imported only when a Session asks for it.
BACKENDS: dict[str, str] = {
    "eager": "ie_lab.eager.backend:EagerBackend",
    "vllm": "ie_lab.vllm.backend:VLLMBackend",
    "remote": "ie_lab.remote.client:RemoteBackend",  # a model served by `ie-lab serve` (docs/REMOTE.md)
}


def backend_class(name: str) -> Callable[..., Backend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
