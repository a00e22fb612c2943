"""The eager steering hooks: specs applied to the forwards of the operation they belong to, or of a `with` block.

Apart from steer.py (operations, their marking) so that EagerModel can place a block's hooks without importing
the module that imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.handles import as_lm
from ..core.steer_scope import CURRENT_OP
from ..core.steer_spec import ForwardState, SteerSpec
from .writers import Writers

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

    def __init__(
        self,
        lm: Any,
        specs: Sequence[SteerSpec],
        state: ForwardState | None = None,
        gate: Callable[[], bool] | None = None,
    ):

        self.lm = as_lm(lm)
        self.specs = list(specs)
        self.state = state or (_ThreadState() if gate is not None else ForwardState())
        tok = self.lm.tokenizer
        self.special = frozenset(getattr(tok, "all_special_ids", []) or [])
        self.gate = gate or self._mine
        edits = [w for sp in self.specs for w in sp.writes(self.state, self.special)]
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
