"""logit_attribution(): direct logit attribution on the eager backend, from one forward.

The residual stream the final norm reads is the sum of what was written into it: the embeddings (resid_pre.0) and,
per layer, what each sublayer adds (attn_out_post, mixer_out_post, mlp_out_post; or each head's attn_result times
the layer's multiplier, and the projection's bias). One capture reads those pieces, the final residual, the final
norm's output and the head's output; the final norm is frozen at the scale the run had (ops/attribution.py, fitted
and checked against the norm's own output), and each piece is read through it and the unembedding. Families whose
residual is not that plain sum are refused with the reason, and a sum that does not come out (measured on the run)
is refused rather than returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.attribution import AttributionResult
from ..core.inputs import prepare_prompts, str_tokens
from ..errors import CapabilityUnsupported, InputError, shown_value
from ..ops.attribution import freeze_norm, unembed_bias, unembed_direction
from ..points import Structure, absence
from .capture import capture_batch
from .head_results import heads_bias, linear_kind, projection_kind
from .model import lm_of

BY = ("layer", "point", "head")
# What each layer may add to the residual, in the order a layer runs them (a mixer beside attention runs with it).
_SUBLAYERS = ("attn_out_post", "mixer_out_post", "mlp_out_post")


def logit_attribution(
    model: Any, prompt: Any, target_tokens: Any, *, by: str = "layer", positions: Any = None
) -> AttributionResult:
    """Split the target logit at `positions` (the last by default) into what each piece of the residual stream
    writes, read through the final norm at the run's own scale and the unembedding.

    target_tokens: one token (an id, or a string that is one token) for its logit, or a pair for the logit
    difference of the first over the second. by: "layer" (one piece per layer), "point" (per sublayer output) or
    "head" (per attention head, the projection's bias a piece of its own). The pieces sum to the model's logit."""
    lm = lm_of(model)
    if not isinstance(by, str) or by not in BY:
        raise InputError(f"by must be one of {', '.join(map(repr, BY))}, got {shown_value(by)}.")
    if prepare_prompts(lm, prompt) is not None:
        raise InputError(
            "logit_attribution reads one prompt; for several, call it once per prompt (each has its own last "
            "position and its own final norm scale)."
        )
    targets = _targets(lm, target_tokens)
    _refuse_structure(lm, by)
    b, f = lm.binding, lm.facts
    last = f.n_layers - 1
    layers = _layer_pieces(lm)
    reads = {"resid_pre.0", f"resid_post.{last}", "lm_head"} | ({"final_norm"} if b.final_norm is not None else set())
    for L, names in layers:
        for name in names:
            if by == "head" and name == "attn_out_post":
                projection_kind(lm, b.layers[L], f"logit_attribution(by='head') at layer {L}")
                reads.add(f"attn_result.{L}")
            else:
                reads.add(f"{name}.{L}")
    cache = capture_batch(lm, prompt, sorted(reads))
    ids = cache.tokens
    assert ids is not None  # capture_batch always records the tokens it ran
    if ids.shape[0] != 1:
        raise InputError(f"logit_attribution reads one prompt; got a batch of {ids.shape[0]}: call it once per prompt.")
    seq = ids.shape[1]
    pos = _positions(positions, seq)

    def at(addr: str) -> torch.Tensor:
        return cache[addr][0, pos].float()

    labels, pieces = ["embed"], [at("resid_pre.0")]
    for L, names in layers:
        lb = b.layers[L]
        layer_sum = None
        for name in names:
            if by == "head" and name == "attn_out_post":
                m = lb.attn_multiplier if lb.attn_multiplier is not None else 1.0
                heads = at(f"attn_result.{L}") * m  # [positions, heads, d_model]
                for h in range(heads.shape[1]):
                    labels.append(f"attn_result.{L}.head-{h}")
                    pieces.append(heads[:, h])
                bias = heads_bias(lb)
                if bias is not None:
                    labels.append(f"attn_bias.{L}")
                    pieces.append((bias.float() * m).expand(len(pos), -1).to(heads.device))
                continue
            t = at(f"{name}.{L}")
            if by == "layer":
                layer_sum = t if layer_sum is None else layer_sum + t
            else:
                labels.append(f"{name}.{L}")
                pieces.append(t)
        if layer_sum is not None:
            labels.append(f"layer.{L}")
            pieces.append(layer_sum)
    stack = torch.stack(pieces)  # [pieces, positions, d_model]
    x = at(f"resid_post.{last}")
    tol = 1e-4 if lm.dtype in (torch.float32, torch.float64) else 3e-2
    _check_sum(lm, stack.sum(0), x, tol)

    scale_w = b.head_input_scale or 1.0  # the model multiplies the final norm's output before its head (measured)
    post = (f.logit_multiplier if f.logit_multiplier is not None else 1.0) / (
        f.logit_divisor if f.logit_divisor is not None else 1.0
    )
    W_U, b_U = _head(lm)
    direction = unembed_direction(W_U, targets).to(x.device)
    note = "final norm frozen at the run's scale"
    if b.final_norm is not None:
        norm = b.final_norm
        weight, nbias = _param(norm, "weight"), _param(norm, "bias")
        frozen = freeze_norm(x, at("final_norm"), weight, nbias, tol, _norm_forms(norm))
        if frozen is None:
            raise CapabilityUnsupported(
                f"logit_attribution on {b.family}",
                f"the final norm ({type(norm).__name__}) is not input * gain / scale (centred or not, plus a bias) "
                "on this run, so freezing its scale would not split the logit exactly",
                "capture resid_post and final_norm and decompose them yourself",
            )
        stack = frozen.apply(stack)
        note += " (LayerNorm: each piece centred)" if frozen.center else " (RMSNorm)"
        if frozen.bias is not None:
            labels.append("final_norm.bias")
            stack = torch.cat([stack, frozen.bias.to(stack.device).expand(1, len(pos), -1)])
    values = stack @ direction * (scale_w * post)  # [pieces, positions]
    hb = unembed_bias(b_U, targets)
    if hb is not None:
        labels.append("lm_head.bias")
        values = torch.cat([values, torch.full((1, len(pos)), hb * post, device=values.device)])
    raw = cache["lm_head"][0, pos].float()
    logit = (raw[:, targets[0]] - raw[:, targets[1]] if len(targets) == 2 else raw[:, targets[0]]) * post
    _check_sum(lm, values.sum(0), logit, 10 * tol, logits=True, scale=values.abs().sum(0))
    capped = None
    if f.final_logit_softcap:
        c = float(f.final_logit_softcap)
        capped_raw = torch.tanh(raw * post / c) * c
        capped = (
            capped_raw[:, targets[0]] - capped_raw[:, targets[1]] if len(targets) == 2 else capped_raw[:, targets[0]]
        )
        note += f"; the model soft-caps its logits at {c} (tanh) after this: the pieces sum to the logit before the cap"
    tok_strs = str_tokens(lm, ids)[0]
    return AttributionResult(
        labels=labels,
        values=values.detach().cpu(),
        positions=pos,
        str_tokens=tok_strs,
        target_ids=targets,
        target_tokens=_names(lm, targets),
        by=by,
        logit=logit.detach().cpu(),
        note=note,
        capped=None if capped is None else capped.detach().cpu(),
    )


def _layer_pieces(lm: Any) -> list[tuple[int, list[str]]]:
    """Per layer, the sublayer points whose outputs it adds to the residual stream (as the registry finds them)."""
    structure = Structure.from_binding(lm.binding)
    return [(L, [n for n in _SUBLAYERS if absence(n, structure, L) is None]) for L in range(lm.facts.n_layers)]


def _refuse_structure(lm: Any, by: str) -> None:
    """Families whose residual stream is not the embeddings plus what each sublayer adds, unscaled."""
    b = lm.binding
    what = f"logit_attribution on {b.family}"
    instead = "capture the residual points (resid_pre, resid_post) and decompose them yourself"
    if b.facts.n_streams > 1:
        raise CapabilityUnsupported(
            what,
            f"this trunk carries {b.facts.n_streams} residual streams (hyper-connections) that a learned collapse "
            "turns into what the final norm reads, so no sum of single d_model pieces is that input",
            instead,
        )
    for lb in b.layers:
        if lb.norm_residual or lb.stream_norm is not None or lb.stream_scale is not None:
            how = (
                "adds each sublayer's output to its input norm's output, not to the stream it read"
                if lb.norm_residual
                else "normalises the stream itself inside the layer"
                if lb.stream_norm is not None
                else "rescales the stream between layers"
            )
            raise CapabilityUnsupported(
                what, f"layer {lb.index} {how}, so the final residual is not the plain sum of the pieces", instead
            )
        if by == "head" and lb.post_attn_norm is not None and not lb.mixer_kind and not lb.mlp_only:
            raise CapabilityUnsupported(
                f"logit_attribution(by='head') on {b.family}",
                f"layer {lb.index} normalises attention's output (a post-attention norm) before adding it to the "
                "residual, so the heads' writes are not pieces of what it adds",
                "use by='point' (attn_out_post per layer), or capture attn_result per head",
            )
    if linear_kind(b.lm_head) != "linear":
        raise CapabilityUnsupported(
            what,
            f"the unembedding is a {type(b.lm_head).__name__}, not a plain linear map, so its rows are not the "
            "logits' directions",
            "use the logit lens (s.logit_lens)",
        )


def _check_sum(
    lm: Any,
    got: torch.Tensor,
    want: torch.Tensor,
    tol: float,
    *,
    logits: bool = False,
    scale: torch.Tensor | None = None,
) -> None:
    """Refuse, rather than return, pieces that do not add up on this run (a structure the binder did not flag, or
    steering that wrote into the stream)."""
    if logits:
        ok = (got - want).abs() <= tol * (scale + want.abs()) + 1e-6  # type: ignore[operator]
        err = float((got - want).abs().max())
    else:
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
        ok, err = rel <= tol, float(rel.max())
    if not bool(ok.all()):
        where = "the target logit" if logits else "the residual stream the final norm reads"
        raise CapabilityUnsupported(
            f"logit_attribution on {lm.binding.family}",
            f"the pieces do not sum to {where} on this run (off by {err:.3g}): the family's residual stream is "
            "not the plain sum of the embeddings and what each sublayer adds, or steering wrote into it",
            "capture the residual points and decompose them yourself, or call it outside any steering block",
        )


def _head(lm: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = lm.binding.lm_head
    return head.weight.detach(), _param(head, "bias")


def _param(m: nn.Module, name: str) -> torch.Tensor | None:
    p = getattr(m, name, None)
    return p.detach() if isinstance(p, torch.Tensor) else None


def _norm_forms(norm: nn.Module) -> tuple[bool, ...]:
    """Which forms to fit (centred first): a LayerNorm is centred, an RMSNorm is not; others are measured."""
    name = type(norm).__name__.lower()
    if isinstance(norm, nn.LayerNorm) or ("layernorm" in name and "rms" not in name):
        return (True,)
    if "rms" in name:
        return (False,)
    return (True, False)


def _targets(lm: Any, target_tokens: Any) -> list[int]:
    items = list(target_tokens) if isinstance(target_tokens, (list, tuple)) else [target_tokens]
    if isinstance(target_tokens, torch.Tensor):
        items = target_tokens.flatten().tolist()
    if len(items) not in (1, 2):
        raise InputError(
            f"target_tokens is one token (its logit) or a pair (the logit difference of the first over the "
            f"second); got {len(items)} items."
        )
    vocab = int(lm.facts.vocab_size)
    out = []
    for t in items:
        if isinstance(t, str):
            tok = lm.tokenizer
            if tok is None:
                raise InputError("this model has no tokenizer, so target tokens must be ids.")
            got = tok.encode(t, add_special_tokens=False)
            if len(got) != 1:
                raise InputError(
                    f"target token {t!r} is {len(got)} tokens for this tokenizer ({got}); give one token: its id, "
                    f"or a string that is a single token (with its leading space where the tokenizer has one)."
                )
            t = got[0]
        if isinstance(t, bool) or not isinstance(t, int):
            raise InputError(f"a target token is an id (int) or a one-token string, got {shown_value(t)}.")
        if not 0 <= t < vocab:
            raise InputError(f"target token id {t} is outside the vocabulary (0..{vocab - 1}).")
        out.append(t)
    if len(out) == 2 and out[0] == out[1]:
        raise InputError(f"the pair names token {out[0]} twice: its logit difference is 0 by construction.")
    return out


def _positions(positions: Any, seq: int) -> list[int]:
    if positions is None:
        return [seq - 1]
    items = positions.tolist() if isinstance(positions, torch.Tensor) else positions
    items = [items] if isinstance(items, int) else items
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple, range)) or not len(items):
        raise InputError(
            f"positions is a token index or a list of them (negative from the end), got {shown_value(positions)}."
        )
    out: list[int] = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, int):
            raise InputError(f"positions must be integer token indices, got {shown_value(p)}.")
        if not -seq <= p < seq:
            raise InputError(f"position {p} is outside the {seq}-token prompt.")
        if p % seq in out:
            raise InputError(f"positions names token {p % seq} twice; list each position once.")
        out.append(p % seq)
    return out


def _names(lm: Any, ids: list[int]) -> list[str]:
    tok = lm.tokenizer
    return [tok.decode([i]) if tok is not None else str(i) for i in ids]
