"""Fitting a Jacobian lens: each layer's residual mapped to the final residual by the model's own local linearisation.

For a layer L, J_L is the Jacobian of the final residual (resid_post of the last layer: what the final norm reads,
the residual the logit lens decodes) with respect to the lens point at layer L, *at the same position*:

    J_L[t] = d resid_post.{last}[t] / d point.L[t]          (d_model x d_model, output index first)

averaged over every position t of every prompt (each position counts once). Attention mixes positions, so the
full derivative also has blocks d r_final[t] / d r_L[s] for s < t; the lens keeps the same-position block, the one
a map applied position by position (a transport) can stand for. The transport is h -> h @ J^T (A = J^T, b = 0),
the format logit_lens(transports=...) takes, so the lens reads J_L h_L through the final norm and unembedding.

One vector-Jacobian product gives one row of one position's block for every layer at once: the cotangent e_i at
position t of the final residual, pulled back to each layer's point, read at position t. A prompt of T tokens needs
T * d_model of them; they run as batches of copies of the prompt (row k of a batch carries its own (t, i)), one
forward and one backward per batch, with zero-valued leaves added at each layer's point (eager/writers.py) whose
gradients are the rows. The forward stops once the last layer has produced the final residual: the final norm
and the unembedding play no part. Every hook is removed when the batch ends, also on an error or an interrupt.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..address import Address, layer_list
from ..core.inputs import prepare, prepare_prompts
from ..errors import AddressError, CapabilityUnsupported, check_flag
from ..points import Scope, Width
from .grad_support import grad_support
from .lens import _lens_point
from .means import auto_batch_size, check_batch_size
from .model import lm_of
from .writers import WRITABLE, Writers


@dataclass
class JacobianLens:
    """A fitted Jacobian lens. transports: {layer: (A, b)} for logit_lens(transports=...), A = J^T [d_model,
    d_model] and b = 0, in the model's dtype on the CPU; `jacobian(L)` is J_L itself (output index first)."""

    transports: dict[int, tuple[torch.Tensor, torch.Tensor]]
    point: str
    tokens: int  # positions averaged over
    prompts: int

    def jacobian(self, layer: int) -> torch.Tensor:
        """J_L = mean over positions of d resid_post.{last}[t] / d point.L[t]: [d_model out, d_model in]."""
        return self.transports[layer][0].T

    def __repr__(self) -> str:
        return (
            f"JacobianLens({self.point}, layers={sorted(self.transports)}, averaged over {self.tokens} positions of "
            f"{self.prompts} prompt{'s' if self.prompts != 1 else ''})"
        )


class _Reached(Exception):
    """Raised by the probe at the final residual: the rest of the forward (final norm, unembedding) is not needed."""


def _check_point(lm: Any, point: Any, layers: list[int]) -> None:
    p = _lens_point(point)
    if p.width is not Width.D_MODEL or p.scope is not Scope.LAYER:
        raise AddressError(
            f"a Jacobian lens maps d_model-wide per-layer points (resid_pre, resid_mid, resid_post, ...); "
            f"{point} is not one."
        )
    if p.name not in WRITABLE:
        raise CapabilityUnsupported(
            f"a Jacobian lens of {p.name}",
            f"{p.name} has no module boundary where a derivative probe flows on (eager/writers.py).",
            "fit it at resid_pre, resid_mid or resid_post.",
        )
    if lm.facts.n_streams > 1:
        raise CapabilityUnsupported(
            "a Jacobian lens on a hyper-connection trunk",
            f"this trunk carries {lm.facts.n_streams} residual streams, so a layer's residual is a stack, not the "
            "one d_model vector the final norm reads.",
            "take gradients() of the streams you need, or lens a model with one residual stream.",
        )
    for L in layers:
        Address(point, L).check(lm.facts)


def _rows(lm: Any, prompts: Any) -> list[torch.Tensor]:
    """Each prompt as its own [1, seq] ids, every one checked before any forward (a [batch, seq] tensor: its rows)."""
    many = prepare_prompts(lm, prompts, rows=True)
    return many if many is not None else [prepare(lm, prompts)[0]]


