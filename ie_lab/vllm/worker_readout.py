"""The vLLM worker extension's read-out: what ``ie_drain`` (a stream's rows so far) and ``ie_collect`` (a request's
whole capture) hand back to the client, as plain data, with attention patterns rebuilt from the q/k the hooks filed.

A base of IELabWorker (ie_lab/vllm/worker.py), so the methods are the worker's and collective_rpc reaches them;
imported in vLLM's worker process, so only what the worker imports already (torch, ie_lab.ops, vllm/sites, vllm/wire).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.attention import scores_and_probs
from .sites import LayerSites
from .wire import by_position as _by_position
from .wire import dedupe_order as _dedupe_order
from .wire import pack
from .worker_requests import Spec, tp_rank


class WorkerReadout:
    """ie_drain and ie_collect over the worker's per-request Specs (set up by IELabWorker.ie_install)."""

    _ie_specs: dict[str, Spec]
    _ie_layers: list[LayerSites]
    _ie_ran: int  # registered requests this worker ran a forward of, collected or released since install

    def ie_drain(self, key: str) -> dict:
        """The point rows filed for a request since the last drain (a streamed capture), handed over and
        forgotten here so a long stream holds nothing twice; {"error": ...} once a hook failed for it."""
        spec = self._ie_specs.get(key)
        if spec is None or tp_rank() != 0:
            return {}
        if spec.error is not None:
            return {"error": spec.error}
        out: dict[str, Any] = {}
        for point, parts in list(spec.store.items()):
            if parts:
                pos, t = _by_position(parts)
                out[point] = {"positions": pack(pos), "rows": pack(t)}
                parts.clear()
        # Attention rows of the queries filed since the last drain, against every key so far (a query's later
        # keys are masked). The q/k stay: later queries need every key, and ie_collect rebuilds the whole matrix.
        attn: dict[int, Any] = {}
        for L in spec.attn_layers:
            if not spec.qk.get(L):
                continue
            pos, scores, probs = self._attention(spec, L)
            new = pos >= spec.attn_sent.get(L, 0)
            if bool(new.any()):
                attn[L] = {
                    "positions": pack(pos[new]),
                    "scores": pack(scores[0][:, new]),
                    "probs": pack(probs[0][:, new]),
                }
                spec.attn_sent[L] = int(pos.max()) + 1
        return {"points": out, "attn": attn}

    def _attention(self, spec: Spec, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, scores and probabilities of layer L rebuilt from every q/k the request has filed so far."""
        parts = spec.qk[L]
        pos = torch.cat([p for p, _, _ in parts])
        q = torch.cat([x for _, x, _ in parts])
        k = torch.cat([x for _, _, x in parts])
        order = _dedupe_order(pos)
        q, k = q[order], k[order]
        s = self._ie_layers[L]
        core = s.attn_core
        hd = core.head_size
        T = q.shape[0]
        qh = q.reshape(T, -1, hd).transpose(0, 1)[None]
        kh = k.reshape(T, -1, hd).transpose(0, 1)[None]
        impl = core.impl
        scores, probs = scores_and_probs(
            qh,
            kh,
            scaling=float(impl.scale),
            softcap=getattr(impl, "logits_soft_cap", None) or None,
            sliding_window=getattr(core, "sliding_window", None) or None,
            sinks=s.sinks,
        )
        return pos[order], scores, probs

    def ie_collect(self, key: str) -> dict:
        spec = self._ie_specs.pop(key, None)
        if spec is not None and spec.forwards:  # this worker ran it (with data parallelism, one rank of several)
            self._ie_ran += 1
        if spec is None or tp_rank() != 0:
            return {}
        if spec.error is not None:
            return {"error": spec.error}
        out: dict[str, Any] = {"points": {}, "attn": {}, "lens": {}, "forwards": spec.forwards}
        for point, parts in spec.store.items():
            if not parts:  # everything was drained during a stream
                continue
            pos, t = _by_position(parts)
            out["points"][point] = pack(t)
            out.setdefault("positions", pack(pos))
            out.setdefault("point_positions", {})[point] = pack(pos)
        for L in spec.qk:
            _, scores, probs = self._attention(spec, L)
            if f"attn_scores.{L}" in spec.points or L in spec.attn_layers:
                out["attn"][L] = {"scores": pack(scores[0]), "probs": pack(probs[0])}
        for point, parts in spec.proj_store.items():
            pos, sc = _by_position(parts)
            out.setdefault("project", {})[point] = {"positions": pack(pos), "scores": pack(sc)}
        for L, rows in spec.lens_rows.items():
            pos = torch.cat([p for p, _, _ in rows])
            order = _dedupe_order(pos)
            out["lens"][L] = {
                "ids": pack(torch.cat([i for _, i, _ in rows])[order]),
                "probs": pack(torch.cat([v for _, _, v in rows])[order]),
            }
        return out
