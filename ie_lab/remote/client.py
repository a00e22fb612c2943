"""RemoteBackend: the Backend protocol (ie_lab/backend.py) over HTTP, to a model served by `ie-lab serve`.

A loop-style backend: every operation is a coroutine on the Session's loop, one HTTP request made with httpx
(a stream: one chunked response of frames). The Session above it is the same as for a local model: the same
methods, plain and awaited, the same `with s.steer(...)` scoping, the same refusals (the server's arrive as the
same exception classes with the same text). Cancelling a call (an interrupted cell, a cancelled task) closes its
connection, and the server cancels the operation when it sees the client gone.

What stays local: the model's facts and its tokenizer (sent once, at connect), so tokens(), to_str_tokens(),
picker panels and steering specs are checked here before anything is sent.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from ..backend import CancelToken, close_with_loop
from ..cache import Cache
from ..capabilities import GradSupport, table_grad_support
from ..core import calls
from ..core.addresses import parse_addresses
from ..core.chat import Chat
from ..core.client_model import ClientModel
from ..core.inputs import prepare_prompts
from ..core.steer_spec import issued_specs, make_spec
from ..errors import CapabilityUnsupported, IELabError, InputError, RequestFailed, check_flag
from .metrics import from_callable
from .wire import (
    COMPRESS_HEADER,
    COMPRESSION,
    CONTENT_TYPE,
    PROTOCOL,
    PROTOCOL_HEADER,
    VERSION_HEADER,
    compress,
    decode,
    encode,
    facts_from,
    package_version,
    protocol_mismatch,
    rebuild_error,
)

VERSION = package_version()
TOKEN_ENV = "IE_LAB_TOKEN"  # the client's token when connect() is given none
_POLL = 0.05  # seconds between looks at a stream's cancel token while it waits for the next step
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")  # tokenizer files the server sends: plain names only
_NOT_SERVED = ("run(fn) on the model object",)
_NOT_SERVED_WHY = (
    "a remote server runs a closed list of operations with data arguments and no code of the client, and fn is code"
)
_NOT_SERVED_INSTEAD = (
    "use the served operations, which take data (capture, generate, generate_stream, attention, logit_lens, "
    "project, mean_difference, logit_attribution, patch, patch_sweep and gradients with a metric of "
    "ie_lab.remote.metrics; docs/REMOTE.md), or run ie_lab where the model is (Session(model, backend='eager')) for fn(model)"
)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise CapabilityUnsupported(
            "a remote Session", "httpx is not installed in this environment", "pip install 'ie_lab[serve]'"
        ) from None
    return httpx


class RemoteModel(ClientModel):
    """What the client knows of the served model: its facts and tokenizer, and the backend that serves it."""

    backend = "remote"

    def __init__(self, name: str, facts: Any, tokenizer: Any, dtype: torch.dtype, served: str):
        super().__init__(name, facts, tokenizer, dtype)
        self.served = served


def _load_tokenizer(files: dict) -> Any:
    """The server's tokenizer, rebuilt from its files; no code from them runs (trust_remote_code=False)."""
    if not files:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ie_lab-remote-tok-") as d:
        for name, data in files.items():
            if not isinstance(name, str) or not _FILE_NAME.match(name) or not isinstance(data, torch.Tensor):
                raise RequestFailed(f"the server sent a tokenizer file named {str(name)[:60]!r}; refused.")
            with open(os.path.join(d, name), "wb") as f:
                f.write(data.numpy().tobytes())
        return AutoTokenizer.from_pretrained(d, trust_remote_code=False)


