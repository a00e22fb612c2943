"""How tests compare a batched computation with the same one run alone.

A row of a batched forward is not bit-equal to the same prompt run alone on every CPU: the matmul kernels block a
[rows, d] product by its row count, and on some CPUs (AVX-512/AMX oneDNN paths, seen on a Sapphire Rapids gate
machine) the float32 sums round differently, by a few units in the last place per layer. So batched-vs-solo
checks allow float32 rounding relative to the tensor's own scale, and nothing more: a neighbour's tensor (another
prompt's row, another layer) differs by orders of magnitude more and fails them.
"""

from __future__ import annotations

import torch


def batched_tolerance(want: torch.Tensor) -> dict[str, float]:
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    return {"atol": 1e-5 * scale, "rtol": 1e-5}


def assert_batched_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """got (a row of a batched run) equals want (the same run alone) up to float32 rounding at want's scale."""
    torch.testing.assert_close(got, want, **batched_tolerance(want), msg=lambda m: f"{what}: {m}" if what else m)


def batched_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, **batched_tolerance(want))
