"""What one request of the eager backend's shared batch is (the batch's design: ie_lab/eager/batcher.py).

A generation, a capture or a gradients() call becomes one request per prompt: its arguments, its progress, and how
its result or error gets back to the call that made it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..backend import OperationCancelled
from ..cache import Cache
from ..core.results import GenerationResult, GenStep
from ..core.steer_spec import ForwardState, SteerSpec
from .generate import Plan


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


def ready(reqs: list[Request]) -> bool:
    """Whether a call's driver may stop: all its requests are done, or (a stream) some have steps to hand out and
    none is holding its last step back for one more forward, so a list's steps of one token go out together."""
    if all(r.finished for r in reqs):
        return True
    return any(r.stream and r.outbox for r in reqs) and not any(r.draining is not None for r in reqs)


def wake(r: Request) -> None:
    if r.wake is not None:
        r.wake()


def first_error(reqs: list[Any]) -> BaseException | None:
    errors = [r.error for r in reqs if r.error is not None]
    return next((e for e in errors if not isinstance(e, OperationCancelled)), errors[0] if errors else None)