class _Frames:
    """The frames of a streamed response: each is preceded by its length (8 bytes)."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks, self.buf = chunks, b""

    async def next(self) -> bytes | None:
        while True:
            if len(self.buf) >= 8:
                (n,) = struct.unpack(">Q", self.buf[:8])
                if len(self.buf) >= 8 + n:
                    frame, self.buf = self.buf[8 : 8 + n], self.buf[8 + n :]
                    return frame
            chunk = await anext(self.chunks, None)
            if chunk is None:
                return None
            self.buf += chunk


class RemoteBackend:
    """Session(url, backend='remote', token=...) or ie_lab.connect(url, token=...). token: the bearer token the
    server's operator gave you (default: $IE_LAB_TOKEN). timeout: seconds to wait for the server to accept a
    connection (operations themselves run as long as the server's request_timeout allows). compress: send and
    receive large frames zlib-compressed where it pays (None: yes unless the server is on this machine, where
    the bytes cost less than compressing them)."""

    name = "remote"
    on_loop = True
    thread_name = "ie_lab-remote-session"
    extras = ("url", "served_backend")
    collect_on_close = False

    def __init__(
        self,
        model: Any,
        device: Any = None,
        dtype: Any = None,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        progress: bool = True,
        token: str | None = None,
        timeout: float = 10.0,
        compress: bool | None = None,
    ):
        if not isinstance(model, str) or not re.match(r"^https?://[^/\s]+/?$", model):
            raise InputError(
                f"a remote Session takes the server's URL, such as 'http://127.0.0.1:8765', got {str(model)[:80]!r}."
            )
        for what, v in (("device", device), ("dtype", dtype), ("tokenizer", tokenizer)):
            if v is not None:
                raise InputError(
                    f"{what}= is chosen by the server for a remote Session; pass it to `ie-lab serve` there instead."
                )
        if trust_remote_code:
            raise InputError(
                "trust_remote_code=True: a remote Session runs no code of the model here; the "
                "server decides what it trusts."
            )
        token = os.environ.get(TOKEN_ENV) if token is None else token
        if not isinstance(token, str) or not token:
            raise InputError(
                f"a remote Session needs its bearer token: ie_lab.connect(url, token=...) or "
                f"${TOKEN_ENV}; the server's operator hands one out per user."
            )
        if compress is not None and not isinstance(compress, bool):
            raise InputError(f"compress must be True, False or None (decided by the address), got {compress!r}.")
        _httpx()
        self.url = model.rstrip("/")
        host = re.sub(r"^https?://", "", self.url).rsplit(":", 1)[0].strip("[]")
        self.compress = compress if compress is not None else host not in ("127.0.0.1", "localhost", "::1")
        self._send_compressed = False  # once the server's hello says it reads compressed bodies
        self._token, self._timeout = token, float(timeout)
        # Re-running connect() for the same user replaces the earlier session; another user's session on the same
        # server stays open. A hash, so no key or repr carries the token itself.
        self.replace_key = hashlib.sha256(token.encode()).hexdigest()[:16]
        self._http: Any = None
        self._hello: dict = {}
        self.lm: RemoteModel | None = None

    @property
    def served_backend(self) -> str:
        """The backend the server runs the model on ('eager' or 'vllm')."""
        return self._hello.get("backend", "")

    # ---- lifecycle ------------------------------------------------------------------------------
    def attach(self, session: Any) -> None:
        self._loop = session._loop

    def load(self) -> Any:
        return self._load()

    async def _load(self) -> RemoteModel:
        httpx = _httpx()
        headers = {"authorization": f"Bearer {self._token}", PROTOCOL_HEADER: str(PROTOCOL), VERSION_HEADER: VERSION}
        if self.compress:
            headers[COMPRESS_HEADER] = COMPRESSION
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(None, connect=self._timeout)
        )
        # A script that ends without close() (or a kernel shut down) closes the client while the session's loop
        # still runs: a Session's own finalizer comes only once the interpreter is being torn down, too late to
        # await anything, and the client was dropped open (an "unclosed" warning, its connections cut mid-way).
        atexit.register(self._close_at_exit)
        r = await self._send("GET", "/v1/hello")
        stated = r.headers.get(PROTOCOL_HEADER)
        if stated != str(PROTOCOL):  # a server of another protocol, or one from before protocol versions
            raise protocol_mismatch(str(PROTOCOL), VERSION, stated, r.headers.get(VERSION_HEADER), self.url)
        hello = decode(r.content, results=True)["hello"]
        self._hello = hello
        self._send_compressed = self.compress and COMPRESSION in (hello.get("compression") or ())
        dtype = getattr(torch, str(hello.get("dtype", "float32")), torch.float32)
        self.lm = RemoteModel(
            hello["model"],
            facts_from(hello["facts"]),
            _load_tokenizer(hello.get("tokenizer") or {}),
            dtype if isinstance(dtype, torch.dtype) else torch.float32,
            hello["backend"],
        )
        return self.lm

    @property
    def _close_at_exit(self) -> Callable[[], None]:
        """An exit hook that holds no reference to this backend (atexit would keep every closed one alive)."""
        hook = self.__dict__.get("_exit_hook")
        if hook is None:
            ref = weakref.ref(self)

            def hook() -> None:
                backend = ref()
                if backend is not None:
                    backend.stop()

            self.__dict__["_exit_hook"] = hook
        return hook

    def stop(self) -> None:
        http, self._http = self._http, None
        if http is None:
            return
        atexit.unregister(self._close_at_exit)
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return
        if threading.current_thread().name == self.thread_name:  # stopped on the loop's own thread: it cannot wait
            close_with_loop(loop, http.aclose)  # here, so the loop runs aclose as it ends (session/handoff.py)
            return
        coro = http.aclose()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed meanwhile: the sockets close with the process
            coro.close()
            return
        with contextlib.suppress(Exception):
            fut.result(timeout=5)

    def close(self) -> None:
        self.lm = None

    def require(self, capability: str) -> None:
        from ..capabilities import require

        if capability in _NOT_SERVED:
            raise CapabilityUnsupported(
                f"{capability} on a remote Session", _NOT_SERVED_WHY, _NOT_SERVED_INSTEAD, backend="backend='remote'"
            )
        require(capability, self.served_backend)

    # ---- requests -----------------------------------------------------------------------------------
    def _gone(self, e: Exception) -> RequestFailed:
        return RequestFailed(
            f"the ie_lab server at {self.url} did not answer ({type(e).__name__}: {e}). Is "
            "`ie-lab serve` running there? The next call connects again."
        )

    def _refusal(self, status: int, content: bytes) -> BaseException:
        if status == 401:
            return RequestFailed(
                f"the ie_lab server at {self.url} refused the token (401 Unauthorized): pass the "
                f"token its operator gave you, ie_lab.connect(url, token=...) or ${TOKEN_ENV}."
            )
        try:
            body = json.loads(content)["error"]
        except (ValueError, KeyError, TypeError):
            body = None
        if body is None:
            return RequestFailed(
                f"the ie_lab server at {self.url} answered {status} without an ie_lab error "
                f"(a proxy in between?): {content[:200]!r}"
            )
        return rebuild_error(body, self.url)

    async def _send(self, method: str, path: str, body: bytes | None = None) -> Any:
        httpx = _httpx()
        if self._http is None:
            raise RequestFailed(f"the remote Session on {self.url} is closed; connect again.")
        try:
            r = await self._http.request(
                method, path, content=body, headers={"content-type": CONTENT_TYPE} if body is not None else None
            )
        except httpx.TransportError as e:
            raise self._gone(e) from None
        if r.status_code != 200:
            raise self._refusal(r.status_code, r.content)
        return r

    def _frame(self, call: calls.Record) -> dict:
        """A record as it travels (ie_lab/remote/wire.py encodes it): its positional arguments, the keywords that
        differ from their defaults, and the steering of the caller's context read now, where it is issued (the
        record's own steer= first, for an operation that has one). The client's own encodings: a patch source
        Cache as its tensors, a metric as data (ie_lab.remote.metrics), patch_sweep's layers as a list; what
        stays here (patch_sweep's progress: the server draws no bar) is checked as locally and not sent."""
        wire = call.wire_checks()
        kwargs = {k: v for k, v in call.given().items() if wire.get(k) != "local"}
        if "progress" in wire and wire["progress"] == "local":
            check_flag("progress", call.progress)  # type: ignore[attr-defined]
        # a Chat travels as its ids and stop ids (messages travel as a conversation, which the server renders)
        args = [_chat_ids(a) for a in call.positional()]
        if isinstance(call, calls.Patch) and isinstance(call.source, Cache):
            args[1] = self._cache_tensors(call.source, call.addresses)
        if isinstance(call, (calls.PatchSweep, calls.Gradients)):
            args[2 if isinstance(call, calls.PatchSweep) else 1] = from_callable(call.metric)
        if isinstance(kwargs.get("layers"), (range, tuple)):
            kwargs["layers"] = list(kwargs["layers"])
        specs = issued_specs(self.lm, kwargs.pop("steer", None))
        if specs:
            kwargs["steer"] = list(specs)
        return {"args": args, "kwargs": kwargs}

    def _call(self, call: calls.Record) -> Any:
        """The request, encoded now (in the caller's thread: a value that cannot travel refuses here)."""
        return self._post(call.op, self._body(self._frame(call)))

    def _body(self, header: dict) -> bytes:
        frame = encode(header)
        return compress(frame) if self._send_compressed else frame

    async def _post(self, name: str, body: bytes) -> Any:
        r = await self._send("POST", f"/v1/op/{name}", body)
        return decode(r.content, results=True)["result"]

    # ---- operations: each returns a coroutine the Session runs on its loop ----------------------------
    # Each operation is its record sent as it is (_call): the server checks the same fields (ie_lab/remote/ops.py
    # reads them from ie_lab/core/calls.py) and builds the same record at its Session's door.
    def capture(self, call: calls.Capture) -> Any:
        return self._call(call)

    def generate(self, call: calls.Generate) -> Any:
        return self._call(call)

    async def astream(self, token: CancelToken, call: calls.GenerateStream) -> AsyncIterator:
        httpx = _httpx()
        body = self._body(self._frame(call))
        if self._http is None:
            raise RequestFailed(f"the remote Session on {self.url} is closed; connect again.")
        try:
            async with self._http.stream(
                "POST", "/v1/op/generate_stream", content=body, headers={"content-type": CONTENT_TYPE}
            ) as r:
                if r.status_code != 200:
                    raise self._refusal(r.status_code, await r.aread())
                frames = _Frames(r.aiter_bytes())
                while not token.cancelled:
                    nxt = asyncio.ensure_future(frames.next())
                    try:
                        while not nxt.done():
                            await asyncio.wait({nxt}, timeout=_POLL)
                            if token.cancelled:
                                return  # leaving the `async with` closes the connection: the server cancels
                    finally:
                        if not nxt.done():
                            nxt.cancel()
                            with contextlib.suppress(BaseException):
                                await nxt
                    frame = nxt.result()
                    if frame is None:
                        raise RequestFailed(
                            f"the ie_lab server at {self.url} ended the stream without its last "
                            "frame (it stopped or restarted?)."
                        )
                    head = decode(frame, results=True)
                    if "step" in head:
                        yield head["step"]
                    elif "error" in head:
                        raise rebuild_error(head["error"], self.url)
                    else:
                        return
        except httpx.TransportError as e:
            raise self._gone(e) from None

    def attention(self, call: calls.Attention) -> Any:
        return self._call(call)

    def logit_lens(self, call: calls.LogitLens) -> Any:
        return self._call(call)

    def project(self, call: calls.Project) -> Any:
        return self._call(call)

    def mean_difference(self, call: calls.MeanDifference) -> Any:
        return self._call(call)

    def logit_attribution(self, call: calls.LogitAttribution) -> Any:
        return self._call(call)

    def patch(self, call: calls.Patch) -> Any:
        return self._call(call)

    def _cache_tensors(self, cache: Cache, addresses: Any) -> dict:
        """A patch source Cache as it travels: the tensors at `addresses` (all of them where one is missing or
        unreadable, so the server's refusal lists what the cache holds, as a local one does)."""
        try:
            wanted = parse_addresses(self.lm, addresses)
        except IELabError:
            wanted = None
        if wanted is None or not all(a in cache for a in wanted):
            return {str(a): t for a, t in cache.items()}
        return {str(a): cache[a] for a in wanted}

    def patch_sweep(self, call: calls.PatchSweep) -> Any:
        return self._call(call)

    def gradients(self, call: calls.Gradients) -> Any:
        return self._call(call)

    def run(self, call: calls.Run) -> Any:
        self.require("run(fn) on the model object")  # raises: no code crosses to the server

    def harvest(self, call: calls.Harvest) -> Any:
        raise CapabilityUnsupported(
            "harvest on a remote Session",
            "a harvest writes its shards into a directory where the model runs, and a server takes no paths from a "
            "client",
            "run the harvest where the model is (ie_lab.Session(model) there), or capture() prompt by prompt here "
            "and save what comes back",
            backend="backend='remote'",
        )

    def fit_jacobian_lens(self, call: calls.FitJacobianLens) -> Any:
        raise CapabilityUnsupported(
            "fit_jacobian_lens on a remote Session",
            "its result is transports for logit_lens(transports=...), which a remote server does not take (they "
            "may be code), so the server does not fit them either",
            "run ie_lab where the model is (Session(model, backend='eager')) to fit and use a Jacobian lens, or "
            "take gradients() here with a metric of ie_lab.remote.metrics",
            backend="backend='remote'",
        )

    def issued(self, steer: Any) -> Any:
        return issued_specs(self.lm, steer)

    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any) -> Any:
        """A steering spec checked here against the served model's facts; it travels as data with each request."""
        return make_spec(self.lm, address, vector, method=method, **kwargs)

    def check_printable(self, prompt: Any) -> None:
        if prepare_prompts(self.lm, prompt, rows=True) is not None:
            raise InputError(
                "print_tokens=True prints one prompt's stream; for a list of prompts, loop over "
                "s.generate_stream(prompts) and print step.token by step.prompt_index."
            )

    # ---- facts and reprs (as the server described them at connect) -----------------------------------
    def raw_model(self) -> Any:
        raise CapabilityUnsupported(
            "Session.model on a remote Session",
            "the weights live on the server",
            "run ie_lab where the model is for the raw transformers model",
        )

    def describe(self) -> str:
        return f"{self._hello['describe']} Served by {self.url} (backend={self.served_backend})."

    def points(self) -> Any:
        return self._hello["points"]

    def capabilities(self) -> dict:
        return self._hello["capabilities"]

    def grad_support(self) -> GradSupport:
        """The server's verdict on its model, sent at connect (a server from before it: its backend's cell)."""
        got = self._hello.get("grad_support")
        if not isinstance(got, dict):
            return table_grad_support(self.served_backend)
        return GradSupport(
            bool(got.get("available")),
            tuple(str(r) for r in got.get("reasons") or ()),
            f"remote ({got.get('backend') or self.served_backend})",
            str(got.get("instead") or ""),
        )

    def summary(self) -> str:
        return f"backend=remote, served: {self._hello.get('summary', '')}"

    def headline(self) -> str:
        return f"remote at {self.url}: {self._hello.get('describe', '')}"


def _chat_ids(x: Any) -> Any:
    """A Chat (ie_lab.to_chat) or a list holding Chats, with each Chat as its token ids and the ids its generation
    stops at (the server rebuilds it from them: remote/ops.py _chat)."""
    if isinstance(x, Chat):
        return {"chat_ids": x.ids[0].tolist(), "stop_ids": sorted(x.stop_ids)}
    if isinstance(x, (list, tuple)) and any(isinstance(p, Chat) for p in x):
        return [_chat_ids(p) for p in x]
    return x


__all__ = ["RemoteBackend", "RemoteModel"]
