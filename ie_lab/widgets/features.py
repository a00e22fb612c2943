"""The feature panel: ``session.feature_panel(prompt, address, sae_or_directions, top=16)``.

One prompt's tokens coloured by the selected feature's activation (an SAE's features or a matrix of probe
directions), a picker of the features most active over the prompt, and, per token, its strongest features. The
scores are one ``session.project`` call (computed where the activation is: the eager hook, the vLLM worker, a
remote server), so the panel works on every backend and only [tokens, features] numbers reach the kernel. They stay
in the kernel: the front end gets the selected feature's column and the per-token top lists, as binary buffers
(float32 / int32, as the attention viewer sends patterns), never the whole matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import traitlets

from ..errors import InputError, plural
from . import _base, _static

MAX_TOP = 64  # features listed in the picker
MAX_HOVER = 16  # features listed per token on hover
MAX_TOKENS = 2048  # tokens drawn (each a coloured span)


def _count(name: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise InputError(
            f"{name}={value!r}: an int from 1 to {limit} (the panel lists at most {limit}); for more, read "
            f"s.project(...).top(n) in the kernel."
        )
    return value


def _f32(t: torch.Tensor) -> bytes:
    return t.detach().float().contiguous().numpy().astype("<f4").tobytes()


def _i32(t: torch.Tensor) -> bytes:
    return t.detach().to(torch.int32).contiguous().numpy().astype("<i4").tobytes()


class FeaturePanel(_base.Panel):
    """Tokens coloured by one feature's activation; a picker of the prompt's top features; hover: a token's top."""

    _esm = _static.bundle("features.js")
    COMMANDS = {"select": {"feature": _base.integer(0, (1 << 31) - 1)}}

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    n_features = traitlets.Int(0).tag(sync=True)
    feature = traitlets.Int(0).tag(sync=True)
    values = traitlets.Bytes(b"").tag(sync=True)  # float32 [tokens]: the selected feature's scores
    top_ids = traitlets.Bytes(b"").tag(sync=True)  # int32 [top]: the features with the highest max over the prompt
    top_max = traitlets.Bytes(b"").tag(sync=True)  # float32 [top]: their maxima
    hover = traitlets.Int(0).tag(sync=True)
    tok_ids = traitlets.Bytes(b"").tag(sync=True)  # int32 [tokens, hover]: each token's strongest features
    tok_vals = traitlets.Bytes(b"").tag(sync=True)  # float32 [tokens, hover]
    scale = traitlets.Float(0.0).tag(sync=True)  # the colour scale's top: the largest |score| over the panel's top
    title = traitlets.Unicode("").tag(sync=True)
    address = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        scores: torch.Tensor,
        tokens: list[str],
        *,
        address: str = "",
        top: int = 16,
        hover: int = 5,
        feature: int | None = None,
        title: str = "",
    ):
        if scores.dim() != 2 or scores.shape[0] != len(tokens):
            raise InputError(f"scores have shape {list(scores.shape)}, expected [tokens={len(tokens)}, features].")
        if len(tokens) > MAX_TOKENS:
            raise InputError(
                f"the prompt has {len(tokens)} tokens; the panel draws at most {MAX_TOKENS}: pass a shorter prompt "
                "(or read s.project(...).scores in the kernel)."
            )
        self._scores = scores.detach().float().cpu()
        n = int(self._scores.shape[1])
        top, hover = min(_count("top", top, MAX_TOP), n), min(_count("hover", hover, MAX_HOVER), n)
        # The picker ranks features by their largest activation on the prompt (an SAE feature that fires once
        # strongly is what a user looks for); probes can be negative, so a probe's size is its largest |score|.
        peak = self._scores.abs().amax(0)
        order = peak.topk(top).indices
        tv, ti = self._scores.topk(hover, dim=-1)
        if feature is None:
            feature = int(order[0])
        super().__init__(
            tokens=list(tokens),
            n_features=n,
            top_ids=_i32(order),
            top_max=_f32(self._scores.amax(0)[order]),
            hover=hover,
            tok_ids=_i32(ti),
            tok_vals=_f32(tv),
            scale=float(peak[order].max()) if top else 0.0,
            title=title,
            address=address,
        )
        self.show(feature)

    def show(self, feature: int) -> None:
        """Colour the tokens by one feature (any index, listed in the picker or not)."""
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < self.n_features:
            raise InputError(f"feature={feature!r}: an int from 0 to {self.n_features - 1}.")
        with self.hold_sync():
            self.values = _f32(self._scores[:, feature])
            self.feature = feature
            self.error = ""

    def feature_values(self) -> torch.Tensor:
        """The scores on screen: the selected feature's, [tokens] float32."""
        return torch.from_numpy(np.frombuffer(self.values, dtype="<f4").copy())

    def on_select(self, feature: int) -> None:
        if feature >= self.n_features:
            self._reject(f"no feature {feature} here: features run from 0 to {self.n_features - 1}")
            return
        self.show(feature)

    def __repr__(self) -> str:
        return (
            f"FeaturePanel({self.title or 'features'} at {self.address}: {plural(len(self.tokens), 'token')}, "
            f"{plural(self.n_features, 'feature')}; showing feature {self.feature})"
        )


def for_session(
    session: Any,
    prompt: Any,
    address: Any,
    features: Any,
    *,
    top: int = 16,
    hover: int = 5,
    feature: Any = None,
    **project_kwargs: Any,
) -> FeaturePanel:
    """Scores through the session's public ``project`` (an SAE's encoder with its nonlinearity, or directions)."""
    from ..sae import SAE

    session.facts  # refuses a closed session before any work  # noqa: B018
    _count("top", top, MAX_TOP)
    _count("hover", hover, MAX_HOVER)
    if features is None:
        raise InputError("feature_panel needs an SAE (ie_lab.load_sae(...)) or a [k, d] tensor of probe directions.")
    if isinstance(features, SAE):
        fixed = sorted(set(project_kwargs) & {"bias", "activation", "threshold", "k"})
        if fixed:
            raise InputError(f"{', '.join(fixed)}= come from the SAE itself; pass them only with probe directions.")
        address = features.address if address is None else address
        if address is None:
            raise InputError(
                "this SAE is attached to no point: load it with the model (ie_lab.load_sae(path, s)) or pass "
                "address='resid_post.L'."
            )
        p = session.project(
            prompt,
            address,
            features.encoder(),
            activation=features.activation,
            k=features.k if features.activation == "topk" else None,
            **project_kwargs,
        )
        what = f"SAE ({features.activation}, {plural(features.d_sae, 'feature')})"
    else:
        if address is None:
            raise InputError("feature_panel with probe directions needs address= (e.g. 'resid_post.3').")
        p = session.project(prompt, address, features, **project_kwargs)
        what = "probes"
    if p.scores.dim() != 2:
        raise InputError("the feature panel shows one prompt; pass a single text or one row of ids.")
    return FeaturePanel(
        p.scores, p.str_tokens, address=str(p.address), top=top, hover=hover, feature=feature, title=what
    )
