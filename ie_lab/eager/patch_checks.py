"""What every patching operation shares (patch, patch_sweep, gradients, attribution_patch): the Metric type, the
checks of a metric, positions and a patchable point, the replacement edit, and the plain forward whose logits the
metric reads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import CapabilityUnsupported, InputError
from .writers import WRITABLE

Metric = Callable[[torch.Tensor], Any]  # logits [batch, seq, vocab] -> scalar (gradients(of=...): a point or a Cache)


def plain_forward(lm: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return lm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits


def check_positions(positions: Any, seq: int) -> list[int] | None:
    """Patch positions: None (every position) or distinct token indices inside the prompt (negative from the end)."""
    if positions is None:
        return None
    if isinstance(positions, (str, bytes)) or not isinstance(positions, (list, tuple, range, torch.Tensor)):
        raise InputError(
            f"positions must be a list of token indices (or None for every position), got {type(positions).__name__}."
        )
    items = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
    if isinstance(items, (int, float)):
        items = [items]
    if not items:
        raise InputError("positions is empty: name at least one token index, or pass None to patch every position.")
    out: list[int] = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, int):
            raise InputError(f"positions must be integer token indices, got {p!r} ({type(p).__name__}).")
        if not -seq <= p < seq:
            raise InputError(f"patch positions {items} are outside the {seq}-token prompt.")
        if p % seq in [q % seq for q in out]:
            raise InputError(f"positions names token {p % seq} twice; list each position once.")
        out.append(p)
    return out


def check_metric(metric: Any) -> None:
    if not callable(metric):
        raise InputError(
            f"metric must be a function of the logits [batch, seq, vocab] returning a scalar, got "
            f"{type(metric).__name__}; e.g. ie_lab.logit_diff(good_id, bad_id)."
        )


def replacement(src: torch.Tensor, positions: Sequence[int] | None) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def edit(t: torch.Tensor, offset: int) -> torch.Tensor:
        s = src.to(t)
        if positions is None:
            return s
        out = t.clone()
        out[:, list(positions)] = s[:, list(positions)]
        return out

    return edit


def scalar(x: Any) -> float:
    try:
        return float(x.detach() if isinstance(x, torch.Tensor) else x)
    except (TypeError, ValueError, RuntimeError):
        shape = f" of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else ""
        raise InputError(
            f"the metric must return a scalar (a number or a one-element tensor), got "
            f"{type(x).__name__}{shape}; reduce it, e.g. with .sum() or .mean()."
        ) from None


def check_patchable(point: Any) -> None:
    if not isinstance(point, str):
        raise InputError(
            f"point must be a point name such as 'resid_pre' (the layers come from layers=), got "
            f"{type(point).__name__}."
        )
    if point not in WRITABLE:
        from .. import points as _points

        if "." in point:
            raise InputError(
                f"point takes the name alone ({point.split('.')[0]!r}), not {point!r}: pick the layers "
                "with layers=[...]."
            )
        _points.get(point)  # an unknown name: the registry's error, with a suggestion
        raise CapabilityUnsupported(
            f"patching {point}",
            "its value is read inside the attention call, so a replacement would not flow on.",
            "patch z, attn_out or a residual point.",
        )
