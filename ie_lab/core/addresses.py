"""Addresses as operations take them: parsing a user's list against a model's facts, and cutting out one head.

Neutral: both read only the grammar (ie_lab/address.py) and the model's facts, so every backend accepts the
same addresses and returns a head's slice in the same layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..address import Address, AddressLike
from ..errors import AddressError
from ..points import Width


def parse_addresses(lm: Any, addresses: AddressLike | Iterable[AddressLike]) -> list[Address]:
    if isinstance(addresses, (str, Address)):
        addresses = [addresses]
    if not isinstance(addresses, (list, tuple, set, frozenset)) and not hasattr(addresses, "__next__"):
        raise AddressError(
            f"addresses must be an address string like 'resid_post.0' or a list of them, got "
            f"{type(addresses).__name__}."
        )
    out = []
    for a in addresses:
        out.append(Address.parse(a).check(lm.facts))
    if not out:
        raise AddressError("no addresses given: name at least one point, e.g. ['resid_post.0'].")
    return list(dict.fromkeys(out))


def slice_head(addr: Address, t: torch.Tensor, facts: Any) -> torch.Tensor:
    if addr.head is None:
        return t
    if addr.point.is_attention:
        return t[:, addr.head]
    if addr.point.width is Width.HEADS_D_MODEL:  # [batch, seq, heads, d_model]: the head axis is its own
        return t[..., addr.head, :]
    return t.reshape(*t.shape[:-1], head_count(addr, facts), -1)[..., addr.head, :]


def head_count(addr: Address, facts: Any) -> int:
    """How many heads a head-axis point's width splits into. A head is that width over the count, not head_dim:
    latent attention's value heads (z, value) are wider than its query heads."""
    return int(facts.n_kv_heads if addr.point.width is Width.KV_HEADS else facts.n_heads)
