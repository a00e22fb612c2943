"""The input checks moved to ie_lab/core/inputs.py; these names stay until the session modules import core."""

from __future__ import annotations

from ..core.inputs import prepare, prepare_prompts, str_tokens  # noqa: F401 - re-exported for session modules

__all__ = ["prepare", "prepare_prompts", "str_tokens"]
