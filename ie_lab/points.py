"""The point registry: the one place that says what each hook point is.

Docs tables (docs/POINTS.md), the picker's cards, the mappers, the validator and both backends read
this module. It holds plain data only (no torch) so it can be imported anywhere, including by tools
that never load a model.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any


class Scope(str, enum.Enum):
    LAYER = "layer"  # one tensor per decoder layer: addressed as name.L
    TRUNK = "trunk"  # one tensor per forward: addressed with no layer


class Width(str, enum.Enum):
    """What the last axis of a captured point counts."""

    D_MODEL = "d_model"
    HEADS = "n_heads*head_dim"
    KV_HEADS = "n_kv_heads*head_dim"
    D_MLP = "d_mlp"
    EXPERTS = "n_experts"
    VOCAB = "vocab_size"
    ATTN = "n_heads*q*k"
    STREAMS = "n_streams"
    # latent attention's compressed latents, and the per-head keys decompressed from the key/value latent
    Q_LATENT = "q_lora_rank"
    KV_LATENT = "kv_lora_rank"
    K_NOPE = "n_heads*qk_nope_head_dim"
    # a mixer's final state, one per sequence (no position axis): its shape depends on the mixer's kind (docs)
    STATE = "mixer state"

    @property
    def head_axis(self) -> bool:
        """Points whose width splits into heads, so that a head coordinate selects a slice."""
        return self in (Width.HEADS, Width.KV_HEADS, Width.ATTN, Width.K_NOPE)


class Verdict(str, enum.Enum):
    SERVED = "served"
    RECOMPUTE = "served by recompute"
    UNIMPLEMENTED = "unimplemented"  # the tensor exists at a module boundary; nobody wired it yet
    UNREACHABLE = "unreachable"  # a fused kernel or missing boundary means no hook can see it

    @property
    def ok(self) -> bool:
        return self in (Verdict.SERVED, Verdict.RECOMPUTE)

    @property
    def symbol(self) -> str:
        return {"served": "✅", "served by recompute": "♻️", "unimplemented": "❌", "unreachable": "❌"}[self.value]


BACKENDS = ("eager", "vllm")


@dataclass(frozen=True)
class BackendVerdict:
    verdict: Verdict
    reason: str = ""


class Needs(str, enum.Enum):
    """A structural feature a point exists only with. A model without it has no such tensor, and
    ``absence`` says why, in the same words for every backend, the picker and the points table."""

    MULTI_STREAM = "several residual streams"
    FINAL_NORM = "a final norm"
    QK_NORM = "a QK-norm"
    ATTN_GATE = "an attention output gate"
    SEQUENTIAL = "attention and MLP in sequence"  # not a parallel block: a residual lies between them
    DENSE_MLP = "a dense MLP on the layer"  # not a sparse MoE layer, whose experts each have their own neurons
    GATED_MLP = "a gated MLP"
    MOE = "a router on the layer"
    ATTENTION = "an attention layer"  # not a mixer layer: a hybrid trunk's state-space/linear/conv layers have none
    MIXER = "a non-attention mixer on the layer"  # state-space, linear-attention, convolution or recurrence
    MLP = "an MLP on the layer"  # not a mixer-only block (pure state-space trunks)
    # not an MLP-only block: single-sublayer trunks (Nemotron-H) give the MLP (or MoE) a layer of its own
    TOKEN_MIXER = "attention or a mixer on the layer"
    # one residual stream: on a hyper-connection trunk a sublayer's output enters each stream with its own weight
    SINGLE_STREAM = "a single residual stream"
    STREAM_MIX = "a stream-mixing matrix"  # hyper-connections that mix the streams (DeepSeek-V4), not add them back
    Q_LATENT = "a compressed query latent"  # latent attention with q_lora_rank; DeepSeek-V4's low-rank queries
    KV_LATENT = "a compressed key/value latent"  # multi-head latent attention (DeepSeek-V2/V3, MiniCPM 3)
    # keys and values one per token: not a layer whose kernel also attends to compressed blocks (DeepSeek-V4)
    TOKEN_KV = "one key/value entry per token"
    # a mixer that leaves a state for the next forward (what a decode step starts from), in a cache or on itself
    MIXER_STATE = "a mixer that carries a recurrent state"
    MIXER_CONV_STATE = "a mixer that carries a convolution state"


@dataclass(frozen=True)
class Point:
    name: str
    scope: Scope
    width: Width
    definition: str
    eager: BackendVerdict
    vllm: BackendVerdict
    # Other engines' names, with {L} standing for the layer. Several spellings are alternatives.
    tl_legacy: tuple[str, ...] = ()
    tl_bridge: tuple[str, ...] = ()
    nnterp: tuple[str, ...] = ()
    # What a model must have for this point to exist there, checked in this order (the first missing one is
    # the reason given).
    needs: tuple[Needs, ...] = ()
    # Points that exist per residual stream, so an address may carry .stream-S on such trunks.
    per_stream: bool = False
    # The eager backend can write it: a module boundary where an edited value flows on (patching, gradients).
    writable: bool = False
    # What to use where this point is absent or refused, in one phrase.
    note: str = ""

    @property
    def multi_stream_only(self) -> bool:
        """Points that only exist on trunks with several residual streams (hyper-connections)."""
        return Needs.MULTI_STREAM in self.needs

    @property
    def head_axis(self) -> bool:
        return self.width.head_axis

    @property
    def is_attention(self) -> bool:
        """An attention matrix, [batch, heads, query, key], rather than one vector per token."""
        return self.width is Width.ATTN

    @property
    def steerable(self) -> bool:
        """Steering adds a d_model vector, so only d_model-wide per-layer points take it."""
        return self.width is Width.D_MODEL and self.scope is Scope.LAYER

    @property
    def tappable(self) -> bool:
        """vLLM reads it from one module's input or output (its verdict is plain "served"), so a hook serves it
        and graph mode can compile a static tap for it. Recomputed points are rebuilt after the request."""
        return self.vllm.verdict is Verdict.SERVED

    @property
    def recomputed(self) -> bool:
        """vLLM rebuilds it from other captured tensors after the request instead of reading it."""
        return self.vllm.verdict is Verdict.RECOMPUTE

    def verdict(self, backend: str) -> BackendVerdict:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        return getattr(self, backend)


_OK = BackendVerdict(Verdict.SERVED)
_TP_NOTE = "Sharded across tensor-parallel ranks, so ie_lab gathers the slices before returning it."
_MHC_EAGER = BackendVerdict(Verdict.SERVED, "Only on trunks that carry several residual streams (hyper-connections).")
_MHC_VLLM = BackendVerdict(
    Verdict.UNIMPLEMENTED,
    "No multi-stream family has been checked against eager on vLLM yet; use backend='eager'.",
)
_MIXER_VLLM = BackendVerdict(
    Verdict.SERVED,
    "The mixer module's input and output on vLLM's layer, on the hybrid and state-space families vLLM runs on CPU "
    "and ie_lab has checked against eager (Mamba 2, Granite-MoE-hybrid, Falcon-H1's Mamba beside attention, "
    "LFM2's and LFM2-MoE's short convolutions, Zamba 2's Mamba 2 mixers); others are refused at load with vLLM's own reason.",
)
_MIXER_STATE_EAGER = BackendVerdict(
    Verdict.SERVED,
    "Read after the forward from where the mixer leaves it, as the binder measured at load: the cache transformers "
    "fills for the layer (ie_lab.capture runs the forward with one), the cache the model returns (xLSTM), or the mixer "
    "module itself (RecurrentGemma, put back as it was after); capture only.",
)
_MIXER_STATE_VLLM = BackendVerdict(
    Verdict.UNIMPLEMENTED,
    "vLLM keeps mixer states in its own paged state cache, which ie_lab does not read; use backend='eager'.",
)
_LATENT_VLLM = BackendVerdict(
    Verdict.UNIMPLEMENTED, "No latent-attention family is served by the vLLM backend yet; use backend='eager'."
)
_L, _T = Scope.LAYER, Scope.TRUNK

# One row per point, laid out as a table: the formatter would put every field on its own line.
# fmt: off
_POINTS: tuple[Point, ...] = (
    Point(
        "embeddings", _T, Width.D_MODEL,
        "The token-embedding module's output (with any scaling the module itself applies, as on Gemma 3), before the positional embeddings, trunk-level scaling or dropout applied on the way to layer 0.",
        _OK, _OK,
        note="Equals resid_pre.0 only on families that neither add positions nor scale the embedding.",
        tl_legacy=('hook_embed',), tl_bridge=('embed.hook_out',), nnterp=('token_embeddings',),
        writable=True,
    ),
    Point(
        "resid_pre", _L, Width.D_MODEL,
        "The residual stream entering decoder layer L (the layer's hidden_states input).",
        _OK, _OK,
        per_stream=True,
        tl_legacy=('blocks.{L}.hook_resid_pre',), tl_bridge=('blocks.{L}.hook_in',), nnterp=('layers_input[{L}]',),
        writable=True,
    ),
    Point(
        "attn_in", _L, Width.D_MODEL,
        "The input of the attention module: the residual after the layer's input norm (the raw residual on families without one).",
        _OK, _OK,
        tl_bridge=('blocks.{L}.attn.hook_in', 'blocks.{L}.ln1.hook_out',), nnterp=('attentions_input[{L}]',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "q_norm_in", _L, Width.HEADS,
        "Queries entering the QK-norm, flattened over heads (after the query projection; before RoPE on most families, after it where the family normalises rotated queries).",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        tl_legacy=('blocks.{L}.attn.hook_q',), tl_bridge=('blocks.{L}.attn.q_norm.hook_in', 'blocks.{L}.attn.q.hook_out',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "q_norm_out", _L, Width.HEADS,
        "Queries leaving the QK-norm, flattened over heads.",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        tl_bridge=('blocks.{L}.attn.q_norm.hook_out', 'blocks.{L}.attn.hook_q_normed',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "k_norm_in", _L, Width.KV_HEADS,
        "Keys entering the QK-norm, flattened over key/value heads (placed like q_norm_in).",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        tl_legacy=('blocks.{L}.attn.hook_k',), tl_bridge=('blocks.{L}.attn.k_norm.hook_in', 'blocks.{L}.attn.k.hook_out',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "k_norm_out", _L, Width.KV_HEADS,
        "Keys leaving the QK-norm, flattened over key/value heads.",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        tl_bridge=('blocks.{L}.attn.k_norm.hook_out', 'blocks.{L}.attn.hook_k_normed',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "value", _L, Width.KV_HEADS,
        "The value vectors the attention kernel mixes, one per key/value head (split out of a fused QKV projection where there is one).",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        note="Under grouped-query attention the width counts key/value heads, not query heads.",
        tl_legacy=('blocks.{L}.attn.hook_v',), tl_bridge=('blocks.{L}.attn.v.hook_out',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "attn_scores", _L, Width.ATTN,
        "Pre-softmax attention logits, [batch, heads, query, key]: q·k times the scale, soft-capped where the running kernel caps (sdpa ignores a family's softcap), with masked entries set to -inf.",
        BackendVerdict(Verdict.SERVED, "Read inside the attention call; on fused kernels (sdpa) rebuilt from the post-RoPE q and k the kernel received."),
        BackendVerdict(Verdict.RECOMPUTE, "Paged attention never materialises the matrix; rebuilt from captured post-RoPE q and k."),
        tl_legacy=('blocks.{L}.attn.hook_attn_scores',), tl_bridge=('blocks.{L}.attn.hook_attn_scores',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "attn_probs", _L, Width.ATTN,
        "The attention pattern after softmax, [batch, heads, query, key]; each row sums to 1 except where the family adds attention sinks.",
        BackendVerdict(Verdict.SERVED, "The eager kernel's own probabilities; on fused kernels (sdpa) rebuilt from the post-RoPE q and k the kernel received."),
        BackendVerdict(Verdict.RECOMPUTE, "Paged attention never materialises the probabilities; rebuilt from captured post-RoPE q and k."),
        tl_legacy=('blocks.{L}.attn.hook_pattern',), tl_bridge=('blocks.{L}.attn.hook_pattern',), nnterp=('attention_probabilities[{L}]',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "z", _L, Width.HEADS,
        "The per-head attention-weighted values, concatenated over heads: the input of the attention output projection (on gated-attention families, after attn_gate multiplies them).",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        tl_legacy=('blocks.{L}.attn.hook_z',), tl_bridge=('blocks.{L}.attn.o.hook_in',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "attn_gate", _L, Width.HEADS,
        "The activated output gate (sigmoid or softplus, as the family applies it) a gated-attention family multiplies into each head's kernel output (attn_probs @ value); z is that gated product.",
        _OK,
        BackendVerdict(Verdict.UNIMPLEMENTED, "The gate is a real module on vLLM's tree but is not wired up yet; use backend='eager'."),
        needs=(Needs.ATTENTION, Needs.ATTN_GATE),
    ),
    Point(
        "q_latent", _L, Width.Q_LATENT,
        "Latent attention's compressed query: the query's low-rank down-projection after its norm, one q_lora_rank vector per token, which the query up-projection reads.",
        _OK, _LATENT_VLLM,
        note="Latent attention with a compressed query only (DeepSeek-V2/V3, MiniCPM 3, DeepSeek-V4's low-rank queries).",
        writable=True,
        needs=(Needs.ATTENTION, Needs.Q_LATENT),
    ),
    Point(
        "kv_latent", _L, Width.KV_LATENT,
        "Latent attention's compressed key/value latent: the shared low-rank down-projection after its norm (the rotary key part split off), one kv_lora_rank vector per token; what the KV cache holds and the key/value up-projection reads.",
        _OK, _LATENT_VLLM,
        note="Multi-head latent attention only (DeepSeek-V2/V3, MiniCPM 3).",
        writable=True,
        needs=(Needs.ATTENTION, Needs.KV_LATENT),
    ),
    Point(
        "k_nope", _L, Width.K_NOPE,
        "The position-free part of each head's key, decompressed from kv_latent by the key/value up-projection (the rotary part is one shared vector per token), concatenated over heads.",
        _OK, _LATENT_VLLM,
        note="Multi-head latent attention only; the decompressed values are the value point.",
        needs=(Needs.ATTENTION, Needs.KV_LATENT),
    ),
    Point(
        "attn_out", _L, Width.D_MODEL,
        "The attention module's output (after the output projection), before any post-attention norm or residual multiplier.",
        _OK, _OK,
        note="TransformerLens' hook_attn_out is this point only on families without a post-attention norm or multiplier.",
        tl_bridge=('blocks.{L}.attn.hook_out',), nnterp=('attentions_output[{L}]',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "attn_out_post", _L, Width.D_MODEL,
        "What attention adds to the residual stream: attn_out after the post-attention norm and residual multiplier where the family has them.",
        _OK, _OK,
        tl_legacy=('blocks.{L}.hook_attn_out',), tl_bridge=('blocks.{L}.ln1_post.hook_out',),
        writable=True,
        needs=(Needs.ATTENTION, Needs.SINGLE_STREAM),
    ),
    Point(
        "mixer_in", _L, Width.D_MODEL,
        "The input of a non-attention mixer (a state-space, linear-attention, convolution or recurrent block) on a hybrid or state-space trunk's mixer layer: the residual after the layer's input norm.",
        _OK, _MIXER_VLLM,
        note="Mixer layers only; attention layers have attn_in.",
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_out", _L, Width.D_MODEL,
        "The mixer module's output on a mixer layer, before any post-mixer norm or residual multiplier.",
        _OK, _MIXER_VLLM,
        note="Mixer layers only; attention layers have attn_out.",
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_out_post", _L, Width.D_MODEL,
        "What the mixer adds to the residual stream: mixer_out after the post-mixer norm and residual multiplier where the family has them.",
        _OK, _MIXER_VLLM,
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_state", _L, Width.STATE,
        "The recurrent state a mixer leaves after the prompt, exactly as the model holds it for layer L (what the next decode step starts from): in transformers' own cache, a selective state space's [batch, d_inner, d_state] (Mamba, Falcon-Mamba, Jamba), a Mamba-2 mixer's [batch, n_heads, head_dim, d_state] (Mamba 2, Bamba, Nemotron-H, Zamba 2), a gated delta net's [batch, n_value_heads, key_head_dim, value_head_dim] (Qwen3-Next, Qwen3.5, OLMo hybrid, Kimi-linear), Zamba's multi-head selective state space [batch, n_mamba_heads, d_inner / n_mamba_heads, d_state]; in xLSTM's own cache, the mLSTM's matrix memory C [batch, n_heads, qk_head_dim, v_head_dim]; on RecurrentGemma's module, the RG-LRU's state [batch, lru_width] (float32, as the model keeps it); in the state list RWKV's forward returns, the time mix's WKV numerator, denominator and running maximum [batch, attention_hidden_size, 3] (float32). One final state per sequence, not one per position.",
        _MIXER_STATE_EAGER, _MIXER_STATE_VLLM,
        note="Capture only: no position axis to steer, and writing a state is refused. Absent on attention layers and on mixers that keep no recurrent state (LFM2's convolution). xLSTM's normaliser n and stabiliser m, carried beside C, are not served.",
        needs=(Needs.MIXER, Needs.MIXER_STATE),
    ),
    Point(
        "mixer_conv_state", _L, Width.STATE,
        "The convolution state a mixer leaves after the prompt, exactly as the model holds it for layer L: the last inputs of its causal convolution, [batch, channels, kernel_size] in transformers' cache (channels: d_inner on Mamba, the convolved x/B/C width on Mamba 2, the convolved q/k/v width on a gated delta net, d_model on LFM2), [batch, lru_width, conv1d_width - 1] on RecurrentGemma's module, [batch, d_model, 1] in RWKV's returned state (its time mix's token shift mixes each input with the one before: the last input, mixer_in.L at the last position). Final state only, left-padded with zeros where the prompt is shorter than the kernel.",
        _MIXER_STATE_EAGER, _MIXER_STATE_VLLM,
        note="Capture only, as mixer_state. Absent on attention layers and on mixers without a causal convolution (xLSTM's mLSTM).",
        needs=(Needs.MIXER, Needs.MIXER_CONV_STATE),
    ),
    Point(
        "resid_mid", _L, Width.D_MODEL,
        "The residual stream between the attention and MLP sublayers (after attention's contribution is added).",
        _OK, BackendVerdict(Verdict.SERVED, "Captured everywhere; on families where vLLM fuses the residual add into the next norm it is rebuilt as h + residual."), per_stream=True,
        note="Absent on parallel blocks, where attention and MLP both read the layer input.",
        tl_legacy=('blocks.{L}.hook_resid_mid',), tl_bridge=('blocks.{L}.ln2.hook_in',),
        writable=True,
        needs=(Needs.MLP, Needs.TOKEN_MIXER, Needs.SEQUENTIAL),
    ),
    Point(
        "mlp_in", _L, Width.D_MODEL,
        "The input of the MLP (or MoE) module: the residual after the pre-MLP norm.",
        _OK, _OK,
        tl_bridge=('blocks.{L}.mlp.hook_in', 'blocks.{L}.ln2.hook_out',), nnterp=('mlps_input[{L}]',),
        writable=True,
        needs=(Needs.MLP,),
    ),
    Point(
        "mlp_pre", _L, Width.D_MLP,
        "The MLP pre-activation: the gate projection's output on gated MLPs, the up/in projection's output otherwise.",
        _OK,
        BackendVerdict(Verdict.SERVED, "vLLM merges the gate and up projections into one gate_up_proj: the point is the gate half of its output (each rank's shard split, then gathered); c_fc's output on GPT-2."),
        note="Absent on sparse MoE layers, where every expert has its own.",
        tl_legacy=('blocks.{L}.mlp.hook_pre',), tl_bridge=('blocks.{L}.mlp.gate.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP),
    ),
    Point(
        "mlp_pre_linear", _L, Width.D_MLP,
        "The linear (up) branch of a gated MLP, which is multiplied by the activated gate.",
        _OK,
        BackendVerdict(Verdict.SERVED, "The up half of vLLM's merged gate_up_proj output (each rank's shard split, then gathered)."),
        note="Gated MLPs only.",
        tl_legacy=('blocks.{L}.mlp.hook_pre_linear',), tl_bridge=('blocks.{L}.mlp.in.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP, Needs.GATED_MLP),
    ),
    Point(
        "mlp_act", _L, Width.D_MLP,
        "The neuron activations: the input of the MLP's down/out projection (activated gate times up branch on gated MLPs).",
        _OK, BackendVerdict(Verdict.SERVED, _TP_NOTE),
        note="Absent on sparse MoE layers, where each expert has its own neurons.",
        tl_legacy=('blocks.{L}.mlp.hook_post',), tl_bridge=('blocks.{L}.mlp.out.hook_in',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP),
    ),
    Point(
        "router_logits", _L, Width.EXPERTS,
        "The MoE router's logits over experts, before top-k selection.",
        _OK, BackendVerdict(Verdict.SERVED, "The router is replicated across ranks, so tensor parallelism does not affect it."),
        tl_bridge=('blocks.{L}.mlp.gate.hook_out',),
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "expert_weights", _L, Width.EXPERTS,
        "The routing weights as a dense [.., n_experts] tensor: each selected expert's mixing weight, zero for the rest.",
        _OK,
        BackendVerdict(Verdict.UNREACHABLE, "The top-k selection happens inside vLLM's fused MoE kernel and is never materialised. Use backend='eager'."),
        tl_bridge=('blocks.{L}.mlp.gate.hook_expert_weights',),
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "expert_indices", _L, Width.EXPERTS,
        "The expert selection as a dense 0/1 mask over experts: 1 where the token was routed.",
        _OK,
        BackendVerdict(Verdict.UNREACHABLE, "As expert_weights: the selection lives inside the fused MoE kernel. Use backend='eager'."),
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "mlp_out", _L, Width.D_MODEL,
        "The MLP (or MoE) module's output, before any post-MLP norm or residual multiplier.",
        _OK, _OK,
        note="TransformerLens' hook_mlp_out is this point only on families without a post-MLP norm or multiplier.",
        tl_bridge=('blocks.{L}.mlp.hook_out',), nnterp=('mlps_output[{L}]',),
        writable=True,
        needs=(Needs.MLP,),
    ),
    Point(
        "mlp_out_post", _L, Width.D_MODEL,
        "What the MLP adds to the residual stream: mlp_out after the post-MLP norm and residual multiplier where the family has them.",
        _OK, _OK,
        tl_legacy=('blocks.{L}.hook_mlp_out',), tl_bridge=('blocks.{L}.ln2_post.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.SINGLE_STREAM),
    ),
    Point(
        "resid_post", _L, Width.D_MODEL,
        "The residual stream leaving decoder layer L (the layer's output hidden states).",
        _OK, BackendVerdict(Verdict.SERVED, "vLLM layers defer the residual add to the next layer; ie_lab adds h + residual so it equals the HF layer output."),
        per_stream=True,
        tl_legacy=('blocks.{L}.hook_resid_post',), tl_bridge=('blocks.{L}.hook_out',), nnterp=('layers_output[{L}]',),
        writable=True,
    ),
    Point(
        "final_norm", _T, Width.D_MODEL,
        "The output of the trunk's final norm, which the unembedding reads.",
        _OK, BackendVerdict(Verdict.SERVED, "Computed over every position of the request, not only the decoded ones."),
        tl_bridge=('ln_final.hook_out',), nnterp=('ln_final.output',),
        writable=True,
        needs=(Needs.FINAL_NORM,),
    ),
    Point(
        "lm_head", _T, Width.VOCAB,
        "The unembedding's raw output (W_U·x + b), before any logit soft-capping or scaling the family applies afterwards.",
        _OK,
        BackendVerdict(Verdict.UNREACHABLE, "vLLM's compute_logits folds scaling and soft-capping into the unembedding, so no hook sees the bare W_U·x. Use the logit lens or backend='eager'."),
        tl_bridge=('unembed.hook_out',), nnterp=('lm_head.output',),
    ),
    # Hyper-connection trunks (several residual streams) only.
    Point(
        "resid_streams", _L, Width.STREAMS,
        "The stack of residual streams entering layer L, [batch, seq, n_streams, d_model]: resid_pre.L.stream-S is its S-th slice.",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_collapse", _L, Width.D_MODEL,
        "The one d_model vector per token the streams collapse into for attention (a learned, token-dependent weighted sum of the streams), before the input norm: attn_in is its normed form.",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "mlp_stream_collapse", _L, Width.D_MODEL,
        "The one d_model vector per token the streams collapse into for the MLP, before the pre-MLP norm: mlp_in is its normed form.",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_write", _L, Width.STREAMS,
        "The per-token weight of each stream, [batch, seq, n_streams], with which attention's output is added to it: stream S receives attn_stream_write[..., S] * attn_out.",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "mlp_stream_write", _L, Width.STREAMS,
        "The per-token weight of each stream, [batch, seq, n_streams], with which the MLP's output is added to it: stream S receives mlp_stream_write[..., S] * mlp_out.",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_mix", _L, Width.STREAMS,
        "The per-token stream-to-stream mixing matrix around the attention sublayer, [batch, seq, n_streams, n_streams]: entry [i, j] is the weight of stream i (entering the layer) in stream j (at resid_mid).",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM, Needs.STREAM_MIX),
    ),
    Point(
        "mlp_stream_mix", _L, Width.STREAMS,
        "The per-token stream-to-stream mixing matrix around the MLP sublayer, [batch, seq, n_streams, n_streams]: entry [i, j] is the weight of stream i (at resid_mid) in stream j (leaving the layer).",
        _MHC_EAGER, _MHC_VLLM, needs=(Needs.MULTI_STREAM, Needs.STREAM_MIX),
    ),
)
# fmt: on

REGISTRY: dict[str, Point] = {p.name: p for p in _POINTS}
NAMES: tuple[str, ...] = tuple(REGISTRY)
SINGLE_STREAM_NAMES: tuple[str, ...] = tuple(p.name for p in _POINTS if not p.multi_stream_only)


def get(name: str, rest: str = "") -> Point:
    """The registry entry for a point name; otherwise an AddressError naming the few nearest points (with the
    coordinates that were typed after the name, `rest`: ".1" of "resid_psot.1") and where every point is listed."""
    from .errors import AddressError, nearest, shown

    try:
        return REGISTRY[name]
    except KeyError:
        pass
    # the single-stream names first: multi-stream points are on few trunks, and a newcomer's model is rarely one
    close = nearest(name[:100], SINGLE_STREAM_NAMES, n=3) or nearest(name[:100], NAMES, n=3)
    layer = re.match(r"\.\d{1,6}(?=\.|$)", rest)  # only the layer: a head or stream typed after it may not apply
    coords = layer.group(0) if layer else ""
    guesses = [n + (coords if REGISTRY[n].scope is Scope.LAYER else "") for n in close]
    hint = ""
    if guesses:
        hint = " Did you mean " + (", ".join(guesses[:-1]) + " or " if len(guesses) > 1 else "") + guesses[-1] + "?"
    if name in ("blocks", "model", "layers", "transformer", "gpt_neox") or name.startswith("hook_"):
        hint += (
            " That looks like another engine's hook or module name: ie_lab.mappers.from_engine(name, s, "
            "'transformerlens') (or 'transformerlens_bridge', 'nnterp') translates it (docs/MAPPERS.md)."
        )
    raise AddressError(
        f"unknown point name {shown(name)}.{hint} Every point this model has, with what each one is: "
        "s.points() on your Session, or click one in s.picker() (docs/POINTS.md lists them all)."
    ) from None


def all_points() -> tuple[Point, ...]:
    return _POINTS


def served(backend: str) -> tuple[str, ...]:
    """Names of points the backend serves (by hook or by recompute) on families that have them."""
    return tuple(p.name for p in _POINTS if p.verdict(backend).verdict.ok)


def tappable() -> tuple[str, ...]:
    """Names of points vLLM reads with a module hook, which are also the ones graph mode can tap."""
    return tuple(p.name for p in _POINTS if p.tappable)


@dataclass(frozen=True)
class Structure:
    """What one model has of the features points need (``Needs``), however it was learnt: from its config
    (``from_facts``), measured on the loaded model by the binder (``from_binding``), or reported by vLLM."""

    family: str
    qk_norm: bool = False
    parallel: bool = False  # attention and MLP both read the layer input: no residual between them
    gated_mlp: bool = True
    moe_layers: tuple[int, ...] = ()
    attn_gate: bool = False
    final_norm: bool = True
    n_streams: int = 1
    # Hyper-connection trunks: a learned matrix mixes the streams around each sublayer (DeepSeek-V4); without one the
    # streams are added back unmixed (HY-V4)
    stream_mix: bool = False
    # Latent attention: a compressed query latent / key-value latent on the attention layers
    q_latent: bool = False
    kv_latent: bool = False
    # Layers whose attention also attends to key/value entries a compressor builds from blocks of tokens
    kv_compressed_layers: tuple[int, ...] = ()
    # Hybrid and state-space trunks: the layers whose token mixer is not attention, and what each is (its layer
    # type as the config names it, or the mixer module's name), in the same order.
    mixer_layers: tuple[int, ...] = ()
    mixer_kinds: tuple[str, ...] = ()
    no_mlp_layers: tuple[int, ...] = ()  # mixer-only blocks, and attention-only ones on single-sublayer trunks
    # Single-sublayer trunks (Nemotron-H): blocks whose one sublayer is the MLP or MoE, with no token mixer. Such a
    # block is a layer of its own (layer L is the config's block L), so resid_mid exists on no layer of it.
    mlp_only_layers: tuple[int, ...] = ()
    # Layers whose mixer runs beside attention, both added to the stream (Falcon-H1): among mixer_layers, and
    # attention layers too, so both kinds of point exist there.
    parallel_mixer_layers: tuple[int, ...] = ()
    # Mixer layers whose mixer leaves a recurrent / convolution state for the next forward (mixer_state,
    # mixer_conv_state), wherever it keeps it (arch.mixer_states)
    state_layers: tuple[int, ...] = ()
    conv_state_layers: tuple[int, ...] = ()

    def layer_kind(self, layer: int) -> str:
        if layer in self.mlp_only_layers:
            return "moe" if layer in self.moe_layers else "mlp"
        return self.mixer_kinds[self.mixer_layers.index(layer)] if layer in self.mixer_layers else "attention"

    def mixers_text(self) -> str:
        """'0 mamba, 2 linear_attention': each mixer layer with its kind (every other layer is attention), and the
        MLP-only blocks of a single-sublayer trunk ('1 moe-only, 3 mlp-only')."""
        kinds = dict(zip(self.mixer_layers, self.mixer_kinds))
        kinds.update({i: f"{self.layer_kind(i)}-only" for i in self.mlp_only_layers})
        return ", ".join(f"{i} {kinds[i]}" for i in sorted(kinds)) or "none"

    @classmethod
    def from_facts(cls, facts: Any, final_norm: bool = True) -> "Structure":
        """From a config's ArchFacts (no weights). Configs do not say whether the trunk ends in a norm: a backend
        that found out passes it."""
        raw = facts.raw or {}
        # every layer runs this mixer beside its attention (Falcon-H1; arch.quirks.PARALLEL_MIXER): both kinds there
        beside = getattr(facts, "parallel_mixer", "")
        parallel = tuple(range(facts.n_layers)) if beside else ()
        return cls(
            facts.model_type,
            qk_norm=bool(facts.qk_norm),
            parallel=bool(facts.parallel_block),
            gated_mlp=bool(facts.gated_mlp),
            moe_layers=tuple(facts.moe_layers),
            attn_gate=bool(
                getattr(facts, "attn_gate", False)
                or raw.get("attn_output_gate")
                or raw.get("use_gated_attention")
                or raw.get("gated_attention")
            ),
            final_norm=final_norm,
            n_streams=int(facts.n_streams),
            # DeepSeek-V4's config states how many Sinkhorn steps shape its mixing matrix; HY-V4 has none to shape
            stream_mix=facts.n_streams > 1 and raw.get("hc_sinkhorn_iters") is not None,
            q_latent=bool(getattr(facts, "q_lora_rank", 0)),
            kv_latent=bool(getattr(facts, "kv_lora_rank", 0)),
            # DeepSeek-V4 names its compressed layers' types (compressed_sparse / heavily_compressed_attention)
            kv_compressed_layers=tuple(
                i for i, t in enumerate(raw.get("layer_types") or ()) if "compressed" in str(t) and i < facts.n_layers
            ),
            mixer_layers=tuple(i for i, k in enumerate(facts.mixer_kinds) if k) or parallel,
            mixer_kinds=tuple(k for k in facts.mixer_kinds if k) or (f"{beside} beside attention",) * len(parallel),
            parallel_mixer_layers=parallel,
            # a config that states an SSM and no attention heads is a pure state-space trunk: mixer-only blocks (not
            # RWKV's, headless too: each of its blocks runs its time mix, then a channel mix)
            no_mlp_layers=tuple(range(facts.n_layers))
            if not facts.n_heads and set(facts.mixer_kinds) == {"state_space"}
            else tuple(i for i, k in enumerate(getattr(facts, "block_sublayers", ())) if k in ("mixer", "attention")),
            mlp_only_layers=tuple(i for i, k in enumerate(getattr(facts, "block_sublayers", ())) if k == "mlp"),
            # a config names the kind only: a cached forward of the loaded model says for sure (from_binding)
            state_layers=tuple(i for i, k in enumerate(facts.mixer_kinds) if k and k not in _NO_RECURRENT_STATE)
            or parallel,
            conv_state_layers=tuple(
                i
                for i, k in enumerate(facts.mixer_kinds)
                if k and k not in _NO_CONV_STATE and facts.model_type not in _CONV_FREE_FAMILIES
            )
            or parallel,
        )

    @classmethod
    def from_binding(cls, binding: Any) -> "Structure":
        """Measured on a loaded model by arch.binder (a model with only MoE layers counts as gated: no dense
        layer exists to ask)."""
        st = binding.structure
        return cls(
            binding.family,
            qk_norm=bool(st["qk_norm"]),
            parallel=bool(st["parallel_block"]),
            gated_mlp=st["gated_mlp"] is not False,
            moe_layers=tuple(st["moe_layers"]),
            attn_gate=any(getattr(lb, "attn_gate", None) is not None for lb in binding.layers),
            final_norm=binding.final_norm is not None,
            n_streams=int(binding.facts.n_streams),
            stream_mix=any(getattr(lb, "stream_mix", False) for lb in binding.layers),
            q_latent=any(getattr(lb, "q_latent", None) is not None for lb in binding.layers),
            kv_latent=any(getattr(lb, "kv_latent", None) is not None for lb in binding.layers),
            kv_compressed_layers=tuple(lb.index for lb in binding.layers if getattr(lb, "kv_compressor", "")),
            mixer_layers=tuple(lb.index for lb in binding.layers if lb.mixer_kind or _par_mixer(lb)),
            mixer_kinds=tuple(
                lb.mixer_kind or _par_mixer(lb) for lb in binding.layers if lb.mixer_kind or _par_mixer(lb)
            ),
            parallel_mixer_layers=tuple(lb.index for lb in binding.layers if _par_mixer(lb)),
            no_mlp_layers=tuple(lb.index for lb in binding.layers if not lb.has_mlp),
            mlp_only_layers=tuple(lb.index for lb in binding.layers if getattr(lb, "mlp_only", False)),
            state_layers=tuple(lb.index for lb in binding.layers if "recurrent" in _cache_states(lb)),
            conv_state_layers=tuple(lb.index for lb in binding.layers if "conv" in _cache_states(lb)),
        )

    def has(self, need: Needs, layer: int | None = None) -> bool:
        return {
            Needs.MULTI_STREAM: self.n_streams > 1,
            Needs.SINGLE_STREAM: self.n_streams <= 1,
            Needs.STREAM_MIX: self.stream_mix,
            Needs.Q_LATENT: self.q_latent,
            Needs.KV_LATENT: self.kv_latent,
            Needs.TOKEN_KV: layer not in self.kv_compressed_layers,
            Needs.FINAL_NORM: self.final_norm,
            Needs.QK_NORM: self.qk_norm,
            Needs.ATTN_GATE: self.attn_gate,
            Needs.SEQUENTIAL: not self.parallel,
            Needs.DENSE_MLP: layer not in self.moe_layers,
            Needs.GATED_MLP: self.gated_mlp,
            Needs.MOE: layer in self.moe_layers,
            Needs.ATTENTION: (layer not in self.mixer_layers or layer in self.parallel_mixer_layers)
            and layer not in self.mlp_only_layers,
            Needs.MIXER: layer in self.mixer_layers,
            Needs.MLP: layer not in self.no_mlp_layers,
            Needs.TOKEN_MIXER: layer not in self.mlp_only_layers,
            Needs.MIXER_STATE: layer in self.state_layers,
            Needs.MIXER_CONV_STATE: layer in self.conv_state_layers,
        }[need]


# Config layer kinds known to carry no such state: a short convolution (LFM2) has no recurrent state, an mLSTM
# (xLSTM) no convolution.
_NO_RECURRENT_STATE = frozenset({"conv"})
_NO_CONV_STATE = frozenset({"mlstm"})
# Families whose mixer kind's name (as the config gives it) also names mixers with a short convolution elsewhere:
# MiniMax's lightning "linear_attention" has none (Qwen3-Next's gated delta net, of the same name, has one).
_CONV_FREE_FAMILIES = frozenset({"minimax"})


def _cache_states(lb: Any) -> tuple[str, ...]:
    """Which final states the layer's mixer leaves after a forward ('recurrent', 'conv'), as the binder measured
    them with a cached probe forward (arch.mixer_states)."""
    return tuple(getattr(lb, "mixer_states", None) or ())


def _par_mixer(lb: Any) -> str:
    """'mamba beside attention' on a layer whose mixer runs in parallel with attention (arch.binder), else ''."""
    return f"{lb.names.get('mixer', 'mixer')} beside attention" if getattr(lb, "par_mixer", None) is not None else ""


@dataclass(frozen=True)
class Absence:
    """Why a point does not exist on a model, and what to use instead (a PointAbsent's two sentences)."""

    need: Needs
    why: str
    instead: str


# Layer kinds whose mixer's input also receives a transformer block shared across layers, through the layer's own
# linear (Zamba's "hybrid" layers): the block's output never reaches the residual stream itself.
SHARED_BLOCK_KINDS = frozenset({"hybrid"})
_SHARED_BLOCK = (
    "layer {L} is a {kind} layer: its attention and MLP belong to a transformer block shared across layers, whose "
    "output joins the mixer's input (through the layer's linear) rather than the residual stream, and ie_lab does "
    "not address that shared block's tensors per layer yet, so there is no {name} here (layer kinds: {kinds}).",
    "capture mixer_in.{L} (the mixer's input, which the shared block's output joined), mixer_out.{L}, or "
    "resid_post.{L}.",
)
# An attention-only block of a single-sublayer trunk: the same absence as a mixer-only block, in its own words.
_ATTENTION_ONLY = (
    "layer {L} is an attention-only block (a single-sublayer block: attention's output is added straight to the "
    "residual stream), so it has no {name} (layer kinds: {kinds}; every other layer is attention).",
    "capture attn_out.{L}, or resid_post.{L} (the stream after attention).",
)

# Per missing feature: (why, instead); {L} is the layer, {name} the point, {moe} the model's MoE layers.
_ABSENT: dict[Needs, tuple[str, str]] = {
    Needs.MULTI_STREAM: (
        "this trunk carries a single residual stream, so there are no per-stream points or stream coordinates.",
        "use the plain point, e.g. 'resid_post.3'.",
    ),
    Needs.SINGLE_STREAM: (
        "this trunk carries {n_streams} residual streams (hyper-connections): the sublayer's output enters each "
        "stream with a weight of its own, so no single tensor is what it adds to the residual.",
        "capture {sub}_out.{L} and {sub}_stream_write.{L}: stream S receives {sub}_stream_write[..., S] * {sub}_out.",
    ),
    Needs.Q_LATENT: (
        "this family's attention projects queries straight from the residual (no compressed query latent).",
        "capture attn_in.{L} (what the query projection reads), or kv_latent.{L} where the keys and values are "
        "compressed.",
    ),
    Needs.KV_LATENT: (
        "this family's attention projects its keys and values from the residual directly: there is no compressed "
        "key/value latent that an up-projection decompresses per head (multi-head latent attention: DeepSeek-V2/V3, "
        "MiniCPM 3).",
        "capture value.{L} (and attn_scores.{L} for the keys' effect).",
    ),
    Needs.TOKEN_KV: (
        "layer {L}'s attention also attends to key/value entries its compressor builds from blocks of tokens, "
        "appended after the tokens' own (a compressed-attention layer), so the key axis is not one entry per token "
        "and {name} would not line up with the prompt.",
        "capture z.{L} (what the kernel returned) or attn_out.{L}, or {name} on a layer without a compressor.",
    ),
    Needs.STREAM_MIX: (
        "this trunk's hyper-connections add the {n_streams} streams back unmixed (no stream-to-stream matrix): each "
        "stream is carried on and receives the sublayer's output with its own weight.",
        "capture resid_pre.{L}.stream-S and {sub}_stream_write.{L}.",
    ),
    Needs.FINAL_NORM: ("the trunk has no final norm before the unembedding.", "use the last resid_post."),
    Needs.QK_NORM: (
        "this family has no QK-norm (queries and keys enter attention un-normalised).",
        "capture attn_in, or value / attn_scores.",
    ),
    Needs.ATTN_GATE: ("this family's attention has no output gate.", "capture z."),
    Needs.SEQUENTIAL: (
        "this family runs attention and the MLP in parallel on the same layer input (a parallel "
        "block), so no residual exists between them.",
        "use resid_pre (what both read) or resid_post.",
    ),
    Needs.DENSE_MLP: (
        "layer {L} is a sparse mixture-of-experts layer: each expert has its own neurons, so there is "
        "no single {name} tensor.",
        "capture router_logits / expert_weights, or mlp_out.",
    ),
    Needs.GATED_MLP: (
        "this family's MLP is not gated (up -> activation -> down), so there is no separate linear branch.",
        "capture mlp_pre (the pre-activation) or mlp_act.",
    ),
    Needs.MOE: ("layer {L} is a dense MLP layer with no router.", "MoE layers of this model: {moe}."),
    Needs.ATTENTION: (
        "layer {L} is a {kind} mixer layer, not an attention layer, so it has no {name} (layer kinds: {kinds}; "
        "every other layer is attention).",
        "capture mixer_in.{L} / mixer_out.{L} there, or {name} on an attention layer.",
    ),
    Needs.MIXER: (
        "layer {L} is an attention layer, not a non-attention mixer layer (mixer layers of this model: {kinds}).",
        "use attn_in.{L} / attn_out.{L} there, or {name} on a mixer layer.",
    ),
    Needs.MLP: (
        "layer {L} is a mixer-only block ({kind}, no MLP): the mixer's output is added straight to the residual "
        "stream, so there is no {name}.",
        "capture mixer_out.{L}, or resid_post.{L} (the stream after the mixer).",
    ),
    Needs.MIXER_STATE: (
        "layer {L}'s mixer ({kind}) hands no recurrent state on to the next forward (measured at load: a cached "
        "forward left none for this layer in the cache or on the mixer; mixer layers of this model: {kinds}): a "
        "short convolution has none.",
        "capture mixer_conv_state.{L} where the mixer has a convolution, or mixer_out.{L}.",
    ),
    Needs.MIXER_CONV_STATE: (
        "layer {L}'s mixer ({kind}) hands no convolution state on to the next forward (measured at load: a cached "
        "forward left none for this layer in the cache or on the mixer; mixer layers of this model: {kinds}).",
        "capture mixer_state.{L} where the mixer has a recurrent state, or mixer_out.{L}.",
    ),
    Needs.TOKEN_MIXER: (
        "layer {L} is an MLP-only block ({kind}: a single-sublayer block with no attention or mixer, whose output "
        "is added straight to the residual stream), so it has no {name} (layer kinds: {kinds}; every other layer "
        "is attention).",
        "capture mlp_in.{L} / mlp_out.{L} there, or resid_pre.{L} / resid_post.{L}.",
    ),
}


def absence(point: "Point | str", structure: Structure, layer: int | None = None) -> Absence | None:
    """Why ``point`` (at ``layer``, for per-layer points) does not exist on a model of this structure, or None
    where it does. The one place every backend, the picker and the points table take that answer from."""
    p = get(point) if isinstance(point, str) else point
    for need in p.needs:
        if not structure.has(need, layer):
            why, instead = _ABSENT[need]
            if need in (Needs.ATTENTION, Needs.MIXER) and layer in structure.mlp_only_layers:
                why, instead = _ABSENT[Needs.TOKEN_MIXER]  # no token mixer at all: say the block's kind
            elif need is Needs.MLP and structure.layer_kind(layer or 0) == "attention":
                why, instead = _ATTENTION_ONLY
            elif need in (Needs.ATTENTION, Needs.MLP) and structure.layer_kind(layer or 0) in SHARED_BLOCK_KINDS:
                why, instead = _SHARED_BLOCK
            fill = dict(L=layer, name=p.name, moe=list(structure.moe_layers) or "none", n_streams=structure.n_streams)
            fill.update(sub="mlp" if p.name.startswith("mlp") else "attn")
            if need in (
                Needs.ATTENTION,
                Needs.MIXER,
                Needs.MLP,
                Needs.TOKEN_MIXER,
                Needs.MIXER_STATE,
                Needs.MIXER_CONV_STATE,
            ):
                fill.update(kind=structure.layer_kind(layer or 0), kinds=structure.mixers_text())
            return Absence(need, why.format(**fill), instead.format(**fill))
    return None


def absent_reason(point: "Point | str", structure: Structure, layer: int | None = None) -> str | None:
    """The sentence saying why the point is absent on this structure; None where it exists."""
    a = absence(point, structure, layer)
    return None if a is None else a.why


def require_present(
    point: "Point | str", structure: Structure, layer: int | None = None, label: str | None = None
) -> None:
    """Raise PointAbsent (naming ``label``, the point's name by default) where ``absence`` finds a reason."""
    a = absence(point, structure, layer)
    if a is not None:
        from .errors import PointAbsent

        name = point if isinstance(point, str) else point.name
        raise PointAbsent(label or name, structure.family, a.why, a.instead)


def width_of(width: Width, facts: Any) -> int | str:
    """What a point of this width's last axis counts on a model with these facts. A head of z, attn_gate and value
    is a value head: wider than head_dim on latent attention (where the QK-norm points, head_dim wide, are absent)."""
    v = getattr(facts, "value_head_dim", facts.head_dim)
    return {
        Width.D_MODEL: facts.d_model,
        Width.HEADS: facts.n_heads * v,
        Width.KV_HEADS: facts.n_kv_heads * v,
        Width.D_MLP: facts.d_mlp,
        Width.EXPERTS: facts.n_experts,
        Width.VOCAB: facts.vocab_size,
        Width.ATTN: f"{facts.n_heads} x q x k",
        Width.STREAMS: facts.n_streams,
        Width.Q_LATENT: getattr(facts, "q_lora_rank", 0),
        Width.KV_LATENT: getattr(facts, "kv_lora_rank", 0),
        Width.K_NOPE: facts.n_heads * getattr(facts, "qk_nope_head_dim", 0),
        Width.STATE: "per mixer kind (POINTS.md)",
    }[width]


def reason(name: str, backend: str) -> str:
    """The sentence explaining a backend's verdict on a point (empty when it is simply served)."""
    return get(name).verdict(backend).reason


def markdown_table() -> str:
    """The points table for docs/POINTS.md, generated so it cannot drift from the code."""
    rows = [
        "| point | scope | width | eager | vLLM | definition | TransformerLens | nnterp |",
        "| --- | --- | --- | :---: | :---: | --- | --- | --- |",
    ]
    for p in _POINTS:

        def cell(v: BackendVerdict) -> str:
            text = v.verdict.symbol + " " + v.verdict.value
            return text + (f": {v.reason}" if v.reason else "")

        tl = ", ".join(f"`{n}`" for n in p.tl_legacy + tuple(x for x in p.tl_bridge if x not in p.tl_legacy)) or "—"
        nn = ", ".join(f"`{n}`" for n in p.nnterp) or "—"
        definition = p.definition + (f" *{p.note}*" if p.note else "")
        rows.append(
            f"| `{p.name}` | {p.scope.value} | `{p.width.value}` | {cell(p.eager)} | {cell(p.vllm)} | {definition} | {tl} | {nn} |"
        )
    return "\n".join(rows) + "\n"
