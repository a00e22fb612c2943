"""Where each point is read on vLLM's module tree: the one site table the worker's hooks and graph mode's
static taps are both built from.

``bind_vllm`` (layer_binding.py: one row per layer kind) finds a model's embedding, final norm and, per layer,
the modules points are read at (``LayerSites``); ``site_table`` here turns them into one ``Site`` per point this
model has: which module, which side of its call, how to read the point off that call and, for the points steering
edits, how to hand an edited value on. worker.py hooks every site (reading and steering per request);
static_taps.py copies the declared ones into buffers inside the compiled graph. A new layer kind is therefore
taught in these two modules, once.

Reads are pure tensor work on one call (a static tap records them in the traced graph); everything per
request (rows, positions, tensor-parallel gathers) stays in the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Bound here before layer_binding.py held them: the worker imports them from this module still.
from .layer_binding import LayerSites, bind_vllm
from .layer_binding import _tp_size as _tp_size

__all__ = ["LayerSites", "Site", "bind_vllm", "hook_targets", "layer_sites", "site_table", "trunk_sites"]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _out_and_bias(mod: nn.Module, out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, bias) of a call. A vLLM linear built with skip_bias_add returns (x, bias) and leaves the add to its
    caller (Falcon): the module's output, as transformers computes it, is x + bias."""
    t = _first(out)
    if getattr(mod, "skip_bias_add", False) and isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
        return t + out[1], out[1]
    return t, None


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    raise RuntimeError("ie_lab: no hidden-state argument found")


