"""Each attention head's own write through the output projection: the weight slices attn_result is computed from
(eager/sites.py reads it at the projection's input) and logit_attribution splits attention by.

A head's write is its slice of z times the projection's columns for that head; summed over heads, plus the bias,
it is the projection's output. That holds only where the projection is a plain linear map of the heads'
concatenation, which projection_kind checks (or refuses, saying why) before any hook exists.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..arch.binding import LayerBinding
from ..errors import CapabilityUnsupported


def projection_kind(lm: Any, lb: LayerBinding, what: str) -> str:
    """'linear' or 'conv1d': how layer lb's output projection holds its weight. Refuses (naming `what`) a layer
    whose output projection is not a plain linear map of the heads' concatenation (z), where no per-head slice of
    its weight is what one head writes: a norm across heads before it, a projection of another kind (quantized, an
    adapter's wrapper, fused), or an input that is not n_heads equal slices."""
    fam, L, m = lm.binding.family, lb.index, lb.o_proj
    instead = f"capture z.{L} and attn_out.{L}"  # the heads' outputs, and their projection
    if lb.z_at_kernel:
        why = (
            f"layer {L}'s output projection reads the kernel's output normed across heads ({lb.names.get('o_proj')} "
            "after a sub-norm)"
            if lb.z_sub_norm is not None
            else lb.z_at_kernel_why
        )
        raise CapabilityUnsupported(
            f"{what} on {fam}", why + ", so no slice of its weight is one head's write", instead
        )
    kind = linear_kind(m)
    if kind is None:
        raise CapabilityUnsupported(
            f"{what} on {fam}",
            f"layer {L}'s output projection is a {type(m).__name__}, not a plain torch Linear or transformers "
            "Conv1D, so ie_lab will not assume a slice of its weight is what one head writes (a quantized, adapted "
            "or fused projection computes something else)",
            instead,
        )
    width = cast(torch.Tensor, m.weight).shape[1 if kind == "linear" else 0]
    H = int(lm.facts.n_heads)
    if width % H:
        raise CapabilityUnsupported(
            f"{what} on {fam}",
            f"layer {L}'s output projection reads {width} features, not n_heads ({H}) equal slices",
            instead,
        )
    return kind


def linear_kind(m: nn.Module) -> str | None:
    """'linear' (weight [out, in]), 'conv1d' (transformers' Conv1D, weight [in, out]), or None for anything else.
    A subclass of Linear counts only where its own forward, run on a probe outside the model (no hook fires), is
    x @ W.T + b (Falcon's FalconLinear is; a quantized or BitNet linear computes something else from its weight)."""
    if type(m) is nn.Linear:
        return "linear"
    if type(m).__name__ == "Conv1D" and type(m).__module__ == "transformers.pytorch_utils":
        return "conv1d"
    W = getattr(m, "weight", None)
    if not isinstance(m, nn.Linear) or not isinstance(W, torch.Tensor) or not W.is_floating_point() or W.dim() != 2:
        return None
    probe = torch.randn(2, W.shape[1], generator=torch.Generator().manual_seed(0)).to(W.device, W.dtype)
    with torch.no_grad():
        try:
            got = type(m).forward(m, probe)
        except Exception:  # noqa: BLE001 - a forward that cannot take a plain tensor is no plain linear
            return None
        want = torch.nn.functional.linear(probe, W, m.bias)
    ok = isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-3, atol=1e-3)
    return "linear" if ok else None


def heads_through(z: torch.Tensor, o_proj: nn.Module, n_heads: int, kind: str) -> torch.Tensor:
    """[..., n_heads * d_head] -> [..., n_heads, d_out]: each head's slice of z through the output projection's
    columns for that head (its bias not included: summed over heads, plus the bias, this is the projection's
    output)."""
    zh = z.reshape(*z.shape[:-1], n_heads, -1)
    W = cast(torch.Tensor, o_proj.weight)
    if kind == "linear":  # [out, heads * d_head]
        return torch.einsum("...he,dhe->...hd", zh, W.reshape(W.shape[0], n_heads, -1).to(zh.dtype))
    return torch.einsum("...he,hed->...hd", zh, W.reshape(n_heads, -1, W.shape[1]).to(zh.dtype))


def heads_bias(lb: LayerBinding) -> torch.Tensor | None:
    """What attn_out adds to the heads' sum: the output projection's bias plus any the layer adds (o_bias)."""
    parts = [b for b in (getattr(lb.o_proj, "bias", None), lb.o_bias) if isinstance(b, torch.Tensor)]
    out = None
    for p in parts:
        out = p.detach() if out is None else out + p.detach()
    return out
