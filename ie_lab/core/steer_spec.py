"""Steering specs: what a user asks to steer, checked, and which positions a spec covers in a forward.

A SteerSpec is data (addresses, a checked vector, a method and its numbers, positions); ``edit`` turns it into
the function a hook applies (ops/steering.py under a position mask). ``with spec:`` opens a scope
(steer_scope.py); ``issued_specs`` reads, where an operation is issued, the specs it carries.

Neutral: the checks read only the grammar and the model's facts, the masks are tensor math, and the vLLM
backend sends these very specs to its worker, so both backends accept and refuse the same specs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..address import Address, AddressLike
from ..errors import AddressError, InputError, plural, shown_value
from ..ops import steering as ops
from .handles import as_lm
from .steer_scope import active_specs, enter_scope, exit_scope

Positions = str | Sequence[int] | torch.Tensor
POSITION_KINDS = ("all", "prompt", "generated", "special")


@dataclass
class ForwardState:
    """What the forward in flight is: which ids, how many positions came before, where the prompt ends."""

    ids: torch.Tensor | None = None
    offset: int = 0
    prompt_len: int | None = None  # None: every position is prompt (a plain forward)
    # A left-padded batch (batched generation): each row's pad count, so index and mask positions count over
    # that row's own tokens (offset and prompt_len are in the padded frame, where every prompt ends together).
    pad: torch.Tensor | None = None


@dataclass(eq=False)
class SteerSpec:
    """One steering intervention. Use as a context manager, or pass to generate(..., steer=...)."""

    lm: Any
    addresses: tuple[Address, ...]
    vector: torch.Tensor
    method: str = "add"
    scale: float = 1.0
    normalize: bool = False
    min: float | None = None
    max: float | None = None
    target: float = 0.0
    positions: Positions = "all"

    def method_kwargs(self) -> dict[str, Any]:
        """The arguments this spec passes to its ops.steering function (shared by every backend)."""
        table: dict[str, dict[str, Any]] = {
            "add": {"scale": self.scale, "normalize": self.normalize},
            "orthogonal": {"scale": self.scale},
            "norm_scaled_add": {"scale": self.scale},
            "cap": {"min": self.min, "max": self.max},
            "swap": {"target": self.target},
            "ablate": {},
        }
        return table[self.method]

    def edit(self, state: ForwardState, special_ids: frozenset[int]):
        """The function a hook applies: (h [batch, seq, d_model], absolute position of h's first row) -> steered h."""
        fn = cast(Callable[..., torch.Tensor], ops.FUNCTIONS[self.method])  # one signature per method
        kwargs = self.method_kwargs()

        def apply(h: torch.Tensor, offset: int) -> torch.Tensor:
            mask = position_mask(self.positions, h.shape[:2], offset, state, special_ids, h.device)
            return fn(h, self.vector, mask=mask, **kwargs)

        return apply

    def writes(self, state: ForwardState, special_ids: frozenset[int]) -> list[tuple[Address, Callable]]:
        """(address, edit) per point the hooks place for this spec in one forward: ``edit`` at each of its addresses.
        A spec that reads one point and writes another (a transcoder splice, core/transcoder_splice.py) returns
        its own pair, the reader first, sharing what it read."""
        return [(a, self.edit(state, special_ids)) for a in self.addresses]

    def __enter__(self) -> "SteerSpec":
        scope = enter_scope(self)
        try:
            # Operations carry the spec. A backend that runs forwards in this process also steers the raw ones the
            # block runs (lm.hf(...)) with hooks it places now, gated by the scope; the vLLM client runs none.
            place = getattr(self.lm, "steer_raw_forwards", None)
            if place is not None:
                scope.hooks = place(self, scope.applies)
        except BaseException:
            exit_scope(self)
            raise
        return self

    def __exit__(self, *exc) -> None:
        exit_scope(self)

    def __repr__(self) -> str:
        extra = {
            "add": f"scale={self.scale}" + (", normalize" if self.normalize else ""),
            "orthogonal": f"scale={self.scale}",
            "norm_scaled_add": f"scale={self.scale}",
            "cap": f"min={self.min}, max={self.max}",
            "swap": f"target={self.target}",
            "ablate": "",
        }[self.method]
        where = ", ".join(str(a) for a in self.addresses)
        pos = self.positions if isinstance(self.positions, str) else "custom"
        return f"SteerSpec({self.method} at {where}; {extra}; positions={pos}; |v|={float(self.vector.float().norm()):.3g})"


# ---- the specs an operation carries -------------------------------------------------------------------


class Issued(tuple):
    """The specs one request carries, fixed where it was issued (a later read adds nothing)."""


def issued_specs(lm: Any, steer: Any = None) -> Issued:
    """The `with` scopes open in the calling context on lm, then the per-call `steer=` specs, checked.

    Call it where the operation is issued (the Session method, the free function), in the caller's context.
    """
    if isinstance(steer, Issued):
        return steer
    per_call = as_specs(steer)
    for sp in per_call:
        if sp.lm is not lm:
            raise InputError(
                "steer=: this steering spec was made on another model; make it on this one with "
                "s.steer(...) or ie_lab.steer(lm, ...)."
            )
    out: list[SteerSpec] = []
    for sp in active_specs(lm) + per_call:
        if not any(s is sp for s in out):  # one spec applies once per request, however it arrived
            out.append(sp)
    return Issued(out)


def as_specs(steer: Any) -> list[SteerSpec]:
    """steer= as a list of specs; anything else is refused naming how to make one."""
    if steer is None:
        return []
    items = list(steer) if isinstance(steer, (list, tuple)) else [steer]
    for it in items:
        if not isinstance(it, SteerSpec):
            got = repr(it) if isinstance(it, str) else type(it).__name__
            raise InputError(
                f"steer= takes a steering spec or a list of them, got {got}; make one with "
                "s.steer(address, vector, ...) (or ie_lab.steer(lm, address, vector, ...)) and pass "
                "it as steer=spec."
            )
    return items


# ---- checks -------------------------------------------------------------------------------------------


def _number(name: str, x: Any) -> float:
    """A finite real number: Python, numpy scalar or 0-d tensor; bools, complex and NaN/inf refused."""
    fix = f"pass {name} as a finite real number, e.g. {name}=2.0."
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or x.is_complex() or x.dtype == torch.bool:
            raise InputError(
                f"{name} must be a real number or a 0-d real tensor, got a tensor of shape "
                f"{list(x.shape)} and dtype {x.dtype}; {fix}"
            )
        x = x.item()
    elif not isinstance(x, (int, float)) and hasattr(x, "item") and getattr(x, "shape", None) == ():
        x = x.item()  # numpy scalars and 0-d arrays
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise InputError(f"{name} must be a real number, got {shown_value(x)} ({type(x).__name__}); {fix}")
    try:
        x = float(x)
    except OverflowError:  # an integer past float's range
        raise InputError(f"{name} must be finite, got {shown_value(x)}; {fix}") from None
    if not math.isfinite(x):
        raise InputError(f"{name} must be finite, got {x}; {fix}")
    return x


def _vector(vector: Any) -> torch.Tensor:
    if not isinstance(vector, torch.Tensor):
        try:
            vector = torch.as_tensor(vector)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(
                f"vector must be a 1-D tensor of d_model numbers, got {type(vector).__name__} ({e})."
            ) from None
    if vector.is_complex():
        raise InputError(
            "vector is complex; steering adds a real direction, and dropping the imaginary part would "
            "change it silently: pass vector.real (or the direction you meant) as a real tensor."
        )
    if vector.dtype == torch.bool:
        raise InputError(
            "vector is a bool tensor; a steering direction is a real tensor (e.g. mask.float() if "
            "that is really the direction you mean)."
        )
    return vector


def _positions(positions: Any) -> Positions:
    """'all' / 'prompt' / 'generated' / 'special', a bool mask, or distinct non-negative integer indices."""
    hint = (
        "pass a bool tensor for a mask (torch.tensor([True, False, False, True])) or the token indices to "
        "steer ([0, 3])."
    )
    if isinstance(positions, str):
        if positions not in POSITION_KINDS:
            raise InputError(
                f"unknown positions {positions!r}; use one of {POSITION_KINDS}, a list of token "
                "indices, or a boolean mask."
            )
        return positions
    if not isinstance(positions, torch.Tensor):
        items = positions.tolist() if hasattr(positions, "tolist") else positions  # numpy arrays and scalars
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise InputError(
                f"positions={shown_value(positions)} is not a list; pass a list of token indices, e.g. "
                f"positions=[3], or one of {POSITION_KINDS}."
            )
        items = list(items)
        n_bool = sum(isinstance(p, bool) for p in items)
        if items and n_bool == len(items):
            return torch.tensor(items, dtype=torch.bool)
        if n_bool:
            raise InputError(
                f"positions {shown_value(items)} are not token indices: they mix True/False with numbers; {hint}"
            )
        try:
            positions = torch.as_tensor(items) if items else torch.zeros(0, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError, OverflowError):  # OverflowError: an integer past int64
            raise InputError(f"positions {shown_value(items)} are not token indices; {hint}") from None
    t = positions.detach().cpu()
    if t.dim() == 0:
        raise InputError(
            f"positions is a 0-d tensor ({shown_value(t)}); pass a list of token indices, e.g. positions=[3], "
            f"a 1-D mask, or one of {POSITION_KINDS}."
        )
    if t.dtype == torch.bool:
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise InputError(
                f"a positions mask is 1-D over prompt + generated tokens, got shape {list(t.shape)}; "
                "pass mask[0] for one row (every row of a batch is steered at the same positions)."
            )
        return t
    if t.dtype == torch.uint8:
        raise InputError(f"positions is a uint8 tensor, which reads both as a 0/1 mask and as indices; {hint}")
    if t.is_floating_point() or t.is_complex():
        raise InputError(
            f"positions {t.tolist()} are not integers, and rounding them would steer other tokens than meant; {hint}"
        )
    if t.dim() > 1:
        raise InputError(f"positions indices are a flat list, got shape {list(t.shape)}; {hint}")
    idx = [int(p) for p in t.tolist()]
    if any(p < 0 for p in idx):
        raise InputError(f"positions must be non-negative token indices, got {idx}.")
    if len(set(idx)) != len(idx):
        # [1, 0, 0, 1] is a 0/1 mask written as integers far more often than a list of indices with repeats.
        raise InputError(
            f"positions {idx} repeat an index, so they read as a 0/1 mask written as integers; "
            f"integer positions are always token indices: {hint}"
        )
    return tuple(idx)


def position_mask(
    positions: Positions,
    shape: tuple[int, ...],
    offset: int,
    state: ForwardState,
    special_ids: frozenset[int],
    device: torch.device,
) -> torch.Tensor | None:
    b, s = shape[0], shape[1]
    absolute = torch.arange(offset, offset + s, device=device)
    if isinstance(positions, str):
        if positions == "all":
            return None
        if positions == "prompt":
            end = state.prompt_len if state.prompt_len is not None else offset + s
            return (absolute < end)[None].expand(b, s)
        if positions == "generated":
            end = state.prompt_len if state.prompt_len is not None else offset + s
            return (absolute >= end)[None].expand(b, s)
        if positions == "special":
            if state.ids is None or state.ids.shape[-1] != s:
                return torch.zeros(b, s, dtype=torch.bool, device=device)
            ids = state.ids.to(device)
            return torch.isin(ids, torch.tensor(sorted(special_ids), device=device, dtype=ids.dtype))
    if state.pad is not None and not isinstance(positions, str):
        own = absolute[None] - state.pad.to(device)[:, None]  # [b, s]: each row's own positions (pads < 0)
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
            full = positions.to(device).reshape(-1)
            if full.numel() == 0:
                return torch.zeros(b, s, dtype=torch.bool, device=device)
            return (own >= 0) & (own < full.shape[0]) & full[own.clamp(0, max(full.shape[0] - 1, 0))]
        return torch.isin(own, torch.as_tensor(list(positions), dtype=torch.long, device=device))
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        full = positions.to(device).reshape(-1)
        if offset + s > full.shape[0]:
            pad = torch.zeros(offset + s - full.shape[0], dtype=torch.bool, device=device)
            full = torch.cat([full, pad])
        return full[offset : offset + s][None].expand(b, s)
    idx = torch.as_tensor(list(positions), dtype=torch.long, device=device)
    return torch.isin(absolute, idx)[None].expand(b, s)


def make_spec(
    lm: Any,
    address: AddressLike | Iterable[AddressLike],
    vector: Any,
    *,
    method: str = "add",
    scale: Any = 1.0,
    normalize: bool = False,
    min: Any = None,
    max: Any = None,  # noqa: A002
    target: Any = 0.0,
    positions: Any = "all",
) -> SteerSpec:
    """Validate everything before any hook exists; the spec is inert until entered or passed to a call.

    lm is a backend model or a Session; the eager backend's make_spec (ie_lab/eager/steer.py) also binds a raw
    transformers model first."""
    lm = as_lm(lm)
    if not isinstance(method, str) or method not in ops.METHODS:
        raise InputError(f"unknown steering method {method!r}; choose one of {', '.join(ops.METHODS)}.")
    if isinstance(address, (str, Address)):
        addrs = [address]
    elif isinstance(address, (list, tuple)):
        addrs = list(address)
    else:
        raise AddressError(
            f"address must be an address such as 'resid_post.3' or a list of them, got "
            f"{type(address).__name__} {address!r}."
        )
    if not addrs:
        raise AddressError("no address to steer: name at least one d_model-wide point, e.g. 'resid_post.3'.")
    parsed = []
    for a in addrs:
        a = Address.parse(a).check(lm.facts)
        if not a.point.steerable or a.head is not None:
            from ..points import all_points  # the registry says which points are d_model-wide per layer

            names = ", ".join(p.name for p in all_points() if p.steerable and not p.multi_stream_only)
            raise AddressError(
                f"{a} cannot be steered: steering adds a d_model vector, so it applies to "
                f"per-layer d_model-wide points ({names})."
            )
        parsed.append(a)
    vector = _vector(vector)
    if not isinstance(normalize, bool) and type(normalize).__name__ != "bool_":
        raise InputError(f"normalize must be True or False, got {shown_value(normalize)}.")
    scale, target = _number("scale", scale), _number("target", target)
    min = None if min is None else _number("min", min)  # noqa: A001
    max = None if max is None else _number("max", max)  # noqa: A001
    try:
        ops.check_vector(vector, lm.facts.d_model, needs_unit=method != "add" or bool(normalize))
        if method == "cap" and min is None and max is None:
            raise ValueError("cap needs min, max or both")
        if method == "cap" and min is not None and max is not None and min > max:
            raise ValueError(f"cap min ({min}) is above max ({max})")
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from None
    positions = _positions(positions)
    vector = vector.detach().to(device=lm.device, dtype=torch.float32)
    return SteerSpec(lm, tuple(parsed), vector, method, scale, bool(normalize), min, max, target, positions)


def check_positions_fit(specs: Sequence[SteerSpec], total_len: int) -> None:
    for sp in specs:
        pos = sp.positions
        if isinstance(pos, tuple) and pos and max(pos) >= total_len:
            raise InputError(
                f"steering positions {list(pos)} reach past the {plural(total_len, 'token')} this call "
                "will run; positions count from 0 over prompt + generated tokens."
            )
        if isinstance(pos, torch.Tensor) and bool(pos[total_len:].any()):
            raise InputError(
                f"the steering mask marks positions past the {plural(total_len, 'token')} this call will run "
                f"(it is {pos.shape[0]} long); positions count from 0 over prompt + generated tokens."
            )
