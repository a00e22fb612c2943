"""Shared pieces of the vLLM tests: which families, which addresses, one engine per module."""

from __future__ import annotations

import torch

import ie_lab
from ie_lab import points
from tests.families import make_model, make_tokenizer, saved_model_dir

TEXT = "the cat sat on the mat and Mary went to the store"
# Eight prompts of different lengths, for the concurrent-request tests.
PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "Paris is the capital of France and",
    "John gave a book to",
    "the dog ran in the park",
    "Alice and Bob went to the beach",
    "one two three four five",
    "the old man walked to the station",
]


def served_addresses(session) -> list[str]:
    """Every address the registry marks served on vLLM that exists on this model."""
    from ie_lab.errors import CapabilityUnsupported, PointAbsent
    from ie_lab.vllm.checks import check_served

    out = []
    f = session.facts
    for name in points.served("vllm"):
        p = points.get(name)
        if p.multi_stream_only:
            continue
        for L in [None] if p.scope is points.Scope.TRUNK else range(f.n_layers):
            a = ie_lab.Address(name, L)
            try:
                check_served(session._lm, a)
            except (PointAbsent, CapabilityUnsupported):
                continue
            out.append(str(a))
    return out


def eager_for(family: str):
    # attn_implementation="eager": the kernel that applies soft-capping, like vLLM's (sdpa ignores it)
    return ie_lab.load(make_model(family, attn_implementation="eager"), make_tokenizer(), quiet=True)


def vllm_session(family: str, tmp_root, **kw):
    return ie_lab.Session(saved_model_dir(family, tmp_root), backend="vllm", progress=False, replace=False, **kw)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> bool:
    if a.shape != b.shape:
        return False
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return False
    return bool(torch.allclose(a[fin].float(), b[fin].float(), atol=atol, rtol=1e-4))
