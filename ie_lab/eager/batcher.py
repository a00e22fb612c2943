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
from ..errors import CapabilityUnsupported, IELabError, InputError, RequestFailed, StructureError
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
    """One prompt's generation: its arguments, its progress, and how its result gets back. A list of prompts is
    one Request per prompt (``index`` its place in the list), sharing the call's token."""

    plan: Plan
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    n_logprobs: int = 0
    keep_logits: bool = True
    stream: bool = False
    index: int = 0  # its prompt's place in the call's list (GenStep.prompt_index)
    wake: Any = None  # a stream's: called (on the driver's thread) when it has a new step or has finished
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
    # Its kept logits, one row per step, allocated at its first step: a fresh small tensor per step left the
    # allocator so fragmented that 8 requests x 32 tokens peaked ~300 MB above bare HF (benchmarks/eager_batch.py).
    logit_rows: torch.Tensor | None = None

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
    """One prompt's capture (no grad): its ids, the points, its steering; its Cache once read. A list of prompts
    is one CaptureRequest per prompt."""

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


@dataclass(eq=False)
class GradRequest:
    """One prompt's gradients() (unsteered): d metric / d point for its points, its metric seeing only its own row;
    its Cache once computed. Queued with the captures, read only with other GradRequests."""

    ids: torch.Tensor  # [1, n]
    mask: torch.Tensor | None
    addrs: list[Address]  # the points differentiated with respect to
    measured: list[Address]  # of=: what the metric reads instead of the logits
    single: bool  # of= named one point (the metric gets its tensor, not a Cache)
    metric: Any
    token: Any = None
    finished: bool = False
    result: Cache | None = None
    error: BaseException | None = None

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


def _ready(reqs: list[Request]) -> bool:
    """Whether a call's driver may stop: all its requests are done, or (a stream) some have steps to hand out and
    none is holding its last step back for one more forward, so a list's steps of one token go out together."""
    if all(r.finished for r in reqs):
        return True
    return any(r.stream and r.outbox for r in reqs) and not any(r.draining is not None for r in reqs)


def _wake(r: Request) -> None:
    if r.wake is not None:
        r.wake()


def _total(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _first_error(reqs: list[Any]) -> BaseException | None:
    errors = [r.error for r in reqs if r.error is not None]
    return next((e for e in errors if not isinstance(e, OperationCancelled)), errors[0] if errors else None)


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


class Batcher:
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
                while not _ready(reqs):
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

    # ---- captures ------------------------------------------------------------------------------------
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
                if not c.finished:
                    c.error, c.finished = (OperationCancelled("interrupted") if c.cancelled else e), True
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
                t = parts[0][i : i + 1]
                t = t[:, :, :n, :n] if a.point.is_attention else t[:, :n]
                got[a] = slice_head(a, t, lm.facts)
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
            for g in group:
                if not g.finished:
                    g.error, g.finished = (OperationCancelled("interrupted") if g.cancelled else e), True
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
                t = parts[0][i : i + 1]
                t = t[:, :, :n, :n] if m.point.is_attention else t[:, :n]
                seen[m] = slice_head(m, t, self.lm.facts)
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
            _wake(r)
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
        _wake(r)

    def _fail_all(self, reqs: list[Request], error: BaseException) -> None:
        for r in reqs:
            self._fail(r, OperationCancelled("interrupted") if r.cancelled else error)

    def _fail(self, r: Request, error: BaseException) -> None:
        if not r.finished:
            r.error, r.finished = error, True
            r.parts = {}
            _wake(r)


class BatchedCall:
    """What the eager backend returns for a batched generate: a function of no arguments for the Session, which
    hands it its cancel token as the call is queued (`bind`: its requests join the batch from then on). A list of
    prompts is one request per prompt; the result is then a list, in prompt order."""

    def __init__(self, batcher: Batcher, reqs: list[Request], batch: bool):
        self.batcher, self.reqs, self.batch = batcher, reqs, batch
        self._submitted = False

    def bind(self, token: Any) -> None:
        for r in self.reqs:
            r.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.reqs)

    def __call__(self) -> GenerationResult | list[GenerationResult]:
        if not self._submitted:
            self.bind(self.reqs[0].token)
        self.batcher.drive(self.reqs)
        error = _first_error(self.reqs)
        if error is not None:
            raise error
        results = [r.result for r in self.reqs]
        assert all(x is not None for x in results)
        return results if self.batch else results[0]  # type: ignore[return-value]


