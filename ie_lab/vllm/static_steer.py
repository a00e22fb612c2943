"""Graph mode's steering: static buffers at declared steering sites, read inside the compiled trunk.

A compiled trunk (torch.compile, and CUDA graphs on a GPU) replays the tensor work it recorded while it was traced;
per-request Python inside it never runs again. So each declared site gets buffers placed before vLLM traces the
model (as the static taps are, static_taps.py), and a hook that is pure tensor work on them:

- per token row: ``code`` (the method's index in ops.steering.METHODS, or -1 where that row is not steered: a
  request without steering, or a position its mask leaves out) and ``slot`` (which request the row belongs to,
  shared by every site);
- per request slot: ``vecs`` (the direction its method's row formula takes: add's v or u, every other method's u)
  and ``params`` (scale, min, max, target).

The hook computes each method's row formula (ie_lab/ops/steering.py ``ROWS``, the functions eager's hooks call)
with the row's own vector and numbers and keeps, per row, its own method's result (``_blend``, as a mask does on
eager): one trace serves any mix of methods, vectors, numbers and masks in a batch. The worker fills the buffers
for each forward outside the trunk (``StaticSteer.fill``, from the top-level model's pre-hook, which stays Python).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..ops import steering as steer_ops

METHOD_INDEX = {m: i for i, m in enumerate(steer_ops.METHODS)}
N_PARAMS = 4  # scale, min, max, target


@dataclasses.dataclass
class SteerSite:
    point: str  # base address, "resid_post.3"
    code: torch.Tensor  # [max tokens] int64: the row's method index, -1 for rows left alone
    vecs: torch.Tensor  # [max requests in a forward, d_model] float32
    params: torch.Tensor  # [max requests in a forward, N_PARAMS] float32
    # the liveness tick echoed by this site's hook inside the graph (as the taps' canary): an artifact traced without
    # this very hook (another declaration's) is caught before a steered request returns
    echo: torch.Tensor = dataclasses.field(default_factory=lambda: torch.full((1,), -1, dtype=torch.int64))
    # [max tokens] bool, written inside the graph: the rows this site's steering made non-finite (nan or inf), which it
    # handed on unsteered instead, so no later layer writes them into the KV cache; the worker fails their requests
    bad: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1, dtype=torch.bool))
    live: bool = False  # some code is not -1 (a forward with no steering here must clear it)
    # per slot: the entry whose vector and numbers the slot holds (copied again only when that changes)
    held: list[Any] = dataclasses.field(default_factory=list)


def params_of(method: str, kwargs: dict) -> list[float]:
    """A spec's numbers in the buffer's order; a missing cap bound is the infinity that leaves clamp's side open."""
    return [
        float(kwargs.get("scale", 1.0)),
        float("-inf") if kwargs.get("min") is None else float(kwargs["min"]),
        float("inf") if kwargs.get("max") is None else float(kwargs["max"]),
        float(kwargs.get("target", 0.0)),
    ]


def steer_rows(
    h: torch.Tensor,
    code: torch.Tensor,
    slot: torch.Tensor,
    vecs: torch.Tensor,
    params: torch.Tensor,
    bad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inside the compiled trunk: h [n, d_model] with every row steered by its own method, vector and numbers. A
    steered row the steering made non-finite is handed on as it came in (its NaN would reach the KV cache, whose
    freed blocks other requests reuse) and flagged in ``bad`` for the worker to fail its request."""
    n = h.shape[0]
    c = code[:n]
    s = slot[:n]
    v = vecs[s].to(h.device)  # [n, d_model]: each row its request's direction
    p = params[s]
    scale, lo, hi, target = p[:, 0:1], p[:, 1:2], p[:, 2:3], p[:, 3:4]
    numbers = {
        "add": (scale,),
        "orthogonal": (scale,),
        "cap": (lo, hi),
        "norm_scaled_add": (scale,),
        "ablate": (),
        "swap": (target,),
    }
    out = h
    for m, i in METHOD_INDEX.items():
        out = steer_ops._blend(out, steer_ops.ROWS[m](h, v, *numbers[m]), c == i)
    if bad is None:
        return out
    broke = (c >= 0) & ~torch.isfinite(out).all(dim=-1)
    bad[:n].copy_(broke)
    return torch.where(broke[:, None], h, out)


class StaticSteer:
    """The steering buffers of one model: ``sites`` by point, and the row-to-request ``slot`` they share."""

    def __init__(self, sites: dict[str, SteerSite], slot: torch.Tensor):
        self.sites, self.slot = sites, slot

    def fill(self, n: int, entries: list[tuple[str, int, int, int, int, torch.Tensor | None, Any]]) -> None:
        """Before a forward of n token rows, outside the trunk. entries: (point, start, end, slot, method index,
        row mask or None for every row, entry) per steering spec of a request in this forward, where the entry
        holds ``graph_vec`` and ``graph_params``. Sites no entry names are cleared if they were live."""
        codes: dict[str, torch.Tensor] = {}
        slots = torch.zeros(n, dtype=torch.int64)
        for point, start, end, slot, idx, mask, entry in entries:
            site = self.sites[point]
            c = codes.get(point)
            if c is None:
                c = codes[point] = torch.full((n,), -1, dtype=torch.int64)
            if mask is None:
                c[start:end] = idx
            else:
                c[start:end][mask.cpu()] = idx
            slots[start:end] = slot
            while len(site.held) <= slot:
                site.held.append(None)
            if site.held[slot] is not entry:
                site.vecs[slot].copy_(entry.graph_vec)
                site.params[slot].copy_(entry.graph_params)
                site.held[slot] = entry
        for point, site in self.sites.items():
            c = codes.get(point)
            if site.live and (c is None or c.shape[0] < site.code.shape[0]):
                site.code.fill_(-1)  # rows past n keep nothing of an earlier, longer forward
                site.live = False
            if c is not None:
                site.code[:n].copy_(c)
                site.live = True
        if codes:
            self.slot[:n].copy_(slots)


def allocate(points: list[str], max_tokens: int, max_seqs: int, d_model: int, device: Any) -> StaticSteer:
    sites = {
        p: SteerSite(
            p,
            torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            torch.zeros(max_seqs, d_model, dtype=torch.float32, device=device),
            torch.zeros(max_seqs, N_PARAMS, dtype=torch.float32, device=device),
            echo=torch.full((1,), -1, dtype=torch.int64, device=device),
            bad=torch.zeros(max_tokens, dtype=torch.bool, device=device),
        )
        for p in points
    }
    return StaticSteer(sites, torch.zeros(max_tokens, dtype=torch.int64, device=device))


def steer_hook(site: Any, buffers: SteerSite, slot: torch.Tensor, tick: torch.Tensor) -> tuple[str, Any]:
    """(side, hook) steering one site of the table (sites.py) from its buffers: the value read at the site, steered,
    handed on through the site's own write; the hook echoes the forward's tick."""
    read, write, echo = site.read, site.write, buffers.echo
    if site.side == "pre":

        def pre(m: Any, args: tuple, kwargs: dict) -> Any:
            t = read(args, kwargs)
            echo.copy_(tick)
            return write(args, kwargs, steer_rows(t, buffers.code, slot, buffers.vecs, buffers.params, buffers.bad))

        return "pre", pre

    def post(m: Any, args: tuple, out: Any) -> Any:
        t = read(args, out)
        echo.copy_(tick)
        return write(args, out, steer_rows(t, buffers.code, slot, buffers.vecs, buffers.params, buffers.bad))

    return "post", post
