"""Measuring attention's structure on the probe forward: where z and the value are, and what sits between them.

The fused QKV layout, an output gate or a sub-norm between the kernel and the output projection, keys shared with an
earlier layer, latent attention's compressed latents; a kernel output that reaches the output projection by a step
none of these explain is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import StructureError
from ..ops.attention import divided_scores
from .binding import Binding, LayerBinding
from .config_facts import ArchFacts
from .recorder import PROBE_LEN, Recorder, close, same
from .spellings import (
    KV_LATENT_NORM_NAMES,
    KV_UP_NAMES,
    Q_LATENT_NORM_NAMES,
    Q_UP_NAMES,
    child,
    is_norm,
    reads_shared_kv,
)


def split_fused_qkv(x: torch.Tensor, layout: str, n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """The value slice of a fused QKV projection output, flattened to [.., n_kv*head_dim]."""
    lead = x.shape[:-1]
    if layout == "contiguous":
        return x[..., (n_heads + n_kv) * head_dim : (n_heads + 2 * n_kv) * head_dim]
    if layout == "per_head":
        return x.reshape(*lead, n_heads, 3, head_dim)[..., 2, :].reshape(*lead, n_heads * head_dim)
    if layout == "grouped":
        per = n_heads // n_kv
        return x.reshape(*lead, n_kv, per + 2, head_dim)[..., -1, :].reshape(*lead, n_kv * head_dim)
    if layout.startswith("blocks:"):  # measured per query head: where its value block starts in the fused output
        starts = [int(o) for o in layout[len("blocks:") :].split(",")][:: n_heads // n_kv]
        return torch.cat([x[..., o : o + head_dim] for o in starts], dim=-1)
    raise ValueError(layout)


def measure_fused_layout(
    qkv_out: torch.Tensor | None, z: torch.Tensor | None, probs: torch.Tensor | None, facts: ArchFacts
) -> str | None:
    """Which slicing of the fused QKV output, mixed by the measured probabilities, reproduces z."""
    if probs is None or qkv_out is None or z is None:
        return None
    H, KV, d = facts.n_heads, facts.n_kv_heads, facts.head_dim
    b, s, _ = z.shape
    for layout in ("contiguous", "per_head", "grouped"):
        try:
            v = split_fused_qkv(qkv_out, layout, H, KV, d)
        except RuntimeError:
            continue
        if v.shape[-1] != KV * d:
            continue
        vh = v.reshape(b, s, KV, d).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        zz = (probs.float() @ vh.float()).transpose(1, 2).reshape(b, s, H * d)
        if close(zz, z, 1e-4):
            return layout
    # None of the named layouts (CodeGen interleaves q, v, k per model-parallel shard): find, per query head, the
    # head_dim-wide block of the fused output that the head's probabilities mix into its slice of z.
    starts = []
    for h in range(H):
        zh = z[..., h * d : (h + 1) * d].float()
        found = next(
            (
                o
                for o in range(0, qkv_out.shape[-1] - d + 1, d)
                if close(probs[:, h].float() @ qkv_out[..., o : o + d].float(), zh, 1e-4)
            ),
            None,
        )
        if found is None:
            return None
        starts.append(found)
    return "blocks:" + ",".join(str(o) for o in starts)


GATE_FNS = ("sigmoid", "softplus")


_GATE_VIEWS = ("full", "per_head", "per_head_half")


def gate_values(
    t: torch.Tensor, view: str, fn: str, n_heads: int, width: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The gate a gated-attention layer multiplies into z, laid out like z ([.., width], width = n_heads*head_dim),
    from its gate module's output (plus a bias the attention module adds per head or per channel before activating
    it, Beam's gate_bias); None where this view does not fit the output's width."""
    lead, w = t.shape[:-1], t.shape[-1]
    if bias is not None:
        if bias.numel() == w:
            t = t + bias
        elif bias.numel() == n_heads and w % n_heads == 0:
            t = (t.reshape(*lead, n_heads, w // n_heads) + bias.reshape(n_heads, 1)).reshape(*lead, w)
        else:
            return None
    if view == "per_head_half":
        if w != 2 * width:
            return None
        t = t.reshape(*lead, n_heads, w // n_heads)[..., w // n_heads // 2 :].reshape(*lead, width)
    elif view == "per_head":
        if w != n_heads:
            return None
    elif w != width:
        return None
    g = torch.sigmoid(t) if fn == "sigmoid" else torch.nn.functional.softplus(t.float()).to(t.dtype)
    return g.repeat_interleave(width // n_heads, dim=-1) if view == "per_head" else g


def _measure_gate(lb: LayerBinding, rec: Recorder, out: torch.Tensor, z: torch.Tensor, n_heads: int) -> bool:
    """Whether z (o_proj's input) is the kernel's output times an activated gate read from one of the attention
    module's own linears (a gate projection, or the second half of each head of the query projection)."""
    # a bias parameter of the attention module itself (not of a child) may be added to the gate before activation
    biases = [None, *(p for p in lb.attn.parameters(recurse=False) if p.dim() == 1)]
    for name, m in lb.attn.named_children():
        G = rec.out(m)
        if not isinstance(m, nn.Linear) or m is lb.o_proj or G is None:
            continue
        for view in _GATE_VIEWS:
            for fn in GATE_FNS:
                for bias in biases:
                    g = gate_values(G, view, fn, n_heads, out.shape[-1], bias)
                    if g is None or g.shape != out.shape or m is lb.v_proj:
                        continue
                    if close(out * g, z, 1e-5):
                        lb.attn_gate, lb.attn_gate_view, lb.attn_gate_fn = m, view, fn
                        lb.attn_gate_bias = bias
                        lb.names["attn_gate"] = f"{lb.names.get('attn', 'attn')}.{name}"
                        return True
    return False


def weights_explain_output(call: Any) -> bool:
    """Whether the probabilities a kernel returns, mixed with its values, give its output. A kernel that rescales
    its output after the softmax (a sink applied as a per-row scale, GraniteSWA's eager path) returns weights that
    do not: its pattern is then rebuilt from q and k with the sink, as on fused kernels. No weights: nothing to
    check (the rebuild is used anyway)."""
    w, v, out = call.weights, call.value, call.output
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[-1] != v.shape[2]:
        return True
    v = v.repeat_interleave(w.shape[1] // v.shape[1], dim=1)
    z = (w.float() @ v.float()).transpose(1, 2)
    return close(z.reshape(out.shape), out.float(), 1e-4) if z.numel() == out.numel() else True


# What a module computing attention in its own step (arch.attention_tap.STEP) divides q·kᵀ by, where it says: GPT-J's
# and CodeGen's scale_attn, sqrt(head_dim). Read off the module, then kept only if the probe's probabilities agree.
STEP_DIVISOR_ATTR = "scale_attn"


def measure_step_divisor(attn: nn.Module, call: Any) -> float | None:
    """The divisor of q·kᵀ in the module's own attention step, where the probe saw that step run: kept only if the
    softmax of the scores so divided and masked is the probabilities the step returned, and those probabilities
    times its values its output. attn_scores is then read from the q and k that step receives (eager/sites.py);
    None (refused there) otherwise."""
    div = getattr(attn, STEP_DIVISOR_ATTR, None)
    if call is None or isinstance(div, bool) or not isinstance(div, (int, float)) or not div > 0:
        return None
    w, v, out = call.weights, call.value, call.output
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (w, v, out)) or w.shape[-1] != v.shape[2]:
        return None
    try:
        mixed = w.float() @ v.float().repeat_interleave(w.shape[1] // v.shape[1], dim=1)  # the step's [b, H, q, d]
        probs = torch.softmax(divided_scores(call.query, call.key, float(div), call.attention_mask), dim=-1)
    except RuntimeError:  # shapes that do not combine: not the step described above
        return None
    ok = close(mixed, out.float(), 1e-4) and probs.shape == w.shape and close(probs, w.float(), 1e-5)
    return float(div) if ok else None


def check_kernel_feeds_o_proj(lb: LayerBinding, rec: Recorder, family: str, n_heads: int = 0) -> None:
    """z is read at the output projection's input: refuse a layer where that is not what the kernel returned.

    Some families transform the attention output on its way to the projection (an output gate, a sub-norm, two
    kernel calls combined); serving the projection's input as z would then hand back a tensor that
    attn_probs @ value does not explain."""
    out, z = rec.kernel_outputs.get(id(lb.attn)), rec.inp(lb.o_proj)
    if out is None or z is None:
        return
    if out.dim() == 4:
        out = out.reshape(*out.shape[:2], -1)  # [b, s, H, d] -> [b, s, H*d], the projection's input layout
    if same(out, z):
        return
    sub = next((m for m in lb.attn.children() if is_norm(m) and same(rec.inp(m), out) and same(rec.out(m), z)), None)
    if sub is not None:  # a norm over the kernel's output feeds o_proj: z is what the kernel returned
        lb.z_sub_norm = sub
        return
    if out.shape[:-1] == z.shape[:-1] and out.shape[-1] != z.shape[-1] and lb.o_proj is not lb.attn:
        # The output projection reads a tensor of another width: a projection in two steps whose first step (and
        # any rotation before it) is the module's own code (DeepSeek-V4 rotates each head's output back, then
        # projects groups of heads to a low rank). z is the kernel's output, attn_probs @ value; nothing carries it
        # onward at a module boundary, so writing it is refused, as behind a sub-norm.
        lb.z_at_kernel_why = (
            f"the attention module transforms the kernel's output (width {out.shape[-1]}) into a tensor of another "
            f"width ({z.shape[-1]}) before its output projection reads it"
        )
        return
    if not (n_heads and out.shape == z.shape and _measure_gate(lb, rec, out, z, n_heads)):
        raise StructureError(
            f"{family} layer {lb.index}: the attention kernel's output is transformed before the output projection "
            "(an output gate, a norm or a second kernel call sits between them), and ie_lab does not bind that step "
            "yet, so z and the attention points would not be the tensors the model used."
        )


def measure_kv_sources(binding: Binding, rec: Recorder, seen: set[int]) -> None:
    """A layer whose attention has no key or value projection (reads_shared_kv) may read an earlier layer's: the
    earlier layer whose kernel call was handed the very keys this layer's was (KV sharing) is its kv_source. Where no
    earlier layer's keys are those (latent attention computes its keys from other projections), nothing is shared,
    and a query norm bound alone for it is dropped again (the QK-norm points then need both norms, as before)."""
    for lb in binding.layers:
        if lb.mixer_kind or lb.mlp_only or lb.k_norm is not None or not reads_shared_kv(lb.attn):
            continue
        key = rec.kernel_keys.get(id(lb.attn)) if id(lb.attn) in seen else None
        for src in binding.layers[: lb.index]:
            other = rec.kernel_keys.get(id(src.attn))
            if key is not None and other is not None and other.shape == key.shape and torch.equal(other, key):
                lb.kv_source = src.kv_source if src.kv_source is not None else src.index
                break
        else:
            lb.q_norm = None


def measure_latents(lb: LayerBinding, rec: Recorder, facts: ArchFacts) -> None:
    """Latent attention's compressed latents: a norm of the attention module whose output its up-projection reads.
    The key/value up-projection also needs the width its heads' blocks have (position-free key, then value)."""
    for norms, ups, role in ((Q_LATENT_NORM_NAMES, Q_UP_NAMES, "q"), (KV_LATENT_NORM_NAMES, KV_UP_NAMES, "kv")):
        norm, up = child(lb.attn, norms), child(lb.attn, ups)
        if norm is None or up is None or not same(rec.out(norm[1]), rec.inp(up[1])):
            continue
        if role == "q":
            lb.q_latent = norm[1]
            lb.names["q_latent"] = f"{lb.names.get('attn', 'attn')}.{norm[0]}"
            continue
        block = facts.qk_nope_head_dim + facts.value_head_dim
        width = getattr(up[1], "out_features", None)
        if facts.qk_nope_head_dim and width == facts.n_heads * block:
            lb.kv_latent, lb.kv_up = norm[1], up[1]
            lb.names["kv_latent"] = f"{lb.names.get('attn', 'attn')}.{norm[0]}"


def measure_qk_norm_layout(lb: LayerBinding, rec: Recorder) -> None:
    """Where the query norm's input puts the heads: flat [b,s,h*d], or per head with heads before or after the
    sequence axis (told apart by the probe's length, which no head count equals). A query norm the probe never
    reached is dropped with its key norm."""
    if lb.q_norm is not None:
        q_in = rec.inp(lb.q_norm)
        if q_in is not None and q_in.dim() == 4:
            lb.qk_norm_layout = "bshd" if q_in.shape[1] == PROBE_LEN else "bhsd"
        elif q_in is None:
            lb.q_norm = lb.k_norm = None
