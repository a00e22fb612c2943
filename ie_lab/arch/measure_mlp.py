"""Measuring the MLP's and the mixture of experts' structure on the probe forward.

Where the experts' routing is passed, which returned tensor is the router's logits, a gate after the down projection
(RWKV's receptance) and a token shift, and which of two spelt projections is really the gate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import StructureError
from .binding import LayerBinding
from .measure_attention import GATE_FNS
from .recorder import Recorder, close, first_tensor
from .spellings import ACT_NAMES, child, name_in


def routing_in_args(call: Any, n_experts: int) -> bool:
    """Whether an experts module's probe call carried an integer index tensor with valid expert ids and a
    floating tensor of the same shape (the routing weights): where expert_weights / expert_indices are read."""
    if call is None:
        return False
    args, kwargs = call
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    idx = next((t for t in tensors if not t.is_floating_point()), None)
    if idx is None or idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= n_experts:
        return False
    return any(t.is_floating_point() and t.shape == idx.shape for t in tensors)


def measure_router_output(router: nn.Module, x: torch.Tensor | None, out: Any, n_experts: int) -> int | None:
    """Which returned tensor is the router's logits (router_logits: before top-k selection). Routers return the
    logits alone or in a tuple whose order varies by family, and some return more than one n_experts-wide float
    tensor (Llama 4: the top-k sigmoid scores scattered into zeros, then the logits). Where more than one is, the
    logits are the one equal to the router's own linear map of its input on the probe forward; -1 where none is."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    wide = [
        i
        for i, t in enumerate(items)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] == n_experts
    ]
    if len(wide) <= 1:
        return None
    w = getattr(router, "weight", None)
    if x is None or not isinstance(w, torch.Tensor) or tuple(w.shape) != (n_experts, x.shape[-1]):
        return -1
    b = getattr(router, "bias", None)
    lin = torch.nn.functional.linear(x.float(), w.float(), b.float() if isinstance(b, torch.Tensor) else None)
    lin = lin.reshape(-1, n_experts)
    match = [
        i
        for i in wide
        if items[i].numel() == lin.numel()
        and torch.allclose(items[i].float().reshape(-1, n_experts), lin, atol=1e-4, rtol=1e-3)
    ]
    return match[0] if len(match) == 1 else -1


def measure_router_weights(lb: LayerBinding, rec: Recorder, n_experts: int, top_k: int | None) -> int | None:
    """Which of the router's returned tensors is the dense routing weights, where the experts module is not handed
    (indices, weights) but the router returns them dense (Llama 4: its top-k sigmoid scores scattered into zeros,
    beside its logits). Kept only if, on the probe forward, that tensor is nonzero exactly at each token's top-k
    logits and the experts module read every token once per expert, scaled by that expert's column of it (the
    weight applied to the expert's input); None otherwise (expert_weights is then refused)."""
    out, x, routed = rec.outputs.get(id(lb.router)), rec.inp(lb.router), rec.inp(lb.experts)
    items = out if isinstance(out, (tuple, list)) else (out,)
    i_logits = lb.router_output
    if not top_k or x is None or routed is None or i_logits is None or i_logits < 0:
        return None
    logits = items[i_logits].reshape(-1, n_experts)
    x = x.reshape(-1, x.shape[-1])
    picked = torch.zeros_like(logits, dtype=torch.bool).scatter(1, logits.topk(top_k, dim=-1).indices, True)
    for i, t in enumerate(items):
        if i == i_logits or not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape[-1] != n_experts:
            continue
        w = t.reshape(-1, n_experts)
        if w.shape != logits.shape or not torch.equal(w != 0, picked) or routed.numel() != n_experts * x.numel():
            continue
        if close(routed.reshape(n_experts, *x.shape), w.T.unsqueeze(-1) * x.unsqueeze(0), 1e-5):
            return i
    return None


def measure_mlp_out_gate(lb: LayerBinding, rec: Recorder, d_out: torch.Tensor | None, m_out: torch.Tensor) -> bool:
    """Whether the MLP module's output is its down projection's output times the nominated gate's activated output
    (RWKV's channel mix: receptance); sets the activation that does it."""
    g = rec.out(lb.mlp_out_gate)
    if g is None or d_out is None or g.shape != d_out.shape:
        return False
    for fn in GATE_FNS:
        act = torch.sigmoid(g) if fn == "sigmoid" else torch.nn.functional.softplus(g.float()).to(g.dtype)
        if close(act * d_out, m_out, 1e-5):
            lb.mlp_out_gate_fn = fn
            lb.names["mlp_out_gate"] = f"{lb.names.get('mlp', 'mlp')}.{name_in(lb.mlp, lb.mlp_out_gate)}"
            return True
    return False


@torch.no_grad()
def reads_previous_token(mlp: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the MLP's output at a position moves when only the previous position of its input does (a token
    shift, RWKV's channel mix): rerun on its recorded input with position 0 changed, the output from position 1 on
    compared. Run only on a channel mix (a module called on its input alone, nothing cached or counted)."""
    if x.dim() != 3 or x.shape[1] < 2:
        return False
    x2 = x.clone()
    x2[:, 0] = x2[:, 0] + 1.0
    out2 = first_tensor(mlp(x2))
    return out2 is not None and not close(out2[:, 1:], out[:, 1:], 1e-5)


def order_gate_up(lb: LayerBinding, rec: Recorder) -> None:
    """Of a layer's two spelt projections, the gate is the one whose activated output times the other's is the down
    projection's input: swap them where the tensors say the spellings lied (as on every family, an MLP-only block's
    included)."""
    act = child(lb.mlp if lb.mlp is not None else lb.layer, ACT_NAMES)
    go, uo, d_in = rec.out(lb.gate_proj), rec.out(lb.up_proj), rec.inp(lb.down_proj)
    if act is not None and go is not None and uo is not None and d_in is not None:
        if not close(act[1](go) * uo, d_in, 1e-4) and close(act[1](uo) * go, d_in, 1e-4):
            lb.gate_proj, lb.up_proj = lb.up_proj, lb.gate_proj  # the spellings lied; trust the tensors


def measure_gate_up(lb: LayerBinding, rec: Recorder, where: str) -> None:
    """Gate vs up: check that the down projection's input is act(gate) * up, and learn a fused projection's order
    (refused where neither order of its halves explains it)."""
    if lb.fused_gate_up is not None:
        act = child(lb.mlp_in_module if lb.mlp is None else lb.mlp, ACT_NAMES)
        fo, d_in = rec.out(lb.fused_gate_up), rec.inp(lb.down_proj)
        if act is not None and fo is not None and d_in is not None:
            g, u = fo.chunk(2, dim=-1)
            if close(act[1](g) * u, d_in, 1e-4):
                lb.fused_gate_first = True
            elif close(act[1](u) * g, d_in, 1e-4):
                lb.fused_gate_first = False
            else:
                raise StructureError(
                    f"{where}: the fused gate_up projection's halves do not explain the MLP activation."
                )
    elif lb.gate_proj is not None and lb.up_proj is not None:
        order_gate_up(lb, rec)
