"""Read-out arithmetic of the lenses: the family's logit post-processing (the vLLM backend describes it from here too)."""

from __future__ import annotations

from typing import Any

import torch


def postprocess_logits(facts: Any, raw: torch.Tensor) -> torch.Tensor:
    """What the family does to the unembedding's output before it is the model's logits."""
    out = raw
    if facts.logit_multiplier is not None:
        out = out * facts.logit_multiplier
    if facts.logit_divisor is not None:
        out = out / facts.logit_divisor
    if facts.final_logit_softcap:
        out = torch.tanh(out / facts.final_logit_softcap) * facts.final_logit_softcap
    return out


def describe_postprocess(facts: Any) -> str:
    steps = []
    if facts.logit_multiplier is not None:
        steps.append(f"multiplied by {facts.logit_multiplier} (logit_scale)")
    if facts.logit_divisor is not None:
        steps.append(f"divided by {facts.logit_divisor} (logits_scaling)")
    if facts.final_logit_softcap:
        steps.append(f"soft-capped at {facts.final_logit_softcap} (tanh)")
    if not steps:
        return "final norm, then the unembedding; no further post-processing on this family"
    return "final norm, then the unembedding, then " + ", then ".join(steps) + " — as the model itself does"


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and probabilities per row of [..., vocab] logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    vals, idx = probs.topk(k, dim=-1)
    return idx, vals
