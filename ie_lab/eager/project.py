"""project(): per-token scores of one point against probe directions or an SAE encoder, computed in the hook.

The hook that reads the point applies ie_lab/ops/projection.py to the rows as they pass and keeps only the
[tokens, k] scores, never the full-width activation. ``make_encoder`` is the one place that checks what a
user may pass (shared with the vLLM backend, which ships the checked encoder to its worker). See
docs/PROJECTION.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..errors import AddressError, CapabilityUnsupported, InputError, StructureError
from ..ops.projection import ACTIVATIONS, Encoder, scores
from ..points import Width
from .inputs import prepare, str_tokens
from .model import lm_of
from .taps import Taps

SAE_KEYS = ("W_enc", "b_enc", "b_dec", "threshold")


@dataclass
class Projection:
    """Scores of one prompt: ``scores`` [tokens, k] float32, one row per token the model read.

    With max_new_tokens > 0 the rows cover the prompt and every generated token but the last (which the model
    never reads); ``generated`` holds the generated ids and ``text`` their decoding."""

    address: Address
    scores: torch.Tensor
    tokens: torch.Tensor  # the ids the rows belong to, [tokens]
    str_tokens: list[str]
    generated: list[int] = field(default_factory=list)
    text: str = ""

    def top(self, n: int = 5) -> list[list[tuple[int, float]]]:
        """Per token: the n highest-scoring (feature, score) pairs."""
        n = min(int(n), self.scores.shape[-1])
        vals, idx = self.scores.topk(n, dim=-1)
        return [[(int(i), float(v)) for i, v in zip(ri, rv)] for ri, rv in zip(idx, vals)]

    def __repr__(self) -> str:
        gen = f", {len(self.generated)} generated" if self.generated else ""
        return f"Projection({self.address}: scores {list(self.scores.shape)}{gen})"


# ---- checks -------------------------------------------------------------------------------------------

def point_width(addr: Address, facts: Any) -> int:
    """The width of one row of addr, refusing points whose rows are not per-token vectors."""
    w = addr.point.width
    if w is Width.ATTN:
        raise AddressError(f"address {addr}: attention patterns are [heads, query, key] matrices, not per-token "
                           "vectors; project a per-token point such as 'z.L' or 'resid_post.L'.")
    if w is Width.STREAMS or addr.stream is not None:
        raise AddressError(f"address {addr}: per-stream points are not projected; use a single-stream point.")
    if addr.head is not None:
        return int(facts.head_dim)
    return int({Width.D_MODEL: facts.d_model, Width.HEADS: facts.n_heads * facts.head_dim,
                Width.KV_HEADS: facts.n_kv_heads * facts.head_dim, Width.D_MLP: facts.d_mlp,
                Width.EXPERTS: facts.n_experts, Width.VOCAB: facts.vocab_size}[w])


def _tensor(name: str, x: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """x as a finite float32 CPU tensor of exactly `shape`, or an InputError naming `name`."""
    if not isinstance(x, torch.Tensor):
        try:
            import numpy as np

            if isinstance(x, np.ndarray):
                x = torch.from_numpy(x)
        except ImportError:  # pragma: no cover - numpy ships with torch
            pass
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name} must be a tensor ({what}, shape {list(shape)}), got {type(x).__name__}.")
    if not x.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor ({what}), got dtype {x.dtype}.")
    if tuple(x.shape) != tuple(shape):
        raise InputError(f"{name} has shape {list(x.shape)}; expected {list(shape)} ({what}).")
    x = x.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise InputError(f"{name} has non-finite values (NaN or inf); pass finite numbers.")
    return x.contiguous()


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    if not str(path).endswith(".safetensors"):
        raise InputError(f"directions={path!r}: only a .safetensors file is loaded (never a pickle); pass a "
                         "tensor, a dict of tensors, or a path ending in .safetensors.")
    if not os.path.isfile(path):
        raise InputError(f"directions={path!r}: no such file.")
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def make_encoder(d: int, directions: Any, *, bias: Any = None, activation: str | None = None,
                 threshold: Any = None, k: Any = None) -> Encoder:
    """Check what a user passed and return the Encoder that ops/projection.py applies to rows of width d.

    directions: a [k, d] tensor (probes: one direction a row; bias [k] optional), or an SAE's encoder as a dict
    with SAELens' names W_enc [d, k], b_enc [k], b_dec [d] (optional) and threshold [k] (JumpReLU), or the
    path of a .safetensors file holding that dict."""
    if isinstance(directions, (str, os.PathLike)):
        directions = _load_safetensors(os.fspath(directions))
    if activation is not None and activation not in ACTIVATIONS:
        raise InputError(f"activation={activation!r} is not known; use one of {list(ACTIVATIONS)}.")
    b_dec = None
    if isinstance(directions, dict):
        unknown = sorted(set(directions) - set(SAE_KEYS))
        if unknown:
            raise InputError(f"directions: unknown key(s) {unknown}; an SAE encoder takes {list(SAE_KEYS)} "
                             "(SAELens' names).")
        if "W_enc" not in directions:
            raise InputError("directions: an SAE encoder dict needs 'W_enc' [d, k].")
        if bias is not None:
            raise InputError("bias= is for a probe matrix; an SAE dict carries its own 'b_enc'.")
        W_raw = directions["W_enc"]
        if not isinstance(W_raw, torch.Tensor) or W_raw.dim() != 2:
            raise InputError(f"directions['W_enc'] must be a 2-D tensor [d, k], got "
                             f"{getattr(W_raw, 'shape', type(W_raw).__name__)}.")
        n = int(W_raw.shape[1])
        W = _tensor("directions['W_enc']", W_raw, (d, n), f"d = {d} rows, the width of the point")
        b = _tensor("directions['b_enc']", directions["b_enc"], (n,), "one per feature") \
            if directions.get("b_enc") is not None else None
        b_dec = _tensor("directions['b_dec']", directions["b_dec"], (d,), "subtracted before encoding") \
            if directions.get("b_dec") is not None else None
        if threshold is None and directions.get("threshold") is not None:
            threshold = directions["threshold"]
        if activation is None:
            activation = "jumprelu" if threshold is not None else "relu"
    else:
        if not isinstance(directions, torch.Tensor) or directions.dim() != 2:
            raise InputError(f"directions must be a [k, d] tensor of probe directions, a dict with 'W_enc', or a "
                             f".safetensors path; got {getattr(directions, 'shape', type(directions).__name__)}.")
        n = int(directions.shape[0])
        # kept a view (not made contiguous): the scores are x @ directions.T exactly, as a user writes it
        W = _tensor("directions", directions, (n, d), f"k directions of width d = {d}, the point's width").T
        b = _tensor("bias", bias, (n,), "one per direction") if bias is not None else None
        if activation is None:
            activation = "none"
    if n < 1:
        raise InputError("directions has no directions (k = 0); pass at least one.")
    thr = None
    if activation == "jumprelu":
        if threshold is None:
            raise InputError("activation='jumprelu' needs threshold= (a number, or a [k] tensor, one per feature).")
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            if not math.isfinite(threshold):
                raise InputError("threshold is not finite; pass a finite number or a [k] tensor.")
            threshold = torch.full((n,), float(threshold))
        thr = _tensor("threshold", threshold, (n,), "one per feature")
    elif threshold is not None:
        raise InputError(f"threshold= applies to activation='jumprelu' only (activation is {activation!r}).")
    topk = None
    if activation == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise InputError(f"k={k!r}: activation='topk' needs k, an int from 1 to the number of features ({n}).")
        topk = int(k)
    elif k is not None:
        raise InputError(f"k= applies to activation='topk' only (activation is {activation!r}).")
    return Encoder(W, b, b_dec, activation, thr, topk)


def one_address(lm: Any, address: Any) -> Address:
    if isinstance(address, (list, tuple)):
        raise AddressError("address: project takes one address (a string like 'resid_post.3'); call it once per "
                           "point.")
    return Address.parse(address).check(lm.facts)


GEN_KEYS = frozenset({"temperature", "top_k", "top_p", "seed", "stop", "ignore_eos"})


def check_gen(max_new_tokens: Any, gen: dict) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: an int >= 0 (0 projects the prompt only).")
    unknown = sorted(set(gen) - GEN_KEYS)
    if unknown:
        raise InputError(f"unknown argument(s) {unknown}; project takes the generation arguments {sorted(GEN_KEYS)}.")
    return max_new_tokens


# ---- the hooks ------------------------------------------------------------------------------------------

class _ProjTaps(Taps):
    """Taps that keep the scores of each forward's rows instead of the rows themselves."""

    def __init__(self, lm: Any, addr: Address, enc: Encoder):
        super().__init__(lm, [addr])
        self.addr, self.enc = addr, enc
        self.parts: list[torch.Tensor] = []
        self._shape_handle = None

    def _keep(self, base: Address, t: torch.Tensor) -> None:
        b, s = self.shape
        if t.dim() == 2 and b and t.shape[0] == b * s:
            t = t.reshape(b, s, -1)  # layers that flatten tokens around the MLP (OPT)
        if self.addr.head is not None:
            from .capture import slice_head

            t = slice_head(self.addr, t, self.lm.facts)
        if t.shape[-1] != self.enc.d:
            raise StructureError(f"{self.addr} came out {t.shape[-1]} wide where {self.enc.d} was expected.")
        self.parts.append(scores(t.detach(), self.enc))

    def __enter__(self) -> "_ProjTaps":
        def shape(mod, args, kwargs):  # (batch, new tokens) of each forward, for the flattening families
            if not self._mine():
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            if ids is not None:
                self.shape = (int(ids.shape[0]), int(ids.shape[1]))
        self._shape_handle = self.lm.hf.register_forward_pre_hook(shape, with_kwargs=True)
        try:
            return super().__enter__()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._shape_handle is not None:
            self._shape_handle.remove()
            self._shape_handle = None
        super().close()


