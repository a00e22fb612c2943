"""Activation patching, patching sweeps, and gradients with respect to points (attribution patching)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..address import Address, AddressLike, layer_list
from ..cache import Cache
from ..core.addresses import parse_addresses, slice_head
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..core.results import PatchGrid
from ..errors import CapabilityUnsupported, InputError, StructureError, check_flag
from .capture import capture_batch
from .means import auto_batch_size
from .model import lm_of
from .taps import Taps
from .writers import WRITABLE, Edit, Writers

Metric = Callable[[torch.Tensor], Any]  # logits [batch, seq, vocab] -> scalar (gradients(of=...): a point or a Cache)


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


def _forward(lm: Any, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return lm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _check_positions(positions: Any, seq: int) -> list[int] | None:
    """Patch positions: None (every position) or distinct token indices inside the prompt (negative from the end)."""
    if positions is None:
        return None
    if isinstance(positions, (str, bytes)) or not isinstance(positions, (list, tuple, range, torch.Tensor)):
        raise InputError(
            f"positions must be a list of token indices (or None for every position), got {type(positions).__name__}."
        )
    items = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
    if isinstance(items, (int, float)):
        items = [items]
    if not items:
        raise InputError("positions is empty: name at least one token index, or pass None to patch every position.")
    out: list[int] = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, int):
            raise InputError(f"positions must be integer token indices, got {p!r} ({type(p).__name__}).")
        if not -seq <= p < seq:
            raise InputError(f"patch positions {items} are outside the {seq}-token prompt.")
        if p % seq in [q % seq for q in out]:
            raise InputError(f"positions names token {p % seq} twice; list each position once.")
        out.append(p)
    return out


def _check_metric(metric: Any) -> None:
    if not callable(metric):
        raise InputError(
            f"metric must be a function of the logits [batch, seq, vocab] returning a scalar, got "
            f"{type(metric).__name__}; e.g. ie_lab.logit_diff(good_id, bad_id)."
        )


def _replacement(src: torch.Tensor, positions: Sequence[int] | None) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def edit(t: torch.Tensor, offset: int) -> torch.Tensor:
        s = src.to(t)
        if positions is None:
            return s
        out = t.clone()
        out[:, list(positions)] = s[:, list(positions)]
        return out

    return edit


def run_with_patches(
    model: Any, prompt: Any, patches: Mapping[AddressLike, torch.Tensor], *, positions: Sequence[int] | None = None
) -> torch.Tensor:
    """Run prompt with the given points replaced (at all positions, or only `positions`); returns logits."""
    lm = lm_of(model)
    if not isinstance(patches, Mapping):
        raise InputError(f"patches must be a dict {{address: tensor}}, got {type(patches).__name__}.")
    ids, mask = prepare(lm, prompt)
    positions = _check_positions(positions, ids.shape[1])
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
        edits.append((addr, _replacement(t, positions)))
    with lm.lock, torch.no_grad(), Writers(lm, edits) as w:
        w.shape = (ids.shape[0], ids.shape[1])
        return _forward(lm, ids, mask)


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


def _scalar(x: Any) -> float:
    try:
        return float(x.detach() if isinstance(x, torch.Tensor) else x)
    except (TypeError, ValueError, RuntimeError):
        shape = f" of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else ""
        raise InputError(
            f"the metric must return a scalar (a number or a one-element tensor), got "
            f"{type(x).__name__}{shape}; reduce it, e.g. with .sum() or .mean()."
        ) from None


def patch_sweep(
    model: Any,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    *,
    point: str = "resid_pre",
    over: str = "layer_position",
    layers: Sequence[int] | None = None,
    progress: bool = True,
    batch_size: int | None = None,
) -> PatchGrid:
    """Patch clean activations into the corrupted run one cell at a time and record the metric.

    over="layer_position": every (layer, position) of `point`; over="layer_head": every (layer, head) of z.
    The cells run `batch_size` at a time: the corrupted prompt repeated, each row patched at its own cell, the
    metric read on each row alone (a [1, seq, vocab] slice, as unbatched). None sizes the batch from
    ie_lab.sizing.batch_size_for; batch_size=1 is one forward per cell. The grid does not depend on it.

    Over layer x position, where the model's facts allow it (softmax attention with transformers' plain KV cache
    in every layer, no steering in force), a forward whose first cell patches position p computes only positions
    p.. on top of the corrupted run's cached prefix, and the metric sees the corrupted run's logits before p:
    a patch at p changes nothing before it (docs/ATTENTION_AND_PATCHING.md, "How a sweep skips the prefix").
    """
    return _patch_sweep(
        model,
        clean,
        corrupted,
        metric,
        point=point,
        over=over,
        layers=layers,
        progress=progress,
        batch_size=batch_size,
        reuse_prefix=True,
    )


def _patch_sweep(
    model: Any,
    clean: Any,
    corrupted: Any,
    metric: Metric,
    *,
    point: str,
    over: str,
    layers: Sequence[int] | None,
    progress: bool,
    batch_size: int | None,
    reuse_prefix: bool,
) -> PatchGrid:
    """patch_sweep; reuse_prefix=False runs every cell's forward over the whole prompt (what it did before it
    reused the prefix: benchmarks/patch_sweep_batch.py compares the two)."""
    from tqdm.auto import tqdm

    lm = lm_of(model)
    if not isinstance(over, str) or over not in ("layer_position", "layer_head"):
        raise InputError(f"over must be 'layer_position' or 'layer_head', got {over!r}.")
    _check_metric(metric)
    check_flag("progress", progress)
    from .means import auto_batch_size, check_batch_size

    batch_size = check_batch_size(batch_size)
    point = "z" if over == "layer_head" else point
    layers = layer_list(layers, lm.facts)
    _check_patchable(point)
    c_ids, _ = prepare(lm, clean)
    x_ids, _ = prepare(lm, corrupted)
    if c_ids.shape != x_ids.shape:
        raise InputError(
            f"clean and corrupted prompts must have the same token length to patch position by "
            f"position (got {c_ids.shape[1]} and {x_ids.shape[1]})."
        )
    addrs = [Address(point, L).check(lm.facts) for L in layers]
    src = capture_batch(lm, c_ids, addrs)  # one id tensor: one Cache, as capture() returns for it
    base = _prefix_base(lm, x_ids) if reuse_prefix and over == "layer_position" else None
    with torch.no_grad():
        clean_m = _scalar(metric(_forward(lm, c_ids, None)))
        corr_m = _scalar(metric(base.logits if base is not None else _forward(lm, x_ids, None)))
    b, seq = x_ids.shape
    n_cols = seq if over == "layer_position" else lm.facts.n_heads
    grid = torch.zeros(len(layers), n_cols)
    if batch_size is None:
        batch_size = max(1, auto_batch_size(lm, seq, 0) // b)  # a cell is a block of b batch rows
    if base is not None:
        chunks = _prefix_chunks(len(addrs), seq, batch_size, b, _forward_overhead(x_ids.device))
    else:
        cells = [(i, j) for i in range(len(addrs)) for j in range(n_cols)]
        chunks = [cells[k : k + batch_size] for k in range(0, len(cells), batch_size)]
    bar = tqdm(total=len(addrs) * n_cols, desc=f"patching {point}", disable=not progress)
    try:
        for chunk in chunks:
            if base is not None:
                rows = _prefix_batch(lm, base, x_ids, src, addrs, chunk)
            else:
                rows = _sweep_batch(lm, x_ids, src, addrs, chunk, over)
            for (i, j), v in zip(chunk, rows):
                grid[i, j] = _scalar(metric(v))
            bar.update(len(chunk))
    finally:
        bar.close()
    cols = (
        [f"{p}:{t}" for p, t in enumerate(str_tokens(lm, x_ids)[0])]
        if over == "layer_position"
        else [f"head {h}" for h in range(n_cols)]
    )
    return PatchGrid(grid, [str(a) for a in addrs], cols, clean_m, corr_m, getattr(metric, "__name__", "metric"))


def _sweep_batch(
    lm: Any, x_ids: torch.Tensor, src: Cache, addrs: list[Address], chunk: list[tuple[int, int]], over: str
) -> list[torch.Tensor]:
    """One forward of the corrupted prompt repeated len(chunk) times, row r patched at cell chunk[r] only;
    the logits of each cell as a [batch, seq, vocab] tensor (what the metric sees unbatched)."""
    rows_of: dict[tuple[int, int | None], list[tuple[int, int]]] = {}
    for r, (i, j) in enumerate(chunk):
        # positions: one writer per layer, rows patched at their own position; heads: one per (layer, head)
        rows_of.setdefault((i, None) if over == "layer_position" else (i, j), []).append((r, j))
    b = x_ids.shape[0]  # a batched prompt: each cell is a block of b rows

    def block(r: int) -> slice:
        return slice(r * b, (r + 1) * b)

    edits: list[tuple[Address, Edit]] = []
    for (i, head), rs in rows_of.items():
        a = addrs[i]
        if over == "layer_position":

            def edit(t: torch.Tensor, off: int, s: torch.Tensor = src[a], rs: list = rs) -> torch.Tensor:
                out = t.clone()
                s = s.to(t)
                for r, j in rs:
                    out[block(r), j] = s[:, j]
                return out

            edits.append((a, edit))
        else:
            assert head is not None  # over="layer_head" keys every cell by its (layer, head)
            d = lm.facts.head_dim
            head_src = src[a][..., head * d : (head + 1) * d]

            def edit(t: torch.Tensor, off: int, s: torch.Tensor = head_src, rs: list = rs) -> torch.Tensor:
                out = t.clone()
                for r, _ in rs:
                    out[block(r)] = s.to(t)
                return out

            edits.append((Address("z", a.layer, head=head), edit))
    ids = x_ids.repeat(len(chunk), 1)
    with lm.lock, torch.no_grad(), Writers(lm, edits) as w:
        w.shape = (ids.shape[0], ids.shape[1])
        logits = _forward(lm, ids, None)
    return [logits[block(r)] for r in range(len(chunk))]


# ---- reusing the corrupted run's prefix --------------------------------------------------------------------
#
# A cell patches one position p of one layer. In a causal model nothing flows from p to an earlier position, so
# every position before p is, at every layer, what the unpatched corrupted run computed there: its keys and values
# included. So the corrupted prompt runs once with transformers' own KV cache, and a forward whose cells patch
# positions >= p runs positions p.. only, on a copy of that cache cropped to p and repeated over its rows. The
# metric is a function of the whole [batch, seq, vocab] logits, so the positions before p get the corrupted run's.
# The answer equals the full forward's up to float rounding (a cached forward multiplies the same numbers in a
# different grouping); tests/test_patch_sweep_prefix.py holds it to the per-cell sweep.


@dataclass(eq=False)
class _Prefix:
    """The corrupted run, once: its logits and, per cache layer, its keys and values [batch, kv heads, seq, dim]."""

    logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def _prefix_reusable(lm: Any) -> bool:
    """Whether this model's facts let a cell's forward start at its patched position: every layer mixes tokens by
    softmax attention over all earlier positions (no recurrent, convolutional or state-space mixer, whose state
    is not a per-position cache; no sliding window, whose cache drops positions), the forward hands back a KV
    cache, no experts with a capacity (the tokens of a forward compete for it, so a shorter forward would route
    differently), and no steering in force (its positions count from the start of each forward)."""
    from ..core.steer_scope import active_specs
    from .generate import _returns_a_kv_cache

    if active_specs(lm):
        return False
    if any(lb.mixer_kind for lb in lm.binding.layers) or any(lm.facts.mixer_kinds):
        return False
    if any(k not in ("", "global") for k in lm.facts.layer_kinds):
        return False
    cfg = lm.hf.config  # the attributes generate.check_batchable refuses a padded batch for, as well
    if any(getattr(cfg, a, None) for a in ("expert_capacity", "capacity_factor", "moe_capacity_factor")):
        return False
    return _returns_a_kv_cache(lm.hf)


def _prefix_base(lm: Any, x_ids: torch.Tensor) -> _Prefix | None:
    """The corrupted prompt run once with a KV cache, where the prefix may be reused; None where it may not:
    _prefix_reusable says no, or the cache that came back is not transformers' plain DynamicCache holding every
    position of every layer (measured on the cache itself: a sliding or state layer the facts did not name, a
    layer sharing another's keys)."""
    if not _prefix_reusable(lm):
        return None
    from .generate import _cache_keyword

    key = _cache_keyword(lm.hf)
    with lm.lock, torch.no_grad():
        out = lm.hf(input_ids=x_ids, use_cache=True)
    kv = _plain_kv(getattr(out, key, None), tuple(x_ids.shape))
    return _Prefix(out.logits, kv) if kv is not None else None


def _plain_kv(cache: Any, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or not getattr(cache, "layers", None):
        return None
    out = []
    for la in cache.layers:
        if type(la) is not DynamicLayer or not la.is_initialized:
            return None
        k, v = la.keys, la.values
        if k.dim() != 4 or v.dim() != 4 or (k.shape[0], k.shape[2]) != shape or (v.shape[0], v.shape[2]) != shape:
            return None
        out.append((k, v))
    return out


# What a forward costs beyond its tokens, in token-rows (one token of one row through the model). Measured on CPU
# (benchmarks/patch_sweep_batch.py, 2 threads): about 60 on the demo model (a 1.4 ms forward of one 32-token row, of
# which 0.47 ms scales with tokens) and 40 on the 25M bench model. Elsewhere (an accelerator) it is unmeasured and
# taken as large: as few forwards as the batch size allows.
_OVERHEAD_TOKENS = {"cpu": 64.0}


def _forward_overhead(device: torch.device) -> float:
    return _OVERHEAD_TOKENS.get(device.type, 1e9)


def _prefix_chunks(
    n_layers: int, seq: int, cap: int, rows_per_cell: int, overhead: float
) -> list[list[tuple[int, int]]]:
    """The cells (layer index, position) as forwards of at most `cap` cells: each forward every layer of a run of
    consecutive positions, computed from its first position on. Where to cut is chosen to minimise
    overhead x forwards + token-rows computed (a dynamic programme over positions): one position per forward
    computes least, one forward for many positions recomputes the later ones' shared stretch."""
    if n_layers > cap:  # one position's layers already fill a forward: no two positions share one
        return [[(i, j) for i in range(k, min(k + cap, n_layers))] for j in range(seq) for k in range(0, n_layers, cap)]
    per = cap // n_layers
    best = [0.0] * (seq + 1)
    cut = [seq] * (seq + 1)
    for a in range(seq - 1, -1, -1):
        best[a] = math.inf
        for e in range(a + 1, min(seq, a + per) + 1):
            c = overhead + rows_per_cell * n_layers * (e - a) * (seq - a) + best[e]
            if c < best[a]:
                best[a], cut[a] = c, e
    chunks, a = [], 0
    while a < seq:
        chunks.append([(i, j) for j in range(a, cut[a]) for i in range(n_layers)])
        a = cut[a]
    return chunks


def _prefix_batch(
    lm: Any, base: _Prefix, x_ids: torch.Tensor, src: Cache, addrs: list[Address], chunk: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """One forward for the cells of `chunk`, which patch positions >= p (its first cell's): positions p.. of the
    corrupted prompt, one row per cell and prompt row, on the base run's KV cache cropped to p; each cell's logits
    [batch, seq, vocab], the base run's before p."""
    from transformers.cache_utils import DynamicCache

    from .generate import _cache_keyword

    b, seq = x_ids.shape
    n, p = len(chunk), chunk[0][1]
    # Row k * n + r is prompt row k patched at cell chunk[r]: the order batch_repeat_interleave gives the cache.
    at: dict[int, list[tuple[int, int]]] = {}
    for r, (i, j) in enumerate(chunk):
        at.setdefault(i, []).append((r, j))
    edits: list[tuple[Address, Edit]] = []
    for i, rs in at.items():
        s = src[addrs[i]]
        rows = torch.tensor([k * n + r for k in range(b) for r, _ in rs], device=x_ids.device)
        pos = torch.tensor([j for _ in range(b) for _, j in rs], device=x_ids.device)
        prompt_rows = torch.arange(b).repeat_interleave(len(rs))
        vals = s[prompt_rows.to(s.device), pos.to(s.device)]

        def edit(t: torch.Tensor, off: int, rows=rows, pos=pos, vals=vals) -> torch.Tensor:
            out = t.clone()
            out[rows, pos - off] = vals.to(t)  # off: the positions the cache holds before this forward's first
            return out

        edits.append((addrs[i], edit))
    ids = x_ids[:, p:].repeat_interleave(n, 0)
    kwargs: dict[str, Any] = {"use_cache": False}
    if p:
        cache = DynamicCache(ddp_cache_data=base.kv)
        cache.crop(p - seq)  # a negative count: drop the positions from p on (every transformers 5 takes it)
        cache.batch_repeat_interleave(n)
        kwargs = {"use_cache": True, _cache_keyword(lm.hf): cache}
    with lm.lock, torch.no_grad(), Writers(lm, edits) as w:
        w.shape = (ids.shape[0], ids.shape[1])
        w.offset = p
        logits = lm.hf(input_ids=ids, **kwargs).logits
    if p:
        logits = torch.cat([base.logits[:, :p].repeat_interleave(n, 0).to(logits), logits], dim=1)
    return [logits[r::n] for r in range(n)]


def _check_patchable(point: Any) -> None:
    if not isinstance(point, str):
        raise InputError(
            f"point must be a point name such as 'resid_pre' (the layers come from layers=), got "
            f"{type(point).__name__}."
        )
    if point not in WRITABLE:
        from .. import points as _points

        if "." in point:
            raise InputError(
                f"point takes the name alone ({point.split('.')[0]!r}), not {point!r}: pick the layers "
                "with layers=[...]."
            )
        _points.get(point)  # an unknown name: the registry's error, with a suggestion
        raise CapabilityUnsupported(
            f"patching {point}",
            "its value is read inside the attention call, so a replacement would not flow on.",
            "patch z, attn_out or a residual point.",
        )


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
        logits = _forward(lm, ids, mask)
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
    _check_metric(metric)
    layers = layer_list(layers, lm.facts)
    _check_patchable(point)
    addrs = [Address(point, L) for L in layers]
    fused = _clean_and_corrupted(lm, clean, corrupted, addrs, metric)
    g = gradients(lm, corrupted, metric, addrs)
    if fused is not None:
        c, x, clean_m, corr_m, tokens = fused
    else:
        cc, xc = capture_batch(lm, clean, addrs), capture_batch(lm, corrupted, addrs)
        assert cc.tokens is not None and xc.tokens is not None  # a captured Cache has them
        with torch.no_grad():
            corr_m = _scalar(metric(_forward(lm, xc.tokens, None)))
            clean_m = _scalar(metric(_forward(lm, cc.tokens, None)))
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
        logits = _forward(lm, ids, None)
    got = {a: taps.collected[a.without_head()] for a in addrs}
    if any(len(parts) != 1 for parts in got.values()):
        return None  # a point seen more than once per forward: read each prompt alone
    c = {a: slice_head(a, parts[0][:b], lm.facts) for a, parts in got.items()}
    x = {a: slice_head(a, parts[0][b:], lm.facts) for a, parts in got.items()}
    return c, x, _scalar(metric(logits[:b])), _scalar(metric(logits[b:])), xids
