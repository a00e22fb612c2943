"""SAE splicing on the eager backend: the spec made and checked against the model (``make_splice``), and a capture
that also returns the spliced SAEs' feature activations under ``sae.<name>.acts`` (``capture_with_acts``).

The splice itself is a steering edit (ie_lab/core/splice_spec.py): the operations, the continuous batch and the
`with` blocks apply it through the steering hooks, scoped as steering is. A capture that reads feature activations
runs on its own (never in the shared batch): the activations are what the spec's edit encoded in this thread's
forward, kept by ``recording``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..address import Address
from ..cache import Cache
from ..core import calls
from ..core.splice_spec import SpliceSpec, acts_name, fold, is_acts_name, make_splice_spec, recording, splices
from ..core.steer_scope import CURRENT_OP
from ..errors import InputError, did_you_mean
from .capture import capture
from .model import lm_of
from .taps import resolve
from .writers import Writers


def make_splice(model: Any, sae: Any, *, error: bool = False) -> SpliceSpec:
    """A splice of sae at its point on this model (core/splice_spec.py make_splice_spec), and the point one this
    model's hooks can write, every argument checked before anything is placed."""
    lm = lm_of(model)
    spec = make_splice_spec(lm, sae, error=error)
    addr = spec.addresses[0]
    Writers(lm, [(addr, lambda t, off: t)])  # refuses a point no hook can write, before any is placed
    resolve(lm, addr.without_head())  # an absent point is refused here, in the caller's words
    return spec


def wants_acts(addresses: Any) -> bool:
    items = [addresses] if isinstance(addresses, (str, Address)) else addresses
    try:
        return any(is_acts_name(a) for a in items)
    except TypeError:
        return False


def capture_with_acts(model: Any, tokens_or_text: Any, addresses: Iterable[Any], *, grad: bool = False) -> Any:
    """capture(), where addresses may also name `sae.<name>.acts` of an SAE spliced into this call: those come
    back in each Cache under that name, [batch, seq, d_sae], as the splice encoded them (clamps applied).

    Runs inside the operation (eager/steer.py run_issued), so the call's specs are the operation's."""
    lm = lm_of(model)
    items = [addresses] if isinstance(addresses, (str, Address)) else list(addresses)
    names = [a.strip() for a in items if is_acts_name(a)]
    plain = [a for a in items if not is_acts_name(a)]
    op = CURRENT_OP.get()
    spliced = splices(op.specs) if op is not None else []
    by_name: dict[str, SpliceSpec] = {}
    for sp in spliced:
        by_name.setdefault(acts_name(sp.name), sp)
    for n in names:
        if n not in by_name:
            have = ", ".join(by_name) or "none"
            raise InputError(
                f"{n!r}: no SAE of that name is spliced into this call (spliced: {have}).{did_you_mean(n, by_name)} "
                "Feature activations are read during a spliced run: pass splice=s.splice(sae) (or capture inside "
                "`with s.splice(sae):`), naming the SAE as ie_lab.load_sae(..., name=...) named it."
            )
    wanted = [by_name[n] for n in dict.fromkeys(names)]
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
                n = c.tokens.shape[-1] if c.tokens is not None else parts[0].shape[1]
                t = parts[0][i : i + 1, :n] if isinstance(got, list) else parts[0]
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
    """The record with splice= moved into steer= (core/splice_spec.py fold); feature activations asked of a
    generation are refused (they are read by capture)."""
    call = fold(call, lm_of(lm))
    if isinstance(call, calls.Generate) and call.capture is not None and wants_acts(call.capture):
        raise InputError(
            "generate(capture=...): SAE feature activations ('sae.<name>.acts') are read by capture, not during "
            "generation; capture the text generate returns with s.capture(text, ['sae.<name>.acts'], splice=spec)."
        )
    return call


def keywords(call: Any) -> dict[str, Any]:
    """call.keywords() without splice= (folded into steer= by then): what the eager functions take."""
    kw = call.keywords()
    kw.pop("splice", None)
    return kw
