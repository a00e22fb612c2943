"""A tap on transformers' attention-function registry.

Most families call ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)`` with the
post-RoPE query, key and value. While any capture is listening, each registered implementation (and
"eager", which normally falls through to the modeling file's own function) is replaced by a wrapper
that calls the original unchanged and then hands the call's tensors to the listener registered for
that attention module. Modules nobody listens to pass straight through, so concurrent models are not
affected, and the registry is restored exactly when the last listener leaves.

Part of the structure layer, not of a backend: the binder's probe forward listens through it to learn which
attention modules go through transformers' interface, and the eager taps read q, k, v through it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_MISSING = object()
_lock = threading.RLock()
_installed: dict[str, Any] = {}  # key -> original value in the global mapping (or _MISSING)
_listeners: dict[int, Callable[[nn.Module, "AttentionCall"], None]] = {}
# Editors change what one attention module's call receives (query, key, value) before the original runs: the
# attribution graph detaches the query and key so the pattern is a constant at its run value.
_editors: dict[int, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = {}
_depth = 0


@dataclass
class AttentionCall:
    """What one attention-function call saw. q: [b, H, q, d]; k, v: [b, KV, k, d] (cache included)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    kwargs: dict[str, Any]
    output: torch.Tensor
    weights: torch.Tensor | None
    implementation: str

    @property
    def scaling(self) -> float:
        s = self.kwargs.get("scaling")
        return float(s) if s is not None else self.query.shape[-1] ** -0.5


def _interface_class():
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface


def _eager_for(module: nn.Module) -> Callable:
    mod = sys.modules.get(type(module).__module__)
    fn = getattr(mod, "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} asked for eager attention but its modeling file has no eager_attention_forward"
        )
    return fn


def _wrap(key: str, original: Any) -> Callable:
    def ie_lab_attention_tap(module, query, key_states, value, attention_mask, *args, **kwargs):
        fn = _eager_for(module) if original is _MISSING else original
        editor = _editors.get(id(module))
        if editor is not None:
            query, key_states, value = editor(query, key_states, value)
        out = fn(module, query, key_states, value, attention_mask, *args, **kwargs)
        listener = _listeners.get(id(module))
        if listener is not None:
            output, weights = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
            listener(
                module, AttentionCall(query, key_states, value, attention_mask, dict(kwargs), output, weights, key)
            )
        return out

    ie_lab_attention_tap.__wrapped__ = original if original is not _MISSING else None  # type: ignore[attr-defined]
    return ie_lab_attention_tap


def _install() -> None:
    mapping = _interface_class()._global_mapping
    keys = set(mapping) | {"eager"}
    for key in keys:
        original = mapping.get(key, _MISSING)
        _installed[key] = original
        mapping[key] = _wrap(key, original)


def _uninstall() -> None:
    mapping = _interface_class()._global_mapping
    for key, original in _installed.items():
        if original is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = original
    _installed.clear()


def is_installed() -> bool:
    return bool(_installed)


@contextlib.contextmanager
def listening(listeners: dict[int, Callable[[nn.Module, AttentionCall], None]]) -> Iterator[None]:
    """Route attention calls of the given modules (by id) to their listeners for the duration."""
    with _attached(_listeners, listeners, "listening to"):
        yield


@contextlib.contextmanager
def editing(editors: dict[int, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]]) -> Iterator[None]:
    """For the duration, the given modules' (by id) attention calls receive editor(query, key, value) instead."""
    with _attached(_editors, editors, "editing"):
        yield


@contextlib.contextmanager
def _attached(table: dict, entries: dict, what: str) -> Iterator[None]:
    global _depth
    with _lock:
        clash = set(entries) & set(table)
        if clash:
            raise RuntimeError(
                f"another caller is already {what} this model's attention; operations on one model are "
                "serialised, so this is a bug in the caller"
            )
        if _depth == 0:
            _install()
        _depth += 1
        table.update(entries)
    try:
        yield
    finally:
        with _lock:
            for k in entries:
                table.pop(k, None)
            _depth -= 1
            if _depth == 0:
                _uninstall()
