"""The shared decode loop of the eager backend's continuous batching (the design: ie_lab/eager/batcher.py).

The Batcher admits waiting generation requests at every step boundary (their prompts as one left-padded forward,
their KV rows then joined to the batch's cache), decodes one token for every row, hands each request its steps and
captures, and drops cancelled, failed and finished rows; captures and gradients() are read by its other half
(ie_lab/eager/batch_reads.py).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any

import torch

from ..address import Address
from ..backend import OperationCancelled
from ..cache import Cache
from ..core.addresses import slice_head
from ..core.inputs import str_tokens
from ..core.results import GenerationResult, GenStep
from ..core.steer_spec import SteerSpec
from ..errors import CapabilityUnsupported, IELabError, RequestFailed
from .batch_reads import BatchReads
from .batch_requests import CaptureRequest, GradRequest, Request, ready, wake
from .generate import (
    _cache_keyword,
    _choose,
    _join,
    _pad_id,
    _returns_a_kv_cache,
    check_batchable,
    make_step,
    stop_reason,
)
from .steer import running
from .taps import Taps
from .writers import Writers


def shareable(lm: Any) -> bool:
    """Whether concurrent requests on this model may share one padded batch: a forward that takes the pads' mask
    and positions and has no expert capacity (generate.check_batchable), a KV cache handed back, and softmax
    attention in every layer (a recurrent or linear mixer's state would carry the pads)."""
    try:
        check_batchable(lm)
    except CapabilityUnsupported:
        return False
    kinds = tuple(getattr(lm.facts, "mixer_kinds", ())) + tuple(getattr(lm.facts, "layer_kinds", ()))
    return _returns_a_kv_cache(lm.hf) and not any(k and k not in ("global", "sliding") for k in kinds)


def _plain_layers(cache: Any) -> bool:
    """Whether every layer of this cache holds all positions as [batch, heads, positions, dim] (rows can be padded
    on the left and joined); a sliding-window layer drops old positions, which makes joining unsafe."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(la) is DynamicLayer and la.is_initialized for la in layers)


def _own(e: Exception, where: str) -> IELabError:
    """A request's own failure as the error it raises: an ie_lab refusal as it is, anything else as RequestFailed
    naming where it happened and what it was (the original chained as its cause)."""
    if isinstance(e, IELabError):
        return e
    error = RequestFailed(
        f"this request failed {where}: {type(e).__name__}: {e}. It alone ended; the session and the requests "
        "batched with it run on. Fix what the error names (the steering spec, the arguments) and run it again."
    )
    error.__cause__ = e
    return error


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t


class Batcher(BatchReads):
    """The shared batch of one eager backend. Every method runs under the session's operation lock, except
    `submit` and `forget` (any thread)."""

    def __init__(self, lm: Any):
        self.lm = lm
        self._guard = threading.Lock()
        self.pending: list[Request] = []
        self.captures: list[CaptureRequest | GradRequest] = []  # queued: the first to compute reads them all
        self.rows: list[Request] = []
        self.cache: Any = None
        self.width = 0  # positions in the cache (the frame every row ends at)
        self.in_forward: list[Any] = []  # the requests of the forward in flight
        self._at: dict[int, int] = {}  # id(request) -> its row in the forward in flight
        self._cache_kw = _cache_keyword(lm.hf)
        self._keep_kw = "logits_to_keep" in inspect.signature(lm.hf.forward).parameters
        self._pad_id = _pad_id(lm)
        self._special = frozenset(getattr(lm.tokenizer, "all_special_ids", []) or [])
        self._hooks: contextlib.ExitStack | None = None
        self._hooked: tuple = ()
        self._taps: Taps | None = None
        self._writers: Writers | None = None
        self._mergeable: bool | None = None

    # ---- any thread ----------------------------------------------------------------------------------
    def submit(self, reqs: list[Request] | list[CaptureRequest] | list[GradRequest]) -> None:
        """Queue a call's requests together (a list's prompts are admitted in the same step)."""
        with self._guard:
            for req in reqs:
                if isinstance(req, (CaptureRequest, GradRequest)):
                    self.captures.append(req)
                else:
                    self.pending.append(req)

    def prune(self) -> None:
        """Drop cancelled and closed requests now (a closed stream's row leaves without waiting for a driver)."""
        self._drop_cancelled()

    def may_stop_forward(self) -> bool:
        """Whether a cancel hook may stop the forward in flight: none is, or every request in it is cancelled."""
        return all(r.cancelled for r in self.in_forward)

    def close(self, error: BaseException) -> None:
        with self._guard:
            reqs, self.pending = self.pending + self.rows, []
            caps, self.captures = self.captures, []
        self.rows, self.cache, self.width = [], None, 0
        for r in reqs:
            self._fail(r, error)
        for c in caps:
            c.error, c.finished = error, True

    # ---- under the operation lock --------------------------------------------------------------------
    def drive(self, reqs: list[Request]) -> None:
        """Run the batch until every one of `reqs` is finished (a stream: until it has steps to hand out)."""
        lm = self.lm
        try:
            with lm.lock, torch.no_grad():
                while not ready(reqs):
                    if not (self.rows or self.pending):
                        raise RuntimeError("internal: a batched request is neither queued nor running")
                    self._step()
                self._drop_cancelled()  # requests cancelled while queued: nobody else may drive soon
        finally:
            self._unhook()

    def _step(self) -> None:
        self._drop_cancelled()
        with self._guard:
            if self.rows and not self._can_join():
                joining: list[Request] = []
            else:
                joining, self.pending = self.pending, []
        try:
            if joining:  # a step of its own: a stream's driver then hands out its first token before running on
                self._admit(joining)
            elif self.rows:
                self._decode()
        except Exception as e:  # noqa: BLE001 - the requests of this step end with it; the batcher serves on
            # A failure no one request is to blame for (each request's own are contained where they happen): the
            # cache may be half-updated, so this step's requests end with it and the next call starts a new batch.
            rows, self.rows, self.cache, self.width = self.rows + joining, [], None, 0
            self._unhook()
            self._fail_all(rows, e)

    def _can_join(self) -> bool:
        if self._mergeable is None:
            self._mergeable = _plain_layers(self.cache)
        return self._mergeable

    def _drop_cancelled(self) -> None:
        with self._guard:
            gone = [r for r in self.pending if r.cancelled]
            self.pending = [r for r in self.pending if not r.cancelled]
        for r in gone:
            self._fail(r, OperationCancelled("interrupted"))
        keep = [i for i, r in enumerate(self.rows) if not r.cancelled]
        for r in self.rows:
            if r.cancelled:
                self._fail(r, OperationCancelled("interrupted"))
        if len(keep) < len(self.rows):
            self._select(keep)

    # ---- forwards ------------------------------------------------------------------------------------
    def _admit(self, reqs: list[Request]) -> None:
        """The newcomers' prompts as one left-padded forward; each chooses its first token from it. Those still
        running (or whose capture still needs their last token read) join the batch's cache."""
        width = max(r.n for r in reqs)
        device = reqs[0].prompt.device
        ids = torch.full((len(reqs), width), self._pad_id, dtype=torch.long, device=device)
        for i, r in enumerate(reqs):
            r.pad = width - r.n
            ids[i, r.pad :] = r.prompt[0]
        try:
            logits, cache = self._forward(reqs, ids, None, 0)
        except Exception as e:  # these requests end with it; the batch's own cache is untouched
            self._fail_all(reqs, e)
            return
        except BaseException as e:
            self._fail_all(reqs, e)
            raise
        for i, r in enumerate(reqs):
            self._next(r, logits[i])
        staying = [i for i, r in enumerate(reqs) if not r.finished]
        if not staying:
            return
        if len(staying) < len(reqs):
            cache.batch_select_indices(torch.tensor(staying, device=device))
        reqs = [reqs[i] for i in staying]
        if not self.rows:
            self.rows, self.cache, self.width = reqs, cache, width
            self._mergeable = None
            self._trim()
            return
        frame = max(self.width, width)
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([_left_pad(old.keys, frame - self.width), _left_pad(new.keys, frame - width)])
            old.values = torch.cat([_left_pad(old.values, frame - self.width), _left_pad(new.values, frame - width)])
        for r in self.rows:
            r.pad += frame - self.width
        for r in reqs:
            r.pad += frame - width
        self.rows = self.rows + reqs
        self.width = frame
        self._trim()

    def _decode(self) -> None:
        rows = self.rows
        ids = torch.tensor([[r.next_token] for r in rows], device=rows[0].prompt.device)
        try:
            logits, self.cache = self._forward(rows, ids, self.cache, self.width)
        except BaseException as e:
            # a forward stopped half-way leaves some layers one position longer: the cache goes with its rows
            self.rows, self.cache, self.width = [], None, 0
            self._fail_all(rows, e)
            if not isinstance(e, Exception):
                raise
            return
        self.width += 1
        keep = []
        for i, r in enumerate(rows):
            if r.finished:  # failed in this forward (its own hook raised): its row leaves
                continue
            if r.draining is not None:
                self._finish(r, r.draining)
                continue
            self._next(r, logits[i])
            if not r.finished:
                keep.append(i)
        if len(keep) < len(rows):
            self._select(keep)

    def _forward(self, reqs: list[Request], ids: torch.Tensor, cache: Any, offset: int) -> tuple[torch.Tensor, Any]:
        """One forward of these requests' rows ([rows, new tokens] ids after `offset` cached positions)."""
        lm = self.lm
        b, s = ids.shape
        pads = torch.tensor([r.pad for r in reqs], device=ids.device)
        kwargs: dict[str, Any] = {}
        if self._keep_kw and not any(a.name == "lm_head" for r in reqs for a in r.plan.addrs):
            kwargs["logits_to_keep"] = 1
        if bool(pads.any()):
            end = offset + s
            kwargs["attention_mask"] = (torch.arange(end, device=ids.device)[None] >= pads[:, None]).long()
            own = torch.arange(offset, end, device=ids.device)[None] - pads[:, None]
            kwargs["position_ids"] = own.clamp(min=0)  # a pad's position is never attended to
        for i, r in enumerate(reqs):
            st = r.state
            st.ids, st.offset, st.prompt_len, st.pad = ids[i : i + 1], offset, r.pad + r.n, pads[i : i + 1]
        self._hook(reqs, (b, s), offset)
        self.in_forward = reqs
        self._at = {id(r): i for i, r in enumerate(reqs)}
        try:
            # marked as an operation's forward: a `with` block's raw-forward hooks leave it alone
            with running(None, ()):
                out = lm.hf(input_ids=ids, use_cache=True, **{self._cache_kw: cache}, **kwargs)
        finally:
            self.in_forward = []
        if self._taps is not None:
            self._collect(reqs, offset, s)
        return out.logits[:, -1], getattr(out, self._cache_kw)

    def _hook(self, reqs: list[Request], shape: tuple[int, int], offset: int) -> None:
        """Taps for every capture and a row-bound writer for every steering spec of these requests; kept while the
        same requests run, so a decode loop places them once."""
        key = tuple(id(r) for r in reqs if r.plan.addrs or r.plan.specs)
        if key != self._hooked:
            self._unhook()
            self._hooked = key
            stack = contextlib.ExitStack()
            try:
                addrs = list(dict.fromkeys(a for r in reqs for a in r.plan.addrs))
                if addrs:
                    self._taps = stack.enter_context(Taps(self.lm, addrs))
                edits = [w for r in reqs for sp in r.plan.specs for w in self._row_edits(r, sp)]
                if edits:
                    self._writers = stack.enter_context(Writers(self.lm, edits))
            except BaseException:
                stack.close()
                self._taps = self._writers = None
                self._hooked = ()
                raise
            self._hooks = stack
        if self._taps is not None:
            self._taps.shape = shape
            self._taps.owner = threading.get_ident()
        if self._writers is not None:
            self._writers.shape, self._writers.offset = shape, offset
            self._writers.owner = threading.get_ident()

    def _unhook(self) -> None:
        stack, self._hooks = self._hooks, None
        self._taps = self._writers = None
        self._hooked = ()
        if stack is not None:
            stack.close()

    def _row_edits(self, req: Request | CaptureRequest, spec: SteerSpec) -> list[tuple[Any, Any]]:
        """(address, edit) per point the spec writes (SteerSpec.writes), each acting on this request's row only."""
        return [(a, self._row_edit(req, spec, edit)) for a, edit in spec.writes(req.state, self._special)]

    def _row_edit(self, req: Request | CaptureRequest, spec: SteerSpec, edit: Any) -> Any:
        def apply(h: torch.Tensor, offset: int) -> torch.Tensor:
            r = self._at.get(id(req))
            if r is None or req.finished:
                return h
            try:
                row = edit(h[r : r + 1], offset).to(h.dtype)
            except Exception as e:  # noqa: BLE001 - its own steering failed: only this request ends with it
                # The forward goes on for the others (rows never read each other); this row runs unsteered to
                # the end of the forward and then leaves the batch.
                self._hook_failed(req, spec, e)
                return h
            out = h.clone()
            out[r : r + 1] = row
            return out

        return apply

    def _collect(self, reqs: list[Request], offset: int, s: int) -> None:
        """Each capturing request's rows of this forward, pads cut, kept at its own positions."""
        assert self._taps is not None
        got = {base: parts[-1] for base, parts in self._taps.collected.items() if parts}
        self._taps.collected.clear()
        for i, r in enumerate(reqs):
            if not r.plan.addrs or r.finished:
                continue
            drop = max(r.pad - offset, 0)  # pad queries of this forward
            for a in dict.fromkeys(a.without_head() for a in r.plan.addrs):
                t = got.get(a)
                if t is None:
                    continue
                if a.point.is_attention:
                    end = offset + s
                    first_key = end - t.shape[-1]  # a cropped window's keys start later
                    t = t[i : i + 1, :, drop:, max(r.pad - first_key, 0) :]
                else:
                    t = t[i : i + 1, drop:]
                r.parts.setdefault(a, []).append(t)
            r.spans.append((offset + drop - r.pad, offset + s - r.pad))

    # ---- rows ----------------------------------------------------------------------------------------
    def _select(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.cache, self.width = [], None, 0
            return
        self.cache.batch_select_indices(torch.tensor(keep, device=self.rows[0].prompt.device))
        self.rows = [self.rows[i] for i in keep]
        self._trim()

    def _trim(self) -> None:
        """Drop the leading positions that are padding in every row (when the layers allow it)."""
        cut = min(r.pad for r in self.rows)
        if cut and self._can_join():
            for la in self.cache.layers:
                la.keys, la.values = la.keys[:, :, cut:], la.values[:, :, cut:]
            for r in self.rows:
                r.pad -= cut
            self.width -= cut

    # ---- per request ---------------------------------------------------------------------------------
    def _next(self, r: Request, row_logits: torch.Tensor) -> None:
        """Choose r's next token; whatever fails there (logits that cannot be sampled, ...) ends r alone."""
        if r.finished:  # failed in the forward that made these logits (its own steering hook raised)
            return
        try:
            r.next_token = self._choose(r, row_logits)
        except Exception as e:  # noqa: BLE001 - its own step: the batch's other requests run on
            self._fail(r, _own(e, f"at step {len(r.generated)} of this request"))

    def _hook_failed(self, req: Request | CaptureRequest, spec: SteerSpec, e: Exception) -> None:
        where = f"at step {len(req.generated)} of this request" if isinstance(req, Request) else "in this capture"
        error = _own(e, f"in its steering hook ({spec!r}) {where}")
        if isinstance(req, Request):
            self._fail(req, error)
        else:
            req.error, req.finished = error, True

    def _choose(self, r: Request, row_logits: torch.Tensor) -> int:
        """The request's next token from its row's logits, its step, and whether it ends here."""
        p = r.plan
        token_id = _choose(row_logits, r.temperature, r.top_k, r.top_p, r.gen, len(r.generated), bool(p.specs))
        r.generated.append(token_id)
        i = len(r.generated) - 1
        step = make_step(self.lm, i, token_id, row_logits, r.n_logprobs, False, r.index)
        if r.keep_logits:
            if r.logit_rows is None:
                r.logit_rows = row_logits.new_empty((r.max_new_tokens, row_logits.shape[-1]))
            r.logit_rows[i].copy_(row_logits.detach())
            step.logits = r.logit_rows[i]
        reason = stop_reason(self.lm, token_id, r.generated, p.eos, p.stops)
        last = reason is not None or len(r.generated) == r.max_new_tokens
        if reason is not None:
            r.reason = reason
        if r.captures and last:
            r.draining = step  # one more forward reads its last token's rows, then it leaves
            return token_id
        if r.captures:
            self._hand(r, step, last=False)
        r.steps.append(step)
        if r.stream:
            r.outbox.append(step)
            wake(r)
        if last:
            self._finish(r, None)
        return token_id

    def _hand(self, r: Request, step: GenStep, last: bool) -> None:
        """The rows of the forwards since r's previous step, as this step's capture."""
        upto = len(r.spans)
        got = self._rows(r, r.handed, upto)
        start = r.spans[r.handed][0] if r.handed < upto else r.spans[-1][1]
        positions = range(start, r.spans[upto - 1][1] if upto else start)
        r.handed = upto
        full = torch.cat([r.prompt, torch.tensor([r.generated], device=r.prompt.device)], dim=1)
        at = full[:, positions.start : positions.stop]
        step.captured = Cache(got, tokens=at, str_tokens=str_tokens(self.lm, at))
        step.captured_positions = positions
        if last:
            step.cache = Cache(self._rows(r, 0, upto), tokens=full, str_tokens=str_tokens(self.lm, full))

    def _rows(self, r: Request, first: int, upto: int) -> dict[Address, torch.Tensor]:
        out: dict[Address, torch.Tensor] = {}
        if first >= upto:
            return out
        start = r.spans[first][0]
        for a in r.plan.addrs:
            parts = r.parts.get(a.without_head(), [])[first:upto]
            if parts:
                out[a] = slice_head(a, _join(a, parts, start), self.lm.facts)
        return out

    def _finish(self, r: Request, draining: GenStep | None) -> None:
        if draining is not None:
            self._hand(r, draining, last=True)
            r.steps.append(draining)
            if r.stream:
                r.outbox.append(draining)
            r.draining = None  # after its step is out: a stream read from another thread never sees neither
        tok = self.lm.tokenizer
        text = tok.decode(r.generated) if tok is not None else " ".join(map(str, r.generated))
        cache = r.steps[-1].cache if r.captures and r.steps else None
        r.result = GenerationResult(r.prompt, r.generated, text, r.steps, r.reason, cache)
        r.finished = True
        r.parts = {}
        wake(r)

    def _fail_all(self, reqs: list[Request], error: BaseException) -> None:
        for r in reqs:
            self._fail(r, OperationCancelled("interrupted") if r.cancelled else error)

    def _fail(self, r: Request, error: BaseException) -> None:
        if not r.finished:
            r.error, r.finished = error, True
            r.parts = {}
            wake(r)
