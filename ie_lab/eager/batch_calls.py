"""What the eager backend hands the Session for a batched call: a function of no arguments (a generate, a capture,
a gradients() call) or an iterator (a stream), each bound to the Session's cancel token as the call is queued, at
which point its requests join the shared batch (ie_lab/eager/batcher.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from ..backend import OperationCancelled
from ..cache import Cache
from ..core.results import GenerationResult, GenStep
from .batch_decode import Batcher
from .batch_requests import CaptureRequest, GradRequest, Request, first_error, ready


class _Queued:
    """A call's requests, queued on the batch once: `bind` hands them the Session's cancel token (again on a later
    bind) and submits them the first time."""

    batcher: Batcher
    reqs: list[Any]
    _submitted: bool

    def bind(self, token: Any) -> None:
        for r in self.reqs:
            r.token = token
        if not self._submitted:
            self._submitted = True
            self.batcher.submit(self.reqs)


class BatchedCall(_Queued):
    """What the eager backend returns for a batched generate: a function of no arguments for the Session, which
    hands it its cancel token as the call is queued (`bind`: its requests join the batch from then on). A list of
    prompts is one request per prompt; the result is then a list, in prompt order."""

    def __init__(self, batcher: Batcher, reqs: list[Request], batch: bool):
        self.batcher, self.reqs, self.batch = batcher, reqs, batch
        self._submitted = False

    def __call__(self) -> GenerationResult | list[GenerationResult]:
        if not self._submitted:
            self.bind(self.reqs[0].token)
        self.batcher.drive(self.reqs)
        error = first_error(self.reqs)
        if error is not None:
            raise error
        results = [r.result for r in self.reqs]
        assert all(x is not None for x in results)
        return results if self.batch else results[0]  # type: ignore[return-value]


class BatchedCapture(_Queued):
    """What the eager backend returns for a capture (or a gradients call): queued at `bind`, read with the requests
    of its kind queued meanwhile. A list of prompts is one request per prompt, read in as few forwards as the
    memory budget allows."""

    def __init__(self, batcher: Batcher, reqs: list[CaptureRequest] | list[GradRequest], rows_for: Any, batch: bool):
        self.batcher, self.reqs, self.rows_for, self.batch = batcher, reqs, rows_for, batch
        self._submitted = False

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
        error = first_error(self.reqs)
        if error is not None:
            raise error
        results = [r.result for r in self.reqs]
        return results if self.batch else results[0]  # type: ignore[return-value]


class BatchedStream(_Queued, Iterator[GenStep]):
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
        return bool(self._out) or ready(self.reqs)

    def poll(self) -> GenStep | None:
        """The next step another driver produced, without driving: None while there is none yet; StopIteration (or
        the request's error) once every request is finished and every step handed out."""
        if self._out:
            return self._out.popleft()
        done = all(r.finished for r in self.reqs)  # read first: a request's steps are queued before it finishes
        if ready(self.reqs) and self._take():
            return self._out.popleft()
        if done:
            return self._end()
        return None

    def _end(self) -> GenStep:
        error = first_error(self.reqs)
        if error is not None:
            raise error
        raise StopIteration

    def __next__(self) -> GenStep:
        if not self._submitted:
            self.bind(self.reqs[0].token)
        self._holding = True
        if not self._out and not ready(self.reqs):
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
