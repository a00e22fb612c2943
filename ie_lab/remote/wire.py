"""The remote wire format: how values, tensors and refusals cross between an ie_lab server and its clients.

A message is one frame: ``IEL1``, the header's length (4 bytes, big-endian), the header (JSON), then the tensors
as safetensors bytes. Tensors are never pickled: the header refers to them by name, and safetensors reads
nothing but dtypes, shapes and raw bytes, checked against the buffer's length. A stream is a sequence of frames,
each preceded by its length (8 bytes), so a reader knows where one ends whatever the HTTP chunking did.

Values are JSON with tags for what JSON lacks: ``{"$": "tensor", "id": "t0"}``, tuples, maps with non-string
keys, addresses, ranges, and the result types of ie_lab/core/results.py by name. Decoding looks every tag up in a
fixed table; a request may hold only data (no result types), so nothing a client sends names a class to build.
Refusals travel as ``{"class": name, "message": text}`` and are re-raised as that class, looked up in ERRORS.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..address import Address
from ..arch.config_facts import ArchFacts
from ..backend import OperationCancelled, SessionClosed
from ..cache import Cache
from ..core.attribution import AttributionResult
from ..core.results import AttentionResult, GenerationResult, GenStep, LensResult, PatchGrid, Projection
from ..core.steer_spec import SteerSpec
from ..errors import (
    AddressError,
    ArchitectureUnsupported,
    CapabilityUnsupported,
    IELabError,
    InputError,
    PointAbsent,
    RequestFailed,
    StructureError,
)
from ..points_table import PointsTable, Row
from .metrics import Metric

MAGIC = b"IEL1"
CONTENT_TYPE = "application/x-ie-lab-frame"
STREAM_TYPE = "application/x-ie-lab-stream"

# The remote protocol's version: what a client and a server must share (the operations, their arguments, the
# frames). Both state it on every message (PROTOCOL_HEADER); a different number on the other side is refused with
# both numbers and the fix. It changes when a message of one version would be misread by the other.
PROTOCOL = 2
PROTOCOL_HEADER = "x-ie-lab-protocol"
VERSION_HEADER = "x-ie-lab-version"  # the package version beside it, for the error text only

# Compression where it pays: a frame of at least COMPRESS_MIN bytes is sent zlib-compressed (ZMAGIC, then the
# frame's own length, then the zlib stream) when the receiver said it reads them (COMPRESS_HEADER on a request,
# "compression" in the server's hello) and the result is at most COMPRESS_KEEP of the original. Small frames, and
# those that hardly shrink (float32 activations often save a few percent), travel as they are.
ZMAGIC = b"IELZ"
COMPRESSION = "zlib"
COMPRESS_HEADER = "x-ie-lab-accept-compression"
COMPRESS_MIN = 64 << 10
COMPRESS_KEEP = 0.9
COMPRESS_LEVEL = 1  # the fastest: it pays on a slow link, where the bytes saved outweigh the CPU spent

# The exception classes a refusal may name. Anything else the server raises arrives as RequestFailed.
ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (
        IELabError,
        AddressError,
        PointAbsent,
        CapabilityUnsupported,
        InputError,
        RequestFailed,
        StructureError,
        ArchitectureUnsupported,
        OperationCancelled,
        SessionClosed,
    )
}
# Attributes a refusal carries besides its text (e.why, e.instead), sent along so `except` code reads them as local.
_ERROR_ATTRS = ("point", "family", "why", "instead", "what", "backend")

# Result types a response may carry, by tag. Requests carry none of them (decode(..., results=False)).
RESULTS: dict[str, type] = {
    c.__name__: c
    for c in (GenStep, GenerationResult, LensResult, AttentionResult, Projection, PatchGrid, Row, AttributionResult)
}


class WireError(InputError):
    """A frame or value that is not in the wire format (a truncated body, an unknown tag, a pickle)."""


# ---- values ------------------------------------------------------------------------------------------


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor) -> dict:
        name = f"t{len(self.tensors)}"
        # a copy of its own: safetensors refuses views and tensors that share storage
        self.tensors[name] = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        return {"$": "tensor", "id": name}

    def value(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x)
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, Address):
            return {"$": "address", "v": str(x)}
        if isinstance(x, range):
            return {"$": "range", "v": [x.start, x.stop, x.step]}
        if isinstance(x, list):
            return [self.value(v) for v in x]
        if isinstance(x, tuple):
            return {"$": "tuple", "v": [self.value(v) for v in x]}
        if isinstance(x, dict):
            return {"$": "map", "v": [[self.value(k), self.value(v)] for k, v in x.items()]}
        if isinstance(x, Cache):
            return {
                "$": "Cache",
                "t": self.value(dict(x.items())),
                "tokens": self.value(x.tokens),
                "str_tokens": self.value(x.str_tokens),
                "mask": self.value(x.attention_mask),
            }
        if isinstance(x, SteerSpec):
            return {
                "$": "steer",
                "addresses": [str(a) for a in x.addresses],
                "vector": self.tensor(x.vector),
                "method": x.method,
                "scale": x.scale,
                "normalize": x.normalize,
                "min": x.min,
                "max": x.max,
                "target": x.target,
                "positions": self.value(x.positions),
            }
        if isinstance(x, Metric):
            d = x.data()
            return {"$": "metric", "kind": d["kind"], "params": self.value(d["params"])}
        if isinstance(x, PointsTable):
            return {"$": "PointsTable", "rows": self.value(list(x.rows)), "backend": x.backend, "family": x.family}
        if type(x).__name__ in RESULTS and dataclasses.is_dataclass(x):
            return {"$": type(x).__name__, "f": {f.name: self.value(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        if hasattr(x, "item") and getattr(x, "shape", None) == ():  # numpy scalars
            return self.value(x.item())
        raise WireError(
            f"a {type(x).__name__} cannot be sent to or from an ie_lab server; send tensors, numbers, "
            "strings, lists and dicts of them."
        )


def encode(header: dict, limit: int | None = None) -> bytes:
    """One frame of `header` (any values, encoded here). limit: the most tensor bytes allowed (a server's
    max_capture_bytes), refused before anything is sent."""
    enc = _Encoder()
    body = {k: enc.value(v) for k, v in header.items()}
    if limit is not None:
        size = sum(t.numel() * t.element_size() for t in enc.tensors.values())
        if size > limit:
            raise LimitExceeded(
                "max_capture_bytes",
                limit,
                size,
                "bytes of tensors in one response",
                "capture fewer points or a shorter prompt per request",
            )
    head = json.dumps(body, separators=(",", ":")).encode()
    blob = _st_save(enc.tensors) if enc.tensors else b""
    return MAGIC + struct.pack(">I", len(head)) + head + blob


def compress(frame: bytes) -> bytes:
    """The frame as it travels to a receiver that reads compressed frames: compressed where it pays."""
    if len(frame) < COMPRESS_MIN:
        return frame
    packed = zlib.compress(frame, COMPRESS_LEVEL)
    if len(packed) + 12 > COMPRESS_KEEP * len(frame):
        return frame
    return ZMAGIC + struct.pack(">Q", len(frame)) + packed


def decompress(data: bytes, limit: int | None = None) -> bytes:
    """A received frame, decompressed if it was compressed; `limit` bounds the decompressed size (a small body that
    inflates to gigabytes is refused before it is inflated)."""
    if data[:4] != ZMAGIC:
        return data
    if len(data) < 12:
        raise WireError("a compressed frame without its length.")
    (n,) = struct.unpack(">Q", data[4:12])
    if limit is not None and n > limit:
        raise LimitExceeded(
            "max_request_bytes", limit, n, "bytes of request body once decompressed", "send smaller tensors per request"
        )
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data[12:], n + 1)  # at most one byte past the stated length: a lie shows
    except zlib.error as e:
        raise WireError(f"a compressed frame that is not a zlib stream: {e}.") from None
    if len(out) != n or not inflater.eof or inflater.unconsumed_tail:
        raise WireError(f"a compressed frame whose content is not the {n} bytes it states.")
    return out


def package_version() -> str:
    """This ie_lab's version (named in a protocol mismatch, so the fix can say which one to install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ie_lab")
    except PackageNotFoundError:
        return "unknown"


