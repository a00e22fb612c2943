"""The contract between a Session and the backend it holds: what a new backend must provide.

A Session (session.py) owns the concurrency and the lifecycle: its loop thread, cancellation, the operation lock
and its leases, SIGINT handling, replacing a re-created session, reprs. Everything about the model is the
backend's: loading it, the operations, the facts, closing it. Backends are composed into the Session, never
subclassed from it, and import nothing from session.py; this module is what both sides share.

The twin methods of a Session (``s.capture`` and ``await s.acapture``, ...) are generated from OPERATIONS, one row
per operation: the backend method it calls, its kind, and the capability row (ie_lab/capabilities.py) a backend
must support for it, so an operation a backend cannot do refuses from that table before the backend is called.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass(frozen=True)
class Operation:
    """One row of OPERATIONS: ``s.<name>(...)`` and ``await s.a<name>(...)`` call ``backend.<method>(...)``.

    kind "call": one result. kind "stream": an iterator of steps (a plain stream, and an async iterator for the
    ``a`` twin). capability: the row of ie_lab/capabilities.py a backend needs for it (None: every backend)."""

    name: str
    method: str
    kind: str = "call"
    capability: str | None = None
    doc: str = ""


OPERATIONS: tuple[Operation, ...] = (
    Operation("capture", "capture", doc="One forward; the activations at `addresses` in a Cache."),
    Operation(
        "generate",
        "generate",
        doc="Generate to the end. print_tokens=True streams the text into the cell as "
        "it is produced; a capture covers prompt + every generated token.",
    ),
    Operation(
        "generate_stream",
        "stream",
        "stream",
        doc="Yield GenStep objects as tokens are produced; an interrupt stops within one token.",
    ),
    Operation("attention", "attention", doc="Attention patterns (and values) of one prompt, for the viewers."),
    Operation(
        "logit_lens", "logit_lens", doc="The logit lens: each layer's residual read out through the unembedding."
    ),
    Operation(
        "project",
        "project",
        doc="Per-token scores [tokens, k] of one point against probe directions or an SAE "
        "encoder, computed where the activation is read (docs/PROJECTION.md).",
    ),
    Operation(
        "patch",
        "patch",
        capability="activation patching and sweeps",
        doc="Run the prompt with activations replaced from `source` at `addresses`.",
    ),
    Operation(
        "patch_sweep",
        "patch_sweep",
        capability="activation patching and sweeps",
        doc="Patch every (layer, position) of the clean run into the corrupted one; the metric per cell.",
    ),
    Operation(
        "gradients",
        "gradients",
        capability="gradients",
        doc="Gradients of metric(logits) with respect to the activations at `addresses`.",
    ),
    Operation(
        "mean_difference",
        "mean_difference",
        doc="mean(positive) - mean(negative) at `address`, the prompts in batches (see ie_lab.mean_difference).",
    ),
    Operation(
        "run",
        "run",
        capability="run(fn) on the model object",
        doc="Run fn(model) queued behind the session's other operations (for custom analyses), on the calling "
        "thread; interrupts stop it between layers.",
    ),
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

    Operations (each named by a row of OPERATIONS; arguments as the user passed them):
      require(capability)  raise CapabilityUnsupported for a capability row (ie_lab/capabilities.py) this backend
                        does not support; called before an operation that names one. Eager and vLLM read their
                        column of the table; a new backend may read a column it adds, or answer for itself.
      capture, generate, attention, logit_lens, project, mean_difference; patch, patch_sweep, gradients and run
      where `require` lets them through (otherwise they are never called, and need not exist).
      stream(prompt, max_new_tokens, **kw) -> Iterator[GenStep] (on_loop False), or
      astream(token, prompt, max_new_tokens, kw) -> AsyncIterator[GenStep] (on_loop True).
      issued(steer)     the steering of the caller's context, read where a stream is issued.
      add_cancel_hooks(token) -> handles   (on_loop False) hooks that raise OperationCancelled at the next layer.
      .bind(token)      optional, on a returned function or stream (on_loop False): the Session hands the
                        operation its cancel token as soon as it is queued, before the operation lock is leased
                        (eager: a generation joins the shared batch then, and leaves it when the token is
                        cancelled). An operation without `bind` is handed nothing.
      steer(address, vector, method, **kw) a steering spec on this model.
      check_printable(prompt)  refuse what generate(print_tokens=True) cannot print.

    Facts and reprs: raw_model(), describe(), points(), summary() (the repr's fields after the name), headline()
    (the HTML repr's text).
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

    # The operations, with the signatures the Session's generated methods show (help(s.capture)).
    def capture(self, tokens_or_text: Any, addresses: Any, *, steer: Any = None, **kwargs: Any) -> Any: ...
    def generate(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Any: ...
    def attention(self, prompt: Any, layers: Any = None) -> Any: ...
    def logit_lens(self, prompt: Any, **kwargs: Any) -> Any: ...
    def project(self, prompt: Any, address: Any, directions: Any, **kwargs: Any) -> Any: ...
    def patch(self, prompt: Any, source: Any, addresses: Any, **kwargs: Any) -> Any: ...
    def patch_sweep(self, clean: Any, corrupted: Any, metric: Any, **kwargs: Any) -> Any: ...
    def gradients(self, prompt: Any, metric: Any, addresses: Any, *, of: Any = None) -> Any: ...
    def mean_difference(self, positive: Any, negative: Any, address: Any, **kwargs: Any) -> Any: ...
    def run(self, fn: Callable[[Any], Any]) -> Any: ...
    def issued(self, steer: Any) -> Any: ...
    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any) -> Any: ...
    def check_printable(self, prompt: Any) -> None: ...

    def raw_model(self) -> Any: ...
    def describe(self) -> str: ...
    def points(self) -> Any: ...
    def summary(self) -> str: ...
    def headline(self) -> str: ...

    # on_loop False only (a loop-style backend need not have them):
    def stream(self, prompt: Any, max_new_tokens: int, **kwargs: Any) -> Iterator[Any]: ...
    def add_cancel_hooks(self, token: CancelToken) -> list: ...

    # on_loop True only:
    def astream(
        self, token: CancelToken, prompt: Any, max_new_tokens: int, kwargs: dict
    ) -> AsyncGenerator[Any, None]: ...


# backend= name -> "module:class". Named, not imported: session.py imports no backend, and a backend whose
# engine is an optional dependency (vLLM) is imported only when a Session asks for it.
BACKENDS: dict[str, str] = {
    "eager": "ie_lab.eager.backend:EagerBackend",
    "vllm": "ie_lab.vllm.backend:VLLMBackend",
    "remote": "ie_lab.remote.client:RemoteBackend",  # a model served by `ie-lab serve` (docs/REMOTE.md)
}


def backend_class(name: str) -> Callable[..., Backend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
