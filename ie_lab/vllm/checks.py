"""The vLLM backend's checks and client-side types: what needs no engine.

VLLMModel (what the client knows of a served model), check_served (which addresses vLLM serves here), the
modes and their refusals, graph-point and sampling checks, and _Work (what one request asks the worker for).
The backend that drives the engine is backend.py (VLLMBackend); ``Session(path, backend="vllm")`` is a plain
Session holding one (there is no vLLM Session class).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import points as _points
from ..address import Address
from ..arch import quirks
from ..core.client_model import ClientModel
from ..core.sampling import check_generation_args
from ..errors import AddressError, CapabilityUnsupported, InputError, PointAbsent
from . import verdicts
from .wire import RECOMPUTED


class VLLMModel(ClientModel):
    """What the client side knows of a model served by vLLM: facts, tokenizer, and what the worker binds."""

    backend = "vllm"

    def __init__(self, name: str, facts: Any, tokenizer: Any, dtype: torch.dtype, info: dict):
        super().__init__(name, facts, tokenizer, dtype)
        self.info = info


def check_served(lm: VLLMModel, addr: Address, steering: bool = False) -> None:
    """Refuse an address vLLM cannot serve (registry reason) or this model lacks (PointAbsent). steering: the address
    is to be steered, not read (graph mode checks its declared steering sites instead: check_graph_steer)."""
    p = addr.point
    if lm.info.get("mode") == "generate":
        raise CapabilityUnsupported(
            f"{addr} in generation-only mode (mode='generate')", GENERATE_ONLY_WHY, GENERATE_ONLY_FIX
        )
    v = verdicts.POINTS[p.name]
    if not v.verdict.ok:
        raise CapabilityUnsupported(
            f"{addr} on backend='vllm'",
            v.reason or f"{p.name} is {v.verdict.value} on vLLM.",
            "use backend='eager', which serves every point",
        )
    graph = lm.info.get("graph_points")
    if graph is not None and p.name in RECOMPUTED:
        raise CapabilityUnsupported(
            f"{addr} in graph mode",
            "attention patterns are rebuilt from every q/k of a request after it ends, "
            "which needs Python inside the compiled forward.",
            "create the Session without graph_points for attention; its hooks run eagerly.",
        )
    if graph is not None and not steering and str(addr.without_head()) not in graph:
        raise CapabilityUnsupported(
            f"{addr} in graph mode",
            "graph mode reads only the points declared when the Session started "
            f"({', '.join(graph)}): the compiled graph holds a static tap for each of them and for nothing else.",
            "add it to graph_points= when creating the Session, or create the Session without graph_points "
            "(hooks run eagerly and serve every point).",
        )
    if p.name == "attn_scores" and lm.family in quirks.VLLM_SCORES_UNCHECKED:
        raise CapabilityUnsupported(
            f"{addr} on {lm.family} (backend='vllm')",
            f"transformers' {lm.family} hands out attention probabilities but never its pre-softmax scores, so "
            "scores rebuilt from vLLM's q and k would have no reference to be checked against.",
            f"capture attn_probs.{addr.layer} (checked against transformers on this family).",
        )
    # what this model lacks, in the registry's words; the worker reported whether the trunk ends in a norm
    structure = _points.Structure.from_facts(lm.facts, final_norm=bool(lm.info.get("final_norm")))
    _points.require_present("resid_streams" if addr.stream is not None else p, structure, addr.layer, str(addr))
    if p.scope is _points.Scope.TRUNK:
        return
    if addr.layer not in lm.info["present"].get(p.name, []):  # the model has it, but the worker found no module
        raise PointAbsent(
            str(addr),
            lm.family,
            f"{p.name} is not bound on layer {addr.layer} of this family on vLLM.",
            "use backend='eager', or see Session.points() for what this model serves.",
        )


MODES = ("hooks", "generate", "graph")
GENERATE_ONLY_WHY = (
    "the Session runs vLLM's compiled model with none of ie_lab's hooks or taps in it, for plain fast "
    "generation; capture, steering, attention, the logit lens and projection all need them."
)
GENERATE_ONLY_FIX = (
    "switch with s.set_mode('hooks', reload=True) (or set_mode(graph_points=[...], reload=True) for "
    "compiled capture); either reloads the weights into a new engine. Or create the Session with "
    "mode='hooks' (the default)."
)


def _resolve_mode(mode: Any, graph_points: Any, steer_points: Any = None) -> str:
    """The Session mode asked for: graph_points= or steer_points= means graph mode, and nothing means hooks (the
    default)."""
    if mode is not None and mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}.")
    if graph_points is not None or steer_points is not None:
        if mode not in (None, "graph"):
            which = "graph_points=" if graph_points is not None else "steer_points="
            raise InputError(f"{which} declares graph mode, which cannot go with mode={mode!r}; drop one of them.")
        return "graph"
    if mode == "graph":
        raise InputError(
            "mode='graph' needs graph_points=[...] (the points its static taps read, e.g. "
            "graph_points=['resid_post.0']) or steer_points=[...] (the points it may steer)."
        )
    return mode or "hooks"


def check_data_parallel(dp: Any, tp: int, engine: str, mode: str) -> None:
    """data_parallel_size= checked before anything starts: a positive integer; above 1, the async engine in hook mode
    with one worker per engine (the combination checked against eager, tests/test_vllm_data_parallel.py)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise InputError(f"data_parallel_size must be a positive integer (how many engines), got {dp!r}.")
    if dp == 1:
        return
    if engine == "inproc":
        raise InputError(
            f"engine='inproc' runs one engine in this process; data_parallel_size={dp} runs {dp} engine processes: "
            "use engine='auto' (or 'async')."
        )
    if tp != 1:
        raise CapabilityUnsupported(
            f"data_parallel_size={dp} with tensor_parallel_size={tp} on backend='vllm'",
            "ie_lab has checked data parallelism with one worker per engine only: how a request's rows are gathered "
            "across one engine's tensor-parallel workers while another engine runs other requests is not checked.",
            "use one of the two: data_parallel_size for throughput on a model one device holds, tensor_parallel_size "
            "for a model that needs several; or ie_lab.harvest_on_ray, one tensor-parallel Session per part "
            "(docs/HARVEST.md).",
        )
    if mode != "hooks":
        raise CapabilityUnsupported(
            f"data_parallel_size={dp} in mode={mode!r}",
            "ie_lab has checked data parallelism in hook mode only (each engine's eager trunk with ie_lab's hooks); "
            "graph mode's static taps and generation-only mode's compiled model are not checked across engines.",
            "use mode='hooks' (the default) with data_parallel_size, or data_parallel_size=1 for graph or "
            "generation-only mode.",
        )


