"""The sizing panel: `ie_lab.sizing.panel(model)` (or a Sizing's own HTML repr) in a notebook. It lives
with the sizer, below the panels' layer: nothing in it talks back to the kernel.

Plain HTML, no kernel round trips: everything it shows is computed once from the config, so it needs no front-end
code, survives a static export (nbconvert, GitHub's viewer) as drawn, and reads the same in VS Code and Colab.
Colours are JupyterLab's theme variables with light fallbacks, like the other panels.
"""

from __future__ import annotations

import html
from typing import Any

_STYLE = (
    "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;"
    "color:var(--jp-ui-font-color1,#222);background:var(--jp-layout-color1,#fff);"
    "border:1px solid var(--jp-border-color2,rgba(127,127,127,.35));border-radius:8px;padding:10px 12px;"
    "max-width:100%;box-sizing:border-box;overflow-x:auto"
)
_CELL = "padding:2px 10px 2px 0;text-align:left;white-space:nowrap"
_MUTED = "color:var(--jp-ui-font-color2,#777)"
_OK = "color:var(--jp-success-color1,#2e7d32)"
_NO = "color:var(--jp-error-color1,#c62828)"


def sizing_html(s: Any) -> str:
    """The panel's HTML for a Sizing: summary, verdict, the cache by layer kind, one row per GPU."""
    e = html.escape
    summary = "".join(f"<div>{e(line)}</div>" for line in s.summary().splitlines())
    verdict = e(s.verdict())
    head = "".join(
        f"<th style='{_CELL};{_MUTED};font-weight:normal'>{e(h)}</th>"
        for h in (*s.HEAD[:3], f"seqs of {s.tokens}", *s.HEAD[4:])
    )
    body = []
    plans = s.plans()
    best = s.best()
    for plan, row in zip(plans, s.rows()):
        colour = _OK if plan.fits else _NO
        mark = " ★" if best is not None and plan.gpu == best.gpu else ""
        cells = [f"<td style='{_CELL};{colour}'>{e(row[0])}{mark}</td>"]
        cells += [f"<td style='{_CELL}'>{e(c)}</td>" for c in row[1:-1]]
        cells.append(f"<td style='{_CELL};{'' if plan.fits else _NO}'>{e(row[-1])}</td>")
        body.append(f"<tr class='iel-sizing-row' data-fits='{int(plan.fits)}'>{''.join(cells)}</tr>")
    notes = "".join(f"<div style='{_MUTED}'>note: {e(n)}</div>" for n in s.notes())
    return (
        f"<div class='iel-sizing' style='{_STYLE}'>"
        f"<div style='{_MUTED};margin-bottom:4px'><b style='color:var(--jp-ui-font-color1,#222);font-size:14px'>"
        f"Sizing</b> · {e(s.name)} · {s.tokens} tokens per sequence</div>"
        f"<div style='{_MUTED}'>{summary}</div>"
        f"<div class='iel-sizing-verdict' style='margin:6px 0;font-weight:bold'>{verdict}</div>"
        f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{''.join(body)}</table>"
        f"<div style='{_MUTED};font-size:11px;margin-top:4px'>decode: one sequence, memory-bandwidth bound; "
        "prefill: compute bound at the datasheet's dense bf16 peak; both are limits no engine exceeds. "
        "★ the smallest GPU set that fits.</div>"
        f"{notes}</div>"
    )


class SizingPanel:
    """A Sizing drawn as a panel. `.sizing` is the Sizing (its plans, bytes and verdict as values)."""

    def __init__(self, sizing: Any):
        self.sizing = sizing

    def _repr_html_(self) -> str:
        return sizing_html(self.sizing)

    def __repr__(self) -> str:
        return repr(self.sizing)
