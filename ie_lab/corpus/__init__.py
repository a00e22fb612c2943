"""The corpus harvest (s.harvest, ie_lab.harvest): activations written to disk as the model runs, resumable, read back memory-mapped
(docs/HARVEST.md). shards.py owns the format, run.py the driver every backend runs its batched capture under,
activations.py the reader (Activations)."""

from .activations import Activations, Rows

__all__ = ["Activations", "Rows"]
