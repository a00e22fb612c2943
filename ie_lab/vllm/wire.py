"""The wire format between the vLLM client (the session) and its worker extension: plain data only.

Tensors cross vLLM's process boundary as {dtype, shape, bytes} dicts (vLLM's msgspec IPC, no pickling), and rows
filed per forward come back with their absolute positions, to be put in order by the receiver. Both sides import
this module for these types alone, so it registers nothing with vLLM and imports no loader or worker: importing it
has no side effect.
"""

from __future__ import annotations

import torch

# Points no hook reads on vLLM: the worker rebuilds them from the captured post-RoPE q and k.
RECOMPUTED = ("attn_scores", "attn_probs")

# Steering entries that splice a dictionary in (an SAE at its point; a transcoder read at mlp_in and written at
# mlp_out, its two entries paired by their 'tc' key): they run in the worker's hooks, never in graph mode's trunk.
SPLICE_METHODS = ("splice", "transcoder_in", "transcoder")


def pack(t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).replace("torch.", "")
    if t.dtype == torch.bfloat16:
        t = t.float()
        dtype = "float32"
    return {"dtype": dtype, "shape": list(t.shape), "data": t.numpy().tobytes()}


def unpack(d: dict) -> torch.Tensor:
    import numpy as np

    arr = np.frombuffer(d["data"], dtype=getattr(np, d["dtype"])).reshape(d["shape"])
    return torch.from_numpy(arr.copy())


def dedupe_order(pos: torch.Tensor) -> torch.Tensor:
    """Indices that sort by position, keeping the last occurrence of a repeated position (recomputes)."""
    order = torch.argsort(pos, stable=True)
    p = pos[order]
    keep = torch.ones_like(p, dtype=torch.bool)
    if p.numel() > 1:
        keep[:-1] = p[1:] != p[:-1]
    return order[keep]


def by_position(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rows) filed in pieces, as one tensor each in position order, a repeated position once."""
    pos = torch.cat([p for p, _ in parts])
    t = torch.cat([x for _, x in parts])
    order = dedupe_order(pos)
    return pos[order], t[order]
