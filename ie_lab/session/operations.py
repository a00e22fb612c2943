"""Running an operation on a Session: the door, the dispatch, the generated methods (a room of class Session)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..backend import OPERATIONS, Operation, OperationCancelled, SessionClosed
from ..backend import CancelToken as _CancelToken
from ..capabilities import SPLICING, TRANSCODER_SPLICING
from ..core import calls
from ..core.calls import Record, signature_with
from ..core.inputs import PROMPT_PARAMETERS, with_bos
from ..core.results import GenerationResult
from ..errors import CapabilityUnsupported, check_flag
from .handoff import (
    _AwaitedInterrupts,
    _bind,
    _Deferral,
    _forget,
    _Lease,
    _leases,
    _OmpPool,
    _until_done,
)
from .lifecycle import _DEFAULT


class _Operations:
    """How a Session runs one operation: the call becomes its record at the door (`_door`), the backend makes
    its work of it (`_issue`), and the work runs as a plain call (on the caller's thread under a lease of the
    lock, or on the loop) or as an awaited twin (`_async`, `_on_loop`). The operations themselves are generated
    from OPERATIONS by `install` below."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _backend: Any
    _op_lock: asyncio.Lock | None
    _bos: Any
    _check_open: Any
    _closed: Any
    _generate_stream: Any
    _inside_own_operation: Any
    _lm: Any
    _loop: Any
    _loop_work: Any
    _refuse_nested: Any
    _tokens: Any

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

    def _door(self, record: type[Record], args: tuple, kwargs: dict, door: tuple[str, ...] = ("prepend_bos",)) -> Any:
        """The record of one call (ie_lab/core/calls.py), built and checked here, at the door, before any backend
        sees it; its prompts' text turned into ids by prepend_bos (the call's keyword, else the Session's; nothing
        changes while both are None), so every backend (eager, vLLM, a remote server) runs the same ids."""
        kwargs = dict(kwargs)
        prepend_bos = kwargs.pop("prepend_bos", _DEFAULT)
        call = record.build(args, kwargs, door=door)  # door: this method's own keywords, offered as near matches
        intervene = getattr(call, "intervene", None) is not None
        if getattr(call, "splice", None) is not None or intervene:
            self._splicing(intervene)  # a backend that cannot splice refuses splice= and intervene= here, first
        if intervene:
            self._backend.require(TRANSCODER_SPLICING)  # a backend whose splices cannot pair mlp_in with mlp_out
        bos = self._bos(prepend_bos)
        if hasattr(call, "prepend_bos"):  # harvest: its texts are read lazily, so the record carries the choice
            return call.replace(prepend_bos=bos)
        if bos is None:
            return call
        tok = self._lm.tokenizer
        prompts = {n: with_bos(tok, getattr(call, n), bos) for n in PROMPT_PARAMETERS if hasattr(call, n)}
        return call.replace(**prompts)

    # ---- operations: generated from OPERATIONS (ie_lab/backend.py) by install(), below ------------------
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
        call = self._door(calls.Generate, args, kwargs, door=("prepend_bos", "print_tokens"))
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

    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any):
        """A steering spec on this model: `with s.steer(...):` or s.generate(..., steer=spec). A `with` block
        steers the requests issued inside it from the same task or thread (other tasks and threads are untouched)."""
        self._check_open()
        return self._backend.steer(address, vector, method=method, **kwargs)

    # ---- SAE splicing (docs/SAE.md, "Splicing"): a spec carried as steering is ----------------------------
    def splice(self, sae: Any, *, error: bool = False):
        """An SAE spliced in at its point: the point's value becomes the SAE's reconstruction decode(encode(x))
        (error=True adds the error term x - decode(encode(x)) back, so only feature edits change the run).
        `with s.splice(sae):` or s.generate(..., splice=spec); spec.ablate(features) / spec.clamp(features, value)
        return a new spec; capture 'sae.<name>.acts' during a spliced run for the features. Eager and vLLM (not
        graph mode); a remote Session refuses it. Transcoders (ie_lab.load_transcoders, or one of its layers) splice
        in place of their MLPs' outputs, read at mlp_in.L and written at mlp_out.L (eager and vLLM; docs/CIRCUITS.md,
        "Interventions")."""
        self._check_open()
        return self._splicing().splice(sae, error=error)

    def _splicing(self, intervene: bool = False) -> Any:
        """The backend, where it splices; otherwise CapabilityUnsupported naming the eager backend (intervene: the
        refusal names transcoders, the call's intervene= would splice them)."""
        self._backend.require(SPLICING)
        if intervene and not callable(getattr(self._backend, "splice", None)):
            raise CapabilityUnsupported(
                TRANSCODER_SPLICING + " on a remote Session",
                "intervene= splices transcoders into the forward, whose weights would have to travel to the server; "
                "the served operations take steering as data (addresses and a vector) and have no checked argument "
                "for a transcoder",
                "run ie_lab where the model is (Session(model) or Session(path, backend='vllm')) to intervene, or "
                "steer along a feature's decoder direction remotely (tcs[L].steer(s, feature, scale) adds "
                "scale x W_dec[feature] at mlp_out.L)",
                backend=f"backend={self._backend.name!r}",
            )
        if not callable(getattr(self._backend, "splice", None)):  # a remote Session (its server may be eager)
            raise CapabilityUnsupported(
                SPLICING + " on a remote Session",
                "a splice holds an SAE's weights and runs its arithmetic inside the forward; the served operations "
                "take steering as data (addresses and a vector) and have no checked argument for an SAE",
                "run ie_lab where the model is (Session(model, backend='eager')) and splice there, or steer along "
                "the SAE's decoder directions remotely (sae.steer(s, feature, scale))",
                backend=f"backend={self._backend.name!r}",
            )
        return self._backend


