"""Two ways to drive vLLM from a Session's loop, behind one small interface.

``AsyncDriver`` wraps vLLM's ``AsyncLLM`` (engine core in its own process, workers spawned for tensor
parallelism): the production path. ``InprocDriver`` steps an in-process ``LLMEngine`` from a task on the
Session's loop: vLLM's AsyncLLM cannot run its engine core in-process ("Running EngineCore in asyncio
without multiprocessing is not currently supported"), and on a 2-core CPU the in-process engine loads
several times faster, so tests and notebooks on CPU use it. Both batch concurrent requests (the
scheduler sees every request added since the last step) and both abort a request whose consumer stops.

Interface: ``await build()``, ``generate(prompt, params, request_id, key=None)`` (async iterator of RequestOutput
deltas), ``await rpc(method, *args)`` (one result per worker, every data-parallel rank's), ``assign(key)`` /
``release(key)`` and ``await rpc_for(key, method, *args)`` (a registered request's rank and its worker's answer),
``await shutdown()``.

Data parallelism (``AsyncDriver(args, dp=2)``): vLLM runs one engine core per rank, each with its own workers, and its
client's ``collective_rpc`` hands back rank 0's workers' answers only (with vLLM's own balancer the call reaches every
rank; with an external one, rank 0 alone): a request rank 1 ran would read back empty. So every ie_* call goes to
every rank through ``call_utility_all_async``, one answer per rank (the hooks are installed, and a request registered
and released, everywhere), a registered
request is pinned to the rank ie_lab picks for it (``data_parallel_rank``, the least busy; a capture's follow-up
forward runs where its request ran), and its rows are read from that rank's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

WORKER_EXTENSION = "ie_lab.vllm.worker.IELabWorker"

# engine_kwargs a user may pass, each with why it cannot change what a hook reads or writes. Everything
# else is refused at load (REFUSED says why, and what to use instead): an engine argument that quietly
# compiles the trunk, changes numerics, or reorders work the hooks rely on would hand back tensors or
# steering that differ from eager with nothing to show it. docs/VLLM.md renders both tables.
SAFE_ENGINE_KWARGS: dict[str, str] = {
    "max_num_seqs": "how many requests the scheduler batches; the hooks split every forward's rows per request.",
    "max_num_batched_tokens": "the token budget of one forward; a prompt split into chunks is filed by absolute "
    "position, so chunking changes nothing a capture or steering sees.",
    "enable_chunked_prefill": "as max_num_batched_tokens: chunks are filed by absolute position.",
    "block_size": "the KV page size; capture and steering requests carry their own cache salt whatever it is.",
    "gpu_memory_utilization": "memory sizing only.",
    "kv_cache_memory_bytes": "memory sizing only.",
    "max_logprobs": "the most top log-probabilities a request may ask for (raise it for n_logprobs above 20).",
    "scheduling_policy": "the order waiting requests are admitted in; per-request work does not depend on it.",
    "disable_log_stats": "logging only.",
    "download_dir": "where a hub checkpoint is cached.",
    "max_parallel_loading_workers": "loading only.",
    "use_tqdm_on_load": "loading only.",
}

_COMPILED = (
    "it compiles the model (torch.compile, CUDA graphs), and ie_lab's Python hooks run only while the "
    "graph is traced: steering is silently dropped and captures come back empty.",
    "for plain fast generation create the Session with mode='generate' (compiled, no hooks; or switch "
    "with s.set_mode('generate', reload=True)); for compiled capture and steering declare the points "
    "with graph_points=[...] and steer_points=[...] (graph mode, docs/VLLM.md); the default eager engine serves "
    "everything else.",
)
_SESSION_KW = "it is a Session keyword, which ie_lab checks and passes on itself."
_OURS = (
    "ie_lab sets it to install its worker extension and hooks; another value would leave requests without them.",
    "leave it out.",
)
REFUSED_ENGINE_KWARGS: dict[str, tuple[str, str]] = {
    "enforce_eager": _COMPILED,
    "compilation_config": _COMPILED,
    "cudagraph_capture_sizes": _COMPILED,
    "max_cudagraph_capture_size": _COMPILED,
    "optimization_level": _COMPILED,
    "enable_prefix_caching": (
        _SESSION_KW + " Capture and steering requests are salted so they never share KV "
        "blocks; plain generation uses the cache.",
        "Session(..., enable_prefix_caching=...).",
    ),
    "model": (_SESSION_KW, "pass the model as the Session's first argument."),
    "tokenizer": (_SESSION_KW, "Session(..., tokenizer=...)."),
    "dtype": (_SESSION_KW, "Session(..., dtype=...)."),
    "tensor_parallel_size": (_SESSION_KW, "Session(..., tensor_parallel_size=...)."),
    "seed": (_SESSION_KW, "Session(..., seed=...)."),
    "max_model_len": (_SESSION_KW, "Session(..., max_model_len=...)."),
    "trust_remote_code": (_SESSION_KW, "Session(..., trust_remote_code=...)."),
    "worker_extension_cls": _OURS,
    "worker_cls": _OURS,
    "load_format": _OURS,
    "model_loader_extra_config": _OURS,
    "kv_cache_dtype": (
        "a quantised KV cache changes what attention reads inside the kernel; the attention "
        "patterns ie_lab rebuilds from q and k, and every later point, would differ from eager by "
        "an amount no hook sees.",
        "keep the model's dtype for the KV cache.",
    ),
    "quantization": (
        "quantising the weights as vLLM loads them makes every point differ from the checkpoint's model in "
        "transformers, which is what ie_lab checks vLLM against.",
        "pass a checkpoint quantised on disk (compressed-tensors W4A16 or W8A8, torchao int8 or intx weight-only "
        "are served, docs/LOADING.md), or "
        "load it with backend='eager'.",
    ),
    "quantization_config": (
        "as quantization: the weights would differ from the checkpoint's model in transformers.",
        "pass a checkpoint quantised on disk (compressed-tensors W4A16 or W8A8, torchao int8 or intx weight-only "
        "are served, docs/LOADING.md), or "
        "load it with backend='eager'.",
    ),
    "speculative_config": (
        "draft tokens run through the model and are then rejected: hooks would capture and "
        "steer positions that never become output.",
        "leave speculative decoding off.",
    ),
    "spec_method": (
        "as speculative_config: rejected draft tokens pass through the hooks.",
        "leave speculative decoding off.",
    ),
    "spec_model": (
        "as speculative_config: rejected draft tokens pass through the hooks.",
        "leave speculative decoding off.",
    ),
    "spec_tokens": (
        "as speculative_config: rejected draft tokens pass through the hooks.",
        "leave speculative decoding off.",
    ),
    "pipeline_parallel_size": (
        "ie_lab's worker binds the whole trunk on every rank; a pipeline stage holds only some layers.",
        "use tensor_parallel_size=.",
    ),
    "data_parallel_size": (_SESSION_KW, "Session(..., data_parallel_size=...)."),
    "enable_lora": (
        "adapters change the weights per request, which ie_lab's checks against eager do not cover.",
        "merge the adapter into the weights, or use backend='eager'.",
    ),
    "hf_overrides": (
        "it changes the config vLLM builds the model from, while ie_lab reads the checkpoint's own "
        "config: addresses and shapes would be checked against the wrong model.",
        "edit config.json and pass the folder.",
    ),
    "model_impl": (
        "another implementation of the model is not the module tree ie_lab's worker binds and checks.",
        "leave it out.",
    ),
    "disable_sliding_window": (
        "sliding-window layers would attend over the whole context, unlike transformers' model.",
        "leave it out.",
    ),
    "async_scheduling": (
        "the scheduler runs a step ahead of the outputs; ie_lab's per-forward request layout and "
        "its follow-up capture forward are not checked under it.",
        "leave it out.",
    ),
}


def check_engine_kwargs(extra: dict) -> None:
    """Refuse, before anything starts, an engine argument that is not known to leave hooks' results alone."""
    from ..errors import CapabilityUnsupported, InputError, did_you_mean

    for key, value in extra.items():
        if not isinstance(key, str):
            raise InputError(f"engine_kwargs keys are vLLM EngineArgs names (strings), got {key!r}.")
        if key in SAFE_ENGINE_KWARGS:
            continue
        if key == "enforce_eager" and value is True:  # the default ie_lab already uses
            continue
        if key in REFUSED_ENGINE_KWARGS:
            why, instead = REFUSED_ENGINE_KWARGS[key]
            raise CapabilityUnsupported(f"engine_kwargs={{{key!r}: {value!r}}} on backend='vllm'", why, instead)
        raise CapabilityUnsupported(
            f"engine_kwargs={{{key!r}: ...}} on backend='vllm'",
            "ie_lab passes on only the engine arguments known to leave what its hooks capture and steer unchanged, "
            "and this one has not been checked." + did_you_mean(key, SAFE_ENGINE_KWARGS),
            f"use one of {', '.join(sorted(SAFE_ENGINE_KWARGS))} (docs/VLLM.md says why each is safe), or "
            "backend='eager'.",
        )


