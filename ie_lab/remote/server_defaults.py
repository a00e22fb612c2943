"""The server's per-request limits and their defaults: one table for the command's options and the Limits type."""

from __future__ import annotations

from typing import Any

# name -> (type, (default, help)). Each name is a field of server.Limits and the command's --option.
DEFAULTS: dict[str, tuple[type, tuple[Any, str]]] = {
    "max_new_tokens": (int, (512, "most new tokens one request may ask for (512)")),
    "max_request_tokens": (
        int,
        (
            65536,
            "most tokens one request may run through the model: its prompts' tokens, plus new tokens x prompts "
            "(a patch sweep: its prompt once per cell), summed over the request, refused before it runs (65536)",
        ),
    ),
    "max_capture_bytes": (
        int,
        (
            256 << 20,
            "most bytes of tensors in one response or stream, counted from the shapes the request will produce "
            "and refused before it runs (256 MiB)",
        ),
    ),
    "max_concurrent": (int, (4, "most requests running at once per user (4)")),
    "request_timeout": (float, (300.0, "seconds one request (a whole stream) may run (300)")),
    "max_request_bytes": (int, (64 << 20, "most bytes in one request body (64 MiB)")),
}
