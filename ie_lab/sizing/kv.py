"""What one sequence keeps between decode steps, layer by layer, from the config alone.

Four kinds of layer, four rules:
- full attention: K and V for every token (n_kv_heads x (head_dim + value head_dim) values per token);
- sliding-window attention: the same, bounded by the window (transformers keeps window - 1 past tokens: the new
  token attends to itself and those);
- latent attention (MLA: DeepSeek-V2/V3, MiniCPM 3, Kimi K2): the compressed latent and the shared rotary key,
  kv_lora_rank + qk_rope_head_dim values per token, not K and V per head (vLLM and transformers both cache that);
- linear attention and state-space mixers (Mamba, Mamba 2, Gated DeltaNet, Kimi Delta Attention, LFM2's short
  convolutions): a convolution window and a recurrent state of fixed size per sequence, whatever its length.
Hybrids mix them per layer. tests/test_sizing.py checks every rule against the cache transformers allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arch.config_facts import ArchFacts


def _first(d: dict[str, Any], *keys: str) -> Any:
    return next((d[k] for k in keys if d.get(k) is not None), None)


@dataclass(frozen=True)
class LayerCache:
    kind: str  # "attention" | "sliding" | "latent" | "state"
    per_token: int = 0  # values cached per token
    window: int | None = None  # tokens kept at most (sliding)
    state: int = 0  # values kept per sequence whatever its length (state-space and linear-attention mixers)

    def values(self, tokens: int) -> int:
        kept = tokens if self.window is None else min(tokens, self.window)
        return self.per_token * kept + self.state


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerCache, ...]
    notes: tuple[str, ...] = ()
    latent: bool = False  # latent attention: every tensor-parallel rank holds the whole latent

    def values(self, tokens: int) -> int:
        """Values one sequence of `tokens` tokens keeps in the cache (multiply by the cache dtype's bytes)."""
        return sum(layer.values(tokens) for layer in self.layers)

    @property
    def per_token(self) -> int:
        """Values each further token adds once every sliding window is full (full-attention layers only)."""
        return sum(layer.per_token for layer in self.layers if layer.window is None)

    @property
    def state(self) -> int:
        return sum(layer.state for layer in self.layers)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + 1
        return out


# Spellings of the state-space mixer sizes across families (Mamba, Jamba, Falcon-H1, Zamba 2, Bamba, Nemotron-H,
# GraniteMoE-hybrid): read here rather than in ArchFacts, whose facts describe the residual stream, not the cache.
_SSM_HEADS = ("mamba_n_heads", "n_mamba_heads", "mamba_num_heads")
_SSM_HEAD_DIM = ("mamba_d_head", "mamba_headdim", "mamba_head_dim")
_SSM_GROUPS = ("mamba_n_groups", "mamba_ngroups", "n_groups")
_SSM_STATE = ("mamba_d_state", "ssm_state_size", "state_size")
_SSM_CONV = ("mamba_d_conv", "conv_kernel", "d_conv")
_SSM_EXPAND = ("mamba_expand", "expand")


def _state_values(d: dict[str, Any], facts: ArchFacts) -> int | None:
    """Values one state-space or linear-attention layer keeps per sequence; None for a mixer not sized here."""
    if d.get("linear_num_value_heads"):  # Gated DeltaNet (Qwen3-Next, Qwen3.5): conv over q, k, v and an S matrix
        nk, nv = d["linear_num_key_heads"], d["linear_num_value_heads"]
        dk, dv = d["linear_key_head_dim"], d["linear_value_head_dim"]
        kernel = d.get("linear_conv_kernel_dim") or 4
        return (2 * nk * dk + nv * dv) * kernel + nv * dk * dv
    if d.get("linear_num_heads") and d.get("linear_head_dim"):  # Kimi Delta Attention: conv over q, k, v; S per head
        heads, hd = d["linear_num_heads"], d["linear_head_dim"]
        return 3 * heads * hd * (d.get("linear_conv_kernel_dim") or 4) + heads * hd * hd
    if d.get("conv_L_cache"):  # LFM2's short convolutions: the last conv_L_cache inputs, d_model wide
        return facts.d_model * int(d["conv_L_cache"])
    n_state = _first(d, *_SSM_STATE)
    kernel = _first(d, *_SSM_CONV)
    if not n_state or not kernel:
        return None
    heads = _first(d, *_SSM_HEADS)
    head_dim = _first(d, *_SSM_HEAD_DIM)
    if facts.model_type == "mamba2":  # Mamba 2 alone spells its SSM heads as the attention keys
        heads, head_dim = d.get("num_heads"), d.get("head_dim")
    if heads and head_dim:  # Mamba 2: conv over x, B and C; a [heads, head_dim, state] SSM state
        inner = d.get("mamba_d_ssm") or heads * head_dim
        groups = _first(d, *_SSM_GROUPS) or 1
        return (inner + 2 * groups * n_state) * kernel + heads * head_dim * n_state
    # Mamba: conv over the inner width, a [inner, state] SSM state
    inner = d.get("mamba_d_inner") or (
        d.get("intermediate_size") if facts.model_type in ("mamba", "falcon_mamba") else None
    )
    if not inner:
        expand = _first(d, *_SSM_EXPAND) or 2
        inner = int(expand * facts.d_model)
    return inner * kernel + inner * n_state


def cache_layout(d: dict[str, Any], facts: ArchFacts) -> CacheLayout:
    notes: list[str] = []
    latent = bool(facts.kv_lora_rank)
    rope = int(d.get("qk_rope_head_dim") or 0)
    if latent:
        attn_per_token = facts.kv_lora_rank + rope
    else:
        attn_per_token = facts.n_kv_heads * (facts.head_dim + facts.value_head_dim)
    state = None
    layers: list[LayerCache] = []
    unsized = set()
    for i in range(facts.n_layers):
        mixer = facts.mixer_kinds[i] if i < len(facts.mixer_kinds) else ""
        sub = facts.block_sublayers[i] if i < len(facts.block_sublayers) else ""
        # attention here: an attention layer (not an MLP-only or mixer-only block of a single-sublayer trunk), or a
        # hybrid block (Zamba's mixer fed by the shared attention block)
        has_attn = facts.n_heads > 0 and (mixer == "" or mixer == "hybrid") and sub in ("", "attention", "mixer")
        has_state = bool(mixer) or bool(facts.parallel_mixer)
        if sub == "mlp":
            has_attn = has_state = False
        if sub == "attention":
            has_state = False
        if has_attn:
            sliding = facts.layer_kinds[i] == "sliding" and facts.sliding_window
            window = max(1, int(facts.sliding_window) - 1) if sliding and facts.sliding_window else None
            kind = "latent" if latent else "sliding" if sliding else "attention"
            layers.append(LayerCache(kind, attn_per_token, window))
        if has_state:
            if state is None:
                state = _state_values(d, facts)
            if state is None:
                unsized.add(mixer or facts.parallel_mixer)
                continue
            layers.append(LayerCache("state", state=state))
    if unsized:
        notes.append(
            f"the state of {', '.join(sorted(unsized))} layers is not sized (a mixer the sizer has no rule for): "
            "it is fixed per sequence, so the per-token figure stands"
        )
    return CacheLayout(tuple(layers), tuple(notes), latent)
