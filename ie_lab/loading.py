"""The old import path of ie_lab/eager/loading.py (load() builds the eager backend's model, so it lives in the eager
package) and of the load-argument checks in ie_lab/core/load_checks.py. The package __init__ (ie_lab.load) and the
Session read it; new code imports from those two modules."""

from __future__ import annotations

from .core.load_checks import check_flags, check_tokenizer_arg, default_dtype, pick_device, resolve_dtype
from .eager.loading import OPTIONS, load, options_markdown

__all__ = [
    "OPTIONS",
    "check_flags",
    "check_tokenizer_arg",
    "default_dtype",
    "load",
    "options_markdown",
    "pick_device",
    "resolve_dtype",
]
