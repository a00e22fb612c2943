"""Building and submitting vLLM requests for a VLLMBackend: what a request captures and steers (`_work_for`,
checked before it reaches the engine), its sampling parameters, its prompt's ids, the request itself (registered
with the worker, streamed, collected), and the steering specs a Session hands out. A room of VLLMBackend
(ie_lab/vllm/backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import torch

from ..address import Address
from ..core.addresses import parse_addresses
from ..core.inputs import prepare
from ..core.splice_spec import SpliceSpec, acts_name, make_splice_spec
from ..core.steer_scope import active_specs, enter_scope, exit_scope
from ..core.steer_spec import make_spec
from ..core.transcoder_splice import TranscoderSplice, is_transcoders, make_transcoder_splice
from ..errors import (
    CapabilityUnsupported,
    InputError,
)
from ..ops.projection import Encoder, to_plain
from .checks import (
    _Work,
    check_graph_steer,
    check_sampling,
    check_served,
)

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.
from .results import _raise_if_failed
from .wire import RECOMPUTED, SPLICE_METHODS, pack


def _splice_payload(spec: SpliceSpec) -> list[dict]:
    """A splice as a steering entry of method 'splice': the SAE's encoder and decoder, the edits, the error flag, and
    the name its features are kept under when a capture asks for them ('keep', set by the capture)."""
    idx, vals = spec.edits()
    sae = spec.sae
    return [
        {
            "address": str(spec.addresses[0]),
            "method": "splice",
            "kwargs": {},
            "vector": pack(torch.zeros(0)),
            "positions": "all",
            "splice": {
                "encoder": to_plain(spec._enc, pack),
                "W_dec": pack(sae.W_dec.float()),
                "b_dec": None if sae.b_dec is None else pack(sae.b_dec.float()),
                "idx": [int(i) for i in idx.tolist()],
                "vals": [float(v) for v in vals.tolist()],
                "error": bool(spec.error),
                "acts": acts_name(spec.name),
                "keep": False,
            },
        }
    ]


def _columns(w: torch.Tensor, dim: int, cols: torch.Tensor | None) -> torch.Tensor:
    """A transcoder weight in float32, cut to the features that travel (cols; None: all of them)."""
    w = w.detach().float()
    return w if cols is None else w.index_select(dim, cols)


def _check_transcoder(lm: Any, t: Any, error: bool) -> str:
    """The activation the worker encodes t's features with, once both of its points are served on this model and
    the worker computes what eager does with it (error: the splice keeps the error term)."""
    check_served(lm, t.address_in)
    check_served(lm, t.address_out, steering=True)
    if getattr(t, "decoders", None) or getattr(t, "clt_layers", ()):
        # a CLT layer as load_transcoders builds it: its own write in W_dec, its later layers' in decoders; the
        # worker writes its own layer only, so a clamp would miss every later layer's (value - act) * W_dec[l -> l']
        raise CapabilityUnsupported(
            f"the cross-layer transcoder {t.address_in} -> layers {list(getattr(t, 'writes_to', [t.layer]))} on "
            "backend='vllm'",
            "the worker pairs one layer's mlp_in with the same layer's mlp_out; a cross-layer transcoder's features "
            "also write every later layer, which the worker does not",
            "use backend='eager'",
        )
    if getattr(t, "W_skip", None) is not None and not error:
        raise CapabilityUnsupported(
            f"the skip transcoder {t.address_in} -> {t.address_out} spliced with error=False on backend='vllm'",
            "the worker writes the features' reconstruction without the skip path's x @ W_skip (with the error term "
            "kept the skip path cancels out, and that splice is served)",
            "keep error=True, or use backend='eager'",
        )
    W_dec = t.W_dec
    if t.address_out.layer != t.layer or W_dec.dim() != 2 or tuple(W_dec.shape) != (t.d_sae, lm.facts.d_model):
        raise CapabilityUnsupported(
            f"the transcoder {t.address_in} -> {t.address_out} (W_dec {tuple(W_dec.shape)}) on backend='vllm'",
            "the worker pairs one layer's mlp_in with the same layer's mlp_out, through a [d_sae, d_model] decoder; "
            "a transcoder that writes other layers (cross-layer) is not spliced there",
            "use backend='eager'",
        )
    act = "jumprelu" if getattr(t, "threshold", None) is not None else getattr(t, "activation", None)
    if act not in ("relu", "jumprelu", "topk"):
        raise CapabilityUnsupported(
            f"a transcoder with activation {act!r} on backend='vllm'",
            "the worker encodes with ops/projection.py's activations (relu, jumprelu, topk) only",
            "use backend='eager', which calls the transcoder's own activate()",
        )
    return act


def _transcoder_payload(spec: TranscoderSplice) -> list[dict]:
    """A transcoder splice as two steering entries per layer, paired by 'tc': 'transcoder_in' at mlp_in.L keeps the
    request's rows the MLP reads, and 'transcoder' at mlp_out.L encodes them and writes (ops/splice.py, the eager
    hooks' arithmetic). A clamp's position travels as an absolute position (None: every position, prompt and
    generated), which the worker matches against each row's own position, however vLLM packs and chunks the batch.
    With the error term kept, a layer with no clamp is the plain run and sends nothing, and (a ReLU or JumpReLU
    encoder: each feature's activation is its own column's) only the clamped features' columns travel."""
    out: list[dict] = []
    for t in spec.transcoders:
        act = _check_transcoder(spec.lm, t, spec.error)
        th = getattr(t, "threshold", None)
        mine = [c for c in spec.clamps if c[0] == t.layer]
        if spec.error and not mine:
            continue
        feats = sorted({c[1] for c in mine}) if spec.error and act != "topk" else list(range(t.d_sae))
        col = {f: j for j, f in enumerate(feats)}
        cols = None if len(feats) == t.d_sae else torch.tensor(feats, dtype=torch.long)
        kept = functools.partial(_columns, cols=cols)
        k = getattr(t, "k", None) if act == "topk" else None
        enc = Encoder(kept(t.W_enc, 1), kept(t.b_enc, 0), None, act, None if th is None else kept(th, 0), k)
        key = f"{id(spec)}.{t.layer}"
        none = {"kwargs": {}, "vector": pack(torch.zeros(0)), "positions": "all", "tc": key}
        out.append({"address": str(t.address_in), "method": "transcoder_in", **none})
        out.append(
            {
                "address": str(t.address_out),
                "method": "transcoder",
                **none,
                "transcoder": {
                    "encoder": to_plain(enc, pack),
                    "W_dec": pack(kept(t.W_dec, 0)),
                    "b_dec": None if spec.error or t.b_dec is None else pack(t.b_dec.detach().float()),
                    "idx": [col[c[1]] for c in mine],
                    "vals": [float(c[3]) for c in mine],
                    "at": [None if c[2] is None else int(c[2]) for c in mine],
                    "error": bool(spec.error),
                },
            }
        )
    return out


