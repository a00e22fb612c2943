"""The hooks that read points: ``Taps`` places them for a set of sources (sites.py) for the duration of a ``with``
block and collects what they see; every exit path removes every hook and the attention-tap listeners.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..address import Address
from ..arch import attention_tap
from ..arch.recorder import first_tensor, hidden_arg
from . import hook_calls

# The site table lived here before sites.py held it: its callers import these names from this module still.
from .sites import _MIXER_AS_SUBLAYER as _MIXER_AS_SUBLAYER
from .sites import Source, _bound, _routing, resolve
from .sites import _recompute as _recompute

__all__ = ["Source", "Taps", "resolve"]


# ---- placing hooks ---------------------------------------------------------------------------------


class Taps:
    """Hooks for a set of addresses; ``collected[base]`` lists one tensor per forward that ran."""

    def __init__(self, lm: Any, addresses: list[Address], grad: bool = False):
        self.lm = lm
        self.grad = grad
        self.bases: list[Address] = []
        self.sources: dict[Address, Source] = {}
        for a in addresses:
            base = a.without_head()
            if base not in self.sources:
                self.sources[base] = resolve(lm, base)  # refusals happen here, before any hook exists
                self.bases.append(base)
        self.collected: dict[Address, list[torch.Tensor]] = defaultdict(list)
        self.shape: tuple[int, int] = (0, 0)  # (batch, new tokens) of the forward in flight
        self._handles: list[Any] = []
        self._stack: contextlib.ExitStack | None = None
        # The thread whose forwards these taps read (set on entry; a generation re-sets it before each forward).
        # Hooks live on shared modules: a forward another thread runs meanwhile (a raw model call outside
        # ie_lab's locks) must not land in this operation's tensors.
        self.owner: int | None = None

    def _mine(self) -> bool:
        return self.owner is None or threading.get_ident() == self.owner

    @property
    def needs_output_attentions(self) -> bool:
        return any(s.needs_output_attentions for s in self.sources.values())

    def _keep(self, base: Address, t: torch.Tensor) -> None:
        b, s = self.shape
        if t.dim() == 2 and b and t.shape[0] == b * s:
            t = t.reshape(b, s, -1)  # layers that flatten tokens around the MLP (OPT)
        # Clone even with grad (clone is differentiable): some families update module outputs in place later.
        self.collected[base].append(t.clone() if self.grad else t.detach().clone())

    def __enter__(self) -> "Taps":
        self.owner = threading.get_ident()
        by_module: dict[tuple[int, str], list[tuple[Address, Source]]] = defaultdict(list)
        for base, src in self.sources.items():
            by_module[(id(src.module), src.kind)].append((base, src))
        listeners: dict[int, Callable] = {}
        steps: list[Any] = []  # modules read at their own attention step (Source.at_step)
        n_experts = self.lm.facts.n_experts
        try:
            for (_, kind), items in by_module.items():
                module = items[0][1].module
                if kind == "pre":

                    def pre(mod, args, kwargs, items=items):
                        if not self._mine():
                            return
                        h = hidden_arg(args, kwargs)
                        for base, src in items:
                            self._keep(base, src.transform(h))

                    self._handles.append(hook_calls.on_input(module, pre))
                elif kind == "moe_args":

                    def moe(mod, args, kwargs, items=items):
                        if not self._mine():
                            return
                        routing = _routing(args, kwargs)
                        for base, src in items:
                            self._keep(base, src.transform(routing, self.shape, n_experts))

                    self._handles.append(hook_calls.on_input(module, moe))
                elif kind in ("post", "post_raw", "attn_out_full"):

                    def post(mod, args, kwargs, out, items=items, kind=kind):
                        if not self._mine():
                            return
                        for base, src in items:
                            if kind == "post":
                                self._keep(base, src.transform(first_tensor(out)))
                            elif kind == "post_raw":
                                self._keep(base, src.transform(out, self.shape, n_experts))
                            else:  # transforms that need the whole output and the forward's shape
                                self._keep(base, src.transform(out, self.shape))

                    self._handles.append(hook_calls.on_output(module, post))
                elif kind == "post_sum":
                    earlier: dict[int, torch.Tensor] = {}  # per thread: the partner's output in the forward in flight
                    partner = _bound(items[0][1].partner)

                    def keep_partner(mod, args, kwargs, out, earlier=earlier):
                        if self._mine():
                            earlier[threading.get_ident()] = first_tensor(out)

                    def post_sum(mod, args, kwargs, out, items=items, earlier=earlier):
                        if not self._mine():
                            return
                        t = first_tensor(out)
                        total = t + earlier.pop(threading.get_ident()).reshape(t.shape)
                        for base, src in items:
                            self._keep(base, src.transform(total))

                    self._handles.append(hook_calls.on_output(partner, keep_partner))
                    self._handles.append(hook_calls.on_output(module, post_sum))
                elif kind == "attn":
                    calls = [0]  # this module's calls so far: a forward makes src.calls_per_forward of them

                    def listen(mod, call, items=items, calls=calls):
                        if not self._mine():
                            return
                        i, calls[0] = calls[0], calls[0] + 1
                        for base, src in items:
                            if i % src.calls_per_forward == 0:
                                self._keep(base, src.transform(call, self.shape))

                    listeners[id(module)] = listen
                    if any(src.at_step for _, src in items):
                        steps.append(module)
            self._stack = contextlib.ExitStack()
            if listeners:
                self._stack.enter_context(attention_tap.listening(listeners, steps=tuple(steps)))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def __exit__(self, *exc) -> None:
        self.close()