def _vjp_rows(
    lm: Any, ids: torch.Tensor, t_idx: torch.Tensor, i_idx: torch.Tensor, points: list[Address], final: Address
) -> list[torch.Tensor]:
    """For each batch row k: d final[t_k, i_k] / d point[t_k, :] for each point, as [k, d_model] per point.

    Row k of the batch is the prompt itself; its cotangent is e_{i_k} at position t_k of the final residual."""
    k = len(t_idx)
    batch = ids.expand(k, -1).contiguous()
    leaves: dict[Address, torch.Tensor] = {}
    reached: list[torch.Tensor] = []

    def probe(a: Address):
        def edit(t: torch.Tensor, off: int) -> torch.Tensor:
            leaf = torch.zeros_like(t, requires_grad=True)
            leaves[a] = leaf
            v = t + leaf  # the same value; its gradient is the derivative at this point
            if a == final:
                reached.append(v)
                raise _Reached
            return v

        return edit

    addrs = [a for a in dict.fromkeys(points) if a != final] + [final]  # the final probe runs last on its module
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        w = stack.enter_context(Writers(lm, [(a, probe(a)) for a in addrs]))
        w.shape = (k, batch.shape[1])
        try:
            lm.hf(input_ids=batch, use_cache=False)
        except _Reached:
            pass
    if not reached:
        raise RuntimeError(f"the forward never reached {final}; the lens cannot read the final residual")
    rows = torch.arange(k, device=reached[0].device)
    t_dev, i_dev = t_idx.to(rows.device), i_idx.to(rows.device)
    picked = reached[0][rows, t_dev, i_dev].sum()
    grads = torch.autograd.grad(picked, [leaves[a] for a in points], allow_unused=True)
    return [
        g[rows, t_dev] if g is not None else torch.zeros(k, leaves[a].shape[-1], dtype=picked.dtype)
        for a, g in zip(points, grads)
    ]


def fit_jacobian_lens(
    model: Any,
    prompts: Any,
    layers: Any = None,
    *,
    point: str = "resid_post",
    batch_size: int | None = None,
    progress: bool = True,
) -> JacobianLens:
    """The Jacobian lens of each layer: J_L = d resid_post.{last}[t] / d point.L[t] (the same position's block),
    averaged over every position of every prompt; transports A = J_L^T, b = 0 for logit_lens(transports=...).

    prompts: one prompt or a list (texts, token ids, conversations; a [batch, seq] tensor is its rows), each run
    on its own (no padding). batch_size: vector-Jacobian products per forward (None: sized from the activation
    budget, as gradients() is); the result does not depend on it. A prompt of T tokens costs T * d_model of them."""
    lm = lm_of(model)
    layers = layer_list(layers, lm.facts)
    _check_point(lm, point, layers)
    batch_size = check_batch_size(batch_size)
    check_flag("progress", progress)
    grad_support(lm).require("fit_jacobian_lens")
    rows = _rows(lm, prompts)
    last = lm.facts.n_layers - 1
    final = Address("resid_post", last).check(lm.facts)
    points = [Address(point, L) for L in layers]
    d = lm.facts.d_model
    acc_dtype = torch.float64 if lm.dtype == torch.float64 else torch.float32
    device = lm.device
    acc = [torch.zeros(d, d, dtype=acc_dtype, device=device) for _ in layers]
    n = 0
    bar = tqdm(total=sum(r.shape[1] for r in rows) * d, desc="fitting Jacobian lens", disable=not progress, leave=False)
    try:
        with lm.lock:
            for ids in rows:
                ids = ids.to(device)
                T = ids.shape[1]
                # the backward keeps every layer's activations: one layer's budget shared among the layers
                k = batch_size or max(1, auto_batch_size(lm, T, len(points) + 1) // max(1, lm.facts.n_layers))
                for start in range(0, T * d, k):
                    idx = torch.arange(start, min(start + k, T * d))
                    t_idx, i_idx = idx // d, idx % d
                    got = _vjp_rows(lm, ids, t_idx, i_idx, points, final)
                    i_dev = i_idx.to(device)
                    for a, g in zip(acc, got):
                        a.index_add_(0, i_dev, g.detach().to(device, acc_dtype))  # row i of J[t, t]
                    bar.update(len(idx))
                n += T
    finally:
        bar.close()
    dtype = lm.dtype if lm.dtype.is_floating_point else torch.float32
    transports = {
        L: ((a / n).T.contiguous().to("cpu", dtype), torch.zeros(d, dtype=dtype)) for L, a in zip(layers, acc)
    }
    return JacobianLens(transports, point, n, len(rows))


__all__ = ["JacobianLens", "fit_jacobian_lens"]
