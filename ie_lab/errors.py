"""Every exception ie_lab raises on purpose.

Each one is a ValueError or RuntimeError subclass so generic handlers still work, and each message
says what was wrong and what to do instead.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class IELabError(Exception):
    """Base class: anything ie_lab refuses on purpose."""


class AddressError(IELabError, ValueError):
    """An address string or coordinate is malformed, unknown or out of range."""


class PointAbsent(IELabError, ValueError):
    """The point is a real ie_lab point, but this model family has no such tensor."""

    def __init__(self, point: str, family: str, why: str, instead: str | None = None):
        self.point, self.family, self.why, self.instead = point, family, why, instead
        msg = f"{point!r} does not exist on {family}: {why}"
        if instead:
            msg += f" Instead: {instead}"
        super().__init__(msg)


class CapabilityUnsupported(IELabError, RuntimeError):
    """A backend cannot do what was asked. Raised instead of returning something subtly different."""

    def __init__(self, what: str, why: str, instead: str, backend: str | None = None):
        self.what, self.why, self.instead, self.backend = what, why, instead, backend
        where = f" on {backend}" if backend else ""
        # One sentence per part, whichever way the caller punctuated them.
        super().__init__(f"{what} is not supported{where}: {why.rstrip('. ')}. Instead: {instead.rstrip('. ')}.")


class InputError(IELabError, ValueError):
    """Tokens, text or arguments handed to an operation are unusable."""


class RequestFailed(IELabError, RuntimeError):
    """One request failed while it ran (a vLLM engine's request, an eager batch's row); the engine, the batch and the
    other requests go on."""


class StructureError(IELabError, RuntimeError):
    """The binder could not understand a model's module tree well enough to serve it faithfully."""


class ArchitectureUnsupported(StructureError, ValueError):
    """A family whose structure ie_lab does not bind yet (state-space, recurrent or hybrid blocks, ...).

    Raised at load, before weights are read where the config alone tells; also a ValueError, as the
    config-arithmetic refusal it replaces was."""

    def __init__(self, what: str, why: str, instead: str):
        self.what, self.why, self.instead = what, why, instead
        super().__init__(f"{what}: {why} Instead: {instead}")


class IELabWarning(UserWarning):
    """Base class: ie_lab goes ahead as asked, but tells you something you should know."""


class ComputeDiffersWarning(IELabWarning):
    """The model will compute a different answer from its reference implementation (e.g. an attention kernel
    that leaves out the family's soft-cap), because that is what was asked for or what the object was built with."""


def plural(n: int, noun: str, many: str | None = None) -> str:
    """A count with its noun, as it reads: "1 token", "2 tokens", "0 tokens" (many: an irregular plural)."""
    return f"{n} {noun if n == 1 else (many or noun + 's')}"


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The nearest valid spelling, for 'did you mean' hints."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return found[0] if found else None


def nearest(word: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.5) -> list[str]:
    """Up to `n` valid spellings nearest to `word`, nearest first (case ignored): a short list to read, where every
    valid name would be a long one to search."""
    by_lower = {c.lower(): c for c in choices}
    return [by_lower[m] for m in difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=cutoff)]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    best = closest(word, choices)
    return f" Did you mean {best!r}?" if best else ""


def shown(text: str, keep: int = 60) -> str:
    """A user's string as a message shows it: its repr (control characters and lone surrogates escaped, so the
    message prints anywhere), cut to `keep` characters, with its length said, when longer."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def shown_value(value: object, keep: int = 80) -> str:
    """Any argument as a refusal shows it, never itself failing: an integer too long for str() (Python refuses past
    4300 digits) by its number of digits, any other repr cut to `keep` characters, an object whose repr fails by
    its type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's object whose __repr__ fails is still refused, by its type
        return f"a {type(value).__name__}"
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"


def check_text(text: str, what: str = "the text") -> None:
    """Refuse text a tokenizer cannot read: a lone surrogate (half of a UTF-16 pair, e.g. from a file decoded with
    errors='surrogateescape' or a JSON '\\ud800') is no character and has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is no Unicode character "
            "and has no UTF-8 form to tokenize: decode the text from its bytes with errors='replace' (or remove the "
            "character) and pass it again."
        ) from None


def check_flag(name: str, value: object) -> None:
    """A switch is True or False: a string such as "no", a number or None would silently read as one or the other."""
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}.")
