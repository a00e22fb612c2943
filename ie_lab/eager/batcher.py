"""Continuous batching on the eager backend: concurrent generation requests share one decode loop.

A Session computes one operation at a time (its operation lock). Single-prompt ``generate`` and
``generate_stream`` requests on the eager backend become `Request`s of the backend's `Batcher` as soon as they
are queued for that lock, and whichever of them holds the lock drives the batch for all: at every step boundary
the requests waiting meanwhile join (their prompts run as one forward, their KV rows are then merged into the
batch's cache), cancelled ones leave, finished ones leave and hand back their result; the driver returns once
its own request is done (a stream: once its next step is there) and the next holder carries on. So requests that
arrive while the model is busy ride along instead of queueing behind each other, and one that finishes early
does not wait for the longest.

What one request sees is what it sees alone: its rows of the cache are left-padded, hidden from every other
position by the attention mask and numbered by their own position ids (the solo run's numbers); its steering
hooks edit only its own row, at positions counted over its own tokens (``ForwardState.pad``); its captures are
cut from its own row with the padding removed; its seed, stop strings, eos and length are its own. The cache is
transformers' own DynamicCache; only its per-layer key/value tensors are padded, joined and selected by row
(a cache whose layers keep a sliding window cannot be joined safely, so there a newcomer waits until the batch
is empty and then starts a batch with everyone else waiting).

Cancelling one request (its token) drops it at the next step boundary; the others run on. The cancel hooks stop
a forward in the middle only when every request in it is cancelled (an interrupt of a lone request stops at the
next layer as before); that forward's requests then all end, and a half-updated cache goes with them.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..backend import OperationCancelled
from ..cache import Cache
from ..core.addresses import slice_head
from ..core.inputs import str_tokens
from ..core.results import GenerationResult, GenStep
from ..core.steer_spec import ForwardState, SteerSpec
from ..errors import CapabilityUnsupported, StructureError
from .generate import (
    Plan,
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


@dataclass(eq=False)
class Request:
    """One single-prompt generation: its arguments, its progress, and how its result gets back."""

    plan: Plan
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    n_logprobs: int = 0
    keep_logits: bool = True
    stream: bool = False
    token: Any = None  # the Session's CancelToken once the call is queued
    closed: bool = False  # a stream its consumer closed
    # progress
    generated: list[int] = field(default_factory=list)
    steps: list[GenStep] = field(default_factory=list)
    outbox: deque = field(default_factory=deque)  # a stream's steps not yet handed out
    reason: str = "length"
    error: BaseException | None = None
    finished: bool = False
    result: GenerationResult | None = None
    # its place in the batch
    pad: int = 0  # left padding of its row in the batch's frame
    next_token: int = 0  # the token its row is fed at the next decode forward
    draining: GenStep | None = None  # its last step, waiting for the forward that captures its last token
    state: ForwardState = field(default_factory=ForwardState)
    parts: dict[Address, list[torch.Tensor]] = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)  # own positions each forward covered
    handed: int = 0  # forwards whose rows earlier steps already carry

    def __post_init__(self) -> None:
        seed = self.plan.seeds[0]
        self.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.prompt = self.plan.rows[0]
        self.n = int(self.prompt.shape[1])

    @property
    def cancelled(self) -> bool:
        return self.closed or bool(self.token is not None and self.token.cancelled)

    @property
    def captures(self) -> bool:
        return bool(self.plan.addrs)


@dataclass(eq=False)
class CaptureRequest:
    """One single-prompt capture (no grad): its ids, the points, its steering; its Cache once read."""

    ids: torch.Tensor  # [1, n]
    mask: torch.Tensor | None  # the prompt's own attention mask, as a solo capture passes it
    addrs: list[Address]
    specs: list[SteerSpec]
    token: Any = None
    finished: bool = False
    result: Cache | None = None
    error: BaseException | None = None
    state: ForwardState = field(default_factory=ForwardState)

    @property
    def cancelled(self) -> bool:
        return bool(self.token is not None and self.token.cancelled)


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


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t


class Batcher:
    """The shared batch of one eager backend. Every method runs under the session's operation lock, except
    `submit` and `forget` (any thread)."""

    def __init__(self, lm: Any):
        self.lm = lm
        self._guard = threading.Lock()
        self.pending: list[Request] = []
        self.captures: list[CaptureRequest] = []  # captures queued: the first to compute reads them all
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
    def submit(self, req: Request | CaptureRequest) -> None:
        with self._guard:
            if isinstance(req, CaptureRequest):
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
    def drive(self, req: Request) -> None:
        """Run the batch until `req` is finished (a stream: until it has a step to hand out)."""
        lm = self.lm
        try:
            with lm.lock, torch.no_grad():
                while not (req.finished or (req.stream and req.outbox)):
                    if not (self.rows or self.pending):
                        raise RuntimeError("internal: a batched request is neither queued nor running")
                    self._step()
                self._drop_cancelled()  # requests cancelled while queued: nobody else may drive soon
        finally:
            self._unhook()
        if req.finished and req.error is not None and not req.outbox:
            raise req.error

    def _step(self) -> None:
        self._drop_cancelled()
        with self._guard:
            if self.rows and not self._can_join():
                joining: list[Request] = []
            else:
                joining, self.pending = self.pending, []
        if joining:  # a step of its own: a stream's driver then hands out its first token before running on
            self._admit(joining)
        elif self.rows:
            self._decode()

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

    # ---- captures ------------------------------------------------------------------------------------
    def read(self, req: CaptureRequest, rows_for: Any) -> Cache:
        """Read `req`, with every capture queued meanwhile, in right-padded forwards of at most rows_for(width,
        points) rows; each Cache holds only its own prompt's tokens (as `capture` over a list)."""
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
                width = max(x.ids.shape[1] for x in [*group, c])
                points = len({a.without_head() for x in [*group, c] for a in x.addrs})
                if len(group) + 1 > rows_for(width, points):
                    break
                group.append(c)
            with self._guard:
                self.captures = queued[len(group) :] + self.captures  # the rest wait for their own turn
            self._read_group(group)
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _read_group(self, group: list[CaptureRequest]) -> None:
        lm = self.lm
        lens = [int(c.ids.shape[1]) for c in group]
        width = max(lens)
        device = group[0].ids.device
        ids = torch.full((len(group), width), self._pad_id, dtype=torch.long, device=device)
        for i, c in enumerate(group):
            ids[i, : lens[i]] = c.ids[0]
        mask: torch.Tensor | None = group[0].mask if len(group) == 1 else None  # alone: exactly as capture()
        if min(lens) < width:  # right padding: real tokens never read the pads after them, the mask hides them
            mask = (torch.arange(width, device=device)[None] < torch.tensor(lens, device=device)[:, None]).long()
        for i, c in enumerate(group):
            c.state.ids, c.state.offset, c.state.prompt_len, c.state.pad = ids[i : i + 1], 0, None, None
        bases = list(dict.fromkeys(a.without_head() for c in group for a in c.addrs))
        edits = [(a, self._row_edit(c, sp)) for c in group for sp in c.specs for a in sp.addresses]
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
            for c in group:
                c.error, c.finished = (OperationCancelled("interrupted") if c.cancelled else e), True
            return
        finally:
            self._at = {}
            self.in_forward = []
        for i, (c, n) in enumerate(zip(group, lens)):
            got: dict[Address, torch.Tensor] = {}
            for a in c.addrs:
                parts = taps.collected.get(a.without_head(), [])
                if len(parts) != 1:
                    c.error = StructureError(
                        f"{a} was seen {len(parts)} times in one forward (expected once): the module it is read "
                        "from is shared or skipped on this family, so ie_lab will not pick one."
                    )
                    break
                t = parts[0][i : i + 1]
                t = t[:, :, :n, :n] if a.point.is_attention else t[:, :n]
                got[a] = slice_head(a, t, lm.facts)
            if c.error is None:
                c.result = Cache(got, tokens=c.ids, str_tokens=str_tokens(lm, c.ids), attention_mask=c.mask)
            c.finished = True

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
            r.next_token = self._choose(r, logits[i])
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
            if r.draining is not None:
                self._finish(r, r.draining)
                continue
            r.next_token = self._choose(r, logits[i])
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
                edits = [(a, self._row_edit(r, sp)) for r in reqs for sp in r.plan.specs for a in sp.addresses]
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

    def _row_edit(self, req: Request | CaptureRequest, spec: SteerSpec) -> Any:
        edit = spec.edit(req.state, self._special)

        def apply(h: torch.Tensor, offset: int) -> torch.Tensor:
            r = self._at.get(id(req))
            if r is None:
                return h
            out = h.clone()
            out[r : r + 1] = edit(h[r : r + 1], offset).to(h.dtype)
            return out

        return apply

    def _collect(self, reqs: list[Request], offset: int, s: int) -> None:
        """Each capturing request's rows of this forward, pads cut, kept at its own positions."""
        assert self._taps is not None
        got = {base: parts[-1] for base, parts in self._taps.collected.items() if parts}
        self._taps.collected.clear()
        for i, r in enumerate(reqs):
            if not r.plan.addrs:
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
    def _choose(self, r: Request, row_logits: torch.Tensor) -> int:
        """The request's next token from its row's logits, its step, and whether it ends here."""
        p = r.plan
        token_id = _choose(row_logits, r.temperature, r.top_k, r.top_p, r.gen)
        r.generated.append(token_id)
        i = len(r.generated) - 1
        step = make_step(self.lm, i, token_id, row_logits, r.n_logprobs, r.keep_logits, 0)
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
            r.draining = None
            self._hand(r, draining, last=True)
            r.steps.append(draining)
            if r.stream:
                r.outbox.append(draining)
        tok = self.lm.tokenizer
        text = tok.decode(r.generated) if tok is not None else " ".join(map(str, r.generated))
        cache = r.steps[-1].cache if r.captures and r.steps else None
        r.result = GenerationResult(r.prompt, r.generated, text, r.steps, r.reason, cache)
        r.finished = True
        r.parts = {}

    def _fail_all(self, reqs: list[Request], error: BaseException) -> None:
        for r in reqs:
            self._fail(r, OperationCancelled("interrupted") if r.cancelled else error)

    def _fail(self, r: Request, error: BaseException) -> None:
        if not r.finished:
            r.error, r.finished = error, True
            r.parts = {}


