"""Memory estimates from a config alone (no weights, no torch): weights, KV cache, capture buffers, and
which common GPU fits with what vLLM settings."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from ..arch.config_facts import ArchFacts

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1, "int4": 0.5}
# Usable memory of common accelerators in GiB (what the device reports, before any framework overhead).
GPUS = {
    "T4 16GB": 15.0,
    "L4 24GB": 22.0,
    "RTX 4090 24GB": 23.6,
    "A10G 24GB": 22.0,
    "A100 40GB": 39.4,
    "A100 80GB": 79.1,
    "H100 80GB": 79.1,
    "H200 141GB": 139.8,
    "B200 180GB": 178.0,
}
GIB = 1024**3


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
        return {
            "fits": seqs >= 1,
            "concurrent_sequences": seqs,
            "max_model_len": context,
            "gpu_memory_utilization": gpu_memory_utilization,
        }


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
            setting = (
                f"max_model_len={self.context}, gpu_memory_utilization={f['gpu_memory_utilization']}"
                if f["fits"]
                else "does not fit: quantise or use tensor_parallel_size >= 2"
            )
            out.append((gpu, f"{f['concurrent_sequences']}" if f["fits"] else "—", setting))
        return out

    def __repr__(self) -> str:
        e = self.est
        head = (
            f"{e.facts.model_type}: ~{e.n_params / 1e9:.2f}B params; weights {e.weights_bytes / GIB:.2f} GiB in "
            f"{e.dtype}; KV cache {e.kv_bytes_per_token / 1024:.1f} KiB/token; context {self.context}"
        )
        return head + "\n" + "\n".join(f"  {g:<16} {n:>6} concurrent  {s}" for g, n, s in self.rows())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(g)}</td><td>{n}</td><td>{html.escape(s)}</td></tr>" for g, n, s in self.rows()
        )
        return (
            f"<div><pre>{html.escape(repr(self).splitlines()[0])}</pre><table><tr><th>GPU</th>"
            f"<th>full contexts at once</th><th>vLLM settings</th></tr>{rows}</table></div>"
        )


def table(config: Any, dtype: str = "bfloat16", context: int = 4096) -> SizingTable:
    return SizingTable(estimate(config, dtype), context)


def forward_bytes_per_row(facts: ArchFacts, n_tokens: int, points: int = 0, dtype: str = "float32") -> float:
    """Peak activation bytes one batch row adds to a forward without a KV cache (an upper-bound estimate).

    Counted: the `points` captured d_model-wide buffers, a handful of live d_model-wide tensors and one MLP
    hidden at a time (a forward frees each layer's temporaries before the next), one layer's attention
    scores (eager attention materialises [heads, tokens, tokens]) and the logits over the vocabulary.
    """
    b = BYTES[dtype]
    f = facts
    per_token = (points + 4) * f.d_model + 2 * f.d_mlp * max(1, f.experts_per_token) + f.vocab_size
    return b * (n_tokens * per_token + f.n_heads * n_tokens * n_tokens)


def batch_size_for(
    facts: Any, n_tokens: int, points: int = 0, budget_bytes: float = 1 * GIB, dtype: str = "float32", cap: int = 64
) -> int:
    """How many rows of `n_tokens` tokens one forward can take inside `budget_bytes` of activation memory.

    Used by the batched operations (difference of means, patch sweeps) when no batch_size is given; at least 1
    (a single row is what the unbatched code runs anyway) and at most `cap` (past a few dozen rows a forward is
    compute-bound, so more rows buy no speed). `facts` is an ArchFacts or a config.
    """
    from ..errors import InputError

    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise InputError(f"batch_size_for: n_tokens must be a positive integer, got {n_tokens!r}.")
    if isinstance(points, bool) or not isinstance(points, int) or points < 0:
        raise InputError(f"batch_size_for: points must be a non-negative integer, got {points!r}.")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise InputError(f"batch_size_for: budget_bytes must be a positive number of bytes, got {budget_bytes!r}.")
    if dtype not in BYTES:
        raise InputError(f"batch_size_for: unknown dtype {dtype!r}; use one of {sorted(BYTES)}.")
    facts = facts if isinstance(facts, ArchFacts) else ArchFacts.from_config(facts)
    per_row = forward_bytes_per_row(facts, n_tokens, points, dtype)
    return max(1, min(cap, int(budget_bytes // per_row)))
