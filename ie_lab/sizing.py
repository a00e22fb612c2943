"""Memory estimates from a config alone (no weights, no torch): weights, KV cache, capture buffers, and
which common GPU fits with what vLLM settings."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .arch.config_facts import ArchFacts

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1, "int4": 0.5}
# Usable memory of common accelerators in GiB (what the device reports, before any framework overhead).
GPUS = {"T4 16GB": 15.0, "L4 24GB": 22.0, "RTX 4090 24GB": 23.6, "A10G 24GB": 22.0, "A100 40GB": 39.4,
        "A100 80GB": 79.1, "H100 80GB": 79.1, "H200 141GB": 139.8, "B200 180GB": 178.0}
GIB = 1024 ** 3


@dataclass
class Estimate:
    facts: ArchFacts
    n_params: int
    dtype: str

    @property
    def weights_bytes(self) -> float:
        return self.n_params * BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer (sliding-window layers cap at the window, which this per-token figure ignores)."""
        return 2 * self.facts.n_layers * self.facts.n_kv_heads * self.facts.head_dim * BYTES[self.dtype]

    def capture_bytes(self, tokens: int, points_per_layer: int = 1, width: int | None = None) -> float:
        """Buffers for capturing `points_per_layer` d_model-wide points at every layer for `tokens` tokens."""
        w = width or self.facts.d_model
        return tokens * w * points_per_layer * self.facts.n_layers * BYTES[self.dtype]

    def fits(self, gpu_gib: float, context: int = 4096, gpu_memory_utilization: float = 0.9) -> dict[str, Any]:
        """Whether weights + one full context of KV fit, and how many concurrent full contexts vLLM could hold."""
        budget = gpu_gib * GIB * gpu_memory_utilization - self.weights_bytes - 1.0 * GIB  # activations/overhead
        seqs = int(budget // (self.kv_bytes_per_token * context)) if budget > 0 else 0
        return {"fits": seqs >= 1, "concurrent_sequences": seqs, "max_model_len": context,
                "gpu_memory_utilization": gpu_memory_utilization}


def estimate(config: Any, dtype: str = "bfloat16") -> Estimate:
    if dtype not in BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(BYTES)}")
    facts = config if isinstance(config, ArchFacts) else ArchFacts.from_config(config)
    return Estimate(facts, facts.n_params_estimate(), dtype)


class SizingTable:
    def __init__(self, est: Estimate, context: int):
        self.est, self.context = est, context

    def rows(self) -> list[tuple[str, str, str]]:
        out = []
        for gpu, gib in GPUS.items():
            f = self.est.fits(gib, self.context)
            setting = (f"max_model_len={self.context}, gpu_memory_utilization={f['gpu_memory_utilization']}"
                       if f["fits"] else "does not fit: quantise or use tensor_parallel_size >= 2")
            out.append((gpu, f"{f['concurrent_sequences']}" if f["fits"] else "—", setting))
        return out

    def __repr__(self) -> str:
        e = self.est
        head = (f"{e.facts.model_type}: ~{e.n_params / 1e9:.2f}B params; weights {e.weights_bytes / GIB:.2f} GiB in "
                f"{e.dtype}; KV cache {e.kv_bytes_per_token / 1024:.1f} KiB/token; context {self.context}")
        return head + "\n" + "\n".join(f"  {g:<16} {n:>6} concurrent  {s}" for g, n, s in self.rows())

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(g)}</td><td>{n}</td><td>{html.escape(s)}</td></tr>"
                       for g, n, s in self.rows())
        return (f"<div><pre>{html.escape(repr(self).splitlines()[0])}</pre><table><tr><th>GPU</th>"
                f"<th>full contexts at once</th><th>vLLM settings</th></tr>{rows}</table></div>")


def table(config: Any, dtype: str = "bfloat16", context: int = 4096) -> SizingTable:
    return SizingTable(estimate(config, dtype), context)
