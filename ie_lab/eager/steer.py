"""Steering on the eager backend: the hooks that apply specs to forwards, and which forwards they act on.

The specs, their checks and position masks live in ie_lab/core/steer_spec.py, the `with spec:` scopes in
ie_lab/core/steer_scope.py (docs/STEERING.md, "Scope"). Here:

- An operation installs hooks for its specs and marks the forwards it runs (``running``); its hooks act
  only on forwards marked for it, so a forward that another thread runs meanwhile is never touched.
- Raw ``lm.hf(...)`` forwards inside a ``with`` block are steered too: the block installs hooks
  (EagerModel.steer_raw_forwards) that act only on unmarked forwards run in a context where that very scope
  is open.

The hooks themselves are in steer_hooks.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..address import AddressLike
from ..core.steer_scope import CURRENT_OP, Op
from ..core.steer_spec import SteerSpec
from ..core.steer_spec import make_spec as _make_spec
from .model import lm_of
from .steer_hooks import steering


@contextlib.contextmanager
def running(
    ctx: "steering | None", specs: Sequence[Any] = (), *, offset: int = 0, shape: tuple[int, int] | None = None
) -> Iterator[None]:
    """Mark the forwards run inside as an operation's: its own hooks (ctx) act, `with`-block hooks do not.

    Set and reset within one synchronous stretch, so it never spans a generator's yield.
    """
    if ctx is not None:
        ctx.writers.offset = ctx.state.offset = offset
        if shape is not None:
            ctx.writers.shape = shape
    token = CURRENT_OP.set(Op(tuple(ctx.specs) if ctx is not None else tuple(specs), ctx))
    try:
        yield
    finally:
        CURRENT_OP.reset(token)


def make_spec(lm: Any, address: AddressLike | Sequence[AddressLike], vector: Any, **kwargs: Any) -> SteerSpec:
    """ie_lab/core/steer_spec.py's make_spec on the model an eager operation runs on: a raw transformers model
    is bound once first (ie_lab.steer(hf_model, ...))."""
    return _make_spec(lm_of(lm), address, vector, **kwargs)


def run_issued(lm: Any, specs: Sequence[SteerSpec], fn: Callable[[], Any]) -> Any:
    """Run fn (an operation of plain forwards: capture, lens, patching, run) steered by exactly `specs`."""
    ctx = steering(lm, specs) if specs else None
    if ctx is not None:
        ctx.install()
    try:
        with running(ctx, specs):
            return fn()
    finally:
        if ctx is not None:
            ctx.remove()
