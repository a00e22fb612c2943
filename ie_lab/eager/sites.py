"""Where each point is read on a bound model: the eager backend's site table (beside vLLM's, ie_lab/vllm/sites.py).

``resolve`` turns an Address into a Source (which module, which side, which transform) or refuses it with the
reason the point is absent on this family; ``TRUNK_SITES`` and ``LAYER_SITES`` hold one reader per point, so a
point is taught to the eager backend by one row. taps.py places the hooks that read the sources.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .. import points as _points
from ..address import Address
from ..arch import attention_tap
from ..arch.binding import LayerBinding
from ..arch.measure_attention import gate_values, split_fused_qkv
from ..arch.recorder import first_tensor
from ..errors import CapabilityUnsupported, PointAbsent
from ..ops.attention import divided_scores, scores_and_probs
from .head_results import heads_through, projection_kind

# kind: "pre" reads a module's hidden input, "post" its first output ("post_raw" the whole output; "post_sum"
# its first output plus the partner module's, which ran earlier in the same forward),
# "attn" an attention-interface
# call, "attn_out_full" the attention module's full output tuple (legacy families' probs), "moe_args"
# the experts module's routing arguments.
_Kind = str


@dataclass(frozen=True)
class Source:
    kind: _Kind
    module: nn.Module
    transform: Callable[..., torch.Tensor]
    needs_output_attentions: bool = False
    partner: nn.Module | None = None  # "post_sum": the module whose output the layer adds to this one's
    # "attn": read at the module's own attention step (attention_tap.STEP), not the registry (GPT-J, CodeGen)
    at_step: bool = False
    # "attn": the kernel calls each forward makes (measured); the first of each forward's calls is read (DiffLlama's
    # two calls share one pattern per head)
    calls_per_forward: int = 1


def _summed(lb: LayerBinding, transform: Callable[[torch.Tensor], torch.Tensor]) -> Source:
    """mlp_out beside a side MLP (a shared expert the layer sums with the MoE outside any module): read where the
    later of the two returns, plus the earlier one's output from the same forward (the order is measured)."""
    side, main = _bound(lb.mlp_side), lb.mlp_out_module
    later, earlier = (side, main) if lb.mlp_side_last else (main, side)
    return Source("post_sum", later, transform, partner=earlier)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(*t.shape[:2], -1)