def project(model: Any, prompt: Any, address: Any, directions: Any, *, bias: Any = None,
            activation: str | None = None, threshold: Any = None, k: Any = None, max_new_tokens: int = 0,
            steer: Any = None, **gen: Any) -> Projection:
    """Per-token scores [tokens, k] of `address` against probe directions or an SAE encoder (docs/PROJECTION.md).

    Every argument is checked before a hook is placed. With max_new_tokens > 0 the model generates (greedy
    unless temperature= etc.) and the scores cover every token it read."""
    from .generate import generate
    from .steer import issued_specs, run_issued

    lm = lm_of(model)
    addr = one_address(lm, address)
    d = point_width(addr, lm.facts)
    n_new = check_gen(max_new_tokens, gen)
    enc = make_encoder(d, directions, bias=bias, activation=activation, threshold=threshold, k=k)
    specs = issued_specs(lm, steer)
    ids, mask = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise InputError("prompt: project takes one prompt per call (its scores are [tokens, k]); loop over prompts.")
    if mask is not None and not bool(mask.all()):
        raise InputError("prompt: the attention mask hides tokens; pass the prompt without padding.")
    generated: list[int] = []
    with lm.lock:  # re-entrant: the forwards below take it too; no other forward may pass through these hooks
        taps = _ProjTaps(lm, addr, enc)  # refuses a point this family lacks before any hook exists
        with taps:
            if n_new == 0:
                def forward():
                    with torch.no_grad():
                        lm.hf(input_ids=ids, use_cache=False)
                run_issued(lm, specs, forward)
            else:
                res = generate(lm, ids, n_new, steer=specs, keep_logits=False, **gen)
                generated = [int(t) for t in res.ids]
    if not taps.parts:
        raise CapabilityUnsupported(str(addr), "no forward passed through this point.", "use capture() to check it.")
    sc = torch.cat([p.reshape(-1, enc.k) for p in taps.parts])
    read = torch.cat([ids[0].cpu(), torch.tensor(generated, dtype=ids.dtype)])[: sc.shape[0]]
    if sc.shape[0] != read.shape[0]:
        raise StructureError(f"{addr}: {sc.shape[0]} rows for {read.shape[0]} tokens read; the point is seen more "
                             "than once per forward on this family.")
    tok = lm.tokenizer
    text = tok.decode(generated) if (tok is not None and generated) else ""
    return Projection(addr, sc, read, str_tokens(lm, read[None])[0], generated, text)
