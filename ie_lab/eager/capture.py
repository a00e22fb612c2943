"""capture(): one forward of the raw model with hooks at the requested points.

With grad=True the returned tensors form one autograd graph: where a point is a module boundary the rest of
the forward reads (a residual, a branch input or output), the tensor returned is the one the forward goes on
from, so ``torch.autograd.grad(c["resid_post.3"].sum(), c["resid_post.0"])`` is the model's own derivative.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ..address import Address, AddressLike
from ..arch.recorder import first_tensor, hidden_arg
from ..cache import Cache
from ..core.addresses import head_count, parse_addresses, slice_head
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..errors import StructureError, check_flag
from . import hook_calls, mixer_state
from .grad_support import grad_support
from .model import lm_of
from .taps import Taps, resolve

# Points whose tensor is a module's input or output that the rest of the forward reads, in full, from that
# very boundary: returning the tensor the forward goes on from makes later points functions of it. resid_mid
# is left out: it is read at the MLP norm's input, while the residual add reads the stream itself.
LINKABLE = frozenset(
    {
        "embeddings",
        "resid_pre",
        "resid_post",
        "attn_in",
        "z",
        "attn_out",
        "attn_out_post",
        "mlp_in",
        "mlp_pre",
        "mlp_pre_linear",
        "mlp_act",
        "mlp_out",
        "mlp_out_post",
        "final_norm",
        "value",
        # a mixer layer's input and output, and the output as the layer adds it
        "mixer_in",
        "mixer_out",
        "mixer_out_post",
    }
)


def _replace_input(args: tuple, kwargs: dict, old: torch.Tensor, new: torch.Tensor) -> tuple[tuple, dict]:
    """The module call's arguments with the hidden-states tensor `old` (found by hidden_arg) swapped for `new`."""
    kwargs = dict(kwargs)
    for k, v in kwargs.items():
        if v is old:
            kwargs[k] = new
            return args, kwargs
    return tuple(new if a is old else a for a in args), kwargs


def _replace_first(out: Any, new: torch.Tensor) -> Any:
    if isinstance(out, torch.Tensor):
        return new
    items = list(out)
    i = next(j for j, t in enumerate(items) if isinstance(t, torch.Tensor))
    items[i] = new
    return type(out)(items) if type(out) in (tuple, list) else out.__class__(*items)


def _is_identity(transform: Any) -> bool:
    probe = torch.zeros(1, 1, 2)
    try:
        return transform(probe) is probe
    except Exception:  # transforms that need a real shape (fused qkv) are not the identity
        return False


