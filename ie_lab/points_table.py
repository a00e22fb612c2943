"""The points of one loaded model, each with this model's verdict: served, or why not, as every backend reports them
(PointsTable, Row), and the layer-kind line the cheat sheet and the picker print. Each backend builds its own rows:
the eager one in ie_lab/eager/points_table.py, vLLM's in its backend, the remote one from the wire."""

from __future__ import annotations

import html
from dataclasses import dataclass

from .points import Structure, width_of  # noqa: F401 - width_of: the vLLM backend and the vLLM sites test read it here


def layer_kinds(s: Structure, n_layers: int) -> list[str]:
    """Per layer: "attention", or the mixer's kind as the model's facts name it (linear_attention, mamba, conv...)."""
    return [s.layer_kind(i) for i in range(n_layers)]


def layer_kinds_text(kinds: list[str]) -> str:
    """'layers 0-2, 4-6: linear_attention (mixer); 3, 7: attention', or "" when every layer is attention (a dense
    trunk says nothing new)."""
    if all(k == "attention" for k in kinds):
        return ""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault(k, []).append(i)
    parts = []
    for k, layers in groups.items():
        runs: list[list[int]] = []
        for i in layers:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        spans = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
        parts.append(
            f"{spans}: {k}"
            + {"attention": "", "mlp": " (MLP-only block)", "moe": " (MoE-only block)"}.get(k, " (mixer)")
        )
    return ("layer " if parts[0][0].isdigit() and parts[0].split(":")[0].isdigit() else "layers ") + "; ".join(parts)


@dataclass
class Row:
    name: str
    example: str
    width: str
    served: bool
    reason: str


class PointsTable:
    def __init__(self, rows: list[Row], backend: str, family: str):
        self.rows, self.backend, self.family = rows, backend, family

    def served(self) -> list[str]:
        return [r.name for r in self.rows if r.served]

    def __repr__(self) -> str:
        w = max(len(r.example) for r in self.rows)
        lines = [f"Points on {self.family} ({self.backend}): {len(self.served())} of {len(self.rows)} served"]
        for r in self.rows:
            mark = "✓" if r.served else "✗"
            note = "" if r.served and not r.reason else f"  — {r.reason}"
            lines.append(f"  {mark} {r.example.ljust(w)}  {r.width}{note if not r.served else ''}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr style='opacity:{1 if r.served else 0.55}'><td>{'✓' if r.served else '✗'}</td>"
            f"<td><code>{html.escape(r.example)}</code></td><td>{html.escape(r.width)}</td>"
            f"<td>{html.escape(r.reason)}</td></tr>"
            for r in self.rows
        )
        return (
            f"<div><b>Points on {html.escape(self.family)}</b> ({self.backend}): {len(self.served())} of "
            f"{len(self.rows)} served<table><tr><th></th><th>address</th><th>width</th><th>note</th></tr>"
            f"{body}</table></div>"
        )
