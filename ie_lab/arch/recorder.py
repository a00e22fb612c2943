"""What flowed on the probe forward, and the two words every measurement is said in.

The Recorder keeps each watched module's hidden input and first output. `same`: this is the tensor flowing from one
module to the next (tight at every dtype). `close`: a sum recomputed in another order equals it (up to the dtype's
rounding). The arch.measure_* modules compare recorded tensors with these two alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PROBE_LEN = 7  # distinct from every head count we meet, so [.., heads, seq, ..] layouts are unambiguous


def first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            if isinstance(item, torch.Tensor):
                return item
    return None


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden-states input of a module call, whether passed by position or keyword."""
    if "hidden_states" in kwargs and isinstance(kwargs["hidden_states"], torch.Tensor):
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for key in ("x", "input", "hidden"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def match_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.shape == b.shape:
        return a
    # Some layers flatten [b, s, d] to [b*s, d] around their MLP (OPT); compare the same numbers.
    if a.numel() != b.numel() or a.shape[-1] != b.shape[-1]:
        return None
    return a.reshape(b.shape)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Is this the same tensor flowing from one module to the next? (Tight at every dtype.)"""
    if a is None or b is None:
        return False
    a = match_shape(a, b)
    if a is None:
        return False
    scale = max(float(b.float().abs().max()), 1e-6)
    return float((a.float() - b.float()).abs().max()) <= 1e-6 * scale


def detached(x: Any) -> torch.Tensor:
    t = first_tensor(x)
    assert t is not None  # hooked on the final norm's output and the unembedding's input: tensors on every model
    return t.detach().clone()


def close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float = 1e-5) -> bool:
    """Equal up to rounding: for sums we recompute in another order, so the dtype's precision counts."""
    if a is None or b is None:
        return False
    a = match_shape(a, b)
    if a is None:
        return False
    eps = max(torch.finfo(t.dtype).eps for t in (a, b) if t.is_floating_point())
    tol = max(tol, 8 * eps)
    scale = max(float(b.float().abs().max()), 1e-6)
    return float((a.float() - b.float()).abs().max()) <= tol * scale + 1e-7


class Recorder:
    """Records each watched module's hidden input and first output during the probe forward."""

    def __init__(self) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.handles: list[Any] = []

    def watch(self, m: nn.Module | None) -> None:
        if m is None or id(m) in self.inputs:
            return

        def pre(mod, args, kwargs):
            t = hidden_arg(args, kwargs)
            if t is not None and id(mod) not in self.inputs:
                self.inputs[id(mod)] = t.detach().clone()
                self.args[id(mod)] = (args, kwargs)

        def post(mod, args, kwargs, out):
            if id(mod) not in self.outputs:
                # Clone: some families update a module's output in place afterwards (Falcon's mlp += attn).
                if isinstance(out, torch.Tensor):
                    out = out.detach().clone()
                elif isinstance(out, (tuple, list)):
                    out = type(out)(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in out)
                self.outputs[id(mod)] = out

        self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(m.register_forward_hook(post, with_kwargs=True))

    args: dict[int, Any]
    kernel_outputs: dict[int, torch.Tensor]  # attention module id -> what transformers' attention kernel returned
    kernel_weights_ok: dict[int, bool]  # attention module id -> its returned weights times value give its output
    kernel_calls: dict[int, int]  # attention module id -> how many kernel calls it made in the probe forward
    kernel_keys: dict[int, torch.Tensor]  # attention module id -> the keys its first kernel call was handed
    # attention module id -> whether every kernel call of the probe forward was handed the first call's q and k
    kernel_same_qk: dict[int, bool]
    step_calls: dict[int, Any]  # attention module id -> the first call of its own attention step (attention_tap.STEP)

    def __enter__(self) -> "Recorder":
        self.args = {}
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def inp(self, m: nn.Module | None) -> torch.Tensor | None:
        return None if m is None else self.inputs.get(id(m))

    def out(self, m: nn.Module | None) -> torch.Tensor | None:
        if m is None:
            return None
        o = first_tensor(self.outputs.get(id(m)))
        return None if o is None else o.detach()
