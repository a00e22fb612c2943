"""The attention viewer: ``session.show_attention(prompt, layers=None)``.

Head thumbnails for one layer and the selected head's full pattern, both sent as binary buffers
(uint8 thumbnails, float32 pattern); a layer's probabilities are captured only when that layer is
first shown, and other heads are fetched when clicked. The whole [layers, heads, q, k] tensor never
leaves the kernel.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import traitlets

from ..address import layer_list
from ..errors import AddressError, InputError, plural
from . import _base, _static

THUMB = 32  # thumbnail side in cells (patterns are max-pooled down to it)


def _thumbs(probs: torch.Tensor, side: int) -> bytes:
    """[heads, q, k] -> uint8 [heads, side, side], max-pooled, each head scaled to its own maximum."""
    x = probs.detach().float().cpu()
    t = torch.nn.functional.adaptive_max_pool2d(x[:, None], (side, side))[:, 0]
    top = t.flatten(1).amax(1).clamp_min(1e-12)[:, None, None]
    return (t / top * 255).round().clamp(0, 255).to(torch.uint8).numpy().tobytes()


class AttentionViewer(_base.Panel):
    """Thumbnails of every head of one layer; the large pattern of the selected head, with token labels."""

    _esm = _static.bundle("attention.js")
    COMMANDS = {"select": {"layer": _base.integer(0, 1 << 16), "head": _base.integer(0, 1 << 16)}}

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    layers = traitlets.List(traitlets.Int()).tag(sync=True)
    n_heads = traitlets.Int(0).tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    head = traitlets.Int(0).tag(sync=True)
    thumb_side = traitlets.Int(THUMB).tag(sync=True)
    thumbs = traitlets.Bytes(b"").tag(sync=True)
    pattern = traitlets.Bytes(b"").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        fetch: Callable[[int], torch.Tensor],
        tokens: list[str],
        layers: list[int],
        n_heads: int,
        *,
        layer: int | None = None,
        head: int = 0,
        title: str = "",
    ):
        self._fetch = fetch
        self._cache: "collections.OrderedDict[int, torch.Tensor]" = collections.OrderedDict()
        layer = layers[0] if layer is None else int(layer)
        if layer not in layers:
            raise InputError(f"layer {layer} is not among the layers shown ({layers}).")
        if not 0 <= head < n_heads:
            raise InputError(f"head {head} is out of range: this model has {plural(n_heads, 'head')}.")
        side = max(1, min(THUMB, len(tokens)))
        super().__init__(tokens=list(tokens), layers=list(layers), n_heads=n_heads, thumb_side=side, title=title)
        self.show(layer, head)

    def _probs(self, layer: int) -> torch.Tensor:
        if layer not in self._cache:
            p = self._fetch(layer)
            if p.dim() != 3 or p.shape[0] != self.n_heads:
                raise InputError(f"attention for layer {layer} has shape {list(p.shape)}, expected [heads, q, k].")
            self._cache[layer] = p.detach().float().cpu()
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        self._cache.move_to_end(layer)
        return self._cache[layer]

    def show(self, layer: int, head: int) -> None:
        """Show one head (fetching its layer if it is not the one on screen)."""
        if layer not in self.layers:
            raise InputError(f"layer {layer} is not among the layers shown ({self.layers}).")
        if not 0 <= head < self.n_heads:
            raise InputError(f"head {head} is out of range: this model has {plural(self.n_heads, 'head')}.")
        probs = self._probs(layer)
        with self.hold_sync():
            if layer != self.layer or not self.thumbs:
                self.thumbs = _thumbs(probs, self.thumb_side)
            self.pattern = probs[head].contiguous().numpy().astype("<f4").tobytes()
            self.layer, self.head = layer, head
            self.error = ""

    def head_pattern(self) -> torch.Tensor:
        """The pattern on screen, [q, k] float32."""
        import numpy as np

        q = len(self.tokens)
        return torch.from_numpy(np.frombuffer(self.pattern, dtype="<f4").copy()).reshape(q, q)

    def on_select(self, layer: int, head: int) -> None:
        if layer not in self.layers or head >= self.n_heads:
            self._reject(f"no layer {layer} / head {head} here (layers {self.layers}, {plural(self.n_heads, 'head')})")
            return
        self.show(layer, head)

    def __repr__(self) -> str:
        return (
            f"AttentionViewer({self.title or 'attention'}: {plural(len(self.tokens), 'token')}, layers {self.layers}, "
            f"{plural(self.n_heads, 'head')}; showing layer {self.layer} head {self.head})"
        )


def for_session(
    session: Any, prompt: Any, layers: Any = None, *, layer: int | None = None, head: int = 0
) -> AttentionViewer:
    facts = session.facts  # refuses a closed session
    try:
        chosen = layer_list(layers, facts)
    except AddressError as e:  # the viewer's arguments are InputErrors, as they always were
        raise InputError(str(e)) from None
    for name, value in (("layer", layer), ("head", head)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{name} must be an integer (or None), got {value!r} ({type(value).__name__}).")
    ids = session.tokens(prompt)  # text, token ids or a conversation, checked as every operation checks them
    if ids.shape[0] != 1:
        raise InputError("the attention viewer shows one prompt; pass a single text or one row of ids.")
    tokens = session.to_str_tokens(ids)[0]

    def fetch(L: int) -> torch.Tensor:
        return session.capture(ids, [f"attn_probs.{L}"])[f"attn_probs.{L}"][0]

    return AttentionViewer(
        fetch, tokens, chosen, facts.n_heads, layer=layer, head=head, title=facts.model_type
    )  # the repr adds the token count
