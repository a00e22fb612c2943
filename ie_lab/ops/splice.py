"""SAE splicing arithmetic on [..., d] rows, shared by the eager hooks and the vLLM worker (which runs it in its own
process): the point's value replaced by the SAE's reconstruction from edited features, or, keeping the error term,
moved by exactly the decoder-direction change of the edits.

| error term | new value |
| --- | --- |
| dropped | f' @ W_dec + b_dec |
| kept | x + (f' - f) @ W_dec   (x itself where nothing is edited) |

f = encode(x) (ops/projection.py's scores); f' is f with the features at ``idx`` set to ``vals``.
"""

from __future__ import annotations

import torch


def splice(
    x: torch.Tensor,
    f: torch.Tensor,
    W_dec: torch.Tensor,
    b_dec: torch.Tensor | None,
    idx: torch.Tensor,
    vals: torch.Tensor,
    keep_error: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new value in float32 [..., d], the edited features f' [..., n]) for rows x [..., d] with features f."""
    x = x.float()
    edited = f
    if idx.numel():
        edited = f.clone()
        edited[..., idx.to(f.device)] = vals.to(f.device, f.dtype)
    W = W_dec.to(x.device, torch.float32)
    if keep_error:
        # x - decode(f) + decode(f'): the plain value where nothing is edited, exactly the edits' change elsewhere
        return (x + (edited - f) @ W if idx.numel() else x), edited
    out = edited @ W
    if b_dec is not None:
        out = out + b_dec.to(x.device, torch.float32)
    return out, edited
