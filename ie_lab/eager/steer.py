"""Steering on the eager backend: specs, position masks, and the context that installs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

import torch

from ..address import Address, AddressLike
from ..errors import AddressError, InputError
from ..ops import steering as ops
from .writers import Writers

Positions = Union[str, Sequence[int], torch.Tensor]
POSITION_KINDS = ("all", "prompt", "generated", "special")


@dataclass
class ForwardState:
    """What the forward in flight is: which ids, how many positions came before, where the prompt ends."""

    ids: torch.Tensor | None = None
    offset: int = 0
    prompt_len: int | None = None  # None: every position is prompt (a plain forward)


@dataclass
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
    _ctx: Any = field(default=None, repr=False)

    def method_kwargs(self) -> dict[str, Any]:
        """The arguments this spec passes to its ops.steering function (shared by every backend)."""
        return {"add": {"scale": self.scale, "normalize": self.normalize}, "orthogonal": {"scale": self.scale},
                "norm_scaled_add": {"scale": self.scale}, "cap": {"min": self.min, "max": self.max},
                "swap": {"target": self.target}, "ablate": {}}[self.method]

    def edit(self, state: ForwardState, special_ids: frozenset[int]):
        fn = ops.FUNCTIONS[self.method]
        kwargs = self.method_kwargs()

        def apply(h: torch.Tensor, offset: int) -> torch.Tensor:
            mask = position_mask(self.positions, h.shape[:2], offset, state, special_ids, h.device)
            return fn(h, self.vector, mask=mask, **kwargs)
        return apply

    def __enter__(self) -> "SteerSpec":
        self._ctx = steering(self.lm, [self])
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)

    def __repr__(self) -> str:
        extra = {"add": f"scale={self.scale}" + (", normalize" if self.normalize else ""),
                 "orthogonal": f"scale={self.scale}", "norm_scaled_add": f"scale={self.scale}",
                 "cap": f"min={self.min}, max={self.max}", "swap": f"target={self.target}", "ablate": ""}[self.method]
        where = ", ".join(str(a) for a in self.addresses)
        pos = self.positions if isinstance(self.positions, str) else "custom"
        return f"SteerSpec({self.method} at {where}; {extra}; positions={pos}; |v|={float(self.vector.float().norm()):.3g})"


def position_mask(positions: Positions, shape: tuple[int, ...], offset: int, state: ForwardState,
                  special_ids: frozenset[int], device: torch.device) -> torch.Tensor | None:
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
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        full = positions.to(device).reshape(-1)
        if offset + s > full.shape[0]:
            pad = torch.zeros(offset + s - full.shape[0], dtype=torch.bool, device=device)
            full = torch.cat([full, pad])
        return full[offset:offset + s][None].expand(b, s)
    idx = torch.as_tensor(list(positions) if not isinstance(positions, torch.Tensor) else positions, device=device)
    return torch.isin(absolute, idx)[None].expand(b, s)


def make_spec(lm: Any, address: AddressLike | Iterable[AddressLike], vector: torch.Tensor, *, method: str = "add",
              scale: float = 1.0, normalize: bool = False, min: float | None = None, max: float | None = None,  # noqa: A002
              target: float = 0.0, positions: Positions = "all") -> SteerSpec:
    """Validate everything before any hook exists; the spec is inert until entered or passed to a call."""
    from .. import _as_lm

    lm = _as_lm(lm)
    if method not in ops.METHODS:
        raise InputError(f"unknown steering method {method!r}; choose one of {', '.join(ops.METHODS)}.")
    addrs = [address] if isinstance(address, (str, Address)) else list(address)
    if not addrs:
        raise AddressError("no address to steer: name at least one d_model-wide point, e.g. 'resid_post.3'.")
    parsed = []
    for a in addrs:
        a = Address.parse(a).check(lm.facts)
        if not a.point.steerable or a.head is not None:
            raise AddressError(f"{a} cannot be steered: steering adds a d_model vector, so it applies to "
                               "per-layer d_model-wide points (resid_pre, resid_mid, resid_post, attn_out, "
                               "attn_out_post, mlp_out, mlp_out_post, attn_in, mlp_in).")
        parsed.append(a)
    if not isinstance(vector, torch.Tensor):
        vector = torch.as_tensor(vector, dtype=torch.float32)
    try:
        ops.check_vector(vector, lm.facts.d_model, needs_unit=method != "add" or normalize)
        ops.check_scalars(scale=scale, min=min, max=max, target=target)
        if method == "cap" and min is None and max is None:
            raise ValueError("cap needs min, max or both")
        if method == "cap" and min is not None and max is not None and min > max:
            raise ValueError(f"cap min ({min}) is above max ({max})")
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from None
    if isinstance(positions, str) and positions not in POSITION_KINDS:
        raise InputError(f"unknown positions {positions!r}; use one of {POSITION_KINDS}, a list of token indices, "
                         "or a boolean mask.")
    if not isinstance(positions, str):
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
            pass
        else:
            idx = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
            if any(p < 0 for p in idx):
                raise InputError(f"positions must be non-negative token indices, got {idx}.")
            positions = tuple(idx)
    vector = vector.detach().to(device=lm.device, dtype=torch.float32)
    return SteerSpec(lm, tuple(parsed), vector, method, float(scale), normalize, min, max, float(target), positions)


def check_positions_fit(specs: Sequence[SteerSpec], total_len: int) -> None:
    for sp in specs:
        if isinstance(sp.positions, tuple) and sp.positions and max(sp.positions) >= total_len:
            raise InputError(f"steering positions {list(sp.positions)} reach past the {total_len} tokens this call "
                             "will run; positions count from 0 over prompt + generated tokens.")


class steering:  # noqa: N801 - used like a function: `with steering(lm, specs):`
    """Install steering specs for the duration of a ``with`` block; every hook is removed on exit."""

    def __init__(self, lm: Any, specs: Sequence[SteerSpec], state: ForwardState | None = None):
        from .. import _as_lm

        self.lm = _as_lm(lm)
        self.specs = list(specs)
        self.state = state or ForwardState()
        tok = self.lm.tokenizer
        self.special = frozenset(getattr(tok, "all_special_ids", []) or [])
        edits = [(a, sp.edit(self.state, self.special)) for sp in self.specs for a in sp.addresses]
        self.writers = Writers(self.lm, edits)
        self._ids_hook = None

    def __enter__(self) -> "steering":
        # The lock is held only while hooks go in and come out, never across the user's block: a Session
        # runs operations on its own thread, which must be able to take the lock inside the block.
        with self.lm.lock:
            self._install()
        return self

    def _install(self) -> None:
        try:
            self.writers.__enter__()

            def record_ids(mod, args):
                if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
                    self.state.ids = args[0]
                    self.writers.shape = tuple(args[0].shape[:2])
            self._ids_hook = self.lm.binding.embed.register_forward_pre_hook(record_ids)
            # Generation loops find the active contexts here to tell them where the prompt ends.
            self.lm.__dict__.setdefault("_steering_active", []).append(self)
        except BaseException:
            self.writers.close()
            raise

    def __exit__(self, *exc) -> None:
        with self.lm.lock:
            active = self.lm.__dict__.get("_steering_active", [])
            if self in active:
                active.remove(self)
            if self._ids_hook is not None:
                self._ids_hook.remove()
                self._ids_hook = None
            self.writers.close()
