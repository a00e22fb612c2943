"""connect(): a Session around the RemoteBackend, the client's entry point. It lives apart from remote/client.py
because it builds a Session, a layer above the backends: the backend module imports no Session."""

from __future__ import annotations

from typing import Any

from ..session import Session


def connect(url: str, token: str | None = None, **kwargs: Any) -> Session:
    """A Session on the model an `ie-lab serve` runs at url: the same methods, plain and awaited, as a local one.

    token: the bearer token the server's operator gave you (default: $IE_LAB_TOKEN). See docs/REMOTE.md."""
    return Session(url, backend="remote", token=token, **kwargs)


__all__ = ["connect"]
