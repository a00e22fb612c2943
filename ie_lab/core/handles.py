"""Model handles: the backend model behind whatever a user passes (a Session, a loaded model, a raw one).

Neutral: a handle is resolved by what it holds, never by its class, so this module imports no backend and no
session. Only the eager backend can adopt a raw transformers model (it binds it); it passes that step in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InputError


def is_backend_model(x: Any) -> bool:
    """A model a backend loaded (EagerModel, VLLMModel): its class names its backend, and it carries facts."""
    return isinstance(getattr(type(x), "backend", None), str) and hasattr(x, "facts") and not hasattr(x, "_lm")


def is_raw_model(x: Any) -> bool:
    """A transformers model as a user built it: a config and a forward, nothing ie_lab added."""
    return hasattr(x, "config") and callable(getattr(x, "forward", None))


def as_lm(model: Any, adopt: Callable[[Any], Any] | None = None) -> Any:
    """The backend model `model` is or holds: a backend model itself, a Session's (or any handle's) ._lm, or,
    where the caller passes `adopt`, what adopt makes of a raw transformers model (the eager backend binds it)."""
    if hasattr(model, "_lm"):  # a Session or anything that holds a backend model
        return model._lm
    if is_backend_model(model):
        return model
    if adopt is not None and is_raw_model(model):
        return adopt(model)
    raise InputError(
        f"model must be a Session, a model from ie_lab.load(...), or a transformers model; got "
        f"{type(model).__name__}. Open one first: s = ie_lab.Session('path or HF id')."
    )
