"""Measuring a hyper-connection layer (several residual streams: DeepSeek-V4, HY-V4) on the probe forward.

Which output of each hyper-connection module is the collapse, the write weights and the mixing matrix, the norms
between collapse and sublayer, and that the two stream identities hold.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StructureError
from .binding import LayerBinding
from .config_facts import ArchFacts
from .recorder import Recorder, close, same
from .spellings import norm_children


def _hc_roles(out: Any, b: int, s: int, n: int, d: int) -> dict[str, int] | None:
    """Where a hyper-connection module's output tuple holds the collapse ([b, s, d_model]), the write weights
    ([b, s, n_streams]) and, where it mixes the streams, the mixing matrix ([b, s, n, n]); None if not both of the
    first two are there."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    roles: dict[str, int] = {}
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            continue
        for role, want in (("collapse", (b, s, d)), ("write", (b, s, n)), ("mix", (b, s, n, n))):
            if tuple(t.shape) == want and role not in roles and i not in roles.values():
                roles[role] = i
    return roles if "collapse" in roles and "write" in roles else None


def _streams_explained(
    before: torch.Tensor, after: torch.Tensor, sub: torch.Tensor, out: Any, roles: dict[str, int], transposed: bool
) -> bool:
    """after[.., j, :] = sum_i mix[.., i, j] * before[.., i, :] + write[.., j] * sub (the streams carried on unmixed
    where there is no matrix): one sublayer of a hyper-connection layer, in float64."""
    w = out[roles["write"]].double()
    x = before.double()
    if "mix" in roles:
        m = out[roles["mix"]].double()
        x = torch.einsum("bsji,bsjd->bsid" if not transposed else "bsij,bsjd->bsid", m, x)
    return close(x + w.unsqueeze(-1) * sub.double().unsqueeze(-2), after.double(), 1e-5)


def classify_streams(
    lb: LayerBinding,
    rec: Recorder,
    X: torch.Tensor,
    Y: torch.Tensor,
    A_in: torch.Tensor,
    A_out: torch.Tensor,
    M_in: torch.Tensor,
    M_out: torch.Tensor,
    facts: ArchFacts,
    where: str,
) -> None:
    """A hyper-connection layer: it reads and writes a [batch, seq, n_streams, d_model] stack. A module before each
    sublayer collapses the stack into the sublayer's one input vector per token and returns the weights that write
    the sublayer's output back into each stream (and, on DeepSeek-V4, a matrix mixing the streams). Measured: which
    output is which, the norms between collapse and sublayer, and that the two stream identities hold."""
    n = facts.n_streams
    if X.dim() != 4 or X.shape[-2] != n or Y.shape != X.shape:
        raise StructureError(
            f"{where}: the config states {n} residual streams, but the layer reads a {tuple(X.shape)} tensor and "
            f"returns a {tuple(Y.shape)} one, not a [batch, seq, {n}, d_model] stack."
        )
    b, s, _, d = X.shape
    mid = rec.inp(lb.mlp_hc)
    a_full, m_full = rec.outputs.get(id(lb.attn_hc)), rec.outputs.get(id(lb.mlp_hc))
    a_roles, m_roles = _hc_roles(a_full, b, s, n, d), _hc_roles(m_full, b, s, n, d)
    if mid is None or a_roles is None or a_roles != m_roles or not same(rec.inp(lb.attn_hc), X):
        raise StructureError(
            f"{where}: its hyper-connection modules do not read the layer's stream stack and return a d_model-wide "
            f"collapse and {n} write weights per token, so ie_lab cannot say which tensor each stream point is."
        )
    assert a_full is not None and m_full is not None  # _hc_roles found tensors in both
    ca, cm = a_full[a_roles["collapse"]], m_full[m_roles["collapse"]]
    for nm in norm_children(lb):
        if lb.input_norm is None and same(rec.inp(nm), ca) and same(rec.out(nm), A_in):
            lb.input_norm = nm
        elif lb.pre_mlp_norm is None and same(rec.inp(nm), cm) and same(rec.out(nm), M_in):
            lb.pre_mlp_norm = nm
    if (lb.input_norm is None and not same(ca, A_in)) or (lb.pre_mlp_norm is None and not same(cm, M_in)):
        raise StructureError(
            f"{where}: a sublayer does not read its hyper-connection's collapse (directly or through one norm), so "
            "attn_stream_collapse / mlp_stream_collapse would not be what it reads."
        )
    lb.hc_roles, lb.stream_mix = a_roles, "mix" in a_roles
    for transposed in (False, True) if lb.stream_mix else (False,):
        if _streams_explained(X, mid, A_out, a_full, a_roles, transposed) and _streams_explained(
            mid, Y, M_out, m_full, m_roles, transposed
        ):
            lb.mix_transposed = transposed
            return
    raise StructureError(
        f"{where}: the residual identities of a hyper-connection layer (each stream at resid_mid is the mixed streams "
        "entering the layer plus its write weight times attn_out, and likewise for the MLP) do not hold for the "
        "measured modules, so ie_lab refuses to serve stream points it cannot stand behind."
    )
