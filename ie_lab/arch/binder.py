"""The binder: finds each structural role on a live HF module tree.

Names only nominate candidates (short vocabularies of attribute spellings). What a module *is* —
a pre-norm or a post-norm, a parallel block, a gate or an up branch, a residual multiplier, a fused
QKV layout — is decided by a probe forward on the real model, comparing the tensors that actually
flow between modules. If the measured structure does not add up (the residual identities fail),
the model is refused with a StructureError rather than served with plausible-but-wrong tensors.

This module is the door and the probe forward: `bind` nominates (arch.nominate, by the names in arch.spellings),
runs one small forward with every candidate watched (arch.recorder), and hands the recorded tensors to the rooms
that measure each part of the structure:
- arch.measure_attention: z, the value, output gates and sub-norms, shared keys, latent attention;
- arch.measure_mlp: experts' routing, the router's logits, a gate after the down projection, gate vs up;
- arch.measure_residual: the norms and residual wiring of each layer (naming why it fails via
  arch.residual_refusals), the factor between layers, the scale before the unembedding;
- arch.measure_streams: hyper-connection layers (several residual streams);
- arch.measured_notes: the sentences a reader of the points should know.
The result types are in arch.binding; the names below are re-exported for the eager backend and the tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import ArchitectureUnsupported, StructureError
from . import attention_tap, mixer_states
from .binding import Binding, LayerBinding
from .config_facts import UNBOUND_INSTEAD, ArchFacts, unbound_structure
from .measure_attention import (
    check_kernel_feeds_o_proj,
    gate_values,
    measure_fused_layout,
    measure_kv_sources,
    measure_latents,
    measure_step_divisor,
    split_fused_qkv,
    weights_explain_output,
)
from .measure_mlp import measure_router_output, measure_router_weights, routing_in_args
from .measure_residual import classify_layer, measure_head_input_scale, measure_stream_scales
from .measured_notes import measured_quirks
from .nominate import nominate
from .recorder import PROBE_LEN, Recorder, detached, first_tensor, hidden_arg, same
from .spellings import is_norm, norm_children

__all__ = [
    "PROBE_LEN",
    "Binding",
    "LayerBinding",
    "bind",
    "first_tensor",
    "gate_values",
    "hidden_arg",
    "split_fused_qkv",
]


def bind(model: nn.Module, facts: ArchFacts | None = None) -> Binding:
    """Bind roles on a live causal LM, measuring structure with one small probe forward.

    Every refusal names what did not add up and, as every ie_lab error does, what to do instead."""
    facts = facts or ArchFacts.from_config(model.config)
    found = unbound_structure(model.config)
    if found is not None:
        raise ArchitectureUnsupported(found[0], found[1], UNBOUND_INSTEAD)
    try:
        return _bind(model, facts)
    except StructureError as e:
        if "Instead:" in str(e):
            raise
        leak = _future_leak(model, facts)
        if leak is not None:  # the first thing wrong is that it is not a causal decoder as loaded
            raise StructureError(
                f"{facts.model_type} is not causal as loaded: changing the last of {PROBE_LEN} tokens changes the "
                f"logits at earlier positions (by up to {leak:.3g}), so its attention sees later tokens "
                "(bidirectional or permutation attention), and ie_lab binds causal decoders only (the structure "
                f"check said: {e}) Instead: {UNBOUND_INSTEAD}"
            ) from e.__cause__
        raise StructureError(f"{e} Instead: {UNBOUND_INSTEAD}") from e.__cause__


def _bind(model: nn.Module, facts: ArchFacts) -> Binding:
    """Nominate by name, measure on the probe forward, then find where each mixer leaves its states."""
    binding = nominate(model, facts)
    _measure(model, binding)
    mixer_states.measure(model, binding)
    return binding


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode for a probe forward, each module's own training flag put back after (model.train(flag)
    would flatten a mixed state)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in modes:
            m.training = flag


@torch.no_grad()
def _future_leak(model: nn.Module, facts: ArchFacts) -> float | None:
    """How much the logits at earlier positions move when only the last token changes: None for a causal model (or
    one whose forward cannot be run on token ids alone)."""
    gen = torch.Generator().manual_seed(4321)
    vocab = max(2, facts.vocab_size)
    ids = torch.randint(0, vocab, (1, PROBE_LEN), generator=gen).to(next(model.parameters()).device)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    try:
        with _eval_mode(model):
            a, b = (getattr(model(input_ids=x), "logits", None) for x in (ids, other))
    except Exception:  # noqa: BLE001 - the structural refusal stands on its own
        return None
    if a is None or b is None or a.shape != b.shape or a.dim() != 3:
        return None
    leak = float((a[:, :-1].float() - b[:, :-1].float()).abs().max())
    return leak if leak > 1e-4 * max(float(a.float().abs().max()), 1e-6) else None


def _probe(model: nn.Module, binding: Binding, rec: Recorder, **kwargs: Any) -> set[int]:
    """One small forward with the recorder and the attention tap listening; returns the ids of the
    attention modules that went through transformers' attention interface."""
    facts = binding.facts
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, max(2, facts.vocab_size), (1, PROBE_LEN), generator=gen).to(device)
    seen: set[int] = set()
    kernel_out = rec.kernel_outputs = {}
    weights_ok = rec.kernel_weights_ok = {}
    calls = rec.kernel_calls = {}
    keys = rec.kernel_keys = {}
    first_qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    same_qk = rec.kernel_same_qk = {}
    steps = rec.step_calls = {}

    def listener(module, call):
        if call.implementation == attention_tap.STEP:  # the module's own attention step, not the registry
            steps.setdefault(id(module), call)
            return
        seen.add(id(module))
        calls[id(module)] = calls.get(id(module), 0) + 1
        kernel_out.setdefault(id(module), call.output.detach().clone())
        keys.setdefault(id(module), call.key.detach().clone())
        q, k = first_qk.setdefault(id(module), (call.query.detach().clone(), call.key.detach().clone()))
        same_qk[id(module)] = same_qk.get(id(module), True) and _equal(q, call.query) and _equal(k, call.key)
        if id(module) not in weights_ok:
            weights_ok[id(module)] = weights_explain_output(call)

    attns = tuple(lb.attn for lb in binding.layers if not lb.mixer_kind and not lb.mlp_only)
    try:
        with (
            _eval_mode(model),
            rec,
            attention_tap.listening({id(lb.attn): listener for lb in binding.layers}, steps=attns),
        ):
            model(input_ids=ids, use_cache=False, **kwargs)
    except StructureError:
        raise
    except Exception as e:
        raise StructureError(f"{binding.family}: the probe forward failed ({type(e).__name__}: {e}).") from e
    return seen


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b.detach())


