"""Captures and gradients() in the shared batch: every request of one kind queued meanwhile read in right-padded
forwards of as many rows as the memory budget allows, each request handed its own row with the pads cut.

A mixin of the Batcher (ie_lab/eager/batch_decode.py): it shares the batch's queue, its steering row edits and its
cancel bookkeeping (which forward is in flight, and each request's row in it), so an interrupt stops a forward only
when every request in it is cancelled, as in the decode loop.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from ..address import Address
from ..backend import OperationCancelled
from ..cache import Cache
from ..core.addresses import slice_head
from ..core.inputs import str_tokens
from ..core.steer_spec import SteerSpec
from ..errors import InputError, StructureError
from .batch_requests import CaptureRequest, GradRequest, Request
from .steer import running
from .taps import Taps
from .writers import Writers


def _total(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _own_row(a: Address, t: torch.Tensor, i: int, n: int, facts: Any) -> torch.Tensor:
    """Row i of a right-padded forward's tensor at `a`, its n real positions kept (an attention pattern's keys
    too), sliced to the head `a` names."""
    t = t[i : i + 1]
    return slice_head(a, t[:, :, :n, :n] if a.point.is_attention else t[:, :n], facts)


def _end_all(group: list[Any], e: Exception) -> None:
    """A forward failed: each of its requests not already ended ends with it (a cancelled one as interrupted)."""
    for r in group:
        if not r.finished:
            r.error, r.finished = (OperationCancelled("interrupted") if r.cancelled else e), True


class BatchReads:
    """The Batcher's reading half: `read` and the forwards it runs. Runs under the session's operation lock."""

    # the Batcher's state this half reads and sets (ie_lab/eager/batch_decode.py)
    lm: Any
    _guard: threading.Lock
    captures: list[CaptureRequest | GradRequest]
    in_forward: list[Any]
    _at: dict[int, int]
    _pad_id: int

    def _row_edits(self, req: Request | CaptureRequest, spec: SteerSpec) -> list[tuple[Any, Any]]:
        raise NotImplementedError  # the Batcher's: a spec's edits, each bound to the request's row of the forward

    def read(self, req: CaptureRequest | GradRequest, rows_for: Any) -> Cache:
        """Read `req`, with every request of its kind (capture, gradients) queued meanwhile, in right-padded
        forwards of at most rows_for(width, points) rows; each Cache holds only its own prompt's tokens (as
        `capture` over a list)."""
        while not req.finished:
            with self._guard:
                for c in [*self.captures, req]:
                    if c.cancelled and not c.finished:
                        c.error, c.finished = OperationCancelled("interrupted"), True
                queued = [c for c in self.captures if not c.finished and c is not req]
                self.captures = []
            if req.finished:
                with self._guard:
                    self.captures = queued + self.captures
                break
            queued.insert(0, req)  # its own first: whatever the budget, it is read now
            group = [req]
            for c in queued[1:]:
                if type(c) is not type(req):
                    continue
                width = max(x.ids.shape[1] for x in [*group, c])
                points = len({a.without_head() for x in [*group, c] for a in [*x.addrs, *getattr(x, "measured", ())]})
                if len(group) + 1 > rows_for(width, points):
                    break
                group.append(c)
            with self._guard:  # the rest wait for their own turn
                self.captures = [c for c in queued if c not in group] + self.captures
            if isinstance(req, GradRequest):
                self._grad_group(group)  # type: ignore[arg-type]
            else:
                self._read_group(group)  # type: ignore[arg-type]
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _right_padded(self, group: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """One-prompt requests as one right-padded frame: ids, the attention mask (a lone request keeps its own,
        exactly as capture() would; right padding is masked, and real tokens never read the pads after them) and
        each row's real length."""
        lens = [int(r.ids.shape[1]) for r in group]
        width = max(lens)
        device = group[0].ids.device
        ids = torch.full((len(group), width), self._pad_id, dtype=torch.long, device=device)
        for i, r in enumerate(group):
            ids[i, : lens[i]] = r.ids[0]
        mask: torch.Tensor | None = group[0].mask if len(group) == 1 else None
        if min(lens) < width:
            mask = (torch.arange(width, device=device)[None] < torch.tensor(lens, device=device)[:, None]).long()
        return ids, mask, lens

    def _read_group(self, group: list[CaptureRequest]) -> None:
        lm = self.lm
        ids, mask, lens = self._right_padded(group)
        width = ids.shape[1]
        for i, c in enumerate(group):
            c.state.ids, c.state.offset, c.state.prompt_len, c.state.pad = ids[i : i + 1], 0, None, None
        bases = list(dict.fromkeys(a.without_head() for c in group for a in c.addrs))
        edits = [w for c in group for sp in c.specs for w in self._row_edits(c, sp)]
        self._at = {id(c): i for i, c in enumerate(group)}
        self.in_forward = list(group)  # a cancel stops this forward only if every capture in it is cancelled
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(lm.lock)
                stack.enter_context(torch.no_grad())
                taps = stack.enter_context(Taps(lm, bases))
                taps.shape = (len(group), width)
                if edits:
                    w = stack.enter_context(Writers(lm, edits))
                    w.shape = taps.shape
                kwargs: dict[str, Any] = {"use_cache": False}
                if taps.needs_output_attentions:
                    kwargs["output_attentions"] = True
                with running(None, ()):
                    lm.hf(input_ids=ids, attention_mask=mask, **kwargs)
        except Exception as e:  # noqa: BLE001 - each request of the forward ends with it
            _end_all(group, e)
            return
        finally:
            self._at = {}
            self.in_forward = []
        for i, (c, n) in enumerate(zip(group, lens)):
            if c.finished:  # its own steering hook failed in the forward (the others' rows are sound)
                continue
            got: dict[Address, torch.Tensor] = {}
            for a in c.addrs:
                parts = taps.collected.get(a.without_head(), [])
                if len(parts) != 1:
                    c.error = StructureError(
                        f"{a} was seen {len(parts)} times in one forward (expected once): the module it is read "
                        "from is shared or skipped on this family, so ie_lab will not pick one."
                    )
                    break
                got[a] = _own_row(a, parts[0], i, n, lm.facts)
            if c.error is None:
                c.result = Cache(got, tokens=c.ids, str_tokens=str_tokens(lm, c.ids), attention_mask=c.mask)
            c.finished = True

    def _grad_group(self, group: list[GradRequest]) -> None:
        """One forward and one backward for a group of gradients() requests.

        Each point gets one zero-valued leaf over the whole batch (adding it changes no number); each request's
        metric sees only its own row (its real tokens: right padding, which they never attend to), and the
        backward of the sum of the metrics gives each leaf row the derivative of its own request's metric alone,
        since no row reads another. Each request is handed its own row of each leaf's gradient, pads cut."""
        lm = self.lm
        ids, mask, lens = self._right_padded(group)
        width = ids.shape[1]
        addrs = list(dict.fromkeys(a for g in group for a in g.addrs))
        measured = list(dict.fromkeys(m for g in group for m in g.measured))
        leaves: dict[Address, torch.Tensor] = {}

        def probe(a: Address) -> Any:
            def edit(t: torch.Tensor, off: int) -> torch.Tensor:
                leaves[a] = torch.zeros_like(t, requires_grad=True)
                return t + leaves[a]

            return edit

        self.in_forward = list(group)
        values: dict[int, torch.Tensor] = {}
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(lm.lock)
                stack.enter_context(torch.enable_grad())
                w = stack.enter_context(Writers(lm, [(a, probe(a)) for a in addrs]))
                w.shape = (len(group), width)
                taps = stack.enter_context(Taps(lm, measured, grad=True)) if measured else None
                if taps is not None:
                    taps.shape = w.shape
                with running(None, ()):
                    logits = lm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
                self.in_forward = []
                for i, (g, n) in enumerate(zip(group, lens)):
                    try:
                        values[i] = self._metric(g, i, n, logits, taps)
                    except Exception as e:  # noqa: BLE001 - its own metric: only this request ends with it
                        g.error, g.finished = e, True
                live = [v for v in values.values() if v.requires_grad]
                grads = (
                    torch.autograd.grad(_total(live), [leaves[a] for a in addrs], allow_unused=True)
                    if live
                    else (None,) * len(addrs)
                )
        except Exception as e:  # noqa: BLE001 - each request of the forward ends with it
            _end_all(group, e)
            return
        finally:
            self.in_forward = []
        by_addr = dict(zip(addrs, grads))
        for i, (g, n) in enumerate(zip(group, lens)):
            if g.finished:
                continue
            out = {}
            for a in g.addrs:
                got = by_addr[a]
                # a metric that does not depend on the points (read upstream of them, or not from the model): zeros
                row = got[i : i + 1, :n] if got is not None and values[i].requires_grad else None
                out[a] = (row if row is not None else torch.zeros_like(leaves[a][i : i + 1, :n])).detach()
            g.result = Cache(out, tokens=g.ids, str_tokens=str_tokens(lm, g.ids))
            g.finished = True

    def _metric(self, g: GradRequest, i: int, n: int, logits: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        """Request g's metric of its own row (its logits, or its points of `of=` with the pads cut)."""
        if not g.measured:
            arg: Any = logits[i : i + 1, :n]
        else:
            assert taps is not None
            seen = {}
            for m in g.measured:
                parts = taps.collected.get(m.without_head(), [])
                if len(parts) != 1:
                    raise StructureError(
                        f"{m} was seen {len(parts)} times in one forward (expected once), so "
                        "ie_lab will not pick one to measure."
                    )
                seen[m] = _own_row(m, parts[0], i, n, self.lm.facts)
            arg = seen[g.measured[0]] if g.single else Cache(seen, tokens=g.ids, str_tokens=str_tokens(self.lm, g.ids))
        value = g.metric(arg)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = "the logits" if not g.measured else ("the point's tensor" if g.single else "the cache of points")
            raise InputError(
                f"the metric must return a scalar tensor computed from {what}, got "
                f"{type(value).__name__}"
                + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else "")
                + "; reduce it, e.g. with .sum() or .mean()."
            )
        return value.reshape(())
