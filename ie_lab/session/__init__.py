"""Session: the one object a notebook user holds.

Each Session owns a background asyncio loop in a daemon thread; every backend operation is queued there. Each
operation exists twice: a plain method for cells and scripts (it works inside Jupyter's already-running loop,
no nest_asyncio), and an ``a``-prefixed coroutine to ``await``. Operations on one Session queue behind an
asyncio lock on that loop, so streams and captures never interleave.

The loop schedules; a plain call's own thread computes. The loop grants the operation lock to the waiting
caller's thread (`_Lease`), which runs the whole operation (a stream: every step, and its cleanup) and hands
the lock back: torch's OpenMP pool belongs to the thread that runs an op, and a second pool on the loop thread
makes libgomp cut its spin-waits once the process holds more pool threads than CPUs, which made every call from
a notebook (whose main thread has a pool) up to ~1.5x slower on CPU (`benchmarks/session_threads.py`). Awaited
twins compute on the loop thread, as the caller's loop must stay free; so that they too compute beside no second
pool, the caller hands its pool back as it hands them over, and the loop its own once none is left (`_OmpPool`).

Interrupts. While a plain call holds the lock on the main thread, SIGINT (Ctrl-C, the notebook's Interrupt)
cancels the operation instead of raising wherever the thread is (`_Deferral`): the forward stops at the next
layer, hooks, steering, the model lock and the operation lock are given back in order, then KeyboardInterrupt
is raised. An interrupt raised in the middle of that cleanup is what left hooks and held locks behind. Awaited
twins are cancelled through the same token, set from the caller's side (the session loop may be busy
computing and would not see a cancel message until it is done). The hand-off itself stores plain flags that
the other side also polls, so a wake-up lost to an interrupt delays a release by one poll and never deadlocks.

The loop thread holds no reference to its Session: a session nobody refers to is closed by `__del__` (thread
stopped, loop and its file descriptors closed, model released), as when a notebook re-binds the name.
"""

from __future__ import annotations

from ..address import Address
from ..backend import OPERATIONS, OperationCancelled, SessionClosed
from .handoff import _POLL, _Deferral, _Lease, _OmpPool, _until_done  # noqa: F401 - read by tests and benchmarks
from .lifecycle import _Lifecycle
from .operations import _Operations, install
from .panels import _Panels
from .streaming import _Streaming


class Session(_Lifecycle, _Operations, _Streaming, _Panels):
    """Load a model once; capture, generate, steer, read lenses, look at attention and patch from cells.

    Session(model, backend="auto" | "eager" | "vllm", device=None, dtype=None, tokenizer=None, prepend_bos=None)
    model: an HF id, a local folder, or a model object (then pass its tokenizer: Session(model, tokenizer) or
    tokenizer=, the way TransformerLens and nnsight users hold one).
    prepend_bos: None keeps the tokenizer's own choice; True / False put a BOS token first or not, as
    TransformerLens' switch does (core/inputs.py text_ids; docs/PORTING.md); every operation also takes it per call.
    backend="vllm" takes further keywords (tensor_parallel_size, data_parallel_size, engine, graph_points, mode, ...: see
    ie_lab.vllm.backend.VLLMBackend); `s.set_mode`, `s.mode`, `s.worker_state()` exist there.

    The Session is the concurrency and the lifecycle; the model and the operations are its backend's
    (ie_lab/backend.py: the protocol, and the table the methods below are generated from).


    The class is composed of rooms, one file each in ie_lab/session/: lifecycle.py (building, closing, facts,
    reprs), operations.py (the door, the dispatch, the generated methods), streaming.py (generate_stream, plain
    and awaited), panels.py (the notebook panels), over handoff.py (the loop, the lock's leases, interrupts).
    """


install(Session)

ASYNC_TWINS = tuple(op.name for op in OPERATIONS)

__all__ = ["Session", "OperationCancelled", "SessionClosed", "Address"]
