"""How work and the operation lock pass between a caller's thread and a Session's loop thread: the loop itself,
the lease of the lock to a plain call (`_Lease`, `_hold`), an awaited stream's hand-over (`_Handoff`), SIGINT
turned into a cancellation (`_Deferral`, `_AwaitedInterrupts`), and the OpenMP pool a thread gives back before
another computes (`_OmpPool`). The Session's docstring (ie_lab/session/__init__.py) says why each exists."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..backend import CancelToken as _CancelToken
from ..backend import OperationCancelled, SessionClosed, loop_closers

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
            for closer in loop_closers(loop):  # a backend stopped on this thread (a remote client's aclose)
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.wait_for(closer(), timeout=5))
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

    def __init__(self, session: Any, token: _CancelToken) -> None:
        self.session = weakref.ref(session)
        self.loop = session._loop
        self.token = token
        self.granted = False
        self.done = False
        self.computing = False
        self.event = threading.Event()  # set by the loop: granted, or the loop gave up (closed)
        self.loop_wake: asyncio.Event | None = None
        self.fut: concurrent.futures.Future | None = None

    def acquire(self, session: Any, until: Callable[[], bool] | None = None) -> bool:
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
