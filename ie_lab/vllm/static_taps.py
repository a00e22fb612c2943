"""Graph mode: static taps compiled into vLLM's graph for a set of points declared at engine start.

With ``enforce_eager=False`` vLLM traces the model's trunk once (torch.compile) and, on GPUs, replays it
from CUDA graphs: Python hooks inside the trunk run only while it is traced, never afterwards. A static tap
is therefore pure tensor work that the trace records: ``buffer[:n].copy_(tensor)`` into a buffer allocated
before tracing (fixed address, room for the largest batch). Everything per request (which rows belong to
whom, positions, tensor-parallel gathers) happens outside the trunk, in the worker's hooks on the top-level
model, which stay Python on every step (vLLM graphs the trunk piecewise; ie_lab asks for PIECEWISE).

Taps must be in place before vLLM traces the model, which happens while the engine is built, before any
``collective_rpc`` can reach the worker. So graph mode loads the weights through a model loader of its own
(``load_format="ie_lab_static"``): vLLM's safetensors loader, then the taps. The declared points travel in
``model_loader_extra_config``. A tick/echo pair checks on every step that the taps really ran in the
compiled graph (a stale compile cache or a fully graphed forward would skip them): a forward whose echo is
stale raises instead of returning nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

LOAD_FORMAT = "ie_lab_static"
CONFIG_KEY = "ie_lab_static_points"

# Points a static tap can read: a pure function of one module's input or output. attn_scores / attn_probs
# (rebuilt from all q/k of a request), steering and the logit lens need per-request Python inside the trunk.
TAPPABLE = ("embeddings", "resid_pre", "attn_in", "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "value",
            "z", "attn_out", "attn_out_post", "resid_mid", "mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_act",
            "router_logits", "mlp_out", "mlp_out_post", "resid_post", "final_norm")


@dataclasses.dataclass
class Tap:
    point: str  # base address, "resid_post.3" or "embeddings"
    buffer: torch.Tensor  # [max tokens in one forward, width on this rank]
    sharded: bool  # this rank holds a slice of the width: gather across tensor-parallel ranks after reading


class StaticTaps:
    """The buffers and the tick/echo liveness pair of one model; stored on the model as ``_ie_static``."""

    def __init__(self, taps: dict[str, Tap], tick: torch.Tensor, echo: torch.Tensor):
        self.taps, self.tick, self.echo = taps, tick, echo
        self.step = 0

    def arm(self) -> None:
        """Before a forward (outside the graph): a new tick the compiled graph must echo."""
        self.step = (self.step + 1) % (1 << 20)
        self.tick.fill_(self.step)

    def check(self) -> None:
        if int(self.echo.item()) != self.step:
            raise RuntimeError(
                "ie_lab graph mode: the static taps did not run in this forward (the compiled graph does not "
                "contain them: a stale vLLM compile cache, or a fully graphed forward). Nothing was captured; "
                "restart the Session, or create it without graph_points.")


def _sites(model: nn.Module, d_model: int) -> dict[str, tuple[nn.Module, str, Callable, Any, bool]]:
    """point -> (module, 'pre' | 'post', extract, width on this rank, sharded), for every point this model has.
    Widths read off vLLM's modules are callables, evaluated only for the declared points."""
    # the worker's readers of hooked calls; imported here because the worker module imports this one
    from .worker import _first, _fused_args, _hidden, _out_and_bias, _tp_size, bind_vllm

    def _stream(args: tuple, kwargs: dict) -> torch.Tensor:  # the residual entering a deferred-add call
        h, res = _fused_args(args, kwargs)
        return h if res is None else h + res

    embed, final, layers = bind_vllm(model)
    trunk = getattr(model, "model", None) or getattr(model, "transformer", None)
    norm = getattr(trunk, "normalizer", None)
    out: dict[str, tuple] = {}
    if norm is None:
        out["embeddings"] = (embed, "post", lambda a, o: _first(o), d_model, False)
    else:  # Gemma scales outside the embedding module on vLLM (inside it on HF)
        out["embeddings"] = (embed, "post", lambda a, o: _first(o) * norm, d_model, False)
    if final is not None:
        out["final_norm"] = (final, "post", lambda a, o: _first(o), d_model, False)
    post = lambda a, o: _first(o)  # noqa: E731
    pre = lambda a, k: _hidden(a, k)  # noqa: E731
    for s in layers:
        L = s.index
        attn = s.attn_mod
        if s.fused:
            out[f"resid_pre.{L}"] = (s.layer, "pre", _stream, d_model, False)
            out[f"resid_post.{L}"] = (s.layer, "post", lambda a, o: o[0] + o[1], d_model, False)
            out[f"resid_mid.{L}"] = (s.mid_norm, "pre", _stream, d_model, False)
        else:
            out[f"resid_pre.{L}"] = (s.layer, "pre", pre, d_model, False)
            out[f"resid_post.{L}"] = (s.layer, "post", post, d_model, False)
            if not s.parallel:
                out[f"resid_mid.{L}"] = (s.mid_norm, "pre", pre, d_model, False)
        # post-norm layers have no pre-MLP norm: mid_norm is the MLP itself, whose input is resid_mid and mlp_in;
        # parallel blocks have none either: mlp_in is the MLP's own input
        out[f"mlp_in.{L}"] = (s.mlp, "pre", pre, d_model, False) if s.parallel else \
            (s.mid_norm, "pre", pre, d_model, False) if s.post_norm else (s.mid_norm, "post", post, d_model, False)
        out[f"attn_in.{L}"] = (attn, "pre", pre, d_model, False)
        out[f"z.{L}"] = (s.o_proj, "pre", pre, lambda s=s: s.o_proj.input_size_per_partition, True)
        # a linear built with skip_bias_add hands its bias to the caller (Falcon): the output is x + bias
        attn_o = lambda a, o, mod=s.o_proj: _out_and_bias(mod, o)[0]  # noqa: E731
        out[f"attn_out.{L}"] = (s.o_proj, "post", attn_o, d_model, False)
        m = s.out_scale
        scaled = attn_o if m is None else (lambda a, o, m=m: _first(o) * m)
        out[f"attn_out_post.{L}"] = ((s.post_attn_norm, "post", post, d_model, False) if s.post_attn_norm is not None
                                     else (s.o_proj, "post", scaled, d_model, False))
        core = s.attn_core
        kv_width = lambda core=core: core.num_kv_heads * core.head_size  # noqa: E731
        out[f"value.{L}"] = (core, "pre", lambda a, k: (k["value"] if "value" in k else a[2]).reshape(
            (k["value"] if "value" in k else a[2]).shape[0], -1), kv_width, not s.kv_replicated)
        if s.q_norm is not None:
            flat_in = lambda a, k: _hidden(a, k).reshape(_hidden(a, k).shape[0], -1)  # noqa: E731
            flat_out = lambda a, o: _first(o).reshape(_first(o).shape[0], -1)  # noqa: E731
            q_width = lambda core=core: core.num_heads * core.head_size  # noqa: E731
            for nm, width, rep in (("q_norm", q_width, False), ("k_norm", kv_width, s.kv_replicated)):
                mod = s.q_norm if nm == "q_norm" else s.k_norm
                out[f"{nm}_in.{L}"] = (mod, "pre", flat_in, width, not rep)
                out[f"{nm}_out.{L}"] = (mod, "post", flat_out, width, not rep)
        if s.down_proj is not None:
            out[f"mlp_act.{L}"] = (s.down_proj, "pre", pre, lambda s=s: s.down_proj.input_size_per_partition, True)
        if s.up_proj is not None:
            w = lambda s=s: s.up_proj.output_size_per_partition  # noqa: E731
            if s.gated:
                half = lambda w=w: w() // 2  # noqa: E731
                out[f"mlp_pre.{L}"] = (s.up_proj, "post", lambda a, o: _first(o)[..., : _first(o).shape[-1] // 2],
                                       half, True)
                out[f"mlp_pre_linear.{L}"] = (s.up_proj, "post",
                                              lambda a, o: _first(o)[..., _first(o).shape[-1] // 2:], half, True)
            else:
                out[f"mlp_pre.{L}"] = (s.up_proj, "post", lambda a, o, mod=s.up_proj: _out_and_bias(mod, o)[0], w,
                                       True)
        if s.router is not None:
            n_experts = lambda s=s: int(getattr(s.router, "output_size", None) or s.router.weight.shape[0])  # noqa: E731
            out[f"router_logits.{L}"] = (s.router, "post", post, n_experts, False)
        mo = s.mlp_out_mod or s.mlp
        mlp_o = lambda a, o, mod=mo: _out_and_bias(mod, o)[0]  # noqa: E731
        out[f"mlp_out.{L}"] = (mo, "post", mlp_o, d_model, False)
        out[f"mlp_out_post.{L}"] = ((s.post_mlp_norm, "post", post, d_model, False) if s.post_mlp_norm is not None
                                    else (mo, "post", mlp_o if m is None else scaled, d_model, False))
    if _tp_size() == 1:
        out = {k: (m, kind, f, w, False) for k, (m, kind, f, w, _) in out.items()}
    return out


def install(model: nn.Module, points: list[str], max_tokens: int, d_model: int) -> StaticTaps:
    """Allocate one buffer per declared point and register the taps; before vLLM traces the model."""
    sites = _sites(model, d_model)
    missing = [p for p in points if p not in sites]
    if missing:
        raise RuntimeError(f"ie_lab graph mode: {missing} do not exist on {type(model).__name__}; "
                           f"declare some of {sorted(sites)}")
    param = next(model.parameters())
    taps: dict[str, Tap] = {}
    for p in points:
        mod, kind, extract, width, sharded = sites[p]
        width = int(width() if callable(width) else width)
        buf = torch.zeros(max_tokens, width, dtype=param.dtype, device=param.device)
        taps[p] = Tap(p, buf, sharded)
        if kind == "pre":
            def hook(m, args, kwargs, _b=buf, _f=extract):
                t = _f(args, kwargs)
                _b[: t.shape[0]].copy_(t)
            mod.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            def hook(m, args, out, _b=buf, _f=extract):
                t = _f(args, out)
                _b[: t.shape[0]].copy_(t)
            mod.register_forward_hook(hook)
    tick = torch.zeros(1, dtype=torch.int64, device=param.device)
    echo = torch.full((1,), -1, dtype=torch.int64, device=param.device)
    embed = sites["embeddings"][0]

    def canary(m, a, o):  # returns None: a forward hook's return value would replace the module's output
        echo.copy_(tick)

    embed.register_forward_hook(canary)
    static = StaticTaps(taps, tick, echo)
    model._ie_static = static
    return static


def register_loader() -> None:
    """Make ``load_format="ie_lab_static"`` known to vLLM in this process (client, engine core and workers
    all import this module: the worker extension lives next to it)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as known
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if LOAD_FORMAT in known:
        return

    @register_model_loader(LOAD_FORMAT)
    class StaticTapLoader(DefaultModelLoader):
        """vLLM's safetensors loader, then the static taps (before vLLM compiles the model)."""

        def __init__(self, load_config: Any):
            extra = dict(load_config.model_loader_extra_config or {})
            self.ie_points = list(extra.pop(CONFIG_KEY, []))
            super().__init__(dataclasses.replace(load_config, load_format="safetensors",
                                                 model_loader_extra_config=extra))

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            model = super().load_model(vllm_config, model_config, prefix)
            install(model, self.ie_points, int(vllm_config.scheduler_config.max_num_batched_tokens),
                    int(model_config.get_hidden_size()))
            return model
