"""The vLLM worker extension: persistent hooks, per-request capture, steering and logit lens.

Loaded inside every vLLM worker through ``worker_extension_cls="ie_lab.vllm.worker.IELabWorker"``; the
client talks to it only through ``collective_rpc`` with plain data (dicts, lists, bytes), so it works the
same in-process and across vLLM's worker processes.

Life of a request with work attached:

1. ``ie_register(key, spec)`` stores what the request wants (points, steering, lens) under a client key;
2. the request carries ``extra_args={"ie_lab": key}``; a pre-hook on the model reads, for every forward,
   the runner's ``input_batch.req_ids`` and ``query_start_loc`` (the flattened layout) and the positions,
   and keeps the rows of requests that have a spec;
3. hooks placed once at install time read (or edit) only those rows and file slices per request with
   their absolute positions, so the grouping of requests into forwards does not matter;
4. ``ie_collect(key)`` reassembles by position, rebuilds attention from the captured post-RoPE q/k,
   and forgets the key; ``ie_release(key)`` forgets it without returning anything (aborts).

Head- and neuron-sharded points are gathered across tensor-parallel ranks inside the hook (every rank
runs the same hooks on the same layout, so the collective is matched); only rank 0 keeps the data.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..ops import steering as steer_ops
from ..ops.attention import scores_and_probs
from ..ops.projection import from_plain
from ..ops.projection import scores as project_scores
from .wire import RECOMPUTED, pack, unpack  # the wire format (plain data); re-exported for the session
from .wire import by_position as _by_position
from .wire import dedupe_order as _dedupe_order

# Points a backend hook can read on vLLM's module tree. Everything else is refused by the client.
READ_POINTS = ("embeddings", "resid_pre", "attn_in", "q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "value",
               "z", "attn_out", "attn_out_post", "resid_mid", "mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_act",
               "router_logits", "mlp_out", "mlp_out_post", "resid_post", "final_norm")
STEERABLE = ("resid_pre", "attn_in", "attn_out", "attn_out_post", "resid_mid", "mlp_in", "mlp_out", "mlp_out_post",
             "resid_post")
SHARDED = ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "value", "z", "mlp_pre", "mlp_pre_linear", "mlp_act")


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
    args = list(args)
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            args[i] = new
            return tuple(args), kwargs
    raise RuntimeError("ie_lab: no hidden-state argument to replace")


def _fused_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual) of a call that may defer the residual add (layers and fused add+norms)."""
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    h = kwargs.get("hidden_states", kwargs.get("x", floats[0] if floats else None))
    res = kwargs.get("residual", floats[1] if len(floats) > 1 else None)
    return h, res


def _replace_fused_args(args: tuple, kwargs: dict, h: torch.Tensor, res: torch.Tensor) -> tuple[tuple, dict]:
    """Put the steered stream back as (stream, zeros): the consumer's deferred add gives the stream exactly."""
    args = list(args)
    kwargs = dict(kwargs)
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = h
    elif "x" in kwargs:
        kwargs["x"] = h
    else:
        args[idx[0]] = h
        idx = idx[1:]
    if "residual" in kwargs:
        kwargs["residual"] = res
    elif idx:
        args[idx[0]] = res
    elif len(args) >= 3 and args[2] is None:  # (positions, hidden, residual=None) on a first layer
        args[2] = res
    else:
        kwargs["residual"] = res
    return tuple(args), kwargs


@dataclass
class LayerSites:
    index: int
    layer: nn.Module
    fused: bool  # layer returns (h, residual) with the add deferred
    attn_mod: nn.Module
    attn_core: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_attn_norm: nn.Module | None  # a plain norm applied to attention's output (Gemma 2)
    mid_norm: nn.Module | None  # the norm between attention and the MLP: its input is resid_mid (None: parallel)
    mlp: nn.Module
    down_proj: nn.Module | None  # None on sparse MoE layers
    router: nn.Module | None
    post_mlp_norm: nn.Module | None
    up_proj: nn.Module | None = None  # the MLP's input projection; None on sparse MoE layers
    out_scale: float | None = None  # the layer scales each sublayer's output before adding it (Granite)
    gated: bool = False  # up_proj's output is [gate | up] (a merged gate_up_proj) on each rank
    post_norm: bool = False  # norms only after each sublayer (EXAONE 4): mid_norm is then the MLP itself
    kv_replicated: bool = False  # fewer KV heads than TP ranks: every rank holds the same heads
    parallel: bool = False  # attention and MLP both read the layer's one normed input (no resid_mid, no mid_norm)
    mlp_out_mod: nn.Module | None = None  # whose output is mlp_out, where that is not the MLP module's (Falcon)
    sinks: torch.Tensor | None = None  # every head's attention-sink logit, gathered over ranks (GPT-OSS)


