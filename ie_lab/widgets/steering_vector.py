"""Where the steering panel's vector comes from: a tensor, a saved .pt / .npy file, a capture, or a difference of
means, and the short description the panel shows for each."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..address import Address
from ..core.files import checked_file
from ..errors import InputError, plural


def load_vector(vector: Any, address: Address) -> tuple[torch.Tensor, str]:
    """A 1-D float vector and a short description of where it came from."""
    from ..cache import Cache

    if isinstance(vector, (str, os.PathLike)):
        path = checked_file(vector, "vector=", "vector")
        if path.endswith(".npy"):
            import numpy as np

            t = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            t = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(t, dict) and len(t) == 1:
                t = next(iter(t.values()))
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{path} holds a {type(t).__name__}, not a tensor.")
        src = f"saved tensor {os.path.basename(path)}"
    elif isinstance(vector, Cache):
        key = str(address) if str(address) in vector else (next(iter(vector)) if len(vector) == 1 else None)
        if key is None:
            raise InputError(f"the cache holds {', '.join(map(str, vector))}; none is {address}.")
        t = vector[key]
        src = f"capture of {key}"
    else:
        t = torch.as_tensor(vector)
        src = "given tensor"
    t = t.detach().float().cpu()
    if t.dim() > 1:
        src += f" (mean over {plural(t.shape[:-1].numel(), 'position')})"
        t = t.reshape(-1, t.shape[-1]).mean(0)
    return t, src


def mean_difference_source(address: Any, pos: list, neg: list) -> str:
    """How a difference-of-means vector was made, as the panel shows it ("6 vs 6 prompts", "1 vs 1 prompt")."""
    noun = "prompt" if max(len(pos), len(neg)) == 1 else "prompts"
    return f"difference of means at {address} ({len(pos)} vs {len(neg)} {noun})"
