"""capture(): one forward of the raw model with hooks at the requested points."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..address import Address, AddressLike
from ..cache import Cache
from ..errors import AddressError, StructureError
from .inputs import prepare, str_tokens
from .taps import Taps


def parse_addresses(lm: Any, addresses: AddressLike | Iterable[AddressLike]) -> list[Address]:
    if isinstance(addresses, (str, Address)):
        addresses = [addresses]
    if not isinstance(addresses, (list, tuple, set, frozenset)) and not hasattr(addresses, "__next__"):
        raise AddressError(f"addresses must be an address string like 'resid_post.0' or a list of them, got "
                           f"{type(addresses).__name__}.")
    out = []
    for a in addresses:
        out.append(Address.parse(a).check(lm.facts))
    if not out:
        raise AddressError("no addresses given: name at least one point, e.g. ['resid_post.0'].")
    return list(dict.fromkeys(out))


def slice_head(addr: Address, t: torch.Tensor, facts: Any) -> torch.Tensor:
    if addr.head is None:
        return t
    if addr.point.width.value == "n_heads*q*k":
        return t[:, addr.head]
    return t.reshape(*t.shape[:-1], -1, facts.head_dim)[..., addr.head, :]


def capture(model: Any, tokens_or_text: Any, addresses: AddressLike | Iterable[AddressLike], *,
            grad: bool = False) -> Cache:
    """Run one forward and return the requested points, keyed by Address.

    Per-token points come back [batch, seq, width]; attention matrices [batch, heads, query, key].
    With grad=True the tensors stay attached to the autograd graph.
    """
    from .. import _as_lm

    lm = _as_lm(model)
    addrs = parse_addresses(lm, addresses)
    ids, mask = prepare(lm, tokens_or_text)
    with lm.lock:
        taps = Taps(lm, addrs, grad=grad)  # refuses absent points before any hook is placed
        taps.shape = (ids.shape[0], ids.shape[1])
        kwargs: dict[str, Any] = {"use_cache": False}
        if taps.needs_output_attentions:
            kwargs["output_attentions"] = True
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx, taps:
            lm.hf(input_ids=ids, attention_mask=mask, **kwargs)
    out: dict[Address, torch.Tensor] = {}
    for a in addrs:
        parts = taps.collected.get(a.without_head(), [])
        if len(parts) != 1:
            raise StructureError(
                f"{a} was seen {len(parts)} times in one forward (expected once): the module it is read from "
                "is shared or skipped on this family, so ie_lab will not pick one."
            )
        out[a] = slice_head(a, parts[0], lm.facts)
    return Cache(out, tokens=ids, str_tokens=str_tokens(lm, ids), attention_mask=mask)