def engine_args(
    model: str,
    *,
    tokenizer: str | None,
    dtype: str,
    tensor_parallel_size: int,
    enable_prefix_caching: bool,
    data_parallel_size: int = 1,
    max_model_len: int | None,
    seed: int,
    extra: dict,
    async_engine: bool = False,
    graph_points: list[str] | None = None,
    compile_dir: str | None = None,
    steer_points: list[str] | None = None,
    generate_only: bool = False,
    native_ops: tuple[str, ...] = (),
) -> Any:
    """vLLM's EngineArgs for ie_lab's modes. native_ops: vLLM custom ops to run through their PyTorch reference
    (forward_native) instead of the platform's kernel (quirks.VLLM_NATIVE_OPS)."""
    from vllm import AsyncEngineArgs, EngineArgs

    kw = dict(
        model=model,
        tokenizer=tokenizer or model,
        dtype=dtype,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        enable_prefix_caching=enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        seed=seed,
        disable_log_stats=True,
        load_format="safetensors",
    )  # never unpickle weights
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if data_parallel_size > 1 and tensor_parallel_size == 1 and not _on_gpu():
        # vLLM would give each data-parallel engine a worker process of its own (its 'mp' executor, chosen whenever
        # the world across ranks is larger than one); on CPU one worker per engine runs inside the engine's process,
        # which spares a process start (a fresh interpreter importing torch and vLLM) per rank. Not on a GPU, where
        # vLLM's 'mp' executor gives each rank its own device and the 'uni' one is not checked with data parallelism.
        kw["distributed_executor_backend"] = "uni"
    if generate_only:
        # Generation-only mode: vLLM compiles the model as it would on its own (CUDA graphs on a GPU in its default
        # mode), and ie_lab installs nothing in it. A private compile cache, as in graph mode: an artifact traced
        # with graph mode's taps (or a later version of them) is never loaded here.
        kw.update(enforce_eager=False, compilation_config={"cache_dir": compile_dir or ""})
    elif graph_points is not None:
        from . import static_taps, worker  # noqa: F401 - importing the worker registers the loader

        # Compiled trunk with static taps. A private compile cache: an artifact traced without these taps
        # (or with other buffers) must never be loaded. PIECEWISE keeps the top-level model, where rows are
        # split per request, out of the CUDA graphs.
        kw.update(
            enforce_eager=False,
            load_format=static_taps.LOAD_FORMAT,
            model_loader_extra_config={
                static_taps.CONFIG_KEY: list(graph_points),
                static_taps.STEER_KEY: list(steer_points or []),
            },
        )
        import torch

        comp: dict[str, Any] = {"cache_dir": compile_dir or ""}
        if torch.cuda.is_available():
            comp["cudagraph_mode"] = "PIECEWISE"
        kw["compilation_config"] = comp
    if not kw["enforce_eager"]:
        # vLLM's AOT compile (its default from torch 2.10) writes the compiled model under
        # ~/.cache/vllm/torch_compile_cache/torch_aot_compile/<hash>, past the private cache_dir above, and its hash
        # leaves out the load config, where graph mode declares its taps: an artifact traced with other taps (or
        # none, in generate mode) would be loaded for this model. Turned off, compilation keeps to cache_dir.
        # The process's environment is read by vLLM at compile time, here and in the workers it spawns. It also
        # skips serialising the artifact on every start (about a quarter of a graph-mode engine start's CPU time on this CPU).
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        from vllm import envs

        # an engine that already ran in this process froze vLLM's view of the environment (functools.cache)
        getattr(envs.__getattr__, "cache_clear", lambda: None)()
    if native_ops:  # vLLM adds the base mode ('all' or 'none') to custom_ops itself
        ops = {"custom_ops": [f"-{op}" for op in native_ops]}
        prev = kw.get("compilation_config")
        kw["compilation_config"] = {**prev, **ops} if isinstance(prev, dict) else ops
    kw.update(extra)
    return (AsyncEngineArgs if async_engine else EngineArgs)(**kw)


