"""Plotly figures drawn for JupyterLab's theme: every ``.plot()`` of ie_lab's results passes its figure through
``themed``, so a figure made in the dark theme is not a white block (issue 33)."""

from __future__ import annotations

from typing import Any


def jupyterlab_theme() -> str:
    """ "dark" or "light": the theme JupyterLab is set to, as its settings file says (the kernel runs beside the
    server, and JUPYTERLAB_SETTINGS_DIR, which the server hands its kernels, names the folder); "light" when
    there is none, JupyterLab's default."""
    import os
    import re

    folder = os.environ.get("JUPYTERLAB_SETTINGS_DIR")
    if not folder:
        try:
            from jupyter_core.paths import jupyter_config_dir

            folder = os.path.join(jupyter_config_dir(), "lab", "user-settings")
        except ImportError:
            return "light"
    path = os.path.join(folder, "@jupyterlab", "apputils-extension", "themes.jupyterlab-settings")
    try:
        with open(path, encoding="utf-8") as f:
            text = "\n".join(line for line in f if not line.lstrip().startswith("//"))  # JSON5: comments
    except OSError:
        return "light"
    m = re.search(r'"theme"\s*:\s*"([^"]*)"', text)
    return "dark" if m and "dark" in m.group(1).lower() else "light"


def themed(fig: Any) -> Any:
    """A figure drawn for JupyterLab's theme when it is made: plotly's dark template in a dark theme, its plain white
    one otherwise, on a transparent background (the notebook's own colour shows through, never a white block).
    A default template the user chose (plotly.io.templates.default) is kept."""
    import plotly.io as pio

    layout: dict[str, Any] = {"paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)"}
    if pio.templates.default == "plotly":
        layout["template"] = "plotly_dark" if jupyterlab_theme() == "dark" else "plotly_white"
    fig.update_layout(**layout)
    return fig
