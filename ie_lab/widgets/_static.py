"""Where the panels' modules and style are read from: ``ie_lab/static/``, built from the repository's ``widgets/``.

``widgets/build.py`` bundles each panel's ES module with the helpers it imports (esbuild) into
``ie_lab/static/<panel>.js``, and the style sheet into ``ie_lab/static/ie_lab.css``. The bundles are committed and
shipped as package data, so no install needs node; ``setup.py`` rebuilds or checks them. No network, no CDN.

Panels hand anywidget these files as ``pathlib.Path``: anywidget reads them, and in a source checkout with
``ANYWIDGET_HMR=1`` it also watches them and reloads the panels on screen when they change. There the development
bundles that ``python widgets/build.py --watch`` keeps current (``build/widgets-dev/``) are used when present.
"""

from __future__ import annotations

import os
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "static"
DEV = Path(__file__).resolve().parents[2] / "build" / "widgets-dev"  # exists only in a source checkout


def bundle(name: str) -> Path:
    """The file anywidget reads for one panel module (``picker.js``...) or the style sheet (``ie_lab.css``)."""
    if os.environ.get("ANYWIDGET_HMR") == "1" and (DEV / name).is_file():
        return DEV / name
    path = STATIC / name
    if not path.is_file():
        raise FileNotFoundError(
            f"ie_lab's notebook panel file {path} is missing: in a source checkout run "
            "`./dev setup` (or `python widgets/build.py`); otherwise reinstall ie_lab."
        )
    return path