def steer_point_names(facts: Any, names: Iterable[Any]) -> list[str]:
    """Validate steer_points= before the engine starts: layer points steering can edit on this model, as base
    addresses; each gets static steering buffers in the compiled trunk (static_steer.py)."""
    out = []
    for n in names:
        a = n if isinstance(n, Address) else Address.parse(str(n))
        p = a.point
        if not p.steerable or a.head is not None or not verdicts.tappable(p.name):
            raise CapabilityUnsupported(
                f"{a} as a graph-mode steering site",
                "steering adds a d_model vector, so it edits per-layer d_model-wide points read by one module.",
                "declare some of "
                + ", ".join(x.name for x in _points.all_points() if x.steerable and verdicts.tappable(x.name))
                + " with their layer, e.g. steer_points=['resid_post.3'].",
            )
        if a.layer is not None and not 0 <= a.layer < facts.n_layers:
            raise AddressError(f"layer {a.layer} of {a}: this model has layers 0..{facts.n_layers - 1}.")
        _points.require_present(p, _points.Structure.from_facts(facts), a.layer, str(a))
        if str(a) not in out:
            out.append(str(a))
    if not out:
        raise InputError("steer_points is empty: declare the points to steer, e.g. ['resid_post.3'], or leave it out.")
    return out


def check_graph_steer(lm: VLLMModel, addr: Address) -> None:
    """In graph mode only the declared steering sites have buffers in the compiled trunk."""
    declared = lm.info.get("steer_points")
    if lm.info.get("graph_points") is not None and str(addr) not in (declared or []):
        raise CapabilityUnsupported(
            f"steering {addr} in graph mode",
            "graph mode steers only the sites declared when the Session started "
            f"({', '.join(declared) if declared else 'none were'}): the compiled graph holds steering buffers for "
            "each of them and for nothing else.",
            "add it to steer_points= when creating the Session (or s.set_mode(steer_points=[...], reload=True)), "
            "or create the Session without graph_points / steer_points (hooks run eagerly and steer every point).",
        )


