"""Where each mixer layer's state is after a forward (the mixer_state / mixer_conv_state points), measured at bind.

A mixer hands its final state on to the next forward in one of three places, and the model, not its source text,
says which: a cached probe forward is run and what it wrote is looked at.

- transformers' cache: a fresh ``DynamicCache`` passed in, whose layer L holds ``recurrent_states`` /
  ``conv_states`` after the forward (Mamba, Mamba 2, gated delta nets, LFM2's convolution, ...);
- a cache of the model's own kind that the forward makes and returns, one state tuple per layer (xLSTM's
  ``rnn_state[L]``: the mLSTM's matrix memory C first, then its normaliser n and stabiliser m);
- tensors the mixer module keeps on itself (RecurrentGemma's ``rg_lru.recurrent_states`` and ``conv1d_state``):
  the attributes a cached forward set, the convolution's being the one that equals the tail of its conv's input.

Each mixer layer's ``LayerBinding.mixer_states`` maps 'recurrent' / 'conv' to where that state is
('cache:recurrent_states', 'rnn_state:0', 'module:rg_lru.recurrent_states', ...); eager.mixer_state reads it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_CACHE_FIELDS = {"recurrent": "recurrent_states", "conv": "conv_states"}
_CACHE_KEYS = ("cache", "past_key_values", "cache_params")  # Mamba's forward took cache_params before 5.2x
# where a forward's output hands its cache back ("state": RWKV's list of per-kind [batch, width, n_layers] tensors)
_OWN_CACHE_ATTRS = ("cache", "cache_params", "past_key_values", "state")
_PROBE = (2, 8)  # batch 2: a state's leading axis is the batch; 8 tokens: longer than any mixer's convolution


def mixer_of(lb: Any) -> nn.Module | None:
    """The layer's non-attention mixer: the one beside attention (Falcon-H1), or the layer's own mixer."""
    m = getattr(lb, "par_mixer", None)
    if m is None and lb.mixer_kind:
        m = lb.attn
    return m


def cache_keyword(model: nn.Module) -> str | None:
    """The keyword the model's forward takes its cache under."""
    params = inspect.signature(model.forward).parameters
    return next((k for k in _CACHE_KEYS if k in params), None)


def returned_cache(out: Any) -> Any:
    """The cache object a forward handed back in its output, or None."""
    for a in _OWN_CACHE_ATTRS:
        c = getattr(out, a, None)
        if c is not None:
            return c
    return None


def module_tensors(m: nn.Module) -> dict[str, Any]:
    """Plain attributes (not parameters, buffers or children) of the module and its submodules that hold a tensor
    or None, by dotted path: where a mixer that keeps its state on itself puts it."""
    out: dict[str, Any] = {}
    for prefix, sub in m.named_modules():
        for k, v in vars(sub).items():
            if not k.startswith("_") and (v is None or isinstance(v, torch.Tensor)):
                out[f"{prefix}.{k}" if prefix else k] = v
    return out


def set_path(m: nn.Module, path: str, value: Any) -> None:
    host, _, name = path.rpartition(".")
    setattr(m.get_submodule(host) if host else m, name, value)


def get_path(m: nn.Module, path: str) -> Any:
    host, _, name = path.rpartition(".")
    return getattr(m.get_submodule(host) if host else m, name, None)


@contextlib.contextmanager
def kept_module_states(mixers: list[nn.Module]) -> Iterator[None]:
    """Put back every tensor attribute the mixers held before (a cached forward leaves its states on them), so the
    model is exactly as before whatever happens inside."""
    saved = [(m, module_tensors(m)) for m in mixers]
    try:
        yield
    finally:
        for m, attrs in saved:
            for path, v in attrs.items():
                set_path(m, path, v)


@torch.no_grad()
def measure(model: nn.Module, binding: Any) -> None:
    """Set ``mixer_states`` on each mixer layer of the binding from two cached probe forwards (the first with
    transformers' DynamicCache, the second, where that wrote no mixer state, with the cache the model makes)."""
    mixers = [(lb, m) for lb in binding.layers if (m := mixer_of(lb)) is not None]
    if not mixers:
        return
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(4242)
    ids = torch.randint(0, max(2, binding.facts.vocab_size), _PROBE, generator=gen).to(device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with kept_module_states([m for _, m in mixers]):
            found = _in_dynamic_cache(model, ids, mixers)
            if not any(found.values()):
                found = _in_own_cache_or_module(model, ids, mixers)
            if not any(found.values()):
                found = _in_returned_state(model, ids, mixers)
    finally:
        for m, flag in modes:
            m.training = flag
    for lb, _ in mixers:
        lb.mixer_states = found.get(lb.index, {})


def _in_dynamic_cache(model: nn.Module, ids: torch.Tensor, mixers: list) -> dict[int, dict[str, str]]:
    """Which layers' entries of a fresh DynamicCache the forward wrote a mixer state into."""
    from transformers import DynamicCache

    key = cache_keyword(model)
    if key is None:
        return {}
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, **{key: cache})
    except Exception:  # noqa: BLE001 - a model that takes no DynamicCache keeps its states elsewhere (measured next)
        return {}
    layers = getattr(cache, "layers", None) or []
    found: dict[int, dict[str, str]] = {}
    for lb, _ in mixers:
        layer = layers[lb.index] if lb.index < len(layers) else None
        for kind, fld in _CACHE_FIELDS.items():
            states = getattr(layer, fld, None)
            if isinstance(states, dict) and any(_is_state(t, ids) for t in states.values()):
                found.setdefault(lb.index, {})[kind] = f"cache:{fld}"
    return found


