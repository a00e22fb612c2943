"""Hooks that change a point's tensor in the forward: the substrate of steering, patching and gradients.

A writer is given an Address and an edit ``f(tensor, token_offset) -> tensor`` that sees the point's
value as capture would return it ([batch, new_tokens, width], token_offset being how many positions
the cache already holds) and returns the value it should have. Points that are a transform of a module
output (a residual multiplier; resid_mid, which no module returns) are written by solving for the module
output that yields the edited value, so the rest of the forward sees a consistent stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import points as _points
from ..address import Address
from ..arch.binding import LayerBinding
from ..arch.recorder import first_tensor, hidden_arg
from ..errors import CapabilityUnsupported
from . import hook_calls

Edit = Callable[[torch.Tensor, int], torch.Tensor]

# Points with a module boundary where an edited value flows on: the registry says which (Point.writable).
WRITABLE = tuple(p.name for p in _points.all_points() if p.writable)


def _replace_hidden(args: tuple, kwargs: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    if "hidden_states" in kwargs and isinstance(kwargs["hidden_states"], torch.Tensor):
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = new
        return args, kwargs
    items = list(args)
    first = next((a for a in items if isinstance(a, torch.Tensor)), None)
    if first is None:
        raise RuntimeError("no hidden-states argument to replace")
    # the same tensor passed in several places is one input (CTRL's attention is called as (x, x, x) for v, k, q)
    return tuple(new if a is first else a for a in items), kwargs


def _replace_output(out: Any, new: torch.Tensor) -> Any:
    if isinstance(out, torch.Tensor):
        return new
    if isinstance(out, tuple):
        items = list(out)
        for i, t in enumerate(items):
            if isinstance(t, torch.Tensor):
                items[i] = new
                return type(out)(items) if type(out) is tuple else out.__class__(*items)
    raise RuntimeError(f"cannot replace an output of type {type(out).__name__}")


def _bound_norm(norm: torch.nn.Module | None) -> torch.nn.Module:
    # a norm-residual layer has both norms (arch.measure_residual._norm_residual binds none without)
    assert norm is not None
    return norm


def _as3d(t: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Present flattened [b*s, w] tensors (OPT's MLP) as [b, s, w], and undo it after."""
    b, s = shape
    if t.dim() == 2 and t.shape[0] == b * s:
        return t.reshape(b, s, -1), lambda u: u.reshape(b * s, -1)
    return t, lambda u: u