@torch.no_grad()
def _measure(model: nn.Module, binding: Binding) -> None:
    rec = Recorder()
    for lb in binding.layers:
        for m in (
            lb.layer,
            lb.attn,
            lb.o_proj,
            lb.mlp_in_module,
            lb.mlp_out_module,
            lb.q_norm,
            lb.k_norm,
            lb.gate_proj,
            lb.up_proj,
            lb.fused_gate_up,
            lb.down_proj,
            lb.router,
            lb.experts,
            lb.v_proj,
            lb.fused_qkv,
            lb.mlp_side,
            lb.mlp_out_gate,
            *lb.layer.children(),  # what else the layer runs: named when the residual identities fail
            lb.attn_hc,
            lb.mlp_hc,
            *norm_children(lb),
            # gate and sub-norm candidates between the kernel and o_proj
            *(m for m in lb.attn.children() if (isinstance(m, nn.Linear) or is_norm(m)) and not lb.mixer_kind),
            # what else the layer runs between a sublayer and its residual add, named where the identities fail
            *(m for m in lb.layer.children() if not isinstance(m, (nn.ModuleList, nn.Dropout))),
        ):
            rec.watch(m)
    last: dict[str, torch.Tensor] = {}  # the final norm's last output and the unembedding's input
    handles = []
    if binding.stream_head is not None and binding.final_norm is not None:
        rec.watch(binding.stream_head)
    if binding.final_norm is not None:
        handles.append(
            binding.final_norm.register_forward_pre_hook(lambda m, a: last.__setitem__("norm_in", detached(a)))
        )
        handles.append(binding.final_norm.register_forward_hook(lambda m, a, o: last.__setitem__("norm", detached(o))))
        handles.append(binding.lm_head.register_forward_pre_hook(lambda m, a: last.__setitem__("head", detached(a))))
    try:
        seen = _probe(model, binding, rec)
    finally:
        for h in handles:
            h.remove()
    if binding.stream_head is not None:
        # it must read the last layer's stack and hand the final norm its input, or the lens would not be the model's
        ok = same(rec.inp(binding.stream_head), rec.out(binding.layers[-1].layer)) and same(
            rec.out(binding.stream_head), last.get("norm_in")
        )
        binding.stream_head = binding.stream_head if ok else None
    if "norm" in last and "head" in last and not same(last["norm"], last["head"]):
        scale = measure_head_input_scale(binding, last["norm"], last["head"])
        if scale is not None:
            binding.head_input_scale = scale
            binding.facts = replace(binding.facts, logit_divisor=None)  # applied before the head, not after it
    if "norm" in last and "head" in last and not same(last["norm"], last["head"]) and not binding.head_input_scale:
        raise StructureError(
            f"{binding.family}: the final norm's output is changed (rescaled) before the unembedding reads it, and "
            "ie_lab does not bind that step yet, so final_norm and the logit lens would not be what the model used."
        )
    measure_kv_sources(binding, rec, seen)
    legacy = []
    for lb in binding.layers:
        lb.uses_attention_interface = id(lb.attn) in seen
        if lb.mlp_only:
            continue  # no token mixer: nothing of attention to measure
        if lb.mixer_kind:
            if lb.uses_attention_interface:
                raise StructureError(
                    f"{binding.family} layer {lb.index}: bound as a {lb.mixer_kind} mixer, but the module calls "
                    "transformers' attention interface, so it is attention and its points would be misnamed."
                )
            continue
        if lb.uses_attention_interface:
            lb.value_source = "interface"
        elif lb.v_proj is not None:
            lb.value_source = "v_proj"
        elif lb.fused_qkv is not None:
            lb.value_source = "fused"
            legacy.append(lb)
        else:
            raise StructureError(f"{binding.family} layer {lb.index}: cannot find the value projection.")
    for lb in binding.layers:
        if lb.sparse_moe and lb.experts is not None:
            lb.routing_args = routing_in_args(rec.args.get(id(lb.experts)), binding.facts.n_experts)
        if lb.sparse_moe and lb.router is not None:
            lb.router_output = measure_router_output(
                lb.router, rec.inputs.get(id(lb.router)), rec.outputs.get(id(lb.router)), binding.facts.n_experts
            )
            if not lb.routing_args and lb.experts is not None:
                f = binding.facts
                lb.router_weights_output = measure_router_weights(lb, rec, f.n_experts, f.experts_per_token)
        lb.kernel_calls = rec.kernel_calls.get(id(lb.attn), 1)
        if lb.uses_attention_interface and lb.kernel_calls > 1:
            # differential attention: z is o_proj's input whatever the calls computed, the value is v_proj's output
            # (each call sees one half of it); the pattern points are served where every call was handed the same q
            # and k (one pattern per head, eager/sites.py reads the first call of each forward), refused otherwise
            lb.kernel_same_qk = rec.kernel_same_qk.get(id(lb.attn), False)
            if lb.v_proj is None:
                raise StructureError(
                    f"{binding.family} layer {lb.index}: the attention calls the kernel {lb.kernel_calls} times per "
                    "forward and has no value projection among the names ie_lab knows, so its value cannot be read."
                )
            lb.value_source = "v_proj"
        elif lb.uses_attention_interface:
            lb.kernel_weights_ok = rec.kernel_weights_ok.get(id(lb.attn), True)
            check_kernel_feeds_o_proj(lb, rec, binding.family, binding.facts.n_heads)
        elif not lb.mixer_kind and not lb.mlp_only:
            lb.scores_divisor = measure_step_divisor(lb.attn, rec.step_calls.get(id(lb.attn)))
        classify_layer(lb, rec, binding.facts, binding.family)
        if not lb.mixer_kind:
            measure_latents(lb, rec, binding.facts)
        if lb.mixer_kind:
            lb.q_norm = lb.k_norm = None
    measure_stream_scales(binding, rec, last.get("norm_in"))
    binding.notes += measured_quirks(binding)
    if legacy:
        # Fused QKV outside the attention interface: learn the value slice from a forward that returns probs.
        rec2 = Recorder()
        for lb in legacy:
            for m in (lb.attn, lb.o_proj, lb.fused_qkv):
                rec2.watch(m)
        _probe(model, binding, rec2, output_attentions=True)
        for lb in legacy:
            probs = None
            full = rec2.outputs.get(id(lb.attn))
            if isinstance(full, (tuple, list)):
                probs = next((t for t in full[1:] if isinstance(t, torch.Tensor) and t.dim() == 4), None)
            layout = measure_fused_layout(rec2.out(lb.fused_qkv), rec2.inp(lb.o_proj), probs, binding.facts)
            if layout is None:
                raise StructureError(
                    f"{binding.family} layer {lb.index}: could not measure which slice of the fused QKV output is the "
                    "value (its q/k/v layout is none of those ie_lab knows: contiguous, per head, grouped)."
                )
            lb.fused_qkv_layout = layout
