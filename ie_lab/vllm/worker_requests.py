"""What the vLLM worker extension keeps per request, and the small functions its hooks apply to a request's rows.

A Spec is what ``ie_register`` stored (points, steering, lens, projections, and what was read so far); a Row is one
request's slice of the forward in flight. Imported by the worker in vLLM's worker process: torch and the standard
library only (vLLM's tensor-parallel rank is asked for when called).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Row:
    key: str
    spec: "Spec"
    start: int
    end: int
    positions: torch.Tensor  # absolute positions of this request's tokens in the forward
    slot: int = 0  # the request's index in the runner's batch (graph mode's per-request steering buffers)


@dataclass
class Spec:
    points: set[str]  # base addresses "name.L" / "name"
    attn_layers: set[int]
    steer: list[dict]
    lens: dict | None
    prompt_len: int
    special_ids: frozenset[int] = frozenset()
    store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    qk: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    lens_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    forwards: int = 0
    attn_sent: dict[int, int] = field(default_factory=dict)  # per layer: attention rows a stream has been handed
    error: str | None = None  # set when a hook failed for this request: its work stops, ie_collect reports it
    # project(): point -> (encoder, head, head_dim); only the [tokens, k] scores are kept and cross back
    project: dict[str, tuple[Any, int | None, int]] = field(default_factory=dict)
    proj_store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    graph_steer: list["GraphSteer"] = field(default_factory=list)  # graph mode: the steer entries, prepared once
    # a transcoder's input rows (mlp_in.L, float32), kept by its 'tc' key for its output point in the same forward
    tc_seen: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class GraphSteer:
    """One steering entry of a request in graph mode: what StaticSteer.fill copies into a site's buffers."""

    point: str
    method: int  # index in ops.steering.METHODS
    positions: Any
    graph_vec: torch.Tensor  # the direction the method's row formula takes (ops.steering.direction), on the device
    graph_params: torch.Tensor  # scale, min, max, target (static_steer.params_of)


def non_finite(where: str, r: Row, broke: torch.Tensor, cleared: bool = False) -> str:
    """Why a request failed: where its steering made activations non-finite, and at which step (step i chooses
    generated token i: the prompt's forward is step 0). cleared: the rows reached the KV cache and were cleared
    from it (the check on the model's output), rather than kept out of it."""
    first = int(r.positions[broke.nonzero()[0, 0]])
    step = max(first - r.spec.prompt_len + 1, 0)
    kept = "they were cleared from the KV cache" if cleared else "they were kept out of the KV cache"
    return (
        f"steering made {where} non-finite (nan or inf) at step {step} of request {r.key}; {kept}, so no other "
        "request sees them, and this request stops. Lower the steering scale (or the vector's norm), or steer fewer "
        "positions or layers"
    )


def scrub(caches: Any) -> None:
    """Every non-finite value in the KV cache (and state caches) set to 0, in place: a freed block that holds one
    poisons the next request it is handed to (its masked slots weigh 0, and 0 x NaN is NaN)."""
    if isinstance(caches, torch.Tensor):
        if caches.is_floating_point():
            with torch.no_grad():
                caches.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    elif isinstance(caches, (list, tuple)):
        for c in caches:
            scrub(c)
    elif isinstance(caches, dict):
        for c in caches.values():
            scrub(c)


def layer_of(point: str) -> int:
    tail = point.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def position_mask(
    positions: Any, absolute: torch.Tensor, prompt_len: int, ids: torch.Tensor | None, special: frozenset[int]
) -> torch.Tensor | None:
    """Which of this request's rows a steering spec edits, counted over prompt + generated positions."""
    dev = absolute.device
    if isinstance(positions, str):
        if positions == "all":
            return None
        if positions == "prompt":
            return absolute < prompt_len
        if positions == "generated":
            return absolute >= prompt_len
        if positions == "special":
            if ids is None or not special:
                return torch.zeros_like(absolute, dtype=torch.bool)
            return torch.isin(ids.cpu(), torch.tensor(sorted(special), dtype=ids.dtype))
    if isinstance(positions, torch.Tensor):
        full = positions.reshape(-1)
        ok = absolute < full.shape[0]
        out = torch.zeros_like(absolute, dtype=torch.bool)
        out[ok] = full[absolute[ok]]
        return out
    return torch.isin(absolute, torch.as_tensor(list(positions), dtype=absolute.dtype, device=dev))


def tp_rank() -> int:
    """This worker's tensor-parallel rank: every rank runs the hooks (their gathers are collectives), only rank 0
    keeps and hands back a request's data."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001
        return 0
