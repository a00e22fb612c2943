"""Many feature dashboards as one offline HTML file: ``ie_lab.export_dashboards(s, sae, features, acts, path)``.

Neuronpedia-like: a list of the features at the top, then each feature's section (its top contexts with tokens
tinted by value, hover for the value; its activation histogram and density; the tokens its decoder direction
promotes and suppresses; the steering texts where a prompt was given), drawn by the same view code as the notebook
panel (widgets/dashboard_view.js, bundled into ie_lab/static/dashboard_export.js). Everything is inline: the script,
the style sheet and the data (JSON), so the file opens from disk with no network and no kernel. The page follows
the reader's light or dark preference (prefers-color-scheme).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from typing import Any

from ..errors import InputError, plural
from . import _static
from .dashboard_data import EncodedCorpus, FeatureData, as_plain, encode_corpus, feature_data

MAX_FEATURES = 2000  # sections in one file (each is a few kB of data)

# The panels read JupyterLab's theme variables; a page outside JupyterLab sets them here, light by default and dark
# where the reader's system prefers it.
THEME = """
:root { color-scheme: light dark; --jp-layout-color1: #ffffff; --jp-layout-color2: #f3f3f3;
  --jp-ui-font-color1: #1f1f1f; --jp-ui-font-color2: #616161; --jp-border-color2: #d0d0d0;
  --jp-brand-color1: #1976d2; --jp-success-color1: #2e7d32; --jp-error-color1: #c62828; --jp-warn-color1: #b26a00; }
@media (prefers-color-scheme: dark) {
  :root { --jp-layout-color1: #1e1e1e; --jp-layout-color2: #2b2b2b; --jp-ui-font-color1: #e6e6e6;
    --jp-ui-font-color2: #a8a8a8; --jp-border-color2: #4a4a4a; --jp-brand-color1: #64b5f6;
    --jp-success-color1: #81c784; --jp-error-color1: #ef9a9a; --jp-warn-color1: #ffb74d; }
}
body { margin: 0; padding: 8px; background: var(--jp-layout-color1); color: var(--jp-ui-font-color1); }
"""


def _inline(text: str, what: str) -> str:
    """Text placed inside a <script> or <style> element: it must not close the element early."""
    closing = "</script" if what == "script" else "</style"
    if closing in text.lower():
        raise ValueError(f"the bundled {what} contains {closing}>, which would end the element early")
    return text


def render_html(data: Sequence[FeatureData], *, title: str = "Feature dashboards") -> str:
    """The HTML page for already computed FeatureData (one file, nothing fetched)."""
    if not data:
        raise InputError("no features to export: pass at least one feature.")
    address = data[0].address
    payload = {
        "title": title,
        "address": address,
        "subtitle": (
            f"{plural(len(data), 'feature')} of an SAE with {plural(data[0].d_sae, 'feature')} at {address}, over "
            f"{plural(data[0].n_tokens, 'token')}; "
            "tokens tinted by each feature's activation (hover for the value)"
        ),
        "features": [as_plain(d) for d in data],
    }
    # JSON inside <script type="application/json">: "<" escaped, so no token text can close the element
    blob = json.dumps(payload, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    css = _inline(_static.bundle("ie_lab.css").read_text(encoding="utf-8"), "style")
    js = _inline(_static.bundle("dashboard_export.js").read_text(encoding="utf-8"), "script")
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'\">\n"
        f"<style>{THEME}</style>\n<style>{css}</style>\n</head>\n<body>\n"
        f'<script type="application/json" id="iel-dashboards">{blob}</script>\n'
        f'<script type="module">{js}</script>\n</body>\n</html>\n'
    )


def export_dashboards(
    session_or_data: Any,
    sae: Any = None,
    features: Any = None,
    acts: Any = None,
    path: Any = None,
    *,
    title: str = "Feature dashboards",
    **options: Any,
) -> str:
    """Write one self-contained HTML file with a dashboard per feature; returns its path.

    session_or_data: a Session (each feature computed with ``feature_data`` over `acts`, an ie_lab.Activations or
    a list of texts, encoded once), or a list of FeatureData already computed (then sae, features and acts are not
    needed). Other keywords (top=, before=, after=, bins=, logits=, prompt=, scale=, max_new_tokens=) go to
    ``feature_data``."""
    if path is None:
        raise InputError("export_dashboards needs path= (where to write the .html file).")
    path = os.fspath(path)
    if (
        isinstance(session_or_data, (list, tuple))
        and session_or_data
        and all(isinstance(d, FeatureData) for d in session_or_data)
    ):
        data = list(session_or_data)
    else:
        s = session_or_data
        if sae is None or features is None or acts is None:
            raise InputError(
                "export_dashboards(s, sae, features, acts, path): a Session needs the SAE, the features "
                "and the corpus (or pass a list of FeatureData first)."
            )
        feats = [features] if isinstance(features, int) else list(features)
        if not feats or len(feats) > MAX_FEATURES:
            raise InputError(f"features: from 1 to {MAX_FEATURES} feature indices, got {len(feats)}.")
        corpus = acts if isinstance(acts, EncodedCorpus) else encode_corpus(s, sae, acts)
        data = [feature_data(s, sae, f, corpus, **options) for f in feats]
    text = render_html(data, title=title)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