def graph_point_names(facts: Any, names: Iterable[Any], allow_empty: bool = False) -> list[str]:
    """Validate graph_points= before the engine starts: base addresses a static tap can read on this model (none
    with allow_empty: a graph-mode Session that only steers)."""
    out = []
    for n in names:
        a = n if isinstance(n, Address) else Address.parse(str(n))
        p = a.point
        if not verdicts.tappable(p.name):
            why = (
                "rebuilt from every q/k of a request after it ends, not read from one module"
                if verdicts.recomputed(p.name)
                else verdicts.POINTS[p.name].reason or f"{p.name} is not read by a module hook on vLLM"
            )
            raise CapabilityUnsupported(
                f"{a} as a graph-mode point",
                why + ".",
                f"declare some of {', '.join(verdicts.tappable_names())}, or create the Session without graph_points.",
            )
        if p.scope is _points.Scope.LAYER and a.layer is not None:  # Address refuses a layer point without one
            if not 0 <= a.layer < facts.n_layers:
                raise AddressError(f"layer {a.layer} of {a}: this model has layers 0..{facts.n_layers - 1}.")
        _points.require_present(p, _points.Structure.from_facts(facts), a.layer, str(a))
        base = str(a.without_head())
        if base not in out:
            out.append(base)
    if not out and not allow_empty:
        raise InputError("graph_points is empty: declare the points to read, e.g. ['resid_post.0'].")
    return out


def check_sampling(
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    seed: Any,
    stop: Any,
    n_logprobs: Any,
    ignore_eos: Any,
    *,
    vocab: int | None,
    max_logprobs: int | None,
) -> list[str]:
    """Every generation argument checked before vLLM sees it; the stop strings as a list.

    A bad value that reaches vLLM fails inside the engine's step (a seed torch cannot use, a stop that is not a
    string), which fails every request of that step: so nothing unchecked goes in. The rules are eager's
    (ie_lab/core/sampling.py `check_generation_args`: ranges, finite numbers, a seed torch accepts, the vocabulary bound on
    top_k and n_logprobs) plus the one vLLM adds: its engine's max_logprobs."""
    stops = check_generation_args(
        max_new_tokens, temperature, top_k, top_p, n_logprobs, vocab=vocab, seed=seed, stop=stop, ignore_eos=ignore_eos
    )
    if max_logprobs is not None and max_logprobs >= 0 and n_logprobs > max_logprobs:
        raise InputError(
            f"n_logprobs={n_logprobs} exceeds the engine's max_logprobs={max_logprobs}; create the "
            f"Session with engine_kwargs={{'max_logprobs': {n_logprobs}}} or ask for fewer."
        )
    return stops


@dataclass
class _Work:
    """What one request asks the worker for."""

    points: list[str]
    attn_layers: list[int]
    steer: list[dict]
    lens: dict | None = None
    specs: list = field(default_factory=list)  # the steering specs behind `steer` (the block's and steer=)
    project: dict | None = None  # project(): point -> encoder payload (ie_lab/ops/projection.py)

    @property
    def empty(self) -> bool:
        return not (self.points or self.attn_layers or self.steer or self.lens or self.project)


def refuse_unserved_layout(cfg: Any, facts: Any) -> None:
    """Refuse, before the engine starts, a served family's layout that ie_lab's worker does not bind or vLLM cannot
    load (quirks.VLLM_LAYOUTS_REFUSED: OPT-350m's post-norm layout, Falcon-RW, Falcon's MLP not 4 x hidden)."""
    for refused, what, why in quirks.VLLM_LAYOUTS_REFUSED.get(facts.model_type, ()):
        if refused(cfg, facts):
            fill = dict(cfg=cfg, four_hidden=4 * cfg.hidden_size)
            raise CapabilityUnsupported(
                what.format(**fill) + " on backend='vllm'", why.format(**fill), "use backend='eager'."
            )
