"""Projection arithmetic: per-token scores of an activation against a probe matrix or an SAE encoder.

Pure tensor math shared by every backend (the eager hooks and the vLLM worker both call ``scores``), so a
probe or an encoder means the same numbers everywhere. Argument checks (what a user may pass) live in
ie_lab/core/projection_args.py, which builds the ``Encoder`` this module applies.

For a row x of width d (computed in float32, whatever the model's dtype):

| activation | scores |
| --- | --- |
| none | z = (x - b_dec) @ W + b   (a probe: W is directions.T, b its bias) |
| relu | max(z, 0) |
| jumprelu | z where z > threshold (per feature), else 0 |
| topk | max(z, 0) at each row's k largest z, 0 elsewhere |

b_dec (subtracted before encoding) and b are optional. These are the parameter names of SAELens' saved
encoders (W_enc [d, k], b_enc [k], b_dec [d], threshold [k]); a probe matrix [k, d] is W_enc transposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ACTIVATIONS = ("none", "relu", "jumprelu", "topk")


@dataclass
class Encoder:
    """A checked encoder: W [d, k] float32, optional b [k], b_dec [d], threshold [k] (jumprelu), topk (topk)."""

    W: torch.Tensor
    b: torch.Tensor | None = None
    b_dec: torch.Tensor | None = None
    activation: str = "none"
    threshold: torch.Tensor | None = None
    topk: int | None = None
    _on: dict = field(default_factory=dict, repr=False, compare=False)  # device -> tensors moved there once

    @property
    def d(self) -> int:
        return int(self.W.shape[0])

    @property
    def k(self) -> int:
        return int(self.W.shape[1])

    def tensors_on(self, device: torch.device) -> tuple:
        key = str(device)
        if key not in self._on:  # moved once per device: a GPU worker applies it on every forward
            self._on[key] = tuple(
                None if t is None else t.to(device) for t in (self.W, self.b, self.b_dec, self.threshold)
            )
        return self._on[key]


def scores(x: torch.Tensor, enc: Encoder) -> torch.Tensor:
    """[..., d] activations -> [..., k] float32 scores (see the module docstring for the formula)."""
    W, b, b_dec, thr = enc.tensors_on(x.device)
    lead = x.shape[:-1]
    h = x.reshape(-1, x.shape[-1]).float()  # one [rows, d] @ [d, k] whatever the leading shape
    if b_dec is not None:
        h = h - b_dec
    z = h @ W
    if b is not None:
        z = z + b
    act = enc.activation
    if act == "relu":
        z = torch.relu(z)
    elif act == "jumprelu":
        z = torch.where(z > thr, z, torch.zeros_like(z))
    elif act == "topk":
        if enc.topk is None:  # make_encoder refuses this earlier; an Encoder built by hand gets told here
            raise ValueError("a topk encoder needs its k (Encoder.topk)")
        vals, idx = z.topk(int(enc.topk), dim=-1)
        z = torch.zeros_like(z).scatter(-1, idx, torch.relu(vals))
    elif act != "none":
        raise ValueError(f"unknown activation {act!r}; one of {ACTIVATIONS}")
    return z.reshape(*lead, z.shape[-1])


def to_plain(enc: Encoder, pack) -> dict:
    """The encoder as plain data (tensors through ``pack``) for the trip to a vLLM worker."""
    p = lambda t: None if t is None else pack(t)  # noqa: E731
    return {
        "W": p(enc.W),
        "b": p(enc.b),
        "b_dec": p(enc.b_dec),
        "activation": enc.activation,
        "threshold": p(enc.threshold),
        "topk": enc.topk,
    }


def from_plain(d: dict, unpack) -> Encoder:
    u = lambda t: None if t is None else unpack(t).float()  # noqa: E731
    return Encoder(
        unpack(d["W"]).float(),
        u(d.get("b")),
        u(d.get("b_dec")),
        d.get("activation", "none"),
        u(d.get("threshold")),
        d.get("topk"),
    )
