"""Chat helpers: the model's own chat template, and which tokens belong to which message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import InputError


@dataclass(frozen=True)
class Span:
    role: str
    index: int  # message index
    start: int  # first token of the message's rendering (template markup included)
    end: int  # one past its last token

    def __repr__(self) -> str:
        return f"Span({self.role}#{self.index}: tokens {self.start}..{self.end - 1})"


def _check(lm: Any, messages: Sequence[dict]) -> Any:
    tok = getattr(lm, "tokenizer", None)
    if tok is None:
        raise InputError("chat templates need the model's tokenizer; load it with one.")
    if not getattr(tok, "chat_template", None):
        raise InputError("this tokenizer has no chat template; set tokenizer.chat_template (a Jinja string), or "
                         "build the prompt text yourself.")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    return tok


def _ids(tok: Any, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def apply_chat_template(model: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> torch.Tensor:
    """Token ids [1, seq] of the conversation rendered with the model's own template."""
    from . import _as_lm

    lm = _as_lm(model)
    tok = _check(lm, messages)
    return torch.tensor([_ids(tok, messages, add_generation_prompt)])


def message_spans(model: Any, messages: Sequence[dict]) -> list[Span]:
    """Token spans per message, found by rendering growing prefixes of the conversation.

    Raises if the template rewrites earlier turns when later ones are added (then spans are ambiguous).
    """
    from . import _as_lm

    lm = _as_lm(model)
    tok = _check(lm, messages)
    spans, prev = [], []
    for i in range(len(messages)):
        cur = _ids(tok, messages[: i + 1], add_generation_prompt=False)
        if cur[: len(prev)] != prev:
            raise InputError("this chat template renders earlier messages differently once later ones are added, so "
                             "per-message token spans are not well defined for it.")
        spans.append(Span(messages[i]["role"], i, len(prev), len(cur)))
        prev = cur
    return spans
