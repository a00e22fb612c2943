"""`ie-lab serve`: one Session behind an HTTP API (FastAPI on uvicorn), for notebooks on other machines.

The API is the closed list of operations in ops.py, each argument checked there; bodies are wire.py frames
(JSON + safetensors, never pickle). Every request needs a bearer token from the tokens file (re-read when its
content changes, so adding or revoking a user needs no restart) or the environment; without a valid one the
answer is 401 and nothing runs. Per-request limits (new tokens, tokens run, tensor bytes, concurrent requests per
user, time) refuse with the limit's name; every cost a request states (its tokens, the shapes of its answer) is
counted from its arguments and refused before the model runs (costs.py). A client that goes away (a closed
connection, an interrupted cell) cancels its operation: the Session's own cancellation, the same as an interrupt
in a local notebook.

Concurrency is the Session's: on eager, requests queue behind its lock; on vLLM, concurrent requests batch in
the engine as local ones do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import struct
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..capabilities import CAPABILITIES
from ..errors import IELabError
from ..session import Session
from .costs import Costs
from .ops import OPS, ArgError
from .server_defaults import DEFAULTS
from .server_tokens import Tokens
from .wire import (
    COMPRESS_HEADER,
    COMPRESSION,
    CONTENT_TYPE,
    PROTOCOL,
    PROTOCOL_HEADER,
    STREAM_TYPE,
    VERSION_HEADER,
    LimitExceeded,
    SteerPayload,
    accepts_compression,
    compress,
    encode,
    error_body,
    facts_dict,
    package_version,
    protocol_mismatch,
    tensor_bytes,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits; each refusal names its field (which is also the command's --option)."""

    max_new_tokens: int = DEFAULTS["max_new_tokens"][1][0]
    max_request_tokens: int = DEFAULTS["max_request_tokens"][1][0]  # prompt tokens + new tokens, over all prompts
    max_capture_bytes: int = DEFAULTS["max_capture_bytes"][1][0]
    max_concurrent: int = DEFAULTS["max_concurrent"][1][0]  # requests running at once per user
    request_timeout: float = DEFAULTS["request_timeout"][1][0]  # seconds, a stream's whole length included
    max_request_bytes: int = DEFAULTS["max_request_bytes"][1][0]


# How to ask for a smaller answer, per operation (the fix a max_capture_bytes refusal names).
_SMALLER = {
    "capture": "capture fewer points or send fewer or shorter prompts per request",
    "gradients": "ask for fewer addresses or send fewer or shorter prompts per request",
    "generate": "capture fewer points, ask for fewer new tokens or prompts, or pass keep_logits=False",
    "generate_stream": "capture fewer points, ask for fewer new tokens or prompts, or pass keep_logits=False",
    "attention": "ask for fewer layers (layers=[...]) or send a shorter prompt",
    "logit_lens": "pass keep_logits=False, ask for fewer layers, or send a shorter prompt",
    "project": "project onto fewer directions, or send a shorter prompt",
}


def _status(e: BaseException) -> int:
    if isinstance(e, LimitExceeded):
        return {
            "max_capture_bytes": 413,
            "max_request_bytes": 413,
            "max_request_tokens": 413,
            "max_concurrent": 429,
            "request_timeout": 504,
        }.get(e.limit, 400)
    if isinstance(e, IELabError):
        return 400
    return 500


VERSION = package_version()
_STATED = {PROTOCOL_HEADER: str(PROTOCOL), VERSION_HEADER: VERSION}  # on every answer to an authorized request


def _refusal(e: BaseException) -> Response:
    return JSONResponse({"error": error_body(e)}, status_code=_status(e), headers=_STATED)


def _framed(frame: bytes, request: Request) -> Response:
    """One frame as the answer, compressed where it pays if the client reads compressed frames."""
    zipped = accepts_compression(request.headers.get(COMPRESS_HEADER))
    return Response(compress(frame) if zipped else frame, media_type=CONTENT_TYPE, headers=_STATED)