class BatchedCall:
    """What the eager backend returns for a batched generate: a function of no arguments for the Session, which
    hands it its cancel token as the call is queued (`bind`: the request joins the batch from then on)."""

    def __init__(self, batcher: Batcher, req: Request):
        self.batcher, self.req = batcher, req
        self._submitted = False

    def bind(self, token: Any) -> None:
        self.req.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.req)

    def __call__(self) -> GenerationResult:
        if not self._submitted:
            self.bind(self.req.token)
        self.batcher.drive(self.req)
        assert self.req.result is not None
        return self.req.result


class BatchedCapture:
    """What the eager backend returns for a capture: queued at `bind`, read with the captures queued meanwhile."""

    def __init__(self, batcher: Batcher, req: CaptureRequest, rows_for: Any):
        self.batcher, self.req, self.rows_for = batcher, req, rows_for
        self._submitted = False

    def bind(self, token: Any) -> None:
        self.req.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.req)

    def __call__(self) -> Cache:
        return self.batcher.read(self.req, self.rows_for)


class BatchedStream(Iterator[GenStep]):
    """A batched generate_stream: each next() drives the batch until this request has a step to hand out; close()
    (or an exhausted stream) leaves the batch at the next step boundary."""

    def __init__(self, batcher: Batcher, req: Request):
        self.batcher, self.req = batcher, req
        self._submitted = False

    def bind(self, token: Any) -> None:
        self.req.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.req)

    def __next__(self) -> GenStep:
        r = self.req
        if not self._submitted:
            self.bind(r.token)
        if not r.outbox and not r.finished:
            self.batcher.drive(r)
        if r.outbox:
            return r.outbox.popleft()
        if r.error is not None:
            raise r.error
        raise StopIteration

    def close(self) -> None:
        # Closed where the stream holds the operation lock (the Session closes it before handing the lock back), so
        # its row leaves the batch now.
        self.req.closed = True
        self.batcher.prune()


__all__ = ["Batcher", "BatchedCall", "BatchedCapture", "BatchedStream", "CaptureRequest", "Request"]
