"""Addresses: the standard name of one captured tensor, e.g. ``resid_post.10`` or ``z.3.head-2``.

Grammar: ``name[.layer][.head-H][.stream-S]``. Parsing checks everything that can be checked without
a model (name, scope, which coordinates a point accepts); ranges are checked against a model's
facts by :meth:`Address.check`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import points as _points
from .errors import AddressError, plural, shown, shown_value
from .points import Scope

if TYPE_CHECKING:
    from .arch.config_facts import ArchFacts

# ASCII digits only: str.isdigit and \d also accept '²' or Arabic-Indic '١', which int() then rejects or reads
# as a number the user never typed.
_LAYER = re.compile(r"[0-9]+")
_HEAD = re.compile(r"head-([0-9]+)")
_STREAM = re.compile(r"stream-([0-9]+)")

# No model has a billion layers, heads or streams; a longer number is refused before int() reads it (int() itself
# refuses past 4300 digits with a ValueError, and such a number could not be printed in a message either).
_MAX_COORD = 10**9
_MAX_DIGITS = 9


def _too_big(coord: str, digits: str, where: str) -> AddressError:
    return AddressError(
        f"the {coord} in {where} is a number of {digits} digits; no model has {_MAX_COORD:,} {coord}s: write the "
        f"{coord} as a number from 0 to the model's count minus one, e.g. 'resid_post.3', 'z.3.head-2'."
    )


def _coord(digits: str, coord: str, raw: str) -> int:
    if len(digits.lstrip("0")) > _MAX_DIGITS:
        raise _too_big(coord, str(len(digits)), f"address {shown(raw)}")
    return int(digits)


@dataclass(frozen=True, order=True)
class Address:
    name: str
    layer: int | None = None
    head: int | None = None
    stream: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise AddressError(
                f"an address's name is a point name string like 'resid_post', got {type(self.name).__name__}."
            )
        point = _points.get(self.name)  # raises with a suggestion for unknown names
        for coord in ("layer", "head", "stream"):
            value = getattr(self, coord)
            if value is None:
                continue
            if not isinstance(value, int) and not isinstance(value, bool) and hasattr(value, "__index__"):
                try:  # numpy / torch integer scalars: store the plain int (hashing and equality follow it)
                    value = value.__index__()
                    object.__setattr__(self, coord, value)
                except TypeError:
                    pass
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                if isinstance(value, int) and not isinstance(value, bool) and value <= -_MAX_COORD:
                    raise _too_big(coord, f"about {int(abs(value).bit_length() * 0.30103) + 1}", repr(self.name))
                raise AddressError(
                    f"{self.name}: {coord} must be a non-negative integer, got {value!r} ({type(value).__name__})."
                )
            if value >= _MAX_COORD:  # printed by its number of digits: str() of it can fail past 4300 of them
                raise _too_big(coord, f"about {int(abs(value).bit_length() * 0.30103) + 1}", repr(self.name))
        if point.scope is Scope.TRUNK and self.layer is not None:
            raise AddressError(
                f"{self.name!r} is a trunk point (one per forward), so it takes no layer: write {self.name!r}, "
                f"not '{self.name}.{self.layer}'."
            )
        if point.scope is Scope.LAYER and self.layer is None:
            raise AddressError(f"{self.name!r} exists once per layer: add the layer, e.g. '{self.name}.0'.")
        if self.head is not None and not point.head_axis:
            head_points = ", ".join(p.name for p in _points.all_points() if p.head_axis)
            raise AddressError(
                f"{self.name!r} is {point.width.value} wide and has no head axis, so '.head-{self.head}' cannot "
                f"select anything. Head coordinates apply to: {head_points}."
            )
        if self.stream is not None and not point.per_stream:
            # the hyper-connection points (resid_streams, the collapses, writes and mixes) are one tensor per layer
            # spanning every stream; the sublayer points exchange a single d_model vector per token
            stream_points = ", ".join(p.name for p in _points.all_points() if p.per_stream)
            raise AddressError(
                f"{self.name!r} has no stream coordinate; '.stream-S' applies to {stream_points} on trunks "
                "with several residual streams."
                + (" It already spans every stream: drop the '.stream-S'." if point.multi_stream_only else "")
            )

    @property
    def point(self) -> _points.Point:
        return _points.REGISTRY[self.name]

    @classmethod
    def parse(cls, text: str | "Address") -> "Address":
        if isinstance(text, Address):
            return text
        if not isinstance(text, str):
            raise AddressError(f"an address is a string like 'resid_post.3', got {type(text).__name__}.")
        raw = text.strip()
        if not raw:
            raise AddressError("empty address; write e.g. 'resid_post.3' or 'embeddings'.")
        parts = raw.split(".")
        name, rest = parts[0], parts[1:]
        _points.get(name, raw[len(name) :])  # unknown name: the nearest ones before looking at coordinates
        layer = head = stream = None
        i = 0
        if i < len(rest) and _LAYER.fullmatch(rest[i]):
            layer = _coord(rest[i], "layer", raw)
            i += 1
        if i < len(rest) and (m := _HEAD.fullmatch(rest[i])):
            head = _coord(m.group(1), "head", raw)
            i += 1
        if i < len(rest) and (m := _STREAM.fullmatch(rest[i])):
            stream = _coord(m.group(1), "stream", raw)
            i += 1
        if i < len(rest):
            bad = rest[i]
            hint = ""
            if any(ch.isdigit() and ch not in "0123456789" for ch in bad):
                hint = " Write numbers with the ASCII digits 0-9."
            elif bad.lstrip("-").isdigit():
                hint = " Layers are non-negative integers."
            elif bad.startswith("head") or bad.startswith("stream"):
                hint = f" Write it as '{bad.split('-')[0].rstrip('0123456789')}-N' (e.g. 'head-2'), after the layer."
            raise AddressError(
                f"cannot read {shown(bad)} in address {shown(raw)}: expected name[.layer][.head-H][.stream-S], "
                f"e.g. 'resid_post.3', 'z.3.head-2', 'embeddings'.{hint}"
            )
        return cls(name, layer, head, stream)

    def __str__(self) -> str:
        out = self.name
        if self.layer is not None:
            out += f".{self.layer}"
        if self.head is not None:
            out += f".head-{self.head}"
        if self.stream is not None:
            out += f".stream-{self.stream}"
        return out

    def __repr__(self) -> str:
        return f"Address('{self}')"

    def _repr_html_(self) -> str:
        p = self.point
        return f"<code>{self}</code> <small>({p.width.value}) — {p.definition}</small>"

    def without_head(self) -> "Address":
        return Address(self.name, self.layer, None, self.stream)

    def check(self, facts: "ArchFacts") -> "Address":
        """Check coordinate ranges against a model's facts; returns self for chaining."""
        if self.layer is not None and self.layer >= facts.n_layers:
            raise AddressError(
                f"layer {self.layer} is out of range in {str(self)!r}: this model has {plural(facts.n_layers, 'layer')} "
                f"(0..{facts.n_layers - 1}). Negative layers are not accepted; write {facts.n_layers - 1} for the last."
            )
        if self.head is not None:
            n = facts.n_kv_heads if self.point.width is _points.Width.KV_HEADS else facts.n_heads
            kind = "key/value heads" if self.point.width is _points.Width.KV_HEADS else "heads"
            if self.head >= n:
                raise AddressError(
                    f"head {self.head} is out of range in {str(self)!r}: {self.name} has {n} {kind} (0..{n - 1})."
                )
        if self.stream is not None and facts.n_streams <= 1:
            raise AddressError(
                f"{str(self)!r} names a stream, but this trunk carries a single residual stream: drop '.stream-{self.stream}'."
            )
        if self.stream is not None and self.stream >= facts.n_streams:
            raise AddressError(
                f"stream {self.stream} is out of range in {str(self)!r}: this trunk has {facts.n_streams} residual stream(s)."
            )
        return self


