"""Rebuilding attention matrices from the post-RoPE q and k a kernel received.

Shared by the eager backend (models running sdpa or another fused kernel) and the vLLM worker.
Plain tensor arithmetic: no hooks, no model.
"""

from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[b, KV, s, d] -> [b, H, s, d] by repeating each key/value head over its query group."""
    kv = x.shape[1]
    if kv == n_heads:
        return x
    if n_heads % kv:
        raise ValueError(f"{n_heads} query heads cannot be grouped over {kv} key/value heads")
    return x.repeat_interleave(n_heads // kv, dim=1)


def allowed_mask(
    q_len: int,
    k_len: int,
    attention_mask: torch.Tensor | None,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Boolean [b or 1, 1, q, k] of which keys each query may see.

    With no mask the kernel ran causally (queries are the last q_len of k_len positions), narrowed to
    a sliding window when one is given. A boolean mask is used as is; an additive float mask allows
    the entries that are not (close to) the dtype's minimum.
    """
    if attention_mask is None:
        qpos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        kpos = torch.arange(k_len, device=device)[None, :]
        ok = kpos <= qpos
        if sliding_window:
            ok &= kpos > qpos - sliding_window
        return ok[None, None]
    m = attention_mask[..., -q_len:, -k_len:] if attention_mask.dim() == 4 else attention_mask
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


def scores_and_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-softmax scores (masked entries -inf) and probabilities, both [b, H, q, k], in float32.

    softcap: logits become softcap * tanh(logits / softcap) before masking (Gemma 2 style).
    sinks: per-head extra logit that joins the softmax but attends to nothing, so rows sum below 1.
    """
    q = query.float()
    k = repeat_kv(key.float(), q.shape[1])
    scores = (q @ k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dim() == 4:
        # An additive mask may carry biases besides the -inf pattern; keep them where allowed.
        add = attention_mask[..., -q.shape[2] :, -k.shape[2] :].float()
        ok = add > torch.finfo(attention_mask.dtype).min / 2
        scores = scores + torch.where(ok, add, torch.zeros_like(add))
    else:
        ok = allowed_mask(q.shape[2], k.shape[2], attention_mask, sliding_window, q.device)
    scores = scores.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        joint = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(joint, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    # A fully masked row (padding queries) gives NaN; those rows attend to nothing.
    probs = torch.nan_to_num(probs, nan=0.0)
    return scores, probs


def divided_scores(
    query: torch.Tensor, key: torch.Tensor, divisor: float, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Pre-softmax scores as a module that divides q·kᵀ by its own divisor in float32 computes them (GPT-J's and
    CodeGen's attention step), masked entries -inf: [b, H, q, k] in float32.

    Divided rather than multiplied by the reciprocal, as those modules do, so the allowed entries are bit for bit
    theirs (their additive mask is zero there, whether added before or after the division)."""
    q = query.float()
    k = repeat_kv(key.float(), q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)) / divisor
    ok = allowed_mask(q.shape[2], k.shape[2], attention_mask, device=q.device)
    return scores.masked_fill(~ok, float("-inf"))
