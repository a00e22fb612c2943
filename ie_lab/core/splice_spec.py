"""SAE splicing: a SpliceSpec replaces the value at an SAE's point by the SAE's reconstruction decode(encode(x)),
with chosen features ablated or clamped first, and (error=True) the SAE's error term x - decode(encode(x)) added
back, so that only the feature edits change the run (docs/SAE.md, "Splicing").

A SpliceSpec is a SteerSpec whose edit is the splice: everything that carries steering carries it the same way, so
a splice is scoped exactly as steering is (core/steer_scope.py): ``with s.splice(sae):`` reaches the requests issued
in that task or thread only, and ``splice=spec`` (folded into the call's steering by ``fold``) the one call. The
eager backend's hooks, its continuous batch and its raw-forward `with` hooks all call ``edit`` as for any spec.

Feature activations of a spliced run are read under a name of their own, ``sae.<name>.acts`` (``acts_name``), not
an Address (the point grammar names a model's tensors; an SAE's features are not one): ``recording()`` collects
what each spec's edit encoded (after its clamps) in the forward run inside it.

Neutral: the spec holds the SAE by duck typing (encoder(), W_dec, b_dec, d_sae, address, name: ie_lab/sae.py's SAE)
and computes with ops/projection.py's encoder, so this module imports nothing above core.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import numbers
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..address import Address
from ..errors import AddressError, InputError, did_you_mean, shown_value
from ..ops.projection import scores
from ..ops.splice import splice as splice_rows
from .projection_args import make_encoder, point_width
from .steer_spec import ForwardState, Issued, SteerSpec, as_specs
from .transcoder_splice import TranscoderSplice, with_interventions

ACTS_NAME = re.compile(r"sae\.([A-Za-z0-9_\-]+)\.acts")

# id(spec) -> the feature activations its edit computed, one [batch, seq, d_sae] tensor per forward, while a capture
# of `sae.<name>.acts` runs in this context (None: nobody is reading them, the edit keeps nothing)
_RECORDING: contextvars.ContextVar[dict[int, list[torch.Tensor]] | None] = contextvars.ContextVar(
    "ie_lab_splice_acts", default=None
)


def acts_name(name: str) -> str:
    """The name a spliced SAE's feature activations are captured under."""
    return f"sae.{name}.acts"


def is_acts_name(x: Any) -> bool:
    return isinstance(x, str) and ACTS_NAME.fullmatch(x.strip()) is not None


