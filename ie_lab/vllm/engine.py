"""Two ways to drive vLLM from a Session's loop, behind one small interface.

``AsyncDriver`` wraps vLLM's ``AsyncLLM`` (engine core in its own process, workers spawned for tensor
parallelism): the production path. ``InprocDriver`` steps an in-process ``LLMEngine`` from a task on the
Session's loop: vLLM's AsyncLLM cannot run its engine core in-process ("Running EngineCore in asyncio
without multiprocessing is not currently supported"), and on a 2-core CPU the in-process engine loads
several times faster, so tests and notebooks on CPU use it. Both batch concurrent requests (the
scheduler sees every request added since the last step) and both abort a request whose consumer stops.

Interface: ``await build()``, ``generate(prompt, params, request_id)`` (async iterator of RequestOutput
deltas), ``await rpc(method, *args)`` (one result per worker), ``await shutdown()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

WORKER_EXTENSION = "ie_lab.vllm.worker.IELabWorker"


def engine_args(model: str, *, tokenizer: str | None, dtype: str, tensor_parallel_size: int,
                enable_prefix_caching: bool, max_model_len: int | None, seed: int, extra: dict,
                async_engine: bool = False, graph_points: list[str] | None = None,
                compile_dir: str | None = None) -> Any:
    from vllm import AsyncEngineArgs, EngineArgs

    kw = dict(model=model, tokenizer=tokenizer or model, dtype=dtype, enforce_eager=True,
              tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=enable_prefix_caching,
              worker_extension_cls=WORKER_EXTENSION, seed=seed, disable_log_stats=True,
              load_format="safetensors")  # never unpickle weights
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if graph_points is not None:
        from . import static_taps, worker  # noqa: F401 - importing the worker registers the loader

        # Compiled trunk with static taps. A private compile cache: an artifact traced without these taps
        # (or with other buffers) must never be loaded. PIECEWISE keeps the top-level model, where rows are
        # split per request, out of the CUDA graphs.
        kw.update(enforce_eager=False, load_format=static_taps.LOAD_FORMAT,
                  model_loader_extra_config={static_taps.CONFIG_KEY: list(graph_points)})
        import torch

        comp: dict[str, Any] = {"cache_dir": compile_dir or ""}
        if torch.cuda.is_available():
            comp["cudagraph_mode"] = "PIECEWISE"
        kw["compilation_config"] = comp
    kw.update(extra)
    return (AsyncEngineArgs if async_engine else EngineArgs)(**kw)


class InprocDriver:
    kind = "inproc"

    def __init__(self, args: Any):
        self.args = args
        self.engine: Any = None
        self.queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None

    async def build(self) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = self.args.create_engine_config()
        self.engine = LLMEngine(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False,
                                multiprocess_mode=False)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outs = eng.step()  # one scheduler step: every request added so far is batched together
            except Exception as e:  # noqa: BLE001 - delivered to every waiting request
                self._error = e
                for q in self.queues.values():
                    q.put_nowait(e)
                raise
            for o in outs:
                q = self.queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)
            await asyncio.sleep(0)  # let callers add requests between steps

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine stopped: {self._error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        finished = False
        try:
            self.engine.add_request(request_id, prompt, params)
            self._wake.set()
            while not finished:
                o = await q.get()
                if isinstance(o, BaseException):
                    raise RuntimeError(f"the vLLM engine failed: {o!r}") from o
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
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.engine_core.shutdown()
        self.engine = None
        _release_distributed()


class AsyncDriver:
    kind = "async"

    def __init__(self, args: Any):
        self.args = args
        self.engine: Any = None

    async def build(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(self.args)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        finished = False
        try:
            async for o in self.engine.generate(prompt, params, request_id):
                finished = o.finished
                yield o
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)

    async def rpc(self, method: str, *args: Any) -> list:
        return await self.engine.collective_rpc(method, args=args)

    async def shutdown(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
        self.engine = None


def _release_distributed() -> None:
    """Free the in-process engine's model-parallel groups so another engine can start in this process."""
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    import gc

    gc.collect()
