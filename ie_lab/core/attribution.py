"""What logit_attribution returns: the pieces of one target logit (or logit difference), their repr and their plot.

Neutral: a plain container of tensors and strings, built the same way by any backend that computes it (and sent as
it is by a remote server, ie_lab/remote/wire.py RESULTS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import InputError, plural
from .plot_theme import themed

_HEAD = re.compile(r"^attn_result\.(\d+)\.head-(\d+)$")


@dataclass
class AttributionResult:
    """Direct logit attribution of one prompt: ``values[i, j]`` is what piece ``labels[i]`` adds to the target logit
    (difference) at ``positions[j]``, through the final norm frozen at the run's scale and the unembedding.

    Pieces, by ``by``: "embed" (resid_pre.0: the token embeddings, with the positional ones and any scaling, as layer
    0 reads them), then per layer "layer.L" (by="layer": all the layer adds), or each sublayer's output as it is
    added ("attn_out_post.L", "mixer_out_post.L", "mlp_out_post.L"; by="point"), or each head ("attn_result.L.head-H",
    and "attn_bias.L" for the output projection's bias; by="head"), then "final_norm.bias" and "lm_head.bias" where
    the model has them. Every column sums to ``logit``, the model's own value (``total`` is that sum)."""

    labels: list[str]
    values: torch.Tensor  # [pieces, positions], float32
    positions: list[int]  # absolute positions in the prompt
    str_tokens: list[str]
    target_ids: list[int]  # one token, or a pair (the logit difference of the first over the second)
    target_tokens: list[str]
    by: str
    logit: torch.Tensor  # [positions]: the model's own logit (difference) there, which the pieces sum to
    note: str = ""
    # The model's final logits after a soft cap (Gemma 2): the pieces sum to `logit`, the value before the cap.
    capped: torch.Tensor | None = field(default=None, repr=False)

    @property
    def total(self) -> torch.Tensor:
        """[positions]: the sum of the pieces (equal to ``logit`` up to float rounding)."""
        return self.values.sum(0)

    @property
    def target(self) -> str:
        names = [f"logit[{t!r}]" for t in self.target_tokens]
        return " - ".join(names)

    def __getitem__(self, label: str) -> torch.Tensor:
        """The piece's values at each position, [positions]."""
        if label not in self.labels:
            raise InputError(f"no piece named {label!r}; the pieces are {', '.join(self.labels[:8])}, ...")
        return self.values[self.labels.index(label)]

    def _column(self, position: int | None) -> int:
        if position is None:
            return len(self.positions) - 1
        if position in self.positions:
            return self.positions.index(position)
        raise InputError(f"position {position} was not attributed; the attributed positions are {self.positions}.")

    def top(self, n: int = 10, position: int | None = None) -> list[tuple[str, float]]:
        """The n pieces of largest magnitude at `position` (the last attributed by default), largest first."""
        col = self.values[:, self._column(position)]
        order = col.abs().argsort(descending=True)[: max(0, int(n))]
        return [(self.labels[int(i)], float(col[int(i)])) for i in order]

    def __repr__(self) -> str:
        j = len(self.positions) - 1
        p = self.positions[j]
        what = "difference" if len(self.target_ids) == 2 else ""
        head = (
            f"LogitAttribution({self.target} at position {p} {self.str_tokens[p]!r}, by {self.by}: "
            f"{plural(len(self.labels), 'piece')} sum to {float(self.total[j]):.4f}; the model's logit {what}"
            f"{' ' if what else ''}is {float(self.logit[j]):.4f}" + (f"; {self.note}" if self.note else "") + ")"
        )
        shown = (
            list(zip(self.labels, self.values[:, j].tolist())) if len(self.labels) <= 16 else self.top(12, position=p)
        )
        width = max(len(label) for label, _ in shown)
        rows = [f"  {label.ljust(width)}  {v:+.4f}" for label, v in shown]
        if len(shown) < len(self.labels):
            rows.append(f"  ... {len(self.labels) - len(shown)} smaller pieces (.top(n), .labels, .values)")
        return "\n".join([head, *rows])

    def plot(self, position: int | None = None):
        """A bar per piece at `position` (the last attributed by default); by="head", a layer x head heatmap of the
        heads' pieces beside bars for the rest."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        j = self._column(position)
        p = self.positions[j]
        col = self.values[:, j].tolist()
        title = f"Direct logit attribution of {self.target} at {p}:{self.str_tokens[p]!r} (sum {sum(col):.3f})"
        heads = [(_HEAD.match(label), v) for label, v in zip(self.labels, col)]
        if self.by != "head" or not any(m for m, _ in heads):
            fig = go.Figure(go.Bar(x=self.labels, y=col, marker_color=["#d62728" if v < 0 else "#1f77b4" for v in col]))
            fig.update_layout(title=title, xaxis_title="piece", yaxis_title="logit contribution")
            return themed(fig)
        layers = sorted({int(m.group(1)) for m, _ in heads if m})
        n_heads = 1 + max(int(m.group(2)) for m, _ in heads if m)
        grid = torch.full((len(layers), n_heads), float("nan"))
        for m, v in heads:
            if m:
                grid[layers.index(int(m.group(1))), int(m.group(2))] = v
        rest = [(label, v) for (m, v), label in zip(heads, self.labels) if not m]
        fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], subplot_titles=("heads", "other pieces"))
        fig.add_trace(
            go.Heatmap(
                z=grid.numpy(),
                x=[f"head {h}" for h in range(n_heads)],
                y=[f"layer {L}" for L in layers],
                colorscale="RdBu",
                zmid=0,
                colorbar=dict(title="logit", x=0.55),
                hovertemplate="%{y}, %{x}: %{z:.4f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=[label for label, _ in rest],
                y=[v for _, v in rest],
                marker_color=["#d62728" if v < 0 else "#1f77b4" for _, v in rest],
                showlegend=False,
            ),
            row=1,
            col=2,
        )
        fig.update_layout(title=title)
        return themed(fig)
