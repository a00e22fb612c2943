"""The binder: finds each structural role on a live HF module tree.

Names only nominate candidates (short vocabularies of attribute spellings). What a module *is* —
a pre-norm or a post-norm, a parallel block, a gate or an up branch, a residual multiplier, a fused
QKV layout — is decided by a probe forward on the real model, comparing the tensors that actually
flow between modules. If the measured structure does not add up (the residual identities fail),
the model is refused with a StructureError rather than served with plausible-but-wrong tensors.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..errors import ArchitectureUnsupported, StructureError
from . import attention_tap, mixer_states
from .config_facts import UNBOUND_INSTEAD, ArchFacts, unbound_structure

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer", "multi_head_attention")
# A child of the layer that wraps its input norm, attention, residual add and pre-MLP norm in one module (DBRX's
# norm_attn_norm): the attention and norms are looked for inside it, and the probe measures their roles as usual.
SUBLAYER_WRAPPER_NAMES = ("norm_attn_norm",)
# Where hybrid and state-space layers keep a token mixer that is not attention (state space, linear attention,
# convolution, recurrence); a config-declared mixer layer may also keep it under an attention spelling.
MIXER_NAMES = (
    "mamba",
    "linear_attn",
    "conv",
    "temporal_block",
    "mixer",
    "linear_attention",
    "token_mixer",
    "mlstm_layer",  # xLSTM
)
# shared_mlp last: a dense Granite hybrid (no experts) keeps its one MLP there; beside a MoE it is a side MLP
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe", "mlp_block", "shared_mlp")
Q_NAMES = ("q_proj", "query", "wq")
K_NAMES = ("k_proj", "key", "wk")
V_NAMES = ("v_proj", "value", "wv")
# o_b_proj: the second step of a low-rank output projection (DeepSeek-V4's o_a_proj then o_b_proj)
O_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "wo", "o_b_proj")
FUSED_QKV_NAMES = ("c_attn", "query_key_value", "qkv_proj", "Wqkv", "qkv")
Q_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm")
K_NORM_NAMES = ("k_norm", "k_layernorm", "key_layernorm")
GATE_NAMES = ("gate_proj", "w1", "proj_up_gate")
UP_NAMES = ("up_proj", "w3", "c_fc", "fc_in", "fc1", "dense_h_to_4h", "proj_up")
DOWN_NAMES = ("down_proj", "w2", "c_proj", "fc_out", "fc2", "dense_4h_to_h", "proj_down", "output_linear")
FUSED_GATE_UP_NAMES = ("gate_up_proj", "input_linear")  # Granite's shared MLP: input_linear's halves, measured
ACT_NAMES = ("act_fn", "act", "activation_fn", "gelu_impl", "activation")
ROUTER_NAMES = ("gate", "router")
EXPERTS_NAMES = ("experts",)
# A second MLP the layer runs on the MLP's input and sums with the MLP's output before the residual add, outside
# any module (GraniteMoE-shared's and Granite-hybrid's shared expert beside the MoE block): mlp_out is that sum.
SIDE_MLP_NAMES = ("shared_mlp",)
# A channel mix (RWKV's feed_forward): key -> squared ReLU -> value, the value projection's output multiplied by an
# activated gate (receptance) the module computes from its own input, both linears reading that input mixed with the
# previous token's. Nominated only on an MLP with none of DOWN_NAMES; the probe checks the module's output is the
# down projection's output times the activated gate (_mlp_out_gate), or the layer is refused as before.
CHANNEL_MIX_UP_NAMES = ("key",)
CHANNEL_MIX_DOWN_NAMES = ("value",)
MLP_OUT_GATE_NAMES = ("receptance",)
# Hyper-connection trunks (several residual streams): the modules that collapse the stream stack into each
# sublayer's input and return the weights that write its output back (DeepSeek-V4, HY-V4). The probe measures
# which of their outputs is the collapse, the write weights and the mixing matrix.
ATTN_HC_NAMES = ("attn_hc", "hc_attn")
# Latent attention: the norms after the query and key/value down-projections, and the up-projections that read them
# (DeepSeek-V2/V3, MiniCPM 3; DeepSeek-V4 compresses its queries alone). The probe checks each norm feeds its up.
Q_LATENT_NORM_NAMES = ("q_a_layernorm", "q_a_norm")
Q_UP_NAMES = ("q_b_proj",)
KV_LATENT_NORM_NAMES = ("kv_a_layernorm",)
KV_UP_NAMES = ("kv_b_proj",)
MLP_HC_NAMES = ("ffn_hc", "mlp_hc", "hc_ffn", "hc_mlp")
# Alternating updates (Gemma 3n): a module that predicts and corrects a stack of streams around the layer
ALTUP_NAMES = ("altup",)
# The trunk's last collapse of the streams, before the final norm (DeepSeek-V4, HY-V4)
STREAM_HEAD_NAMES = ("hc_head",)
FINAL_NORM_NAMES = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "norm_f",
    "ln_final",
    "layernorm",
    "out_norm",  # xLSTM
    "ln_out",  # RWKV
)

PROBE_LEN = 7  # distinct from every head count we meet, so [.., heads, seq, ..] layouts are unambiguous


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for n in names:
        m = getattr(module, n, None)
        if isinstance(m, nn.Module):
            return n, m
    return None


def _reads_shared_kv(attn: nn.Module) -> bool:
    """An attention module with a query projection but no key or value projection of any kind: a candidate for
    reading another layer's keys and values (KV sharing); the probe decides (_measure_kv_sources)."""
    return (
        _child(attn, Q_NAMES) is not None
        and _child(attn, K_NAMES) is None
        and _child(attn, V_NAMES) is None
        and _child(attn, FUSED_QKV_NAMES) is None
        and _child(attn, K_NORM_NAMES) is None
    )


def _is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower()


def first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            if isinstance(item, torch.Tensor):
                return item
    return None


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden-states input of a module call, whether passed by position or keyword."""
    if "hidden_states" in kwargs and isinstance(kwargs["hidden_states"], torch.Tensor):
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for key in ("x", "input", "hidden"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def _match_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.shape == b.shape:
        return a
    # Some layers flatten [b, s, d] to [b*s, d] around their MLP (OPT); compare the same numbers.
    if a.numel() != b.numel() or a.shape[-1] != b.shape[-1]:
        return None
    return a.reshape(b.shape)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Is this the same tensor flowing from one module to the next? (Tight at every dtype.)"""
    if a is None or b is None:
        return False
    a = _match_shape(a, b)
    if a is None:
        return False
    scale = max(float(b.float().abs().max()), 1e-6)
    return float((a.float() - b.float()).abs().max()) <= 1e-6 * scale


def _detached(x: Any) -> torch.Tensor:
    t = first_tensor(x)
    assert t is not None  # hooked on the final norm's output and the unembedding's input: tensors on every model
    return t.detach().clone()


def _close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float = 1e-5) -> bool:
    """Equal up to rounding: for sums we recompute in another order, so the dtype's precision counts."""
    if a is None or b is None:
        return False
    a = _match_shape(a, b)
    if a is None:
        return False
    eps = max(torch.finfo(t.dtype).eps for t in (a, b) if t.is_floating_point())
    tol = max(tol, 8 * eps)
    scale = max(float(b.float().abs().max()), 1e-6)
    return float((a.float() - b.float()).abs().max()) <= tol * scale + 1e-7


