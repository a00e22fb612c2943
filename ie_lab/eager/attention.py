"""attention(): scores, probabilities and values per layer and head, with the token strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..address import layer_list
from ..errors import CapabilityUnsupported
from .capture import capture
from .inputs import prepare
from .model import lm_of


@dataclass
class AttentionResult:
    layers: list[int]
    str_tokens: list[str]
    probs: dict[int, torch.Tensor]  # [heads, query, key]
    scores: dict[int, torch.Tensor | None]  # None where the family never exposes pre-softmax scores
    value: dict[int, torch.Tensor]  # [seq, n_kv_heads, head_dim]
    notes: list[str]

    def __getitem__(self, layer: int) -> dict[str, torch.Tensor | None]:
        return {"probs": self.probs[layer], "scores": self.scores[layer], "value": self.value[layer]}

    def __repr__(self) -> str:
        H, q, k = next(iter(self.probs.values())).shape
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return f"AttentionResult(layers={self.layers}, {H} heads, {q} tokens{extra})"

    def plot(self, layer: int, head: int):
        import plotly.graph_objects as go

        labels = [f"{i}:{t}" for i, t in enumerate(self.str_tokens)]
        n = len(labels)
        idx = list(range(n))
        # Square cells sized to the prompt, never below a readable row height, and a tick for every token:
        # left to itself plotly stretches the matrix over the output's width and drops every other label.
        cell = max(14, min(28, 640 // max(n, 1)))
        side = cell * n
        margin = 12 + 7 * max((len(t) for t in labels), default=4)  # room for the longest label
        fig = go.Figure(go.Heatmap(z=self.probs[layer][head].cpu().numpy(), x=idx, y=idx, colorscale="Viridis",
                                   zmin=0, zmax=1, hovertemplate="query %{y}, key %{x}: %{z:.3f}<extra></extra>"))
        ticks = dict(tickmode="array", tickvals=idx, ticktext=labels, tickfont=dict(size=11), showgrid=False)
        fig.update_layout(title=f"attn_probs.{layer}.head-{head}", autosize=False,
                          width=side + margin + 140, height=side + margin + 100,
                          margin=dict(l=margin + 20, b=margin + 20, t=60, r=100),
                          xaxis=dict(title="key", tickangle=-90, constrain="domain", **ticks),
                          yaxis=dict(title="query", autorange="reversed", scaleanchor="x", scaleratio=1,
                                     constrain="domain", **ticks))
        return fig


def attention(model: Any, prompt: Any, layers: Sequence[int] | None = None) -> AttentionResult:
    """Attention matrices for one prompt; on fused kernels (sdpa) they are rebuilt from the kernel's q and k."""

    lm = lm_of(model)
    layers = layer_list(layers, lm.facts)
    ids, _ = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise CapabilityUnsupported("attention() on a batch", "the viewer shows one prompt.", "call it per prompt.")
    # One forward: scores with probs wherever the family exposes them (its attention goes through the tap).
    with_scores = [L for L in layers if lm.binding.layers[L].uses_attention_interface]
    c = capture(lm, ids, [f"attn_probs.{L}" for L in layers] + [f"value.{L}" for L in layers]
                + [f"attn_scores.{L}" for L in with_scores])
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
    return AttentionResult(
        layers, c.str_tokens[0], {L: c[f"attn_probs.{L}"][0] for L in layers}, scores,
        {L: c[f"value.{L}"][0].reshape(-1, kv, d) for L in layers}, notes)
