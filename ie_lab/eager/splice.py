"""SAE and transcoder splicing on the eager backend: the spec made and checked against the model (``make_splice``), and a capture
that also returns the spliced SAEs' feature activations under ``sae.<name>.acts`` (``capture_with_acts``).

The splice itself is a steering edit (ie_lab/core/splice_spec.py): the operations, the continuous batch and the
`with` blocks apply it through the steering hooks, scoped as steering is. A capture that reads feature activations
runs on its own (never in the shared batch): the activations are what the spec's edit encoded in this thread's
forward, kept by ``recording``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..cache import Cache
from ..core.splice_spec import (
    SpliceSpec,
    acts_name,
    fold,
    make_splice_spec,
    recording,
    splices,
    split_acts,
    unknown_acts,
)
from ..core.steer_scope import CURRENT_OP
from ..core.transcoder_splice import TranscoderSplice, is_transcoders, make_transcoder_splice
from ..errors import InputError
from .capture import capture
from .model import lm_of
from .taps import resolve
from .writers import Writers


def make_splice(model: Any, sae: Any, *, error: bool = False) -> SpliceSpec | TranscoderSplice:
    """A splice of sae at its point on this model (core/splice_spec.py make_splice_spec), or of transcoders in place
    of their MLPs' outputs (core/transcoder_splice.py), and the points ones this model's hooks can write, every
    argument checked before anything is placed."""
    lm = lm_of(model)
    spec: SpliceSpec | TranscoderSplice
    if is_transcoders(sae):
        spec = make_transcoder_splice(lm, sae, error=error)
    else:
        spec = make_splice_spec(lm, sae, error=error)
    for addr in spec.addresses:
        Writers(lm, [(addr, lambda t, off: t)])  # refuses a point no hook can write, before any is placed
        resolve(lm, addr.without_head())  # an absent point is refused here, in the caller's words
    return spec


def capture_with_acts(model: Any, tokens_or_text: Any, addresses: Iterable[Any], *, grad: bool = False) -> Any:
    """capture(), where addresses may also name `sae.<name>.acts` of an SAE spliced into this call: those come
    back in each Cache under that name, [batch, seq, d_sae], as the splice encoded them (clamps applied).

    Runs inside the operation (eager/steer.py run_issued), so the call's specs are the operation's."""
    lm = lm_of(model)
    plain, names = split_acts(addresses)
    op = CURRENT_OP.get()
    spliced = splices(op.specs) if op is not None else []
    by_name: dict[str, SpliceSpec] = {}
    for sp in spliced:
        by_name.setdefault(acts_name(sp.name), sp)
    for n in names:
        if n not in by_name:
            raise unknown_acts(n, list(by_name))
    wanted = [by_name[n] for n in names]
    reads = plain or [wanted[0].addresses[0]]  # a forward needs one tap; the SAE's own point serves
    with recording(wanted) as rec:
        got = capture(lm, tokens_or_text, reads, grad=grad)
    caches = got if isinstance(got, list) else [got]
    out = []
    for i, c in enumerate(caches):
        feats = {}
        for sp in wanted:
            parts = rec[id(sp)]
            if len(parts) == len(caches):  # one forward per prompt
                t = parts[i]
            elif len(parts) == 1:  # one padded forward for a list: this prompt's row, its own tokens
                own = c.tokens.shape[-1] if c.tokens is not None else parts[0].shape[1]
                t = parts[0][i : i + 1, :own] if isinstance(got, list) else parts[0]
            else:
                raise InputError(
                    f"{acts_name(sp.name)}: {sp.addresses[0]} was written {len(parts)} times in this capture, so its "
                    "feature activations are ambiguous; capture them without another splice of the same point."
                )
            feats[acts_name(sp.name)] = t
        tensors = {a: c[a] for a in c if plain}
        out.append(Cache(tensors, c.tokens, c.str_tokens, c.attention_mask, features=feats))
    return out if isinstance(got, list) else out[0]


def folded(call: Any, lm: Any) -> Any:
    """The record with splice= moved into steer= (core/splice_spec.py fold)."""
    return fold(call, lm_of(lm))


def keywords(call: Any) -> dict[str, Any]:
    """call.keywords() without splice= and intervene= (folded into steer= by then): what the eager functions take."""
    kw = call.keywords()
    kw.pop("splice", None)
    kw.pop("intervene", None)
    return kw
