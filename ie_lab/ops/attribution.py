"""Direct logit attribution's arithmetic: the final norm frozen at one run's scale, and the pieces of the residual read
through it and the unembedding.

A norm divides its input by a scale it computes from that input, so it is not linear; with the scale frozen at the
value the run had, it is: LayerNorm centres each piece and multiplies it by gain / scale (its bias a piece of its
own), RMSNorm multiplies by gain / scale. The frozen pieces then sum, through the unembedding, to the model's own
logit. Torch alone, nothing of ie_lab: a vLLM worker could run it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FrozenNorm:
    """A final norm at one run's scale: ``apply(piece)`` is what the piece contributes to the norm's output there."""

    center: bool  # LayerNorm: each piece loses its mean over d_model first
    factor: torch.Tensor  # [positions, d_model]: gain / the run's scale, per position
    bias: torch.Tensor | None  # [d_model], the norm's own bias: a piece of its own

    def apply(self, piece: torch.Tensor) -> torch.Tensor:
        """[..., positions, d_model] -> the same shape, through the frozen norm (its bias left out)."""
        if self.center:
            piece = piece - piece.mean(-1, keepdim=True)
        return piece * self.factor


def freeze_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    tol: float,
    centers: tuple[bool, ...] = (True, False),
) -> FrozenNorm | None:
    """The norm that turned the run's input x [positions, d] into its output y [positions, d], frozen at the scale
    it used, or None where no (centred or not) gain-times-input-over-scale form reproduces y within tol (relative).

    The scale is read from the run itself, not recomputed: per position, the one number s with
    y - bias = (centred) x * gain / s, fitted by least squares and then checked, so an epsilon placed anywhere, or a
    norm computed in another precision, is the run's own. The gain is the weight, or 1 + weight (Gemma's norms
    store the offset from 1), or 1 where the norm has none; whichever reproduces y is the norm's. centers: the forms
    to try, in order (the caller knows a LayerNorm or an RMSNorm by its class where it can: on an input whose mean
    is nearly zero both forms reproduce y, and only the norm's own form splits the pieces as it does)."""
    x, y = x.float(), y.float()
    b = bias.float() if bias is not None else None
    target = y - b if b is not None else y
    gains = [torch.ones(x.shape[-1])] if weight is None else [weight.float(), 1.0 + weight.float()]
    for center in centers:
        c = x - x.mean(-1, keepdim=True) if center else x
        for g in gains:
            u = c * g.to(c.device)
            inv = (u * target).sum(-1, keepdim=True) / (u * u).sum(-1, keepdim=True).clamp_min(1e-30)  # 1 / scale
            fit = u * inv
            err = (fit - target).norm(dim=-1) / target.norm(dim=-1).clamp_min(1e-30)
            if bool((err <= tol).all()) and bool((inv > 0).all()):
                return FrozenNorm(center, g.to(c.device) * inv, b)
    return None


def unembed_direction(weight: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """[d_model]: the unembedding's row for one target, or the difference of two rows for a pair."""
    w = weight.float()
    return w[targets[0]] - w[targets[1]] if len(targets) == 2 else w[targets[0]]


def unembed_bias(bias: torch.Tensor | None, targets: list[int]) -> float | None:
    """The unembedding bias's share of the target logit (difference), or None where the head has no bias."""
    if bias is None:
        return None
    b = bias.float()
    return float(b[targets[0]] - b[targets[1]]) if len(targets) == 2 else float(b[targets[0]])
