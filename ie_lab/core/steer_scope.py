"""Where a steering spec applies: the `with spec:` scopes open in each context, and the operation in flight.

Where a spec applies (docs/STEERING.md, "Scope"):

- ``with spec:`` opens a *scope* in the current ``contextvars`` context only (an asyncio task, a thread,
  or a copy of either). Every operation reads the scopes open in the context that issues it, once, when it
  is issued (``issued_specs`` in steer_spec.py), and carries them like a per-call ``steer=``; an operation
  issued in another task or thread sees none of them.
- An operation marks the code it runs (``CURRENT_OP``: the eager backend's ``running``), so code inside it sees
  the operation's specs, and a backend's hooks can tell the operation's forwards from a block's raw ones.

Neutral: plain ContextVars and specs compared by identity; the eager backend adds hooks for raw forwards on top,
the vLLM backend sends the specs with each request.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass
from typing import Any

# ---- operations: the forwards an operation runs are marked for its own hooks ---------------------------


@dataclass(eq=False)
class Op:
    """The operation the code in this context runs inside: the specs it carries and its own hooks (a backend's
    object, None where the backend places none)."""

    specs: tuple
    ctx: Any = None


CURRENT_OP: contextvars.ContextVar[Op | None] = contextvars.ContextVar("ie_lab_steer_op", default=None)


# ---- scopes: which `with` blocks are open in the calling context --------------------------------------


@dataclass(eq=False)
class _Scope:
    spec: Any
    op: Any = None  # the operation whose code entered the block (s.run(fn)), None at the top level
    open: bool = True
    hooks: Any = None  # the backend's raw-forward hooks for this block (removed on close), if it places any

    def applies(self) -> bool:
        """Gate of this scope's raw-forward hooks: a forward run by the same level of code that entered the
        block (not an operation's own forward), in a context where this scope is the first open one of its
        spec at that level (so a spec entered twice, or inherited and re-entered, acts once)."""
        op = CURRENT_OP.get()
        if op is not self.op or not self.open:
            return False
        if op is not None and any(s is self.spec for s in op.specs):
            return False  # the operation already carries this spec (a block around s.run(fn), entered again)
        for sc in _SCOPES.get():
            if sc.spec is self.spec and sc.open and sc.op is self.op:
                return sc is self
        return False

    def close(self) -> None:
        self.open = False
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.remove()


_SCOPES: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar("ie_lab_steer_scopes", default=())
_OPEN: dict[int, list[_Scope]] = {}  # id(spec) -> its open scopes in any context (to close one exited elsewhere)
_OPEN_LOCK = threading.Lock()


def enter_scope(spec: Any) -> _Scope:
    """Open a `with spec:` scope in the current context (SteerSpec.__enter__, and the vLLM session's wrapper)."""
    scope = _Scope(spec, CURRENT_OP.get())
    _SCOPES.set(_SCOPES.get() + (scope,))
    with _OPEN_LOCK:
        _OPEN.setdefault(id(spec), []).append(scope)
    return scope


def exit_scope(spec: Any) -> None:
    """Close the innermost scope of spec in the current context (every backend's __exit__).

    A block exited in another context than it was entered in (a generator resumed elsewhere) closes the
    most recent open scope of the spec wherever it is: a closed scope is ignored everywhere, so nothing
    stays steered and no hook is left.
    """
    cur = _SCOPES.get()
    scope = next((cur[i] for i in range(len(cur) - 1, -1, -1) if cur[i].spec is spec and cur[i].open), None)
    with _OPEN_LOCK:
        mine = _OPEN.get(id(spec), [])
        if scope is None and mine:
            scope = mine[-1]
        if scope in mine:
            mine.remove(scope)
        if not mine:
            _OPEN.pop(id(spec), None)
    if scope is None:
        return
    _SCOPES.set(tuple(sc for sc in cur if sc is not scope and sc.open))
    scope.close()


def active_specs(owner: Any) -> list[Any]:
    """The specs on `owner` (a spec's .lm) that a request issued now, in this context, carries: those of the
    operation this code runs inside (s.run(fn)), then the `with` blocks open here at this level, outermost
    first, each once. Blocks inherited from outside an operation already travel in its specs."""
    op = CURRENT_OP.get()
    out: list[Any] = [sp for sp in op.specs if sp.lm is owner] if op is not None else []
    for sc in _SCOPES.get():
        if sc.open and sc.op is op and sc.spec.lm is owner and not any(s is sc.spec for s in out):
            out.append(sc.spec)
    return out
