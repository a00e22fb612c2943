"""Steering arithmetic: one function per method, on [..., d_model] tensors.

Pure tensor math shared by every backend (the eager hooks and the vLLM worker call these), so
that a steering method means the same thing everywhere. Argument checks (what a user may pass) live with
the specs in ie_lab/core/steer_spec.py. ``v`` is the steering direction; ``u`` is its
unit vector. Every function leaves positions where ``mask`` is False untouched.

| method | formula |
| --- | --- |
| add | h + scale · v  (v replaced by u when normalize) |
| orthogonal | h - (1 - scale) · (h·u) u  (scale 1 is a no-op, 0 removes the component) |
| cap | h + (clamp(h·u, min, max) - h·u) u |
| norm_scaled_add | h + scale · ‖h‖ · u  (each token moved in proportion to its own norm) |
| ablate | h - (h·u) u |
| swap | h + (target - h·u) u  (sets the projection to target) |

Each method is its direction (``direction``: add's v or u, every other method's u, with the checks) and its row
formula (``ROWS``), which takes that direction and numbers that are floats or per-row tensors [n, 1]: graph mode
(ie_lab/vllm/static_steer.py) calls the row formulas inside the compiled trunk with a vector per token row, so a
compiled step and an eager hook share one definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

METHODS = ("add", "orthogonal", "cap", "norm_scaled_add", "ablate", "swap")

# What each method does, in a sentence a newcomer can act on, and its knobs: the steering panel shows these (a
# help line and each option's tooltip) and docs/STEERING.md's table agrees with them (tests/test_steering.py), so
# the explanation is written once, here.
METHOD_HELP: dict[str, str] = {
    "add": "add: h + scale·v. Pushes every token along the vector; scale sets how far (negative: the other way).",
    "orthogonal": "orthogonal: h − (1 − scale)·(h·u)·u. Rescales the part of h along the direction: 1 leaves it, "
    "0 removes it, 2 doubles it.",
    "cap": "cap: h + (clamp(h·u, min, max) − h·u)·u. Clamps how far each token lies along the direction into "
    "[min, max]; tokens already inside are untouched, so it only reins in the extremes.",
    "norm_scaled_add": "norm_scaled_add: h + scale·‖h‖·u. Adds the direction in proportion to each token's own "
    "size, so large and small activations move by the same fraction.",
    "ablate": "ablate: h − (h·u)·u. Removes the direction entirely (its projection set to 0); no knob.",
    "swap": "swap: h + (target − h·u)·u. Sets every token's projection on the direction to target, whatever it was.",
}
assert tuple(METHOD_HELP) == METHODS


def _unit(v: torch.Tensor) -> torch.Tensor:
    n = v.float().norm()
    if not torch.isfinite(n) or float(n) == 0.0:
        raise ValueError("the steering direction has zero (or non-finite) norm, so it has no unit vector")
    return v.float() / n


def _blend(h: torch.Tensor, new: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    new = new.to(h.dtype)
    if mask is None:
        return new
    return torch.where(mask[..., None], new, h)


def _proj(h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if u.dim() == 1:
        return (h.float() @ u.to(h.device))[..., None]
    return (h.float() * u).sum(-1, keepdim=True)  # one unit vector per row (graph mode)


def direction(method: str, v: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """The vector a method's row formula takes: add's v (its unit vector when normalize), every other method's u."""
    return v.float() if method == "add" and not normalize else _unit(v)


def add_rows(h, d, scale):
    return h.float() + scale * d


def orthogonal_rows(h, u, scale):
    return h.float() - (1.0 - scale) * _proj(h, u) * u


def cap_rows(h, u, min, max):  # noqa: A002 - user-facing names
    p = _proj(h, u)
    return h.float() + (p.clamp(min=min, max=max) - p) * u


def norm_scaled_add_rows(h, u, scale):
    return h.float() + scale * h.float().norm(dim=-1, keepdim=True) * u


def ablate_rows(h, u):
    return h.float() - _proj(h, u) * u


def swap_rows(h, u, target):
    return h.float() + (target - _proj(h, u)) * u


def add(h, v, *, scale: float = 1.0, normalize: bool = False, mask=None):
    return _blend(h, add_rows(h, direction("add", v, normalize=normalize).to(h.device), scale), mask)


def orthogonal(h, v, *, scale: float = 0.0, mask=None):
    return _blend(h, orthogonal_rows(h, _unit(v).to(h.device), scale), mask)


def cap(h, v, *, min: float | None = None, max: float | None = None, mask=None):  # noqa: A002 - user-facing names
    if min is None and max is None:
        raise ValueError("cap needs min, max or both")
    if min is not None and max is not None and min > max:
        raise ValueError(f"cap min ({min}) is above max ({max})")
    return _blend(h, cap_rows(h, _unit(v).to(h.device), min, max), mask)


def norm_scaled_add(h, v, *, scale: float = 1.0, mask=None):
    return _blend(h, norm_scaled_add_rows(h, _unit(v).to(h.device), scale), mask)


def ablate(h, v, *, mask=None):
    return _blend(h, ablate_rows(h, _unit(v).to(h.device)), mask)


def swap(h, v, *, target: float = 0.0, mask=None):
    return _blend(h, swap_rows(h, _unit(v).to(h.device), target), mask)


FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "add": add,
    "orthogonal": orthogonal,
    "cap": cap,
    "norm_scaled_add": norm_scaled_add,
    "ablate": ablate,
    "swap": swap,
}

# The row formulas by method: (h, direction, *numbers) with the numbers in each method's keyword order.
ROWS: dict[str, Callable[..., torch.Tensor]] = {
    "add": add_rows,
    "orthogonal": orthogonal_rows,
    "cap": cap_rows,
    "norm_scaled_add": norm_scaled_add_rows,
    "ablate": ablate_rows,
    "swap": swap_rows,
}


def check_vector(v: torch.Tensor, d_model: int, *, needs_unit: bool) -> None:
    """Refuse vectors that cannot mean anything, before any hook exists."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"a steering vector is a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1 or v.shape[0] != d_model:
        raise ValueError(
            f"the steering vector has shape {list(v.shape)} but this point is d_model = {d_model} wide; "
            "pass a 1-D tensor of that width (e.g. a difference of mean resid_post activations)."
        )
    if not torch.isfinite(v).all():
        raise ValueError("the steering vector contains NaN or inf; check how it was computed.")
    if needs_unit and float(v.float().norm()) == 0.0:
        raise ValueError("the steering vector is all zeros, so it has no direction to normalise or project on.")
