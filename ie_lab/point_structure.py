"""What a model has of the features points need (``Needs``), and why a point is absent without one.

A Structure is learnt from a config (``from_facts``), measured on a loaded model by the binder (``from_binding``),
or reported by vLLM; ``absence_of`` turns a missing need into the two sentences of a PointAbsent (why, instead),
in the same words for every backend, the picker and the points table. ie_lab/points.py re-exports all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .arch import quirks
from .point_kinds import Needs


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
    # The attention output projection reads each head's output as the kernel left it (a slice of its weight is that
    # head's write): not behind a norm across heads or a grouped low-rank projection (arch.quirks)
    heads_projected: bool = True

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
                if k and k not in _NO_CONV_STATE and not getattr(facts, "conv_free_mixers", False)
            )
            or parallel,
            heads_projected=facts.model_type not in quirks.HEADS_MIXED_BEFORE_PROJECTION,
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
            heads_projected=not any(
                lb.z_at_kernel for lb in binding.layers if not lb.mixer_kind and not getattr(lb, "mlp_only", False)
            ),
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
            Needs.HEADS_PROJECTED: self.heads_projected,
        }[need]


# Config layer kinds known to carry no such state: a short convolution (LFM2) has no recurrent state, an mLSTM
# (xLSTM) no convolution.
_NO_RECURRENT_STATE = frozenset({"conv"})
_NO_CONV_STATE = frozenset({"mlstm"})


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
    Needs.HEADS_PROJECTED: (
        "this family's attention output projection does not read the heads' outputs as the kernel left them (a norm "
        "across heads, or a rotation and a low-rank projection of groups of heads, sits between them), so no slice "
        "of its weight is one head's write.",
        "capture z.{L} (the heads' outputs) and attn_out.{L} (their projection).",
    ),
    Needs.TOKEN_MIXER: (
        "layer {L} is an MLP-only block ({kind}: a single-sublayer block with no attention or mixer, whose output "
        "is added straight to the residual stream), so it has no {name} (layer kinds: {kinds}; every other layer "
        "is attention).",
        "capture mlp_in.{L} / mlp_out.{L} there, or resid_pre.{L} / resid_post.{L}.",
    ),
}


def absence_of(name: str, needs: tuple[Needs, ...], structure: Structure, layer: int | None = None) -> Absence | None:
    """Why the point ``name``, which exists only with ``needs``, is absent at ``layer`` on a model of this structure,
    or None where it exists (points.absence looks the point up by name and asks here)."""
    for need in needs:
        if not structure.has(need, layer):
            why, instead = _ABSENT[need]
            if need in (Needs.ATTENTION, Needs.MIXER) and layer in structure.mlp_only_layers:
                why, instead = _ABSENT[Needs.TOKEN_MIXER]  # no token mixer at all: say the block's kind
            elif need is Needs.MLP and structure.layer_kind(layer or 0) == "attention":
                why, instead = _ATTENTION_ONLY
            elif need in (Needs.ATTENTION, Needs.MLP) and structure.layer_kind(layer or 0) in SHARED_BLOCK_KINDS:
                why, instead = _SHARED_BLOCK
            fill = dict(L=layer, name=name, moe=list(structure.moe_layers) or "none", n_streams=structure.n_streams)
            fill.update(sub="mlp" if name.startswith("mlp") else "attn")
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
