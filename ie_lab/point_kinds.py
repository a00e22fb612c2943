"""The words points are described in: scope, width, what a model must have (Needs) and a backend's verdict.

Plain enums and one record, no torch and no ie_lab imports, so the point registry (ie_lab/points.py), the
structure a model has of the needs (ie_lab/point_structure.py) and each backend's own verdict table
(ie_lab/eager/verdicts.py, ie_lab/vllm/verdicts.py) all read them without reading one another.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    # one d_model vector per head and token, [batch, seq, n_heads, d_model]: each head's write through the output
    # projection (attn_result)
    HEADS_D_MODEL = "n_heads*d_model"

    @property
    def head_axis(self) -> bool:
        """Points whose width splits into heads, so that a head coordinate selects a slice."""
        return self in (Width.HEADS, Width.KV_HEADS, Width.ATTN, Width.K_NOPE, Width.HEADS_D_MODEL)


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


@dataclass(frozen=True)
class BackendVerdict:
    """One backend's word on one point: what it does with it, and (where that is not plain "served") why or how.
    Each backend declares its own, in its own package's verdicts.py."""

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
    # an attention output projection that reads the heads' outputs as the kernel left them, so a slice of its weight
    # is one head's write (not BitNet's norm across heads, DeepSeek-V4's rotated, grouped low-rank projection)
    HEADS_PROJECTED = "an output projection that reads each head's output"