class Writers:
    """Hooks that apply edits to points during forwards run inside the ``with`` block.

    Writer hooks are prepended, so any capture hook on the same module sees the written value (what
    flows on), whichever was installed first.
    """

    # An operation's writers edit only the forwards of the thread that entered them (a raw model call another
    # thread runs meanwhile is left alone); `with`-block steering gates its own writers instead (steer.py).
    thread_bound = True

    def __init__(self, lm: Any, edits: list[tuple[Address, Edit]]):
        self.lm = lm
        self.edits = edits
        self.owner: int | None = None
        self.shape: tuple[int, int] = (0, 0)
        self.offset = 0  # positions already in the KV cache before the forward in flight
        for addr, _ in edits:
            if addr.name in ("mixer_state", "mixer_conv_state"):
                from .mixer_state import refuse_hooked

                raise refuse_hooked(addr, "writing")
            if addr.name not in WRITABLE:
                raise CapabilityUnsupported(
                    f"writing {addr.name}",
                    f"{addr.name} is read inside the attention call or from a computed view, so there is no module "
                    "boundary where a changed value would flow on.",
                    "write z (per head), attn_out, or a residual point instead.",
                )
            if addr.head is not None and addr.name != "z":
                raise CapabilityUnsupported(
                    f"writing one head of {addr.name}",
                    "only z is written per head.",
                    f"write z.{addr.layer}.head-{addr.head}.",
                )
        self._handles: list[Any] = []

    def _edit3(self, t: torch.Tensor, edit: Edit) -> torch.Tensor:
        if self.owner is not None and threading.get_ident() != self.owner:
            return t
        t3, back = _as3d(t, self.shape)
        return back(edit(t3, self.offset))

    def _pre(self, module: torch.nn.Module, edit: Edit) -> None:
        def hook(mod, args, kwargs):
            h = hidden_arg(args, kwargs)
            return _replace_hidden(args, kwargs, self._edit3(h, edit))

        self._handles.append(hook_calls.on_input(module, hook, prepend=True))

    def _post(self, module: torch.nn.Module, edit: Edit) -> None:
        def hook(mod, args, kwargs, out):
            t = out if isinstance(out, torch.Tensor) else next(x for x in out if isinstance(x, torch.Tensor))
            return _replace_output(out, self._edit3(t, edit))

        self._handles.append(hook_calls.on_output(module, hook, prepend=True))

    def _beside_attention(self, lb: LayerBinding, addr: Address) -> Callable[[], torch.Tensor] | None:
        """What a mixer beside attention (Falcon-H1) adds to resid_mid in the forward in flight, for writing resid_mid
        through attention's output; None on layers without one."""
        if lb.par_mixer is None:
            return None
        if not lb.par_mixer_first:
            raise CapabilityUnsupported(
                f"writing {addr}",
                "the mixer beside attention on this layer runs after attention, so its share of resid_mid is not known "
                "when attention's output is written.",
                f"write attn_out_post.{addr.layer} or mixer_out_post.{addr.layer}.",
            )
        got: dict[int, torch.Tensor] = {}
        pm = lb.par_mixer_multiplier or 1.0

        def keep(mod, args, kwargs, out):
            got[threading.get_ident()] = first_tensor(out)

        self._handles.append(hook_calls.on_output(lb.par_mixer, keep))
        return lambda: pm * _as3d(got[threading.get_ident()], self.shape)[0]

    def _post_sum(self, lb: LayerBinding, edit: Edit, mult: float) -> None:
        """Write mlp_out beside a side MLP, a sum the layer forms itself: the earlier module's output is remembered
        and the later one's is handed on so that the two add up to the edited value (times mult: mlp_out_post)."""
        assert lb.mlp_side is not None  # only called on such layers
        later, earlier = (lb.mlp_side, lb.mlp_out_module) if lb.mlp_side_last else (lb.mlp_out_module, lb.mlp_side)
        seen: dict[int, torch.Tensor] = {}  # per thread: two threads' forwards may pass this layer at once

        def keep(mod, args, kwargs, out):
            seen[threading.get_ident()] = first_tensor(out)

        def via_later(t: torch.Tensor, off: int) -> torch.Tensor:
            e = seen[threading.get_ident()].reshape(t.shape)
            return edit((t + e) * mult, off) / mult - e

        self._handles.append(hook_calls.on_output(earlier, keep))
        self._post(later, via_later)

    def _place(self, addr: Address, edit: Edit) -> None:
        from .taps import _MIXER_AS_SUBLAYER, resolve

        b = self.lm.binding
        resolve(self.lm, addr.without_head())  # refuses absent points with the family's reason
        if addr.name == "embeddings":
            return self._post(b.embed, edit)
        if addr.name == "final_norm":
            return self._post(b.final_norm, edit)
        lb: LayerBinding = b.layers[addr.layer]
        if lb.par_mixer is not None and addr.name in _MIXER_AS_SUBLAYER:  # a mixer beside attention: its own
            if addr.name == "mixer_in":
                return self._pre(lb.par_mixer, edit)
            pm = (lb.par_mixer_multiplier or 1.0) if addr.name == "mixer_out_post" else 1.0
            return self._post(lb.par_mixer, lambda t, off: edit(t * pm, off) / pm)
        n = _MIXER_AS_SUBLAYER.get(addr.name, addr.name)  # a mixer layer's mixer sits where attention would
        if addr.stream is not None:
            return self._place_stream(lb, addr, edit)
        if n == "resid_pre":
            return self._pre(lb.layer, edit)
        if n == "resid_post":
            return self._post(lb.layer, edit)
        if n == "attn_in":
            if lb.norm_residual:  # the input norm's output feeds the sublayer and the residual add alike: edit both
                return self._post(_bound_norm(lb.input_norm), edit)
            return self._pre(lb.attn, edit)
        if n == "z":
            if lb.z_at_kernel:
                raise CapabilityUnsupported(
                    f"writing z.{addr.layer}",
                    "on this layer z is the attention kernel's output, which "
                    + (lb.z_at_kernel_why or "a norm (measured) changes before the output projection")
                    + ", so no module boundary carries z itself onward.",
                    "write attn_out or a residual point.",
                )
            if addr.head is not None:
                n, h = self.lm.facts.n_heads, addr.head

                def head_edit(t: torch.Tensor, off: int, edit=edit) -> torch.Tensor:
                    d = t.shape[-1] // n  # a value head's width: wider than head_dim on latent attention
                    out = t.clone()
                    out[..., h * d : (h + 1) * d] = edit(t[..., h * d : (h + 1) * d], off)
                    return out

                return self._pre(lb.o_proj, head_edit)
            return self._pre(lb.o_proj, edit)
        if n in ("q_latent", "kv_latent"):  # the norm's output is what the up-projection (and the cache) reads
            norm = lb.q_latent if n == "q_latent" else lb.kv_latent
            assert norm is not None  # resolve() above refused the point where the binder measured no such norm
            return self._post(norm, edit)
        if n == "attn_out" and lb.o_bias is not None:  # attn_out is the projection's output plus the returned bias
            ob = lb.o_bias.detach()
            return self._post(lb.o_proj, lambda t, off: edit(t + ob, off) - ob)
        if n == "attn_out":
            return self._post(lb.o_proj, edit)
        if n == "mlp_out" or (n == "mlp_out_post" and lb.post_mlp_norm is None):
            if lb.mlp_side is not None:
                return self._post_sum(lb, edit, (lb.mlp_multiplier or 1.0) if n == "mlp_out_post" else 1.0)
        if n in ("attn_out_post", "mlp_out_post"):
            attn = n.startswith("attn")
            norm = lb.post_attn_norm if attn else lb.post_mlp_norm
            mult = (lb.attn_multiplier if attn else lb.mlp_multiplier) or 1.0
            if attn and norm is None and lb.o_bias is not None:
                ob = lb.o_bias.detach()
                return self._post(lb.o_proj, lambda t, off: edit((t + ob) * mult, off) / mult - ob)
            module = norm if norm is not None else (lb.o_proj if attn else lb.mlp_out_module)
            return self._post(module, lambda t, off: edit(t * mult, off) / mult if mult != 1.0 else edit(t, off))
        if n == "resid_mid" and lb.norm_residual:  # the pre-MLP norm is its only reader: write it at its input
            return self._pre(_bound_norm(lb.pre_mlp_norm), edit)
        if n == "resid_mid":
            # resid_mid = resid_pre + m * c, where c is attention's (post-norm) output: edit it through c.
            seen: dict[int, torch.Tensor | None] = {}  # per thread: two threads' forwards may pass this layer at once
            self._handles.append(
                hook_calls.on_input(
                    lb.layer,
                    lambda mod, args, kwargs: seen.__setitem__(threading.get_ident(), hidden_arg(args, kwargs)),
                )
            )
            mult = lb.attn_multiplier or 1.0
            module = lb.post_attn_norm if lb.post_attn_norm is not None else lb.o_proj
            beside = self._beside_attention(lb, addr)
            # the bias the layer adds to o_proj's output (skip-bias-add, measured), where o_proj is written
            ob = lb.o_bias.detach() if lb.o_bias is not None and module is lb.o_proj else torch.zeros(())

            def via_attention(c: torch.Tensor, off: int) -> torch.Tensor:
                h = seen[threading.get_ident()]
                assert h is not None  # a decoder layer is always called with its hidden states
                x, _ = _as3d(h, self.shape)
                x = x + beside() if beside is not None else x
                r = x + mult * (c + ob)
                return (edit(r, off) - x) / mult - ob

            return self._post(module, via_attention)
        if n == "mlp_in":
            if lb.norm_residual:  # as attn_in: the pre-MLP norm's output is also what the MLP's residual adds to
                return self._post(_bound_norm(lb.pre_mlp_norm), edit)
            if lb.mlp_side is not None:
                # The side MLP reads mlp_in too (measured): written at the MLP's input alone, the edit would miss it
                # while mlp_out, the sum, counts it. The pre-MLP norm's output is the one tensor both read; one write
                # there (an edit run once per forward, as everywhere else).
                if lb.pre_mlp_norm is None:
                    raise CapabilityUnsupported(
                        f"writing mlp_in.{addr.layer}",
                        "the MLP and the side MLP the layer adds to it both read mlp_in, and no norm output was "
                        "measured that hands the one tensor to both.",
                        f"write resid_mid.{addr.layer} or mlp_out.{addr.layer}.",
                    )
                return self._post(lb.pre_mlp_norm, edit)
            return self._pre(lb.mlp_in_module, edit)
        if n == "mlp_act":
            assert lb.down_proj is not None  # resolve() above refused mlp_act where the layer has none
            return self._pre(lb.down_proj, edit)
        if n in ("mlp_pre", "mlp_pre_linear"):
            if lb.fused_gate_up is not None:
                first = (n == "mlp_pre") == lb.fused_gate_first

                def half(t: torch.Tensor, off: int) -> torch.Tensor:
                    a, c = t.chunk(2, -1)
                    return torch.cat([edit(a, off), c] if first else [a, edit(c, off)], -1)

                return self._post(lb.fused_gate_up, half)
            linear = (lb.gate_proj or lb.up_proj) if n == "mlp_pre" else lb.up_proj
            assert linear is not None  # resolve() above refused the point where the layer has no such linear
            return self._post(linear, edit)
        if n == "mlp_out":
            return self._post(lb.mlp_out_module, edit)
        raise CapabilityUnsupported(f"writing {n}", "no writer is bound for this point.", "write a residual point.")

    def _place_stream(self, lb: LayerBinding, addr: Address, edit: Edit) -> None:
        """One stream of a hyper-connection layer's stack: the layer's input (resid_pre) or output (resid_post) with
        that stream's slice edited, the other streams untouched."""
        S = addr.stream

        def one_stream(t: torch.Tensor, off: int) -> torch.Tensor:
            out = t.clone()
            out[..., S, :] = edit(t[..., S, :], off)
            return out

        if addr.name == "resid_pre":
            return self._pre(lb.layer, one_stream)
        if addr.name == "resid_post":
            return self._post(lb.layer, one_stream)
        raise CapabilityUnsupported(
            f"writing {addr}",
            "the layer hands the stack between its sublayers both to the MLP's hyper-connection and to its own "
            "mixing sum, so a change at the hyper-connection's input would reach one and not the other.",
            f"write resid_pre.{addr.layer}.stream-{S}, resid_post.{addr.layer}.stream-{S}, attn_out.{addr.layer} "
            f"or mlp_in.{addr.layer}.",
        )

    def __enter__(self) -> "Writers":
        self.owner = threading.get_ident() if self.thread_bound else None
        try:
            # Hooks are prepended, so place in reverse: edits on one module then apply in the order given.
            for addr, edit in reversed(self.edits):
                self._place(addr, edit)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield
