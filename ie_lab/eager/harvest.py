"""harvest on the eager backend: the driver of ie_lab/corpus/run.py over the batched capture (eager/capture.py's
right-padded forward, as capturing a list of prompts runs it), each prompt's own rows cut out, so padding never
reaches a shard. Each point's batch crosses to the CPU in one copy and is cut there: one device transfer per point
and batch, not one per prompt."""

from __future__ import annotations

from typing import Any

import torch

from ..address import AddressLike
from ..core.addresses import parse_addresses
from ..corpus import Activations
from ..corpus.run import DEFAULT_MAX_TOKENS, DEFAULT_SHARD_ROWS, Harvester
from .capture import _capture_ids, right_padded
from .means import auto_batch_size, check_batch_size
from .model import lm_of


def harvest(
    model: Any,
    texts_or_dataset: Any,
    addresses: AddressLike | list[AddressLike],
    out_dir: Any,
    *,
    batch_size: int | None = None,
    max_tokens_per_prompt: int | None = DEFAULT_MAX_TOKENS,
    text_column: str = "text",
    shard_rows: int = DEFAULT_SHARD_ROWS,
    progress: bool = True,
    sae: Any = None,
    top_k: int = 32,
    prepend_bos: bool | None = None,
) -> Activations:
    """Activations at `addresses` over every prompt of texts_or_dataset, written to out_dir in shards as the model
    runs (docs/HARVEST.md); calling it again with the same arguments resumes after the last committed shard.

    batch_size: prompts per forward (None: sized from ie_lab.sizing for max_tokens_per_prompt tokens a prompt);
    max_tokens_per_prompt: a longer prompt keeps its first tokens (None: whole); shard_rows: rows buffered before
    a shard is written and committed (a killed run loses at most these); progress: a bar counting tokens (tok/s);
    sae: an ie_lab SAE whose features are kept too, sparse, with each feature's top_k rows (its point is captured
    whether or not `addresses` names it); prepend_bos: True / False put a BOS token first in each text or not (None:
    the tokenizer's own choice)."""
    lm = lm_of(model)
    addrs = parse_addresses(lm, addresses) if addresses else []
    batch_size = check_batch_size(batch_size)
    if batch_size is None:
        batch_size = auto_batch_size(lm, max_tokens_per_prompt or lm.facts.max_positions or 2048, len(addrs))
    h = Harvester(
        lm,
        texts_or_dataset,
        addrs,
        out_dir,
        batch_size=batch_size,
        max_tokens_per_prompt=max_tokens_per_prompt,
        text_column=text_column,
        shard_rows=shard_rows,
        progress=progress,
        sae=sae,
        top_k=top_k,
        prepend_bos=prepend_bos,
    )
    try:
        for batch in h.batches():
            h.add(batch, _batch_rows(lm, [ids for _, ids in batch], h.capture_addrs))
        return h.finish()
    finally:
        h.close()


def _batch_rows(lm: Any, rows: list[torch.Tensor], addrs: list) -> list[dict[str, torch.Tensor]]:
    """One right-padded forward over the prompts (each keeps its positions 0..n-1; the mask hides the pads and a
    causal model's real tokens never read the pads after them), then each prompt's [n, width] rows per point."""
    ids, mask, lens = right_padded(rows)
    cache = _capture_ids(lm, ids, mask, addrs, False)
    on_cpu = {str(a): cache[a].to("cpu") for a in addrs}  # [batch, seq, width]: one copy per point
    return [{name: t[i, :n] for name, t in on_cpu.items()} for i, n in enumerate(lens)]
