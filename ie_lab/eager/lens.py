"""Logit lens, user-supplied linear transports (tuned / Jacobian lens), and fitting a tuned lens."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..address import Address, layer_list
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..core.results import LensResult, token_names
from ..errors import AddressError, CapabilityUnsupported, InputError, check_flag, shown_value
from ..ops.lens import describe_postprocess, postprocess_logits, topk_rows
from ..points import Scope, Width
from ..points import get as get_point
from .capture import _capture_many, capture_batch
from .means import auto_batch_size, check_batch_size
from .model import lm_of

Transport = tuple[torch.Tensor, torch.Tensor] | Callable[[torch.Tensor], torch.Tensor]


def decode_residual(lm: Any, h: torch.Tensor) -> torch.Tensor:
    """Logits of a d_model residual through the model's own read-out: the factor the trunk multiplies its last layer's
    output by before the final norm (RWKV halves it there when rescale_every divides the depth; measured), the final
    norm, the unembedding and post-processing."""
    b = lm.binding
    with torch.no_grad():
        scale = b.layers[-1].stream_scale if b.layers else None
        h = h * scale if scale is not None else h
        x = b.final_norm(h) if b.final_norm is not None else h
        if b.head_input_scale:  # the model scales the final norm's output before its head (MiniCPM 3), measured
            x = x * b.head_input_scale
        return postprocess_logits(lm.facts, b.lm_head(x))


def _lens_reads(lm: Any, point: str, layers: list[int]) -> dict[int, list[Address]]:
    """Per layer, the addresses the lens reads: the point itself, or on a hyper-connection trunk every stream of a
    residual point, which the trunk's own final collapse (measured by the binder) turns into what its final norm
    reads, as the model does after its last layer."""
    n = lm.facts.n_streams
    if n <= 1 or not get_point(point).per_stream:
        return {L: [Address(point, L).check(lm.facts)] for L in layers}
    if lm.binding.stream_head is None:
        raise CapabilityUnsupported(
            f"the logit lens on {point}",
            f"this trunk carries {n} residual streams and ie_lab found no module collapsing them before the final "
            "norm, so it has no read-out of its own for a stack of streams.",
            f"capture {point}.L.stream-S and decode it yourself, or lens a sublayer output (attn_out, mlp_out).",
        )
    return {L: [Address(point, L, stream=s).check(lm.facts) for s in range(n)] for L in layers}


def _residual(lm: Any, cache: Any, addrs: list[Address]) -> torch.Tensor:
    """[seq, d_model]: the one read, or the streams collapsed by the trunk's final collapse."""
    if len(addrs) == 1:
        return cache[addrs[0]][0]
    with torch.no_grad():
        return lm.binding.stream_head(torch.stack([cache[a] for a in addrs], dim=-2))[0]


def _apply_transport(t: Transport, h: torch.Tensor) -> torch.Tensor:
    if callable(t):
        return t(h)
    A, bias = t
    return h @ A.to(h) + bias.to(h)


def _lens_point(point: Any) -> Any:
    from .. import points as _points

    if not isinstance(point, str):
        raise AddressError(
            f"point must be a point name such as 'resid_post' (no layer: the lens adds them), got "
            f"{type(point).__name__}."
        )
    if "." in point:
        raise AddressError(
            f"point takes the name alone ({point.split('.')[0]!r}), not {point!r}: pick the layers with layers=[...]."
        )
    return _points.get(point)