def _router(mlp: nn.Module) -> nn.Module | None:
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)  # GPT-OSS: router


def bind_vllm(model: nn.Module) -> tuple[nn.Module, nn.Module | None, list[LayerSites]]:
    """(embedding, final norm, per-layer sites) of a vLLM model, read off its module tree."""
    trunk = getattr(model, "model", None) or getattr(model, "transformer", None)
    if trunk is None:
        raise RuntimeError(f"ie_lab: cannot find the trunk of {type(model).__name__}")
    trunk = getattr(trunk, "decoder", None) or trunk  # OPT: OPTModel holds the decoder
    embed = (getattr(trunk, "embed_tokens", None) or getattr(trunk, "wte", None)
             or getattr(trunk, "word_embeddings", None) or getattr(trunk, "embedding", None))
    final = getattr(trunk, "norm", None) or getattr(trunk, "ln_f", None) or getattr(trunk, "final_layer_norm", None)
    layers = getattr(trunk, "layers", None) or getattr(trunk, "h", None)
    if embed is None or layers is None:
        raise RuntimeError(f"ie_lab: {type(model).__name__} is not bound on vLLM yet")
    out = []
    for i, layer in enumerate(layers):
        if hasattr(layer, "fc1") and hasattr(layer, "self_attn"):  # OPT: explicit adds, the MLP's linears on the layer
            if not getattr(layer, "do_layer_norm_before", True):
                raise RuntimeError("ie_lab: OPT layers that normalise after each sublayer (OPT-350m) are not bound "
                                   "on vLLM")
            attn = layer.self_attn
            sites = LayerSites(i, layer, False, attn, attn.attn, attn.out_proj, None, None, None,
                               layer.final_layer_norm, layer.fc2, layer.fc2, None, None, up_proj=layer.fc1)
        elif hasattr(layer, "self_attn") or (hasattr(layer, "attn") and hasattr(layer, "input_layernorm")):
            # llama-like (GPT-OSS names its attention attn); most defer the residual add to the next fused add+norm
            attn = getattr(layer, "self_attn", None) or layer.attn
            mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            moe = hasattr(mlp, "experts")
            # Post-norm layers (no input norm) take and return a residual but keep the whole stream in hidden.
            post_norm = not sandwich and not hasattr(layer, "input_layernorm") and hasattr(
                layer, "post_feedforward_layernorm")
            # Apertus names its pre-MLP norm feedforward_layernorm
            mid = getattr(layer, "post_attention_layernorm", None) or getattr(layer, "feedforward_layernorm", None)
            # Cohere: one input norm feeds both sublayers; it takes a residual argument but returns the whole
            # stream in hidden (the residual it hands on is ignored by the next layer and the final norm)
            parallel = mid is None and not sandwich and not post_norm
            fused = "residual" in inspect.signature(layer.forward).parameters and not post_norm and not parallel
            if parallel:
                sites = LayerSites(
                    i, layer, False, attn, attn.attn, attn.o_proj, getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None), None, None, mlp, mlp.down_proj, None, None, parallel=True)
            elif post_norm:
                sites = LayerSites(
                    i, layer, False, attn, attn.attn, attn.o_proj, getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None), layer.post_attention_layernorm, mlp, mlp,
                    None if moe else mlp.down_proj, _router(mlp) if moe else None,
                    layer.post_feedforward_layernorm, post_norm=True)
            else:
                sites = LayerSites(
                    i, layer, fused, attn, attn.attn, attn.o_proj, getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None), layer.post_attention_layernorm if sandwich else None,
                    layer.pre_feedforward_layernorm if sandwich else mid, mlp,
                    None if moe else mlp.down_proj, _router(mlp) if moe else None,
                    getattr(layer, "post_feedforward_layernorm", None) if sandwich else None)
            if not moe and hasattr(mlp, "gate_up_proj"):
                sites.up_proj, sites.gated = mlp.gate_up_proj, True
            elif not moe and hasattr(mlp, "up_proj"):  # an ungated MLP (Apertus: up, xIELU, down)
                sites.up_proj = mlp.up_proj
            if not fused and getattr(layer, "residual_multiplier", None) is not None:
                sites.out_scale = float(layer.residual_multiplier)
            total_kv = getattr(attn, "total_num_kv_heads", None)
            sites.kv_replicated = bool(total_kv is not None and total_kv < _tp_size())
        elif hasattr(layer, "self_attention") and not hasattr(layer, "post_attention_layernorm"):
            # Falcon's parallel blocks (7B: one input norm; 40B / 180B: ln_attn and ln_mlp), explicit add. With
            # tensor parallelism both halves are summed before one all-reduce (refused at load).
            attn, mlp = layer.self_attention, layer.mlp
            sites = LayerSites(i, layer, False, attn, attn.attn, attn.dense, None, None, None, None, mlp,
                               mlp.dense_4h_to_h, None, None, up_proj=mlp.dense_h_to_4h, parallel=True,
                               mlp_out_mod=mlp.dense_4h_to_h)  # FalconMLP returns (x, bias) for the layer to add
        elif hasattr(layer, "ln_1") and not hasattr(layer, "ln_2"):  # GPT-J: a parallel block, explicit add
            attn, mlp = layer.attn, layer.mlp
            sites = LayerSites(i, layer, False, attn, attn.attn, attn.out_proj, None, None, None, None, mlp,
                               mlp.fc_out, None, None, up_proj=mlp.fc_in, parallel=True)
        elif hasattr(layer, "ln_1"):  # GPT-2: explicit residual adds inside the block
            attn = layer.attn
            sites = LayerSites(i, layer, False, attn, attn.attn, attn.c_proj, None, None, None, layer.ln_2, layer.mlp,
                               layer.mlp.c_proj, None, None, up_proj=layer.mlp.c_fc)
        else:
            raise RuntimeError(f"ie_lab: layer type {type(layer).__name__} is not bound on vLLM yet")
        out.append(sites)
    return embed, final, out


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001
        return 1


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001
        return 0


