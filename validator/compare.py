"""Bring an engine's tensor into ie_lab's layout and measure how far apart the two are."""

from __future__ import annotations

import math

import torch

MASKED = -1e30  # attention scores at or below this are masked (TransformerBridge fills finfo.min, ie_lab -inf)


def align(ref: torch.Tensor, got: torch.Tensor, attention: bool) -> tuple[torch.Tensor | None, str]:
    """``got`` in ``ref``'s layout, chosen from shapes only (never from values), and a note on what was done.

    Shapes seen: [b, s, w] (ie_lab); [b, s, heads, d] (TransformerLens per-head hooks); [b, heads, s, d]
    (per-head QK-norms); [b*s, w] (routers and TransformerBridge's MoE gate). Prompts are chosen with a
    length that equals no head count, so the last two are never confused.
    """
    if tuple(got.shape) == tuple(ref.shape):
        return got, ""
    if got.numel() != ref.numel():
        if got.dim() == ref.dim() + 1 and got.shape[0] == 1 and tuple(got.shape[1:]) == tuple(ref.shape):
            return got[0], "dropped a leading axis of 1"
        return None, f"shape {list(got.shape)} cannot hold ie_lab's {list(ref.shape)}"
    if attention:
        return None, f"attention shape {list(got.shape)} differs from ie_lab's {list(ref.shape)}"
    b, s = ref.shape[0], ref.shape[1]
    if got.dim() == 4 and got.shape[0] == b and got.shape[1] == s:
        return got.reshape(ref.shape), "per-head [b, s, h, d] flattened"
    if got.dim() == 4 and got.shape[0] == b and got.shape[2] == s:
        return got.transpose(1, 2).reshape(ref.shape), "per-head [b, h, s, d] transposed and flattened"
    if got.dim() == 2 and got.shape[0] == b * s:
        return got.reshape(ref.shape), "token-flattened [b*s, w] unflattened"
    return None, f"shape {list(got.shape)} has no known mapping onto ie_lab's {list(ref.shape)}"


def metrics(ref: torch.Tensor, got: torch.Tensor, attention: bool) -> tuple[dict | None, str]:
    """cosine, worst-token cosine, max abs and relative error of ``got`` against ie_lab's ``ref``."""
    got, note = align(ref.float(), got.float(), attention)
    if got is None:
        return None, note
    ref = ref.float()
    if attention:
        ref_m = ~torch.isfinite(ref) | (ref <= MASKED)
        got_m = ~torch.isfinite(got) | (got <= MASKED)
        differ = int((ref_m != got_m).sum())
        if differ:
            return None, f"the attention masks differ at {differ} entries"
        ref = ref.masked_fill(ref_m, 0.0)
        got = got.masked_fill(got_m, 0.0)
    elif not (torch.isfinite(ref).all() and torch.isfinite(got).all()):
        return None, "non-finite values"
    width = ref.shape[-1]
    r, g = ref.reshape(-1, width).double(), got.reshape(-1, width).double()
    diff = g - r
    ref_norm = float(r.norm())
    rn, gn = r.norm(dim=-1), g.norm(dim=-1)
    tiny = 1e-12
    row_cos = (r * g).sum(-1) / (rn * gn).clamp_min(tiny)
    both_zero = (rn < tiny) & (gn < tiny)
    row_cos = torch.where(both_zero, torch.ones_like(row_cos), row_cos)
    whole = (
        float((r * g).sum() / max(ref_norm * float(g.norm()), tiny))
        if (ref_norm > tiny or float(g.norm()) > tiny)
        else 1.0
    )
    out = {
        "cosine": whole,
        "worst_token_cosine": float(row_cos.min()),
        "max_abs": float(diff.abs().max()),
        "rel_err": float(diff.norm()) / ref_norm
        if ref_norm > tiny
        else (0.0 if float(diff.norm()) < tiny else math.inf),
        "ref_norm": ref_norm,
        "norm_ratio": float(g.norm()) / ref_norm if ref_norm > tiny else 1.0,
    }
    return out, note


def rounded(m: dict) -> dict:
    """Metrics to 6 significant digits, so committed JSON does not churn on float noise."""

    def r(x: float) -> float:
        if x == 0 or not math.isfinite(x):
            return x
        return float(f"{x:.6g}")

    return {k: r(v) for k, v in m.items()}
