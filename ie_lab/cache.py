"""The old import path of ie_lab/core/cache.py (the Cache moved into the core beside the other result types, which
hold one: issue 29's cache <-> core cycle). The backends and the panels still import it from here."""

from __future__ import annotations

from .core.cache import Cache

__all__ = ["Cache"]