def _check_transports(transports: Any, layers: list[int], d: int) -> dict[int, Transport]:
    """Every transport checked before the forward: keyed by a lens layer, and a callable or (A [d, d], b [d])."""
    if transports is None:
        return {}
    if not isinstance(transports, Mapping):
        raise InputError(f"transports must be a dict {{layer: (A, b) or callable}}, got {type(transports).__name__}.")
    out = {}
    for L, t in transports.items():
        if isinstance(L, bool) or not isinstance(L, int) or L not in layers:
            raise InputError(f"a transport is given for layer {L!r}, which is not among the lens layers {layers}.")
        if not callable(t):
            ok = (
                isinstance(t, (tuple, list))
                and len(t) == 2
                and all(isinstance(x, torch.Tensor) for x in t)
                and tuple(t[0].shape) == (d, d)
                and tuple(t[1].shape) == (d,)
                and t[0].is_floating_point()
                and t[1].is_floating_point()
            )
            if not ok:
                raise InputError(
                    f"the transport for layer {L} must be a callable h -> h' or a pair (A, b) of float "
                    f"tensors with A [{d}, {d}] and b [{d}] (h @ A + b); got {type(t).__name__}."
                )
        out[L] = t
    return out


def logit_lens(
    model: Any,
    prompt: Any,
    layers: Sequence[int] | None = None,
    *,
    k: int = 5,
    point: str = "resid_post",
    transports: Mapping[int, Transport] | None = None,
    keep_logits: bool = False,
) -> LensResult:
    """Decode a d_model point at each layer through the model's own read-out (the logit lens).

    transports: optional per-layer maps applied first, h -> h @ A + b (a tuned or Jacobian lens), given
    as (A [d_model, d_model], b [d_model]) or any callable.
    """
    lm = lm_of(model)
    p = _lens_point(point)
    if p.width is not Width.D_MODEL or p.scope is not Scope.LAYER:
        raise AddressError(
            f"a lens decodes d_model-wide per-layer points (resid_pre, resid_mid, resid_post, ...); "
            f"{point} is {p.width.value} wide"
            + (" and a trunk point" if p.scope is Scope.TRUNK else "")
            + ", so it has no read-out."
        )
    vocab = lm.facts.vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (vocab and k > vocab):
        raise InputError(
            f"k (how many top tokens per cell) must be an integer from 1 to the vocabulary size {vocab}, "
            f"got {shown_value(k)}."
        )
    check_flag("keep_logits", keep_logits)
    layers = layer_list(layers, lm.facts)
    reads = _lens_reads(lm, point, layers)
    transports = _check_transports(transports, layers, lm.facts.d_model)
    ids, _ = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise InputError(f"logit_lens reads one prompt, got a batch of {ids.shape[0]}: call it once per prompt.")
    # one [1, seq] tensor: one Cache, as capture() returns for it
    cache = capture_batch(lm, ids, [a for L in layers for a in reads[L]])
    all_logits, top_ids, top_probs = [], [], []
    for L in layers:
        h = _residual(lm, cache, reads[L])
        if L in transports:
            h = _apply_transport(transports[L], h)
        logits = decode_residual(lm, h)
        i, pr = topk_rows(logits, k)
        top_ids.append(i)
        top_probs.append(pr)
        if keep_logits:
            all_logits.append(logits)
    top_ids_t, top_probs_t = torch.stack(top_ids), torch.stack(top_probs)
    tok = lm.tokenizer
    names = token_names(tok, top_ids_t.tolist())
    note = describe_postprocess(lm.facts) + ("; with per-layer transports" if transports else "")
    if lm.binding.head_input_scale:  # the family scales the final norm's output before its head (MiniCPM 3)
        note += f"; the final norm's output is multiplied by {lm.binding.head_input_scale:g} before the unembedding"
    return LensResult(
        layers,
        point,
        str_tokens(lm, ids)[0],
        top_ids_t,
        top_probs_t,
        names,
        note,
        torch.stack(all_logits) if keep_logits else None,
    )


@dataclass
class TunedLens:
    transports: dict[int, tuple[torch.Tensor, torch.Tensor]]
    point: str
    train_tokens: int

    def __repr__(self) -> str:
        return f"TunedLens({self.point}, layers={sorted(self.transports)}, fitted on {self.train_tokens} tokens)"


