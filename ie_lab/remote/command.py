"""The `ie-lab serve` command's options. Kept apart from server.py so that `ie-lab --help` and the other commands
never import FastAPI or uvicorn, which only a server needs (the `serve` extra)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from .server_defaults import DEFAULTS


def _positive(kind: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return v

    return parse


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 picks a free one)")
    return int(text)


def _addresses(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no point (comma-separated addresses, e.g. resid_post.3)")
    return names


def _run(args: argparse.Namespace) -> int:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ie-lab serve needs {' and '.join(missing)}: pip install 'ie_lab[serve]'.", file=sys.stderr)
        return 2
    from .server_app import serve

    return serve(args)


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="one Session behind an HTTP API, for notebooks on other machines",
        description="Serve one model to remote notebooks (ie_lab.connect(url, token=...)). Every request needs a "
        "bearer token from --tokens-file ('NAME TOKEN' lines, tokens of 32+ characters; a malformed line refuses "
        "the whole file; read again whenever its content changes) or $IE_LAB_SERVE_TOKENS ('name:token,...'). "
        "Listens on 127.0.0.1 unless --host says otherwise; see "
        "docs/REMOTE.md for the security model and running it behind TLS.",
    )
    p.add_argument("model", metavar="MODEL", help="a local folder, an HF id, or 'demo' (the bundled demo model)")
    p.add_argument("--backend", choices=("eager", "vllm"), default="eager", help="the Session's backend (eager)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=_port, default=8765, help="port (8765; 0 picks a free one and prints it)")
    p.add_argument(
        "--tokens-file",
        default=None,
        help="file of 'NAME TOKEN' lines, one user each (tokens of 32+ characters, '#' comments); a malformed "
        "line refuses the whole file, naming it",
    )
    p.add_argument("--device", default=None, help="eager: the device (default: the best one here)")
    p.add_argument("--dtype", default=None, help="the model's dtype (default: the checkpoint's)")
    p.add_argument("--tensor-parallel-size", type=_positive(int), default=1, help="vllm: GPUs per model (1)")
    p.add_argument(
        "--graph-points",
        type=_addresses,
        default=None,
        metavar="ADDRS",
        help="vllm: graph mode, a compiled trunk with static taps at these comma-separated points "
        "(e.g. resid_post.3,resid_post.5; docs/VLLM.md)",
    )
    p.add_argument(
        "--steer-points",
        type=_addresses,
        default=None,
        metavar="ADDRS",
        help="vllm graph mode: the comma-separated points the compiled trunk may steer",
    )
    for name, (kind, help_) in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=_positive(kind), default=help_[0], help=help_[1])
    p.set_defaults(run=_run, takes_extra=False)
