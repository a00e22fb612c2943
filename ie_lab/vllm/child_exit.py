"""vLLM's engine-core and worker processes end as soon as their shutdown is done, without the interpreter's teardown.

Session.close() on an engine that runs in processes of its own (engine='async', tensor parallelism) calls vLLM's
AsyncLLM.shutdown: the engine core gets SIGTERM, tears itself down (its executor and workers, scheduler and process
groups: about a second here), and vLLM's process manager waits at most 5 s for the process to end, then kills it and
logs "force killing remaining process" (vllm.v1.utils.shutdown). What the process does after its teardown is
Python's finalisation of an interpreter that imported torch, transformers and vLLM: module teardown, a last collection
over the whole heap, libraries' static destructors. That took 1.5-2 s on a quiet 2-core machine and more than the
5 s under load (measured), so every close waited seconds for it or was killed, warning. A worker process of the
multiprocessing executor (tensor parallelism) ends the same way after its parent closes its pipe, and its engine core
waits for it the same way (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, then SIGTERM with a warning).

None of that finalisation matters to a process that is about to exit (the OS takes back its memory and files), so
these processes skip it: once Python starts exiting, the exit handlers registered with atexit still run (logging's
flush among them), the standard streams are flushed, and the process ends with os._exit. multiprocessing has already
joined the process's threads and run its finalizers by then (BaseProcess._bootstrap, before sys.exit).

Which processes, and the exit status they end with (the status an ordinary exit would give):
- a worker of vLLM's multiprocessing executor ("VllmWorker-N"): always, with status 0, which is what vLLM's
  worker_main exits with on every path (it logs an error and returns, or re-raises the SystemExit its signal handler
  raised with no code);
- an engine core ("EngineCore..."): only after SIGTERM or SIGINT asked it to stop (the signal handler vLLM installs is
  wrapped to note it), with status 0, as the SystemExit its busy loop raises after a requested shutdown gives. An
  engine core that stops for any other reason (a fatal error: status 1) exits as Python does, its status intact.
- any other process (the user's, where an in-process engine loads this extension): nothing is installed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from typing import Any

ENGINE_CORE = "EngineCore"  # vLLM's names for the processes it starts (multiprocessing's process name)
WORKER = "VllmWorker"

_installed = False
_asked_to_stop = False  # an engine core received SIGTERM / SIGINT
_role: str | None = None


def role(process_name: str) -> str | None:
    """'engine core', 'worker' or None (not a process vLLM started for its engine), from multiprocessing's name."""
    if process_name.startswith(ENGINE_CORE):
        return "engine core"
    if process_name.startswith(WORKER):
        return "worker"
    return None


def _noting(previous: Any):
    def handler(signum: int, frame: Any) -> Any:
        global _asked_to_stop
        _asked_to_stop = True
        if callable(previous):
            return previous(signum, frame)  # vLLM's own: it starts the engine core's shutdown
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signum)  # no Python handler was set: what the signal did before
        return None

    return handler


def _exit_now() -> None:
    with contextlib.suppress(Exception):
        atexit.unregister(_exit_now)
    if _role is None or (_role == "engine core" and not _asked_to_stop):
        return  # Python's own exit, its status intact
    atexit._run_exitfuncs()  # the other exit handlers, as an ordinary exit runs them (this one is unregistered)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def installed_role() -> str | None:
    """The role install() found this process in ('engine core' or 'worker'), None where nothing was installed."""
    return _role


def install(process_name: str | None = None) -> bool:
    """In an engine core or worker process vLLM started: end the process without the interpreter's teardown once
    Python starts exiting (see the module's docstring). Called where the worker extension is imported, in the process
    that runs the worker. Returns whether it was installed (False in any other process, or when already done)."""
    global _installed, _role
    if _installed:
        return False
    if process_name is None:
        import multiprocessing

        process_name = multiprocessing.current_process().name
    which = role(process_name)
    if which is None:
        return False
    if which == "engine core":
        if threading.current_thread() is not threading.main_thread():
            return False  # signal handlers can only be set from the main thread: leave the exit as it is
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _noting(signal.getsignal(sig)))
    _role = which
    atexit.register(_exit_now)
    _installed = True
    return True
