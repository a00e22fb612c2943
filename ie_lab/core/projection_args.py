"""The arguments of project(): which points have per-token rows to score, and what a user may pass as probes
or an SAE encoder.

Neutral: the checks read only the grammar, the model's facts and the user's tensors, and return the Encoder
that ops/projection.py applies; the eager hooks and the vLLM worker both run that Encoder (see docs/PROJECTION.md).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..address import Address
from ..errors import AddressError, InputError
from ..ops.projection import ACTIVATIONS, Encoder
from ..points import Width, width_of
from .addresses import head_count
from .files import checked_file

SAE_KEYS = ("W_enc", "b_enc", "b_dec", "threshold")


def point_width(addr: Address, facts: Any) -> int:
    """The width of one row of addr, refusing points whose rows are not per-token vectors."""
    w = addr.point.width
    if w is Width.ATTN:
        raise AddressError(
            f"address {addr}: attention patterns are [heads, query, key] matrices, not per-token "
            "vectors; project a per-token point such as 'z.L' or 'resid_post.L'."
        )
    if w is Width.HEADS_D_MODEL and addr.head is None:
        raise AddressError(
            f"address {addr}: {addr.name} is one d_model vector per head ([batch, seq, heads, d_model]); project one "
            f"head's, e.g. '{addr}.head-0', or the heads' sum, attn_out.{addr.layer}."
        )
    if w is Width.STREAMS or addr.stream is not None:
        raise AddressError(f"address {addr}: per-stream points are not projected; use a single-stream point.")
    # the point's real width on this model: z and value are value heads wide (wider than head_dim on latent
    # attention), and one head is that width over the head count, as capture slices it
    n = int(width_of(w, facts))
    return n // head_count(addr, facts) if addr.head is not None else n


def _tensor(name: str, x: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """x as a finite float32 CPU tensor of exactly `shape`, or an InputError naming `name`."""
    if not isinstance(x, torch.Tensor):
        try:
            import numpy as np

            if isinstance(x, np.ndarray):
                x = torch.from_numpy(x)
        except ImportError:  # pragma: no cover - numpy ships with torch
            pass
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name} must be a tensor ({what}, shape {list(shape)}), got {type(x).__name__}.")
    if not x.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor ({what}), got dtype {x.dtype}.")
    if tuple(x.shape) != tuple(shape):
        raise InputError(f"{name} has shape {list(x.shape)}; expected {list(shape)} ({what}).")
    x = x.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise InputError(f"{name} has non-finite values (NaN or inf); pass finite numbers.")
    return x.contiguous()


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    if not str(path).endswith(".safetensors"):
        raise InputError(
            f"directions={path!r}: only a .safetensors file is loaded (never a pickle); pass a "
            "tensor, a dict of tensors, or a path ending in .safetensors."
        )
    from safetensors.torch import load_file

    return load_file(checked_file(path, "directions=", "tensors"), device="cpu")


def make_encoder(
    d: int, directions: Any, *, bias: Any = None, activation: str | None = None, threshold: Any = None, k: Any = None
) -> Encoder:
    """Check what a user passed and return the Encoder that ops/projection.py applies to rows of width d.

    directions: a [k, d] tensor (probes: one direction a row; bias [k] optional), or an SAE's encoder as a dict
    with SAELens' names W_enc [d, k], b_enc [k], b_dec [d] (optional) and threshold [k] (JumpReLU), or the
    path of a .safetensors file holding that dict."""
    if isinstance(directions, (str, os.PathLike)):
        directions = _load_safetensors(os.fspath(directions))
    if activation is not None and activation not in ACTIVATIONS:
        raise InputError(f"activation={activation!r} is not known; use one of {list(ACTIVATIONS)}.")
    b_dec = None
    if isinstance(directions, dict):
        unknown = sorted(set(directions) - set(SAE_KEYS))
        if unknown:
            raise InputError(
                f"directions: unknown key(s) {unknown}; an SAE encoder takes {list(SAE_KEYS)} (SAELens' names)."
            )
        if "W_enc" not in directions:
            raise InputError("directions: an SAE encoder dict needs 'W_enc' [d, k].")
        if bias is not None:
            raise InputError("bias= is for a probe matrix; an SAE dict carries its own 'b_enc'.")
        W_raw = directions["W_enc"]
        if not isinstance(W_raw, torch.Tensor) or W_raw.dim() != 2:
            raise InputError(
                f"directions['W_enc'] must be a 2-D tensor [d, k], got {getattr(W_raw, 'shape', type(W_raw).__name__)}."
            )
        n = int(W_raw.shape[1])
        W = _tensor("directions['W_enc']", W_raw, (d, n), f"d = {d} rows, the width of the point")
        b = (
            _tensor("directions['b_enc']", directions["b_enc"], (n,), "one per feature")
            if directions.get("b_enc") is not None
            else None
        )
        b_dec = (
            _tensor("directions['b_dec']", directions["b_dec"], (d,), "subtracted before encoding")
            if directions.get("b_dec") is not None
            else None
        )
        if threshold is None and directions.get("threshold") is not None:
            threshold = directions["threshold"]
        if activation is None:
            activation = "jumprelu" if threshold is not None else "relu"
    else:
        if not isinstance(directions, torch.Tensor) or directions.dim() != 2:
            raise InputError(
                f"directions must be a [k, d] tensor of probe directions, a dict with 'W_enc', or a "
                f".safetensors path; got {getattr(directions, 'shape', type(directions).__name__)}."
            )
        n = int(directions.shape[0])
        # kept a view (not made contiguous): the scores are x @ directions.T exactly, as a user writes it
        W = _tensor("directions", directions, (n, d), f"k directions of width d = {d}, the point's width").T
        b = _tensor("bias", bias, (n,), "one per direction") if bias is not None else None
        if activation is None:
            activation = "none"
    if n < 1:
        raise InputError("directions has no directions (k = 0); pass at least one.")
    thr = None
    if activation == "jumprelu":
        if threshold is None:
            raise InputError("activation='jumprelu' needs threshold= (a number, or a [k] tensor, one per feature).")
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            if not math.isfinite(threshold):
                raise InputError("threshold is not finite; pass a finite number or a [k] tensor.")
            threshold = torch.full((n,), float(threshold))
        thr = _tensor("threshold", threshold, (n,), "one per feature")
    elif threshold is not None:
        raise InputError(f"threshold= applies to activation='jumprelu' only (activation is {activation!r}).")
    topk = None
    if activation == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise InputError(f"k={k!r}: activation='topk' needs k, an int from 1 to the number of features ({n}).")
        topk = int(k)
    elif k is not None:
        raise InputError(f"k= applies to activation='topk' only (activation is {activation!r}).")
    return Encoder(W, b, b_dec, activation, thr, topk)


def one_address(lm: Any, address: Any) -> Address:
    if isinstance(address, (list, tuple)):
        raise AddressError("address: project takes one address (a string like 'resid_post.3'); call it once per point.")
    return Address.parse(address).check(lm.facts)


GEN_KEYS = frozenset({"temperature", "top_k", "top_p", "seed", "stop", "ignore_eos"})


def check_gen(max_new_tokens: Any, gen: dict) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: an int >= 0 (0 projects the prompt only).")
    unknown = sorted(set(gen) - GEN_KEYS)
    if unknown:
        raise InputError(f"unknown argument(s) {unknown}; project takes the generation arguments {sorted(GEN_KEYS)}.")
    return max_new_tokens
