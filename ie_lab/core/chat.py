"""Chat helpers: the model's own chat template, which tokens belong to which message and to which part of it
(reasoning, harmony channels, tool calls: core/chat_conventions.py), and where a chat prompt's generation stops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError, check_flag, check_text
from . import chat_conventions as cc
from .handles import as_lm


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of a conversation. part "message": a message's whole rendering (template markup included);
    "generation_prompt": what the template adds after the last message for the reply to follow; any other part
    (reasoning, final, analysis, commentary, tool_call, content) covers exactly that part's own tokens, without the
    markers and the whitespace tokens around it."""

    role: str
    index: int  # message index (the generation prompt: len(messages); -1: ids no message renders, a generated reply)
    start: int
    end: int  # one past the last token
    part: str = "message"
    recipient: str | None = None  # a harmony message's recipient (to=functions.get_weather)
    text: str = field(default="", compare=False)  # the span's tokens decoded (markers kept)

    @property
    def slice(self) -> slice:
        """cache[address][:, span.slice]: this span's rows of a capture of the same ids."""
        return slice(self.start, self.end)

    def __repr__(self) -> str:
        who = self.role if self.index < 0 else f"{self.role}#{self.index}"
        what = "" if self.part == "message" else f" {self.part}"
        return f"Span({who}{what}: tokens {self.start}..{self.end - 1})"


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
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            # an assistant's tool call may come with no content, as chat templates take it
            and (isinstance(m.get("content"), (str, list)) or (m.get("content") is None and "tool_calls" in m))
            for m in messages
        )
    ):
        raise InputError(
            "messages must be a non-empty list of {'role': str, 'content': str} dicts (content may be left out "
            "of a message with tool_calls), e.g. [{'role': 'user', 'content': 'Hello'}]."
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


def _ids(tok: Any, messages: Sequence[dict], add_generation_prompt: bool, **kwargs: Any) -> list[int]:
    if any(k in m for m in messages for k in cc.REASONING_KEYS):  # a reasoning goes where the template reads it
        messages = cc.with_reasoning(cc.detect(tok), messages)
    try:
        out = tok.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
        )
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


def apply_chat_template(
    model: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True, enable_thinking: bool | None = None
) -> torch.Tensor:
    """Token ids [1, seq] of the conversation rendered with the model's own template (enable_thinking: the
    template's switch, where its source reads one)."""
    lm = _model_of(model)
    check_flag("add_generation_prompt", add_generation_prompt)
    tok = _check(lm, messages)
    kwargs = cc.template_kwargs(cc.detect(tok), enable_thinking)
    return torch.tensor([_ids(tok, messages, add_generation_prompt, **kwargs)])


def message_spans(model: Any, messages: Sequence[dict]) -> list[Span]:
    """Token spans per message, found by rendering growing prefixes of the conversation.

    Raises if the template rewrites earlier turns when later ones are added (then spans are ambiguous).
    """
    lm = _model_of(model)
    spans = _message_spans(_check(lm, messages), messages, {})
    if spans is None:
        raise InputError(
            "this chat template renders earlier messages differently once later ones are added, so "
            "per-message token spans are not well defined for it."
        )
    return spans


def _message_spans(tok: Any, messages: Sequence[dict], kwargs: dict) -> list[Span] | None:
    """One span per message by rendering growing prefixes; None where the template rewrites earlier turns."""
    spans: list[Span] = []
    prev: list[int] = []
    for i in range(len(messages)):
        cur = _ids(tok, messages[: i + 1], False, **kwargs)
        if cur[: len(prev)] != prev:
            return None
        spans.append(Span(messages[i]["role"], i, len(prev), len(cur), text=tok.decode(cur[len(prev) :])))
        prev = cur
    return spans


# ---- a rendered conversation, its parts and where its generation stops ------------------------------------------


