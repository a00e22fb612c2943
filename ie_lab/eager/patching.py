"""Activation patching and gradients with respect to points (attribution patching); patch_sweep is in sweep.py, the
checks every patching operation shares in patch_checks.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..address import Address, AddressLike, layer_list
from ..cache import Cache
from ..core.addresses import parse_addresses, slice_head
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..core.results import PatchGrid
from ..errors import CapabilityUnsupported, InputError, StructureError
from .capture import capture_batch
from .grad_support import grad_support
from .means import auto_batch_size
from .model import lm_of
from .patch_checks import Metric, check_metric, check_patchable, check_positions, plain_forward, replacement, scalar
from .sweep import patch_sweep
from .taps import Taps
from .writers import WRITABLE, Writers


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"logit_diff: {name} must be an integer, got {value!r} ({type(value).__name__}).")
    return value


def logit_diff(good: int, bad: int, position: int = -1) -> Metric:
    """A metric: logit[good] - logit[bad] at one position (the last by default), averaged over the batch."""
    good, bad, position = _int_arg("good", good), _int_arg("bad", bad), _int_arg("position", position)
    for name, tok in (("good", good), ("bad", bad)):
        if tok < 0:
            raise InputError(f"logit_diff: {name} is a token id, so it cannot be negative (got {tok}).")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        seq, vocab = logits.shape[1], logits.shape[-1]
        for name, tok in (("good", good), ("bad", bad)):
            if tok >= vocab:
                raise InputError(f"logit_diff: {name} token id {tok} is outside the vocabulary (0..{vocab - 1}).")
        if not -seq <= position < seq:
            raise InputError(f"logit_diff: position {position} is outside the {seq}-token prompt.")
        return (logits[:, position, good] - logits[:, position, bad]).mean()

    metric.__name__ = f"logit_diff({good}, {bad})"
    return metric


def run_with_patches(
    model: Any, prompt: Any, patches: Mapping[AddressLike, torch.Tensor], *, positions: Sequence[int] | None = None
) -> torch.Tensor:
    """Run prompt with the given points replaced (at all positions, or only `positions`); returns logits."""
    lm = lm_of(model)
    if not isinstance(patches, Mapping):
        raise InputError(f"patches must be a dict {{address: tensor}}, got {type(patches).__name__}.")
    ids, mask = prepare(lm, prompt)
    positions = check_positions(positions, ids.shape[1])
    edits = []
    for a, t in patches.items():
        addr = parse_addresses(lm, [a])[0]
        if addr.name not in WRITABLE:
            raise CapabilityUnsupported(
                f"patching {addr.name}",
                "its value is read inside the attention call, so a replacement would not flow on.",
                "patch z, attn_out or a residual point.",
            )
        expected = (ids.shape[0], ids.shape[1])
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[:2]) != expected:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(
                f"the patch for {addr} has shape {got} but this prompt needs [batch={expected[0]}, "
                f"seq={expected[1]}, width]; patch sources must come from a prompt of the same length."
            )
        width = _width(lm, addr)
        if width is not None and t.shape[-1] != width:
            raise InputError(
                f"the patch for {addr} is {t.shape[-1]} wide, but {addr.name} is {width} wide on this "
                "model; patch with a tensor captured at the same point."
            )
        if not t.is_floating_point():
            raise InputError(
                f"the patch for {addr} has dtype {t.dtype}; activations are floating point (capture "
                "the source, or convert with .float())."
            )
        if not bool(torch.isfinite(t).all()):
            raise InputError(
                f"the patch for {addr} contains nan or inf values; they would spread through every later layer."
            )
        edits.append((addr, replacement(t, positions)))
    with lm.lock, torch.no_grad(), Writers(lm, edits) as w:
        w.shape = (ids.shape[0], ids.shape[1])
        return plain_forward(lm, ids, mask)


def _width(lm: Any, addr: Address) -> int | None:
    """The last-axis width of a writable point on this model (None where it depends on the layer's experts)."""
    from ..points import Width

    f = lm.facts
    return {
        Width.D_MODEL: f.d_model,
        Width.HEADS: f.n_heads * f.head_dim,
        Width.KV_HEADS: f.n_kv_heads * f.head_dim,
    }.get(addr.point.width, None)


def patch(
    model: Any,
    prompt: Any,
    source: Cache | Any,
    addresses: AddressLike | Iterable[AddressLike],
    *,
    positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Run `prompt` with `addresses` taken from `source` (a Cache, or another prompt to capture them from)."""
    lm = lm_of(model)
    addrs = parse_addresses(lm, addresses)
    if not isinstance(source, Cache):
        source = capture_batch(lm, source, addrs)
    return run_with_patches(lm, prompt, {a: source[a] for a in addrs}, positions=positions)


def gradients(
    model: Any,
    prompt: Any,
    metric: Callable[[Any], Any],
    addresses: AddressLike | Iterable[AddressLike],
    *,
    of: AddressLike | Iterable[AddressLike] | None = None,
) -> Cache:
    """d metric / d point for each address (the total derivative through everything downstream).

    The metric receives the logits [batch, seq, vocab] by default; with ``of="resid_post.3"`` the tensor of
    that point instead, with ``of=[...]`` a Cache of those points (read in the same forward, so any point
    capture serves can be measured, including attention patterns). It returns a scalar tensor.
    """
    lm = lm_of(model)
    if getattr(lm, "backend", "eager") != "eager":
        raise CapabilityUnsupported(
            "gradients",
            f"the {lm.backend} backend runs inference kernels without autograd.",
            "load the model with backend='eager'.",
        )
    grad_support(lm).require("gradients")  # before any hook: what blocks autograd on this model, named
    if not callable(metric):
        raise InputError(
            f"metric must be a function returning a scalar tensor, got {type(metric).__name__}; e.g. "
            "ie_lab.logit_diff(good_id, bad_id), or lambda t: t[0, -1].norm() with of='resid_post.1'."
        )
    addrs = parse_addresses(lm, addresses)
    for a in addrs:
        if a.name not in WRITABLE:
            raise CapabilityUnsupported(
                f"gradients with respect to {a.name}",
                "it is read inside the attention call, off the autograd path ie_lab can tap.",
                "take gradients with respect to z or a residual point.",
            )
    single = isinstance(of, (str, Address))
    measured = parse_addresses(lm, of) if of is not None else []
    ids, mask = prepare(lm, prompt)
    leaves: dict[Address, torch.Tensor] = {}

    def probe(a: Address):
        def edit(t: torch.Tensor, off: int) -> torch.Tensor:
            leaf = torch.zeros_like(t, requires_grad=True)
            leaves[a] = leaf
            return t + leaf  # same value; its gradient is d metric / d point

        return edit

    taps = Taps(lm, measured, grad=True) if measured else None  # refuses absent points before any hook exists
    with contextlib.ExitStack() as stack:
        stack.enter_context(lm.lock)
        stack.enter_context(torch.enable_grad())
        w = stack.enter_context(Writers(lm, [(a, probe(a)) for a in addrs]))
        w.shape = (ids.shape[0], ids.shape[1])
        if taps is not None:
            stack.enter_context(taps)
            taps.shape = w.shape
        logits = plain_forward(lm, ids, mask)
        if taps is None:
            arg: Any = logits
        else:
            seen = {}
            for m in measured:
                parts = taps.collected.get(m.without_head(), [])
                if len(parts) != 1:
                    raise StructureError(
                        f"{m} was seen {len(parts)} times in one forward (expected once), so "
                        "ie_lab will not pick one to measure."
                    )
                seen[m] = slice_head(m, parts[0], lm.facts)
            arg = seen[measured[0]] if single else Cache(seen, tokens=ids, str_tokens=str_tokens(lm, ids))
        value = metric(arg)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = "the logits" if taps is None else ("the point's tensor" if single else "the cache of points")
            raise InputError(
                f"the metric must return a scalar tensor computed from {what}, got "
                f"{type(value).__name__}"
                + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else "")
                + "; reduce it, e.g. with .sum() or .mean()."
            )
        # A metric read upstream of every point (or not from the model at all) does not depend on them: zeros.
        grads = (
            torch.autograd.grad(value, [leaves[a] for a in addrs], allow_unused=True)
            if value.requires_grad
            else [None] * len(addrs)
        )
    out = {a: (g if g is not None else torch.zeros_like(leaves[a])).detach() for a, g in zip(addrs, grads)}
    return Cache(out, tokens=ids, str_tokens=str_tokens(lm, ids))


def attribution_patch(
    model: Any,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    point: str = "resid_pre",
    layers: Sequence[int] | None = None,
) -> PatchGrid:
    """The linear estimate of patch_sweep: grad(corrupted) · (clean - corrupted) per layer and position."""
    lm = lm_of(model)
    check_metric(metric)
    layers = layer_list(layers, lm.facts)
    check_patchable(point)
    addrs = [Address(point, L) for L in layers]
    fused = _clean_and_corrupted(lm, clean, corrupted, addrs, metric)
    g = gradients(lm, corrupted, metric, addrs)
    if fused is not None:
        c, x, clean_m, corr_m, tokens = fused
    else:
        cc, xc = capture_batch(lm, clean, addrs), capture_batch(lm, corrupted, addrs)
        assert cc.tokens is not None and xc.tokens is not None  # a captured Cache has them
        with torch.no_grad():
            corr_m = scalar(metric(plain_forward(lm, xc.tokens, None)))
            clean_m = scalar(metric(plain_forward(lm, cc.tokens, None)))
        c, x, tokens = {a: cc[a] for a in addrs}, {a: xc[a] for a in addrs}, xc.tokens
    vals = torch.stack([((c[a] - x[a]) * g[a]).sum(-1)[0] for a in addrs]) + corr_m
    cols = [f"{p}:{t}" for p, t in enumerate(str_tokens(lm, tokens)[0])]
    return PatchGrid(vals, [str(a) for a in addrs], cols, clean_m, corr_m, getattr(metric, "__name__", "metric"))


def _clean_and_corrupted(
    lm: Any, clean: Any, corrupted: Any, addrs: list[Address], metric: Metric
) -> tuple[dict[Address, torch.Tensor], dict[Address, torch.Tensor], float, float, torch.Tensor] | None:
    """attribution_patch's reads of both prompts in one forward: the points and the metric of clean and corrupted,
    stacked as one batch. None (each read alone, as before) where they cannot share one: not two prompts of the
    same length, or more rows than ie_lab.sizing fits in the activation budget."""
    if prepare_prompts(lm, clean) is not None or prepare_prompts(lm, corrupted) is not None:
        return None
    cids, xids = prepare(lm, clean)[0], prepare(lm, corrupted)[0]
    b = cids.shape[0]
    if cids.shape != xids.shape or 2 * b > auto_batch_size(lm, int(cids.shape[1]), len(addrs)):
        return None
    ids = torch.cat([cids, xids])
    with lm.lock, torch.no_grad(), Taps(lm, addrs) as taps:
        taps.shape = (ids.shape[0], ids.shape[1])
        logits = plain_forward(lm, ids, None)
    got = {a: taps.collected[a.without_head()] for a in addrs}
    if any(len(parts) != 1 for parts in got.values()):
        return None  # a point seen more than once per forward: read each prompt alone
    c = {a: slice_head(a, parts[0][:b], lm.facts) for a, parts in got.items()}
    x = {a: slice_head(a, parts[0][b:], lm.facts) for a, parts in got.items()}
    return c, x, scalar(metric(logits[:b])), scalar(metric(logits[b:])), xids


# patch_sweep is the package's and the eager backend's through this module, beside patch (the same operation per cell)
__all__ = [
    "Metric",
    "attribution_patch",
    "gradients",
    "logit_diff",
    "patch",
    "patch_sweep",
    "run_with_patches",
]