def protocol_mismatch(
    client: str | None, client_version: str | None, server: str | None, server_version: str | None, where: str
) -> RequestFailed:
    """The refusal of a client and a server that speak different protocols, with both versions and the fix."""

    def side(p: str | None, v: str | None) -> str:
        if not p:
            return "no protocol version (an ie_lab from before protocol versions)"
        return f"protocol {p} (ie_lab {v or 'unknown'})"

    fix = (
        f"pip install 'ie_lab[serve]=={server_version}' on the client"
        if server_version and server_version != "unknown"
        else "install the server's ie_lab version on the client"
    )
    return RequestFailed(
        f"this ie_lab client speaks {side(client, client_version)} and the ie_lab server at {where} speaks "
        f"{side(server, server_version)}; they cannot understand each other's messages. Instead: {fix}, or ask "
        f"the server's operator to run ie_lab {client_version or 'as the client'} for `ie-lab serve`."
    )


def accepts_compression(header: str | None) -> bool:
    return COMPRESSION in [v.strip() for v in (header or "").split(",")]


def tensor_bytes(frame: bytes) -> int:
    """The tensor payload's size in a frame (what a stream's byte budget counts)."""
    (n,) = struct.unpack(">I", frame[4:8])
    return len(frame) - 8 - n


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], results: bool, depth: int = 64):
        self.tensors, self.results, self.depth = tensors, results, depth

    def value(self, x: Any, depth: int = 0) -> Any:
        if depth > self.depth:
            raise WireError(f"value nested deeper than {self.depth} levels.")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [self.value(v, depth + 1) for v in x]
        if not isinstance(x, dict) or not isinstance(x.get("$"), str):
            raise WireError(f"untagged JSON object in a frame: {str(x)[:80]!r}.")
        tag = x["$"]
        if tag == "tensor":
            name = x.get("id")
            if name not in self.tensors:
                raise WireError(f"the frame refers to tensor {str(name)[:40]!r}, which it does not carry.")
            return self.tensors[name]
        if tag == "tuple":
            return tuple(self.value(v, depth + 1) for v in _list(x, "v"))
        if tag == "map":
            out = {}
            for pair in _list(x, "v"):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise WireError("a map entry is not a [key, value] pair.")
                k = self.value(pair[0], depth + 1)
                if not isinstance(k, (str, int, float, bool, type(None), tuple, Address)):
                    raise WireError(f"a map key must be a string or a number, got {type(k).__name__}.")
                out[k] = self.value(pair[1], depth + 1)
            return out
        if tag == "address":
            return Address.parse(_str(x, "v"))
        if tag == "range":
            v = _list(x, "v")
            if len(v) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                raise WireError("a range is [start, stop, step] integers.")
            return range(*v)
        if tag == "steer":
            return SteerPayload(**{k: self.value(x.get(k), depth + 1) for k in SteerPayload.FIELDS})
        if tag == "metric":
            return MetricPayload(x.get("kind"), self.value(x.get("params"), depth + 1))
        if not self.results:
            raise WireError(
                f"{tag[:40]!r} is not a value a request may carry; send tensors, numbers, strings, lists "
                "and maps of them."
            )
        if tag == "Cache":
            tensors = self.value(x.get("t"), depth + 1)
            return Cache(
                {Address.parse(k): v for k, v in tensors.items()},
                self.value(x.get("tokens"), depth + 1),
                self.value(x.get("str_tokens"), depth + 1),
                self.value(x.get("mask"), depth + 1),
            )
        if tag == "PointsTable":
            return PointsTable(self.value(x.get("rows"), depth + 1), _str(x, "backend"), _str(x, "family"))
        cls = RESULTS.get(tag)
        if cls is None:
            raise WireError(f"unknown tag {tag[:40]!r} in a frame (client and server of different ie_lab versions?).")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = x.get("f")
        if not isinstance(fields, dict) or not set(fields) <= names:
            raise WireError(f"a {tag} with fields it does not have.")
        return cls(**{k: self.value(v, depth + 1) for k, v in fields.items()})