def _set_hidden(args: tuple, kwargs: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    if "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = new
        return args, kwargs
    items = list(args)
    for i, a in enumerate(items):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            items[i] = new
            return tuple(items), kwargs
    raise RuntimeError("ie_lab: no hidden-state argument to replace")


def _fused_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual) of a call that may defer the residual add (layers and fused add+norms)."""
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    h = kwargs.get("hidden_states", kwargs.get("x", floats[0] if floats else None))
    res = kwargs.get("residual", floats[1] if len(floats) > 1 else None)
    if h is None:
        raise RuntimeError("ie_lab: no hidden-state argument found")
    return h, res


def _replace_fused_args(args: tuple, kwargs: dict, h: torch.Tensor, res: torch.Tensor) -> tuple[tuple, dict]:
    """Put the steered stream back as (stream, zeros): the consumer's deferred add gives the stream exactly."""
    items = list(args)
    kwargs = dict(kwargs)
    idx = [i for i, a in enumerate(items) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = h
    elif "x" in kwargs:
        kwargs["x"] = h
    else:
        items[idx[0]] = h
        idx = idx[1:]
    if "residual" in kwargs:
        kwargs["residual"] = res
    elif idx:
        items[idx[0]] = res
    elif len(items) >= 3 and items[2] is None:  # (positions, hidden, residual=None) on a first layer
        items[2] = res
    else:
        kwargs["residual"] = res
    return tuple(items), kwargs


class Partner:
    """The output of a module that runs before a site's module in the same layer call, for a site whose value is a
    sum the layer forms itself (Granite-MoE-shared's mlp_out: the MoE block's output plus the shared MLP's). Whoever
    installs such a site also places ``keep`` as a forward hook on ``module`` and ``drop`` as a forward hook on the
    site's module after the site's own hooks, so that the output is held only while the layer runs (a held tensor
    per layer between forwards would keep a batch's activations alive)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._held: dict[str, torch.Tensor] = {}

    def keep(self, mod: nn.Module, args: tuple, out: Any) -> None:
        self._held["out"] = _first(out)

    def drop(self, mod: nn.Module, args: tuple, out: Any) -> None:
        self._held.clear()

    def out(self) -> torch.Tensor:
        return self._held["out"]


@dataclass(frozen=True)
class Site:
    """Where one point is read: ``read(args, kwargs)`` on a pre-call site, ``read(args, out)`` on a post-call one,
    giving [tokens, width on this rank]."""

    point: str  # base address, "resid_post.3" or "embeddings"
    module: nn.Module
    side: str  # "pre" (the call's arguments) | "post" (its output)
    read: Callable[[tuple, Any], torch.Tensor]
    width: Callable[[], int | None]  # on this rank, read off vLLM's modules: asked only of declared graph taps
    # (None: the table was built without d_model, by a caller that reads no width)
    sharded: bool = False  # this rank holds a slice of the width: gathered across tensor-parallel ranks
    # Steerable points: (args, kwargs, new) -> (args, kwargs) before the call, (args, out, new) -> out after it,
    # so that what flows on is the edited value. None: read only.
    write: Callable[..., Any] | None = None
    # Another module's output that read and write need, from the same layer call (Partner); None elsewhere.
    partner: Partner | None = None

    @property
    def name(self) -> str:
        return self.point.partition(".")[0]

    @property
    def layer(self) -> int | None:
        tail = self.point.partition(".")[2]
        return int(tail) if tail else None


def _pre(a: tuple, k: dict) -> torch.Tensor:
    return _hidden(a, k)


def _post(a: tuple, o: Any) -> torch.Tensor:
    return _first(o)


def _stream(a: tuple, k: dict) -> torch.Tensor:
    """The residual entering a call that defers the add: hidden + residual."""
    h, res = _fused_args(a, k)
    return h if res is None else h + res


def _put_stream(a: tuple, k: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    """Hand the edited stream on as (stream, zeros): the callee's deferred add gives the stream exactly."""
    return _replace_fused_args(a, k, new, torch.zeros_like(new))


def _put_hidden(a: tuple, k: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    return _set_hidden(a, k, new)


def _put_in_place(a: tuple, k: dict, new: torch.Tensor) -> tuple[tuple, dict]:
    """A norm's input that the layer also keeps as its residual (explicit adds): edit the one tensor both use."""
    _hidden(a, k).copy_(new)
    return a, k


def _out(mod: nn.Module, m: float | None = None) -> Callable[[tuple, Any], torch.Tensor]:
    """A module's output (with the bias a skip_bias_add linear leaves to its caller), times m where the layer
    scales it before the residual add (Granite)."""
    if m is None:
        return lambda a, o: _out_and_bias(mod, o)[0]
    return lambda a, o: _out_and_bias(mod, o)[0] * m


def _put_out(mod: nn.Module, m: float | None = None) -> Callable[[tuple, Any, torch.Tensor], Any]:
    """The inverse of _out: the output that reads back as ``new`` (divided by m, less the caller's bias)."""

    def write(a: tuple, o: Any, new: torch.Tensor) -> Any:
        t = new if m is None else new / m
        bias = _out_and_bias(mod, o)[1]
        if bias is not None:  # the caller still adds it
            t = t - bias
        return (t,) + tuple(o[1:]) if isinstance(o, tuple) else t

    return write


def _flat_pre(a: tuple, k: dict) -> torch.Tensor:
    h = _hidden(a, k)
    return h.reshape(h.shape[0], -1)


def _flat_post(a: tuple, o: Any) -> torch.Tensor:
    t = _first(o)
    return t.reshape(t.shape[0], -1)


def _value(a: tuple, k: dict) -> torch.Tensor:
    """The attention kernel's value argument, flattened over heads."""
    v = k["value"] if "value" in k else a[2]
    return v.reshape(v.shape[0], -1)


def _half(mod: nn.Module, i: int) -> Callable[[tuple, Any], torch.Tensor]:
    """One half of a merged gate_up_proj's output: each rank holds [gate shard | up shard], so split before any
    gather and each half is reassembled from its own shards."""
    return lambda a, o: _out_and_bias(mod, o)[0].chunk(2, dim=-1)[i]


def trunk_sites(model: nn.Module, embed: Any, final: Any, d_model: int | None) -> list[Site]:
    width = lambda: d_model  # noqa: E731
    trunk: Any = getattr(model, "model", None) or getattr(model, "transformer", None)
    norm = getattr(trunk, "normalizer", None)
    # Gemma-style trunks scale the embedding outside the module on vLLM (HF scales inside it): apply the trunk's
    # normalizer so `embeddings` means the same tensor on both backends.
    out = [Site("embeddings", embed, "post", _post if norm is None else (lambda a, o: _first(o) * norm), width)]
    if final is not None:
        out.append(Site("final_norm", final, "post", _post, width))
    return out


def layer_sites(s: LayerSites, d_model: int | None) -> list[Site]:
    """Every point of one layer, in hook order: sites on the same module and side run in this order, each
    reading what the previous one handed on."""
    L = s.index
    d = lambda: d_model  # noqa: E731
    out: list[Site] = []
    if s.mixer is not None and s.mlp is None and not s.fused:
        return _explicit_mixer_block_sites(s, d)
    if s.mixer is not None and s.mlp is None:  # a mixer-only block (Mamba 2): resid_post = resid_pre + mixer_out
        mx = s.mixer
        return [
            Site(f"resid_pre.{L}", s.layer, "pre", _stream, d, write=_put_stream),
            Site(
                f"resid_post.{L}",
                s.layer,
                "post",
                lambda a, o: o[0] + o[1],
                d,
                write=lambda a, o, new: (new, torch.zeros_like(new)),
            ),
            Site(f"mixer_in.{L}", mx, "pre", _pre, d, write=_put_hidden),
            Site(f"mixer_out.{L}", mx, "post", _out(mx), d, write=_put_out(mx)),
            # no post-mixer norm or multiplier: what the mixer adds is its output
            Site(f"mixer_out_post.{L}", mx, "post", _out(mx), d, write=_put_out(mx)),
        ]
    if s.fused:  # the layer takes and returns (hidden, residual) with the add deferred
        out += [
            Site(f"resid_pre.{L}", s.layer, "pre", _stream, d, write=_put_stream),
            Site(
                f"resid_post.{L}",
                s.layer,
                "post",
                lambda a, o: o[0] + o[1],
                d,
                write=lambda a, o, new: (new, torch.zeros_like(new)),
            ),
            Site(f"resid_mid.{L}", s.mid_norm, "pre", _stream, d, write=_put_stream),
            # a fused add+norm returns (normed, new residual): the normed half is mlp_in
            Site(
                f"mlp_in.{L}",
                s.mid_norm,
                "post",
                _post,
                d,
                write=lambda a, o, new: (new, o[1]) if isinstance(o, tuple) else new,
            ),
        ]
    else:
        out += [
            Site(f"resid_pre.{L}", s.layer, "pre", _pre, d, write=_put_hidden),
            Site(f"resid_post.{L}", s.layer, "post", _out(s.layer), d, write=_put_out(s.layer)),
        ]
        if s.parallel:  # no stream between the sublayers; the MLP's own input is mlp_in, steered for it alone
            out.append(Site(f"mlp_in.{L}", s.mlp, "pre", _pre, d, write=_put_hidden))
        else:
            out.append(Site(f"resid_mid.{L}", s.mid_norm, "pre", _pre, d, write=_put_in_place))
            if s.post_norm:  # no pre-MLP norm: mid_norm is the MLP itself, whose input is mlp_in, steered alone
                out.append(Site(f"mlp_in.{L}", s.mid_norm, "pre", _pre, d, write=_put_hidden))
            else:
                out.append(Site(f"mlp_in.{L}", s.mid_norm, "post", _out(s.mid_norm), d, write=_put_out(s.mid_norm)))
    m = s.out_scale
    if s.mixer is not None:  # a mixer layer with an MLP after it (Granite-MoE-hybrid): the mixer, not attention
        out += _mixer_sites(s, d)
        if not s.mixer_beside:
            return _stream_last(s, out + _mlp_sites(s, d))
        m = s.attn_scale  # a mixer beside attention (Falcon-H1): attention's points too, with its own factor
    out.append(Site(f"attn_in.{L}", s.attn_mod, "pre", _pre, d, write=_put_hidden))
    core = s.attn_core
    kv_width = lambda: core.num_kv_heads * core.head_size  # noqa: E731
    out.append(Site(f"value.{L}", core, "pre", _value, kv_width, sharded=not s.kv_replicated))
    out.append(Site(f"z.{L}", s.o_proj, "pre", _pre, lambda: s.o_proj.input_size_per_partition, sharded=True))
    out.append(Site(f"attn_out.{L}", s.o_proj, "post", _out(s.o_proj), d, write=_put_out(s.o_proj)))
    if s.post_attn_norm is None:  # what attention adds: its output, times the layer's multiplier if any
        out.append(Site(f"attn_out_post.{L}", s.o_proj, "post", _out(s.o_proj, m), d, write=_put_out(s.o_proj, m)))
    else:
        out.append(
            Site(
                f"attn_out_post.{L}",
                s.post_attn_norm,
                "post",
                _out(s.post_attn_norm),
                d,
                write=_put_out(s.post_attn_norm),
            )
        )
    if s.q_norm is not None:
        q_width = lambda: core.num_heads * core.head_size  # noqa: E731
        for nm, mod, width, rep in (
            ("q_norm", s.q_norm, q_width, False),
            ("k_norm", s.k_norm, kv_width, s.kv_replicated),
        ):
            out += [
                Site(f"{nm}_in.{L}", mod, "pre", _flat_pre, width, sharded=not rep),
                Site(f"{nm}_out.{L}", mod, "post", _flat_post, width, sharded=not rep),
            ]
    return _stream_last(s, out + _mlp_sites(s, d))


def _explicit_mixer_block_sites(s: LayerSites, d: Callable[[], int | None]) -> list[Site]:
    """A mixer-only block whose layer adds the mixer's output to the stream itself and returns the sum (Zamba 2):
    resid_pre is the layer's input, resid_post its output, and what the mixer adds is its output (no post-mixer norm
    or multiplier)."""
    L, mx = s.index, s.mixer
    return [
        Site(f"resid_pre.{L}", s.layer, "pre", _pre, d, write=_put_hidden),
        Site(f"resid_post.{L}", s.layer, "post", _out(s.layer), d, write=_put_out(s.layer)),
        Site(f"mixer_in.{L}", mx, "pre", _pre, d, write=_put_hidden),
        Site(f"mixer_out.{L}", mx, "post", _out(mx), d, write=_put_out(mx)),
        Site(f"mixer_out_post.{L}", mx, "post", _out(mx), d, write=_put_out(mx)),
    ]


def _mixer_sites(s: LayerSites, d: Callable[[], int | None]) -> list[Site]:
    """The mixer's input and output, as transformers' mixer module takes and returns them: vLLM's input divided by
    the factor its layer applied before the module (transformers applies it inside), the output times the factor
    the layer scales it by before the add for mixer_out_post."""
    L, mx = s.index, s.mixer
    m = s.out_scale if s.mixer_scale is None else s.mixer_scale
    k = s.mixer_in_scale
    if k is None:
        out = [Site(f"mixer_in.{L}", mx, "pre", _pre, d, write=_put_hidden)]
    else:
        out = [
            Site(
                f"mixer_in.{L}",
                mx,
                "pre",
                lambda a, kw: _hidden(a, kw) / k,
                d,
                write=lambda a, kw, new: _set_hidden(a, kw, new * k),
            )
        ]
    i = s.mixer_out_arg
    if i is None:
        return out + [
            Site(f"mixer_out.{L}", mx, "post", _out(mx), d, write=_put_out(mx)),
            Site(f"mixer_out_post.{L}", mx, "post", _out(mx, m), d, write=_put_out(mx, m)),
        ]

    def put(a: tuple, o: Any, new: torch.Tensor) -> Any:
        a[i].copy_(new)  # the layer's own buffer, which it reads next: the edit is what flows on
        return o

    # an output buffer filled in place (nothing returned); no factor on these layers
    return out + [
        Site(f"mixer_out.{L}", mx, "post", lambda a, o: a[i], d, write=put),
        Site(f"mixer_out_post.{L}", mx, "post", lambda a, o: a[i], d, write=put),
    ]


def _stream_last(s: LayerSites, out: list[Site]) -> list[Site]:
    """Where mlp_out is read off the layer's own output, resid_post must run after it on that output, so that it
    reads the stream a steered mlp_out hands on."""
    if not s.mlp_from_layer:
        return out
    last = f"resid_post.{s.index}"
    return [x for x in out if x.point != last] + [x for x in out if x.point == last]


def _mlp_sites(s: LayerSites, d: Callable[[], int | None]) -> list[Site]:
    """The MLP's points of one layer (after its token mixer's)."""
    L, m = s.index, s.out_scale
    out: list[Site] = []
    if s.down_proj is not None:
        out.append(
            Site(f"mlp_act.{L}", s.down_proj, "pre", _pre, lambda: s.down_proj.input_size_per_partition, sharded=True)
        )
    if s.up_proj is not None:
        up = s.up_proj
        if s.gated:
            half = lambda: up.output_size_per_partition // 2  # noqa: E731
            out += [
                Site(f"mlp_pre.{L}", up, "post", _half(up, 0), half, sharded=True),
                Site(f"mlp_pre_linear.{L}", up, "post", _half(up, 1), half, sharded=True),
            ]
        else:
            out.append(Site(f"mlp_pre.{L}", up, "post", _out(up), lambda: up.output_size_per_partition, sharded=True))
    if s.router is not None:
        router = s.router
        out.append(
            Site(
                f"router_logits.{L}",
                router,
                "post",
                _post,
                lambda: int(getattr(router, "output_size", None) or router.weight.shape[0]),
            )
        )
    if s.mlp_from_layer:  # the layer returns (stream, resid_mid): what the MLP added is their difference
        k = 1.0 if m is None else m
        out += [
            Site(
                f"mlp_out.{L}",
                s.layer,
                "post",
                lambda a, o: (o[0] - o[1]) / k,
                d,
                write=lambda a, o, new: (o[1] + new * k, o[1]),
            ),
            Site(
                f"mlp_out_post.{L}",
                s.layer,
                "post",
                lambda a, o: o[0] - o[1],
                d,
                write=lambda a, o, new: (o[1] + new, o[1]),
            ),
        ]
        return out
    if s.mlp_side is not None:
        return out + _summed_mlp_sites(s, d)
    mo = s.mlp_out_mod or s.mlp
    m = m if s.mlp_scale is None else s.mlp_scale
    out.append(Site(f"mlp_out.{L}", mo, "post", _out(mo), d, write=_put_out(mo)))
    if s.post_mlp_norm is None:
        out.append(Site(f"mlp_out_post.{L}", mo, "post", _out(mo, m), d, write=_put_out(mo, m)))
    else:
        out.append(
            Site(
                f"mlp_out_post.{L}", s.post_mlp_norm, "post", _out(s.post_mlp_norm), d, write=_put_out(s.post_mlp_norm)
            )
        )
    return out


def _summed_mlp_sites(s: LayerSites, d: Callable[[], int | None]) -> list[Site]:
    """mlp_out and mlp_out_post where the layer adds a second MLP's output to the first's (mlp_side, called last):
    read where the second returns, as its output plus the first's from the same call (the sum the layer forms, the
    same two tensors added as eager adds them), times the layer's multiplier for mlp_out_post. Written through the
    second's output: it is handed on as the edited sum less the first's output, so the layer's own add gives the
    edited value (as eager writes it)."""
    L, side, first = s.index, s.mlp_side, Partner(s.mlp)
    out: list[Site] = []
    for name, m in ((f"mlp_out.{L}", 1.0), (f"mlp_out_post.{L}", 1.0 if s.out_scale is None else s.out_scale)):

        def read(a: tuple, o: Any, m: float = m) -> torch.Tensor:
            t = _first(o) + first.out()
            return t if m == 1.0 else t * m

        def write(a: tuple, o: Any, new: torch.Tensor, m: float = m) -> Any:
            t = (new if m == 1.0 else new / m) - first.out()
            return (t,) + tuple(o[1:]) if isinstance(o, tuple) else t

        out.append(Site(name, side, "post", read, d, write=write, partner=first))
    return out


def site_table(
    model: nn.Module,
    d_model: int | None = None,
    bound: tuple[Any, Any, list[LayerSites]] | None = None,
) -> list[Site]:
    """Every site of this model: the trunk's, then each layer's. ``bound``: bind_vllm(model), where the caller
    already has it. d_model is only needed for the widths of graph taps."""
    embed, final, layers = bound if bound is not None else bind_vllm(model)
    table = trunk_sites(model, embed, final, d_model) + [x for s in layers for x in layer_sites(s, d_model)]
    return [_unbatched(x) for x in table] if runs_transformers_modules(model) else table


def runs_transformers_modules(model: nn.Module) -> bool:
    """Whether vLLM runs transformers' own module tree for this model (its Transformers modeling backend, where vLLM
    has no model of its own for a family): the trunk it built is a transformers PreTrainedModel, with vLLM's layers
    swapped in for the linears, norms, embedding and attention kernel. Those modules keep transformers' batch axis
    ([1, tokens, ...] where vLLM's own modules take [tokens, ...]), and transformers' attention interface calls vLLM's
    attention layer's forward directly, past that module's hooks (worker.py routes it through hooks)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - vLLM depends on transformers
        return False
    return isinstance(getattr(model, "model", None), PreTrainedModel)


class KernelCall(nn.Module):
    """The forward of one of vLLM's attention layers, as a module of its own whose hooks run on every call.
    transformers' attention interface on vLLM's Transformers backend calls the layer's ``forward`` directly, so
    hooks on the layer never run; ``route`` sets this stand-in as that one layer's ``forward`` (an instance
    attribute, shadowing the class's method for this layer alone), and the sites' hooks (the worker's, graph mode's
    taps) go on the stand-in. It is kept outside the module tree: no parameters, nothing in the state dict."""

    def __init__(self, forward: Callable):
        super().__init__()
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    @classmethod
    def route(cls, layer: torch.nn.Module) -> "KernelCall":
        current = layer.__dict__.get("forward")
        if isinstance(current, cls):  # once per layer, whoever asks first (the worker, graph mode's loader)
            return current
        stand_in = cls(layer.forward)
        object.__setattr__(layer, "forward", stand_in)  # not nn.Module's setattr: no submodule is registered
        return stand_in


def hook_targets(model: nn.Module, layers: list[LayerSites]) -> dict[int, nn.Module]:
    """id(module) -> the module that module's sites are hooked on, where it is not the module itself: on vLLM's
    Transformers backend each attention layer's forward, routed through a KernelCall (installed here, once)."""
    if not runs_transformers_modules(model):
        return {}
    return {id(s.attn_core): KernelCall.route(s.attn_core) for s in layers if s.attn_core is not None}


def _strip(x: Any) -> Any:
    """A tensor of transformers' modules without its batch axis; anything else (and the 2-D tensors those modules
    flatten to, such as a router's [tokens, experts] logits) unchanged."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return x
    if x.shape[0] != 1:  # vLLM hands transformers' model all of a forward's tokens as one batch row
        raise RuntimeError(f"ie_lab: expected one batch row on vLLM's Transformers backend, got {tuple(x.shape)}")
    return x[0]


def _strip_out(o: Any) -> Any:
    return tuple(_strip(x) for x in o) if isinstance(o, tuple) else _strip(o)


def _rebatch(orig: Any, stripped: Any, new: Any) -> Any:
    """What a write hands on in place of ``stripped`` (``orig`` less its batch axis): the original where the write
    kept it (an in-place edit lands in orig through the view), a new tensor with the batch axis back where orig had
    one."""
    if new is stripped:
        return orig
    if orig is not stripped and isinstance(new, torch.Tensor):
        return new[None]
    return new


def _unbatched(site: Site) -> Site:
    """A site of transformers' modules read and written as [tokens, ...], like vLLM's own: the call's tensors lose
    their batch axis of 1 before the site's read and write, and an edit gets it back before it is handed on."""
    read, write = site.read, site.write
    if site.side == "pre":

        def read_pre(a: tuple, k: dict) -> torch.Tensor:
            return read(tuple(_strip(x) for x in a), {n: _strip(v) for n, v in k.items()})

        def write_pre(a: tuple, k: dict, new: torch.Tensor) -> tuple[tuple, dict]:
            sa, sk = tuple(_strip(x) for x in a), {n: _strip(v) for n, v in k.items()}
            assert write is not None  # only wrapped where the site has one
            na, nk = write(sa, sk, new)
            if len(na) != len(a):
                raise RuntimeError("ie_lab: a steering write changed a call's arguments on the Transformers backend")
            return (
                tuple(_rebatch(o, s, n) for o, s, n in zip(a, sa, na)),
                {n: _rebatch(k.get(n), sk.get(n), v) for n, v in nk.items()},
            )

        return Site(
            site.point, site.module, "pre", read_pre, site.width, site.sharded, None if write is None else write_pre
        )

    def read_post(a: tuple, o: Any) -> torch.Tensor:
        return read(tuple(_strip(x) for x in a), _strip_out(o))

    def write_post(a: tuple, o: Any, new: torch.Tensor) -> Any:
        so = _strip_out(o)
        assert write is not None
        no = write(tuple(_strip(x) for x in a), so, new)
        if isinstance(o, tuple) and isinstance(no, tuple) and len(no) == len(o):
            return tuple(_rebatch(x, s, n) for x, s, n in zip(o, so, no))
        return _rebatch(o, so, no)

    return Site(
        site.point, site.module, "post", read_post, site.width, site.sharded, None if write is None else write_post
    )