@dataclass(eq=False, repr=False)
class SpliceSpec(SteerSpec):
    """One SAE spliced in at its point. Use as a context manager, or pass as splice= to capture / generate /
    generate_stream. ``.ablate(features)`` and ``.clamp(features, value)`` return a new spec with those features
    set before decoding (this one is unchanged, so a spec already in use never changes under a running call)."""

    sae: Any = None
    error: bool = False
    clamps: tuple[tuple[int, float], ...] = ()  # (feature, value), each feature once, in the order set
    name: str = "sae"
    _enc: Any = field(default=None, compare=False)  # ops/projection.py's Encoder of the SAE, built once

    # ---- edits -------------------------------------------------------------------------------------
    def _features(self, features: Any, what: str) -> list[int]:
        items = features.tolist() if hasattr(features, "tolist") else features
        if isinstance(items, (int, numbers.Integral)) and not isinstance(items, bool):
            items = [items]
        if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
            raise InputError(
                f"{what}: features={shown_value(features)}; pass a feature index or a list of them, each an int "
                f"from 0 to {self.sae.d_sae - 1}."
            )
        out = []
        for f in items:
            if isinstance(f, bool) or not isinstance(f, numbers.Integral) or not 0 <= int(f) < self.sae.d_sae:
                raise InputError(
                    f"{what}: feature {shown_value(f)} is not a feature of this SAE; features are ints from 0 to "
                    f"{self.sae.d_sae - 1} (d_sae = {self.sae.d_sae})."
                )
            out.append(int(f))
        if not out:
            raise InputError(f"{what}: no feature given; pass a feature index or a list of them.")
        return out

    def clamp(self, features: Any, value: Any) -> SpliceSpec:
        """A new spec with these features' activations set to value (every token) before decoding."""
        fs = self._features(features, "clamp")
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputError(
                f"clamp: value={shown_value(value)} ({type(value).__name__}); pass a finite real number, e.g. 5.0."
            )
        v = float(value)
        if not math.isfinite(v):
            raise InputError(f"clamp: value={v} is not finite; pass a finite real number, e.g. 5.0.")
        kept = tuple((f, x) for f, x in self.clamps if f not in fs)
        return replace(self, clamps=kept + tuple((f, v) for f in fs))

    def ablate(self, features: Any) -> SpliceSpec:
        """A new spec with these features' activations set to 0 before decoding (clamp(features, 0.0))."""
        return self.clamp(features, 0.0)

    # ---- the edit a hook applies -------------------------------------------------------------------
    def edit(self, state: ForwardState, special_ids: frozenset[int]):
        """(h [batch, seq, d], offset) -> h with the splice applied (ops/splice.py); the features kept when a
        capture reads them."""
        sae, enc, keep_error = self.sae, self._enc, self.error
        idx, vals = self.edits()
        dec: dict[Any, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def decoder(device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            if device not in dec:  # the SAE's decoder on the activation's device, moved once per call
                b = None if sae.b_dec is None else sae.b_dec.detach().to(device, torch.float32)
                dec[device] = (sae.W_dec.detach().to(device, torch.float32), b)
            return dec[device]

        def apply(h: torch.Tensor, offset: int) -> torch.Tensor:
            W, b = decoder(h.device)
            out, edited = splice_rows(h, scores(h.float(), enc), W, b, idx, vals, keep_error)
            rec = _RECORDING.get()
            if rec is not None and id(self) in rec:
                rec[id(self)].append(edited if edited.requires_grad else edited.detach())
            return out.to(h.dtype)

        return apply

    def edits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clamped features and their values, as the arithmetic takes them."""
        idx = torch.tensor([f for f, _ in self.clamps], dtype=torch.long)
        return idx, torch.tensor([v for _, v in self.clamps], dtype=torch.float32)

    def __repr__(self) -> str:
        edits = ", ".join(f"{f}->{v:g}" for f, v in self.clamps) or "none"
        return (
            f"SpliceSpec({self.name} at {self.addresses[0]}; error={'kept' if self.error else 'dropped'}; "
            f"edits: {edits}; d_sae={self.sae.d_sae})"
        )


def splices(specs: Any) -> list[SpliceSpec]:  # the SAE splices (a transcoder splice keeps no features)
    return [s for s in specs if isinstance(s, SpliceSpec)]


def as_splices(splice: Any) -> list[SpliceSpec]:
    """splice= as a list of splice specs; anything else is refused naming how to make one."""
    if splice is None:
        return []
    items = list(splice) if isinstance(splice, (list, tuple)) else [splice]
    for it in items:
        if not isinstance(it, (SpliceSpec, TranscoderSplice)):
            got = repr(it) if isinstance(it, str) else type(it).__name__
            raise InputError(
                f"splice= takes a splice spec or a list of them, got {got}; make one with s.splice(sae) "
                "(an SAE from ie_lab.load_sae(path, s), or transcoders from ie_lab.load_transcoders) and pass it as "
                "splice=spec."
            )
    return items


def wants_acts(addresses: Any) -> bool:
    """Whether a capture's addresses name a spliced SAE's features ('sae.<name>.acts')."""
    items = [addresses] if isinstance(addresses, str) or not hasattr(addresses, "__iter__") else addresses
    try:
        return any(is_acts_name(a) for a in items)
    except TypeError:
        return False


def split_acts(addresses: Any) -> tuple[list[Any], list[str]]:
    """A capture's addresses as (the points, the 'sae.<name>.acts' names, each once)."""
    items = [addresses] if isinstance(addresses, str) or not hasattr(addresses, "__iter__") else list(addresses)
    names = [a.strip() for a in items if is_acts_name(a)]
    return [a for a in items if not is_acts_name(a)], list(dict.fromkeys(names))


def unknown_acts(name: str, spliced: list[str]) -> InputError:
    have = ", ".join(spliced) or "none"
    return InputError(
        f"{name!r}: no SAE of that name is spliced into this call (spliced: {have}).{did_you_mean(name, spliced)} "
        "Feature activations are read during a spliced run: pass splice=s.splice(sae) (or capture inside "
        "`with s.splice(sae):`), naming the SAE as ie_lab.load_sae(..., name=...) named it."
    )


def fold(call: Any, lm: Any) -> Any:
    """A record whose splice= is moved into its steer= (the splices then travel as its steering does); the same
    record where splice= is None or the record has none. Steering already read where the call was issued stays
    read (Issued), with the splices after it. Feature activations asked of a generation are refused here (they
    are read by capture), on every backend alike."""
    capture = getattr(call, "capture", None)
    if capture is not None and wants_acts(capture):
        raise InputError(
            f"{call.op}(capture=...): SAE feature activations ('sae.<name>.acts') are read by capture, not during "
            "generation; capture the text generate returns with s.capture(text, ['sae.<name>.acts'], splice=spec)."
        )
    splice = getattr(call, "splice", None)
    intervene = getattr(call, "intervene", None)
    if intervene is not None:  # folded into the call's transcoder splices (core/transcoder_splice.py)
        prompt = call.prompt if hasattr(call, "prompt") else call.tokens_or_text
        splice = with_interventions(intervene, as_splices(splice), lm, prompt)
        call = call.replace(intervene=None, splice=splice or None)
    if splice is None:
        return call
    extra = as_splices(splice)
    for sp in extra:
        if sp.lm is not lm:
            raise InputError(
                "splice=: this splice was made on another model; make it on this one with s.splice(sae) (the SAE "
                "loaded with this model: ie_lab.load_sae(path, s))."
            )
    steer = call.steer
    if isinstance(steer, Issued):
        return call.replace(steer=Issued([*steer, *(x for x in extra if not any(x is s for s in steer))]), splice=None)
    return call.replace(steer=[*as_specs(steer), *extra], splice=None)


@contextlib.contextmanager
def recording(specs: list[SpliceSpec]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Keep what each of these specs' edits encodes in the forwards run inside (on this thread and context)."""
    rec: dict[int, list[torch.Tensor]] = {id(s): [] for s in specs}
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


def make_splice_spec(lm: Any, sae: Any, *, error: bool = False) -> SpliceSpec:
    """A splice of sae at its point on lm (a backend's model), every argument checked against the model's facts before
    anything is placed; each backend adds what its own writing needs (eager/splice.py, vllm/requests.py)."""
    if not hasattr(sae, "W_enc") or not hasattr(sae, "encoder"):
        raise InputError(
            f"splice: {type(sae).__name__} is not an SAE; load one with ie_lab.load_sae(path, s) and pass it."
        )
    if not isinstance(error, bool):
        raise InputError(f"splice: error={error!r}; pass error=True (keep the SAE's error term) or error=False.")
    if getattr(sae, "W_dec", None) is None:
        raise InputError("splice: this SAE has no W_dec (an encoder-only dict): it cannot reconstruct its point.")
    addr = getattr(sae, "address", None)
    if not isinstance(addr, Address):
        raise AddressError(
            "splice: this SAE is attached to no point; load it with this model (ie_lab.load_sae(path, s)) or pass "
            "address='resid_post.L' to load_sae."
        )
    try:
        addr.check(lm.facts)
        width = point_width(addr, lm.facts)
    except AddressError as e:
        raise InputError(
            f"splice: the SAE's point {addr} is not a point of this model ({e}); load the SAE with this model "
            "(ie_lab.load_sae(path, s)) so its point is resolved here."
        ) from None
    if width != sae.d_in:
        raise InputError(
            f"splice: the SAE reads {sae.d_in}-wide rows but {addr} is {width} wide on this model: it was trained on "
            "another point or model; load the SAE with this model (ie_lab.load_sae(path, s)) or pass address= naming "
            "the point it was trained on."
        )
    name = getattr(sae, "name", None) or "sae"
    if not ACTS_NAME.fullmatch(acts_name(name)):
        raise InputError(
            f"splice: the SAE's name {name!r} cannot name its activations; give it a name of letters, digits, '_' "
            "and '-' (ie_lab.load_sae(..., name='mine'))."
        )
    for t in (sae.W_enc, sae.W_dec):
        if not bool(torch.isfinite(t).all()):
            raise InputError("splice: the SAE's weights hold NaN or inf; load a sound SAE.")
    enc = make_encoder(
        sae.d_in, sae.encoder(), activation=sae.activation, k=sae.k if sae.activation == "topk" else None
    )
    held = copy.copy(sae)  # the spec keeps the SAE as it is now; a later change of sae's attributes does not reach it
    return SpliceSpec(lm, (addr,), torch.zeros(0), sae=held, error=error, name=name, _enc=enc)