def _scaled(m: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if m is None:
        return lambda t: t
    return lambda t: t * m


def _biased(bias: torch.Tensor, m: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: (t + bias.detach()) * (m or 1.0)


def _qk_norm_view(layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if layout == "bhsd":
        return lambda t: t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
    if layout == "bshd":
        return lambda t: t.reshape(t.shape[0], t.shape[1], -1)
    return lambda t: t


_MIXER_AS_SUBLAYER = {"mixer_in": "attn_in", "mixer_out": "attn_out", "mixer_out_post": "attn_out_post"}


def _bound(module: nn.Module | None) -> nn.Module:
    # Only for a point require_present() let through: the binder sets the module wherever the structure it
    # measured has that point (and value_source names the value's module, the fused layout with it).
    assert module is not None
    return module


def _stream_source(b: Any, addr: Address, structure: _points.Structure) -> Source:
    """Points of a hyper-connection trunk (arch.binder measured its modules): a residual point is one stream of the
    layer's [batch, seq, n_streams, d_model] stack, so its stream must be named; resid_streams is the whole stack
    entering the layer; the collapse, write and mix points are the hyper-connection modules' own outputs."""
    p = addr.point
    # a stream coordinate needs several streams, just as the multi-stream points do
    _points.require_present(p if p.multi_stream_only else "resid_streams", structure, label=str(addr))
    _points.require_present(p, structure, addr.layer, label=str(addr))
    L = addr.layer
    lb: LayerBinding = b.layers[L]
    if p.per_stream:
        n = structure.n_streams
        if addr.stream is None:
            raise PointAbsent(
                str(addr),
                b.family,
                f"this trunk carries {n} parallel residual streams (hyper-connections), so {addr} is {n} tensors, "
                "one per stream, and ie_lab will not pick one for you.",
                f"name a stream ({addr}.stream-0 ... {addr}.stream-{n - 1}), or capture resid_streams.{L} for the "
                "whole stack entering the layer.",
            )
        S = addr.stream
        if addr.name == "resid_mid":  # the stack between the sublayers is what the MLP's hyper-connection reads
            return Source("pre", _bound(lb.mlp_hc), lambda t: t[..., S, :])
        return Source("post" if addr.name == "resid_post" else "pre", lb.layer, lambda t: t[..., S, :])
    if addr.name == "resid_streams":
        return Source("pre", lb.layer, lambda t: t)
    hc = _bound(lb.attn_hc if addr.name.startswith("attn") else lb.mlp_hc)
    role = addr.name.rsplit("_", 1)[1]  # collapse | write | mix, where the binder found each in the output tuple
    i, flip = lb.hc_roles[role], role == "mix" and lb.mix_transposed
    return Source("post_raw", hc, lambda out, shape, n: out[i].transpose(-1, -2) if flip else out[i])


def resolve(lm: Any, addr: Address) -> Source:
    """The source of an address on this model, or a PointAbsent / CapabilityUnsupported saying why not."""
    b = lm.binding
    name = addr.name
    p = addr.point
    structure = _points.Structure.from_binding(b)
    if p.multi_stream_only or addr.stream is not None or (p.per_stream and structure.n_streams > 1):
        return _stream_source(b, addr, structure)
    # the registry says which points this structure lacks, and why (the same words on every backend)
    _points.require_present(p, structure, addr.layer, label=name)
    if name in ("mixer_state", "mixer_conv_state"):  # read from the forward's cache by capture, never by a hook
        from .mixer_state import refuse_hooked

        raise refuse_hooked(addr, "reading with a hook (steering, patching, a batched read)")
    if name in TRUNK_SITES:
        return TRUNK_SITES[name](b)
    lb: LayerBinding = b.layers[addr.layer]
    if lb.par_mixer is not None and name in _MIXER_AS_SUBLAYER:  # a mixer beside attention (Falcon-H1): its own
        if name == "mixer_in":
            return Source("pre", lb.par_mixer, lambda t: t)
        return Source("post", lb.par_mixer, _scaled(lb.par_mixer_multiplier if name == "mixer_out_post" else None))
    # A mixer layer binds its mixer where attention would sit (arch.binder): the same boundaries, its own names.
    name = _MIXER_AS_SUBLAYER.get(name, name)
    site = LAYER_SITES.get(name)
    if site is None:
        raise CapabilityUnsupported(name, "the eager backend has no binding for this point yet.", "see ie_lab.points.")
    return site(lm, lb, addr, name)


# ---- the site table: where each point is read on the eager module tree ------------------------------
# One reader per point (beside vLLM's Site table, ie_lab/vllm/sites.py): (lm, the layer's binding, the address, the
# point's name as the layer binds it) -> Source, or the refusal where the binder measured no faithful place.


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _attn_in(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.norm_residual:  # the input norm's output is also what the residual adds to: read (and link) it there
        return Source("post", _bound(lb.input_norm), lambda t: t)
    return Source("pre", lb.attn, lambda t: t)


def _qk_norm(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    mod = lb.q_norm if name.startswith("q") else lb.k_norm
    if mod is None and lb.kv_source is not None:  # measured by the binder: this layer computes no keys
        raise PointAbsent(
            str(addr),
            lm.binding.family,
            f"layer {addr.layer} computes no keys or values of its own: its attention reads those of layer "
            f"{lb.kv_source} (KV sharing), so it has no key norm.",
            f"capture {name}.{lb.kv_source} (the layer whose keys it reads), or q_norm_in.{addr.layer} / "
            f"q_norm_out.{addr.layer} for its own queries.",
        )
    return Source("pre" if name.endswith("_in") else "post", _bound(mod), _qk_norm_view(lb.qk_norm_layout))


def _value(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.value_source == "interface":
        return Source("attn", lb.attn, _value_from_call)
    if lb.value_source == "v_proj":
        return Source("post", _bound(lb.v_proj), lambda t: t)
    f = lm.facts
    layout = lb.fused_qkv_layout
    assert layout is not None  # measured by the binder for every layer it bound with value_source "fused"
    return Source(
        "post", _bound(lb.fused_qkv), lambda t: split_fused_qkv(t, layout, f.n_heads, f.n_kv_heads, f.head_dim)
    )


def _attention_matrix(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    fam = lm.binding.family
    if lb.kernel_calls > 1 and not lb.kernel_same_qk:  # measured by the binder
        raise CapabilityUnsupported(
            f"{name} on {fam}",
            f"layer {addr.layer} calls the attention kernel {lb.kernel_calls} times per forward with different "
            "queries or keys, and combines the calls' outputs before o_proj, so no single attention pattern per "
            "head mixed the values into z.",
            f"capture z.{addr.layer} (o_proj's input) or value.{addr.layer} (v_proj's output).",
        )
    if lb.uses_attention_interface:
        n = lb.kernel_calls  # differential attention (DiffLlama): every call was handed the same q and k
        if name == "attn_probs" and not lb.kernel_weights_ok:  # measured: its weights are not what mixed v
            return Source("attn", lb.attn, _probs_rebuilt, calls_per_forward=n)
        transform = _scores_from_call if name == "attn_scores" else _probs_from_call
        return Source("attn", lb.attn, transform, calls_per_forward=n)
    if name == "attn_scores" and lb.scores_divisor is not None:  # measured: the module's own step, its divisor
        div = lb.scores_divisor
        return Source("attn", lb.attn, lambda call, shape: _scores_at_step(call, div), at_step=True)
    if name == "attn_scores":
        raise CapabilityUnsupported(
            f"attn_scores on {fam}",
            f"{fam} computes attention inside its own module instead of through transformers' attention "
            "interface, so the pre-softmax matrix never leaves that module and ie_lab will not guess it.",
            f"capture attn_probs.{addr.layer} (served on this family from the model's own probabilities).",
        )
    impl = getattr(lm.hf.config, "_attn_implementation", None)
    if impl != "eager":
        raise CapabilityUnsupported(
            f"attn_probs on {fam} running {impl!r} attention",
            f"{fam} only returns its probabilities from its eager code path; asking a {impl!r} model for them "
            "switches it onto a different path mid-forward (on Falcon that path even drops the causal mask), "
            "so the tensor would not be the one your forward used.",
            "load the model with attn_implementation='eager' "
            "(AutoModelForCausalLM.from_pretrained(..., attn_implementation='eager')).",
        )
    return Source("attn_out_full", lb.attn, _legacy_probs, needs_output_attentions=True)


def _z(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.z_at_kernel:  # o_proj reads z normed (measured): z is what the kernel returned
        return Source("attn", lb.attn, _z_from_call)
    return Source("pre", lb.o_proj, lambda t: t)


def _attn_gate(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.attn_gate is None:  # the registry refuses it first where no layer has a gate
        why = f"the binder measured no output gate on layer {addr.layer}."
        raise CapabilityUnsupported(name, why, "capture z.")
    view, fn, H = lb.attn_gate_view, lb.attn_gate_fn, lm.facts.n_heads
    width = lb.o_proj.in_features if isinstance(lb.o_proj, nn.Linear) else H * lm.facts.head_dim
    bias = lb.attn_gate_bias
    return Source("post", lb.attn_gate, lambda t: cast(torch.Tensor, gate_values(t, view, fn, H, width, bias)))


def _latent(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    # the measured norm whose output the up-projection reads
    return Source("post", _bound(lb.q_latent if name == "q_latent" else lb.kv_latent), lambda t: t)


def _k_nope_site(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    f = lm.facts
    return Source("post_raw", _bound(lb.kv_up), lambda out, shape, n: _k_nope(out, shape, f))


def _attn_out(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.o_bias is not None:  # the bias the layer adds to the projection's output (skip-bias-add), measured
        return Source("post", lb.o_proj, _biased(lb.o_bias, None))
    return Source("post", lb.o_proj, lambda t: t)


def _attn_result(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    H = int(lm.facts.n_heads)
    kind = projection_kind(lm, lb, f"{name}.{addr.layer}")
    return Source("pre", lb.o_proj, lambda z: heads_through(z, lb.o_proj, H, kind))


def _attn_out_post(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.post_attn_norm is not None:
        return Source("post", lb.post_attn_norm, _scaled(lb.attn_multiplier))
    if lb.o_bias is not None:
        return Source("post", lb.o_proj, _biased(lb.o_bias, lb.attn_multiplier))
    return Source("post", lb.o_proj, _scaled(lb.attn_multiplier))


def _resid_mid(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.pre_mlp_norm is not None:
        return Source("pre", lb.pre_mlp_norm, lambda t: t)
    return Source("pre", lb.mlp_in_module, lambda t: t)


def _mlp_in(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.norm_residual:  # likewise the pre-MLP norm's output
        return Source("post", _bound(lb.pre_mlp_norm), lambda t: t)
    return Source("pre", lb.mlp_in_module, lambda t: t)


def _mlp_act(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    return Source("pre", _bound(lb.down_proj), lambda t: t)


def _mlp_pre(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    """mlp_pre and mlp_pre_linear: a half of a fused gate/up projection's output, or the gate's / up's own."""
    if lb.fused_gate_up is not None:
        first = (name == "mlp_pre") == lb.fused_gate_first
        return Source(
            "post", lb.fused_gate_up, (lambda t: t.chunk(2, -1)[0]) if first else (lambda t: t.chunk(2, -1)[1])
        )
    if name == "mlp_pre":
        mod = lb.gate_proj if lb.gate_proj is not None else lb.up_proj
        return Source("post", _bound(mod), lambda t: t)
    return Source("post", _bound(lb.up_proj), lambda t: t)


def _router_logits_site(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    fam = lm.binding.family
    if lb.router is None:
        raise CapabilityUnsupported(name, f"no router module was found on {fam}.", "capture expert_weights.")
    if lb.router_output == -1:
        raise CapabilityUnsupported(
            name,
            f"{fam}'s router returns several tensors as wide as the expert count and none of them equals its "
            "linear map of its input (the binder's probe forward), so ie_lab cannot tell which are its logits.",
            "capture mlp_in and apply the router's weight yourself, or capture expert_weights.",
        )
    i = lb.router_output
    return Source("post_raw", lb.router, lambda out, shape, n: _router_logits(out, shape, n, i))


def _expert_choice(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    """expert_weights and expert_indices: densified from the experts module's routing arguments, or (expert_weights)
    read from a router that returns them dense."""
    if not lb.routing_args and name == "expert_weights" and lb.router_weights_output is not None:
        i = lb.router_weights_output  # measured: the router returns the dense weights the experts' input is scaled by
        return Source("post_raw", _bound(lb.router), lambda out, shape, n: out[i].reshape(shape[0], shape[1], n))
    if not lb.routing_args:  # measured by the binder on its probe forward
        raise CapabilityUnsupported(
            name,
            f"{lm.binding.family}'s experts module is not called with the expert indices and routing weights (the "
            "binder's probe saw no such pair among its arguments), so ie_lab has nowhere faithful to read them.",
            "capture router_logits (where served) or mlp_out.",
        )
    return Source("moe_args", _bound(lb.experts), _dense_weights if name == "expert_weights" else _dense_indices)


def _mlp_out(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.mlp_side is not None:
        return _summed(lb, lambda t: t)
    return Source("post", lb.mlp_out_module, lambda t: t)


def _mlp_out_post(lm: Any, lb: LayerBinding, addr: Address, name: str) -> Source:
    if lb.post_mlp_norm is not None:
        return Source("post", lb.post_mlp_norm, _scaled(lb.mlp_multiplier))
    if lb.mlp_side is not None:
        return _summed(lb, _scaled(lb.mlp_multiplier))
    return Source("post", lb.mlp_out_module, _scaled(lb.mlp_multiplier))


_Reader = Callable[[Any, LayerBinding, Address, str], Source]

# Trunk points: read off the binding's trunk modules.
TRUNK_SITES: dict[str, Callable[[Any], Source]] = {
    "embeddings": lambda b: Source("post", b.embed, _same),
    "final_norm": lambda b: Source("post", b.final_norm, _same),
    "lm_head": lambda b: Source("post", b.lm_head, _same),  # the model's own head output (after any input scale)
}

# Layer points, by the name the layer binds them under (a mixer layer's mixer_in / mixer_out / mixer_out_post are
# read where attention's attn_in / attn_out / attn_out_post would be: _MIXER_AS_SUBLAYER). The multi-stream points
# and the per-stream residuals are _stream_source's; mixer_state and mixer_conv_state are read by capture, not here.
LAYER_SITES: dict[str, _Reader] = {
    "resid_pre": lambda lm, lb, addr, name: Source("pre", lb.layer, _same),
    "resid_post": lambda lm, lb, addr, name: Source("post", lb.layer, _same),
    "attn_in": _attn_in,
    "q_norm_in": _qk_norm,
    "q_norm_out": _qk_norm,
    "k_norm_in": _qk_norm,
    "k_norm_out": _qk_norm,
    "value": _value,
    "attn_scores": _attention_matrix,
    "attn_probs": _attention_matrix,
    "z": _z,
    "attn_gate": _attn_gate,
    "q_latent": _latent,
    "kv_latent": _latent,
    "k_nope": _k_nope_site,
    "attn_out": _attn_out,
    "attn_result": _attn_result,
    "attn_out_post": _attn_out_post,
    "resid_mid": _resid_mid,
    "mlp_in": _mlp_in,
    "mlp_pre": _mlp_pre,
    "mlp_pre_linear": _mlp_pre,
    "mlp_act": _mlp_act,
    "router_logits": _router_logits_site,
    "expert_weights": _expert_choice,
    "expert_indices": _expert_choice,
    "mlp_out": _mlp_out,
    "mlp_out_post": _mlp_out_post,
}


# ---- transforms that need more than one tensor ---------------------------------------------------


def _z_from_call(call: attention_tap.AttentionCall, shape: tuple[int, int]) -> torch.Tensor:
    out = call.output  # [b, q, H, d]: the kernel returns its output with heads after the sequence
    return out.reshape(out.shape[0], out.shape[1], -1)


def _k_nope(out: Any, shape: tuple[int, int], f: Any) -> torch.Tensor:
    """The key part of each head's block of the key/value up-projection's output, for this forward's new tokens:
    the up-projection reads the whole cached latent, so earlier positions come first."""
    t = first_tensor(out)
    assert t is not None  # a linear's output
    b, s = shape
    t = t.reshape(b, -1, f.n_heads, f.qk_nope_head_dim + f.value_head_dim)[:, -s:, :, : f.qk_nope_head_dim]
    return t.reshape(b, s, -1)


def _value_from_call(call: attention_tap.AttentionCall, shape: tuple[int, int]) -> torch.Tensor:
    q_len = call.query.shape[2]
    v = call.value[:, :, -q_len:, :]  # the cache may prepend earlier positions
    return v.transpose(1, 2).reshape(v.shape[0], q_len, -1)


# Kernels that accept a softcap keyword but do not apply it; the recompute mirrors what actually ran.
_IGNORES_SOFTCAP = frozenset({"sdpa"})


def _recompute(call: attention_tap.AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    cached = getattr(call, "_ie_lab_recomputed", None)
    if cached is not None:  # scores and probs asked of the same call: compute once
        return cached
    softcap = None if call.implementation in _IGNORES_SOFTCAP else call.kwargs.get("softcap")
    # a memo of ours on attention_tap's per-call record, read back above
    call._ie_lab_recomputed = out = scores_and_probs(  # type: ignore[attr-defined]
        call.query,
        call.key,
        scaling=call.scaling,
        attention_mask=call.attention_mask,
        softcap=softcap,
        sliding_window=call.kwargs.get("sliding_window"),
        sinks=call.kwargs.get("s_aux", call.kwargs.get("sinks")),
    )
    return out


def _scores_from_call(call: attention_tap.AttentionCall, shape: tuple[int, int]) -> torch.Tensor:
    return _recompute(call)[0].to(call.query.dtype)


def _probs_from_call(call: attention_tap.AttentionCall, shape: tuple[int, int]) -> torch.Tensor:
    if call.weights is not None and call.weights.dim() == 4:
        return call.weights  # the eager kernel's own probabilities
    return _recompute(call)[1].to(call.query.dtype)


def _scores_at_step(call: attention_tap.AttentionCall, divisor: float) -> torch.Tensor:
    # the scores the step computes in float32 before its softmax, masked entries -inf (as on every family)
    return divided_scores(call.query, call.key, divisor, call.attention_mask).to(call.query.dtype)


def _probs_rebuilt(call: attention_tap.AttentionCall, shape: tuple[int, int]) -> torch.Tensor:
    return _recompute(call)[1].to(call.query.dtype)


def _legacy_probs(out: Any, shape: tuple[int, int]) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        for t in out[1:]:
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                return t
    raise CapabilityUnsupported("attn_probs", "the attention module returned no probabilities.", "use attn_scores.")


def _router_logits(out: Any, shape: tuple[int, int], n_experts: int, index: int | None = None) -> torch.Tensor:
    # Routers return logits alone or inside a tuple whose order varies by family (GraniteMoE puts indices
    # first): take the floating tensor that is n_experts wide, or the one the binder measured as the logits where
    # several are (LayerBinding.router_output).
    items = out if isinstance(out, (tuple, list)) else (out,)
    if index is not None:
        items = (items[index],)
    t = next(
        (x for x in items if isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape[-1] == n_experts), None
    )
    if t is None:
        raise CapabilityUnsupported(
            "router_logits", "the router returned no tensor as wide as the expert count.", "capture expert_weights."
        )
    return t.reshape(shape[0], shape[1], n_experts)


def _routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
        v for v in kwargs.values() if isinstance(v, torch.Tensor)
    ]
    idx = next(t for t in tensors if not t.is_floating_point())
    w = next(t for t in tensors if t.is_floating_point() and t.shape == idx.shape)
    return idx, w


def _dense(n_experts: int, idx: torch.Tensor, vals: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    dense = torch.zeros(idx.shape[0], n_experts, dtype=vals.dtype, device=vals.device)
    dense.scatter_(1, idx.long(), vals)
    return dense.reshape(shape[0], shape[1], n_experts)


def _dense_weights(routing: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int], n_experts: int) -> torch.Tensor:
    idx, w = routing
    return _dense(n_experts, idx, w.float(), shape).to(w.dtype)


def _dense_indices(routing: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int], n_experts: int) -> torch.Tensor:
    idx, w = routing
    return _dense(n_experts, idx, torch.ones_like(w, dtype=torch.float32), shape)