@dataclass(frozen=True, eq=False)
class Chat:
    """A conversation rendered by the model's template (ie_lab.to_chat): its ids, the spans of each message and of
    each part of one, the convention the tokenizer follows, and the ids its generation stops at. Every operation
    that takes a prompt takes a Chat (its ids); generate stops at stop_ids."""

    ids: torch.Tensor  # [1, seq]
    spans: tuple[Span, ...]
    convention: cc.ChatConvention
    stop_ids: frozenset[int]

    def parts(self, part: str | None = None, *, role: str | None = None, index: int | None = None) -> list[Span]:
        """The spans with this part name (e.g. "reasoning", "final", "analysis", "message"), role and message."""
        return [
            s
            for s in self.spans
            if (part is None or s.part == part)
            and (role is None or s.role == role)
            and (index is None or s.index == index)
        ]

    def __repr__(self) -> str:
        parts = ", ".join(sorted({s.part for s in self.spans}))
        return (
            f"Chat({self.ids.shape[-1]} tokens, {self.convention.style}, spans: {parts}; "
            f"stops at ids {sorted(self.stop_ids)})"
        )


def model_eos_ids(lm: Any) -> set[int]:
    """The model's own end-of-sequence ids: the tokenizer's, the config's and the generation config's."""
    hf = getattr(lm, "hf", None)
    out: set[int] = set()
    for src in (
        getattr(getattr(lm, "tokenizer", None), "eos_token_id", None),
        getattr(getattr(hf, "config", None), "eos_token_id", None),
        getattr(getattr(hf, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(src, int):
            out.add(src)
        elif isinstance(src, (list, tuple)):
            out.update(int(x) for x in src)
    return out


def _check_stop_ids(stop_ids: Any, vocab: int | None) -> frozenset[int]:
    ok = isinstance(stop_ids, (list, tuple, set, frozenset)) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (vocab or 2**62) for i in stop_ids
    )
    if not ok:
        raise InputError(
            f"stop_ids must be a list of token ids within the vocabulary ({vocab}), got {stop_ids!r}; leave it out "
            "to stop at the end of the assistant's turn, or pass [] to stop only at max_new_tokens."
        )
    return frozenset(int(i) for i in stop_ids)


def to_chat(
    model: Any,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    stop_ids: Any = None,
) -> Chat:
    """Render a conversation with the model's template and name its parts (docs/GENERATION.md "Chat conventions").

    An assistant message may carry its reasoning under "reasoning" (or "thinking", "reasoning_content"): it is
    handed to the template where the template reads it. enable_thinking: the template's switch, where its source
    reads one. stop_ids: the ids generation from this chat stops at (default: the end of the assistant's turn as
    the tokenizer marks it, and the model's own EOS)."""
    lm = _model_of(model)
    check_flag("add_generation_prompt", add_generation_prompt)
    tok = _check(lm, messages)
    conv = cc.detect(tok)
    kwargs = cc.template_kwargs(conv, enable_thinking)
    msgs = cc.with_reasoning(conv, messages)
    ids = _ids(tok, msgs, add_generation_prompt, **kwargs)
    spans = _message_spans(tok, msgs, kwargs)
    if spans and ids[: spans[-1].end] != _ids(tok, msgs, False, **kwargs):
        spans = None
    spans = spans or []  # a template that rewrites earlier turns: parts only, with no message to belong to
    if spans and len(ids) > spans[-1].end:  # the generation prompt: the reply's own header, before its first token
        a = spans[-1].end
        spans.append(Span("assistant", len(messages), a, len(ids), "generation_prompt", text=tok.decode(ids[a:])))

    def index_at(pos: int) -> int:
        return next((s.index for s in spans if s.start <= pos < s.end), -1)

    parts = [
        Span(c.role, index_at(c.start), c.start, c.end, c.part, c.recipient, tok.decode(ids[c.start : c.end]))
        for c in cc.cut(conv, tok, ids)
    ]
    text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    parts += _content_parts(tok, text, ids, spans, msgs, parts)
    for i, m in enumerate(messages):
        given = any(isinstance(m.get(k), str) and m[k].strip() for k in cc.REASONING_KEYS)
        if given and not any(p.index == i and p.part in _REASONING for p in parts):
            raise InputError(
                f"message {i}'s reasoning is not in the rendered conversation: this template drops it there (many "
                "drop the reasoning of turns before the last user message); pass the conversation up to that turn, "
                "or put the reasoning in the content."
            )
    vocab = getattr(getattr(lm, "facts", None), "vocab_size", None)
    stops = frozenset(conv.turn_end_ids) | model_eos_ids(lm) if stop_ids is None else _check_stop_ids(stop_ids, vocab)
    ordered = sorted([*spans, *parts], key=lambda s: (s.start, s.part != "message"))
    return Chat(torch.tensor([ids]), tuple(ordered), conv, stops)


_REASONING = ("reasoning", "analysis")


def _content_parts(
    tok: Any, text: str, ids: list[int], spans: list[Span], messages: Sequence[dict], parts: list[Span]
) -> list[Span]:
    """A "content" span for each message whose text content the markers did not cut into parts: the tokens that
    render it, found by the rendered text's character offsets (a fast tokenizer's) and kept only where they decode
    to exactly the content (none where the template rewrites it, or a token straddles its edge)."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except Exception:  # a tokenizer without offsets: message spans and marker parts only
        return []
    if [int(i) for i in enc["input_ids"]] != ids:
        return []
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    out = []
    for s in spans:
        content = messages[s.index].get("content") if s.part == "message" else None
        if not isinstance(content, str) or not content.strip() or any(p.index == s.index for p in parts):
            continue
        lo, hi = offsets[s.start][0], offsets[s.end - 1][1]
        at = text.rfind(content, lo, hi)
        while at >= 0:  # the last occurrence first: the content follows its header, which may hold the same text
            inside = [i for i in range(s.start, s.end) if at <= offsets[i][0] and offsets[i][1] <= at + len(content)]
            if inside and tok.decode(ids[inside[0] : inside[-1] + 1]) == content:
                out.append(Span(s.role, s.index, inside[0], inside[-1] + 1, "content", text=content))
                break
            at = text.rfind(content, lo, at + len(content) - 1)
    return out


def stop_ids_for(lm: Any, prompt: Any, model_eos: set[int]) -> set[int]:
    """The ids a generation from this prompt stops at: a Chat's own; a conversation's turn end with the model's
    EOS; any other prompt the model's EOS. A list of prompts stops at the union of theirs."""
    if isinstance(prompt, Chat):
        return set(prompt.stop_ids)
    if is_messages(prompt):
        tok = getattr(lm, "tokenizer", None)
        return set(model_eos) | (set(cc.detect(tok).turn_end_ids) if tok is not None else set())
    if isinstance(prompt, (list, tuple)) and any(isinstance(p, Chat) or is_messages(p) for p in prompt):
        return set(model_eos).union(*(stop_ids_for(lm, p, model_eos) for p in prompt))
    return set(model_eos)


def split_channels(model: Any, generated: Any) -> list[Span]:
    """Cut ids into their parts by the tokenizer's convention: harmony's channels (analysis, final, commentary,
    tool_call) or think-style reasoning / final / tool_call. generated: token ids (a list or a [1, seq] tensor), a
    Chat, or a GenerationResult, whose spans count positions in prompt + generated ids (as its cache holds them)
    and cover only what was generated."""
    lm = _model_of(model)
    tok = getattr(lm, "tokenizer", None)
    if tok is None:
        raise InputError("split_channels reads the tokenizer's marker tokens, and this model has none: load one.")
    conv = cc.detect(tok)
    if conv.style == "plain":
        raise cc.no_reasoning("split_channels was asked for channels")
    start = 0
    if isinstance(generated, Chat):
        ids = generated.ids[0].tolist()
    elif hasattr(generated, "prompt_ids") and hasattr(generated, "ids"):  # a GenerationResult
        prompt = [int(i) for i in generated.prompt_ids.reshape(-1).tolist()]
        start, ids = len(prompt), prompt + [int(i) for i in generated.ids]
    elif isinstance(generated, torch.Tensor) and generated.ndim <= 2 and (generated.ndim < 2 or len(generated) == 1):
        ids = [int(i) for i in generated.reshape(-1).tolist()]
    elif isinstance(generated, (list, tuple)) and all(isinstance(i, int) for i in generated):
        ids = [int(i) for i in generated]
    else:
        raise InputError(
            "split_channels takes token ids (a list of ints or a [1, seq] tensor), a Chat or a GenerationResult, "
            f"got {type(generated).__name__}."
        )
    out = []
    for c in cc.cut(conv, tok, ids):
        a = max(c.start, start)
        if c.end > a:
            out.append(Span(c.role, -1, a, c.end, c.part, c.recipient, tok.decode(ids[a : c.end])))
    return out
