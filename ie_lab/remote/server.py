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
import hashlib
import hmac
import os
import struct
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..capabilities import CAPABILITIES
from ..core.files import read_bytes
from ..errors import IELabError, InputError, RequestFailed
from ..session import Session
from .costs import Costs
from .ops import OPS, ArgError
from .server_defaults import DEFAULTS
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
    WireError,
    accepts_compression,
    compress,
    encode,
    error_body,
    facts_dict,
    package_version,
    protocol_mismatch,
    tensor_bytes,
)
from .wire import decode as decode_frame

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TOKENS_ENV = "IE_LAB_SERVE_TOKENS"  # "alice:TOKEN,bob:TOKEN", for a server started without a tokens file
MIN_TOKEN = 32  # characters: a shorter token is guessable, and refuses the file that holds it


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits; each refusal names its field (which is also the command's --option)."""

    max_new_tokens: int = DEFAULTS["max_new_tokens"][1][0]
    max_request_tokens: int = DEFAULTS["max_request_tokens"][1][0]  # prompt tokens + new tokens, over all prompts
    max_capture_bytes: int = DEFAULTS["max_capture_bytes"][1][0]
    max_concurrent: int = DEFAULTS["max_concurrent"][1][0]  # requests running at once per user
    request_timeout: float = DEFAULTS["request_timeout"][1][0]  # seconds, a stream's whole length included
    max_request_bytes: int = DEFAULTS["max_request_bytes"][1][0]


MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class Tokens:
    """Bearer tokens, one per user: `NAME TOKEN` per line of the file (`#` starts a comment, blank lines are
    skipped), or TOKENS_ENV's `name:token,name:token`. A token has at least MIN_TOKEN visible ASCII characters and
    belongs to one user; a line that is not that refuses the whole file, naming the line (at start the server
    does not start; on a running server no token of the file is valid until it is fixed). The file is read again
    on every request and parsed again whenever its content changes (its hash: an edit that keeps the file's size
    and modification time still counts), so adding or revoking a user needs no restart. A token is compared in
    constant time against every known one."""

    def __init__(self, path: str | None, env: str | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._digest: bytes | None = None
        self._users: list[tuple[str, bytes]] = []
        self._env = self._parse_env(env) if env else []
        self._reload(strict=True)

    @staticmethod
    def _malformed(where: str, problem: str) -> InputError:
        return InputError(
            f"{where}: {problem}. Each line of a tokens file is 'NAME TOKEN': a name, a space, then a token of "
            f"{MIN_TOKEN} or more visible ASCII characters that no other line holds ('#' starts a comment); make a "
            f"token with: {MAKE_TOKEN}. Every token of the file is refused until the line is fixed."
        )

    @staticmethod
    def _token(where: str, name: str, tok: str) -> bytes:
        if len(tok) < MIN_TOKEN:
            raise Tokens._malformed(
                where, f"the token of {name!r} is {len(tok)} characters, shorter than {MIN_TOKEN} characters"
            )
        if not all(33 <= ord(c) <= 126 for c in tok):
            raise Tokens._malformed(where, f"the token of {name!r} holds a character other than visible ASCII")
        return tok.encode()

    @staticmethod
    def _parse(text: str, where: str) -> list[tuple[str, bytes]]:
        users: list[tuple[str, bytes]] = []
        seen: dict[bytes, int] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            at = f"{where} line {n}"
            parts = line.split()
            if len(parts) != 2:
                what = (
                    "one field, 'NAME:TOKEN' (the environment's form: the file takes a space between them)"
                    if len(parts) == 1 and ":" in parts[0]
                    else "one field alone (a name without a token, or a token without a name)"
                    if len(parts) == 1
                    else f"{len(parts)} fields"
                )
                raise Tokens._malformed(at, f"the line holds {what}, not 'NAME TOKEN'")
            name, tok = parts
            key = Tokens._token(at, name, tok)
            if key in seen:
                raise Tokens._malformed(at, f"the token of {name!r} is the one on line {seen[key]} too")
            seen[key] = n
            users.append((name, key))
        return users

    @staticmethod
    def _parse_env(env: str) -> list[tuple[str, bytes]]:
        users: list[tuple[str, bytes]] = []
        for i, item in enumerate((x.strip() for x in env.split(",")), 1):
            if not item:
                continue
            name, sep, tok = item.partition(":")
            at = f"${TOKENS_ENV} item {i}"
            if not sep or not name.strip() or not tok.strip() or len(item.split()) != 1:
                raise InputError(
                    f"{at} is not 'name:token' (it is not shown here: it may be a secret). {TOKENS_ENV} holds "
                    "'name:token,name:token' "
                    f"(tokens of {MIN_TOKEN}+ visible ASCII characters; make one with: {MAKE_TOKEN})."
                )
            if len(tok) < MIN_TOKEN or not all(33 <= ord(c) <= 126 for c in tok):
                raise InputError(
                    f"{at}: the token of {name!r} is not {MIN_TOKEN}+ visible ASCII characters. {TOKENS_ENV} "
                    f"holds 'name:token,name:token'; make a token with: {MAKE_TOKEN}."
                )
            users.append((name, tok.encode()))
        return users

    def _reload(self, strict: bool = False) -> None:
        """Read the file; parse it again if its content changed. strict (at start): refuse rather than log."""
        if self.path is None:
            self._users = self._env
            return
        if not os.path.lexists(self.path):
            if strict:
                raise InputError(f"no tokens file at {self.path}: write 'NAME TOKEN' lines there.") from None
            self._digest, self._users = None, self._env  # the file is gone: its users are revoked
            return
        try:
            data = read_bytes(self.path, "the tokens file", "text")  # a FIFO or a huge file is refused, never read
        except (OSError, InputError) as e:
            if strict:
                raise InputError(f"cannot read the tokens file {self.path}: {e}") from None
            if self._digest != b"unreadable":
                print(
                    f"ie-lab serve: cannot read {self.path}: {e}; no file token is valid until it can be read.",
                    file=sys.stderr,
                    flush=True,
                )
            self._digest, self._users = b"unreadable", self._env
            return
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return
        self._digest = digest
        try:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{self.path} is not UTF-8 text ({e}).") from None
            users = self._parse(text, self.path)
        except InputError as e:
            if strict:
                raise
            print(f"ie-lab serve: {e}", file=sys.stderr, flush=True)  # once per content: the digest is kept
            users = []
        self._users = users + self._env

    def user(self, header: str | None) -> str | None:
        """The user a request's Authorization header names, or None."""
        with self._lock:
            self._reload()
            users = list(self._users)
        if not header or not header.startswith("Bearer "):
            return None
        given = header[7:].strip().encode()
        found = None
        for name, tok in users:  # every token is compared, whichever matches: the time does not tell which
            if hmac.compare_digest(tok, given) and found is None:
                found = name
        return found

    def count(self) -> int:
        with self._lock:
            self._reload()
            return len(self._users)


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


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="ie_lab", docs_url=None, redoc_url=None, openapi_url=None)  # no unauthenticated pages

    def authorized(request: Request) -> str | None:
        return server.tokens.user(request.headers.get("authorization"))

    def unauthorized() -> Response:
        server.refused += 1
        return JSONResponse(
            {
                "error": {
                    "class": "RequestFailed",
                    "message": "no valid bearer token: send the header "
                    "'Authorization: Bearer <token>' with a token from the server's tokens file "
                    "(ie_lab.connect(url, token=...)).",
                }
            },
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.get("/v1/hello")
    async def hello(request: Request) -> Response:
        if authorized(request) is None:
            return unauthorized()
        return _protocol_refusal(request) or _framed(encode({"hello": server.hello()}), request)

    @app.get("/v1/stats")
    async def stats(request: Request) -> Response:
        if authorized(request) is None:
            return unauthorized()
        return JSONResponse(
            {
                "operations": server.operations,
                "running": server.running,
                "refused": server.refused,
                "cancelled": server.cancelled,
                "forwards": server.forwards,
            }
        )

    @app.post("/v1/op/{name}")
    async def operation(name: str, request: Request) -> Response:
        user = authorized(request)
        if user is None:
            return unauthorized()
        mismatch = _protocol_refusal(request)
        if mismatch is not None:
            return mismatch
        release = None
        try:
            if name not in OPS:
                raise InputError(f"unknown operation {name[:60]!r}; this server runs {', '.join(sorted(OPS))}.")
            body = await server.body(request)
            args, kwargs = server.prepare(
                name, decode_frame(body, results=False, limit=server.limits.max_request_bytes)
            )
            release = server.slot(user)  # before the costs are counted: at most max_concurrent at once per user
            await server.admit(name, args, kwargs)
            server.operations += 1
            if OPS[name].stream:
                held, release = release, None  # the stream gives it back when it ends
                return await server.stream(
                    args, kwargs, held, zipped=accepts_compression(request.headers.get(COMPRESS_HEADER))
                )
            result = await server.run(request, name, args, kwargs)
            return _framed(encode({"result": result}, limit=server.limits.max_capture_bytes), request)
        except _ClientGone:
            return Response(status_code=499)
        except (WireError, ArgError, IELabError) as e:
            return _refusal(e)
        except Exception as e:  # noqa: BLE001 - any other failure is this request's, reported as RequestFailed
            return _refusal(RequestFailed(f"the server failed on this {name} request: {type(e).__name__}: {e}"))
        finally:
            if release is not None:
                release()

    return app


# ---- the command -------------------------------------------------------------------------------------------


def serve(args: Any) -> int:
    """`ie-lab serve` (its options: command.py)."""
    from ..core.demo import DEMO_MODEL

    try:
        tokens = Tokens(args.tokens_file, os.environ.get(TOKENS_ENV))
    except InputError as e:  # a malformed line, a short token: the message names the line and the fix
        print(f"ie-lab serve: {e}", file=sys.stderr)
        return 2
    if tokens.count() == 0:
        print(
            f"ie-lab serve: no usable token: write 'NAME TOKEN' lines (tokens of {MIN_TOKEN}+ characters) to a file "
            f"and pass --tokens-file, or set {TOKENS_ENV}='name:token,...'. A server without tokens would refuse "
            "every request.",
            file=sys.stderr,
        )
        return 2
    if args.host not in LOOPBACK:
        print(
            f"ie-lab serve: WARNING: listening on {args.host}, beyond this machine, over plain HTTP: tokens and "
            "tensors cross the network unencrypted. Put it behind a TLS reverse proxy (docs/REMOTE.md) or an SSH "
            "tunnel, and keep --host 127.0.0.1 for the server itself.",
            file=sys.stderr,
            flush=True,
        )
    limits = Limits(**{k: getattr(args, k) for k in DEFAULTS})
    model = DEMO_MODEL if args.model == "demo" else args.model
    options: dict[str, Any] = {}
    if args.backend == "vllm" and args.tensor_parallel_size != 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    for name in ("graph_points", "steer_points"):
        value = getattr(args, name, None)
        if value is None:
            continue
        if args.backend != "vllm":
            print(
                f"ie-lab serve: --{name.replace('_', '-')} is vLLM's graph mode; the eager backend taps every point "
                "without it. Drop the option, or pass --backend vllm.",
                file=sys.stderr,
            )
            return 2
        options[name] = value
    try:
        session = Session(
            model, backend=args.backend, device=args.device, dtype=args.dtype, progress=False, replace=False, **options
        )
    except IELabError as e:  # a refusal at load (an option this model or backend cannot take): its text is the fix
        print(f"ie-lab serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    name = "ie_lab.DEMO_MODEL" if model == DEMO_MODEL else str(args.model)
    server = Server(session, tokens, limits, name)
    config = uvicorn.Config(
        build_app(server),
        host=args.host,
        port=args.port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    web = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.ensure_future(web.serve())
        while not web.started and not task.done():
            await asyncio.sleep(0.05)
        if web.started:
            port = web.servers[0].sockets[0].getsockname()[1]
            print(
                f"ie-lab serve: {name} on backend={session.backend} at http://{args.host}:{port} "
                f"({tokens.count()} user token(s))",
                flush=True,
            )
        await task

    try:
        asyncio.run(main())
    finally:
        session.close()
    return 0
