"""patch_sweep: every cell (layer x position, or layer x head) patched in batched forwards of the corrupted prompt,
each row at its own cell; over layer x position, each forward computes only the positions from its first patched
one on, on top of the corrupted run's cached prefix (docs/ATTENTION_AND_PATCHING.md, "How a sweep skips the
prefix")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..address import Address, layer_list
from ..cache import Cache
from ..core.inputs import prepare, str_tokens
from ..core.results import PatchGrid
from ..errors import InputError, check_flag
from .capture import capture_batch
from .means import auto_batch_size
from .model import lm_of
from .patch_checks import Metric, check_metric, check_patchable, plain_forward, scalar
from .writers import Edit, Writers


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
    check_metric(metric)
    check_flag("progress", progress)
    from .means import check_batch_size

    batch_size = check_batch_size(batch_size)
    point = "z" if over == "layer_head" else point
    layers = layer_list(layers, lm.facts)
    check_patchable(point)
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
        clean_m = scalar(metric(plain_forward(lm, c_ids, None)))
        corr_m = scalar(metric(base.logits if base is not None else plain_forward(lm, x_ids, None)))
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
                grid[i, j] = scalar(metric(v))
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
        logits = plain_forward(lm, ids, None)
    return [logits[block(r)] for r in range(len(chunk))]


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
