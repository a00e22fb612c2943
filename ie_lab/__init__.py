"""ie_lab: a Jupyter-first workbench for looking inside language models."""

from __future__ import annotations

import weakref
from typing import Any

from . import points
from .address import Address
from .cache import Cache
from .errors import (
    AddressError,
    CapabilityUnsupported,
    IELabError,
    InputError,
    PointAbsent,
    StructureError,
)

__version__ = "0.1.0"

import os as _os

#: The small model trained for the tutorials, shipped inside the package (works offline and in Colab).
DEMO_MODEL = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "demo_model")

_WRAPPED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _as_lm(model: Any):
    """Accept an ie_lab model, or a raw transformers model (bound once and remembered)."""
    from .eager.model import EagerModel

    if isinstance(model, EagerModel):
        return model
    if hasattr(model, "_lm"):  # a Session or anything that holds a backend model
        return model._lm
    try:
        return _WRAPPED[model]
    except (KeyError, TypeError):
        pass
    lm = EagerModel(model)
    _WRAPPED[model] = lm
    return lm


def load(*args: Any, **kwargs: Any):
    from .loading import load as _load

    return _load(*args, **kwargs)


load.__doc__ = "See ie_lab.loading.load."


def capture(model: Any, tokens_or_text: Any, addresses: Any, **kwargs: Any) -> Cache:
    from .eager.capture import capture as _capture

    return _capture(model, tokens_or_text, addresses, **kwargs)


capture.__doc__ = "See ie_lab.eager.capture.capture."

__all__ = [
    "Address", "AddressError", "Cache", "CapabilityUnsupported", "IELabError", "InputError", "PointAbsent",
    "StructureError", "DEMO_MODEL", "capture", "load", "points", "__version__",
]
