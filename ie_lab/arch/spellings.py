"""Where the binder looks: the attribute spellings that nominate a module for each structural role.

Names only nominate candidates (arch.nominate); what each module is, the probe forward decides (arch.binder and the
arch.measure_* modules). A family that spells a role otherwise is bound by adding the spelling here; the probe then
checks it like every other.
"""

from __future__ import annotations

from torch import nn

from .binding import LayerBinding

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
# down projection's output times the activated gate (measure_mlp_out_gate), or the layer is refused as before.
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


def child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for n in names:
        m = getattr(module, n, None)
        if isinstance(m, nn.Module):
            return n, m
    return None


def reads_shared_kv(attn: nn.Module) -> bool:
    """An attention module with a query projection but no key or value projection of any kind: a candidate for
    reading another layer's keys and values (KV sharing); the probe decides (measure_kv_sources)."""
    return (
        child(attn, Q_NAMES) is not None
        and child(attn, K_NAMES) is None
        and child(attn, V_NAMES) is None
        and child(attn, FUSED_QKV_NAMES) is None
        and child(attn, K_NORM_NAMES) is None
    )


def is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower()


def norm_children(lb: LayerBinding) -> list[nn.Module]:
    """The norms on the layer, and on the wrapper around its attention where it has one (measured like the rest)."""
    hosts = (lb.layer,) if lb.wrapper is None else (lb.layer, lb.wrapper)
    return [m for h in hosts for _, m in h.named_children() if is_norm(m)]


def name_in(parent: nn.Module | None, child: nn.Module | None) -> str:
    return next((n for n, m in parent.named_children() if m is child), "?") if parent is not None else "?"