# In-process drivers whose engine is built and not shut down (weakly held: a Session that is never closed
# does not pin its driver).
_LIVE_INPROC: "weakref.WeakSet[InprocDriver]" = weakref.WeakSet()


class InprocDriver:
    kind = "inproc"
    ranks = 1

    def __init__(self, args: Any):
        self.args = args
        self.engine: Any = None
        self.queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self.failures = 0  # engine steps that raised (each failed only the requests it was running)
        self._failed_in_a_row = 0

    async def build(self) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = self.args.create_engine_config()
        _LIVE_INPROC.add(self)
        self.engine = LLMEngine(
            vllm_config=config, executor_class=Executor.get_class(config), log_stats=False, multiprocess_mode=False
        )
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        eng = self.engine
        wake = self._wake
        assert wake is not None  # set by start() before this task is created
        while True:
            if not eng.has_unfinished_requests():
                wake.clear()
                await wake.wait()
                continue
            if self._error is not None:
                return
            try:
                outs = eng.step()  # one scheduler step: every request added so far is batched together
            except Exception as e:  # noqa: BLE001 - fails the requests of this step, not the engine
                self._fail_step(e)
                await asyncio.sleep(0)
                continue
            self._failed_in_a_row = 0
            for o in outs:
                q = self.queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)
            await asyncio.sleep(0)  # let callers add requests between steps

    def _fail_step(self, error: BaseException) -> None:
        """A step raised inside vLLM. vLLM cannot say which request caused it, so the requests it was running
        fail with the error and are aborted (their KV blocks freed, the runner told to drop them); requests
        still waiting to be scheduled, and every later request, run on the same engine. ie_lab's own checks
        keep bad arguments out before this point, and its worker fails only the request a hook failed for."""
        sched = getattr(getattr(getattr(self.engine, "engine_core", None), "engine_core", None), "scheduler", None)
        internal = [r.request_id for r in getattr(sched, "running", ())]
        # vLLM runs each request under an internal id; ours (the external one) is in the output processor's state
        states = getattr(self.engine.output_processor, "request_states", {})
        ours = {getattr(states.get(i), "external_req_id", i) for i in internal}
        hit = [rid for rid in self.queues if rid in ours] or list(self.queues)
        self.failures += 1
        self._failed_in_a_row += 1
        if self._failed_in_a_row > 3:  # the engine itself is broken, not one request: stop rather than spin
            self._error = error
            hit = list(self.queues)
        for rid in hit:
            self.queues[rid].put_nowait(error)
        with contextlib.suppress(Exception):
            self.engine.abort_request(hit)
        if internal:  # whatever else that step ran (not ours to report to) leaves too, or the next step fails again
            with contextlib.suppress(Exception):
                self.engine.abort_request(internal, internal=True)

    def assign(self, key: str) -> None:
        """One engine: every request runs on it."""

    def release(self, key: str) -> None:
        """See assign."""

    async def rpc_for(self, key: str, method: str, *args: Any) -> Any:
        return (await self.rpc(method, *args))[0]

    async def generate(self, prompt: Any, params: Any, request_id: str, key: str | None = None) -> AsyncIterator[Any]:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine stopped: {self._error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            self.engine.add_request(request_id, prompt, params)
            self._wake.set()  # type: ignore[union-attr]  # start() ran: requests come after the driver exists
            while not finished:
                o = await q.get()
                if isinstance(o, BaseException):
                    from ..errors import RequestFailed

                    raise RequestFailed(
                        f"this request failed inside vLLM: {o!r}. The engine keeps running; the "
                        "other requests of the same step failed with it (vLLM cannot say which "
                        "request caused an error inside its step)."
                    ) from o
                finished = o.finished
                yield o
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                with contextlib.suppress(Exception):
                    self.engine.abort_request([request_id])

    async def rpc(self, method: str, *args: Any) -> list:
        return self.engine.collective_rpc(method, args=args)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        _LIVE_INPROC.discard(self)
        others = bool(_LIVE_INPROC)
        if self.engine is not None:
            # vLLM's own teardown is always held back (it would also run a full collection while this driver and
            # the backend still hold the engine, and the Session runs one after dropping them): the groups are
            # released below, once, when no other in-process engine needs them.
            with contextlib.suppress(Exception), _keep_distributed(True):
                self.engine.engine_core.shutdown()
        self.engine = None
        if not others:
            _release_distributed()


class AsyncDriver:
    kind = "async"

    def __init__(self, args: Any, dp: int = 1):
        self.args = args
        self.engine: Any = None
        self.ranks = dp
        self.busy = [0] * dp  # registered requests in flight per data-parallel rank
        self.rank_of: dict[str, int] = {}
        self._next = 0  # where the next tie-break starts
        self.grace: float | None = None  # vLLM's own (5 s) unless the engine core runs the worker (below)

    async def build(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        with _dp_environment(self.ranks):
            self.engine = AsyncLLM.from_engine_args(self.args)
        # Where the worker runs inside the engine core (one rank, vLLM's in-process executor), that process ends right
        # after its own teardown (child_exit.py), and shutdown gives it SHUTDOWN_GRACE_S. Where the engine core only
        # drives worker processes (tensor parallelism, or VLLM_ENABLE_V1_MULTIPROCESSING=1 on CPU), it still ends
        # through Python's finalisation, which vLLM's 5 s cut short is quicker than waiting for.
        with contextlib.suppress(Exception):
            roles = await self.engine.collective_rpc("ie_exit_role", timeout=60)
            if roles and all(r == "engine core" for r in roles):
                self.grace = SHUTDOWN_GRACE_S

    def assign(self, key: str) -> None:
        """Pin a registered request (and its follow-up forward) to the least busy rank; ties go round the ranks, so
        one request at a time alternates too."""
        if self.ranks > 1:
            order = [(self._next + i) % self.ranks for i in range(self.ranks)]
            rank = min(order, key=lambda r: self.busy[r])
            self._next = (rank + 1) % self.ranks
            self.busy[rank] += 1
            self.rank_of[key] = rank

    def release(self, key: str) -> None:
        rank = self.rank_of.pop(key, None)
        if rank is not None:
            self.busy[rank] -= 1

    async def generate(self, prompt: Any, params: Any, request_id: str, key: str | None = None) -> AsyncIterator[Any]:
        finished = False
        rank = self.rank_of.get(key) if key is not None else None
        kw = {} if rank is None else {"data_parallel_rank": rank}
        try:
            async for o in self.engine.generate(prompt, params, request_id, **kw):
                finished = o.finished
                yield o
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)

    async def _per_rank(self, method: str, *args: Any) -> list[list]:
        """Every data-parallel rank's workers' results, in rank order (vLLM's own collective_rpc answers rank 0's)."""
        if self.ranks == 1:
            return [await self.engine.collective_rpc(method, args=args)]
        core = self.engine.engine_core
        return list(await core.call_utility_all_async("collective_rpc", method, None, args, None))

    async def rpc(self, method: str, *args: Any) -> list:
        return [r for rank in await self._per_rank(method, *args) for r in rank]

    async def rpc_for(self, key: str, method: str, *args: Any) -> Any:
        """The first worker's answer on the rank the request runs on. The call still goes to every rank: ie_collect
        forgets the request on each (the others hold it registered, unrun)."""
        per = await self._per_rank(method, *args)
        return per[self.rank_of.get(key, 0)][0]

    async def shutdown(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                try:
                    self.engine.shutdown(timeout=self.grace)
                except TypeError:  # a vLLM whose shutdown takes no timeout: its own 5 s
                    self.engine.shutdown()
            # vLLM stops (or kills) its engine processes without joining them: reaped here, none is left a zombie
            import multiprocessing

            multiprocessing.active_children()
        self.engine = None


# How long vLLM's process manager waits for an engine core that runs the worker to end after SIGTERM before it kills
# it, logging a warning (its default: 5 s). That engine core ends right after its own teardown (vllm/child_exit.py),
# about a second here, so a longer grace costs nothing when it is healthy, and a loaded machine's teardown is not cut
# short by a kill.
SHUTDOWN_GRACE_S = 15.0


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _dp_environment(ranks: int):
    """The environment data-parallel engines start in on CPU (the engines' processes inherit it as they spawn, and
    vLLM's CPU platform reads it as the config is built; restored after, so a later engine in this process starts as
    usual; a VLLM_CPU_OMP_THREADS_BIND the user set is kept, VLLM_ENABLE_V1_MULTIPROCESSING is 0 whatever it was).
    VLLM_CPU_OMP_THREADS_BIND=nobind: vllm-cpu binds an engine's worker to the cores of its local rank, which is 0 on
    every data-parallel engine, so both would share core 0 (on a busy machine they did not finish starting).
    VLLM_ENABLE_V1_MULTIPROCESSING=0: vllm-cpu otherwise swaps the 'uni' executor engine_args asks for for 'mp' (one
    more process per rank, to bind its OpenMP threads, which nobind leaves alone)."""
    if ranks == 1 or _on_gpu():
        yield
        return
    want = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    before = {k: os.environ.get(k) for k in want}
    for k, v in want.items():
        if k == "VLLM_ENABLE_V1_MULTIPROCESSING" or before[k] is None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, was in before.items():
            if was is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = was


_SHUTDOWN_LOCK = threading.Lock()


@contextlib.contextmanager
def _keep_distributed(keep: bool):
    """vLLM's EngineCore.shutdown tears down the process-wide model-parallel groups, which every in-process engine
    shares: closing one Session would break the others' next forward. While another in-process engine is live,
    its shutdown frees this engine (executor, scheduler, KV cache) and leaves the groups alone."""
    if not keep:
        yield
        return
    import vllm.v1.engine.core as core

    with _SHUTDOWN_LOCK:
        original = core.cleanup_dist_env_and_memory
        core.cleanup_dist_env_and_memory = lambda *a, **k: None
        try:
            yield
        finally:
            core.cleanup_dist_env_and_memory = original


def _release_distributed() -> None:
    """Free the in-process engine's model-parallel groups so another engine can start in this process, as vLLM's
    cleanup_dist_env_and_memory does, less its full collection: the Session closing this engine runs that once it
    has dropped its own references (vllm.backend's collect_on_close), which is when it can free the engine.
    gc.unfreeze: vLLM freezes the objects alive after start-up, and a collection never frees frozen objects."""
    import gc

    with contextlib.suppress(Exception):
        import vllm.envs as envs

        envs.disable_envs_cache()
    gc.unfreeze()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