class _Links:
    """Hooks that put the returned tensor of each linkable point on the forward's own path (grad=True).

    At the boundary the hook clones the point's value into P (what capture returns) and hands the rest of
    the forward ``t.detach() + (P - P.detach()) / m``: the same numbers exactly (it adds zeros), but the rest
    of the forward now depends on t only through P, so d(anything later) / dP is the model's derivative with
    respect to that point and gradients to earlier points pass through P once. P itself never flows on, so
    in-place updates later in the forward cannot change it. Heads asked of a point are cloned one by one and P is stacked
    from them, so a single head is a differentiable input too."""

    def __init__(self, lm: Any, addrs: list[Address]):
        self.lm = lm
        self.shape = (0, 0)
        self.bases: dict[Address, tuple[Any, float | None, bool]] = {}  # base -> (source, multiplier, per head)
        for a in addrs:
            if a.name not in LINKABLE:
                continue
            src = resolve(lm, a.without_head())
            if src.kind not in ("pre", "post"):
                continue  # read from inside the attention call: no boundary the forward goes on from
            mult = None
            if a.name in ("attn_out_post", "mlp_out_post", "mixer_out_post"):
                lb = lm.binding.layers[a.layer]
                if a.name == "mixer_out_post":  # beside attention (Falcon-H1) or in its place (the attention slot's)
                    mult = lb.par_mixer_multiplier if lb.par_mixer is not None else lb.attn_multiplier
                else:
                    mult = lb.attn_multiplier if a.name == "attn_out_post" else lb.mlp_multiplier
            if mult is None and not _is_identity(src.transform):
                continue  # a reshaping view (per-layout q/k norms, a fused qkv slice): returned by the taps
            prev = self.bases.get(a.without_head())
            self.bases[a.without_head()] = (src, mult, a.head is not None or bool(prev and prev[2]))
        self.got: dict[Address, list[torch.Tensor]] = defaultdict(list)
        self.heads: dict[Address, list[list[torch.Tensor]]] = defaultdict(list)
        self._handles: list[Any] = []

    def _link(self, base: Address, t: torch.Tensor) -> torch.Tensor | None:
        src, mult, per_head = self.bases[base]
        b, s = self.shape
        t3 = t.reshape(b, s, -1) if t.dim() == 2 and b and t.shape[0] == b * s else t  # OPT flattens tokens
        v = src.transform(t3)
        if not v.requires_grad:  # frozen weights: the point is still a differentiable input for what follows
            v = v.detach().requires_grad_()
        if per_head:
            n = head_count(base, self.lm.facts)  # heads of z are value heads (wider on latent attention)
            pieces = [p.clone() for p in v.reshape(*v.shape[:-1], n, -1).unbind(-2)]
            point = torch.stack(pieces, dim=-2).reshape(v.shape)
            self.heads[base].append(pieces)
        else:
            point = v.clone()
        self.got[base].append(point)
        # The rest of the forward depends on t only through the point (t itself goes on detached), so nothing
        # upstream is counted twice; adding zeros keeps its numbers exactly t's.
        zero = point - point.detach()
        flow = t3.detach() + (zero / mult if mult is not None else zero)
        return flow.reshape(t.shape)

    def __enter__(self) -> "_Links":
        owner = threading.get_ident()  # as Taps: another thread's raw forward through these modules is not ours
        for base, (src, _, _) in self.bases.items():
            if src.kind == "pre":

                def pre(mod, args, kwargs, base=base):
                    if threading.get_ident() != owner:
                        return None
                    h = hidden_arg(args, kwargs)
                    return _replace_input(args, kwargs, h, self._link(base, h))

                # Appended: steering and patching writers (prepended) run first, so P is the written value,
                # the one a capture without grad returns.
                self._handles.append(hook_calls.on_input(src.module, pre))
            else:

                def post(mod, args, kwargs, out, base=base):
                    if threading.get_ident() != owner:
                        return None
                    return _replace_first(out, self._link(base, first_tensor(out)))

                self._handles.append(hook_calls.on_output(src.module, post))
        return self

    def serves(self, a: Address) -> bool:
        return a.without_head() in self.bases

    def value(self, a: Address) -> list[torch.Tensor] | None:
        base = a.without_head()
        if base not in self.got:
            return None
        if a.head is None:
            return self.got[base]
        return [pieces[a.head] for pieces in self.heads[base]]

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def capture(
    model: Any, tokens_or_text: Any, addresses: AddressLike | Iterable[AddressLike], *, grad: bool = False
) -> Cache | list[Cache]:
    """Run one forward and return the requested points, keyed by Address.

    A list of prompts (texts, token lists or conversations; ragged) returns a list of Cache, one per prompt,
    each exactly as that prompt captured alone would be: no padding rows or columns. A [batch, seq] tensor
    stays one batch and returns one Cache.

    Per-token points come back [batch, seq, width]; attention matrices [batch, heads, query, key].
    With grad=True the tensors form one autograd graph: a later point is differentiable with respect to an
    earlier one (residuals, branch inputs and outputs, z and its heads; see docs/ATTENTION_AND_PATCHING.md).
    """
    lm = lm_of(model)
    addrs = parse_addresses(lm, addresses)
    check_flag("grad", grad)
    if grad:  # a model autograd cannot differentiate is refused before the forward, naming what blocks it
        grad_support(lm).require("capture(grad=True)")
    many = prepare_prompts(lm, tokens_or_text)
    if many is not None:
        return _capture_many(lm, many, addrs, grad)
    ids, mask = prepare(lm, tokens_or_text)
    return _capture_ids(lm, ids, mask, addrs, grad)


def capture_batch(
    model: Any, tokens_or_text: Any, addresses: AddressLike | Iterable[AddressLike], *, grad: bool = False
) -> Cache:
    """One Cache over one batch (a [batch, seq] tensor, or texts padded by the tokenizer, with the mask in
    ``Cache.attention_mask``): for the operations that patch or compare whole batches row by row."""
    lm = lm_of(model)
    addrs = parse_addresses(lm, addresses)
    check_flag("grad", grad)
    if grad:  # a model autograd cannot differentiate is refused before the forward, naming what blocks it
        grad_support(lm).require("capture(grad=True)")
    ids, mask = prepare(lm, tokens_or_text)
    return _capture_ids(lm, ids, mask, addrs, grad)


