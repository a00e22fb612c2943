"""Where the panels' JavaScript and CSS live, and the one-step inlining that makes each panel one ES module.

Sources are in the repository's top-level ``widgets/`` folder. A wheel carries a copy in
``ie_lab/static/widgets/`` (see pyproject.toml); an editable install reads the repository folder.
A panel module may import helpers with ``import { a, b } from "./name.js";`` on a line of its own:
anywidget loads one module text, so such lines are replaced by the helper file's text (helpers only
``export`` functions and constants, so the concatenation stays a valid module). No network, no CDN.
"""

from __future__ import annotations

import functools
import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = (
    os.path.join(_HERE, os.pardir, "static", "widgets"),  # inside a wheel
    os.path.join(_HERE, os.pardir, os.pardir, "widgets"),  # a source checkout / editable install
)
_IMPORT = re.compile(r'^import\s*\{[^}]*\}\s*from\s*"\./([A-Za-z0-9_]+)\.js";\s*$', re.M)


def folder() -> str:
    for c in CANDIDATES:
        if os.path.isfile(os.path.join(c, "ie_lab.css")):
            return os.path.normpath(c)
    raise FileNotFoundError("ie_lab's widget sources are missing (looked in " + ", ".join(
        os.path.normpath(c) for c in CANDIDATES) + "); reinstall ie_lab.")


def _read(name: str) -> str:
    with open(os.path.join(folder(), name), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def esm(name: str) -> str:
    """The panel's module text with its helper imports inlined (each helper once)."""
    seen: set[str] = set()

    def inline(text: str) -> str:
        def sub(m: re.Match) -> str:
            dep = m.group(1)
            if dep in seen:
                return ""
            seen.add(dep)
            return f"// ---- {dep}.js\n" + inline(_read(dep + ".js"))
        return _IMPORT.sub(sub, text)

    return inline(_read(name + ".js"))


@functools.lru_cache(maxsize=None)
def css() -> str:
    return _read("ie_lab.css")
