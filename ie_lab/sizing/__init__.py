"""Sizing from a config alone: parameters (counted on the meta device), weight bytes (quantization included), KV
cache per token (sliding windows, latent attention, SSM and linear-attention state), a roofline per GPU, and the
smallest GPU set with its vLLM settings. `ie_lab.sizing.size(model)`; `ie-lab size MODEL` on the command line;
docs/SIZING.md.

The older config-arithmetic helpers (estimate, table, batch_size_for) stay in .memory under their old names: the
batched operations size their batches with them.
"""

from .gpus import GPU, find_gpu
from .gpus import GPUS as GPU_TABLE
from .kv import CacheLayout, LayerCache, cache_layout
from .memory import BYTES, GIB, GPUS, Estimate, SizingTable, batch_size_for, estimate, forward_bytes_per_row, table
from .params import ParamCount, Quantization, count_params, quantization, resolve_config
from .recommend import Plan, Sizing, size


def panel(model, **kwargs):
    """The sizing panel for a notebook: `size(model, **kwargs)` shown as a table with the verdict on top."""
    from .view import SizingPanel

    return SizingPanel(size(model, **kwargs))


__all__ = [
    "BYTES",
    "GIB",
    "GPU",
    "GPUS",
    "GPU_TABLE",
    "CacheLayout",
    "Estimate",
    "LayerCache",
    "ParamCount",
    "Plan",
    "Quantization",
    "Sizing",
    "SizingTable",
    "batch_size_for",
    "cache_layout",
    "count_params",
    "estimate",
    "find_gpu",
    "forward_bytes_per_row",
    "panel",
    "quantization",
    "resolve_config",
    "size",
    "table",
]