AddressLike = str | Address


def as_address(a: AddressLike) -> Address:
    return Address.parse(a)


def layer_list(layers: object, facts: "ArchFacts", *, arg: str = "layers") -> list[int]:
    """A user's layer selection as a checked list: None (every layer), one layer, or a list of distinct layers,
    each an integer in 0..n_layers-1. Everything else is refused naming `arg`, before any work starts."""
    n = facts.n_layers
    if layers is None:
        return list(range(n))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        layers = [layers]
    try:
        items = list(layers)  # type: ignore[call-overload]
    except TypeError:
        items = [layers]
    out: list[int] = []
    for x in items:
        value = x
        if not isinstance(x, (bool, float, str, bytes)) and hasattr(x, "__index__"):
            try:
                value = x.__index__()
            except TypeError:
                value = x
        if isinstance(value, bool) or not isinstance(value, int):
            raise AddressError(
                f"{arg} must be layer numbers (integers 0..{n - 1}) or None for all; got {shown_value(x)} "
                f"({type(x).__name__}) in {arg}."
            )
        if not 0 <= value < n:
            raise AddressError(
                f"{arg} contains {shown_value(value)}, but this model has {plural(n, 'layer')} (0..{n - 1}). Negative layers "
                f"are not accepted; write {n - 1} for the last."
            )
        if value in out:
            raise AddressError(f"{arg} names layer {value} twice; list each layer once.")
        out.append(value)
    if not out:
        raise AddressError(f"{arg} is empty: name at least one layer (0..{n - 1}), or pass None for every layer.")
    return out
