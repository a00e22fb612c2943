"""SAE splicing arithmetic on [..., d] rows, shared by the eager hooks and the vLLM worker (which runs it in its own
process): the point's value replaced by the SAE's reconstruction from edited features, or, keeping the error term,
moved by exactly the decoder-direction change of the edits.

| error term | new value |
| --- | --- |
| dropped | f' @ W_dec + b_dec |
| kept | x + (f' - f) @ W_dec   (x itself where nothing is edited) |

f = encode(x) (ops/projection.py's scores) for an SAE; for a transcoder, x is its output point's value (the MLP's
output) and f the encoding of its input point (the MLP's input), so the same arithmetic writes where it does not
read. f' is f with the features at ``idx`` set to ``vals``; with ``where`` (bool [..., len(idx)]) only where it is
True, edit by edit in order (a feature may then be set at some positions and not others, or twice).
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
    where: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new value in float32 [..., d], the edited features f' [..., n]) for rows x [..., d] with features f."""
    x = x.float()
    edited = f
    if idx.numel() and where is None:
        edited = f.clone()
        edited[..., idx.to(f.device)] = vals.to(f.device, f.dtype)
    elif idx.numel():
        assert where is not None  # the branch above took where is None
        edited = f.clone()
        for j, i in enumerate(idx.tolist()):
            v = vals[j].to(f.device, f.dtype)
            edited[..., i] = torch.where(where[..., j].to(f.device), v, edited[..., i])
    W = W_dec.to(x.device, torch.float32)
    if keep_error:
        # x - decode(f) + decode(f'): the plain value where nothing is edited, exactly the edits' change elsewhere
        return (x + (edited - f) @ W if idx.numel() else x), edited
    out = edited @ W
    if b_dec is not None:
        out = out + b_dec.to(x.device, torch.float32)
    return out, edited
