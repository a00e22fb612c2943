"""The closed list of operations an ie_lab server runs, and the shape of every argument each one takes.

Nothing else crosses: no code (metrics, functions, transports as callables), no module or file paths (a string
where a path is accepted locally, such as project's directions, is refused here), no pickles. Each argument is
checked for its kind and size here, before the Session sees it; the Session then checks its meaning (addresses,
widths, sampling arguments) exactly as for a local call, and its refusals travel back as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..cache import Cache
from ..core import calls
from ..core.chat import Chat
from ..core.chat_conventions import ChatConvention
from ..core.projection_args import SAE_KEYS
from ..errors import IELabError, InputError
from .metrics import KINDS, Metric
from .wire import MetricPayload, SteerPayload

MAX_ITEMS = 4096  # list lengths: prompts in a batch, stop strings, addresses, positions
MAX_TEXT = 1 << 20  # characters in one string
MAX_DIMS = 2


class ArgError(InputError):
    """An argument of the wrong kind for the operation (the server's own check, before the Session runs)."""


Check = Callable[[str, str, Any], Any]


def _bad(op: str, name: str, want: str, got: Any) -> ArgError:
    shown = type(got).__name__ if not isinstance(got, (int, float, str, bool, type(None))) else repr(got)[:80]
    return ArgError(f"{op}: argument {name!r} must be {want}, got {shown}.")


def _text(op: str, name: str, x: Any) -> str:
    if not isinstance(x, str):
        raise _bad(op, name, "a string", x)
    if len(x) > MAX_TEXT:
        raise ArgError(f"{op}: argument {name!r} is {len(x)} characters, over the server's {MAX_TEXT}.")
    return x


def _items(op: str, name: str, x: Any) -> list:
    if not isinstance(x, list):
        raise _bad(op, name, "a list", x)
    if len(x) > MAX_ITEMS:
        raise ArgError(f"{op}: argument {name!r} has {len(x)} items, over the server's {MAX_ITEMS}.")
    return x


def _int(op: str, name: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise _bad(op, name, "an integer", x)
    return x


def _real(op: str, name: str, x: Any) -> float | int:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _bad(op, name, "a number", x)
    return x


def _flag(op: str, name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise _bad(op, name, "true or false", x)
    return x


def _tensor(op: str, name: str, x: Any, *, ints: bool = False, dims: int = MAX_DIMS) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _bad(op, name, "a tensor", x)
    if x.dim() > dims:
        raise ArgError(f"{op}: argument {name!r} has {x.dim()} dimensions {list(x.shape)}; at most {dims} here.")
    if ints and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise ArgError(f"{op}: argument {name!r} must hold token ids (integers), got {x.dtype}.")
    return x


def optional(check: Check) -> Check:
    return lambda op, name, x: None if x is None else check(op, name, x)


def one_of(*checks: Check, want: str) -> Check:
    def check(op: str, name: str, x: Any) -> Any:
        for c in checks:
            try:
                return c(op, name, x)
            except ArgError:
                continue
        raise _bad(op, name, want, x)

    return check


def list_of(check: Check) -> Check:
    return lambda op, name, x: [check(op, name, v) for v in _items(op, name, x)]


def _message(op: str, name: str, x: Any) -> dict:
    if not isinstance(x, dict) or not set(x) <= {"role", "content"} or not all(isinstance(v, str) for v in x.values()):
        raise _bad(op, name, "a chat message {'role': str, 'content': str}", x)
    return {k: _text(op, name, v) for k, v in x.items()}


_ids = list_of(_int)
_conversation = list_of(_message)
MAX_STOP_IDS = 64  # a Chat's stop ids: its turn end and the model's EOS, a handful
# The convention of a Chat rebuilt here: only its ids and stop ids cross (no spans, no markers).
_WIRE_CONVENTION = ChatConvention("plain", (), None, False, False, {})


def _chat(op: str, name: str, x: Any) -> Chat:
    """A Chat (ie_lab.to_chat) as the client sends it, {"chat_ids": [...], "stop_ids": [...]}: rebuilt as a Chat of
    those ids, so generation stops at its stop ids here as it does locally."""
    if not isinstance(x, dict) or set(x) != {"chat_ids", "stop_ids"}:
        raise _bad(op, name, "a chat {'chat_ids': [token ids], 'stop_ids': [token ids]}", x)
    ids, stops = _ids(op, name, x["chat_ids"]), _ids(op, name, x["stop_ids"])
    if not ids or len(stops) > MAX_STOP_IDS or any(not 0 <= i < 2**31 for i in ids + stops):
        raise ArgError(
            f"{op}: argument {name!r}: a chat needs its token ids (at least one) and at most {MAX_STOP_IDS} stop ids, "
            "each a token id (0 or more)."
        )
    return Chat(torch.tensor([ids]), (), _WIRE_CONVENTION, frozenset(stops))


# One prompt: text, token ids (a list or a 1-D / 2-D integer tensor), a conversation of chat messages, or a Chat.
PROMPT = one_of(
    _text,
    _ids,
    lambda op, n, x: _tensor(op, n, x, ints=True),
    _conversation,
    _chat,
    want="text, token ids, a conversation or a chat",
)
# Several prompts: a list of any of those (capture and generation also take one).
PROMPTS = one_of(
    PROMPT, list_of(PROMPT), want="a prompt or a list of prompts (text, token ids, a conversation or a chat)"
)
ADDRESS = _text
ADDRESSES = one_of(_text, list_of(_text), want="an address string or a list of them")
LAYERS = optional(one_of(_int, list_of(_int), want="a layer index or a list of them"))


def _positions(op: str, name: str, x: Any) -> Any:
    if isinstance(x, str):
        return _text(op, name, x)
    if isinstance(x, tuple):
        x = list(x)
    if isinstance(x, list):
        return [_int(op, name, v) if not isinstance(v, bool) else v for v in _items(op, name, x)]
    return _tensor(op, name, x, dims=1)


def _steer(op: str, name: str, x: Any) -> SteerPayload:
    if not isinstance(x, SteerPayload):
        raise _bad(op, name, "a steering spec (made with s.steer(...))", x)
    return SteerPayload(
        addresses=list_of(_text)(op, f"{name}.addresses", x.addresses),
        vector=_tensor(op, f"{name}.vector", x.vector, dims=1),
        method=_text(op, f"{name}.method", x.method),
        scale=_real(op, f"{name}.scale", x.scale),
        normalize=_flag(op, f"{name}.normalize", x.normalize),
        min=optional(_real)(op, f"{name}.min", x.min),
        max=optional(_real)(op, f"{name}.max", x.max),
        target=_real(op, f"{name}.target", x.target),
        positions=_positions(op, f"{name}.positions", x.positions),
    )


STEER = optional(list_of(_steer))
CAPTURE = optional(ADDRESSES)


def _directions(op: str, name: str, x: Any) -> Any:
    if isinstance(x, dict):  # an SAE encoder by SAELens' names; never a file path
        unknown = sorted(str(k) for k in x if k not in SAE_KEYS)
        if unknown:
            raise ArgError(f"{op}: argument {name!r}: unknown key(s) {unknown}; an SAE encoder takes {list(SAE_KEYS)}.")
        return {k: optional(lambda o, n, v: _tensor(o, n, v))(op, f"{name}[{k!r}]", v) for k, v in x.items()}
    if isinstance(x, str):
        raise ArgError(
            f"{op}: argument {name!r} is a string; a remote server reads no files: send the tensor "
            "(or the SAE's dict of tensors) itself."
        )
    return _tensor(op, name, x)


def _metric(op: str, name: str, x: Any) -> Metric:
    if not isinstance(x, MetricPayload):
        raise _bad(op, name, f"a metric a server evaluates ({', '.join(KINDS)}; ie_lab.remote.metrics)", x)
    if not isinstance(x.params, dict) or not all(isinstance(k, str) for k in x.params):
        raise ArgError(f"{op}: argument {name!r}: a metric's parameters are a map of names to values.")
    params = {
        k: _tensor(op, f"{name}.{k}", v, dims=1) if k == "vector" else _int(op, f"{name}.{k}", v)
        for k, v in x.params.items()
    }
    return Metric(_text(op, f"{name}.kind", x.kind), **params)  # checks the kind and its parameters' meaning


def _index_list(op: str, name: str, x: Any) -> Any:
    """Token positions: a list, tuple or range of integers, or a 1-D integer tensor (the Session checks them)."""
    if isinstance(x, range):
        if len(x) > MAX_ITEMS:
            raise ArgError(f"{op}: argument {name!r} has {len(x)} items, over the server's {MAX_ITEMS}.")
        return x
    if isinstance(x, tuple):
        return tuple(list_of(_int)(op, name, list(x)))
    if isinstance(x, list):
        return list_of(_int)(op, name, x)
    return _tensor(op, name, x, ints=True, dims=1)


def _source(op: str, name: str, x: Any) -> Any:
    """patch's source: a prompt (or prompts) to capture from, or the tensors of a Cache by address (the client
    sends a Cache that way); the server rebuilds the Cache."""
    if isinstance(x, dict):
        if len(x) > MAX_ITEMS:
            raise ArgError(f"{op}: argument {name!r} has {len(x)} entries, over the server's {MAX_ITEMS}.")
        tensors = {}
        for k, v in x.items():
            key = _text(op, f"{name} key", k)
            try:
                addr = Address.parse(key)
            except IELabError as e:
                raise ArgError(f"{op}: argument {name!r}: {e}") from None
            tensors[addr] = _tensor(op, f"{name}[{key!r}]", v, dims=4)
        return Cache(tensors)
    return PROMPTS(op, name, x)


# The checks a record's field names (ie_lab/core/calls.py: `arg(..., wire="prompts")`): the server's per-argument
# checks are read from the records, so an operation's arguments are declared once, there.
CHECKS: dict[str, Check] = {
    "prompt": PROMPT,
    "prompts": PROMPTS,
    "prompt_list": list_of(PROMPT),
    "address": ADDRESS,
    "addresses": ADDRESSES,
    "optional_addresses": CAPTURE,
    "layers": LAYERS,
    "steer": STEER,
    "text": _text,
    "optional_text": optional(_text),
    "int": _int,
    "optional_int": optional(_int),
    "real": _real,
    "optional_real": optional(_real),
    "flag": _flag,
    "seed": optional(one_of(_int, list_of(_int), want="an integer or a list of them")),
    "stop": optional(one_of(_text, list_of(_text), want="a string or a list of them")),
    "directions": _directions,
    "optional_vector": optional(lambda o, n, x: _tensor(o, n, x, dims=1)),
    "threshold": optional(one_of(_real, lambda o, n, x: _tensor(o, n, x, dims=1), want="a number or a tensor")),
    "source": _source,
    "optional_positions": optional(_index_list),
    "optional_position_list": optional(one_of(_int, _index_list, want="a token index or a list of them")),
    "targets": one_of(
        _int, _text, list_of(one_of(_int, _text, want="a token id or string")), want="a token or a pair of tokens"
    ),
    "metric": _metric,
}


@dataclass(frozen=True)
class RemoteOp:
    """One served operation: its positional parameters in order (name, check, required) and its keywords."""

    name: str
    params: tuple[tuple[str, Check, bool], ...] = ()
    keywords: dict[str, Check] = field(default_factory=dict)
    stream: bool = False
    tokens: str | None = None  # the argument that asks for new tokens (checked against max_new_tokens)
    # steer= carries the client's `with s.steer(...)` blocks for an operation whose Session method has no steer=
    # (attention, lens, means): the server opens the same blocks around the call, in that request's context only.
    scoped_steer: bool = False

    def bind(self, args: Any, kwargs: Any) -> tuple[list, dict]:
        """The checked arguments; ArgError names the first one that is wrong."""
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ArgError(f"{self.name}: the request needs a list 'args' and a map 'kwargs'.")
        if len(args) > len(self.params):
            raise ArgError(f"{self.name} takes at most {len(self.params)} positional argument(s), got {len(args)}.")
        names = [p[0] for p in self.params]
        for k in kwargs:
            if not isinstance(k, str) or (k not in self.keywords and k not in names):
                allowed = sorted(set(names) | set(self.keywords))
                raise ArgError(f"{self.name}: unknown argument {str(k)[:60]!r} (a remote server takes {allowed}).")
        out_args, out_kw = [], {}
        for i, (name, check, required) in enumerate(self.params):
            if i < len(args):
                if name in kwargs:
                    raise ArgError(f"{self.name}: argument {name!r} given twice.")
                out_args.append(check(self.name, name, args[i]))
            elif name in kwargs:
                out_kw[name] = check(self.name, name, kwargs[name])
            elif required:
                raise ArgError(f"{self.name}: missing argument {name!r}.")
        for k, v in kwargs.items():
            if k in self.keywords:
                out_kw[k] = self.keywords[k](self.name, k, v)
        return out_args, out_kw


def served(record: type[calls.Record]) -> RemoteOp:
    """The served operation of a record: its positional fields in order, its keyword fields that cross (a field
    whose check is None stays local and is refused here by name; "local" ones are the client's own), and steer=
    for the client's `with` blocks where the record has no steer= of its own."""
    wire = record.wire_checks()
    params: list[tuple[str, Check, bool]] = []
    keywords: dict[str, Check] = {}
    for p in record.parameters():
        check = CHECKS.get(wire[p.name] or "")
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            assert check is not None, (record.op, p.name)  # a served operation's positional arguments all cross
            params.append((p.name, check, p.default is p.empty))
        elif check is not None:
            keywords[p.name] = check
    scoped = "steer" not in wire
    if scoped:
        keywords["steer"] = STEER
    return RemoteOp(
        record.op,
        tuple(params),
        keywords,
        stream=record is calls.GenerateStream,
        tokens=record.tokens,
        scoped_steer=scoped,
    )


# Records a server does not run: run(fn) (code, which never crosses), fit_jacobian_lens (its transports serve
# logit_lens(transports=...), which is refused remotely; RemoteBackend refuses it by name) and harvest (it writes
# shards into a directory on the machine that runs the model, a path a client must not choose; refused by name).
NOT_SERVED: tuple[type[calls.Record], ...] = (calls.Run, calls.FitJacobianLens, calls.Harvest)

# Every other operation, then the facts, which take no arguments.
OPS: dict[str, RemoteOp] = {
    op.name: op
    for op in (
        *(served(r) for r in calls.RECORDS.values() if r not in NOT_SERVED),
        RemoteOp("describe"),
        RemoteOp("points"),
        RemoteOp("facts"),
        RemoteOp("capabilities"),
    )
}
