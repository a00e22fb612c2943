"""`ie-lab serve`'s HTTP face and its start: build_app (the FastAPI routes: hello, stats and the closed list of
operations, each behind a bearer token) over a server.Server, and serve(), the command that checks its tokens and
host, loads the Session and runs uvicorn. The work of a request (limits, costs, the run, the stream) is server.py's."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..errors import IELabError, InputError, RequestFailed
from ..session import Session
from .ops import OPS, ArgError
from .server import LOOPBACK, Limits, Server, _ClientGone, _framed, _protocol_refusal, _refusal
from .server_defaults import DEFAULTS
from .server_tokens import MIN_TOKEN, TOKENS_ENV, Tokens
from .wire import COMPRESS_HEADER, WireError, accepts_compression, encode
from .wire import decode as decode_frame


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


__all__ = ["build_app", "serve"]
