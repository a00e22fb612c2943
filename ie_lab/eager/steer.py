"""Steering on the eager backend: the hooks that apply specs to forwards, and which forwards they act on.

The specs, their checks and position masks live in ie_lab/core/steer_spec.py, the `with spec:` scopes in
ie_lab/core/steer_scope.py (docs/STEERING.md, "Scope"). Here:

- An operation installs hooks for its specs and marks the forwards it runs (``running``); its hooks act
  only on forwards marked for it, so a forward that another thread runs meanwhile is never touched.
- Raw ``lm.hf(...)`` forwards inside a ``with`` block are steered too: the block installs hooks
  (EagerModel.steer_raw_forwards) that act only on unmarked forwards run in a context where that very scope
  is open.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

from ..address import AddressLike
from ..core.steer_scope import CURRENT_OP, Op
from ..core.steer_scope import active_specs, enter_scope, exit_scope  # noqa: F401 - re-exported for the sessions
from ..core.steer_spec import ForwardState, SteerSpec
from ..core.steer_spec import check_positions_fit, issued_specs  # noqa: F401 - re-exported for the sessions
from ..core.steer_spec import make_spec as _make_spec
from .model import lm_of
from .writers import Writers

# The names re-exported above moved to ie_lab/core/; they stay importable from here until the session modules
# import them from core (then these lines go).


@contextlib.contextmanager
def running(ctx: "steering | None", specs: Sequence[Any] = (), *, offset: int = 0,
            shape: tuple[int, int] | None = None) -> Iterator[None]:
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


# ---- the hooks ----------------------------------------------------------------------------------------

class _Local(threading.local):
    ids: torch.Tensor | None = None
    shape: tuple[int, int] = (0, 0)


class _ThreadState(ForwardState):
    """A plain-forward state whose ids are per thread: a `with` block's hooks may see forwards from two
    threads that share its context (asyncio.to_thread copies it)."""

    def __init__(self) -> None:
        self._local = _Local()
        super().__init__()

    ids = property(lambda self: self._local.ids, lambda self, v: setattr(self._local, "ids", v))


class _GatedWriters(Writers):
    """Writers whose hooks pass every tensor through untouched unless gate() says this forward is theirs."""

    thread_bound = False  # the gate decides (a block's context may run forwards on two threads)

    def __init__(self, lm: Any, edits: list, gate: Callable[[], bool]):
        self._local = _Local()
        self.gate = gate
        super().__init__(lm, edits)

    shape = property(lambda self: self._local.shape, lambda self, v: setattr(self._local, "shape", v))

    def _edit3(self, t: torch.Tensor, edit: Any) -> torch.Tensor:
        return super()._edit3(t, edit) if self.gate() else t


class steering:  # noqa: N801 - used like a function: `with steering(lm, specs):`
    """Hooks for steering specs, acting only on the forwards gate() accepts; every hook is removed on exit.

    Without a gate they act on the forwards marked for this object (``running(ctx)``): an operation's own.
    """

    def __init__(self, lm: Any, specs: Sequence[SteerSpec], state: ForwardState | None = None,
                 gate: Callable[[], bool] | None = None):

        self.lm = lm_of(lm)
        self.specs = list(specs)
        self.state = state or (_ThreadState() if gate is not None else ForwardState())
        tok = self.lm.tokenizer
        self.special = frozenset(getattr(tok, "all_special_ids", []) or [])
        self.gate = gate or self._mine
        edits = [(a, sp.edit(self.state, self.special)) for sp in self.specs for a in sp.addresses]
        self.writers = _GatedWriters(self.lm, edits, self.gate)
        self._ids_hook = None

    def _mine(self) -> bool:
        op = CURRENT_OP.get()
        return op is not None and op.ctx is self

    def install(self) -> None:
        # No lock: the hooks of a forward in flight elsewhere are read once at its start, and these act on
        # no forward but their own (the gate), so installing never changes someone else's forward.
        try:
            self.writers.__enter__()

            def record_ids(mod, args):
                if self.gate() and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
                    self.state.ids = args[0]
                    self.writers.shape = tuple(args[0].shape[:2])
            self._ids_hook = self.lm.binding.embed.register_forward_pre_hook(record_ids)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        if self._ids_hook is not None:
            self._ids_hook.remove()
            self._ids_hook = None
        self.writers.close()

    def __enter__(self) -> "steering":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