@dataclasses.dataclass
class SteerPayload:
    """A steering spec as a request carries it: data only. The server builds the spec with its own s.steer(...),
    which checks every field exactly as a local s.steer would."""

    FIELDS = ("addresses", "vector", "method", "scale", "normalize", "min", "max", "target", "positions")
    addresses: Any
    vector: Any
    method: Any
    scale: Any
    normalize: Any
    min: Any
    max: Any
    target: Any
    positions: Any


@dataclasses.dataclass
class MetricPayload:
    """A metric as a request carries it: a kind and its parameters, data only. The server builds the Metric
    (ie_lab/remote/metrics.py), which checks both."""

    kind: Any
    params: Any


def _list(x: dict, key: str) -> list:
    v = x.get(key)
    if not isinstance(v, list):
        raise WireError(f"a {x.get('$')!s:.40} value without its list {key!r}.")
    return v


def _str(x: dict, key: str) -> str:
    v = x.get(key)
    if not isinstance(v, str):
        raise WireError(f"a {x.get('$')!s:.40} value without its string {key!r}.")
    return v


def decode(frame: bytes, *, results: bool, limit: int | None = None) -> dict:
    """The header of one frame with its values rebuilt. results=False (a server reading a request): only data.
    A compressed frame is decompressed first, to at most `limit` bytes."""
    frame = decompress(frame, limit)
    if len(frame) < 8 or frame[:4] != MAGIC:
        raise WireError(
            "the body is not an ie_lab frame (it must start with IEL1, or IELZ compressed; pickles and other "
            "formats are refused)."
        )
    (n,) = struct.unpack(">I", frame[4:8])
    if 8 + n > len(frame):
        raise WireError("the frame is truncated: its header runs past the end of the body.")
    try:
        head = json.loads(frame[8 : 8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"the frame's header is not JSON (or is nested too deep): {e}.") from None
    if not isinstance(head, dict):
        raise WireError("the frame's header is not a JSON object.")
    blob = frame[8 + n :]
    try:
        tensors = _st_load(blob) if blob else {}
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (bad header, offsets past the end, ...)
        raise WireError(f"the frame's tensors are not valid safetensors bytes: {e}.") from None
    dec = _Decoder(tensors, results)
    return {k: dec.value(v) for k, v in head.items()}


# ---- refusals ---------------------------------------------------------------------------------------------


class LimitExceeded(InputError):
    """A request over one of the server's per-request limits; the message names the limit and its value."""

    def __init__(self, limit: str, value: int | float, asked: int | float | str, what: str, fix: str):
        self.limit, self.value, self.asked = limit, value, asked
        super().__init__(
            f"refused by the server's limit {limit}={value}: this request asks for {asked} {what}. "
            f"Instead: {fix}, or ask the server's operator to raise --{limit.replace('_', '-')}."
        )


def error_body(e: BaseException) -> dict:
    """The refusal as it travels: the class's name (one of ERRORS, else RequestFailed) and its exact text."""
    cls = type(e)
    while cls.__name__ not in ERRORS and cls is not BaseException:
        cls = cls.__mro__[1]
    name = cls.__name__ if cls.__name__ in ERRORS else "RequestFailed"
    msg = (
        str(e)
        if name != "RequestFailed" or isinstance(e, RequestFailed)
        else f"the server failed on this request: {type(e).__name__}: {e}"
    )
    attrs = {a: getattr(e, a) for a in _ERROR_ATTRS if isinstance(getattr(e, a, None), str)}
    return {"class": name, "message": msg, "attrs": attrs}


def rebuild_error(body: Any, where: str) -> BaseException:
    """The exception a refusal names, with the server's text; attributes such as .why set as they were."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        return RequestFailed(f"the ie_lab server at {where} answered with an unreadable error: {str(body)[:200]}")
    cls = ERRORS.get(body.get("class"), RequestFailed)  # type: ignore[arg-type]
    e = cls.__new__(cls)
    Exception.__init__(e, body["message"])
    for k, v in (body.get("attrs") or {}).items():
        if k in _ERROR_ATTRS and isinstance(v, str):
            setattr(e, k, v)
    return e


def facts_dict(facts: ArchFacts) -> dict:
    d = dataclasses.asdict(facts)
    d["raw"] = json.loads(json.dumps(d.get("raw") or {}, default=str))  # the config as plain JSON
    return d


def facts_from(d: Any) -> ArchFacts:
    names = {f.name for f in dataclasses.fields(ArchFacts)}
    if not isinstance(d, dict) or not set(d) <= names:
        raise WireError("the server's model facts do not match this ie_lab's ArchFacts (different versions?).")
    d = dict(d)
    # JSON has no tuples: every tuple-typed field (layer_kinds, moe_layers, mixer_kinds, and any added later)
    # comes back as a list and is turned back here, so the facts compare equal to the server's.
    for f in dataclasses.fields(ArchFacts):
        if isinstance(d.get(f.name), list) and str(f.type).startswith("tuple"):
            d[f.name] = tuple(d[f.name])
    return ArchFacts(**d)