@dataclass
class LayerBinding:
    index: int
    layer: nn.Module
    attn: nn.Module
    o_proj: nn.Module
    mlp: nn.Module | None  # None when the MLP's linears sit directly on the layer (OPT)
    mlp_in_module: nn.Module  # its input is mlp_in
    mlp_out_module: nn.Module  # its output is mlp_out
    input_norm: nn.Module | None = None
    post_attn_norm: nn.Module | None = None
    pre_mlp_norm: nn.Module | None = None
    post_mlp_norm: nn.Module | None = None
    parallel: bool = False
    attn_multiplier: float | None = None
    mlp_multiplier: float | None = None
    # A residual taken after each sublayer's input norm (MiniMax's alpha/beta factors): resid_mid = attn_alpha *
    # attn_in + attn_out_post and resid_post = mlp_alpha * mlp_in + mlp_out_post, the betas being attn_multiplier and
    # mlp_multiplier. Measured, and bound only with the factors the config states (_norm_residual); None elsewhere.
    attn_alpha: float | None = None
    mlp_alpha: float | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    qk_norm_layout: str = "flat"  # "flat" [b,s,h*d] | "bshd" | "bhsd"
    # The earlier layer whose keys and values this layer's attention reads (KV sharing: Kolibri 1.1's layers with a
    # query projection and norm but no key or value projection), measured: its kernel call's keys are that layer's.
    # Such a layer has no key norm of its own (k_norm None, q_norm bound); None on a layer that computes its keys.
    kv_source: int | None = None
    value_source: str = "interface"  # "interface" | "v_proj" | "fused"
    v_proj: nn.Module | None = None
    fused_qkv: nn.Module | None = None
    fused_qkv_layout: str | None = None  # "contiguous" | "per_head" | "grouped"
    uses_attention_interface: bool = False
    gate_proj: nn.Module | None = None
    up_proj: nn.Module | None = None
    fused_gate_up: nn.Module | None = None
    fused_gate_first: bool = True
    down_proj: nn.Module | None = None
    sparse_moe: bool = False
    router: nn.Module | None = None
    experts: nn.Module | None = None
    routing_args: bool = True  # the experts module is called with (expert indices, routing weights), measured
    # Which of the router's returned tensors is its logits, measured (_router_output): None where only one returned
    # tensor is n_experts wide; its index where several are (Llama 4 returns its top-k sigmoid scores first and the
    # logits second); -1 where several are and none is the router's own linear map of its input.
    router_output: int | None = None
    kernel_weights_ok: bool = True  # the kernel's returned weights are the pattern that mixed the values, measured
    # How many times the attention module calls the kernel per forward, measured: more than one is differential
    # attention (DiffLlama: two calls, one per half of the values, combined as out1 - lambda * out2 and normed before
    # o_proj). There z is o_proj's input and value v_proj's output, and no single pattern mixed the values into z.
    kernel_calls: int = 1
    attn_gate: nn.Module | None = None  # the module whose output gates the kernel's output before o_proj
    attn_gate_view: str = "full"  # "full" | "per_head" (one gate per head) | "per_head_half" (2nd half per head)
    attn_gate_fn: str = "sigmoid"  # "sigmoid" | "softplus"
    attn_gate_bias: nn.Parameter | None = None  # the attention module's own bias added to the gate (Beam's gate_bias)
    # A bias the attention module returns beside its output projection's output for the layer to add before the
    # residual add (skip-bias-add: GPT-NeoX-Japanese's dense_bias on its last layer), measured: attn_out is the
    # projection's output plus it, where the layer's sum is formed.
    o_bias: nn.Parameter | None = None
    z_sub_norm: nn.Module | None = None  # a norm between the kernel's output and o_proj (BitNet's attn_sub_norm)
    attn_sinks: bool = False  # a learned per-head sink logit joins the softmax (rows sum below 1)
    # A mixer layer (hybrid and state-space trunks): what its token mixer is, "" on an attention layer. There
    # `attn` and `o_proj` are both the mixer module, so its input and output are the sublayer's in and out.
    mixer_kind: str = ""
    # Where the mixer's final states are after a forward, measured (arch.mixer_states): 'recurrent' / 'conv' ->
    # 'cache:recurrent_states', 'rnn_state:0', 'module:rg_lru.recurrent_states', ...; empty where it keeps none.
    mixer_states: dict[str, str] = field(default_factory=dict)
    # A mixer-only block (pure state-space trunks): no MLP, so resid_post = resid_pre + mixer_out_post.
    has_mlp: bool = True
    # A side MLP summed with the MLP's output by the layer itself (SIDE_MLP_NAMES), or None; mlp_out is the sum of
    # the two outputs, written through the one that runs last (measured: mlp_side_last).
    mlp_side: nn.Module | None = None
    mlp_side_last: bool = True
    # A token mixer beside attention on the same layer, both added to the residual stream (Falcon-H1's Mamba), with
    # the factor the layer scales its output by (measured with attention's, by least squares, then verified), and
    # whether it runs before attention. The mixer points are read there; resid_mid = resid_pre + both.
    par_mixer: nn.Module | None = None
    par_mixer_multiplier: float | None = None
    par_mixer_first: bool = True
    # An MLP-only block (single-sublayer trunks, Nemotron-H): no token mixer, so resid_post = resid_pre +
    # mlp_out_post; `attn` and `o_proj` are then the MLP module too, never read (the registry refuses them there).
    mlp_only: bool = False
    # Hyper-connection trunks: the modules that collapse the stream stack before attention and before the MLP, and
    # where in their output tuple the probe found each role ("collapse", "write", and "mix" where the streams are
    # mixed by a matrix); mix_transposed: the layer applies the matrix as returned transposed, so it is served
    # transposed back ([.., i, j] is stream i's weight in stream j either way).
    attn_hc: nn.Module | None = None
    mlp_hc: nn.Module | None = None
    hc_roles: dict[str, int] = field(default_factory=dict)
    stream_mix: bool = False
    mix_transposed: bool = False
    # Why z is read at the kernel's output when no norm explains it (a low-rank output projection that first
    # rotates the kernel's output back, DeepSeek-V4): no module boundary carries z onward there either.
    z_at_kernel_why: str = ""
    # A KV compressor on the attention module (DeepSeek-V4's compressed sparse / heavily compressed layers): the
    # kernel also attends to entries it builds from blocks of tokens, so the key axis is not one entry per token.
    # Holds the layer's type as the config names it.
    kv_compressor: str = ""
    # Latent attention, measured: the norm whose output the query up-projection reads (q_latent), the one whose
    # output the key/value up-projection reads (kv_latent), and that up-projection (k_nope is the key part of each
    # head's block of its output).
    q_latent: nn.Module | None = None
    kv_latent: nn.Module | None = None
    kv_up: nn.Module | None = None
    # The layer's child that wraps its attention and the norms around it (DBRX's norm_attn_norm), or None.
    wrapper: nn.Module | None = None
    # A gate multiplied into the MLP's output after its down projection (RWKV's channel-mix receptance): the linear
    # whose activated output (mlp_out_gate_fn) times the down projection's output is the MLP module's output, so
    # mlp_out is that gated product and mlp_act still the down projection's input. Measured; None elsewhere.
    mlp_out_gate: nn.Module | None = None
    mlp_out_gate_fn: str = "sigmoid"
    # The MLP reads the previous token too (RWKV's token shift), measured: its output at a position changes when
    # only the previous position of mlp_in does, so mlp_pre / mlp_act / mlp_out at t depend on mlp_in at t-1 and t.
    mlp_token_shift: bool = False
    # A norm the layer applies to the residual stream itself before its first sublayer, so the first residual add
    # reads stream_norm(resid_pre) (RWKV's pre_ln, on layer 0 only): resid_mid = stream_norm(resid_pre) +
    # mixer_out_post. resid_pre stays the layer's input (what steering and patching there change). Measured.
    stream_norm: nn.Module | None = None
    # The factor the trunk multiplies this layer's output by, outside any module, before the next layer (or the
    # final norm) reads it: resid_pre.{L+1} = stream_scale * resid_post.L (RWKV halves the stream every
    # rescale_every layers in eval mode). Measured on the probe forward; None where the next reader reads it as is.
    stream_scale: float | None = None
    names: dict[str, str] = field(default_factory=dict)  # role -> dotted path, for docs and the diagram

    @property
    def gated_mlp(self) -> bool:
        return self.fused_gate_up is not None or self.gate_proj is not None

    @property
    def z_at_kernel(self) -> bool:
        """z is read at the kernel's output: a norm sits between it and o_proj (measured). An output gate does not
        move z: z is o_proj's input (the gated product, as the registry and every other engine read it) and
        attn_gate is the gate that multiplied the kernel's output into it."""
        return self.z_sub_norm is not None or bool(self.z_at_kernel_why)

    @property
    def has_resid_mid(self) -> bool:
        return not self.parallel

    @property
    def norm_residual(self) -> bool:
        """Each sublayer's output is added to its input norm's output (times alpha), not to the stream it read: the
        norms' outputs are attn_in / mlp_in, and nothing but the norm reads resid_pre or resid_mid."""
        return self.attn_alpha is not None


@dataclass
class Binding:
    facts: ArchFacts
    embed: nn.Module
    final_norm: nn.Module | None
    lm_head: nn.Module
    layers: list[LayerBinding]
    layers_path: str
    family: str
    notes: list[str] = field(default_factory=list)
    # The unembedding reads the final norm's output times this scalar (MiniCPM 3 divides by its logits_scaling
    # first): measured, and bound only where it is the config's logit divisor on a bias-free head. The divisor then
    # acts before the head, not after: lm_head is the head's output (the model's logits, where every engine reads
    # it), the logit lens scales the final norm's output by this before the head, and the facts drop the divisor.
    head_input_scale: float | None = None
    # Hyper-connection trunks: the module that collapses the last layer's stream stack into the one vector per token
    # the final norm reads (DeepSeek-V4's hc_head), measured; the logit lens reads a layer's stack through it.
    stream_head: nn.Module | None = None

    @property
    def structure(self) -> dict[str, Any]:
        """Measured structure flags, comparable with ArchFacts' config-derived ones."""
        first = next((lb for lb in self.layers if not lb.mixer_kind and not lb.mlp_only), self.layers[0])
        return {
            "parallel_block": first.parallel,
            "sandwich_norms": first.post_attn_norm is not None,
            "pre_norms": first.input_norm is not None,
            "gated_mlp": any(lb.gated_mlp for lb in self.layers if not lb.sparse_moe and lb.has_mlp)
            if any(not lb.sparse_moe and lb.has_mlp for lb in self.layers)
            else None,
            "qk_norm": first.q_norm is not None,
            "moe_layers": tuple(lb.index for lb in self.layers if lb.sparse_moe),
        }


def _find_layers(model: nn.Module, n_layers: int, embed: nn.Module | None = None) -> tuple[str, nn.ModuleList]:
    """The shallowest ModuleList as long as the config's layer count; of those, one beside the token embedding first
    (a multimodal wrapper's vision tower may have as many layers as its text trunk: GOT-OCR 2)."""
    best: tuple[str, nn.ModuleList] | None = None

    def beside_embed(name: str) -> bool:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        return embed is not None and any(c is embed for c in parent.children())

    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers and n_layers > 0:
            key = (not beside_embed(name), name.count("."))
            if best is None or key < (not beside_embed(best[0]), best[0].count(".")):
                best = (name, m)
    if best is None:
        raise StructureError(
            f"could not find the decoder layers: no ModuleList of length {n_layers} (the config's layer count)"
            f"{_layer_lists_found(model)}."
        )
    return best


def _layer_lists_found(model: nn.Module) -> str:
    """What the trunk holds instead of one list of the config's length: several layer stacks (HRM's H and L modules,
    run in cycles), or layers that each hold several attention sublayers (LongCat-Flash)."""
    stacks = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and _child(m[0], ATTN_NAMES + SUBLAYER_WRAPPER_NAMES) is not None
    ]
    if not stacks:
        return ""
    text = ", ".join(f"{n} ({len(m)})" for n, m in stacks)
    multi = [f for _, m in stacks if (f := _child(m[0], ATTN_NAMES)) is not None and isinstance(f[1], nn.ModuleList)]
    if multi:
        attr, lst = multi[0]
        k = len(lst) if isinstance(lst, nn.ModuleList) else 0
        return (
            f"; its layer list {text} holds layers whose {attr} is a ModuleList of {k} attention sublayers (each "
            "decoder layer runs several attention and MLP sublayers), and ie_lab binds one attention per layer"
        )
    if len(stacks) > 1:
        return (
            f"; the trunk has several layer stacks instead ({text}), which its forward runs in its own order (possibly "
            "several times), so no layer index names one block"
        )
    return f"; the only layer list is {text}"


def _find_final_norm(model: nn.Module, layers_path: str) -> tuple[str, nn.Module] | None:
    trunk_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    trunk = model.get_submodule(trunk_path) if trunk_path else model
    found = _child(trunk, FINAL_NORM_NAMES)
    if found and _is_norm(found[1]):
        return (f"{trunk_path}.{found[0]}" if trunk_path else found[0]), found[1]
    return None


class _Recorder:
    """Records each watched module's hidden input and first output during the probe forward."""

    def __init__(self) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.handles: list[Any] = []

    def watch(self, m: nn.Module | None) -> None:
        if m is None or id(m) in self.inputs:
            return

        def pre(mod, args, kwargs):
            t = hidden_arg(args, kwargs)
            if t is not None and id(mod) not in self.inputs:
                self.inputs[id(mod)] = t.detach().clone()
                self.args[id(mod)] = (args, kwargs)

        def post(mod, args, kwargs, out):
            if id(mod) not in self.outputs:
                # Clone: some families update a module's output in place afterwards (Falcon's mlp += attn).
                if isinstance(out, torch.Tensor):
                    out = out.detach().clone()
                elif isinstance(out, (tuple, list)):
                    out = type(out)(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in out)
                self.outputs[id(mod)] = out

        self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(m.register_forward_hook(post, with_kwargs=True))

    args: dict[int, Any]
    kernel_outputs: dict[int, torch.Tensor]  # attention module id -> what transformers' attention kernel returned
    kernel_weights_ok: dict[int, bool]  # attention module id -> its returned weights times value give its output
    kernel_calls: dict[int, int]  # attention module id -> how many kernel calls it made in the probe forward
    kernel_keys: dict[int, torch.Tensor]  # attention module id -> the keys its first kernel call was handed

    def __enter__(self) -> "_Recorder":
        self.args = {}
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def inp(self, m: nn.Module | None) -> torch.Tensor | None:
        return None if m is None else self.inputs.get(id(m))

    def out(self, m: nn.Module | None) -> torch.Tensor | None:
        if m is None:
            return None
        o = first_tensor(self.outputs.get(id(m)))
        return None if o is None else o.detach()


