"""Architecture facts from a config alone: plain arithmetic over config keys, no torch, no weights.

Enough to size memory, draw a block diagram, and range-check addresses for a model that was never
loaded. Keys differ between families, so each fact is read from a short vocabulary of spellings.
Structural facts that configs do not state (e.g. sandwich norms) come from the quirks table; on a
live model the binder measures them instead, and a test checks that both agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArchitectureUnsupported
from . import quirks


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
        # to_dict drops some attributes that are computed properties on the object
        for key in (
            "head_dim",
            "layer_types",
            "sliding_window",
            "num_hidden_layers",
            "layers_block_type",
            "logits_scaling",
        ):
            if key not in d and hasattr(config, key):
                try:
                    d[key] = getattr(config, key)
                except Exception:  # a property that needs other fields
                    pass
    else:
        raise TypeError(f"expected a transformers config or a dict, got {type(config).__name__}")
    for sub in _NESTED_CONFIGS:
        # DBRX states its KV heads, MLP width and experts in nested attention and FFN configs: they win over a
        # top-level default left stale beside them
        if isinstance(d.get(sub), Mapping):
            d.update({k: v for k, v in d[sub].items() if k in _NESTED_KEYS and v is not None})
    text = d.get("text_config")
    if isinstance(text, Mapping) and "model_type" in text:
        # Multimodal wrappers keep the language model's facts one level down.
        merged = dict(text)
        merged.setdefault("architectures", d.get("architectures"))
        return merged
    return d


# Sub-configs some families keep their attention and MLP facts in, and the keys read from them.
_NESTED_CONFIGS = ("attn_config", "ffn_config")
_NESTED_KEYS = ("kv_n_heads", "ffn_hidden_size", "moe_num_experts", "moe_top_k")


def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


# What a refusal of an unbound family offers instead (one sentence, shared by every such refusal).
UNBOUND_INSTEAD = (
    "ie_lab binds decoder-only transformer families (the tested ones are listed in docs/BINDER.md); "
    "meanwhile run the raw transformers model and read its modules with torch forward hooks "
    "(module.register_forward_hook)."
)

# Config keys that state a state-space (Mamba-style) mixer: their presence is the fact, whatever the family.
_SSM_KEYS = ("state_size", "ssm_state_size", "mamba_d_state", "mamba_d_ssm")


def unbound_structure(config: Any) -> tuple[str, str] | None:
    """(what, why) when the config alone shows blocks the binder does not bind yet; None otherwise.

    Read from config facts (SSM keys, block and layer type lists); model_type only where no key states it
    (quirks.RECURRENT_BLOCKS). Lets load refuse before any weights are read."""
    d = _as_dict(config)
    mt = d.get("model_type", "unknown")
    if d.get("is_encoder_decoder") or ("encoder_layers" in d and "decoder_layers" in d):
        # XForCausalLM of an encoder-decoder family (BART, Marian, Whisper, ...) clears is_encoder_decoder on its
        # config, but the config still sizes both stacks: the blocks are that family's decoder blocks.
        return (
            f"{mt} is the decoder stack of an encoder-decoder family",
            "its config sizes an encoder and a decoder (is_encoder_decoder, or encoder_layers and decoder_layers); "
            "those decoder blocks carry cross-attention and are not bound.",
        )
    # Hyper-connection trunks (hc_mult > 1) are bound: the binder measures their stream mixing (arch.binder).
    if mt in quirks.RECURRENT_BLOCKS:
        return f"{mt} has no attention layers", quirks.RECURRENT_BLOCKS[
            mt
        ] + ", and recurrent blocks are not bound yet."
    # State-space and hybrid trunks, and layer types naming other mixers (conv, recurrent, linear attention): the
    # binder binds those layers as mixer layers, or refuses naming what it measured.
    return None


def _state_space_only(d: Mapping[str, Any]) -> bool:
    """A config that states an SSM state size and no attention head count: every block is a state-space mixer
    (not num_heads: Mamba 2 counts its SSM heads there)."""
    return any(d.get(k) for k in _SSM_KEYS) and not _first(d, "num_attention_heads", "n_head")


# Words in a config's per-layer type that name a token mixer other than softmax attention.
_MIXER_WORDS = ("linear", "mamba", "conv", "recurrent", "ssm", "deltanet", "lightning")


def _mixer_kinds(d: Mapping[str, Any], n_layers: int) -> tuple[str, ...]:
    """Per layer, the config's name for a non-attention mixer ("" for an attention layer): read from the
    per-layer type lists configs state (the most specific first: layers_block_type, then layer_types, then a
    repeating block_types pattern)."""
    # a single-sublayer trunk's own names for its mixer blocks (Zamba's "hybrid": a mixer fed by a shared block)
    entry = quirks.SINGLE_SUBLAYER_BLOCKS.get(str(d.get("model_type")))
    mixer_types = {t for t, s in entry[1].items() if s == "mixer"} if entry else set()
    for key in ("layers_block_type", "layer_types", "block_types"):
        types = d.get(key)
        if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
            kinds = [str(types[i % len(types)]) for i in range(n_layers)]
            if key != "block_types" and len(types) < n_layers:
                continue
            return tuple(t if any(w in t.lower() for w in _MIXER_WORDS) or t in mixer_types else "" for t in kinds)
    return ("",) * n_layers


def _residual_factors(d: Mapping[str, Any], kinds: list[str]) -> tuple[tuple[float, float, float, float], ...]:
    """Per layer, the factors of a residual taken after each sublayer's input norm, where the config states them
    (MiniMax): resid_mid = a * input_norm(resid_pre) + b * attn_out and resid_post = c * pre_mlp_norm(resid_mid) +
    e * mlp_out, as (a, b, c, e); the attention pair by the layer's kind (linear_attn_* on linear-attention layers,
    full_attn_* on the others). () where the config states none; the binder measures the structure either way."""
    if "mlp_alpha_factor" not in d:
        return ()

    def f(key: str) -> float:
        v = d.get(key)
        return float(v) if isinstance(v, (int, float)) else 1.0  # the config class's default

    return tuple(
        (
            f(f"{'linear' if k == 'linear' else 'full'}_attn_alpha_factor"),
            f(f"{'linear' if k == 'linear' else 'full'}_attn_beta_factor"),
            f("mlp_alpha_factor"),
            f("mlp_beta_factor"),
        )
        for k in kinds
    )


def _block_sublayers(d: Mapping[str, Any], n_layers: int) -> tuple[str, ...]:
    """Per layer of a single-sublayer trunk, its one sublayer ("mixer" | "attention" | "mlp"), from the config's
    per-layer type list; () for every other family, or where the list does not name each layer's type."""
    entry = quirks.SINGLE_SUBLAYER_BLOCKS.get(str(d.get("model_type")))
    if entry is None:
        return ()
    key, names = entry
    types = d.get(key)
    if not isinstance(types, (list, tuple)) or len(types) < n_layers or any(t not in names for t in types[:n_layers]):
        return ()
    return tuple(names[t] for t in types[:n_layers])


