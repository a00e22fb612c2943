"""attention(): scores, probabilities and values per layer and head, with the token strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..address import layer_list
from ..core.inputs import prepare
from ..core.results import AttentionResult
from ..errors import CapabilityUnsupported
from .capture import capture, capture_batch
from .model import lm_of


def attention(model: Any, prompt: Any, layers: Sequence[int] | None = None) -> AttentionResult:
    """Attention matrices for one prompt; on fused kernels (sdpa) they are rebuilt from the kernel's q and k."""
    lm = lm_of(model)
    layers = layer_list(layers, lm.facts)
    ids, _ = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise CapabilityUnsupported("attention() on a batch", "the viewer shows one prompt.", "call it per prompt.")
    # One forward: scores with probs wherever the family exposes them (its attention goes through the tap, or its
    # module's own attention step was measured: GPT-J, CodeGen).
    lbs = lm.binding.layers
    with_scores = [L for L in layers if lbs[L].uses_attention_interface or lbs[L].scores_divisor is not None]
    c = capture_batch(  # one [1, seq] tensor: one Cache, as capture() returns for it
        lm,
        ids,
        [f"attn_probs.{L}" for L in layers]
        + [f"value.{L}" for L in layers]
        + [f"attn_scores.{L}" for L in with_scores],
    )
    notes: list[str] = []
    scores: dict[int, torch.Tensor | None] = {L: c[f"attn_scores.{L}"][0] for L in with_scores}
    missing = [L for L in layers if L not in scores]
    if missing:
        try:
            capture(lm, c.tokens, [f"attn_scores.{missing[0]}"])
        except CapabilityUnsupported as e:
            notes.append(f"scores unavailable: {e.why}")
        for L in missing:
            scores[L] = None
    kv, d = lm.facts.n_kv_heads, lm.facts.head_dim
    assert c.str_tokens is not None  # a captured Cache always carries its token strings
    return AttentionResult(
        layers,
        c.str_tokens[0],
        {L: c[f"attn_probs.{L}"][0] for L in layers},
        scores,
        {L: c[f"value.{L}"][0].reshape(-1, kv, d) for L in layers},
        notes,
    )
