"""What operations return: generation steps and results, lens tables, attention matrices, projection scores,
patching grids.

Neutral: plain containers of tensors and strings with their reprs and plots. Every backend builds the same types,
so code written against one backend's results runs on the other's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..errors import plural
from .cache import Cache
from .plot_theme import themed

# ---- generation ----------------------------------------------------------------------------------------


@dataclass
class GenStep:
    index: int
    token_id: int
    token: str
    logprob: float
    top_logprobs: dict[str, float]
    logits: torch.Tensor | None = field(default=None, repr=False)
    # With capture=: the rows of each captured point that this step's forward produced, at absolute positions
    # captured_positions (prompt + generated). Step 0 holds the prompt's rows; step i the row of token i - 1 (the
    # token fed in to choose this one); the last step also the row of its own token, read by one more cached
    # forward. Concatenating every step's rows along the position axis gives `cache` (attention matrices:
    # [batch, heads, new queries, keys so far], so pad their key axis to the full length first).
    captured: Cache | None = field(default=None, repr=False)
    captured_positions: range | None = field(default=None, repr=False)
    # On the last step only (when capture= was given): the whole cache, the same as generate(...).cache.
    cache: Cache | None = field(default=None, repr=False)
    # Which prompt of a list this step belongs to (0 for a single prompt). Positions and captures count over
    # that prompt's own tokens: padding never shows.
    prompt_index: int = 0

    def __repr__(self) -> str:
        cap = (
            f", captured positions {self.captured_positions.start}..{self.captured_positions.stop - 1}"
            if self.captured_positions is not None
            else ""
        )
        who = f"prompt {self.prompt_index}, " if self.prompt_index else ""
        return f"GenStep({who}{self.index}: {self.token!r}, logprob={self.logprob:.3f}{cap})"


@dataclass
class GenerationResult:
    prompt_ids: torch.Tensor
    ids: list[int]
    text: str
    steps: list[GenStep]
    stop_reason: str
    cache: Cache | None = None

    def __repr__(self) -> str:
        cap = f", captured {plural(len(self.cache), 'point')}" if self.cache is not None else ""
        return f"GenerationResult({plural(len(self.ids), 'token')}, stop={self.stop_reason}{cap}): {self.text!r}"

    def _repr_html_(self) -> str:
        import html

        toks = "".join(
            f"<span title='logprob {s.logprob:.2f}' style='border-bottom:1px dotted #888'>"
            f"{html.escape(s.token)}</span> "
            for s in self.steps
        )
        return f"<div><b>generated</b> ({plural(len(self.ids), 'token')}, stop: {self.stop_reason})<br>{toks}</div>"


# ---- logit lens -----------------------------------------------------------------------------------------


@dataclass
class LensResult:
    layers: list[int]
    point: str
    str_tokens: list[str]
    top_ids: torch.Tensor  # [layers, positions, k]
    top_probs: torch.Tensor  # [layers, positions, k]
    top_tokens: list[list[list[str]]]
    note: str
    logits: torch.Tensor | None = field(default=None, repr=False)  # [layers, positions, vocab] when kept

    def __repr__(self) -> str:
        width = max(8, max(len(t) for t in self.str_tokens[-6:]) + 1)
        pos = list(range(max(0, len(self.str_tokens) - 6), len(self.str_tokens)))
        head = "layer  " + "".join(self.str_tokens[p][: width - 1].ljust(width) for p in pos)
        rows = [f"LogitLens({self.point}, top-1 at the last {plural(len(pos), 'position')}; {self.note})", head]
        for i, L in enumerate(self.layers):
            cells = "".join(f"{self.top_tokens[i][p][0][: width - 1]}".ljust(width) for p in pos)
            rows.append(f"{L:>5}  {cells}")
        return "\n".join(rows)

    def plot(self):
        import plotly.graph_objects as go

        z = self.top_probs[:, :, 0].cpu().numpy()
        text = [[self.top_tokens[i][p][0] for p in range(len(self.str_tokens))] for i in range(len(self.layers))]
        fig = go.Figure(
            go.Heatmap(
                z=z,
                x=[f"{p}:{t}" for p, t in enumerate(self.str_tokens)],
                y=[f"{self.point}.{L}" for L in self.layers],
                text=text,
                texttemplate="%{text}",
                colorscale="Blues",
                zmin=0,
                zmax=1,
                colorbar=dict(title="p(top-1)"),
            )
        )
        fig.update_layout(
            title="Logit lens: top token per layer and position", xaxis_title="position", yaxis_title="layer"
        )
        return themed(fig)


def token_names(tok: Any, ids: list) -> list:
    """Decoded strings for a nested list of ids, decoding each distinct id once (lenses return many rows)."""
    flat: set[int] = set()

    def walk(x):
        for y in x:
            walk(y) if isinstance(y, list) else flat.add(int(y))

    walk(ids)
    names = {i: (tok.decode([i]) if tok is not None else str(i)) for i in flat}

    def build(x):
        return [build(y) if isinstance(y, list) else names[int(y)] for y in x]

    return build(ids)


# ---- attention ------------------------------------------------------------------------------------------


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
        return f"AttentionResult(layers={self.layers}, {plural(H, 'head')}, {plural(q, 'token')}{extra})"

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
        fig = go.Figure(
            go.Heatmap(
                z=self.probs[layer][head].cpu().numpy(),
                x=idx,
                y=idx,
                colorscale="Viridis",
                zmin=0,
                zmax=1,
                hovertemplate="query %{y}, key %{x}: %{z:.3f}<extra></extra>",
            )
        )
        ticks = dict(tickmode="array", tickvals=idx, ticktext=labels, tickfont=dict(size=11), showgrid=False)
        fig.update_layout(
            title=f"attn_probs.{layer}.head-{head}",
            autosize=False,
            width=side + margin + 140,
            height=side + margin + 100,
            margin=dict(l=margin + 20, b=margin + 20, t=60, r=100),
            xaxis=dict(title="key", tickangle=-90, constrain="domain", **ticks),
            yaxis=dict(title="query", autorange="reversed", scaleanchor="x", scaleratio=1, constrain="domain", **ticks),
        )
        return themed(fig)


# ---- projection -----------------------------------------------------------------------------------------


@dataclass
class Projection:
    """Scores of one prompt: ``scores`` [tokens, k] float32, one row per token the model read.

    With max_new_tokens > 0 the rows cover the prompt and every generated token but the last (which the model
    never reads); ``generated`` holds the generated ids and ``text`` their decoding."""

    address: Address
    scores: torch.Tensor
    tokens: torch.Tensor  # the ids the rows belong to, [tokens]
    str_tokens: list[str]
    generated: list[int] = field(default_factory=list)
    text: str = ""

    def top(self, n: int = 5) -> list[list[tuple[int, float]]]:
        """Per token: the n highest-scoring (feature, score) pairs."""
        n = min(int(n), self.scores.shape[-1])
        vals, idx = self.scores.topk(n, dim=-1)
        return [[(int(i), float(v)) for i, v in zip(ri, rv)] for ri, rv in zip(idx, vals)]

    def __repr__(self) -> str:
        gen = f", {len(self.generated)} generated" if self.generated else ""
        return f"Projection({self.address}: scores {list(self.scores.shape)}{gen})"


# ---- patching -------------------------------------------------------------------------------------------


@dataclass
class PatchGrid:
    values: torch.Tensor  # [rows, cols]
    rows: list[str]
    cols: list[str]
    clean: float
    corrupted: float
    metric: str

    def __repr__(self) -> str:
        return (
            f"PatchGrid({self.metric}: {len(self.rows)} x {len(self.cols)}; clean {self.clean:.3f}, corrupted "
            f"{self.corrupted:.3f}, best {float(self.values.max()):.3f} at "
            f"{self.rows[int(self.values.argmax()) // len(self.cols)]} / "
            f"{self.cols[int(self.values.argmax()) % len(self.cols)]})"
        )

    def plot(self):
        import plotly.graph_objects as go

        fig = go.Figure(
            go.Heatmap(
                z=self.values.cpu().numpy(),
                x=self.cols,
                y=self.rows,
                colorscale="RdBu",
                zmid=self.corrupted,
                colorbar=dict(title=self.metric),
            )
        )
        fig.update_layout(
            title=f"Activation patching ({self.metric}); clean={self.clean:.2f}, corrupted={self.corrupted:.2f}"
        )
        return themed(fig)