def _protocol_refusal(request: Request) -> Response | None:
    """A client that states another protocol version is refused, naming both; one that states none (curl, a
    hand-written client) is read as this version."""
    stated = request.headers.get(PROTOCOL_HEADER)
    if stated is None or stated == str(PROTOCOL):
        return None
    e = protocol_mismatch(
        stated[:20],
        request.headers.get(VERSION_HEADER, "")[:40],
        str(PROTOCOL),
        VERSION,
        str(request.base_url).rstrip("/"),
    )
    return JSONResponse({"error": error_body(e)}, status_code=400, headers=_STATED)


class _ClientGone(Exception):
    pass


class _Stream(StreamingResponse):
    """A streamed response whose generator is closed as soon as the response ends, the client gone included: the
    generator's cleanup is what cancels the operation and frees its slot."""

    def __init__(self, content: Any, *, media_type: str, on_close: Any):
        super().__init__(content, media_type=media_type, headers=_STATED)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined,union-attr]
            finally:
                self.on_close()  # also when the body never started


class Server:
    """The state behind the app: the Session, the tokens, the limits and the counters the tests read."""

    def __init__(self, session: Session, tokens: Tokens, limits: Limits, model_name: str):
        self.session, self.tokens, self.limits, self.model_name = session, tokens, limits, model_name
        self.operations = 0  # operations started (after the token, the arguments and their costs were accepted)
        self.running = 0  # requests holding a slot now (their operation in flight, or its costs being counted)
        self.refused = 0  # requests without a valid token
        self.cancelled = 0  # operations stopped because their client went away
        self.per_user: dict[str, int] = {}
        self.costs = Costs(session.facts, session.tokenizer, session._lm.dtype)
        self.forwards: int | None = None  # forward passes the served model ran (eager: counted at its embedding)
        self._forwards_lock = threading.Lock()
        self._count_forwards()

    def _count_forwards(self) -> None:
        """Count every forward of the served model, so that /v1/stats shows that a refused request ran none. On
        eager: a pre-hook on the input embedding, which every forward (a capture, a decode step, a sweep's cell)
        passes; vLLM's model lives in its engine, so its count stays None."""
        if self.session.backend != "eager":
            return
        try:
            embedding = self.session.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return
        if not isinstance(embedding, torch.nn.Module):
            return

        def count(module: Any, args: Any) -> None:
            with self._forwards_lock:
                self.forwards = (self.forwards or 0) + 1

        self.forwards = 0
        embedding.register_forward_pre_hook(count)

    # ---- requests ------------------------------------------------------------------------------------
    async def body(self, request: Request) -> bytes:
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise LimitExceeded(
                "max_request_bytes", limit, int(declared), "bytes of request body", "send smaller tensors per request"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise LimitExceeded(
                    "max_request_bytes",
                    limit,
                    size,
                    "bytes of request body (or more)",
                    "send smaller tensors per request",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def steer_spec(self, p: SteerPayload) -> Any:
        """The spec a payload describes, built and checked by the Session as a local s.steer(...) would be."""
        return self.session.steer(
            p.addresses,
            p.vector,
            method=p.method,
            scale=p.scale,
            normalize=p.normalize,
            min=p.min,
            max=p.max,
            target=p.target,
            positions=p.positions,
        )

    def prepare(self, name: str, head: dict) -> tuple[list, dict]:
        op = OPS[name]
        unknown = set(head) - {"args", "kwargs"}
        if unknown:
            raise ArgError(f"{name}: a request frame holds 'args' and 'kwargs' only, not {sorted(unknown)}.")
        args, kwargs = op.bind(head.get("args", []), head.get("kwargs", {}))
        if op.tokens is not None:
            names = [p[0] for p in op.params]
            asked = (
                args[names.index(op.tokens)]
                if op.tokens in names and names.index(op.tokens) < len(args)
                else kwargs.get(op.tokens, 32 if op.stream or name == "generate" else 0)
            )
            if asked > self.limits.max_new_tokens:
                raise LimitExceeded(
                    "max_new_tokens",
                    self.limits.max_new_tokens,
                    asked,
                    "new tokens",
                    f"ask for at most {self.limits.max_new_tokens} per request",
                )
        if kwargs.get("steer") is not None:
            kwargs["steer"] = [self.steer_spec(p) for p in kwargs["steer"]]
        return args, kwargs

    async def admit(self, name: str, args: list, kwargs: dict) -> None:
        """Refuse a request whose costs, counted from its arguments (costs.py), are over a limit: before the
        Session sees it, so an oversized request never holds the model. Prompts are tokenized off the event loop,
        so a long one never stalls other users' requests."""
        cost = await asyncio.to_thread(self.costs.of, name, args, kwargs, OPS[name].params)
        generation = OPS[name].tokens is not None
        if cost.tokens > self.limits.max_request_tokens:
            raise LimitExceeded(
                "max_request_tokens",
                self.limits.max_request_tokens,
                cost.tokens,
                "tokens to run through the model (its prompts' tokens"
                + (", plus the new tokens it asks for, times its prompts" if generation else "")
                + (", once per cell of the sweep" if name == "patch_sweep" else "")
                + ")",
                "send fewer or shorter prompts per request (split a batch over several requests)"
                + (", or ask for fewer new tokens" if generation else "")
                + (", or sweep fewer layers (layers=[...])" if name == "patch_sweep" else ""),
            )
        if cost.bytes > self.limits.max_capture_bytes:
            raise LimitExceeded(
                "max_capture_bytes",
                self.limits.max_capture_bytes,
                cost.bytes,
                "bytes of tensors in its answer (counted from the shapes it will produce)",
                _SMALLER.get(name, "send fewer or shorter prompts per request"),
            )

    async def call(self, name: str, args: list, kwargs: dict) -> Any:
        s = self.session
        if name == "describe":
            return s.describe()
        if name == "points":
            return s.points()
        if name == "facts":
            return facts_dict(s.facts)
        if name == "capabilities":
            return self.capabilities()
        if name == "patch_sweep":
            kwargs["progress"] = False  # a progress bar would draw in the server's terminal, not the notebook
        specs = kwargs.pop("steer", None) if OPS[name].scoped_steer else None
        with contextlib.ExitStack() as blocks:
            for spec in specs or ():
                blocks.enter_context(spec)  # a scope in this request's task only: other requests never see it
            return await getattr(s, "a" + name)(*args, **kwargs)

    def capabilities(self) -> dict:
        b = self.session.backend
        return {
            "backend": b,
            "operations": sorted(OPS),
            "limits": dataclasses.asdict(self.limits),
            "table": {c.name: getattr(c, b) for c in CAPABILITIES},
        }

    def hello(self) -> dict:
        """What a client needs once, when it connects: the model's facts, tables and tokenizer files."""
        s = self.session
        return {
            "model": self.model_name,
            "backend": s.backend,
            "facts": facts_dict(s.facts),
            "describe": s.describe(),
            "summary": s._backend.summary(),
            "points": s.points(),
            "capabilities": self.capabilities(),
            "grad_support": dataclasses.asdict(s.grad_support()),  # read from the served model, before any run
            "tokenizer": _tokenizer_files(s.tokenizer),
            "dtype": str(s._lm.dtype).replace("torch.", ""),
            "protocol": PROTOCOL,
            "version": VERSION,
            "compression": [COMPRESSION],  # the request bodies this server reads compressed
        }

    def slot(self, user: str) -> Any:
        """Hold one running operation of `user` (refused over the user's max_concurrent); returns its release,
        which may be called more than once."""
        n = self.per_user.get(user, 0)
        if n >= self.limits.max_concurrent:
            raise LimitExceeded(
                "max_concurrent",
                self.limits.max_concurrent,
                n + 1,
                "requests at once for this user",
                "wait for your running requests to finish",
            )
        self.per_user[user] = n + 1
        self.running += 1
        held = [True]

        def release() -> None:
            if held.pop() if held else False:
                self.running -= 1
                self.per_user[user] -= 1

        return release

    async def until_gone(self, request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def run(self, request: Request, name: str, args: list, kwargs: dict) -> Any:
        """The operation, cancelled (the Session's token: it stops at its next layer) when the client goes away or
        the request runs past request_timeout."""
        task = asyncio.ensure_future(self.call(name, args, kwargs))
        gone = asyncio.ensure_future(self.until_gone(request))
        try:
            done, _ = await asyncio.wait(
                {task, gone}, timeout=self.limits.request_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                return task.result()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task  # returns once the operation has stopped and given everything back
            if gone in done:
                self.cancelled += 1
                raise _ClientGone
            raise LimitExceeded(
                "request_timeout",
                self.limits.request_timeout,
                "more",
                "seconds",
                "ask for less per request (fewer tokens, a shorter prompt)",
            )
        finally:
            gone.cancel()

    async def stream(self, args: list, kwargs: dict, release: Any, zipped: bool = False) -> Response:
        """generate_stream: length-prefixed frames, one per GenStep, then an end frame (or an error frame). The
        first step is computed before the response starts, so a refusal is a plain 4xx."""
        limit = self.limits.max_capture_bytes
        steps: Any = None
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout
        timeout = asyncio.timeout_at(deadline)
        try:
            steps = self.session.agenerate_stream(*args, **kwargs)
            async with timeout:
                first = await anext(steps, None)
        except BaseException as e:
            try:
                if steps is not None:
                    await steps.aclose()
            finally:
                release()
            if isinstance(e, TimeoutError):
                raise LimitExceeded(
                    "request_timeout", self.limits.request_timeout, "more", "seconds", "ask for less per request"
                ) from None
            raise

        async def frames() -> AsyncIterator[bytes]:
            sent, ended = 0, False
            try:
                step = first
                while step is not None:
                    frame = encode({"step": step})
                    sent += tensor_bytes(frame)
                    if sent > limit:
                        raise LimitExceeded(
                            "max_capture_bytes",
                            limit,
                            sent,
                            "bytes of tensors in this stream",
                            "capture fewer points, stream fewer tokens, or pass keep_logits=False",
                        )
                    if zipped:
                        frame = compress(frame)
                    yield struct.pack(">Q", len(frame)) + frame
                    async with asyncio.timeout_at(deadline):
                        step = await anext(steps, None)
                frame = encode({"end": True})
            except TimeoutError:
                ended = True
                frame = encode(
                    {
                        "error": error_body(
                            LimitExceeded(
                                "request_timeout",
                                self.limits.request_timeout,
                                "more",
                                "seconds of streaming",
                                "stream fewer tokens per request",
                            )
                        )
                    }
                )
            except Exception as e:  # noqa: BLE001 - a refusal mid-stream travels as the stream's last frame
                ended = True
                frame = encode({"error": error_body(e)})
            else:
                ended = True
            finally:
                if not ended:
                    self.cancelled += 1  # closed from outside: the client went away (or the server is stopping)
                try:
                    await steps.aclose()  # the operation stops and gives everything back (a client gone included)
                finally:
                    release()  # also when a cancelled scope interrupts the wait above
            yield struct.pack(">Q", len(frame)) + frame

        return _Stream(frames(), media_type=STREAM_TYPE, on_close=release)


def _tokenizer_files(tok: Any) -> dict[str, torch.Tensor]:
    """The tokenizer's own files (save_pretrained), as bytes, so the client tokenizes and decodes as the server."""
    import tempfile

    if tok is None or not hasattr(tok, "save_pretrained"):
        return {}
    with tempfile.TemporaryDirectory(prefix="ie_lab-serve-tok-") as d:
        tok.save_pretrained(d)
        out = {}
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out[name] = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        return out
