"""Chat helpers: the model's own chat template, and which tokens belong to which message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError, check_flag, check_text
from .handles import as_lm


@dataclass(frozen=True)
class Span:
    role: str
    index: int  # message index
    start: int  # first token of the message's rendering (template markup included)
    end: int  # one past its last token

    def __repr__(self) -> str:
        return f"Span({self.role}#{self.index}: tokens {self.start}..{self.end - 1})"


def is_messages(x: Any) -> bool:
    """A conversation: a non-empty list or tuple whose items are all dicts (checked further by _check)."""
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, dict) for m in x)


def _check_strings(x: Any, where: str, depth: int = 0) -> None:
    """Every string of a message (its role, its content, a content part's text) is text a tokenizer can read."""
    if isinstance(x, str):
        check_text(x, where)
    elif depth < 8 and isinstance(x, dict):
        for k, v in x.items():
            _check_strings(v, f"{where}'s {k}" if isinstance(k, str) and k.isidentifier() else where, depth + 1)
    elif depth < 8 and isinstance(x, (list, tuple)):
        for v in x:
            _check_strings(v, where, depth + 1)


def _check(lm: Any, messages: Sequence[dict]) -> Any:
    if (
        not isinstance(messages, (list, tuple))
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
            for m in messages
        )
    ):
        raise InputError(
            "messages must be a non-empty list of {'role': str, 'content': str} dicts, e.g. "
            "[{'role': 'user', 'content': 'Hello'}]."
        )
    for i, m in enumerate(messages):
        _check_strings(m, f"message {i}")
    tok = getattr(lm, "tokenizer", None)
    if tok is None:
        raise InputError(
            "a conversation needs the model's tokenizer to render it with its chat template, and this "
            "model was loaded without one: load it with its tokenizer, or pass token ids."
        )
    if not getattr(tok, "chat_template", None):
        raise InputError(
            "this tokenizer has no chat template, so a list of {'role', 'content'} messages cannot be "
            "rendered: set tokenizer.chat_template (a Jinja string) and pass the messages again "
            "(ie_lab.apply_chat_template(model, messages) then shows the ids they become), or pass the "
            "prompt as text or token ids."
        )
    return tok


def _ids(tok: Any, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    try:
        out = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template's own Jinja raised (e.g. it refuses a role order)
        raise InputError(
            f"the chat template could not render these messages: {e}. Check the roles and their "
            "order against what this model's template accepts."
        ) from None
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def render(lm: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation as the model sees it just before replying (with the generation prompt):
    how every operation reads a list of messages."""
    return _ids(_check(lm, messages), messages, add_generation_prompt=True)


def _model_of(model: Any) -> Any:
    """The model whose tokenizer renders: a Session's, a loaded model, or a raw transformers model taken as it is
    (it carries no tokenizer, so _check refuses it with the fix)."""
    return as_lm(model, adopt=lambda m: m)


def apply_chat_template(model: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> torch.Tensor:
    """Token ids [1, seq] of the conversation rendered with the model's own template."""
    lm = _model_of(model)
    check_flag("add_generation_prompt", add_generation_prompt)
    tok = _check(lm, messages)
    return torch.tensor([_ids(tok, messages, add_generation_prompt)])


def message_spans(model: Any, messages: Sequence[dict]) -> list[Span]:
    """Token spans per message, found by rendering growing prefixes of the conversation.

    Raises if the template rewrites earlier turns when later ones are added (then spans are ambiguous).
    """
    lm = _model_of(model)
    tok = _check(lm, messages)
    spans: list[Span] = []
    prev: list[int] = []
    for i in range(len(messages)):
        cur = _ids(tok, messages[: i + 1], add_generation_prompt=False)
        if cur[: len(prev)] != prev:
            raise InputError(
                "this chat template renders earlier messages differently once later ones are added, so "
                "per-message token spans are not well defined for it."
            )
        spans.append(Span(messages[i]["role"], i, len(prev), len(cur)))
        prev = cur
    return spans
