"""Naming why a layer's residual identities fail, where the probe can tell: each function raises a StructureError
that says what the layer does beyond the structure ie_lab binds (a post-norm block, a step after the output
projection, a scaled residual, a branch outside the sublayers), or returns and leaves the generic refusal to the
caller (arch.measure_residual).
"""

from __future__ import annotations

import torch

from ..errors import StructureError
from .binding import LayerBinding
from .recorder import Recorder, close, same
from .spellings import ACT_NAMES, norm_children


def refuse_unbound_branch(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, R: torch.Tensor, Y: torch.Tensor, where: str
) -> None:
    """Name what the layer does beyond its bound sublayers when that is why the residual identities fail: a module
    it runs outside its attention (or mixer) and MLP (Gemma 4's per-layer input branch; a mixer beside attention
    whose share _parallel_mixer could not fit), a learned scale on the residual stream itself (Doge's per-channel
    vectors, Gemma 4's layer_scalar), or a residual that is the input norm's output with factors no config states
    (MiniMax's alpha/beta residual, bound by _norm_residual where its config states them)."""
    A_in, A_out = rec.inp(lb.attn), rec.out(lb.o_proj)
    attn_c = rec.out(lb.post_attn_norm) if lb.post_attn_norm is not None else A_out
    mlp_c = rec.out(lb.post_mlp_norm) if lb.post_mlp_norm is not None else rec.out(lb.mlp_out_module)
    roles = (lb.attn, lb.o_proj, lb.mlp, lb.mlp_side, lb.par_mixer, lb.wrapper, lb.input_norm, lb.post_attn_norm)
    bound = {id(m) for m in (*roles, lb.pre_mlp_norm, lb.post_mlp_norm) if m is not None}
    ran = [
        (name, m)
        for name, m in lb.layer.named_children()
        if id(m) not in bound and id(m) in rec.outputs and name not in ACT_NAMES
    ]
    sub = "mixer" if lb.mixer_kind else "attention"
    if ran:
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in ran)
        raise StructureError(
            f"{where}: the layer also runs {names} outside its {sub} and MLP, a further branch whose output joins the "
            "residual stream outside any module ie_lab binds, so the sublayer points would not add up to resid_post; "
            "such branches are not bound yet."
        )
    own = [*lb.layer.named_parameters(recurse=False), *lb.layer.named_buffers(recurse=False)]
    for name, p in own:
        p = p.detach()
        if p.numel() == X.shape[-1] and (
            (attn_c is not None and close(p * X + attn_c, R, 1e-4))
            or (mlp_c is not None and close(p * R + mlp_c, Y, 1e-4))
        ):
            raise StructureError(
                f"{where}: the layer scales the residual stream per channel by its learned vector {name} before a "
                f"sublayer's output is added (resid_mid = {name} * resid_pre + attn_out_post), so no sublayer output "
                "is what the layer adds to resid_pre; a learned scale on the residual stream is not bound yet."
            )
        if p.numel() == 1 and mlp_c is not None and close(p * (R + mlp_c), Y, 1e-4):
            raise StructureError(
                f"{where}: the layer multiplies its whole output by {name} ({float(p):.4g}): resid_post = {name} * "
                "(resid_mid + mlp_out_post), so the stream itself is rescaled, not a sublayer output; a scale on the "
                "residual stream is not bound yet."
            )
    if A_in is not None and attn_c is not None and A_in.shape == attn_c.shape == R.shape:
        basis = torch.stack([A_in.double().flatten(), attn_c.double().flatten()], dim=1)
        coef = torch.linalg.lstsq(basis, R.double().flatten().unsqueeze(1)).solution.flatten()
        alpha, beta = float(coef[0]), float(coef[1])
        if close(alpha * A_in.double() + beta * attn_c.double(), R.double(), 1e-4):
            raise StructureError(
                f"{where}: the residual the {sub} output is added to is the input norm's output, not resid_pre "
                f"(resid_mid = {alpha:.4g} * input_norm(resid_pre) + {beta:.4g} * {sub} output, as MiniMax's "
                "alpha/beta residual factors have it): the norm sits on the residual path, so no sublayer output "
                "makes resid_pre + attn_out_post = resid_mid hold, and ie_lab binds such a residual only with the "
                "factors a config states (full_attn_/linear_attn_/mlp_alpha_factor and _beta_factor), which this one "
                "does not."
            )


