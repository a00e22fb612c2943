"""The points of one loaded model, each with this model's verdict: served, or why not."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .address import Address
from .errors import CapabilityUnsupported, PointAbsent
from .points import Needs, Scope, Structure, all_points, width_of  # noqa: F401 - width_of: cli reads it here


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

    @classmethod
    def for_model(cls, lm: Any, layer: int | None = None) -> "PointsTable":
        from .eager.taps import resolve

        facts = lm.facts
        layer = facts.n_layers // 2 if layer is None else layer
        moe = Structure.from_binding(lm.binding).moe_layers
        rows = []
        for p in all_points():
            # several residual streams: a residual point is one stream's, so the example names the first
            stream = 0 if p.per_stream and facts.n_streams > 1 else None
            addr = Address(p.name, layer if p.scope is Scope.LAYER else None, stream=stream)
            if Needs.MOE in p.needs and moe and layer not in moe:  # shown where the model has it
                addr = Address(p.name, moe[0])
            verdict = p.verdict(lm.backend)
            try:
                if not verdict.verdict.ok:
                    raise CapabilityUnsupported(p.name, verdict.reason, "")
                resolve(lm, addr)
                served, reason = True, verdict.reason
            except (PointAbsent, CapabilityUnsupported) as e:
                served, reason = False, getattr(e, "why", str(e))
            w = width_of(p.width, facts)
            rows.append(Row(p.name, str(addr), f"{p.width.value} = {w}", served, reason))
        return cls(rows, lm.backend, facts.model_type)

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
