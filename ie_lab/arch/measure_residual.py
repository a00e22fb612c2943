"""Measuring the norms and the residual wiring of each layer on the probe forward.

Which norm reads what (pre-norm, sandwich, parallel block), the residual multipliers, a norm on the stream itself,
a returned output bias, a mixer beside attention, the alpha/beta residual, single-sublayer blocks, the factor
between layers and the scale before the unembedding. Where the residual identities do not hold the layer is refused,
naming why where arch.residual_refusals can.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import StructureError
from .binding import Binding, LayerBinding
from .config_facts import ArchFacts
from .measure_attention import measure_qk_norm_layout
from .measure_mlp import measure_gate_up, measure_mlp_out_gate, order_gate_up, reads_previous_token
from .measure_streams import classify_streams
from .recorder import Recorder, close, match_shape, same
from .residual_refusals import (
    refuse_post_norm,
    refuse_scaled_residual,
    refuse_unbound_branch,
    refuse_unbound_residual_step,
)
from .spellings import ALTUP_NAMES, MIXER_NAMES, child, name_in, norm_children


def classify_layer(lb: LayerBinding, rec: Recorder, facts: ArchFacts, family: str) -> None:
    where = f"{family} layer {lb.index}" + (f" (a {lb.mixer_kind} mixer layer)" if lb.mixer_kind else "")
    X = rec.inp(lb.layer)
    Y = rec.out(lb.layer)
    A_in = rec.inp(lb.attn)
    A_out = rec.out(lb.o_proj)  # the output projection's output is attn_out on every family
    M_in = rec.inp(lb.mlp_in_module)
    M_out_module = rec.out(lb.mlp_out_module)
    if X is None or Y is None or A_in is None or A_out is None or M_in is None or M_out_module is None:
        raise StructureError(f"{where}: the probe forward did not pass through every expected module.")
    if lb.attn_hc is not None:
        classify_streams(lb, rec, X, Y, A_in, A_out, M_in, M_out_module, facts, where)
        return
    odd = [t for t in (Y, A_in, A_out, M_in, M_out_module) if match_shape(t, X) is None]
    if odd:
        altup = child(lb.layer, ALTUP_NAMES)
        how = (
            f"its {altup[0]} module predicts every stream from all of them before the sublayers and corrects them "
            "from the active stream's result after, in methods no module boundary separates (alternating updates, "
            "not hyper-connections), which ie_lab does not bind yet"
            if altup is not None
            else "its config states no stream count (hc_mult) and the layer has no hyper-connection modules ie_lab "
            "measures"
        )
        raise StructureError(
            f"{where}: the layer reads a {tuple(X.shape)} tensor but its sublayers exchange "
            f"{tuple(odd[0].shape)} ones, so the residual stream is not one vector per token: several parallel "
            f"residual streams, and {how}."
        )

    if lb.mlp_only:
        _classify_mlp_only(lb, rec, X, Y, where)
        return
    if not lb.has_mlp:
        _classify_mixer_only(lb, rec, X, Y, A_in, A_out, where)
        return

    # Some families' MLP module adds the residual itself (Bloom): then mlp_out is its down projection's output.
    M_out = M_out_module
    if lb.mlp_out_gate is not None and not measure_mlp_out_gate(lb, rec, rec.out(lb.down_proj), M_out_module):
        lb.mlp_out_gate = None  # nominated, but its activated output does not gate the down projection's into it
    if lb.mlp_out_gate is not None and lb.mlp is not None:
        lb.mlp_token_shift = reads_previous_token(lb.mlp, M_in, M_out_module)
    if lb.down_proj is not None and lb.mlp is not None:
        D_out = rec.out(lb.down_proj)
        if D_out is not None and not same(M_out_module, D_out) and lb.mlp_out_gate is None:
            # A module output that is not its down projection's (nor its gated product) is either residual-added or
            # post-processed.
            lb.mlp_out_module = lb.down_proj
            M_out = D_out
    if lb.mlp_side is not None:
        S_out = rec.out(lb.mlp_side)
        S = match_shape(S_out, M_out) if S_out is not None and same(rec.inp(lb.mlp_side), M_in) else None
        if S is not None:
            # a side MLP reading the MLP's input: what the layer adds is the sum (the identities below verify it)
            order = list(rec.outputs)
            lb.mlp_side_last = order.index(id(lb.mlp_side)) > order.index(id(lb.mlp_out_module))
            M_out = M_out + S
        else:
            lb.mlp_side = None
            lb.names.pop("mlp_side", None)

    norms = norm_children(lb)
    for n in norms:
        n_in, n_out = rec.inp(n), rec.out(n)
        if n_in is None or n_out is None:
            continue
        if same(n_in, A_out) and lb.post_attn_norm is None:
            lb.post_attn_norm = n
        elif same(n_in, M_out) and lb.post_mlp_norm is None:
            lb.post_mlp_norm = n
        elif same(n_out, A_in) and lb.input_norm is None:
            lb.input_norm = n
            if same(n_out, M_in):  # one norm feeding both sublayers: a parallel block
                lb.parallel = True
        elif same(n_out, M_in) and lb.pre_mlp_norm is None:
            lb.pre_mlp_norm = n
    if lb.pre_mlp_norm is not None and lb.input_norm is not None and same(rec.inp(lb.pre_mlp_norm), X):
        lb.parallel = True  # two norms both reading the layer input (GPT-NeoX style)
    if lb.pre_mlp_norm is None and lb.input_norm is not None and not lb.parallel and same(M_in, A_in):
        lb.parallel = True

    attn_c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    mlp_c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else M_out
    assert attn_c is not None and mlp_c is not None  # the loop above binds a norm only where both were recorded

    def ratio(delta: torch.Tensor, c: torch.Tensor) -> float:
        return float((delta.double() * c.double()).sum() / (c.double() * c.double()).sum().clamp_min(1e-30))

    # A ratio within a few ulps of 1 (at the model's precision) is no multiplier at all.
    one_tol = max(1e-4, 8 * torch.finfo(X.dtype).eps)

    def mult(m: float) -> float | None:
        if abs(m - 1.0) < one_tol:
            return None
        cfg = facts.residual_multiplier
        return float(cfg) if cfg is not None and abs(cfg - m) < one_tol * max(1.0, abs(cfg)) else m

    if lb.parallel:
        # Y = X + a*attn_c + b*mlp_c; multipliers on parallel blocks are not expected, verify plain sum.
        if not close(X + attn_c + mlp_c, Y, 1e-4):
            raise StructureError(
                f"{where}: measured a parallel block, but resid_pre + attention + MLP does not equal the layer "
                "output, so ie_lab cannot serve faithful sublayer points for this family."
            )
    else:
        R = rec.inp(lb.pre_mlp_norm) if lb.pre_mlp_norm is not None else M_in
        assert R is not None  # likewise
        if not close(X + attn_c, R, 1e-4):
            sn = _stream_norm(lb, rec, X, attn_c, R)
            normed = rec.out(sn) if sn is not None else None
            if sn is not None and normed is not None:  # the first residual add reads the normed stream (RWKV's pre_ln)
                lb.stream_norm, X = sn, normed
                lb.names["stream_norm"] = name_in(lb.layer, sn)
        if lb.post_attn_norm is None and not close(X + attn_c, R, 1e-4):
            lb.o_bias = _returned_output_bias(lb, rec, X, attn_c, R)
            if lb.o_bias is not None:
                attn_c = attn_c + lb.o_bias.detach()
        m_attn = ratio(R - X, attn_c)
        m_mlp = ratio(Y - R, mlp_c)
        par = _parallel_mixer(lb, rec, X, R, attn_c)
        if par is not None:
            m_attn, m_par, P = par
            lb.par_mixer_multiplier = mult(m_par)
            X = X + P * (lb.par_mixer_multiplier or 1.0)  # what attention's output is added to, beside the mixer's
        lb.attn_multiplier, lb.mlp_multiplier = mult(m_attn), mult(m_mlp)
        a_eff = attn_c * (lb.attn_multiplier or 1.0)
        m_eff = mlp_c * (lb.mlp_multiplier or 1.0)
        if not (close(X + a_eff, R, 1e-4) and close(R + m_eff, Y, 1e-4)) and not _norm_residual(
            lb, rec, facts, R, Y, attn_c, mlp_c, where
        ):
            refuse_post_norm(lb, rec, X, attn_c, mlp_c, where)  # exact tensor identities first, then the
            refuse_unbound_residual_step(lb, rec, X, A_out, R, where)  # broader "what else ran" of the branch check
            refuse_scaled_residual(X, attn_c, R, where)
            refuse_unbound_branch(lb, rec, X, R, Y, where)
            raise StructureError(
                f"{where}: the residual identities resid_pre + {'mixer' if lb.mixer_kind else 'attn'}_out_post = "
                "resid_mid and resid_mid + "
                "mlp_out_post = resid_post do not hold for the measured structure, so ie_lab refuses to serve "
                "sublayer points it cannot stand behind."
            )

    measure_qk_norm_layout(lb, rec)
    measure_gate_up(lb, rec, where)


def _stream_norm(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, attn_c: torch.Tensor, R: torch.Tensor
) -> nn.Module | None:
    """A norm of the layer that reads the layer's input and whose output, not the input, is what the first sublayer's
    output is added to (and what the input norm reads): it normalises the residual stream itself (RWKV's pre_ln)."""
    bound = {id(m) for m in (lb.input_norm, lb.pre_mlp_norm, lb.post_attn_norm, lb.post_mlp_norm) if m is not None}
    for n in norm_children(lb):
        out = rec.out(n)
        if id(n) in bound or out is None or not same(rec.inp(n), X) or not close(out + attn_c, R, 1e-4):
            continue
        if lb.input_norm is None or same(rec.inp(lb.input_norm), out):
            return n
    return None


def _returned_output_bias(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, A_out: torch.Tensor, R: torch.Tensor
) -> nn.Parameter | None:
    """The attention module's own 1-D parameter that it returns beside its output and the layer adds to the output
    projection's output before the residual add (resid_mid = resid_pre + attn_out + bias), or None."""
    full = rec.outputs.get(id(lb.attn))
    extra = [t for t in full[1:] if isinstance(t, torch.Tensor)] if isinstance(full, (tuple, list)) else []
    own = [p for p in lb.attn.parameters(recurse=False) if p.dim() == 1 and p.shape[-1] == X.shape[-1]]
    for b in extra:
        p = next((p for p in own if b.shape == p.shape and same(b, p.detach())), None)
        if p is not None and close(X + A_out + p.detach(), R, 1e-4):
            return p
    return None


def _norm_residual(
    lb: LayerBinding,
    rec: Recorder,
    facts: ArchFacts,
    R: torch.Tensor,
    Y: torch.Tensor,
    attn_c: torch.Tensor,
    mlp_c: torch.Tensor,
    where: str,
) -> bool:
    """A residual taken after each sublayer's input norm and scaled (MiniMax): resid_mid = a * input_norm(resid_pre)
    + b * attn_out and resid_post = c * pre_mlp_norm(resid_mid) + e * mlp_out. The four factors are measured by
    least squares; the layer is bound (True) only where they are the ones the config states for its kind, and then
    the config's exact values must satisfy both identities. False where the structure is not this one, or the
    config states no factors (the refusal then names the measured ones)."""
    A_in, M_in = rec.out(lb.input_norm), rec.out(lb.pre_mlp_norm)
    if A_in is None or M_in is None or lb.post_attn_norm is not None or lb.post_mlp_norm is not None:
        return False
    pairs = ((A_in, attn_c, R), (M_in, mlp_c, Y))
    if any(not (base.shape == c.shape == out.shape) for base, c, out in pairs):
        return False
    measured: list[float] = []
    for base, c, out in pairs:
        basis = torch.stack([base.double().flatten(), c.double().flatten()], dim=1)
        coef = torch.linalg.lstsq(basis, out.double().flatten().unsqueeze(1)).solution.flatten()
        if not close(coef[0] * base.double() + coef[1] * c.double(), out.double(), 1e-4):
            return False
        measured += [float(coef[0]), float(coef[1])]
    cfg = facts.residual_factors[lb.index] if lb.index < len(facts.residual_factors) else None
    if cfg is None:
        return False
    text = "resid_mid = {:.4g} * attn_in + {:.4g} * attn_out, resid_post = {:.4g} * mlp_in + {:.4g} * mlp_out"
    if any(abs(m - f) > 1e-3 * max(1.0, abs(f)) for m, f in zip(measured, cfg)) or not all(
        close(a * base.double() + b * c.double(), out.double(), 1e-4)
        for (a, b), (base, c, out) in zip((cfg[:2], cfg[2:]), pairs)
    ):
        raise StructureError(
            f"{where}: each sublayer's output is added to its input norm's output, measured as "
            f"{text.format(*measured)}, but the config's alpha/beta factors for this layer say "
            f"{text.format(*cfg)}; ie_lab binds this residual only with the factors the config states."
        )
    lb.attn_alpha, lb.mlp_alpha = cfg[0], cfg[2]
    lb.attn_multiplier = None if cfg[1] == 1 else cfg[1]
    lb.mlp_multiplier = None if cfg[3] == 1 else cfg[3]
    return True


def _parallel_mixer(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, R: torch.Tensor, attn_c: torch.Tensor
) -> tuple[float, float, torch.Tensor] | None:
    """A token mixer (MIXER_NAMES) on an attention layer that ran in the probe and whose output, with attention's,
    explains resid_mid - resid_pre as a*attn + b*mixer (least squares, then checked exactly): bound beside attention
    (Falcon-H1). Returns (a, b, the mixer's output); None where there is none or it does not add up."""
    if lb.mixer_kind:
        return None
    for name, m in lb.layer.named_children():
        P = rec.out(m)
        if name not in MIXER_NAMES or m is lb.attn or P is None or P.shape != X.shape:
            continue
        basis = torch.stack([attn_c.double().flatten(), P.double().flatten()], dim=1)
        a, b = (float(c) for c in torch.linalg.lstsq(basis, (R - X).double().flatten().unsqueeze(1)).solution)
        if not close(X.double() + a * attn_c.double() + b * P.double(), R.double(), 1e-4):
            continue
        order = list(rec.outputs)
        lb.par_mixer, lb.par_mixer_first = m, order.index(id(m)) < order.index(id(lb.o_proj))
        lb.names["mixer"] = name
        return a, b, P
    return None


def _one_sublayer_norms(
    lb: LayerBinding, rec: Recorder, s_in: torch.Tensor | None, s_out: torch.Tensor | None
) -> tuple[nn.Module | None, nn.Module | None]:
    """A single-sublayer block's norms: the first whose output is the sublayer's input (its pre-norm) and the first
    that reads the sublayer's output (its post-norm); None for either the layer does not have."""
    pre = post = None
    for n in norm_children(lb):
        if same(rec.out(n), s_in) and pre is None:
            pre = n
        elif same(rec.inp(n), s_out) and post is None:
            post = n
    return pre, post


def _classify_mixer_only(
    lb: LayerBinding,
    rec: Recorder,
    X: torch.Tensor,
    Y: torch.Tensor,
    A_in: torch.Tensor,
    A_out: torch.Tensor,
    where: str,
) -> None:
    """A block with one sublayer: its input norm feeds the mixer, and resid_post = resid_pre + mixer_out."""
    lb.input_norm, lb.post_attn_norm = _one_sublayer_norms(lb, rec, A_in, A_out)
    c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    if c is None or not close(X.float() + c.float(), Y.float(), 1e-4):
        raise StructureError(
            f"{where}: a mixer-only block (no MLP), but resid_pre + the mixer's output does not equal the layer "
            "output, so ie_lab refuses to serve its points."
        )


def _classify_mlp_only(lb: LayerBinding, rec: Recorder, X: torch.Tensor, Y: torch.Tensor, where: str) -> None:
    """A block whose one sublayer is its MLP: its norm feeds the MLP, and resid_post = resid_pre + mlp_out."""
    M_in, M_out = rec.inp(lb.mlp_in_module), rec.out(lb.mlp_out_module)
    lb.pre_mlp_norm, lb.post_mlp_norm = _one_sublayer_norms(lb, rec, M_in, M_out)
    c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else M_out
    if c is None or not close(X.float() + c.float(), Y.float(), 1e-4):
        raise StructureError(
            f"{where}: an MLP-only block (no attention or mixer), but resid_pre + the MLP's output does not equal the "
            "layer output, so ie_lab refuses to serve its points."
        )
    if lb.gate_proj is not None and lb.up_proj is not None:
        order_gate_up(lb, rec)


def measure_stream_scales(binding: Binding, rec: Recorder, norm_in: torch.Tensor | None) -> None:
    """The factor the trunk multiplies each layer's output by before the next layer (the final norm, after the last)
    reads it, outside any module: RWKV halves the stream every rescale_every layers in eval mode. Set only where the
    reader's input is that scalar (not 1) times the layer's output; a power of two is taken as exact."""
    readers = [rec.inp(nxt.layer) for nxt in binding.layers[1:]]
    readers.append(norm_in if binding.stream_head is None else None)  # a stream head collapses the stack: not this
    for lb, seen in zip(binding.layers, readers):
        out = rec.out(lb.layer)
        if out is None or seen is None or out.shape != seen.shape or same(out, seen):
            continue
        o, r = out.double(), seen.double()
        s = float((o * r).sum() / (o * o).sum().clamp_min(1e-30))
        p2 = 2.0 ** round(math.log2(s)) if s > 0 else 0.0
        s = p2 if p2 and abs(s / p2 - 1.0) < 1e-6 else s
        if abs(s - 1.0) > 1e-6 and close(out * s, seen, 1e-5):
            lb.stream_scale = s


def measure_head_input_scale(binding: Binding, norm_out: torch.Tensor, head_in: torch.Tensor) -> float | None:
    """The scalar s with head_in = s * norm_out, where the config's logit divisor is 1/s and the head has no bias
    (then the head's output is the model's logits, and the lens applies s before the head); None otherwise."""
    n, h = norm_out.double(), head_in.double()
    if n.shape != h.shape or getattr(binding.lm_head, "bias", None) is not None:
        return None
    s = float((h * n).sum() / (n * n).sum().clamp_min(1e-30))
    div = binding.facts.logit_divisor
    if not div or abs(s * float(div) - 1.0) > 1e-4 or not close(norm_out * s, head_in, 1e-5):
        return None
    return s