def refuse_post_norm(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, attn_c: torch.Tensor, mlp_c: torch.Tensor, where: str
) -> None:
    """Name a post-norm block (the original GPT's n = ln_1(x + attn), h = ln_2(n + mlp)) when that is why the
    residual identities fail: the MLP's residual add reads the normed stream, not resid_pre + attention's output."""
    n1 = lb.pre_mlp_norm
    normed = rec.out(n1)
    if n1 is None or normed is None or not close(rec.inp(n1), X + attn_c, 1e-4):
        return
    for n in norm_children(lb):
        if n is not n1 and close(rec.inp(n), normed + mlp_c, 1e-4):
            name = next((k for k, m in lb.layer.named_children() if m is n1), type(n1).__name__)
            raise StructureError(
                f"{where}: a post-norm block: {name} normalises the residual stream itself after the attention's "
                "residual add (its input is resid_pre + attn_out), so the stream between sublayers is renormalised, "
                "no sublayer output adds up to the next residual, and post-norm trunks are not bound yet."
            )


def refuse_unbound_residual_step(
    lb: LayerBinding, rec: Recorder, X: torch.Tensor, A_out: torch.Tensor, R: torch.Tensor, where: str
) -> None:
    """Name the step between the attention's output projection and resid_mid when the probe finds one: a bias the
    attention module returns beside its output for the layer to add (skip-bias-add), a module that transforms the
    output before the add, or a module that is the residual add itself (learned per-channel weights)."""
    full = rec.outputs.get(id(lb.attn))
    extra = [t for t in full[1:] if isinstance(t, torch.Tensor)] if isinstance(full, (tuple, list)) else []
    for b in extra:
        if b.dim() == 1 and b.shape[-1] == X.shape[-1] and close(X + A_out + b, R, 1e-4):
            raise StructureError(
                f"{where}: the attention module returns a bias beside its output ({lb.names.get('attn', 'attn')}'s "
                "output tuple) that the layer adds to the output projection's output before the residual add "
                "(skip-bias-add), so attn_out would lack it; a returned output bias is not bound yet."
            )
    skip = {id(lb.attn), id(lb.o_proj), id(lb.mlp), id(lb.wrapper), *(id(n) for n in norm_children(lb))}
    for name, m in lb.layer.named_children():
        i, o = rec.inp(m), rec.out(m)
        if id(m) in skip or i is None or o is None or not same(i, A_out):
            continue
        if close(o, R, 1e-4):
            raise StructureError(
                f"{where}: the residual add is itself a learned module: {name} ({type(m).__name__}) reads the "
                "attention output and the residual and returns resid_mid (a per-channel weighted sum), so resid_mid "
                "is not resid_pre + a sublayer output; learned residual adds are not bound yet."
            )
        if close(X + o, R, 1e-4):
            raise StructureError(
                f"{where}: {name} ({type(m).__name__}) transforms the attention output before the residual add (its "
                "input is attn_out, its output what resid_pre is added to), a step after the output projection that "
                "is not bound yet."
            )


def refuse_scaled_residual(X: torch.Tensor, attn_c: torch.Tensor, R: torch.Tensor, where: str) -> None:
    """Name a residual add that scales the stream itself by a constant (Beam's depth-scaled add: resid_mid =
    a * resid_pre + b * the sublayer's output, a = sqrt((k - 1) / k) at the k-th add), measured by least squares."""
    A = torch.stack([X.double().flatten(), attn_c.double().flatten()], dim=1)
    coef = torch.linalg.lstsq(A, R.double().flatten().unsqueeze(1)).solution.flatten()
    a, b = float(coef[0]), float(coef[1])
    if abs(a - 1.0) > 1e-3 and close((a * X.double() + b * attn_c.double()).to(R.dtype), R, 1e-4):
        raise StructureError(
            f"{where}: the residual add scales the stream itself (resid_mid = {a:.4g} * resid_pre + {b:.4g} * "
            "attn_out_post, a depth-scaled residual), so resid_pre + a sublayer output is not the next residual; "
            "scaled residual streams are not bound yet."
        )
