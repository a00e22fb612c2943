"""What comes back from the worker, as results: a capture streamed with a generation (`_StepRows`), the rows a
request collected by address (`_Results._assemble`), a request the worker failed (`_raise_if_failed`). A room
of VLLMBackend (ie_lab/vllm/backend.py)."""

from __future__ import annotations

from typing import Any

import torch

from ..address import Address
from ..cache import Cache
from ..core.addresses import slice_head
from ..core.inputs import str_tokens
from ..errors import (
    RequestFailed,
)
from .wire import RECOMPUTED, by_position, dedupe_order, unpack

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.


class _StepRows:
    """A capture streamed with generate_stream: the worker hands over the rows filed since the last step (ie_drain),
    and each GenStep carries the rows of the forward that chose it, as on eager: step 0 the prompt's, step i the row
    of token i - 1, and the last step also its own token's row (read by the follow-up forward) plus the whole cache.
    Attention rows are [1, heads, new queries, keys so far], as on eager."""

    def __init__(self, session: Any, addrs: list[Address], ids: torch.Tensor):
        self.s, self.ids, self.P = session, ids, ids.shape[1]
        self.addrs = addrs
        self.buffer: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # point -> (positions, rows)
        self.attn: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}  # layer -> (pos, sc, pr)
        self.upto = 0  # positions below this have been handed to a step
        self.parts: dict[Address, list[torch.Tensor]] = {a: [] for a in addrs if a.name not in RECOMPUTED}

    async def drain(self, rid: str) -> None:
        res = await self.s._driver.rpc_for(rid, "ie_drain", rid)
        _raise_if_failed(res)
        for base, d in res.get("points", {}).items():
            self.buffer.setdefault(base, []).append((unpack(d["positions"]), unpack(d["rows"])))
        for L, d in res.get("attn", {}).items():
            self.attn.setdefault(int(L), []).append((unpack(d["positions"]), unpack(d["scores"]), unpack(d["probs"])))

    def _check(self, pos: torch.Tensor, stop: int, what: str) -> None:
        if not torch.equal(pos, torch.arange(self.upto, stop, dtype=pos.dtype)):
            raise RuntimeError(
                f"ie_lab: the worker filed positions {pos.tolist()} of {what} for a step that covers "
                f"{self.upto}..{stop - 1}"
            )  # never hand out a wrong row silently

    def _take(self, stop: int) -> dict[str, torch.Tensor]:
        """Rows at positions upto..stop - 1 of every point (the latest copy of a recomputed position)."""
        out = {}
        for base in {str(a.without_head()) for a in self.addrs if a.name not in RECOMPUTED}:
            pos, t = by_position(self.buffer.get(base) or [(torch.zeros(0, dtype=torch.long), torch.zeros(0))])
            keep = (pos >= self.upto) & (pos < stop)
            self._check(pos[keep], stop, base)
            out[base] = t[keep]
            later = pos >= stop
            self.buffer[base] = [(pos[later], t[later])] if bool(later.any()) else []
        return out

    def _take_attn(self, L: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and probabilities of the queries at upto..stop - 1 against keys 0..stop - 1 (later keys are
        masked for these queries, so the key axis is cut, or padded masked, to stop)."""

        def fit(t: torch.Tensor, fill: float) -> torch.Tensor:
            k = t.shape[-1]
            return t[..., :stop] if k >= stop else torch.nn.functional.pad(t, (0, stop - k), value=fill)

        parts = self.attn.get(L, [])
        pos = torch.cat([p for p, _, _ in parts]) if parts else torch.zeros(0, dtype=torch.long)
        sc: Any = torch.cat([fit(x, float("-inf")) for _, x, _ in parts], dim=1) if parts else None
        pr: Any = torch.cat([fit(x, 0.0) for _, _, x in parts], dim=1) if parts else None
        order = dedupe_order(pos)
        pos = pos[order]
        keep = (pos >= self.upto) & (pos < stop)
        self._check(pos[keep], stop, f"attention layer {L}")
        sel = order[keep]
        later = order[pos >= stop]
        self.attn[L] = [(pos[pos >= stop], sc[:, later], pr[:, later])] if later.numel() else []
        return sc[:, sel], pr[:, sel]

    def _cache(self, tensors: dict[Address, torch.Tensor], tokens: torch.Tensor) -> Cache:
        return Cache(tensors, tokens=tokens, str_tokens=str_tokens(self.s.lm, tokens))

    def _full(self, generated: list[int]) -> torch.Tensor:
        return torch.cat([self.ids, torch.tensor([generated], dtype=self.ids.dtype)], dim=1)

    def attach(self, step: Any, generated: list[int], stop: int | None = None) -> None:
        stop = self.P + step.index if stop is None else stop
        got = self._take(stop)
        layers: set[Any] = {a.layer for a in self.addrs if a.name in RECOMPUTED}  # attention points have layers
        attn = {L: self._take_attn(L, stop) for L in layers}
        new = {}
        for a in self.addrs:
            if a.name in RECOMPUTED:
                t = attn[a.layer][0 if a.name == "attn_scores" else 1][None]
            else:
                t = got[str(a.without_head())][None]
            new[a] = slice_head(a, t.to(self.s.lm.dtype), self.s.lm.facts)
        for a in self.parts:
            self.parts[a].append(new[a])
        lo = self.upto if getattr(step, "captured_positions", None) is None else step.captured_positions.start
        if getattr(step, "captured", None) is not None:  # the last step: its own token's row joins the earlier rows
            old = step.captured
            for a, t in new.items():
                prev = old[a]
                if a.name in RECOMPUTED:  # the earlier rows' key axis grows by the new key, masked for them
                    pad = float("-inf") if a.name == "attn_scores" else 0.0
                    prev = torch.nn.functional.pad(prev, (0, t.shape[-1] - prev.shape[-1]), value=pad)
                    new[a] = torch.cat([prev, t], dim=2)
                else:
                    new[a] = torch.cat([prev, t], dim=1)
        step.captured = self._cache(new, self._full(generated)[:, lo:stop])
        step.captured_positions = range(lo, stop)
        self.upto = stop

    def finish(self, step: Any, generated: list[int], collected: dict) -> None:
        """The follow-up forward has read the last token: its row joins the last step, which also gets the whole
        cache (every step's rows joined; the attention patterns rebuilt over every position)."""
        for base, t in collected.get("points", {}).items():
            pos = unpack(collected["point_positions"][base])
            self.buffer.setdefault(base, []).append((pos, unpack(t)))
        stop = self.P + len(generated)
        for L, d in collected.get("attn", {}).items():
            self.attn.setdefault(int(L), []).append((torch.arange(stop), unpack(d["scores"]), unpack(d["probs"])))
        self.attach(step, generated, stop=stop)
        whole: dict[Address, torch.Tensor] = {}
        for a in self.addrs:
            if a.name in RECOMPUTED:
                whole.update(self.s._assemble([a], collected))
            else:
                whole[a] = torch.cat(self.parts[a], dim=1)
        step.cache = self._cache(whole, self._full(generated))


def _raise_if_failed(res: dict) -> None:
    """A hook failed for this request inside the worker: the request fails, the engine and other requests go on."""
    if res.get("error"):
        raise RequestFailed(
            f"this request failed inside the vLLM worker ({res['error']}); its captures and "
            "steering were stopped there, the engine and every other request go on."
        )


class _Results:
    """The rows a request's worker collected, by address."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    lm: Any

    def _assemble(self, addrs: list[Address], res: dict) -> dict[Address, torch.Tensor]:
        out = {}
        for a in addrs:
            if a.name in RECOMPUTED:
                t = unpack(res["attn"][a.layer]["scores" if a.name == "attn_scores" else "probs"])
            else:
                t = unpack(res["points"][str(a.without_head())])
            out[a] = slice_head(a, t[None].to(self.lm.dtype), self.lm.facts)
        return out
