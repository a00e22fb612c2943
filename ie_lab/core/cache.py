"""Cache: what a capture returns, a mapping keyed by Address that also accepts the string form."""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..address import Address, AddressLike
from ..errors import AddressError, did_you_mean, plural


def _size(n_bytes: int) -> str:
    size = float(n_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""  # pragma: no cover


class Cache(Mapping[Address, torch.Tensor]):
    """Captured tensors keyed by Address: per-token points [batch, seq, width], attention [batch, heads, q, k].

    features: a spliced SAE's feature activations [batch, seq, d_sae], keyed by their own name `sae.<name>.acts`
    (not an Address: ie_lab/core/splice_spec.py); cache["sae.<name>.acts"] reads them, iterating gives Addresses."""

    def __init__(
        self,
        tensors: dict[Address, torch.Tensor],
        tokens: torch.Tensor | None = None,
        str_tokens: list[list[str]] | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        features: dict[str, torch.Tensor] | None = None,
    ):
        self._t = dict(tensors)
        self.features = dict(features or {})
        self.tokens = tokens
        self.str_tokens = str_tokens
        self.attention_mask = attention_mask

    def _key(self, key: AddressLike) -> Address:
        if isinstance(key, str) and key.strip().startswith("sae."):  # a spliced SAE's features, not captured here
            have = [*map(str, self._t), *self.features]
            raise AddressError(
                f"{key.strip()!r} was not captured.{did_you_mean(key.strip(), have)} This cache holds: "
                f"{', '.join(have) or 'nothing'}. Capture it during a spliced run (docs/SAE.md, Splicing)."
            )
        addr = Address.parse(key)
        if addr not in self._t:
            have = [str(a) for a in self._t]
            raise AddressError(
                f"{str(addr)!r} was not captured.{did_you_mean(str(addr), have)} This cache holds: {', '.join(have) or 'nothing'}."
            )
        return addr

    def __getitem__(self, key: AddressLike) -> torch.Tensor:
        if isinstance(key, str) and key.strip() in self.features:
            return self.features[key.strip()]
        return self._t[self._key(key)]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key.strip() in self.features:
            return True
        try:
            return Address.parse(key) in self._t  # type: ignore[arg-type]
        except Exception:
            return False

    def __iter__(self) -> Iterator[Address]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self._t.values(), *self.features.values()])

    def to(self, device: Any) -> "Cache":
        return Cache(
            {a: t.to(device) for a, t in self._t.items()},
            self.tokens,
            self.str_tokens,
            self.attention_mask,
            features={n: t.to(device) for n, t in self.features.items()},
        )

    def norms(self) -> dict[str, float]:
        """Mean L2 norm over tokens of each per-token point (attention matrices are skipped)."""
        return {str(a): float(t.float().norm(dim=-1).mean()) for a, t in self._t.items() if not a.point.is_attention}

    def plot(self):
        """Activation norms per captured point (in capture order): a plotly bar chart."""
        import plotly.graph_objects as go

        n = self.norms()
        fig = go.Figure(go.Bar(x=list(n), y=list(n.values())))
        fig.update_layout(title="mean activation norm per point", xaxis_title="address", yaxis_title="mean ‖x‖")
        from .plot_theme import themed

        return themed(fig)

    def _rows(self) -> list[tuple[str, str, str, str]]:
        return [
            (
                str(a),
                "[" + ", ".join(str(s) for s in t.shape) + "]",
                str(t.dtype).replace("torch.", ""),
                _size(t.numel() * t.element_size()),
            )
            for a, t in [*self._t.items(), *self.features.items()]
        ]

    def __repr__(self) -> str:
        rows = self._rows()
        head = f"Cache({plural(len(rows), 'tensor')}, {_size(self.nbytes())})"
        if not rows:
            return head
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  " + "  ".join(r[i].ljust(w[i]) for i in range(4)).rstrip() for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            "<tr>" + "".join(f"<td><code>{html.escape(c)}</code></td>" for c in r) + "</tr>" for r in self._rows()
        )
        return (
            f"<div><b>Cache</b> — {len(self)} tensors, {_size(self.nbytes())}"
            "<table><thead><tr><th>address</th><th>shape</th><th>dtype</th><th>size</th></tr></thead>"
            f"<tbody>{body}</tbody></table></div>"
        )