def fit_tuned_lens(
    model: Any,
    corpus: Iterable[Any],
    layers: Sequence[int] | None = None,
    *,
    point: str = "resid_post",
    ridge: float = 1e-3,
    batch_size: int | None = None,
    progress: bool = True,
) -> TunedLens:
    """Fit h_L @ A + b ≈ h_last (the residual the final norm reads) by ridge least squares over a corpus.

    The corpus runs in batches of `batch_size` prompts per forward (None: as many as ie_lab.sizing fits in the
    activation budget for the longest prompt of the batch and the points read); each prompt's own rows are cut
    out of the batch, so the fit does not depend on the batch size.
    progress: the same kind of bar as loading and patch_sweep, counting prompts read; it appears once a second
    forward starts (a corpus that fits one forward is done before a bar would tell anything)."""

    import math

    lm = lm_of(model)
    last = lm.facts.n_layers - 1
    p = _lens_point(point)
    if p.width is not Width.D_MODEL or p.scope is not Scope.LAYER:
        raise AddressError(
            f"a tuned lens maps d_model-wide per-layer points (resid_pre, resid_mid, resid_post, ...); "
            f"{point} is not one."
        )
    layers = layer_list(layers, lm.facts)
    for L in layers:
        Address(point, L).check(lm.facts)
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise InputError(f"ridge must be a finite number >= 0 (the L2 penalty), got {ridge!r}.")
    if isinstance(corpus, (str, bytes, torch.Tensor)) or not hasattr(corpus, "__iter__"):
        raise InputError(
            "corpus must be an iterable of prompts (texts or token ids), e.g. a list of strings; got "
            f"{type(corpus).__name__}"
            + (" (a single string would be read character by character)" if isinstance(corpus, str) else "")
            + "."
        )
    batch_size = check_batch_size(batch_size)
    check_flag("progress", progress)
    total = len(corpus) if isinstance(corpus, Sized) else None  # a generator's length is not known up front
    bar: Any = None  # made when the second forward starts
    forwards = 0
    xs: dict[int, list[torch.Tensor]] = {L: [] for L in layers}
    ys: list[torch.Tensor] = []
    n = 0
    addrs = sorted({Address(point, L) for L in layers} | {Address("resid_post", last)})
    chunk: list[torch.Tensor] = []

    def fits(rows: list[torch.Tensor]) -> int:
        return batch_size or auto_batch_size(lm, max(r.shape[1] for r in rows), len(addrs))

    def run() -> None:
        nonlocal n, bar, forwards
        forwards += 1
        if forwards == 2 and progress:
            bar = tqdm(total=total, initial=len(ys), desc="fitting tuned lens", leave=False)
        for c in _capture_many(lm, chunk, addrs, False):
            ys.append(c[f"resid_post.{last}"][0].float())
            for L in layers:
                xs[L].append(c[Address(point, L)][0].float())
            n += ys[-1].shape[0]
        if bar is not None:
            bar.update(len(chunk))
        chunk.clear()

    try:
        for i, text in enumerate(corpus):
            if prepare_prompts(lm, text) is not None:
                raise InputError(
                    f"corpus item {i} is a list of prompts; the corpus is a flat iterable of prompts (each a text, "
                    "token ids or a conversation): flatten it, e.g. [p for batch in corpus for p in batch]."
                )
            row = prepare(lm, text)[0]
            if chunk and len(chunk) + 1 > fits([*chunk, row]):  # a longer prompt shrinks the batch: run what is held
                run()
            chunk.append(row)
            if len(chunk) >= fits(chunk):
                run()
        if chunk:
            run()
    finally:
        if bar is not None:
            bar.close()
    if n == 0:
        raise InputError("the corpus is empty: give at least one text or token sequence to fit on.")
    Y = torch.cat(ys)
    d = Y.shape[1]
    out = {}
    for L in layers:
        X = torch.cat(xs[L])
        Xa = torch.cat([X, torch.ones(X.shape[0], 1)], 1)
        reg = ridge * torch.eye(d + 1)
        reg[-1, -1] = 0  # the bias is not shrunk
        W = torch.linalg.solve(Xa.T @ Xa + reg * X.shape[0], Xa.T @ Y)
        out[L] = (W[:d].to(lm.dtype), W[d].to(lm.dtype))
    return TunedLens(out, point, n)
