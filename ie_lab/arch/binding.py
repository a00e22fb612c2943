"""What the binder returns: each structural role bound to a live module, and what the probe measured about it.

Plain records. arch.nominate fills in the modules found by name, the arch.measure_* modules what the probe forward
measured; the eager backend's taps and writers read them to hook and write the points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config_facts import ArchFacts


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
    # mlp_multiplier. Measured, and bound only with the factors the config states (measure_residual._norm_residual); None elsewhere.
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
    # Which of the router's returned tensors is its logits, measured (measure_router_output): None where only one returned
    # tensor is n_experts wide; its index where several are (Llama 4 returns its top-k sigmoid scores first and the
    # logits second); -1 where several are and none is the router's own linear map of its input.
    router_output: int | None = None
    # Which of the router's returned tensors is the dense routing weights, where the experts module is not called
    # with them (Llama 4), measured (measure_router_weights): expert_weights is read there. None elsewhere.
    router_weights_output: int | None = None
    kernel_weights_ok: bool = True  # the kernel's returned weights are the pattern that mixed the values, measured
    # How many times the attention module calls the kernel per forward, measured: more than one is differential
    # attention (DiffLlama: two calls, one per half of the values, combined as out1 - lambda * out2 and normed before
    # o_proj). There z is o_proj's input and value v_proj's output, and attn_probs @ value is not z.
    kernel_calls: int = 1
    # With several calls: whether every call was handed the same q and k (DiffLlama's two calls are), measured. Each
    # head then has one pattern, which both calls applied (to one half of the values each): attn_scores / attn_probs
    # are read from each forward's first call. Not so: the pattern points are refused.
    kernel_same_qk: bool = False
    # A module that computes attention itself (not through the registry) in its own attention step (GPT-J before
    # transformers 5.24, CodeGen): what that step divides q·kᵀ by, measured (measure_step_divisor); attn_scores is
    # rebuilt from the q and k the step receives. None: not such a module, or the probe did not confirm it.
    scores_divisor: float | None = None
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