class BatchedCapture:
    """What the eager backend returns for a capture (or a gradients call): queued at `bind`, read with the requests
    of its kind queued meanwhile. A list of prompts is one request per prompt, read in as few forwards as the
    memory budget allows."""

    def __init__(self, batcher: Batcher, reqs: list[CaptureRequest] | list[GradRequest], rows_for: Any, batch: bool):
        self.batcher, self.reqs, self.rows_for, self.batch = batcher, reqs, rows_for, batch
        self._submitted = False

    def bind(self, token: Any) -> None:
        for r in self.reqs:
            r.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.reqs)

    def __call__(self) -> Cache | list[Cache]:
        if not self._submitted:
            self.bind(self.reqs[0].token)
        try:
            for r in self.reqs:
                if not r.finished:
                    self.batcher.read(r, self.rows_for)
        finally:
            for r in self.reqs:  # a list's prompts not read yet (an error or a cancel): they leave the queue
                if not r.finished:
                    r.error, r.finished = OperationCancelled("interrupted"), True
        error = _first_error(self.reqs)
        if error is not None:
            raise error
        results = [r.result for r in self.reqs]
        return results if self.batch else results[0]  # type: ignore[return-value]


class BatchedStream(Iterator[GenStep]):
    """A batched generate_stream: each next() drives the batch until this call has steps to hand out; close()
    (or an exhausted stream) leaves the batch at the next step boundary. A list of prompts hands out each
    token's steps in prompt order, as a list's stream does alone.

    Its requests join the batch when it is bound, which the Session does as soon as the stream is opened: while
    another request drives the batch (this stream waiting for the operation lock), that driver produces this
    stream's steps too, and the Session hands them out as they come (`watch`, `ready`, `poll`: none of them
    drives, so none needs the lock); once the lock is this stream's, next() drives as above."""

    def __init__(self, batcher: Batcher, reqs: list[Request]):
        self.batcher, self.reqs = batcher, reqs
        self._submitted = False
        self._holding = False  # next() has run: this thread holds the operation lock
        self._out: deque[GenStep] = deque()

    def bind(self, token: Any) -> None:
        for r in self.reqs:
            r.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.reqs)

    def watch(self, wake: Any) -> None:
        """Call wake() (from the driving thread) whenever a step of this stream is produced or it finishes."""
        for r in self.reqs:
            r.wake = wake

    def _take(self) -> bool:
        """Move the steps produced so far (by whoever drove the batch) to this stream's own queue."""
        got = [r.outbox.popleft() for r in self.reqs for _ in range(len(r.outbox))]
        got.sort(key=lambda st: (st.index, st.prompt_index))
        self._out.extend(got)
        return bool(self._out)

    def ready(self) -> bool:
        """Whether poll() has something: a step, or the end (all its requests finished)."""
        return bool(self._out) or _ready(self.reqs)

    def poll(self) -> GenStep | None:
        """The next step another driver produced, without driving: None while there is none yet; StopIteration (or
        the request's error) once every request is finished and every step handed out."""
        if self._out:
            return self._out.popleft()
        done = all(r.finished for r in self.reqs)  # read first: a request's steps are queued before it finishes
        if _ready(self.reqs) and self._take():
            return self._out.popleft()
        if done:
            return self._end()
        return None

    def _end(self) -> GenStep:
        error = _first_error(self.reqs)
        if error is not None:
            raise error
        raise StopIteration

    def __next__(self) -> GenStep:
        if not self._submitted:
            self.bind(self.reqs[0].token)
        self._holding = True
        if not self._out and not _ready(self.reqs):
            self.batcher.drive(self.reqs)
        if self._out or self._take():
            return self._out.popleft()
        return self._end()

    def close(self) -> None:
        for r in self.reqs:
            r.closed = True
            r.wake = None
        if self._holding:
            # Closed where the stream holds the operation lock (the Session closes it before handing the lock
            # back), so its rows leave the batch now; a stream closed while waiting for the lock leaves at the
            # driver's next step boundary.
            self.batcher.prune()


__all__ = ["Batcher", "BatchedCall", "BatchedCapture", "BatchedStream", "CaptureRequest", "GradRequest", "Request"]