def _moe_layers(d: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """Which layers route to experts, from whichever placement keys the config states: a per-layer list
    (mlp_layer_types), a dense prefix (first_k_dense_replace, num_dense_layers, moe_layer_start_index), a
    period (decoder_sparse_step, expert_layer_period/offset, moe_layer_interval), an end, or excluded layers."""
    kinds = d.get("mlp_layer_types")
    if isinstance(kinds, (list, tuple)) and len(kinds) >= n_layers and all(isinstance(t, str) for t in kinds):
        return tuple(i for i in range(n_layers) if kinds[i] in ("sparse", "moe", "hash_moe"))  # hash: DeepSeek-V4
    step = d.get("decoder_sparse_step") or 1
    only_mlp = set(d.get("mlp_only_layers") or ())
    first = d.get("first_k_dense_replace") or d.get("num_dense_layers") or d.get("moe_layer_start_index") or 0
    end = d.get("moe_layer_end_index")
    last = n_layers - 1 if not isinstance(end, int) or end < 0 else end
    period, offset = d.get("expert_layer_period") or d.get("moe_layer_interval") or 1, d.get("expert_layer_offset")
    return tuple(
        i
        for i in range(n_layers)
        if (i + 1) % step == 0
        and i not in only_mlp
        and first <= i <= last
        and (i - (offset if isinstance(offset, int) else first)) % period == 0
    )


@dataclass(frozen=True)
class ArchFacts:
    model_type: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_mlp: int
    vocab_size: int
    max_positions: int | None
    n_experts: int = 0
    experts_per_token: int = 0
    n_streams: int = 1
    # Latent attention (DeepSeek-V2/V3, MiniCPM 3): the compressed query and key/value latents' widths (0: none),
    # each head's position-free key width, and the value head width where it is not head_dim (0: head_dim)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    layer_kinds: tuple[str, ...] = ()  # per layer: "global" | "sliding" | "linear"
    mixer_kinds: tuple[str, ...] = ()  # per layer: the config's name for a non-attention mixer, "" on attention
    # per layer on single-sublayer trunks (quirks.SINGLE_SUBLAYER_BLOCKS): the block's one sublayer, "mixer" |
    # "attention" | "mlp"; empty where every block holds a token mixer and an MLP
    block_sublayers: tuple[str, ...] = ()
    # the mixer module every layer runs beside its attention (quirks.PARALLEL_MIXER), "" elsewhere
    parallel_mixer: str = ""
    sliding_window: int | None = None
    parallel_block: bool = False
    sandwich_norms: bool = False  # a norm on each sublayer's output before the residual add
    pre_norms: bool = True  # a norm on each sublayer's input
    gated_mlp: bool = True
    qk_norm: bool = False
    attn_gate: bool = False  # attention multiplies its output by a learned gate before o_proj
    moe_layers: tuple[int, ...] = ()
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    residual_multiplier: float | None = None
    # per layer (attn alpha, attn beta, mlp alpha, mlp beta) of a residual taken after each sublayer's input norm
    # (MiniMax; _residual_factors), () elsewhere
    residual_factors: tuple[tuple[float, float, float, float], ...] = ()
    embedding_multiplier: float | None = None
    logit_multiplier: float | None = None  # logits = lm_head(x) * m (Cohere's logit_scale)
    logit_divisor: float | None = None  # logits = lm_head(x) / m (Granite's logits_scaling)
    tie_word_embeddings: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def value_head_dim(self) -> int:
        """The width of one value head, and so of one head of z: wider than head_dim on latent attention."""
        return self.v_head_dim or self.head_dim

    @property
    def conv_free_mixers(self) -> bool:
        """This family's mixers carry no convolution, whatever their kind is called (quirks.CONV_FREE_MIXERS)."""
        return self.model_type in quirks.CONV_FREE_MIXERS

    def n_params_estimate(self) -> int:
        """Rough parameter count from dimensions (embeddings + attention + MLP + norms)."""
        attn = self.d_model * (self.q_width + 2 * self.kv_width) + self.q_width * self.d_model
        mlp_one = (3 if self.gated_mlp else 2) * self.d_model * self.d_mlp
        n_moe = len(self.moe_layers)
        mlp = (self.n_layers - n_moe) * mlp_one + n_moe * (self.n_experts * mlp_one + self.d_model * self.n_experts)
        emb = self.vocab_size * self.d_model * (1 if self.tie_word_embeddings else 2)
        return self.n_layers * attn + mlp + emb

    @classmethod
    def from_config(cls, config: Any) -> "ArchFacts":
        d = _as_dict(config)
        mt = d.get("model_type", "unknown")
        d_model = _first(d, "hidden_size", "n_embd", "d_model", "dim")
        n_layers = _first(d, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
        n_heads = _first(d, "num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads")
        ssm_only = _state_space_only(d)
        # a recurrence in every layer whose config states no head count (RWKV): no attention anywhere either
        headless = ssm_only or (n_heads is None and mt in quirks.RECURRENT_MIXERS)
        if headless:
            n_heads = 0  # no attention anywhere: the attention widths are all zero
        if d_model is None or n_layers is None or n_heads is None:
            found = unbound_structure(d)
            if found is not None:
                raise ArchitectureUnsupported(found[0], found[1], UNBOUND_INSTEAD)
            missing = [
                name
                for name, v in (
                    ("hidden size (hidden_size/n_embd/d_model)", d_model),
                    ("layer count (num_hidden_layers/n_layer/num_layers)", n_layers),
                    ("attention head count (num_attention_heads/n_head)", n_heads),
                )
                if v is None
            ]
            raise ArchitectureUnsupported(
                f"config of model_type {mt!r}",
                f"it states no {' and no '.join(missing)} under any spelling ie_lab reads, so ie_lab has never bound "
                "this family.",
                UNBOUND_INSTEAD,
            )
        head_dim = 0 if headless else _first(d, "head_dim", "attention_head_size") or d_model // n_heads
        if d.get("multi_query") and not d.get("new_decoder_architecture"):
            n_kv = 1
        else:
            n_kv = _first(d, "kv_n_heads", "num_key_value_heads", "num_kv_heads", "n_head_kv", default=n_heads)
        n_experts = _first(d, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0) or 0
        d_mlp = _first(d, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "dff")
        if isinstance(d_mlp, (list, tuple)):  # per-layer MLP widths (Gemma 3n): the widest sizes memory
            d_mlp = max(d_mlp)
        if d_mlp is None:
            d_mlp = 4 * d_model
        moe_d_mlp = _first(d, "moe_intermediate_size")
        moe_layers: tuple[int, ...] = ()
        sublayers = _block_sublayers(d, int(n_layers))
        if n_experts:
            moe_layers = _moe_layers(d, int(n_layers))
            if sublayers:  # a single-sublayer trunk routes on its MoE blocks only, named per layer
                key = quirks.SINGLE_SUBLAYER_BLOCKS[mt][0]
                moe_layers = tuple(i for i in range(int(n_layers)) if d[key][i] == "moe")
            if moe_d_mlp and not moe_layers:
                d_mlp = d_mlp
        window = _first(d, "sliding_window")
        layer_types = d.get("layer_types")
        kinds: list[str] = []
        for i in range(n_layers):
            if layer_types and i < len(layer_types):
                t = str(layer_types[i])
                kinds.append("sliding" if "sliding" in t else "linear" if "linear" in t else "global")
            elif window and d.get("use_sliding_window", True) and mt not in quirks.WINDOW_KEY_UNUSED:
                kinds.append("sliding")
            else:
                kinds.append("global")
        if not any(k == "sliding" for k in kinds):
            window = None
        parallel = bool(
            _first(d, "use_parallel_residual", "parallel_attn", "parallel_block", default=False)
            or mt in quirks.ALWAYS_PARALLEL
        )
        if mt in quirks.PARALLEL_SWITCH and d.get(quirks.PARALLEL_SWITCH[mt]):
            parallel = True
        structure = quirks.NORM_PLACEMENT.get(mt, "pre")
        qk = bool(_first(d, "use_qk_norm", "qk_layernorm", "qk_norm", default=False) or mt in quirks.ALWAYS_QK_NORM)
        return cls(
            model_type=mt,
            d_model=int(d_model),
            n_layers=int(n_layers),
            n_heads=int(n_heads),
            n_kv_heads=int(n_kv),
            head_dim=int(head_dim),
            d_mlp=int(moe_d_mlp if (n_experts and moe_d_mlp and len(moe_layers) == n_layers) else d_mlp),
            vocab_size=int(_first(d, "vocab_size", "n_vocab", default=0)),
            max_positions=_first(d, "max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len"),
            n_experts=int(n_experts),
            experts_per_token=int(
                _first(d, "num_experts_per_tok", "top_k", "moe_top_k", "moe_k", "moe_topk", default=0) or 0
            ),
            n_streams=int(_first(d, "hc_mult", "num_residual_streams", default=1) or 1),
            q_lora_rank=int(d.get("q_lora_rank") or 0),
            kv_lora_rank=int(d.get("kv_lora_rank") or 0),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim") or 0) if d.get("kv_lora_rank") else 0,
            v_head_dim=int(d.get("v_head_dim") or 0) if d.get("kv_lora_rank") else 0,
            layer_kinds=tuple(kinds),
            mixer_kinds=("state_space",) * int(n_layers)
            if ssm_only
            else (quirks.RECURRENT_MIXERS[mt],) * int(n_layers)
            if mt in quirks.RECURRENT_MIXERS
            else _mixer_kinds(d, int(n_layers)),
            block_sublayers=sublayers,
            parallel_mixer=quirks.PARALLEL_MIXER.get(mt, ""),
            sliding_window=window,
            parallel_block=parallel,
            sandwich_norms=structure in ("sandwich", "post"),
            pre_norms=structure in ("pre", "sandwich"),
            gated_mlp=mt not in quirks.UNGATED_MLP,
            qk_norm=qk,
            attn_gate=bool(
                _first(d, "attn_output_gate", "use_gated_attention", "gated_attention", "gating", default=False)
                or mt in quirks.ALWAYS_ATTN_GATE
            ),
            moe_layers=moe_layers,
            attn_logit_softcap=_first(d, "attn_logit_softcapping"),
            final_logit_softcap=_first(d, "final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"),
            residual_multiplier=_first(d, "residual_multiplier"),
            residual_factors=_residual_factors(d, kinds),
            embedding_multiplier=_first(d, "embedding_multiplier"),
            logit_multiplier=_first(d, "logit_scale", "lm_head_multiplier"),  # Cohere; Falcon-H1's logits = head * m
            logit_divisor=_first(d, "logits_scaling", "logits_mup_width_multiplier"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            raw=d,
        )
