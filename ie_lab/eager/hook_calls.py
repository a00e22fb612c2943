"""Forward hooks that take the call's keyword arguments, registered so that another thread's forward cannot call
them the wrong way.

torch keeps a hook and its "pass the kwargs" flag in two dicts, and a forward looks the flag up only when it reaches
the hook in its loop. Every ie_lab operation removes its hooks when it ends, so a thread whose forward is between two
hooks when another thread removes one (or registers one) can find the hook without its flag and call it with
(module, args[, output]) alone: a TypeError inside a forward that had nothing to do with it (seen under load on CI,
tests/test_steer_scope.py). The hooks registered here accept both calls; the short one can only come from such a
foreign forward (a hook's own forwards start after it is registered and end before it is removed), which every
eager hook ignores anyway, so it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def on_input(
    module: torch.nn.Module, fn: Callable[[Any, tuple, dict], Any], *, prepend: bool = False
) -> torch.utils.hooks.RemovableHandle:
    """module.register_forward_pre_hook(fn, with_kwargs=True), tolerant of the short call."""

    def hook(mod: Any, args: tuple, *kwargs: dict) -> Any:
        return fn(mod, args, kwargs[0]) if kwargs else None

    return module.register_forward_pre_hook(hook, with_kwargs=True, prepend=prepend)


def on_output(
    module: torch.nn.Module, fn: Callable[[Any, tuple, dict, Any], Any], *, prepend: bool = False
) -> torch.utils.hooks.RemovableHandle:
    """module.register_forward_hook(fn, with_kwargs=True), tolerant of the short call."""

    def hook(mod: Any, args: tuple, *rest: Any) -> Any:
        return fn(mod, args, rest[0], rest[1]) if len(rest) == 2 else None

    return module.register_forward_hook(hook, with_kwargs=True, prepend=prepend)
