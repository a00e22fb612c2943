"""The mixer-state points (mixer_state, mixer_conv_state): the states a state-space, gated-delta or convolution
mixer hands on to the next forward through transformers' own cache.

They are not read by a hook: capture runs the forward with a fresh cache of transformers' own kind and, after it,
reads what each mixer wrote there for its layer. No position axis, so one capture per prompt and no steering; and
never written (an edited state would only matter to a later forward, which capture does not run).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import points as _points
from ..address import Address
from ..errors import CapabilityUnsupported, StructureError

NAMES = ("mixer_state", "mixer_conv_state")
_FIELD = {"mixer_state": "recurrent_states", "mixer_conv_state": "conv_states"}


def is_state(addr: Address) -> bool:
    return addr.name in NAMES


def check(lm: Any, addr: Address) -> None:
    """Refuse an absent state point (attention layer, a mixer without that state) before anything runs."""
    _points.require_present(addr.point, _points.Structure.from_binding(lm.binding), addr.layer, label=str(addr))


def refuse_hooked(addr: Address, what: str) -> CapabilityUnsupported:
    """For the operations that read or write points through module hooks (steering, writing, patching)."""
    return CapabilityUnsupported(
        f"{what} {addr}",
        f"{addr.name} is the mixer's final state, read from transformers' cache after the forward (capture only): no "
        "module boundary carries it where a changed value would flow on, and it has no position axis to steer",
        f"capture it with ie_lab.capture (backend='eager'), and write or steer mixer_in.{addr.layer} / "
        f"mixer_out.{addr.layer}, from which the mixer builds it",
    )


def forward_kwargs(lm: Any) -> tuple[dict[str, Any], Any]:
    """The keyword arguments that make the forward fill a fresh cache, and that cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.hf.config)
    params = inspect.signature(lm.hf.forward).parameters
    # Mamba's forward took cache_params before transformers renamed every model's cache keyword to `cache`
    key = next((k for k in ("cache", "past_key_values", "cache_params") if k in params), None)
    if key is None:
        raise CapabilityUnsupported(
            "mixer_state / mixer_conv_state",
            f"{lm.binding.family}'s forward takes no cache, so no mixer state is handed on to read",
            "capture mixer_out",
        )
    return {"use_cache": True, key: cache}, cache


def read(lm: Any, cache: Any, addr: Address) -> torch.Tensor:
    """What the layer's mixer wrote into the cache in the forward just run (a copy: the cache is then dropped)."""
    layers = getattr(cache, "layers", None)
    L = addr.layer
    assert L is not None
    layer = layers[L] if layers is not None and L < len(layers) else None
    states = getattr(layer, _FIELD[addr.name], None)
    if not isinstance(states, dict) or not states:
        raise StructureError(
            f"{addr}: transformers' cache has no {_FIELD[addr.name]} for layer {L} on {lm.binding.family} "
            f"(its cache layer is {type(layer).__name__}), so ie_lab has no state the mixer wrote to return."
        )
    if len(states) != 1:
        raise CapabilityUnsupported(
            str(addr),
            f"layer {L}'s mixer keeps {len(states)} separate {_FIELD[addr.name]} in the cache (one per convolved "
            "projection), and ie_lab does not address them one by one yet",
            f"capture mixer_out.{L}",
        )
    t = states[0]
    if t is None:
        raise StructureError(f"{addr}: layer {L}'s mixer wrote no {_FIELD[addr.name]} into the cache in this forward.")
    return t.detach().clone()