def _gather(t: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return t
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(t.contiguous(), dim=-1)


@dataclass
class Row:
    key: str
    spec: "Spec"
    start: int
    end: int
    positions: torch.Tensor  # absolute positions of this request's tokens in the forward


@dataclass
class Spec:
    points: set[str]  # base addresses "name.L" / "name"
    attn_layers: set[int]
    steer: list[dict]
    lens: dict | None
    prompt_len: int
    special_ids: frozenset[int] = frozenset()
    store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    qk: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    lens_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list))
    forwards: int = 0
    attn_sent: dict[int, int] = field(default_factory=dict)  # per layer: attention rows a stream has been handed
    error: str | None = None  # set when a hook failed for this request: its work stops, ie_collect reports it
    # project(): point -> (encoder, head, head_dim); only the [tokens, k] scores are kept and cross back
    project: dict[str, tuple[Any, int | None, int]] = field(default_factory=dict)
    proj_store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))


class IELabWorker:
    """Mixed into vLLM's worker class; every public method here is reachable through collective_rpc."""

    # ---- install --------------------------------------------------------------------------------
    def ie_install(self) -> dict:
        if getattr(self, "_ie_installed", False):
            return self._ie_info
        runner = self.model_runner
        model = runner.model if hasattr(runner, "model") else runner.get_model()
        self._ie_model = model
        self._ie_specs: dict[str, Spec] = {}
        self._ie_rows: list[Row] | None = None
        self._ie_ids: torch.Tensor | None = None
        self._ie_busy = False  # inside our own read-out (lens): hooks stand aside
        embed, final, layers = bind_vllm(model)
        self._ie_layers = layers
        self._ie_final = final
        self._ie_handles: list[Any] = []
        h = self._ie_handles
        h.append(model.register_forward_pre_hook(self._ie_on_forward, with_kwargs=True))
        h.append(model.register_forward_hook(self._ie_after_forward))
        self._ie_static = getattr(model, "_ie_static", None)
        if self._ie_static is not None:
            # Graph mode: the trunk is compiled with the static taps inside; no Python hook may go in there.
            present: dict[str, list[int]] = defaultdict(list)
            for point in self._ie_static.taps:
                name, _, tail = point.partition(".")
                present[name].append(int(tail) if tail else 0)
            self._ie_installed = True
            self._ie_info = {"model_class": type(model).__name__, "n_layers": len(layers), "present": dict(present),
                             "tp_size": _tp_size(), "final_norm": final is not None,
                             "graph_points": sorted(self._ie_static.taps)}
            return self._ie_info
        # Gemma-style trunks scale the embedding outside the module on vLLM (HF scales inside it): apply the
        # trunk's normalizer so `embeddings` means the same tensor on both backends.
        trunk = getattr(model, "model", None) or getattr(model, "transformer", None)
        norm = getattr(trunk, "normalizer", None)
        if norm is None:
            h.append(embed.register_forward_hook(self._guard(self._post_reader("embeddings"))))
        else:
            h.append(embed.register_forward_hook(self._guard(
                lambda mod, args, out: self._read("embeddings", _first(out) * norm) if self._ie_rows is not None else None)))
        if final is not None:
            h.append(final.register_forward_hook(self._guard(self._post_reader("final_norm"))))
        present: dict[str, list[int]] = defaultdict(list)
        for s in layers:
            sinks = getattr(s.attn_core.impl, "sinks", None)
            if sinks is not None:  # this rank's heads: the read-out on rank 0 rebuilds every head (all ranks gather)
                s.sinks = _gather(sinks.detach().float().reshape(1, -1))[0].cpu()
            self._install_layer(s)
            L = s.index
            for name in ("resid_pre", "attn_in", "value", "z", "attn_out", "attn_out_post", "resid_mid", "mlp_in",
                         "mlp_out", "mlp_out_post", "resid_post", "attn_scores", "attn_probs"):
                if not (s.parallel and name == "resid_mid"):
                    present[name].append(L)
            if s.q_norm is not None:
                for name in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
                    present[name].append(L)
            if s.down_proj is not None:
                present["mlp_act"].append(L)
            if s.up_proj is not None:
                present["mlp_pre"].append(L)
                if s.gated:
                    present["mlp_pre_linear"].append(L)
            if s.router is not None:
                present["router_logits"].append(L)
        self._ie_installed = True
        self._ie_info = {"model_class": type(model).__name__, "n_layers": len(layers), "present": dict(present),
                         "tp_size": _tp_size(), "final_norm": final is not None}
        return self._ie_info

    def _install_layer(self, s: LayerSites) -> None:
        h = self._ie_handles
        L = s.index
        if s.fused:
            h.append(s.layer.register_forward_pre_hook(self._guard(self._fused_pre(f"resid_pre.{L}")), with_kwargs=True))
            h.append(s.layer.register_forward_hook(self._guard(self._fused_post(f"resid_post.{L}"))))
            h.append(s.mid_norm.register_forward_pre_hook(self._guard(self._fused_pre(f"resid_mid.{L}")), with_kwargs=True))
            h.append(s.mid_norm.register_forward_hook(self._guard(self._tuple_post(f"mlp_in.{L}"))))
        elif s.parallel:  # no stream between the sublayers; the MLP's own input is mlp_in, steered for it alone
            h.append(s.layer.register_forward_pre_hook(self._guard(self._pre_rw(f"resid_pre.{L}")), with_kwargs=True))
            h.append(s.layer.register_forward_hook(self._guard(self._post_rw([f"resid_post.{L}"]))))
            h.append(s.mlp.register_forward_pre_hook(self._guard(self._pre_rw(f"mlp_in.{L}")), with_kwargs=True))
        else:
            h.append(s.layer.register_forward_pre_hook(self._guard(self._pre_rw(f"resid_pre.{L}")), with_kwargs=True))
            h.append(s.layer.register_forward_hook(self._guard(self._post_rw([f"resid_post.{L}"]))))
            # resid_mid in place: the layer keeps a second reference to it as the residual
            h.append(s.mid_norm.register_forward_pre_hook(self._guard(self._pre_inplace(f"resid_mid.{L}")), with_kwargs=True))
            if s.post_norm:  # the MLP reads the stream itself: mlp_in is its input, steered for the MLP alone
                h.append(s.mid_norm.register_forward_pre_hook(self._guard(self._pre_rw(f"mlp_in.{L}")), with_kwargs=True))
            else:
                h.append(s.mid_norm.register_forward_hook(self._guard(self._post_rw([f"mlp_in.{L}"]))))
        h.append(s.attn_mod.register_forward_pre_hook(self._guard(self._pre_rw(f"attn_in.{L}")), with_kwargs=True))
        h.append(s.attn_core.register_forward_pre_hook(self._guard(self._attn_core(s)), with_kwargs=True))
        h.append(s.o_proj.register_forward_pre_hook(self._guard(self._pre_reader(f"z.{L}", sharded=True)), with_kwargs=True))
        outs = [f"attn_out.{L}"] + ([] if s.post_attn_norm is not None else [f"attn_out_post.{L}"])
        scale = {f"attn_out_post.{L}": s.out_scale, f"mlp_out_post.{L}": s.out_scale} if s.out_scale else None
        h.append(s.o_proj.register_forward_hook(self._guard(self._post_rw(outs, scale))))
        if s.post_attn_norm is not None:
            h.append(s.post_attn_norm.register_forward_hook(self._guard(self._post_rw([f"attn_out_post.{L}"]))))
        if s.q_norm is not None:
            for mod, nm in ((s.q_norm, "q_norm"), (s.k_norm, "k_norm")):
                rep = nm == "k_norm" and s.kv_replicated
                h.append(mod.register_forward_pre_hook(
                    self._guard(self._pre_reader(f"{nm}_in.{L}", sharded=not rep, flat=True)), with_kwargs=True))
                h.append(mod.register_forward_hook(
                    self._guard(self._post_reader(f"{nm}_out.{L}", sharded=not rep, flat=True))))
        if s.down_proj is not None:
            h.append(s.down_proj.register_forward_pre_hook(self._guard(self._pre_reader(f"mlp_act.{L}", sharded=True)),
                                                           with_kwargs=True))
        if s.up_proj is not None:
            h.append(s.up_proj.register_forward_hook(self._guard(self._up_reader(L, s.gated))))
        if s.router is not None:
            h.append(s.router.register_forward_hook(self._guard(self._post_reader(f"router_logits.{L}"))))
        outs = [f"mlp_out.{L}"] + ([] if s.post_mlp_norm is not None else [f"mlp_out_post.{L}"])
        h.append((s.mlp_out_mod or s.mlp).register_forward_hook(self._guard(self._post_rw(outs, scale))))
        if s.post_mlp_norm is not None:
            h.append(s.post_mlp_norm.register_forward_hook(self._guard(self._post_rw([f"mlp_out_post.{L}"]))))

    # ---- per-forward layout ---------------------------------------------------------------------
    def _ie_on_forward(self, mod, args, kwargs):
        self._ie_rows = None
        if not self._ie_specs:
            return None
        runner = self.model_runner
        ib = runner.input_batch
        n = ib.num_reqs
        if not n:
            return None
        positions = kwargs.get("positions")
        if positions is None:
            positions = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()
                              and a is not args[0]), None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        qsl = runner.query_start_loc.np[: n + 1].tolist()
        rows = []
        for i, req_id in enumerate(ib.req_ids[:n]):
            st = runner.requests.get(req_id)
            extra = getattr(getattr(st, "sampling_params", None), "extra_args", None) or {}
            key = extra.get("ie_lab")
            spec = self._ie_specs.get(key) if key is not None else None
            if spec is None or spec.error is not None or qsl[i + 1] <= qsl[i]:
                continue
            spec.forwards += 1
            rows.append(Row(key, spec, qsl[i], qsl[i + 1], positions[qsl[i]:qsl[i + 1]].detach().to("cpu").clone()))
        self._ie_rows = rows or None
        self._ie_ids = input_ids if rows else None
        if self._ie_static is not None and rows:
            self._ie_static.arm()
        return None

    def _ie_after_forward(self, mod, args, out):
        static = self._ie_static
        try:
            if static is not None and self._ie_rows is not None:
                # Graph mode: the compiled trunk has written every declared point; file the rows outside it.
                static.check()
                n = max(r.end for r in self._ie_rows)
                for point, tap in static.taps.items():
                    self._read(point, tap.buffer[:n], sharded=tap.sharded)
        finally:
            self._ie_rows = None
            self._ie_ids = None

    def _guard(self, hook: Callable) -> Callable:
        """A hook that fails fails the requests it was working for, not the engine: the forward goes on
        unchanged at that point, every ie_lab request in it is marked failed (its work stops, ie_collect
        reports why) and plain requests never notice. Never silent: a request whose steering could not be
        applied here is failed, not returned unsteered."""
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - attributed to the requests of this forward
                for r in self._ie_rows or ():
                    if r.spec.error is None:
                        r.spec.error = f"{type(e).__name__}: {e}"
                return None
        return guarded

    def _active(self) -> list[Row] | None:
        if self._ie_busy:
            return None
        return self._ie_rows

    # ---- reading ----------------------------------------------------------------------------------
    def _file(self, rows: list[Row], point: str, t: torch.Tensor) -> None:
        keep = _tp_rank() == 0
        for r in rows:
            if point in r.spec.points:
                if keep:
                    r.spec.store[point].append((r.positions, t[r.start:r.end].detach().to("cpu").clone()))
            if keep and point in r.spec.project:
                # Projected here, on the activation's device: only [tokens, k] scores leave the worker.
                enc, head, head_dim = r.spec.project[point]
                x = t[r.start:r.end].detach()
                if head is not None:
                    x = x.reshape(x.shape[0], -1, head_dim)[:, head]
                r.spec.proj_store[point].append((r.positions, project_scores(x, enc).to("cpu")))

    def _wanted(self, rows: list[Row], point: str) -> bool:
        return any(point in r.spec.points or point in r.spec.project for r in rows) or any(
            r.spec.lens is not None and point == f"{r.spec.lens['point']}.{_layer_of(point)}" for r in rows)

    def _lens_all(self, rows: list[Row], point: str, t: torch.Tensor) -> None:
        """The logit lens inside the worker: final norm, the model's own logits, top-k; only top-k is kept."""
        want = [r for r in rows if r.spec.lens is not None and f"{r.spec.lens['point']}.{_layer_of(point)}" == point
                and _layer_of(point) in r.spec.lens["layers"]]
        if not want:
            return
        self._ie_busy = True
        try:
            x = torch.cat([t[r.start:r.end] for r in want])
            x = self._ie_final(x) if self._ie_final is not None else x
            x = _first(x)
            logits = self._ie_model.compute_logits(x)
        finally:
            self._ie_busy = False
        if logits is None or _tp_rank() != 0:
            return
        off = 0
        for r in want:
            n = r.end - r.start
            probs = torch.softmax(logits[off:off + n].float(), -1)
            vals, idx = probs.topk(int(r.spec.lens["k"]), dim=-1)
            r.spec.lens_rows[_layer_of(point)].append((r.positions, idx.cpu(), vals.cpu()))
            off += n

    def _read(self, point: str, t: torch.Tensor, sharded: bool = False, flat: bool = False) -> None:
        rows = self._active()
        if rows is None or not self._wanted(rows, point):
            return
        if flat:
            t = t.reshape(t.shape[0], -1)
        if sharded:
            t = _gather(t)
        self._file(rows, point, t)
        self._lens_all(rows, point, t)

    def _pre_reader(self, point: str, sharded: bool = False, flat: bool = False) -> Callable:
        def hook(mod, args, kwargs):
            if self._ie_rows is not None:
                self._read(point, _hidden(args, kwargs), sharded, flat)
        return hook

    def _post_reader(self, point: str, sharded: bool = False, flat: bool = False) -> Callable:
        def hook(mod, args, out):
            if self._ie_rows is not None:
                self._read(point, _first(out), sharded, flat)
        return hook

    def _up_reader(self, L: int, gated: bool) -> Callable:
        """The MLP's input projection. A merged gate_up_proj holds this rank's [gate shard | up shard]: split
        before gathering, so each half is reassembled from its own shards."""
        def hook(mod, args, out):
            if self._ie_rows is None:
                return
            t = _out_and_bias(mod, out)[0]
            if not gated:
                self._read(f"mlp_pre.{L}", t, sharded=True)
                return
            gate, up = t.chunk(2, dim=-1)
            self._read(f"mlp_pre.{L}", gate, sharded=True)
            self._read(f"mlp_pre_linear.{L}", up, sharded=True)
        return hook

    def _tuple_post(self, point: str) -> Callable:
        """A fused add+norm's output (normed, new_residual): the normed half is the point; steerable."""
        def hook(mod, args, out):
            rows = self._active()
            if rows is None:
                return None
            new = self._steer_and_read(rows, point, _first(out))
            if new is not None:
                return (new, out[1]) if isinstance(out, tuple) else new
            return None
        return hook

    # ---- steering ---------------------------------------------------------------------------------
    def _steer(self, rows: list[Row], point: str, t: torch.Tensor) -> torch.Tensor | None:
        """The tensor with every steering spec for this point applied to its rows, or None if none applies."""
        todo = [(r, s) for r in rows for s in r.spec.steer if s["address"] == point]
        if not todo:
            return None
        out = t.clone()
        for r, s in todo:
            if r.spec.error is not None:
                continue
            try:  # one request's steering failing fails that request only; the others in this forward go on
                seg = out[r.start:r.end]
                mask = _position_mask(s["positions"], r.positions, r.spec.prompt_len,
                                      self._ie_ids[r.start:r.end] if self._ie_ids is not None else None,
                                      r.spec.special_ids)
                fn = steer_ops.FUNCTIONS[s["method"]]
                if mask is not None:
                    mask = mask.to(seg.device)[None]
                new = fn(seg[None], s["vector_t"].to(seg.device), mask=mask, **s["kwargs"])[0]
                out[r.start:r.end] = new
            except Exception as e:  # noqa: BLE001
                r.spec.error = f"steering {point} with {s['method']}: {type(e).__name__}: {e}"
        return out

    def _steer_and_read(self, rows: list[Row], point: str, t: torch.Tensor) -> torch.Tensor | None:
        """Steer the rows that ask for it, read what is handed on; the steered tensor, or None if unchanged."""
        new = self._steer(rows, point, t)
        self._read(point, t if new is None else new)
        return new

    def _fused_pre(self, point: str) -> Callable:
        """resid_pre / resid_mid where the stream arrives as (h, residual) with the add deferred."""
        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None:
                return None
            h, res = _fused_args(args, kwargs)
            new = self._steer_and_read(rows, point, h if res is None else h + res)
            if new is not None:
                return _replace_fused_args(args, kwargs, new, torch.zeros_like(new))
            return None
        return hook

    def _fused_post(self, point: str) -> Callable:
        def hook(mod, args, out):
            rows = self._active()
            if rows is None:
                return None
            new = self._steer_and_read(rows, point, out[0] + out[1])
            if new is not None:
                return (new, torch.zeros_like(new))
            return None
        return hook

    def _pre_rw(self, point: str) -> Callable:
        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None:
                return None
            new = self._steer_and_read(rows, point, _hidden(args, kwargs))
            if new is not None:
                return _set_hidden(args, kwargs, new)
            return None
        return hook

    def _pre_inplace(self, point: str) -> Callable:
        """GPT-2's resid_mid: the block keeps a second reference to the norm's input, so edit it in place."""
        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None:
                return None
            x = _hidden(args, kwargs)
            new = self._steer(rows, point, x)
            if new is not None:
                x.copy_(new)
            self._read(point, x)
            return None
        return hook

    def _post_rw(self, points: list[str], scale: dict[str, float] | None = None) -> Callable:
        """A module's output, read and steered; a point in ``scale`` is that output times the factor (what a
        Granite layer adds to the residual): steered as such, handed on divided back."""
        def hook(mod, args, out):
            rows = self._active()
            if rows is None:
                return None
            t, bias = _out_and_bias(mod, out)
            changed = False
            for p in points:
                m = scale.get(p) if scale else None
                new = self._steer_and_read(rows, p, t if m is None else t * m)
                if new is not None:
                    changed = True
                    t = new if m is None else new / m
            if changed:
                if bias is not None:  # the caller still adds the bias
                    t = t - bias
                return (t,) + tuple(out[1:]) if isinstance(out, tuple) else t
            return None
        return hook

    def _attn_core(self, s: LayerSites) -> Callable:
        L = s.index

        def hook(mod, args, kwargs):
            rows = self._active()
            if rows is None:
                return None
            names = ("query", "key", "value")
            q, k, v = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(names))
            self._read(f"value.{L}", v.reshape(v.shape[0], -1), sharded=not s.kv_replicated)
            if any(L in r.spec.attn_layers for r in rows):
                qg = _gather(q.reshape(q.shape[0], -1))
                kg = k.reshape(k.shape[0], -1) if s.kv_replicated else _gather(k.reshape(k.shape[0], -1))
                if _tp_rank() == 0:
                    for r in rows:
                        if L in r.spec.attn_layers:
                            r.spec.qk[L].append((r.positions, qg[r.start:r.end].cpu().clone(),
                                                 kg[r.start:r.end].cpu().clone()))
            return None
        return hook

    # ---- the client's calls -------------------------------------------------------------------------
    def ie_register(self, key: str, spec: dict) -> bool:
        steer = []
        for s in spec.get("steer", []):
            s = dict(s)
            s["vector_t"] = unpack(s["vector"]).to(torch.float32)
            if isinstance(s.get("positions"), dict):  # a boolean mask travels packed
                s["positions"] = unpack(s["positions"]).bool()
            steer.append(s)
        project = {point: (from_plain(p["encoder"], unpack), p.get("head"), int(p.get("head_dim", 0)))
                   for point, p in (spec.get("project") or {}).items()}
        self._ie_specs[key] = Spec(set(spec.get("points", [])), set(spec.get("attn_layers", [])), steer,
                                   spec.get("lens"), int(spec.get("prompt_len", 0)),
                                   frozenset(spec.get("special_ids", [])), project=project)
        return True

    def ie_drain(self, key: str) -> dict:
        """The point rows filed for a request since the last drain (a streamed capture), handed over and
        forgotten here so a long stream holds nothing twice; {"error": ...} once a hook failed for it."""
        spec = self._ie_specs.get(key)
        if spec is None or _tp_rank() != 0:
            return {}
        if spec.error is not None:
            return {"error": spec.error}
        out: dict[str, Any] = {}
        for point, parts in list(spec.store.items()):
            if parts:
                pos, t = _by_position(parts)
                out[point] = {"positions": pack(pos), "rows": pack(t)}
                parts.clear()
        # Attention rows of the queries filed since the last drain, against every key so far (a query's later
        # keys are masked). The q/k stay: later queries need every key, and ie_collect rebuilds the whole matrix.
        attn: dict[int, Any] = {}
        for L in spec.attn_layers:
            if not spec.qk.get(L):
                continue
            pos, scores, probs = self._attention(spec, L)
            new = pos >= spec.attn_sent.get(L, 0)
            if bool(new.any()):
                attn[L] = {"positions": pack(pos[new]), "scores": pack(scores[0][:, new]),
                           "probs": pack(probs[0][:, new])}
                spec.attn_sent[L] = int(pos.max()) + 1
        return {"points": out, "attn": attn}

    def _attention(self, spec: Spec, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, scores and probabilities of layer L rebuilt from every q/k the request has filed so far."""
        parts = spec.qk[L]
        pos = torch.cat([p for p, _, _ in parts])
        q = torch.cat([x for _, x, _ in parts])
        k = torch.cat([x for _, _, x in parts])
        order = _dedupe_order(pos)
        q, k = q[order], k[order]
        s = self._ie_layers[L]
        core = s.attn_core
        hd = core.head_size
        T = q.shape[0]
        qh = q.reshape(T, -1, hd).transpose(0, 1)[None]
        kh = k.reshape(T, -1, hd).transpose(0, 1)[None]
        impl = core.impl
        scores, probs = scores_and_probs(
            qh, kh, scaling=float(impl.scale), softcap=getattr(impl, "logits_soft_cap", None) or None,
            sliding_window=getattr(core, "sliding_window", None) or None,
            sinks=s.sinks)
        return pos[order], scores, probs

    def ie_collect(self, key: str) -> dict:
        spec = self._ie_specs.pop(key, None)
        if spec is None or _tp_rank() != 0:
            return {}
        if spec.error is not None:
            return {"error": spec.error}
        out: dict[str, Any] = {"points": {}, "attn": {}, "lens": {}, "forwards": spec.forwards}
        for point, parts in spec.store.items():
            if not parts:  # everything was drained during a stream
                continue
            pos, t = _by_position(parts)
            out["points"][point] = pack(t)
            out.setdefault("positions", pack(pos))
            out.setdefault("point_positions", {})[point] = pack(pos)
        for L in spec.qk:
            _, scores, probs = self._attention(spec, L)
            if f"attn_scores.{L}" in spec.points or L in spec.attn_layers:
                out["attn"][L] = {"scores": pack(scores[0]), "probs": pack(probs[0])}
        for point, parts in spec.proj_store.items():
            pos, sc = _by_position(parts)
            out.setdefault("project", {})[point] = {"positions": pack(pos), "scores": pack(sc)}
        for L, parts in spec.lens_rows.items():
            pos = torch.cat([p for p, _, _ in parts])
            order = _dedupe_order(pos)
            out["lens"][L] = {"ids": pack(torch.cat([i for _, i, _ in parts])[order]),
                              "probs": pack(torch.cat([v for _, _, v in parts])[order])}
        return out

    def ie_release(self, key: str) -> bool:
        return self._ie_specs.pop(key, None) is not None

    def ie_state(self) -> dict:
        """What the worker holds: for tests that an abort leaves nothing behind."""
        return {"specs": sorted(self._ie_specs), "rows_in_flight": self._ie_rows is not None,
                "steering": sum(len(s.steer) for s in self._ie_specs.values()),
                "hooks": len(self._ie_handles), "installed": bool(getattr(self, "_ie_installed", False))}


def _layer_of(point: str) -> int:
    tail = point.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _position_mask(positions: Any, absolute: torch.Tensor, prompt_len: int, ids: torch.Tensor | None,
                   special: frozenset[int]) -> torch.Tensor | None:
    """Which of this request's rows a steering spec edits, counted over prompt + generated positions."""
    dev = absolute.device
    if isinstance(positions, str):
        if positions == "all":
            return None
        if positions == "prompt":
            return absolute < prompt_len
        if positions == "generated":
            return absolute >= prompt_len
        if positions == "special":
            if ids is None or not special:
                return torch.zeros_like(absolute, dtype=torch.bool)
            return torch.isin(ids.cpu(), torch.tensor(sorted(special), dtype=ids.dtype))
    if isinstance(positions, torch.Tensor):
        full = positions.reshape(-1)
        ok = absolute < full.shape[0]
        out = torch.zeros_like(absolute, dtype=torch.bool)
        out[ok] = full[absolute[ok]]
        return out
    return torch.isin(absolute, torch.as_tensor(list(positions), dtype=absolute.dtype, device=dev))


# Graph mode's model loader must be known wherever this module is imported: the client (which validates
# load_format) and every worker (vLLM imports the extension class before it loads the model).
from . import static_taps as _static_taps  # noqa: E402

_static_taps.register_loader()
