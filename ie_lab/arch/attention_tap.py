"""A tap on transformers' attention-function registry.

Most families call ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)`` with the
post-RoPE query, key and value. While any capture is listening, each registered implementation (and
"eager", which normally falls through to the modeling file's own function) is replaced by a wrapper
that calls the original unchanged and then hands the call's tensors to the listener registered for
that attention module. Modules nobody listens to pass straight through, so concurrent models are not
affected, and the registry is restored exactly when the last listener leaves.

Families that compute attention inside their own module (GPT-J before transformers 5.24, CodeGen) never reach the
registry; their module runs its own attention step, ``_attn(query, key, value, attention_mask)``, handed the
post-rotary q and k and returning (output, probabilities). ``listening(..., steps=modules)`` wraps that step on those
module instances for the duration, the same way: the original runs unchanged, then the listener gets the call (its
implementation is STEP). The instance attribute is removed again when the listening ends.

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
# The attention step a module computing attention itself runs (see the module docstring), and the implementation
# name its calls carry.
STEP_METHOD = "_attn"
STEP = "module step"
_steps: dict[int, tuple[nn.Module, Any]] = {}  # module id -> (module, its instance attribute before, or _MISSING)


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


def has_step(module: nn.Module) -> bool:
    """Whether the module has an attention step of its own to listen on."""
    return callable(getattr(module, STEP_METHOD, None))


def _wrap_step(module: nn.Module) -> None:
    original = getattr(module, STEP_METHOD)  # the bound method (or whatever the instance holds)

    def ie_lab_attention_step(*args, **kwargs):
        out = original(*args, **kwargs)
        listener = _listeners.get(id(module))
        # a step of another shape than (query, key, value, attention_mask) passes through unheard
        if listener is not None and len(args) >= 3 and all(isinstance(t, torch.Tensor) for t in args[:3]):
            mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
            output, weights = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
            listener(module, AttentionCall(*args[:3], mask, dict(kwargs), output, weights, STEP))
        return out

    _steps[id(module)] = (module, module.__dict__.get(STEP_METHOD, _MISSING))
    module.__dict__[STEP_METHOD] = ie_lab_attention_step  # an instance attribute: this module only


def _unwrap_step(key: int) -> None:
    entry = _steps.pop(key, None)
    if entry is None:  # its wrapping never happened (listening failed while placing the wrappers)
        return
    module, before = entry
    if before is _MISSING:
        module.__dict__.pop(STEP_METHOD, None)
    else:
        module.__dict__[STEP_METHOD] = before


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
def listening(
    listeners: dict[int, Callable[[nn.Module, AttentionCall], None]], steps: tuple[nn.Module, ...] = ()
) -> Iterator[None]:
    """Route attention calls of the given modules (by id) to their listeners for the duration; the modules in steps
    (each one with a listener) are also listened on at their own attention step."""
    with _attached(_listeners, listeners, "listening to", steps):
        yield


@contextlib.contextmanager
def editing(editors: dict[int, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]]) -> Iterator[None]:
    """For the duration, the given modules' (by id) attention calls receive editor(query, key, value) instead (at
    the attention interface only: a module running its own attention step is not edited)."""
    with _attached(_editors, editors, "editing"):
        yield


@contextlib.contextmanager
def _attached(table: dict, entries: dict, what: str, steps: tuple[nn.Module, ...] = ()) -> Iterator[None]:
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
        wrapped = [id(m) for m in steps if id(m) in entries and id(m) not in _steps and has_step(m)]
        for m in steps:
            if id(m) in wrapped:
                _wrap_step(m)
    try:
        yield
    finally:
        with _lock:
            for k in wrapped:
                _unwrap_step(k)
            for k in entries:
                table.pop(k, None)
            _depth -= 1
            if _depth == 0:
                _uninstall()