def _graph_splice() -> CapabilityUnsupported:
    return CapabilityUnsupported(
        "SAE and transcoder splicing in graph mode",
        "graph mode's compiled trunk applies the steering methods of its static buffers only; a splice runs an SAE's "
        "(or a transcoder's) encoder and decoder at its point",
        "create the Session without graph_points / steer_points (hooks apply splices), or use backend='eager'",
    )


def _steer_payload(spec: Any) -> list[dict]:
    if isinstance(spec, TranscoderSplice):  # intervene= or s.splice(transcoders)
        return _transcoder_payload(spec)
    if isinstance(spec, SpliceSpec):
        return _splice_payload(spec)
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


def _as_specs(steer: Any) -> list[Any]:
    if steer is None:
        return []
    items = [steer] if not isinstance(steer, (list, tuple)) else list(steer)
    return [s.spec if isinstance(s, _VLLMSteer) else s for s in items]


class _Requests:
    """Requests: what they carry, checked before the engine sees them, and submitting one."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _check_open: Any
    _driver: Any
    _graph: Any
    _inflight: Any
    _len_why: Any
    _max_len: Any
    _refuse_in_generate_mode: Any
    lm: Any

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
        if self._graph is not None and any(p["method"] in SPLICE_METHODS for p in payload):
            raise _graph_splice()
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
            self._driver.assign(rid)  # data parallel: the rank it runs on, and where its rows are read
            try:
                await self._driver.rpc("ie_register", rid, spec)  # on every rank
            except BaseException:  # a rank that did register forgets it again
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._driver.rpc("ie_release", rid))
                self._driver.release(rid)
                raise
            registered = True
            params.extra_args = {"ie_lab": rid}
            prompt["cache_salt"] = rid  # never share KV blocks with other requests: they are read or edited
        self._inflight.add(rid)
        box["rid"] = rid
        done = False
        try:
            async with contextlib.aclosing(self._driver.generate(prompt, params, rid, key=rid)) as stream:
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
                    async with contextlib.aclosing(self._driver.generate(follow, fparams, fid, key=rid)) as stream:
                        async for _ in stream:
                            pass
                finally:
                    self._inflight.discard(fid)
            if registered:
                res = await self._driver.rpc_for(rid, "ie_collect", rid)
                registered = False
                _raise_if_failed(res)
                box["collected"] = res
        finally:
            self._inflight.discard(rid)
            if registered:  # aborted, failed or abandoned: the worker forgets the request
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._driver.rpc("ie_release", rid))
            self._driver.release(rid)
            box["done"] = done

    def _ids(self, prompt: Any) -> torch.Tensor:
        ids, mask = prepare(self.lm, prompt)
        if mask is not None and not bool(mask.all()):
            raise InputError(
                "prompts of different lengths: on backend='vllm' pass one prompt per call (concurrent "
                "calls are batched by vLLM)."
            )
        return ids

    def _params(
        self, max_new_tokens, temperature, top_k, top_p, seed, stop, n_logprobs, ignore_eos=False, stop_token_ids=None
    ):
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
            stop_token_ids=sorted(stop_token_ids) if stop_token_ids else None,  # a chat's turn end (core/chat.py)
        )

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

    def splice(self, sae: Any, *, error: bool = False) -> SpliceSpec | TranscoderSplice:
        """An SAE spliced in at its point (docs/SAE.md, "Splicing"): the worker replaces the point's rows by the
        SAE's reconstruction, as the eager hooks do (ops/splice.py). `with spec:` or splice=spec."""
        self._check_open()
        self._refuse_in_generate_mode("splicing")
        graph = self.lm.info.get("graph_points") is not None
        if is_transcoders(sae):  # read at mlp_in.L, written at mlp_out.L (docs/CIRCUITS.md, "Interventions")
            tspec = make_transcoder_splice(self.lm, sae, error=error)
            if graph:
                raise _graph_splice()
            for t in tspec.transcoders:
                _check_transcoder(self.lm, t, tspec.error)
            return tspec
        spec = make_splice_spec(self.lm, sae, error=error)
        if graph:
            raise _graph_splice()
        check_served(self.lm, spec.addresses[0], steering=True)
        return spec


class _VLLMSteer:
    """A steering spec on vLLM: pass as steer=..., or `with spec:` to steer the requests this context issues inside."""

    def __init__(self, spec: Any, session: Any):
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
