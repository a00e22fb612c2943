"""The point registry: the one place that says what each hook point is.

Docs tables (docs/POINTS.md), the picker's cards, the mappers, the validator and both backends read
this module. It holds plain data only (no torch) so it can be imported anywhere, including by tools
that never load a model.

What a point is lives here; what a backend does with it does not: each backend declares its verdict on every
point in its own package (ie_lab/eager/verdicts.py, ie_lab/vllm/verdicts.py), read through ``Point.verdict``.
The words points are described in are in point_kinds.py, the structure a model has of their needs and why a
point is absent without one in point_structure.py; both are re-exported here.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .point_kinds import BackendVerdict, Needs, Scope, Verdict, Width
from .point_structure import SHARED_BLOCK_KINDS, Absence, Structure, absence_of

__all__ = [
    "BACKENDS",
    "NAMES",
    "REGISTRY",
    "SHARED_BLOCK_KINDS",
    "SINGLE_STREAM_NAMES",
    "Absence",
    "BackendVerdict",
    "Needs",
    "Point",
    "Scope",
    "Structure",
    "Verdict",
    "Width",
    "absence",
    "absent_reason",
    "all_points",
    "backend_verdicts",
    "verdicts_of",
    "get",
    "markdown_table",
    "reason",
    "require_present",
    "served",
    "tappable",
    "width_of",
]

# The backends whose verdicts the points table, the picker and the CLI show. Each declares them in its own package,
# ie_lab/<backend>/verdicts.py (POINTS: point name -> BackendVerdict), found by name as ie_lab/backend.py finds a
# backend class: this module imports no backend, and a new backend adds its name here and its own table there.
BACKENDS = ("eager", "vllm")


def verdicts_of(backend: str) -> ModuleType:
    """The backend's own verdicts module, ie_lab/<backend>/verdicts.py (POINTS, CAPABILITIES, LABEL)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return importlib.import_module(f"{__package__}.{backend}.verdicts")


def backend_verdicts(backend: str) -> Mapping[str, BackendVerdict]:
    """The backend's own verdict on every point (its package's verdicts.POINTS)."""
    return verdicts_of(backend).POINTS


