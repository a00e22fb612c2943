"""The eager backend's points table: each point of the registry at one layer of a model bound in this process,
served where the binding resolves it (ie_lab.eager.taps.resolve, the same check every capture makes), else the
reason it is not."""

from __future__ import annotations

from typing import Any

from ..address import Address
from ..errors import CapabilityUnsupported, PointAbsent
from ..points import Needs, Scope, Structure, all_points, width_of
from ..points_table import PointsTable, Row
from .taps import resolve


def points_table(lm: Any, layer: int | None = None) -> PointsTable:
    """The table of an EagerModel at `layer` (default: the middle layer)."""
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
    return PointsTable(rows, lm.backend, facts.model_type)