_OPS = {op.name: op for op in OPERATIONS}


def _twins(op: Operation) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The plain method and its awaited twin for one row of OPERATIONS.

    A plain call: the backend's coroutine runs on the loop (_call), or its function computes on this thread under
    a lease of the operation lock (_sync). The twin: the coroutine is awaited on the loop (_on_loop), or the
    function computes on the loop thread under the lock (_async)."""

    def plain(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch(self._issue(op, args, kwargs))

    async def awaited(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = self._issue(op, args, kwargs)
        if self._backend.on_loop:
            return await self._on_loop(work)
        return await self._async(work)

    return plain, awaited


def _named(fn: Any, name: str, record: type[Record], doc: str, **door: Any) -> None:
    """fn shows the operation's real parameters: help(s.capture) lists the record's fields (grad=, ...), then the
    keywords of the Session's door (prepend_bos, and generate's print_tokens)."""
    fn.__name__, fn.__qualname__, fn.__doc__ = name, f"Session.{name}", doc
    own = {f.name for f in record.parameters()}  # harvest's prepend_bos is a field of its record (calls.Harvest)
    door = {k: v for k, v in {"prepend_bos": _DEFAULT, **door}.items() if k not in own}
    fn.__signature__ = signature_with(record, before=("self",), door=door)


_BOS_DOC = " prepend_bos: True / False put a BOS token first or not (default: the Session's setting; docs/PORTING.md)."


def install(cls: type) -> None:
    """The operations as methods of cls (the Session): a plain method and its awaited twin per row of OPERATIONS,
    each showing its record's parameters. Streams (a lease held across steps) and generate (print_tokens around
    the same dispatch) are the class's own methods, given their record's signature here."""
    for op in OPERATIONS:
        if op.kind == "stream":
            _named(getattr(cls, op.name), op.name, op.record, op.doc + _BOS_DOC)
            _named(
                getattr(cls, "a" + op.name),
                "a" + op.name,
                op.record,
                "Async iterator of GenStep objects, from any event loop; cancelling the consumer stops the stream. "
                + op.doc
                + _BOS_DOC,
            )
            continue
        plain, awaited = _twins(op)
        if hasattr(cls, op.name):  # generate
            own = " print_tokens=True streams the text into the cell as it is produced."
            _named(getattr(cls, op.name), op.name, op.record, op.doc + own + _BOS_DOC, print_tokens=False)
        else:
            _named(plain, op.name, op.record, op.doc + _BOS_DOC)
            setattr(cls, op.name, plain)
        _named(awaited, "a" + op.name, op.record, f"Awaitable twin of Session.{op.name}: {op.doc}{_BOS_DOC}")
        setattr(cls, "a" + op.name, awaited)
