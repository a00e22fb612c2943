"""Difference-of-means vectors over prompt lists, captured in memory-bounded batches."""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from ..address import AddressLike
from ..core.addresses import parse_addresses
from ..core.inputs import prepare, prepare_prompts
from ..errors import InputError, check_flag
from .capture import _capture_many
from .model import lm_of

# Activation memory one batched forward may take when no batch_size is given. Fixed rather than read from the
# device: the free memory reported moves with every other allocation, and a reproducible batch split is
# easier to reason about (the results do not depend on it; only speed does).
DEFAULT_BUDGET_BYTES = 1024**3


def check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(
            f"batch_size must be a positive integer (rows per forward) or None to size it from "
            f"ie_lab.sizing, got {batch_size!r}."
        )
    return batch_size


def auto_batch_size(lm: Any, n_tokens: int, points: int) -> int:
    from ..sizing import BYTES, batch_size_for

    dtype = str(lm.dtype).replace("torch.", "")
    return batch_size_for(
        lm.facts, n_tokens, points, DEFAULT_BUDGET_BYTES, dtype=dtype if dtype in BYTES else "float32"
    )


def _rows(lm: Any, prompts: Any, side: str) -> list[torch.Tensor]:
    if isinstance(prompts, (list, tuple)) and len(prompts) == 0:
        raise InputError(f"{side} is empty: a difference of means needs at least one prompt on each side.")
    try:
        rows = prepare_prompts(lm, prompts)
        return rows if rows is not None else [prepare(lm, prompts)[0]]  # a single prompt is a list of one
    except InputError as e:
        raise InputError(f"{side}: {e}") from None


def mean_activation(lm: Any, prompts: Any, address: AddressLike, *, batch_size: int | None = None) -> torch.Tensor:
    """The mean over prompts of each prompt's mean over its own tokens at `address` (float32, on the CPU).

    Each prompt counts once whatever its length, and padding never enters: the batched capture hands back each
    prompt's own rows."""
    lm = lm_of(lm)
    addr = parse_addresses(lm, address)
    _one_point(addr)
    batch_size = check_batch_size(batch_size)
    rows = _rows(lm, prompts, "prompts")
    return _mean(lm, rows, addr, batch_size)


def _one_point(addr: list) -> None:
    if len(addr) != 1:
        raise InputError(f"address must name one point, got {len(addr)}: {[str(a) for a in addr]}.")
    if addr[0].point.is_attention:
        raise InputError(
            f"{addr[0]} is an attention matrix, not a per-token activation: a mean over tokens of it "
            "is no steering direction; use a residual point such as resid_post."
        )


def _mean(lm: Any, rows: list[torch.Tensor], addr: list, batch_size: int | None, bar: Any = None) -> torch.Tensor:
    a = addr[0]
    if batch_size is None:
        batch_size = auto_batch_size(lm, max(r.shape[1] for r in rows), 1)
    per_prompt = []
    for i in range(0, len(rows), batch_size):
        for c in _capture_many(lm, rows[i : i + batch_size], addr, False):
            per_prompt.append(c[a][0].float().mean(0).cpu())
        if bar is not None:
            bar.update(len(rows[i : i + batch_size]))
    return torch.stack(per_prompt).mean(0)


def mean_difference(
    model: Any,
    positive: Any,
    negative: Any,
    address: AddressLike,
    *,
    batch_size: int | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """A steering vector: mean(positive) - mean(negative) at `address`, each side a list of prompts.

    Each prompt is averaged over its own tokens, then the prompts of a side are averaged, exactly as capturing
    one prompt at a time; the prompts run in batches of `batch_size` rows (None: sized from ie_lab.sizing for
    the longest prompt, see sizing.batch_size_for). The answer does not depend on the batch size.
    progress: the same kind of bar as loading and patch_sweep, counting prompts; shown only when a side's
    prompts take more than one forward (a bar that flashes past on a short call is noise).
    """
    lm = lm_of(model)
    addr = parse_addresses(lm, address)
    _one_point(addr)
    batch_size = check_batch_size(batch_size)
    check_flag("progress", progress)
    pos, neg = _rows(lm, positive, "positive"), _rows(lm, negative, "negative")  # all checked before any forward
    n = len(pos) + len(neg)
    per_side = [batch_size or auto_batch_size(lm, max(r.shape[1] for r in side), 1) for side in (pos, neg)]
    forwards = sum(-(-len(side) // b) for side, b in zip((pos, neg), per_side))
    with tqdm(total=n, desc=f"mean difference {addr[0]}", disable=not progress or forwards <= 2, leave=False) as bar:
        return _mean(lm, pos, addr, per_side[0], bar) - _mean(lm, neg, addr, per_side[1], bar)