def split_fused_qkv(x: torch.Tensor, layout: str, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """The value slice of a fused QKV projection output, flattened to [.., n_kv*head_dim]."""
    lead = x.shape[:-1]
    if layout == "contiguous":
        return x[..., (n_heads + n_kv) * head_dim : (n_heads + 2 * n_kv) * head_dim]
    if layout == "per_head":
        return x.reshape(*lead, n_heads, 3, head_dim)[..., 2, :].reshape(*lead, n_heads * head_dim)
    if layout == "grouped":
        per = n_heads // n_kv
        return x.reshape(*lead, n_kv, per + 2, head_dim)[..., -1, :].reshape(*lead, n_kv * head_dim)
    if layout.startswith("blocks:"):  # measured per query head: where its value block starts in the fused output
        starts = [int(o) for o in layout[len("blocks:") :].split(",")][:: n_heads // n_kv]
        return torch.cat([x[..., o : o + head_dim] for o in starts], dim=-1)
    raise ValueError(layout)


def _measure_fused_layout(
    qkv_out: torch.Tensor | None, z: torch.Tensor | None, probs: torch.Tensor | None, facts: ArchFacts
) -> str | None:
    """Which slicing of the fused QKV output, mixed by the measured probabilities, reproduces z."""
    if probs is None or qkv_out is None or z is None:
        return None
    H, KV, d = facts.n_heads, facts.n_kv_heads, facts.head_dim
    b, s, _ = z.shape
    for layout in ("contiguous", "per_head", "grouped"):
        try:
            v = split_fused_qkv(qkv_out, layout, H, KV, d)
        except RuntimeError:
            continue
        if v.shape[-1] != KV * d:
            continue
        vh = v.reshape(b, s, KV, d).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        zz = (probs.float() @ vh.float()).transpose(1, 2).reshape(b, s, H * d)
        if _close(zz, z, 1e-4):
            return layout
    # None of the named layouts (CodeGen interleaves q, v, k per model-parallel shard): find, per query head, the
    # head_dim-wide block of the fused output that the head's probabilities mix into its slice of z.
    starts = []
    for h in range(H):
        zh = z[..., h * d : (h + 1) * d].float()
        found = next(
            (
                o
                for o in range(0, qkv_out.shape[-1] - d + 1, d)
                if _close(probs[:, h].float() @ qkv_out[..., o : o + d].float(), zh, 1e-4)
            ),
            None,
        )
        if found is None:
            return None
        starts.append(found)
    return "blocks:" + ",".join(str(o) for o in starts)


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


@torch.no_grad()
def _future_leak(model: nn.Module, facts: ArchFacts) -> float | None:
    """How much the logits at earlier positions move when only the last token changes: None for a causal model (or
    one whose forward cannot be run on token ids alone)."""
    gen = torch.Generator().manual_seed(4321)
    vocab = max(2, facts.vocab_size)
    ids = torch.randint(0, vocab, (1, PROBE_LEN), generator=gen).to(next(model.parameters()).device)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        a, b = (getattr(model(input_ids=x), "logits", None) for x in (ids, other))
    except Exception:  # noqa: BLE001 - the structural refusal stands on its own
        return None
    finally:
        for m, flag in modes:
            m.training = flag
    if a is None or b is None or a.shape != b.shape or a.dim() != 3:
        return None
    leak = float((a[:, :-1].float() - b[:, :-1].float()).abs().max())
    return leak if leak > 1e-4 * max(float(a.float().abs().max()), 1e-6) else None


def _bind(model: nn.Module, facts: ArchFacts) -> Binding:
    family = facts.model_type
    embed = model.get_input_embeddings()  # type: ignore[operator]  # transformers' PreTrainedModel method
    lm_head = model.get_output_embeddings()  # type: ignore[operator]  # (the nn.Module annotation cannot see it)
    layers_path, layer_list = _find_layers(model, facts.n_layers, embed)
    if embed is None or lm_head is None:
        raise StructureError(f"{family}: the model exposes no input or output embeddings; is it a causal LM?")
    fn = _find_final_norm(model, layers_path)

    layers: list[LayerBinding] = []
    for i, layer in enumerate(layer_list):
        declared = facts.mixer_kinds[i] if i < len(facts.mixer_kinds) else ""
        if i < len(facts.block_sublayers) and facts.block_sublayers[i] == "mlp":
            layers.append(_mlp_only_layer(i, layer, family))  # a single-sublayer trunk's MLP or MoE block
            continue
        a = _child(layer, ATTN_NAMES) or _child(layer, SUBLAYER_WRAPPER_NAMES)
        mixer = _child(layer, MIXER_NAMES + ATTN_NAMES) if declared else None
        if declared and mixer is None:
            mixer = _nested_mixer(layer)  # inside a decoder-layer wrapper (Zamba's hybrid layers: mamba_decoder)
        if mixer is None and a is None:
            mixer = _child(layer, MIXER_NAMES)
            if mixer is not None and any(facts.mixer_kinds):
                # a hybrid whose config calls this layer attention keeps it where its mixers sit (RecurrentGemma)
                a, mixer = mixer, None
        if mixer is not None:
            lb = _mixer_layer(i, layer, mixer, declared, family)
            if lb is not None:
                layers.append(lb)
                continue
        if a is None:
            kind = facts.layer_kinds[i] if i < len(facts.layer_kinds) else "global"
            what = " (a linear-attention layer: those are not bound yet)" if kind == "linear" else ""
            kids = ", ".join(n for n, _ in layer.named_children())
            raise StructureError(
                f"{family} layer {i}: no attention module among {ATTN_NAMES}{what}; the layer holds ({kids})."
            )
        attn_name, attn = a
        wrapper = None
        if attn_name in SUBLAYER_WRAPPER_NAMES:
            # its norms are the layer's norms; the attention proper sits one level down
            inner_attn = _child(attn, ATTN_NAMES)
            if inner_attn is None:
                kids = ", ".join(n for n, _ in attn.named_children())
                raise StructureError(
                    f"{family} layer {i}: no attention module among {ATTN_NAMES} inside {attn_name} ({kids})."
                )
            wrapper, attn_name, attn = attn, f"{attn_name}.{inner_attn[0]}", inner_attn[1]
        inner = _child(attn, ATTN_NAMES)
        if _child(attn, O_NAMES) is None and inner is not None and _child(inner[1], O_NAMES) is not None:
            # A wrapper around the attention proper (GPT-Neo's attn.attention): bind the module that projects.
            attn_name, attn = f"{attn_name}.{inner[0]}", inner[1]
        o = _child(attn, O_NAMES)
        if o is None and (_child(attn, EXPERTS_NAMES) or _child(attn, DOWN_NAMES)) and _child(layer, MLP_NAMES) is None:
            raise StructureError(
                f"{family} layer {i}: the block's one sublayer ({attn_name}) is an MLP or mixture of experts, with no "
                "attention or mixer beside it (a single-sublayer block, as trunks interleaving state-space, attention "
                "and MLP blocks have); such blocks are not bound yet."
            )
        if o is None and _child(attn, EXPERTS_NAMES) is not None:
            raise StructureError(
                f"{family} layer {i}: the attention routes each token's heads to experts, each with its own output "
                f"projection ({attn_name}.experts: a mixture of attention heads, as JetMoE's), so no single output "
                "projection reads z and attn_out is a routed sum; mixture-of-heads attention is not bound yet."
            )
        if o is None:
            raise StructureError(f"{family} layer {i}: attention has no output projection among {O_NAMES}.")
        mlp_found = _child(layer, MLP_NAMES)
        mlp = mlp_found[1] if mlp_found else None
        host = mlp if mlp is not None else layer
        names = {"attn": attn_name, "o_proj": f"{attn_name}.{o[0]}"}
        lb = LayerBinding(
            index=i,
            layer=layer,
            attn=attn,
            o_proj=o[1],
            mlp=mlp,
            mlp_in_module=host,
            mlp_out_module=host,
            names=names,
            wrapper=wrapper,
        )
        _find_side_mlp(lb)
        experts = _child(host, EXPERTS_NAMES)
        sub = facts.block_sublayers[i] if i < len(facts.block_sublayers) else ""
        if sub == "attention" and mlp_found is None:
            # An attention-only block of a single-sublayer trunk (the config names it; the probe must find
            # resid_post = resid_pre + attn_out_post): the MLP points are refused here by the registry.
            lb.has_mlp = False
            lb.mlp_in_module = lb.mlp_out_module = attn  # never read
        elif experts is not None and mlp_found is not None:  # mlp is mlp_found's module
            lb.sparse_moe = True
            lb.experts = experts[1]
            r = _child(mlp_found[1], ROUTER_NAMES)
            lb.router = r[1] if r else None
            names["mlp"] = mlp_found[0]
        else:
            fgu = _child(host, FUSED_GATE_UP_NAMES)
            gate = _child(host, GATE_NAMES)
            up = _child(host, UP_NAMES)
            down = _child(host, DOWN_NAMES)
            if down is None and up is None and gate is None and isinstance(mlp, nn.Sequential):
                up, down = _sequential_up_down(mlp) or (None, None)  # CTRL's Sequential(Linear, ReLU, Linear)
            if down is None and mlp is None:
                raise StructureError(
                    f"{family} layer {i}: an attention block with no MLP among {MLP_NAMES} beside it (a "
                    "single-sublayer block, as trunks interleaving state-space, attention and MLP blocks have); such "
                    "blocks are not bound yet."
                )
            if down is None:
                raise StructureError(f"{family} layer {i}: MLP has no down projection among {DOWN_NAMES}.")
            lb.down_proj = down[1]
            if fgu is not None:
                lb.fused_gate_up = fgu[1]
            else:
                lb.gate_proj = gate[1] if gate else None
                lb.up_proj = up[1] if up else None
            if mlp is None:  # linears directly on the layer: mlp_in is the up projection's input
                mlp_in = lb.up_proj or lb.gate_proj or lb.fused_gate_up
                if mlp_in is None:  # the probe would find no mlp_in input: refuse as it would, naming why
                    raise StructureError(f"{family} layer {i}: MLP has no up projection among {UP_NAMES + GATE_NAMES}.")
                lb.mlp_in_module = mlp_in
                lb.mlp_out_module = lb.down_proj
            names["mlp"] = mlp_found[0] if mlp_found else "(on the layer)"
        lb.attn_sinks = isinstance(getattr(attn, "sinks", None), nn.Parameter)
        qn, kn = _child(attn, Q_NORM_NAMES), _child(attn, K_NORM_NAMES)
        if qn and kn:
            lb.q_norm, lb.k_norm = qn[1], kn[1]
        elif qn and _reads_shared_kv(attn):
            lb.q_norm = qn[1]  # its keys are another layer's (measured after the probe: _measure_kv_sources)
        v = _child(attn, V_NAMES)
        fused = _child(attn, FUSED_QKV_NAMES)
        if v is not None and isinstance(v[1], nn.Linear):
            lb.v_proj = v[1]
        elif fused is not None:
            lb.fused_qkv = fused[1]
        if isinstance(getattr(attn, "compressor", None), nn.Module):
            types = facts.raw.get("layer_types") if facts.raw else None
            lb.kv_compressor = str(types[i]) if isinstance(types, (list, tuple)) and i < len(types) else "compressed"
        if facts.n_streams > 1:
            ahc, mhc = _child(layer, ATTN_HC_NAMES), _child(layer, MLP_HC_NAMES)
            if ahc is None or mhc is None:
                kids = ", ".join(n for n, _ in layer.named_children())
                raise StructureError(
                    f"{family} layer {i}: the config states {facts.n_streams} residual streams, but the layer has no "
                    f"hyper-connection modules among {ATTN_HC_NAMES} and {MLP_HC_NAMES} (it holds {kids})."
                )
            lb.attn_hc, lb.mlp_hc = ahc[1], mhc[1]
            names.update(attn_hc=ahc[0], mlp_hc=mhc[0])
        layers.append(lb)

    binding = Binding(
        facts=facts,
        embed=embed,
        final_norm=fn[1] if fn else None,
        lm_head=lm_head,
        layers=layers,
        layers_path=layers_path,
        family=family,
    )
    if facts.n_streams > 1:
        trunk_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
        found = _child(model.get_submodule(trunk_path) if trunk_path else model, STREAM_HEAD_NAMES)
        binding.stream_head = found[1] if found else None
    _measure(model, binding)
    mixer_states.measure(model, binding)
    return binding


def _sequential_up_down(mlp: nn.Sequential) -> tuple[tuple[str, nn.Module], tuple[str, nn.Module]] | None:
    """An MLP built as nn.Sequential(linear, activation..., linear): a Sequential calls its children in order, so
    the first linear is the up projection and the last the down projection (mlp_act is the last one's input)."""
    kids = list(mlp.named_children())
    linear = [k for k in kids if isinstance(k[1], nn.Linear)]
    if len(kids) < 3 or len(linear) != 2 or linear != [kids[0], kids[-1]]:
        return None
    return (f"{kids[0][0]}", kids[0][1]), (f"{kids[-1][0]}", kids[-1][1])


def _mixer_layer(
    i: int, layer: nn.Module, found: tuple[str, nn.Module], declared: str, family: str
) -> LayerBinding | None:
    """A layer whose token mixer is not attention: the mixer module stands where attention would, and the MLP is
    found as on any layer. The probe checks that the mixer does not call transformers' attention interface."""
    name, mixer = found
    mlp_found = _child(layer, MLP_NAMES)
    if mlp_found is None:
        # A mixer-only block: the probe must find resid_post = resid_pre + the mixer's contribution, or refuse.
        return LayerBinding(
            index=i,
            layer=layer,
            attn=mixer,
            o_proj=mixer,
            mlp=None,
            mlp_in_module=mixer,  # never read: the registry refuses every MLP point on this layer
            mlp_out_module=mixer,
            names={"mixer": name},
            mixer_kind=declared or name,
            value_source="none",
            has_mlp=False,
        )
    mlp = mlp_found[1]
    lb = LayerBinding(
        index=i,
        layer=layer,
        attn=mixer,
        o_proj=mixer,
        mlp=mlp,
        mlp_in_module=mlp,
        mlp_out_module=mlp,
        names={"mixer": name, "mlp": mlp_found[0]},
        mixer_kind=declared or name,
        value_source="none",
    )
    _find_side_mlp(lb)
    _bind_mlp_parts(lb, mlp, family)
    return lb


def _nested_mixer(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """A declared mixer one level down: a child of the layer that holds it (Zamba's hybrid layer wraps its Mamba
    layer, norm and mixer, as mamba_decoder beside the shared transformer block). The probe then checks that
    resid_pre + the mixer's output is the layer's output."""
    for name, child in layer.named_children():
        inner = _child(child, MIXER_NAMES)
        if inner is not None:
            return f"{name}.{inner[0]}", inner[1]
    return None


def _mlp_only_layer(i: int, layer: nn.Module, family: str) -> LayerBinding:
    """A block whose one sublayer is an MLP or MoE (single-sublayer trunks): no token mixer. The probe must find
    resid_post = resid_pre + the MLP's output, or refuse."""
    found = _child(layer, MLP_NAMES + MIXER_NAMES + ATTN_NAMES)
    if found is None or not (_child(found[1], EXPERTS_NAMES) or _child(found[1], DOWN_NAMES)):
        kids = ", ".join(n for n, _ in layer.named_children())
        raise StructureError(
            f"{family} layer {i}: the config names an MLP block, but no child of the layer ({kids}) has experts or a "
            f"down projection among {DOWN_NAMES}."
        )
    name, mlp = found
    lb = LayerBinding(
        index=i,
        layer=layer,
        attn=mlp,  # never read: the registry refuses the attention and mixer points on an MLP-only block
        o_proj=mlp,
        mlp=mlp,
        mlp_in_module=mlp,
        mlp_out_module=mlp,
        names={"mlp": name},
        value_source="none",
        mlp_only=True,
    )
    _bind_mlp_parts(lb, mlp, family)
    return lb


def _bind_mlp_parts(lb: LayerBinding, mlp: nn.Module, family: str) -> None:
    """The router and experts, or the projections, of an MLP module found on a layer."""
    experts = _child(mlp, EXPERTS_NAMES)
    if experts is not None:
        lb.sparse_moe, lb.experts = True, experts[1]
        r = _child(mlp, ROUTER_NAMES)
        lb.router = r[1] if r else None
        return
    down = _child(mlp, DOWN_NAMES)
    gate_after = _child(mlp, MLP_OUT_GATE_NAMES)
    if down is None and gate_after is not None and _child(mlp, CHANNEL_MIX_DOWN_NAMES) is not None:
        # a channel mix (RWKV): its value projection is the down projection, its key the up projection, and its
        # receptance a gate after the down projection (the probe keeps it only where it explains the output)
        down, up = _child(mlp, CHANNEL_MIX_DOWN_NAMES), _child(mlp, CHANNEL_MIX_UP_NAMES)
        assert down is not None
        lb.down_proj, lb.up_proj, lb.mlp_out_gate = down[1], up[1] if up else None, gate_after[1]
        return
    if down is None:
        raise StructureError(f"{family} layer {lb.index}: MLP has no down projection among {DOWN_NAMES}.")
    lb.down_proj = down[1]
    fgu = _child(mlp, FUSED_GATE_UP_NAMES)
    if fgu is not None:
        lb.fused_gate_up = fgu[1]
    else:
        gate, up = _child(mlp, GATE_NAMES), _child(mlp, UP_NAMES)
        lb.gate_proj = gate[1] if gate else None
        lb.up_proj = up[1] if up else None


def _refuse_unbound_branch(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, R: torch.Tensor, Y: torch.Tensor, where: str
) -> None:
    """Name what the layer does beyond its bound sublayers when that is why the residual identities fail: a module
    it runs outside its attention (or mixer) and MLP (Gemma 4's per-layer input branch; a mixer beside attention
    whose share _parallel_mixer could not fit), a learned scale on the residual stream itself (Doge's per-channel
    vectors, Gemma 4's layer_scalar), or a residual that is the input norm's output with factors no config states
    (MiniMax's alpha/beta residual, bound by _norm_residual where its config states them)."""
    A_in, A_out = rec.inp(lb.attn), rec.out(lb.o_proj)
    attn_c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    mlp_c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else rec.out(lb.mlp_out_module)
    roles = (lb.attn, lb.o_proj, lb.mlp, lb.mlp_side, lb.par_mixer, lb.wrapper, lb.input_norm, lb.post_attn_norm)
    bound = {id(m) for m in (*roles, lb.pre_mlp_norm, lb.post_mlp_norm) if m is not None}
    ran = [
        (name, m)
        for name, m in lb.layer.named_children()
        if id(m) not in bound and id(m) in rec.outputs and name not in ACT_NAMES
    ]
    sub = "mixer" if lb.mixer_kind else "attention"
    if ran:
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in ran)
        raise StructureError(
            f"{where}: the layer also runs {names} outside its {sub} and MLP, a further branch whose output joins the "
            "residual stream outside any module ie_lab binds, so the sublayer points would not add up to resid_post; "
            "such branches are not bound yet."
        )
    own = [*lb.layer.named_parameters(recurse=False), *lb.layer.named_buffers(recurse=False)]
    for name, p in own:
        p = p.detach()
        if p.numel() == X.shape[-1] and (
            (attn_c is not None and _close(p * X + attn_c, R, 1e-4))
            or (mlp_c is not None and _close(p * R + mlp_c, Y, 1e-4))
        ):
            raise StructureError(
                f"{where}: the layer scales the residual stream per channel by its learned vector {name} before a "
                f"sublayer's output is added (resid_mid = {name} * resid_pre + attn_out_post), so no sublayer output "
                "is what the layer adds to resid_pre; a learned scale on the residual stream is not bound yet."
            )
        if p.numel() == 1 and mlp_c is not None and _close(p * (R + mlp_c), Y, 1e-4):
            raise StructureError(
                f"{where}: the layer multiplies its whole output by {name} ({float(p):.4g}): resid_post = {name} * "
                "(resid_mid + mlp_out_post), so the stream itself is rescaled, not a sublayer output; a scale on the "
                "residual stream is not bound yet."
            )
    if A_in is not None and attn_c is not None and A_in.shape == attn_c.shape == R.shape:
        basis = torch.stack([A_in.double().flatten(), attn_c.double().flatten()], dim=1)
        coef = torch.linalg.lstsq(basis, R.double().flatten().unsqueeze(1)).solution.flatten()
        alpha, beta = float(coef[0]), float(coef[1])
        if _close(alpha * A_in.double() + beta * attn_c.double(), R.double(), 1e-4):
            raise StructureError(
                f"{where}: the residual the {sub} output is added to is the input norm's output, not resid_pre "
                f"(resid_mid = {alpha:.4g} * input_norm(resid_pre) + {beta:.4g} * {sub} output, as MiniMax's "
                "alpha/beta residual factors have it): the norm sits on the residual path, so no sublayer output "
                "makes resid_pre + attn_out_post = resid_mid hold, and ie_lab binds such a residual only with the "
                "factors a config states (full_attn_/linear_attn_/mlp_alpha_factor and _beta_factor), which this one "
                "does not."
            )


def _parallel_mixer(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, R: torch.Tensor, attn_c: torch.Tensor
) -> tuple[float, float, torch.Tensor] | None:
    """A token mixer (MIXER_NAMES) on an attention layer that ran in the probe and whose output, with attention's,
    explains resid_mid - resid_pre as a*attn + b*mixer (least squares, then checked exactly): bound beside attention
    (Falcon-H1). Returns (a, b, the mixer's output); None where there is none or it does not add up."""
    if lb.mixer_kind:
        return None
    for name, m in lb.layer.named_children():
        P = rec.out(m)
        if name not in MIXER_NAMES or m is lb.attn or P is None or P.shape != X.shape:
            continue
        basis = torch.stack([attn_c.double().flatten(), P.double().flatten()], dim=1)
        a, b = (float(c) for c in torch.linalg.lstsq(basis, (R - X).double().flatten().unsqueeze(1)).solution)
        if not _close(X.double() + a * attn_c.double() + b * P.double(), R.double(), 1e-4):
            continue
        order = list(rec.outputs)
        lb.par_mixer, lb.par_mixer_first = m, order.index(id(m)) < order.index(id(lb.o_proj))
        lb.names["mixer"] = name
        return a, b, P
    return None


def _find_side_mlp(lb: LayerBinding) -> None:
    """Nominate a side MLP on the layer (SIDE_MLP_NAMES); the probe keeps it only where it reads the MLP's input."""
    side = _child(lb.layer, SIDE_MLP_NAMES)
    if side is not None and lb.mlp is not None and side[1] is not lb.mlp:
        lb.mlp_side = side[1]
        lb.names["mlp_side"] = side[0]


def _norm_children(lb: LayerBinding) -> list[nn.Module]:
    """The norms on the layer, and on the wrapper around its attention where it has one (measured like the rest)."""
    hosts = (lb.layer,) if lb.wrapper is None else (lb.layer, lb.wrapper)
    return [m for h in hosts for _, m in h.named_children() if _is_norm(m)]


def _probe(model: nn.Module, binding: Binding, rec: _Recorder, **kwargs: Any) -> set[int]:
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

    def listener(module, call):
        seen.add(id(module))
        calls[id(module)] = calls.get(id(module), 0) + 1
        kernel_out.setdefault(id(module), call.output.detach().clone())
        keys.setdefault(id(module), call.key.detach().clone())
        if id(module) not in weights_ok:
            weights_ok[id(module)] = _weights_explain_output(call)

    modes = [(m, m.training) for m in model.modules()]  # per module: model.train(flag) would flatten a mixed state
    model.eval()
    try:
        with rec, attention_tap.listening({id(lb.attn): listener for lb in binding.layers}):
            model(input_ids=ids, use_cache=False, **kwargs)
    except StructureError:
        raise
    except Exception as e:
        raise StructureError(f"{binding.family}: the probe forward failed ({type(e).__name__}: {e}).") from e
    finally:
        for m, flag in modes:
            m.training = flag
    return seen


@torch.no_grad()
def _measure(model: nn.Module, binding: Binding) -> None:
    rec = _Recorder()
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
            *_norm_children(lb),
            # gate and sub-norm candidates between the kernel and o_proj
            *(m for m in lb.attn.children() if (isinstance(m, nn.Linear) or _is_norm(m)) and not lb.mixer_kind),
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
            binding.final_norm.register_forward_pre_hook(lambda m, a: last.__setitem__("norm_in", _detached(a)))
        )
        handles.append(binding.final_norm.register_forward_hook(lambda m, a, o: last.__setitem__("norm", _detached(o))))
        handles.append(binding.lm_head.register_forward_pre_hook(lambda m, a: last.__setitem__("head", _detached(a))))
    try:
        seen = _probe(model, binding, rec)
    finally:
        for h in handles:
            h.remove()
    if binding.stream_head is not None:
        # it must read the last layer's stack and hand the final norm its input, or the lens would not be the model's
        ok = _same(rec.inp(binding.stream_head), rec.out(binding.layers[-1].layer)) and _same(
            rec.out(binding.stream_head), last.get("norm_in")
        )
        binding.stream_head = binding.stream_head if ok else None
    if "norm" in last and "head" in last and not _same(last["norm"], last["head"]):
        scale = _input_scale(binding, last["norm"], last["head"])
        if scale is not None:
            binding.head_input_scale = scale
            binding.facts = replace(binding.facts, logit_divisor=None)  # applied before the head, not after it
    if "norm" in last and "head" in last and not _same(last["norm"], last["head"]) and not binding.head_input_scale:
        raise StructureError(
            f"{binding.family}: the final norm's output is changed (rescaled) before the unembedding reads it, and "
            "ie_lab does not bind that step yet, so final_norm and the logit lens would not be what the model used."
        )
    _measure_kv_sources(binding, rec, seen)
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
            lb.routing_args = _routing_in_args(rec.args.get(id(lb.experts)), binding.facts.n_experts)
        if lb.sparse_moe and lb.router is not None:
            lb.router_output = _router_output(
                lb.router, rec.inputs.get(id(lb.router)), rec.outputs.get(id(lb.router)), binding.facts.n_experts
            )
        lb.kernel_calls = rec.kernel_calls.get(id(lb.attn), 1)
        if lb.uses_attention_interface and lb.kernel_calls > 1:
            # differential attention: z is o_proj's input whatever the calls computed, the value is v_proj's output
            # (each call sees one half of it), and the pattern points are refused (eager/taps.py says why)
            if lb.v_proj is None:
                raise StructureError(
                    f"{binding.family} layer {lb.index}: the attention calls the kernel {lb.kernel_calls} times per "
                    "forward and has no value projection among the names ie_lab knows, so its value cannot be read."
                )
            lb.value_source = "v_proj"
        elif lb.uses_attention_interface:
            lb.kernel_weights_ok = rec.kernel_weights_ok.get(id(lb.attn), True)
            _check_kernel_feeds_o_proj(lb, rec, binding.family, binding.facts.n_heads)
        _classify_layer(lb, rec, binding.facts, binding.family)
        if not lb.mixer_kind:
            _measure_latents(lb, rec, binding.facts)
        if lb.mixer_kind:
            lb.q_norm = lb.k_norm = None
    _measure_stream_scales(binding, rec, last.get("norm_in"))
    binding.notes += _measured_quirks(binding)
    if legacy:
        # Fused QKV outside the attention interface: learn the value slice from a forward that returns probs.
        rec2 = _Recorder()
        for lb in legacy:
            for m in (lb.attn, lb.o_proj, lb.fused_qkv):
                rec2.watch(m)
        _probe(model, binding, rec2, output_attentions=True)
        for lb in legacy:
            probs = None
            full = rec2.outputs.get(id(lb.attn))
            if isinstance(full, (tuple, list)):
                probs = next((t for t in full[1:] if isinstance(t, torch.Tensor) and t.dim() == 4), None)
            layout = _measure_fused_layout(rec2.out(lb.fused_qkv), rec2.inp(lb.o_proj), probs, binding.facts)
            if layout is None:
                raise StructureError(
                    f"{binding.family} layer {lb.index}: could not measure which slice of the fused QKV output is the "
                    "value (its q/k/v layout is none of those ie_lab knows: contiguous, per head, grouped)."
                )
            lb.fused_qkv_layout = layout


def _measure_kv_sources(binding: Binding, rec: _Recorder, seen: set[int]) -> None:
    """A layer whose attention has no key or value projection (_reads_shared_kv) may read an earlier layer's: the
    earlier layer whose kernel call was handed the very keys this layer's was (KV sharing) is its kv_source. Where no
    earlier layer's keys are those (latent attention computes its keys from other projections), nothing is shared,
    and a query norm bound alone for it is dropped again (the QK-norm points then need both norms, as before)."""
    for lb in binding.layers:
        if lb.mixer_kind or lb.mlp_only or lb.k_norm is not None or not _reads_shared_kv(lb.attn):
            continue
        key = rec.kernel_keys.get(id(lb.attn)) if id(lb.attn) in seen else None
        for src in binding.layers[: lb.index]:
            other = rec.kernel_keys.get(id(src.attn))
            if key is not None and other is not None and other.shape == key.shape and torch.equal(other, key):
                lb.kv_source = src.kv_source if src.kv_source is not None else src.index
                break
        else:
            lb.q_norm = None


def _measure_stream_scales(binding: Binding, rec: _Recorder, norm_in: torch.Tensor | None) -> None:
    """The factor the trunk multiplies each layer's output by before the next layer (the final norm, after the last)
    reads it, outside any module: RWKV halves the stream every rescale_every layers in eval mode. Set only where the
    reader's input is that scalar (not 1) times the layer's output; a power of two is taken as exact."""
    readers = [rec.inp(nxt.layer) for nxt in binding.layers[1:]]
    readers.append(norm_in if binding.stream_head is None else None)  # a stream head collapses the stack: not this
    for lb, seen in zip(binding.layers, readers):
        out = rec.out(lb.layer)
        if out is None or seen is None or out.shape != seen.shape or _same(out, seen):
            continue
        o, r = out.double(), seen.double()
        s = float((o * r).sum() / (o * o).sum().clamp_min(1e-30))
        p2 = 2.0 ** round(math.log2(s)) if s > 0 else 0.0
        s = p2 if p2 and abs(s / p2 - 1.0) < 1e-6 else s
        if abs(s - 1.0) > 1e-6 and _close(out * s, seen, 1e-5):
            lb.stream_scale = s


def _layers_text(layers: list[int], n: int) -> str:
    return (
        "every layer"
        if len(layers) == n
        else ("layer " if len(layers) == 1 else "layers ") + ", ".join(str(i) for i in layers)
    )


def _measured_quirks(binding: Binding) -> list[str]:
    """One sentence per measured structure a user reading the points should know of, where the binder found one: a
    norm on the stream itself, a stream rescaled between layers, an MLP gated after its down projection or reading
    the previous token (RWKV has all four)."""
    notes, n = [], len(binding.layers)
    for lb in binding.layers:
        if lb.stream_norm is not None:
            name, sub = lb.names.get("stream_norm", "a norm"), "mixer" if lb.mixer_kind else "attn"
            notes.append(
                f"layer {lb.index} normalises the residual stream itself ({name}) before its first sublayer: "
                f"resid_mid.{lb.index} = {name}(resid_pre.{lb.index}) + {sub}_out_post.{lb.index}, and resid_pre."
                f"{lb.index} is the layer's input."
            )
    scales: dict[float, list[int]] = {}
    for lb in binding.layers:
        if lb.stream_scale is not None:
            scales.setdefault(lb.stream_scale, []).append(lb.index)
    for s, layers in scales.items():
        last = layers[-1] == n - 1
        notes.append(
            f"the trunk multiplies the stream by {s:g} after {_layers_text(layers, n)}, outside any module: "
            f"resid_pre.{{L+1}} = {s:g} * resid_post.L there"
            + (", and the final norm (and the logit lens) reads the last layer's output so scaled" if last else "")
            + " (RWKV in eval mode: every rescale_every layers)."
        )
    gated = [lb.index for lb in binding.layers if lb.mlp_out_gate is not None]
    if gated:
        lb = binding.layers[gated[0]]
        notes.append(
            f"the MLP on {_layers_text(gated, n)} multiplies its down projection's output by "
            f"{lb.mlp_out_gate_fn}({lb.names.get('mlp_out_gate', 'a gate')}): mlp_out is that gated product, "
            "mlp_act the down projection's input (no gated branch before it: mlp_pre_linear is absent)."
        )
    shifted = [lb.index for lb in binding.layers if lb.mlp_token_shift]
    if shifted:
        notes.append(
            f"the MLP on {_layers_text(shifted, n)} mixes each position's input with the previous position's before "
            "its projections (a token shift): mlp_pre, mlp_act and mlp_out at position t depend on mlp_in at t-1 "
            "and t, so writing mlp_in at t also moves the MLP at t+1."
        )
    return notes


def _input_scale(binding: Binding, norm_out: torch.Tensor, head_in: torch.Tensor) -> float | None:
    """The scalar s with head_in = s * norm_out, where the config's logit divisor is 1/s and the head has no bias
    (then the head's output is the model's logits, and the lens applies s before the head); None otherwise."""
    n, h = norm_out.double(), head_in.double()
    if n.shape != h.shape or getattr(binding.lm_head, "bias", None) is not None:
        return None
    s = float((h * n).sum() / (n * n).sum().clamp_min(1e-30))
    div = binding.facts.logit_divisor
    if not div or abs(s * float(div) - 1.0) > 1e-4 or not _close(norm_out * s, head_in, 1e-5):
        return None
    return s


def _routing_in_args(call: Any, n_experts: int) -> bool:
    """Whether an experts module's probe call carried an integer index tensor with valid expert ids and a
    floating tensor of the same shape (the routing weights): where expert_weights / expert_indices are read."""
    if call is None:
        return False
    args, kwargs = call
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    idx = next((t for t in tensors if not t.is_floating_point()), None)
    if idx is None or idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= n_experts:
        return False
    return any(t.is_floating_point() and t.shape == idx.shape for t in tensors)


def _router_output(router: nn.Module, x: torch.Tensor | None, out: Any, n_experts: int) -> int | None:
    """Which returned tensor is the router's logits (router_logits: before top-k selection). Routers return the
    logits alone or in a tuple whose order varies by family, and some return more than one n_experts-wide float
    tensor (Llama 4: the top-k sigmoid scores scattered into zeros, then the logits). Where more than one is, the
    logits are the one equal to the router's own linear map of its input on the probe forward; -1 where none is."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    wide = [
        i
        for i, t in enumerate(items)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == n_experts
    ]
    if len(wide) <= 1:
        return None
    w = getattr(router, "weight", None)
    if x is None or not isinstance(w, torch.Tensor) or tuple(w.shape) != (n_experts, x.shape[-1]):
        return -1
    b = getattr(router, "bias", None)
    lin = torch.nn.functional.linear(x.float(), w.float(), b.float() if isinstance(b, torch.Tensor) else None)
    lin = lin.reshape(-1, n_experts)
    match = [
        i
        for i in wide
        if items[i].numel() == lin.numel()
        and torch.allclose(items[i].float().reshape(-1, n_experts), lin, atol=1e-4, rtol=1e-3)
    ]
    return match[0] if len(match) == 1 else -1


_GATE_FNS = ("sigmoid", "softplus")
_GATE_VIEWS = ("full", "per_head", "per_head_half")


def gate_values(
    t: torch.Tensor, view: str, fn: str, n_heads: int, width: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The gate a gated-attention layer multiplies into z, laid out like z ([.., width], width = n_heads*head_dim),
    from its gate module's output (plus a bias the attention module adds per head or per channel before activating
    it, Beam's gate_bias); None where this view does not fit the output's width."""
    lead, w = t.shape[:-1], t.shape[-1]
    if bias is not None:
        if bias.numel() == w:
            t = t + bias
        elif bias.numel() == n_heads and w % n_heads == 0:
            t = (t.reshape(*lead, n_heads, w // n_heads) + bias.reshape(n_heads, 1)).reshape(*lead, w)
        else:
            return None
    if view == "per_head_half":
        if w != 2 * width:
            return None
        t = t.reshape(*lead, n_heads, w // n_heads)[..., w // n_heads // 2 :].reshape(*lead, width)
    elif view == "per_head":
        if w != n_heads:
            return None
    elif w != width:
        return None
    g = torch.sigmoid(t) if fn == "sigmoid" else torch.nn.functional.softplus(t.float()).to(t.dtype)
    return g.repeat_interleave(width // n_heads, dim=-1) if view == "per_head" else g


def _measure_gate(lb: LayerBinding, rec: _Recorder, out: torch.Tensor, z: torch.Tensor, n_heads: int) -> bool:
    """Whether z (o_proj's input) is the kernel's output times an activated gate read from one of the attention
    module's own linears (a gate projection, or the second half of each head of the query projection)."""
    # a bias parameter of the attention module itself (not of a child) may be added to the gate before activation
    biases = [None, *(p for p in lb.attn.parameters(recurse=False) if p.dim() == 1)]
    for name, m in lb.attn.named_children():
        G = rec.out(m)
        if not isinstance(m, nn.Linear) or m is lb.o_proj or G is None:
            continue
        for view in _GATE_VIEWS:
            for fn in _GATE_FNS:
                for bias in biases:
                    g = gate_values(G, view, fn, n_heads, out.shape[-1], bias)
                    if g is None or g.shape != out.shape or m is lb.v_proj:
                        continue
                    if _close(out * g, z, 1e-5):
                        lb.attn_gate, lb.attn_gate_view, lb.attn_gate_fn = m, view, fn
                        lb.attn_gate_bias = bias
                        lb.names["attn_gate"] = f"{lb.names.get('attn', 'attn')}.{name}"
                        return True
    return False


def _weights_explain_output(call: Any) -> bool:
    """Whether the probabilities a kernel returns, mixed with its values, give its output. A kernel that rescales
    its output after the softmax (a sink applied as a per-row scale, GraniteSWA's eager path) returns weights that
    do not: its pattern is then rebuilt from q and k with the sink, as on fused kernels. No weights: nothing to
    check (the rebuild is used anyway)."""
    w, v, out = call.weights, call.value, call.output
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[-1] != v.shape[2]:
        return True
    v = v.repeat_interleave(w.shape[1] // v.shape[1], dim=1)
    z = (w.float() @ v.float()).transpose(1, 2)
    return _close(z.reshape(out.shape), out.float(), 1e-4) if z.numel() == out.numel() else True


def _check_kernel_feeds_o_proj(lb: LayerBinding, rec: _Recorder, family: str, n_heads: int = 0) -> None:
    """z is read at the output projection's input: refuse a layer where that is not what the kernel returned.

    Some families transform the attention output on its way to the projection (an output gate, a sub-norm, two
    kernel calls combined); serving the projection's input as z would then hand back a tensor that
    attn_probs @ value does not explain."""
    out, z = rec.kernel_outputs.get(id(lb.attn)), rec.inp(lb.o_proj)
    if out is None or z is None:
        return
    if out.dim() == 4:
        out = out.reshape(*out.shape[:2], -1)  # [b, s, H, d] -> [b, s, H*d], the projection's input layout
    if _same(out, z):
        return
    sub = next((m for m in lb.attn.children() if _is_norm(m) and _same(rec.inp(m), out) and _same(rec.out(m), z)), None)
    if sub is not None:  # a norm over the kernel's output feeds o_proj: z is what the kernel returned
        lb.z_sub_norm = sub
        return
    if out.shape[:-1] == z.shape[:-1] and out.shape[-1] != z.shape[-1] and lb.o_proj is not lb.attn:
        # The output projection reads a tensor of another width: a projection in two steps whose first step (and
        # any rotation before it) is the module's own code (DeepSeek-V4 rotates each head's output back, then
        # projects groups of heads to a low rank). z is the kernel's output, attn_probs @ value; nothing carries it
        # onward at a module boundary, so writing it is refused, as behind a sub-norm.
        lb.z_at_kernel_why = (
            f"the attention module transforms the kernel's output (width {out.shape[-1]}) into a tensor of another "
            f"width ({z.shape[-1]}) before its output projection reads it"
        )
        return
    if not (n_heads and out.shape == z.shape and _measure_gate(lb, rec, out, z, n_heads)):
        raise StructureError(
            f"{family} layer {lb.index}: the attention kernel's output is transformed before the output projection "
            "(an output gate, a norm or a second kernel call sits between them), and ie_lab does not bind that step "
            "yet, so z and the attention points would not be the tensors the model used."
        )


def _classify_layer(lb: LayerBinding, rec: _Recorder, facts: ArchFacts, family: str) -> None:
    where = f"{family} layer {lb.index}" + (f" (a {lb.mixer_kind} mixer layer)" if lb.mixer_kind else "")
    X = rec.inp(lb.layer)
    Y = rec.out(lb.layer)
    A_in = rec.inp(lb.attn)
    A_out = rec.out(lb.o_proj)  # the output projection's output is attn_out on every family
    M_in = rec.inp(lb.mlp_in_module)
    M_out_module = rec.out(lb.mlp_out_module)
    if X is None or Y is None or A_in is None or A_out is None or M_in is None or M_out_module is None:
        raise StructureError(f"{where}: the probe forward did not pass through every expected module.")
    if lb.attn_hc is not None:
        _classify_streams(lb, rec, X, Y, A_in, A_out, M_in, M_out_module, facts, where)
        return
    odd = [t for t in (Y, A_in, A_out, M_in, M_out_module) if _match_shape(t, X) is None]
    if odd:
        altup = _child(lb.layer, ALTUP_NAMES)
        how = (
            f"its {altup[0]} module predicts every stream from all of them before the sublayers and corrects them "
            "from the active stream's result after, in methods no module boundary separates (alternating updates, "
            "not hyper-connections), which ie_lab does not bind yet"
            if altup is not None
            else "its config states no stream count (hc_mult) and the layer has no hyper-connection modules ie_lab "
            "measures"
        )
        raise StructureError(
            f"{where}: the layer reads a {tuple(X.shape)} tensor but its sublayers exchange "
            f"{tuple(odd[0].shape)} ones, so the residual stream is not one vector per token: several parallel "
            f"residual streams, and {how}."
        )

    if lb.mlp_only:
        _classify_mlp_only(lb, rec, X, Y, where)
        return
    if not lb.has_mlp:
        _classify_mixer_only(lb, rec, X, Y, A_in, A_out, where)
        return

    # Some families' MLP module adds the residual itself (Bloom): then mlp_out is its down projection's output.
    M_out = M_out_module
    if lb.mlp_out_gate is not None and not _mlp_out_gate(lb, rec, rec.out(lb.down_proj), M_out_module):
        lb.mlp_out_gate = None  # nominated, but its activated output does not gate the down projection's into it
    if lb.mlp_out_gate is not None and lb.mlp is not None:
        lb.mlp_token_shift = _reads_previous_token(lb.mlp, M_in, M_out_module)
    if lb.down_proj is not None and lb.mlp is not None:
        D_out = rec.out(lb.down_proj)
        if D_out is not None and not _same(M_out_module, D_out) and lb.mlp_out_gate is None:
            # A module output that is not its down projection's (nor its gated product) is either residual-added or
            # post-processed.
            lb.mlp_out_module = lb.down_proj
            M_out = D_out
    if lb.mlp_side is not None:
        S_out = rec.out(lb.mlp_side)
        S = _match_shape(S_out, M_out) if S_out is not None and _same(rec.inp(lb.mlp_side), M_in) else None
        if S is not None:
            # a side MLP reading the MLP's input: what the layer adds is the sum (the identities below verify it)
            order = list(rec.outputs)
            lb.mlp_side_last = order.index(id(lb.mlp_side)) > order.index(id(lb.mlp_out_module))
            M_out = M_out + S
        else:
            lb.mlp_side = None
            lb.names.pop("mlp_side", None)

    norms = _norm_children(lb)
    for n in norms:
        n_in, n_out = rec.inp(n), rec.out(n)
        if n_in is None or n_out is None:
            continue
        if _same(n_in, A_out) and lb.post_attn_norm is None:
            lb.post_attn_norm = n
        elif _same(n_in, M_out) and lb.post_mlp_norm is None:
            lb.post_mlp_norm = n
        elif _same(n_out, A_in) and lb.input_norm is None:
            lb.input_norm = n
            if _same(n_out, M_in):  # one norm feeding both sublayers: a parallel block
                lb.parallel = True
        elif _same(n_out, M_in) and lb.pre_mlp_norm is None:
            lb.pre_mlp_norm = n
    if lb.pre_mlp_norm is not None and lb.input_norm is not None and _same(rec.inp(lb.pre_mlp_norm), X):
        lb.parallel = True  # two norms both reading the layer input (GPT-NeoX style)
    if lb.pre_mlp_norm is None and lb.input_norm is not None and not lb.parallel and _same(M_in, A_in):
        lb.parallel = True

    attn_c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    mlp_c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else M_out
    assert attn_c is not None and mlp_c is not None  # the loop above binds a norm only where both were recorded

    def ratio(delta: torch.Tensor, c: torch.Tensor) -> float:
        return float((delta.double() * c.double()).sum() / (c.double() * c.double()).sum().clamp_min(1e-30))

    # A ratio within a few ulps of 1 (at the model's precision) is no multiplier at all.
    one_tol = max(1e-4, 8 * torch.finfo(X.dtype).eps)

    def mult(m: float) -> float | None:
        if abs(m - 1.0) < one_tol:
            return None
        cfg = facts.residual_multiplier
        return float(cfg) if cfg is not None and abs(cfg - m) < one_tol * max(1.0, abs(cfg)) else m

    if lb.parallel:
        # Y = X + a*attn_c + b*mlp_c; multipliers on parallel blocks are not expected, verify plain sum.
        if not _close(X + attn_c + mlp_c, Y, 1e-4):
            raise StructureError(
                f"{where}: measured a parallel block, but resid_pre + attention + MLP does not equal the layer "
                "output, so ie_lab cannot serve faithful sublayer points for this family."
            )
    else:
        R = rec.inp(lb.pre_mlp_norm) if lb.pre_mlp_norm is not None else M_in
        assert R is not None  # likewise
        if not _close(X + attn_c, R, 1e-4):
            sn = _stream_norm(lb, rec, X, attn_c, R)
            normed = rec.out(sn) if sn is not None else None
            if sn is not None and normed is not None:  # the first residual add reads the normed stream (RWKV's pre_ln)
                lb.stream_norm, X = sn, normed
                lb.names["stream_norm"] = _name_in(lb.layer, sn)
        if lb.post_attn_norm is None and not _close(X + attn_c, R, 1e-4):
            lb.o_bias = _returned_output_bias(lb, rec, X, attn_c, R)
            if lb.o_bias is not None:
                attn_c = attn_c + lb.o_bias.detach()
        m_attn = ratio(R - X, attn_c)
        m_mlp = ratio(Y - R, mlp_c)
        par = _parallel_mixer(lb, rec, X, R, attn_c)
        if par is not None:
            m_attn, m_par, P = par
            lb.par_mixer_multiplier = mult(m_par)
            X = X + P * (lb.par_mixer_multiplier or 1.0)  # what attention's output is added to, beside the mixer's
        lb.attn_multiplier, lb.mlp_multiplier = mult(m_attn), mult(m_mlp)
        a_eff = attn_c * (lb.attn_multiplier or 1.0)
        m_eff = mlp_c * (lb.mlp_multiplier or 1.0)
        if not (_close(X + a_eff, R, 1e-4) and _close(R + m_eff, Y, 1e-4)) and not _norm_residual(
            lb, rec, facts, R, Y, attn_c, mlp_c, where
        ):
            _refuse_post_norm(lb, rec, X, attn_c, mlp_c, where)  # exact tensor identities first, then the
            _refuse_unbound_residual_step(lb, rec, X, A_out, R, where)  # broader "what else ran" of the branch check
            _refuse_scaled_residual(X, attn_c, R, where)
            _refuse_unbound_branch(lb, rec, X, R, Y, where)
            raise StructureError(
                f"{where}: the residual identities resid_pre + {'mixer' if lb.mixer_kind else 'attn'}_out_post = "
                "resid_mid and resid_mid + "
                "mlp_out_post = resid_post do not hold for the measured structure, so ie_lab refuses to serve "
                "sublayer points it cannot stand behind."
            )

    # QK-norm layout: flat [b,s,h*d], or per head with heads before or after the sequence axis.
    if lb.q_norm is not None:
        q_in = rec.inp(lb.q_norm)
        if q_in is not None and q_in.dim() == 4:
            lb.qk_norm_layout = "bshd" if q_in.shape[1] == PROBE_LEN else "bhsd"
        elif q_in is None:
            lb.q_norm = lb.k_norm = None

    # Gate vs up: check that down's input is act(gate) * up, and learn the fused order.
    if lb.fused_gate_up is not None:
        act = _child(lb.mlp_in_module if lb.mlp is None else lb.mlp, ACT_NAMES)
        fo, d_in = rec.out(lb.fused_gate_up), rec.inp(lb.down_proj)
        if act is not None and fo is not None and d_in is not None:
            g, u = fo.chunk(2, dim=-1)
            if _close(act[1](g) * u, d_in, 1e-4):
                lb.fused_gate_first = True
            elif _close(act[1](u) * g, d_in, 1e-4):
                lb.fused_gate_first = False
            else:
                raise StructureError(
                    f"{where}: the fused gate_up projection's halves do not explain the MLP activation."
                )
    elif lb.gate_proj is not None and lb.up_proj is not None:
        act = _child(lb.mlp if lb.mlp is not None else lb.layer, ACT_NAMES)
        go, uo, d_in = rec.out(lb.gate_proj), rec.out(lb.up_proj), rec.inp(lb.down_proj)
        if act is not None and go is not None and uo is not None and d_in is not None:
            if not _close(act[1](go) * uo, d_in, 1e-4) and _close(act[1](uo) * go, d_in, 1e-4):
                lb.gate_proj, lb.up_proj = lb.up_proj, lb.gate_proj  # the spellings lied; trust the tensors


def _stream_norm(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, attn_c: torch.Tensor, R: torch.Tensor
) -> nn.Module | None:
    """A norm of the layer that reads the layer's input and whose output, not the input, is what the first sublayer's
    output is added to (and what the input norm reads): it normalises the residual stream itself (RWKV's pre_ln)."""
    bound = {id(m) for m in (lb.input_norm, lb.pre_mlp_norm, lb.post_attn_norm, lb.post_mlp_norm) if m is not None}
    for n in _norm_children(lb):
        out = rec.out(n)
        if id(n) in bound or out is None or not _same(rec.inp(n), X) or not _close(out + attn_c, R, 1e-4):
            continue
        if lb.input_norm is None or _same(rec.inp(lb.input_norm), out):
            return n
    return None


def _mlp_out_gate(lb: LayerBinding, rec: _Recorder, d_out: torch.Tensor | None, m_out: torch.Tensor) -> bool:
    """Whether the MLP module's output is its down projection's output times the nominated gate's activated output
    (RWKV's channel mix: receptance); sets the activation that does it."""
    g = rec.out(lb.mlp_out_gate)
    if g is None or d_out is None or g.shape != d_out.shape:
        return False
    for fn in _GATE_FNS:
        act = torch.sigmoid(g) if fn == "sigmoid" else torch.nn.functional.softplus(g.float()).to(g.dtype)
        if _close(act * d_out, m_out, 1e-5):
            lb.mlp_out_gate_fn = fn
            lb.names["mlp_out_gate"] = f"{lb.names.get('mlp', 'mlp')}.{_name_in(lb.mlp, lb.mlp_out_gate)}"
            return True
    return False


def _name_in(parent: nn.Module | None, child: nn.Module | None) -> str:
    return next((n for n, m in parent.named_children() if m is child), "?") if parent is not None else "?"


@torch.no_grad()
def _reads_previous_token(mlp: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the MLP's output at a position moves when only the previous position of its input does (a token
    shift, RWKV's channel mix): rerun on its recorded input with position 0 changed, the output from position 1 on
    compared. Run only on a channel mix (a module called on its input alone, nothing cached or counted)."""
    if x.dim() != 3 or x.shape[1] < 2:
        return False
    x2 = x.clone()
    x2[:, 0] = x2[:, 0] + 1.0
    out2 = first_tensor(mlp(x2))
    return out2 is not None and not _close(out2[:, 1:], out[:, 1:], 1e-5)


def _measure_latents(lb: LayerBinding, rec: _Recorder, facts: ArchFacts) -> None:
    """Latent attention's compressed latents: a norm of the attention module whose output its up-projection reads.
    The key/value up-projection also needs the width its heads' blocks have (position-free key, then value)."""
    for norms, ups, role in ((Q_LATENT_NORM_NAMES, Q_UP_NAMES, "q"), (KV_LATENT_NORM_NAMES, KV_UP_NAMES, "kv")):
        norm, up = _child(lb.attn, norms), _child(lb.attn, ups)
        if norm is None or up is None or not _same(rec.out(norm[1]), rec.inp(up[1])):
            continue
        if role == "q":
            lb.q_latent = norm[1]
            lb.names["q_latent"] = f"{lb.names.get('attn', 'attn')}.{norm[0]}"
            continue
        block = facts.qk_nope_head_dim + facts.value_head_dim
        width = getattr(up[1], "out_features", None)
        if facts.qk_nope_head_dim and width == facts.n_heads * block:
            lb.kv_latent, lb.kv_up = norm[1], up[1]
            lb.names["kv_latent"] = f"{lb.names.get('attn', 'attn')}.{norm[0]}"


def _hc_roles(out: Any, b: int, s: int, n: int, d: int) -> dict[str, int] | None:
    """Where a hyper-connection module's output tuple holds the collapse ([b, s, d_model]), the write weights
    ([b, s, n_streams]) and, where it mixes the streams, the mixing matrix ([b, s, n, n]); None if not both of the
    first two are there."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    roles: dict[str, int] = {}
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            continue
        for role, want in (("collapse", (b, s, d)), ("write", (b, s, n)), ("mix", (b, s, n, n))):
            if tuple(t.shape) == want and role not in roles and i not in roles.values():
                roles[role] = i
    return roles if "collapse" in roles and "write" in roles else None


def _streams_explained(
    before: torch.Tensor, after: torch.Tensor, sub: torch.Tensor, out: Any, roles: dict[str, int], transposed: bool
) -> bool:
    """after[.., j, :] = sum_i mix[.., i, j] * before[.., i, :] + write[.., j] * sub (the streams carried on unmixed
    where there is no matrix): one sublayer of a hyper-connection layer, in float64."""
    w = out[roles["write"]].double()
    x = before.double()
    if "mix" in roles:
        m = out[roles["mix"]].double()
        x = torch.einsum("bsji,bsjd->bsid" if not transposed else "bsij,bsjd->bsid", m, x)
    return _close(x + w.unsqueeze(-1) * sub.double().unsqueeze(-2), after.double(), 1e-5)


def _classify_streams(
    lb: LayerBinding,
    rec: _Recorder,
    X: torch.Tensor,
    Y: torch.Tensor,
    A_in: torch.Tensor,
    A_out: torch.Tensor,
    M_in: torch.Tensor,
    M_out: torch.Tensor,
    facts: ArchFacts,
    where: str,
) -> None:
    """A hyper-connection layer: it reads and writes a [batch, seq, n_streams, d_model] stack. A module before each
    sublayer collapses the stack into the sublayer's one input vector per token and returns the weights that write
    the sublayer's output back into each stream (and, on DeepSeek-V4, a matrix mixing the streams). Measured: which
    output is which, the norms between collapse and sublayer, and that the two stream identities hold."""
    n = facts.n_streams
    if X.dim() != 4 or X.shape[-2] != n or Y.shape != X.shape:
        raise StructureError(
            f"{where}: the config states {n} residual streams, but the layer reads a {tuple(X.shape)} tensor and "
            f"returns a {tuple(Y.shape)} one, not a [batch, seq, {n}, d_model] stack."
        )
    b, s, _, d = X.shape
    mid = rec.inp(lb.mlp_hc)
    a_full, m_full = rec.outputs.get(id(lb.attn_hc)), rec.outputs.get(id(lb.mlp_hc))
    a_roles, m_roles = _hc_roles(a_full, b, s, n, d), _hc_roles(m_full, b, s, n, d)
    if mid is None or a_roles is None or a_roles != m_roles or not _same(rec.inp(lb.attn_hc), X):
        raise StructureError(
            f"{where}: its hyper-connection modules do not read the layer's stream stack and return a d_model-wide "
            f"collapse and {n} write weights per token, so ie_lab cannot say which tensor each stream point is."
        )
    assert a_full is not None and m_full is not None  # _hc_roles found tensors in both
    ca, cm = a_full[a_roles["collapse"]], m_full[m_roles["collapse"]]
    for nm in _norm_children(lb):
        if lb.input_norm is None and _same(rec.inp(nm), ca) and _same(rec.out(nm), A_in):
            lb.input_norm = nm
        elif lb.pre_mlp_norm is None and _same(rec.inp(nm), cm) and _same(rec.out(nm), M_in):
            lb.pre_mlp_norm = nm
    if (lb.input_norm is None and not _same(ca, A_in)) or (lb.pre_mlp_norm is None and not _same(cm, M_in)):
        raise StructureError(
            f"{where}: a sublayer does not read its hyper-connection's collapse (directly or through one norm), so "
            "attn_stream_collapse / mlp_stream_collapse would not be what it reads."
        )
    lb.hc_roles, lb.stream_mix = a_roles, "mix" in a_roles
    for transposed in (False, True) if lb.stream_mix else (False,):
        if _streams_explained(X, mid, A_out, a_full, a_roles, transposed) and _streams_explained(
            mid, Y, M_out, m_full, m_roles, transposed
        ):
            lb.mix_transposed = transposed
            return
    raise StructureError(
        f"{where}: the residual identities of a hyper-connection layer (each stream at resid_mid is the mixed streams "
        "entering the layer plus its write weight times attn_out, and likewise for the MLP) do not hold for the "
        "measured modules, so ie_lab refuses to serve stream points it cannot stand behind."
    )


def _returned_output_bias(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, A_out: torch.Tensor, R: torch.Tensor
) -> nn.Parameter | None:
    """The attention module's own 1-D parameter that it returns beside its output and the layer adds to the output
    projection's output before the residual add (resid_mid = resid_pre + attn_out + bias), or None."""
    full = rec.outputs.get(id(lb.attn))
    extra = [t for t in full[1:] if isinstance(t, torch.Tensor)] if isinstance(full, (tuple, list)) else []
    own = [p for p in lb.attn.parameters(recurse=False) if p.dim() == 1 and p.shape[-1] == X.shape[-1]]
    for b in extra:
        p = next((p for p in own if b.shape == p.shape and _same(b, p.detach())), None)
        if p is not None and _close(X + A_out + p.detach(), R, 1e-4):
            return p
    return None


def _norm_residual(
    lb: LayerBinding,
    rec: _Recorder,
    facts: ArchFacts,
    R: torch.Tensor,
    Y: torch.Tensor,
    attn_c: torch.Tensor,
    mlp_c: torch.Tensor,
    where: str,
) -> bool:
    """A residual taken after each sublayer's input norm and scaled (MiniMax): resid_mid = a * input_norm(resid_pre)
    + b * attn_out and resid_post = c * pre_mlp_norm(resid_mid) + e * mlp_out. The four factors are measured by
    least squares; the layer is bound (True) only where they are the ones the config states for its kind, and then
    the config's exact values must satisfy both identities. False where the structure is not this one, or the
    config states no factors (the refusal then names the measured ones)."""
    A_in, M_in = rec.out(lb.input_norm), rec.out(lb.pre_mlp_norm)
    if A_in is None or M_in is None or lb.post_attn_norm is not None or lb.post_mlp_norm is not None:
        return False
    pairs = ((A_in, attn_c, R), (M_in, mlp_c, Y))
    if any(not (base.shape == c.shape == out.shape) for base, c, out in pairs):
        return False
    measured: list[float] = []
    for base, c, out in pairs:
        basis = torch.stack([base.double().flatten(), c.double().flatten()], dim=1)
        coef = torch.linalg.lstsq(basis, out.double().flatten().unsqueeze(1)).solution.flatten()
        if not _close(coef[0] * base.double() + coef[1] * c.double(), out.double(), 1e-4):
            return False
        measured += [float(coef[0]), float(coef[1])]
    cfg = facts.residual_factors[lb.index] if lb.index < len(facts.residual_factors) else None
    if cfg is None:
        return False
    text = "resid_mid = {:.4g} * attn_in + {:.4g} * attn_out, resid_post = {:.4g} * mlp_in + {:.4g} * mlp_out"
    if any(abs(m - f) > 1e-3 * max(1.0, abs(f)) for m, f in zip(measured, cfg)) or not all(
        _close(a * base.double() + b * c.double(), out.double(), 1e-4)
        for (a, b), (base, c, out) in zip((cfg[:2], cfg[2:]), pairs)
    ):
        raise StructureError(
            f"{where}: each sublayer's output is added to its input norm's output, measured as "
            f"{text.format(*measured)}, but the config's alpha/beta factors for this layer say "
            f"{text.format(*cfg)}; ie_lab binds this residual only with the factors the config states."
        )
    lb.attn_alpha, lb.mlp_alpha = cfg[0], cfg[2]
    lb.attn_multiplier = None if cfg[1] == 1 else cfg[1]
    lb.mlp_multiplier = None if cfg[3] == 1 else cfg[3]
    return True


def _refuse_post_norm(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, attn_c: torch.Tensor, mlp_c: torch.Tensor, where: str
) -> None:
    """Name a post-norm block (the original GPT's n = ln_1(x + attn), h = ln_2(n + mlp)) when that is why the
    residual identities fail: the MLP's residual add reads the normed stream, not resid_pre + attention's output."""
    n1 = lb.pre_mlp_norm
    normed = rec.out(n1)
    if n1 is None or normed is None or not _close(rec.inp(n1), X + attn_c, 1e-4):
        return
    for n in _norm_children(lb):
        if n is not n1 and _close(rec.inp(n), normed + mlp_c, 1e-4):
            name = next((k for k, m in lb.layer.named_children() if m is n1), type(n1).__name__)
            raise StructureError(
                f"{where}: a post-norm block: {name} normalises the residual stream itself after the attention's "
                "residual add (its input is resid_pre + attn_out), so the stream between sublayers is renormalised, "
                "no sublayer output adds up to the next residual, and post-norm trunks are not bound yet."
            )


def _refuse_unbound_residual_step(
    lb: LayerBinding, rec: _Recorder, X: torch.Tensor, A_out: torch.Tensor, R: torch.Tensor, where: str
) -> None:
    """Name the step between the attention's output projection and resid_mid when the probe finds one: a bias the
    attention module returns beside its output for the layer to add (skip-bias-add), a module that transforms the
    output before the add, or a module that is the residual add itself (learned per-channel weights)."""
    full = rec.outputs.get(id(lb.attn))
    extra = [t for t in full[1:] if isinstance(t, torch.Tensor)] if isinstance(full, (tuple, list)) else []
    for b in extra:
        if b.dim() == 1 and b.shape[-1] == X.shape[-1] and _close(X + A_out + b, R, 1e-4):
            raise StructureError(
                f"{where}: the attention module returns a bias beside its output ({lb.names.get('attn', 'attn')}'s "
                "output tuple) that the layer adds to the output projection's output before the residual add "
                "(skip-bias-add), so attn_out would lack it; a returned output bias is not bound yet."
            )
    skip = {id(lb.attn), id(lb.o_proj), id(lb.mlp), id(lb.wrapper), *(id(n) for n in _norm_children(lb))}
    for name, m in lb.layer.named_children():
        i, o = rec.inp(m), rec.out(m)
        if id(m) in skip or i is None or o is None or not _same(i, A_out):
            continue
        if _close(o, R, 1e-4):
            raise StructureError(
                f"{where}: the residual add is itself a learned module: {name} ({type(m).__name__}) reads the "
                "attention output and the residual and returns resid_mid (a per-channel weighted sum), so resid_mid "
                "is not resid_pre + a sublayer output; learned residual adds are not bound yet."
            )
        if _close(X + o, R, 1e-4):
            raise StructureError(
                f"{where}: {name} ({type(m).__name__}) transforms the attention output before the residual add (its "
                "input is attn_out, its output what resid_pre is added to), a step after the output projection that "
                "is not bound yet."
            )


def _refuse_scaled_residual(X: torch.Tensor, attn_c: torch.Tensor, R: torch.Tensor, where: str) -> None:
    """Name a residual add that scales the stream itself by a constant (Beam's depth-scaled add: resid_mid =
    a * resid_pre + b * the sublayer's output, a = sqrt((k - 1) / k) at the k-th add), measured by least squares."""
    A = torch.stack([X.double().flatten(), attn_c.double().flatten()], dim=1)
    coef = torch.linalg.lstsq(A, R.double().flatten().unsqueeze(1)).solution.flatten()
    a, b = float(coef[0]), float(coef[1])
    if abs(a - 1.0) > 1e-3 and _close((a * X.double() + b * attn_c.double()).to(R.dtype), R, 1e-4):
        raise StructureError(
            f"{where}: the residual add scales the stream itself (resid_mid = {a:.4g} * resid_pre + {b:.4g} * "
            "attn_out_post, a depth-scaled residual), so resid_pre + a sublayer output is not the next residual; "
            "scaled residual streams are not bound yet."
        )


def _classify_mixer_only(
    lb: LayerBinding,
    rec: _Recorder,
    X: torch.Tensor,
    Y: torch.Tensor,
    A_in: torch.Tensor,
    A_out: torch.Tensor,
    where: str,
) -> None:
    """A block with one sublayer: its input norm feeds the mixer, and resid_post = resid_pre + mixer_out."""
    for n in _norm_children(lb):
        if _same(rec.out(n), A_in) and lb.input_norm is None:
            lb.input_norm = n
        elif _same(rec.inp(n), A_out) and lb.post_attn_norm is None:
            lb.post_attn_norm = n
    c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    if c is None or not _close(X.float() + c.float(), Y.float(), 1e-4):
        raise StructureError(
            f"{where}: a mixer-only block (no MLP), but resid_pre + the mixer's output does not equal the layer "
            "output, so ie_lab refuses to serve its points."
        )


def _classify_mlp_only(lb: LayerBinding, rec: _Recorder, X: torch.Tensor, Y: torch.Tensor, where: str) -> None:
    """A block whose one sublayer is its MLP: its norm feeds the MLP, and resid_post = resid_pre + mlp_out."""
    M_in, M_out = rec.inp(lb.mlp_in_module), rec.out(lb.mlp_out_module)
    for n in _norm_children(lb):
        if _same(rec.out(n), M_in) and lb.pre_mlp_norm is None:
            lb.pre_mlp_norm = n
        elif _same(rec.inp(n), M_out) and lb.post_mlp_norm is None:
            lb.post_mlp_norm = n
    c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else M_out
    if c is None or not _close(X.float() + c.float(), Y.float(), 1e-4):
        raise StructureError(
            f"{where}: an MLP-only block (no attention or mixer), but resid_pre + the MLP's output does not equal the "
            "layer output, so ie_lab refuses to serve its points."
        )
    if lb.gate_proj is not None and lb.up_proj is not None:
        act = _child(lb.mlp if lb.mlp is not None else lb.layer, ACT_NAMES)
        go, uo, d_in = rec.out(lb.gate_proj), rec.out(lb.up_proj), rec.inp(lb.down_proj)
        if act is not None and go is not None and uo is not None and d_in is not None:
            if not _close(act[1](go) * uo, d_in, 1e-4) and _close(act[1](uo) * go, d_in, 1e-4):
                lb.gate_proj, lb.up_proj = lb.up_proj, lb.gate_proj  # the spellings lied; trust the tensors


@contextlib.contextmanager
def no_grad_if(flag: bool):
    if flag:
        with torch.no_grad():
            yield
    else:
        yield
