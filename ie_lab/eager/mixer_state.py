"""The mixer-state points (mixer_state, mixer_conv_state): the states a state-space, gated-delta, recurrent or
convolution mixer hands on to the next forward.

They are not read by a hook: capture runs the forward with a cache, and after it reads each state where the binder
measured the mixer leaves it (arch.mixer_states): in a fresh transformers cache of transformers' own kind, in the
cache the model makes and returns (xLSTM), or on the mixer module itself (RecurrentGemma), whose attributes are then
put back as they were. No position axis, so one capture per prompt and no steering; and never written (an edited
state would only matter to a later forward, which capture does not run).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import points as _points
from ..address import Address
from ..arch import mixer_states as _where
from ..errors import CapabilityUnsupported, StructureError

NAMES = ("mixer_state", "mixer_conv_state")
_KIND = {"mixer_state": "recurrent", "mixer_conv_state": "conv"}


def is_state(addr: Address) -> bool:
    return addr.name in NAMES


def check(lm: Any, addr: Address) -> None:
    """Refuse an absent state point (attention layer, a mixer without that state) before anything runs."""
    _points.require_present(addr.point, _points.Structure.from_binding(lm.binding), addr.layer, label=str(addr))


def refuse_hooked(addr: Address, what: str) -> CapabilityUnsupported:
    """For the operations that read or write points through module hooks (steering, writing, patching)."""
    return CapabilityUnsupported(
        f"{what} {addr}",
        f"{addr.name} is the mixer's final state, read after the forward from where the mixer leaves it (capture "
        "only): no "
        "module boundary carries it where a changed value would flow on, and it has no position axis to steer",
        f"capture it with ie_lab.capture (backend='eager'), and write or steer mixer_in.{addr.layer} / "
        f"mixer_out.{addr.layer}, from which the mixer builds it",
    )


def _where_of(lm: Any, addr: Address) -> str:
    assert addr.layer is not None
    return lm.binding.layers[addr.layer].mixer_states[_KIND[addr.name]]


class StateRun:
    """One forward that leaves the requested states where the binder measured they go, and their copies after it.

    Use as a context manager around the forward, then ``collect(output)`` inside it: on leaving, every state the
    forward left on a mixer module is put back as it was before (the model is exactly as before)."""

    def __init__(self, lm: Any, addrs: list[Address]) -> None:
        self.lm = lm
        self.addrs = addrs
        self.values: dict[Address, torch.Tensor] = {}
        self.cache: Any = None
        in_cache = {_where_of(lm, a).startswith("cache:") for a in addrs}
        self.kwargs: dict[str, Any] = {"use_cache": True}
        if True in in_cache:
            from transformers import DynamicCache

            key = _where.cache_keyword(lm.hf)
            if key is None or len(in_cache) > 1:
                raise CapabilityUnsupported(
                    "mixer_state / mixer_conv_state",
                    f"{lm.binding.family}'s mixers hand their states on through more than one kind of cache, or its "
                    "forward takes no cache, so no one forward leaves every state asked for",
                    "capture each layer's state on its own",
                )
            self.cache = DynamicCache(config=lm.hf.config)
            self.kwargs[key] = self.cache
        self._kept = _where.kept_module_states(
            [m for lb in lm.binding.layers if (m := _where.mixer_of(lb)) is not None and lb.mixer_states]
        )

    def __enter__(self) -> "StateRun":
        self._kept.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._kept.__exit__(*exc)

    def collect(self, output: Any) -> None:
        """Copy each requested state out of where the forward just left it (before the module's are put back)."""
        cache = self.cache if self.cache is not None else _where.returned_cache(output)
        for a in self.addrs:
            self.values[a] = self._read(cache, a)

    def _read(self, cache: Any, addr: Address) -> torch.Tensor:
        L = addr.layer
        assert L is not None
        where = _where_of(self.lm, addr)
        family = self.lm.binding.family
        src, _, what = where.partition(":")
        t: Any = None
        if src == "module":
            t = _where.get_path(_where.mixer_of(self.lm.binding.layers[L]), what)  # type: ignore[arg-type]
        elif src == "rnn_state":
            per_layer = getattr(cache, "rnn_state", None) or {}
            t = per_layer[L][int(what)] if L in per_layer else None
        elif src == "linear_cache":  # MiniMax's own cache: layer L's entry (an empty list on attention layers)
            per_index = getattr(cache, "linear_cache", None) or []
            t = per_index[L] if L < len(per_index) else None
        elif src == "state":  # RWKV's returned list: layer L's slice of each listed entry, stacked on a last axis
            idx = [int(k) for k in what.split(",")]
            if isinstance(cache, (list, tuple)) and all(k < len(cache) for k in idx):
                t = torch.stack([cache[k][..., L] for k in idx], dim=-1)
        else:
            layers = getattr(cache, "layers", None)
            layer = layers[L] if layers is not None and L < len(layers) else None
            states = getattr(layer, what, None)
            if not isinstance(states, dict) or not states:
                raise StructureError(
                    f"{addr}: transformers' cache has no {what} for layer {L} on {family} (its cache layer is "
                    f"{type(layer).__name__}), so ie_lab has no state the mixer wrote to return."
                )
            if len(states) != 1:
                raise CapabilityUnsupported(
                    str(addr),
                    f"layer {L}'s mixer keeps {len(states)} separate {what} in the cache (one per convolved "
                    "projection), and ie_lab does not address them one by one yet",
                    f"capture mixer_out.{L}",
                )
            t = states[0]
        if not isinstance(t, torch.Tensor):
            raise StructureError(f"{addr}: layer {L}'s mixer left no state at {where} in this forward on {family}.")
        return t.detach().clone()
