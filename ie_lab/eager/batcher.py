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

The rooms: what a request is (batch_requests.py), the decode loop that admits, steps and drops rows
(batch_decode.py), the right-padded forwards that read captures and gradients (batch_reads.py), and what a call
hands the Session (batch_calls.py). This module names them for the backend.
"""

from .batch_calls import BatchedCall, BatchedCapture, BatchedStream
from .batch_decode import Batcher, shareable
from .batch_requests import CaptureRequest, GradRequest, Request

__all__ = [
    "Batcher",
    "BatchedCall",
    "BatchedCapture",
    "BatchedStream",
    "CaptureRequest",
    "GradRequest",
    "Request",
    "shareable",
]