def _capture_many(lm: Any, rows: list[torch.Tensor], addrs: list[Address], grad: bool) -> list[Cache]:
    """A list of prompts: one Cache per prompt, holding exactly that prompt's tokens (no padding).

    Without grad the prompts run as one right-padded batch: every prompt keeps its own positions 0..n-1 (and
    its steering positions), the mask hides the pads, and a causal model's real tokens never read the pads
    that follow them; each prompt's rows (and, for attention matrices, its queries and keys) are cut out.
    With grad each prompt runs alone, so each Cache is one autograd graph of its own."""
    # a mixer's final state would take in the pads after a shorter prompt: each prompt runs alone then
    if grad or any(mixer_state.is_state(a) for a in addrs):
        return [_capture_ids(lm, r, None, addrs, grad) for r in rows]
    ids, mask, lens = right_padded(rows)
    both = _capture_ids(lm, ids, mask, addrs, grad)
    out = []
    for i, (r, n) in enumerate(zip(rows, lens)):
        got = {}
        for a in addrs:
            t = both[a][i : i + 1]
            if a.point.is_attention:  # [b, heads, q, k], or [b, q, k] for one head
                got[a] = t[:, :n, :n] if a.head is not None else t[:, :, :n, :n]
            else:
                got[a] = t[:, :n]
        out.append(Cache(got, tokens=r, str_tokens=str_tokens(lm, r)))
    return out


def right_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Prompts ([1, n] each) as one right-padded batch: ids [batch, width], its attention mask, and each prompt's n.
    Each keeps its positions 0..n-1; the mask hides the pads, and a causal model's real tokens never read the pads
    after them."""
    lens = [r.shape[1] for r in rows]
    width = max(lens)
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)  # id 0: masked, never read
    for i, r in enumerate(rows):
        ids[i, : lens[i]] = r[0]
    mask = (torch.arange(width, device=ids.device)[None] < torch.tensor(lens, device=ids.device)[:, None]).long()
    return ids, mask, lens


def _capture_ids(lm: Any, ids: torch.Tensor, mask: torch.Tensor | None, addrs: list[Address], grad: bool) -> Cache:
    # mixer states are read from the cache the forward fills, not by a hook (eager.mixer_state)
    states = [a for a in addrs if mixer_state.is_state(a)]
    for a in states:
        mixer_state.check(lm, a)
        if grad:
            raise mixer_state.refuse_hooked(a, "capturing with grad=True")
    addrs_hooked = [a for a in addrs if not mixer_state.is_state(a)]
    with lm.lock:
        links = _Links(lm, addrs_hooked) if grad else None  # refuses absent points before any hook is placed
        taps = Taps(lm, [a for a in addrs_hooked if links is None or not links.serves(a)], grad=grad)
        taps.shape = (ids.shape[0], ids.shape[1])
        kwargs: dict[str, Any] = {"use_cache": False}
        run = mixer_state.StateRun(lm, states) if states else None
        if run is not None:
            kwargs = dict(run.kwargs)
        if taps.needs_output_attentions:
            kwargs["output_attentions"] = True
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx, taps, links if links is not None else contextlib.nullcontext():
            with run if run is not None else contextlib.nullcontext():
                if links is not None:
                    links.shape = taps.shape
                result = lm.hf(input_ids=ids, attention_mask=mask, **kwargs)
                if run is not None:
                    run.collect(result)
    out: dict[Address, torch.Tensor] = {}
    for a in addrs:
        if run is not None and mixer_state.is_state(a):
            out[a] = run.values[a]
            continue
        linked = links.value(a) if links is not None else None
        if linked is not None:
            if len(linked) != 1:
                raise StructureError(
                    f"{a} was seen {len(linked)} times in one forward (expected once): the module "
                    "it is read from is shared or skipped on this family, so ie_lab will not pick one."
                )
            out[a] = linked[0]
            continue
        parts = taps.collected.get(a.without_head(), [])
        if len(parts) != 1:
            raise StructureError(
                f"{a} was seen {len(parts)} times in one forward (expected once): the module it is read from "
                "is shared or skipped on this family, so ie_lab will not pick one."
            )
        out[a] = slice_head(a, parts[0], lm.facts)
    return Cache(out, tokens=ids, str_tokens=str_tokens(lm, ids), attention_mask=mask)
