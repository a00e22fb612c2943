"""Generation streams on a Session, plain and awaited (a room of class Session)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

from ..backend import CancelToken as _CancelToken
from ..backend import OperationCancelled, SessionClosed
from ..core import calls
from .handoff import (
    _END,
    _POLL,
    _SIGINT,
    _AwaitedInterrupts,
    _bind,
    _Deferral,
    _forget,
    _Handoff,
    _Lease,
    _leases,
    _OmpPool,
    _signal,
    _until_done,
)


class _Streaming:
    """Generation streams on a Session: a plain stream computed on the caller's thread under a lease held across
    its steps (eager), or relayed from the loop (vLLM, remote); an awaited stream on the loop, joining the eager
    batch early and handed over once the lock is its own."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _backend: Any
    _cancellable: Any
    _check_open: Any
    _closed: Any
    _door: Any
    _issued: Any
    _lock: Any
    _loop: Any
    _loop_work: Any
    _loop_work_done: Any
    _refuse_nested: Any
    _remove_hooks: Any
    _tokens: Any

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