def _in_own_cache_or_module(model: nn.Module, ids: torch.Tensor, mixers: list) -> dict[int, dict[str, str]]:
    """Run with use_cache=True and no cache: the states the model's own returned cache holds per layer, else the
    tensors the cached forward left on the mixer modules."""
    convs: dict[int, torch.Tensor] = {}  # id(conv module) -> its input in this forward

    def keep_input(m: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            convs[id(m)] = args[0].detach()

    before = {lb.index: module_tensors(m) for lb, m in mixers}  # held, so a new tensor cannot reuse an old one's id
    handles = [
        c.register_forward_pre_hook(keep_input) for _, m in mixers for c in m.modules() if isinstance(c, nn.Conv1d)
    ]
    out = _cached_forward(model, ids, handles)
    if out is None:
        return {}
    found: dict[int, dict[str, str]] = {}
    own = returned_cache(out)
    per_layer = getattr(own, "rnn_state", None)
    if isinstance(per_layer, dict):
        for lb, _ in mixers:
            tup = per_layer.get(lb.index)
            if isinstance(tup, (tuple, list)) and tup and _is_state(tup[0], ids):
                found[lb.index] = {"recurrent": "rnn_state:0"}  # xLSTM: (C, n, m), the matrix memory first
        return found
    linear = getattr(own, "linear_cache", None)
    if isinstance(linear, list):  # MiniMax's own cache: each lightning layer's key-value state, by layer index
        for lb, _ in mixers:
            if lb.index < len(linear) and _is_state(linear[lb.index], ids):
                found[lb.index] = {"recurrent": "linear_cache:"}
        return found
    for lb, m in mixers:
        written = {p: v for p, v in module_tensors(m).items() if _is_state(v, ids) and v is not before[lb.index].get(p)}
        conv_inputs = [convs[id(c)] for c in m.modules() if id(c) in convs]
        conv = [p for p, v in written.items() if any(_tail_of(v, x) for x in conv_inputs)]
        rest = [p for p in written if p not in conv]
        kinds: dict[str, str] = {}
        if len(conv) == 1:
            kinds["conv"] = f"module:{conv[0]}"
        if len(rest) == 1:  # more than one left: which is the recurrent state would be a guess
            kinds["recurrent"] = f"module:{rest[0]}"
        if kinds:
            found[lb.index] = kinds
    return found


def _cached_forward(model: nn.Module, ids: torch.Tensor, handles: list) -> Any:
    """The model's cached forward with the probe's hooks in place, which it always removes; None when the model has
    no cached forward at all (no state to serve: the registry refuses the points)."""
    try:
        return model(input_ids=ids, use_cache=True)
    except Exception:  # noqa: BLE001 - any failure means the same: nothing measured
        return None
    finally:
        for h in handles:
            h.remove()


def _is_state(t: Any, ids: torch.Tensor) -> bool:
    """A per-sequence tensor: batch-leading, at least a vector per sequence."""
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == ids.shape[0]


def _tail_of(state: torch.Tensor, conv_input: torch.Tensor) -> bool:
    """The state is the last positions of the convolution's input [batch, channels, seq]: a convolution state."""
    if conv_input.dim() != 3 or state.dim() != 3 or state.shape[:2] != conv_input.shape[:2]:
        return False
    w = state.shape[-1]
    return 0 < w <= conv_input.shape[-1] and torch.equal(state, conv_input[..., -w:].to(state.dtype))


def _in_returned_state(model: nn.Module, ids: torch.Tensor, mixers: list) -> dict[int, dict[str, str]]:
    """A forward that returns its state as a list of [batch, width, n_layers] tensors, layer L's slice [..., L] of
    each (RWKV's five: the channel mix's and the time mix's last inputs, then the WKV numerator, denominator and
    running maximum). Measured per entry: one equal to the mixer's input at the last position is its token shift's
    state (a width-2 causal convolution's, 'conv': 'state:k'); one equal to another module's input on the layer at the
    last position belongs to that module (the channel mix's token shift), not the mixer; the rest, together and in
    order, are the mixer's recurrent state ('recurrent': 'state:i,j,...')."""
    last: dict[tuple[int, str], list[torch.Tensor]] = {}  # (layer, "mixer" | "other") -> inputs at the last position

    def keep(key: tuple[int, str]):
        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            t = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(t, torch.Tensor) and t.dim() == 3:
                last.setdefault(key, []).append(t[:, -1].detach().clone())

        return pre

    handles = []
    for lb, m in mixers:
        handles.append(m.register_forward_pre_hook(keep((lb.index, "mixer")), with_kwargs=True))
        for c in lb.layer.children():
            if c is not m and not isinstance(c, nn.ModuleList):
                handles.append(c.register_forward_pre_hook(keep((lb.index, "other")), with_kwargs=True))
    out = _cached_forward(model, ids, handles)
    if out is None:
        return {}
    state = getattr(out, "state", None)
    if not isinstance(state, (list, tuple)) or not state:
        return {}
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == ids.shape[0] for t in state):
        return {}

    def among(x: torch.Tensor, ts: list[torch.Tensor]) -> bool:
        return any(t.shape == x.shape and torch.equal(t.to(x.dtype), x) for t in ts)

    found: dict[int, dict[str, str]] = {}
    for lb, _ in mixers:
        L = lb.index
        mine, other = last.get((L, "mixer"), []), last.get((L, "other"), [])
        if not mine or any(t.shape[-1] <= L for t in state):
            continue
        conv = [k for k, t in enumerate(state) if among(t[..., L], mine)]
        rest = [k for k, t in enumerate(state) if not among(t[..., L], mine + other)]
        kinds: dict[str, str] = {}
        if len(conv) == 1:
            kinds["conv"] = f"state:{conv[0]}"
        if rest:
            kinds["recurrent"] = "state:" + ",".join(str(k) for k in rest)
        if kinds:
            found[L] = kinds
    return found