@dataclass(frozen=True)
class Point:
    name: str
    scope: Scope
    width: Width
    definition: str
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

    def verdict(self, backend: str) -> BackendVerdict:
        """What ``backend`` does with this point, as its own package declares (``backend_verdicts``)."""
        return backend_verdicts(backend)[self.name]

    def __getattr__(self, name: str) -> Any:
        # p.eager, p.vllm: p.verdict(name), the spelling callers used when the verdicts were columns of this table
        if name in BACKENDS:
            return self.verdict(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # vLLM's words, kept for their callers: ie_lab.vllm.verdicts owns what they mean.
    @property
    def tappable(self) -> bool:
        """vLLM reads it with a module hook, so graph mode can tap it (ie_lab.vllm.verdicts.tappable)."""
        return bool(verdicts_of("vllm").tappable(self.name))

    @property
    def recomputed(self) -> bool:
        """vLLM rebuilds it after the request from other captured tensors (ie_lab.vllm.verdicts.recomputed)."""
        return bool(verdicts_of("vllm").recomputed(self.name))


_L, _T = Scope.LAYER, Scope.TRUNK

# One row per point, laid out as a table: the formatter would put every field on its own line.
# fmt: off
_POINTS: tuple[Point, ...] = (
    Point(
        "embeddings", _T, Width.D_MODEL,
        "The token-embedding module's output (with any scaling the module itself applies, as on Gemma 3), before the positional embeddings, trunk-level scaling or dropout applied on the way to layer 0.",
        note="Equals resid_pre.0 only on families that neither add positions nor scale the embedding.",
        tl_legacy=('hook_embed',), tl_bridge=('embed.hook_out',), nnterp=('token_embeddings',),
        writable=True,
    ),
    Point(
        "resid_pre", _L, Width.D_MODEL,
        "The residual stream entering decoder layer L (the layer's hidden_states input).",
        per_stream=True,
        tl_legacy=('blocks.{L}.hook_resid_pre',), tl_bridge=('blocks.{L}.hook_in',), nnterp=('layers_input[{L}]',),
        writable=True,
    ),
    Point(
        "attn_in", _L, Width.D_MODEL,
        "The input of the attention module: the residual after the layer's input norm (the raw residual on families without one).",
        tl_bridge=('blocks.{L}.attn.hook_in', 'blocks.{L}.ln1.hook_out',), nnterp=('attentions_input[{L}]',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "q_norm_in", _L, Width.HEADS,
        "Queries entering the QK-norm, flattened over heads (after the query projection; before RoPE on most families, after it where the family normalises rotated queries).",
        tl_legacy=('blocks.{L}.attn.hook_q',), tl_bridge=('blocks.{L}.attn.q_norm.hook_in', 'blocks.{L}.attn.q.hook_out',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "q_norm_out", _L, Width.HEADS,
        "Queries leaving the QK-norm, flattened over heads.",
        tl_bridge=('blocks.{L}.attn.q_norm.hook_out', 'blocks.{L}.attn.hook_q_normed',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "k_norm_in", _L, Width.KV_HEADS,
        "Keys entering the QK-norm, flattened over key/value heads (placed like q_norm_in).",
        tl_legacy=('blocks.{L}.attn.hook_k',), tl_bridge=('blocks.{L}.attn.k_norm.hook_in', 'blocks.{L}.attn.k.hook_out',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "k_norm_out", _L, Width.KV_HEADS,
        "Keys leaving the QK-norm, flattened over key/value heads.",
        tl_bridge=('blocks.{L}.attn.k_norm.hook_out', 'blocks.{L}.attn.hook_k_normed',),
        needs=(Needs.ATTENTION, Needs.QK_NORM),
    ),
    Point(
        "value", _L, Width.KV_HEADS,
        "The value vectors the attention kernel mixes, one per key/value head (split out of a fused QKV projection where there is one).",
        note="Under grouped-query attention the width counts key/value heads, not query heads.",
        tl_legacy=('blocks.{L}.attn.hook_v',), tl_bridge=('blocks.{L}.attn.v.hook_out',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "attn_scores", _L, Width.ATTN,
        "Pre-softmax attention logits, [batch, heads, query, key]: q·k times the scale, soft-capped where the running kernel caps (sdpa ignores a family's softcap), with masked entries set to -inf.",
        tl_legacy=('blocks.{L}.attn.hook_attn_scores',), tl_bridge=('blocks.{L}.attn.hook_attn_scores',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "attn_probs", _L, Width.ATTN,
        "The attention pattern after softmax, [batch, heads, query, key]; each row sums to 1 except where the family adds attention sinks.",
        tl_legacy=('blocks.{L}.attn.hook_pattern',), tl_bridge=('blocks.{L}.attn.hook_pattern',), nnterp=('attention_probabilities[{L}]',),
        needs=(Needs.ATTENTION, Needs.TOKEN_KV),
    ),
    Point(
        "z", _L, Width.HEADS,
        "The per-head attention-weighted values, concatenated over heads: the input of the attention output projection (on gated-attention families, after attn_gate multiplies them).",
        tl_legacy=('blocks.{L}.attn.hook_z',), tl_bridge=('blocks.{L}.attn.o.hook_in',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "attn_gate", _L, Width.HEADS,
        "The activated output gate (sigmoid or softplus, as the family applies it) a gated-attention family multiplies into each head's kernel output (attn_probs @ value); z is that gated product.",
        needs=(Needs.ATTENTION, Needs.ATTN_GATE),
    ),
    Point(
        "q_latent", _L, Width.Q_LATENT,
        "Latent attention's compressed query: the query's low-rank down-projection after its norm, one q_lora_rank vector per token, which the query up-projection reads.",
        note="Latent attention with a compressed query only (DeepSeek-V2/V3, MiniCPM 3, DeepSeek-V4's low-rank queries).",
        writable=True,
        needs=(Needs.ATTENTION, Needs.Q_LATENT),
    ),
    Point(
        "kv_latent", _L, Width.KV_LATENT,
        "Latent attention's compressed key/value latent: the shared low-rank down-projection after its norm (the rotary key part split off), one kv_lora_rank vector per token; what the KV cache holds and the key/value up-projection reads.",
        note="Multi-head latent attention only (DeepSeek-V2/V3, MiniCPM 3).",
        writable=True,
        needs=(Needs.ATTENTION, Needs.KV_LATENT),
    ),
    Point(
        "k_nope", _L, Width.K_NOPE,
        "The position-free part of each head's key, decompressed from kv_latent by the key/value up-projection (the rotary part is one shared vector per token), concatenated over heads.",
        note="Multi-head latent attention only; the decompressed values are the value point.",
        needs=(Needs.ATTENTION, Needs.KV_LATENT),
    ),
    Point(
        "attn_out", _L, Width.D_MODEL,
        "The attention module's output (after the output projection), before any post-attention norm or residual multiplier.",
        note="TransformerLens' hook_attn_out is this point only on families without a post-attention norm or multiplier.",
        tl_bridge=('blocks.{L}.attn.hook_out',), nnterp=('attentions_output[{L}]',),
        writable=True,
        needs=(Needs.ATTENTION,),
    ),
    Point(
        "attn_result", _L, Width.HEADS_D_MODEL,
        "Each head's write through the output projection, [batch, seq, n_heads, d_model]: head h's slice of z times the projection's slice of columns for that head, computed from z and the projection's weight when asked (no second forward). Summed over heads, plus the projection's bias (and any bias the layer adds to it), it is attn_out.",
        note="Where a post-attention norm follows (Gemma 2, OLMo 2), the heads' sum is attn_out, not what attention adds to the residual (attn_out_post); a residual multiplier scales both. Refused where the output projection is not a plain linear map of the heads' concatenation (a norm across heads before it, a quantized or adapted projection).",
        tl_legacy=('blocks.{L}.attn.hook_result',),
        needs=(Needs.ATTENTION, Needs.HEADS_PROJECTED),
    ),
    Point(
        "attn_out_post", _L, Width.D_MODEL,
        "What attention adds to the residual stream: attn_out after the post-attention norm and residual multiplier where the family has them.",
        tl_legacy=('blocks.{L}.hook_attn_out',), tl_bridge=('blocks.{L}.ln1_post.hook_out',),
        writable=True,
        needs=(Needs.ATTENTION, Needs.SINGLE_STREAM),
    ),
    Point(
        "mixer_in", _L, Width.D_MODEL,
        "The input of a non-attention mixer (a state-space, linear-attention, convolution or recurrent block) on a hybrid or state-space trunk's mixer layer: the residual after the layer's input norm.",
        note="Mixer layers only; attention layers have attn_in.",
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_out", _L, Width.D_MODEL,
        "The mixer module's output on a mixer layer, before any post-mixer norm or residual multiplier.",
        note="Mixer layers only; attention layers have attn_out.",
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_out_post", _L, Width.D_MODEL,
        "What the mixer adds to the residual stream: mixer_out after the post-mixer norm and residual multiplier where the family has them.",
        writable=True,
        needs=(Needs.MIXER,),
    ),
    Point(
        "mixer_state", _L, Width.STATE,
        "The recurrent state a mixer leaves after the prompt, exactly as the model holds it for layer L (what the next decode step starts from): in transformers' own cache, a selective state space's [batch, d_inner, d_state] (Mamba, Falcon-Mamba, Jamba), a Mamba-2 mixer's [batch, n_heads, head_dim, d_state] (Mamba 2, Bamba, Nemotron-H, Zamba 2), a gated delta net's [batch, n_value_heads, key_head_dim, value_head_dim] (Qwen3-Next, Qwen3.5, OLMo hybrid, Kimi-linear), Zamba's multi-head selective state space [batch, n_mamba_heads, d_inner / n_mamba_heads, d_state]; in xLSTM's own cache, the mLSTM's matrix memory C [batch, n_heads, qk_head_dim, v_head_dim]; on RecurrentGemma's module, the RG-LRU's state [batch, lru_width] (float32, as the model keeps it); in the state list RWKV's forward returns, the time mix's WKV numerator, denominator and running maximum [batch, attention_hidden_size, 3] (float32). One final state per sequence, not one per position.",
        note="Capture only: no position axis to steer, and writing a state is refused. Absent on attention layers and on mixers that keep no recurrent state (LFM2's convolution). xLSTM's normaliser n and stabiliser m, carried beside C, are not served.",
        needs=(Needs.MIXER, Needs.MIXER_STATE),
    ),
    Point(
        "mixer_conv_state", _L, Width.STATE,
        "The convolution state a mixer leaves after the prompt, exactly as the model holds it for layer L: the last inputs of its causal convolution, [batch, channels, kernel_size] in transformers' cache (channels: d_inner on Mamba, the convolved x/B/C width on Mamba 2, the convolved q/k/v width on a gated delta net, d_model on LFM2), [batch, lru_width, conv1d_width - 1] on RecurrentGemma's module, [batch, d_model, 1] in RWKV's returned state (its time mix's token shift mixes each input with the one before: the last input, mixer_in.L at the last position). Final state only, left-padded with zeros where the prompt is shorter than the kernel.",
        note="Capture only, as mixer_state. Absent on attention layers and on mixers without a causal convolution (xLSTM's mLSTM).",
        needs=(Needs.MIXER, Needs.MIXER_CONV_STATE),
    ),
    Point(
        "resid_mid", _L, Width.D_MODEL,
        "The residual stream between the attention and MLP sublayers (after attention's contribution is added).",
        per_stream=True,
        note="Absent on parallel blocks, where attention and MLP both read the layer input.",
        tl_legacy=('blocks.{L}.hook_resid_mid',), tl_bridge=('blocks.{L}.ln2.hook_in',),
        writable=True,
        needs=(Needs.MLP, Needs.TOKEN_MIXER, Needs.SEQUENTIAL),
    ),
    Point(
        "mlp_in", _L, Width.D_MODEL,
        "The input of the MLP (or MoE) module: the residual after the pre-MLP norm.",
        tl_bridge=('blocks.{L}.mlp.hook_in', 'blocks.{L}.ln2.hook_out',), nnterp=('mlps_input[{L}]',),
        writable=True,
        needs=(Needs.MLP,),
    ),
    Point(
        "mlp_pre", _L, Width.D_MLP,
        "The MLP pre-activation: the gate projection's output on gated MLPs, the up/in projection's output otherwise.",
        note="Absent on sparse MoE layers, where every expert has its own.",
        tl_legacy=('blocks.{L}.mlp.hook_pre',), tl_bridge=('blocks.{L}.mlp.gate.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP),
    ),
    Point(
        "mlp_pre_linear", _L, Width.D_MLP,
        "The linear (up) branch of a gated MLP, which is multiplied by the activated gate.",
        note="Gated MLPs only.",
        tl_legacy=('blocks.{L}.mlp.hook_pre_linear',), tl_bridge=('blocks.{L}.mlp.in.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP, Needs.GATED_MLP),
    ),
    Point(
        "mlp_act", _L, Width.D_MLP,
        "The neuron activations: the input of the MLP's down/out projection (activated gate times up branch on gated MLPs).",
        note="Absent on sparse MoE layers, where each expert has its own neurons.",
        tl_legacy=('blocks.{L}.mlp.hook_post',), tl_bridge=('blocks.{L}.mlp.out.hook_in',),
        writable=True,
        needs=(Needs.MLP, Needs.DENSE_MLP),
    ),
    Point(
        "router_logits", _L, Width.EXPERTS,
        "The MoE router's logits over experts, before top-k selection.",
        tl_bridge=('blocks.{L}.mlp.gate.hook_out',),
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "expert_weights", _L, Width.EXPERTS,
        "The routing weights as a dense [.., n_experts] tensor: each selected expert's mixing weight, zero for the rest.",
        tl_bridge=('blocks.{L}.mlp.gate.hook_expert_weights',),
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "expert_indices", _L, Width.EXPERTS,
        "The expert selection as a dense 0/1 mask over experts: 1 where the token was routed.",
        needs=(Needs.MLP, Needs.MOE),
    ),
    Point(
        "mlp_out", _L, Width.D_MODEL,
        "The MLP (or MoE) module's output, before any post-MLP norm or residual multiplier.",
        note="TransformerLens' hook_mlp_out is this point only on families without a post-MLP norm or multiplier.",
        tl_bridge=('blocks.{L}.mlp.hook_out',), nnterp=('mlps_output[{L}]',),
        writable=True,
        needs=(Needs.MLP,),
    ),
    Point(
        "mlp_out_post", _L, Width.D_MODEL,
        "What the MLP adds to the residual stream: mlp_out after the post-MLP norm and residual multiplier where the family has them.",
        tl_legacy=('blocks.{L}.hook_mlp_out',), tl_bridge=('blocks.{L}.ln2_post.hook_out',),
        writable=True,
        needs=(Needs.MLP, Needs.SINGLE_STREAM),
    ),
    Point(
        "resid_post", _L, Width.D_MODEL,
        "The residual stream leaving decoder layer L (the layer's output hidden states).",
        per_stream=True,
        tl_legacy=('blocks.{L}.hook_resid_post',), tl_bridge=('blocks.{L}.hook_out',), nnterp=('layers_output[{L}]',),
        writable=True,
    ),
    Point(
        "final_norm", _T, Width.D_MODEL,
        "The output of the trunk's final norm, which the unembedding reads.",
        tl_bridge=('ln_final.hook_out',), nnterp=('ln_final.output',),
        writable=True,
        needs=(Needs.FINAL_NORM,),
    ),
    Point(
        "lm_head", _T, Width.VOCAB,
        "The unembedding's raw output (W_U·x + b), before any logit soft-capping or scaling the family applies afterwards.",
        tl_bridge=('unembed.hook_out',), nnterp=('lm_head.output',),
    ),
    # Hyper-connection trunks (several residual streams) only.
    Point(
        "resid_streams", _L, Width.STREAMS,
        "The stack of residual streams entering layer L, [batch, seq, n_streams, d_model]: resid_pre.L.stream-S is its S-th slice.",
        needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_collapse", _L, Width.D_MODEL,
        "The one d_model vector per token the streams collapse into for attention (a learned, token-dependent weighted sum of the streams), before the input norm: attn_in is its normed form.",
        needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "mlp_stream_collapse", _L, Width.D_MODEL,
        "The one d_model vector per token the streams collapse into for the MLP, before the pre-MLP norm: mlp_in is its normed form.",
        needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_write", _L, Width.STREAMS,
        "The per-token weight of each stream, [batch, seq, n_streams], with which attention's output is added to it: stream S receives attn_stream_write[..., S] * attn_out.",
        needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "mlp_stream_write", _L, Width.STREAMS,
        "The per-token weight of each stream, [batch, seq, n_streams], with which the MLP's output is added to it: stream S receives mlp_stream_write[..., S] * mlp_out.",
        needs=(Needs.MULTI_STREAM,),
    ),
    Point(
        "attn_stream_mix", _L, Width.STREAMS,
        "The per-token stream-to-stream mixing matrix around the attention sublayer, [batch, seq, n_streams, n_streams]: entry [i, j] is the weight of stream i (entering the layer) in stream j (at resid_mid).",
        needs=(Needs.MULTI_STREAM, Needs.STREAM_MIX),
    ),
    Point(
        "mlp_stream_mix", _L, Width.STREAMS,
        "The per-token stream-to-stream mixing matrix around the MLP sublayer, [batch, seq, n_streams, n_streams]: entry [i, j] is the weight of stream i (at resid_mid) in stream j (leaving the layer).",
        needs=(Needs.MULTI_STREAM, Needs.STREAM_MIX),
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
    """Names of points vLLM reads with a module hook, which are also the ones graph mode can tap (kept for its
    callers: ie_lab.vllm.verdicts.tappable_names)."""
    return tuple(verdicts_of("vllm").tappable_names())


def absence(point: "Point | str", structure: Structure, layer: int | None = None) -> Absence | None:
    """Why ``point`` (at ``layer``, for per-layer points) does not exist on a model of this structure, or None
    where it does. The one place every backend, the picker and the points table take that answer from."""
    p = get(point) if isinstance(point, str) else point
    return absence_of(p.name, p.needs, structure, layer)


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
        Width.HEADS_D_MODEL: facts.n_heads * facts.d_model,
    }[width]


def reason(name: str, backend: str) -> str:
    """The sentence explaining a backend's verdict on a point (empty when it is simply served)."""
    return get(name).verdict(backend).reason


def markdown_table() -> str:
    """The points table for docs/POINTS.md, generated so it cannot drift from the code."""
    labels = " | ".join(verdicts_of(b).LABEL for b in BACKENDS)
    rows = [
        f"| point | scope | width | {labels} | definition | TransformerLens | nnterp |",
        "| --- | --- | --- | " + ":---: | " * len(BACKENDS) + "--- | --- | --- |",
    ]

    def cell(v: BackendVerdict) -> str:
        text = v.verdict.symbol + " " + v.verdict.value
        return text + (f": {v.reason}" if v.reason else "")

    for p in _POINTS:
        tl = ", ".join(f"`{n}`" for n in p.tl_legacy + tuple(x for x in p.tl_bridge if x not in p.tl_legacy)) or "—"
        nn = ", ".join(f"`{n}`" for n in p.nnterp) or "—"
        definition = p.definition + (f" *{p.note}*" if p.note else "")
        rows.append(
            f"| `{p.name}` | {p.scope.value} | `{p.width.value}` | {' | '.join(cell(p.verdict(b)) for b in BACKENDS)} | "
            f"{definition} | {tl} | {nn} |"
        )
    return "\n".join(rows) + "\n"
