"""Chat conventions a tokenizer can follow, read from what it can do (its added tokens and its chat template's
source), never from a model's name: harmony's channels (gpt-oss: `<|start|>assistant<|channel|>analysis<|message|>
...<|end|>`), think-style reasoning (`<think>...</think>`, Qwen3 / DeepSeek-R1, with or without an `enable_thinking`
switch), and the token that ends a turn (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, harmony's `<|return|>` and
`<|call|>`). The parsers here cut a sequence of ids into its parts by those marker tokens alone, so a prompt rendered
by the template and a generation read afterwards are cut by one rule (docs/GENERATION.md "Chat conventions")."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_STOPS = ("<|return|>", "<|call|>")  # <|end|> closes an analysis message: the model goes on after it
# Marker pairs of think-style templates: the part between them, by name.
PAIRS = (("<think>", "</think>", "reasoning"), ("<tool_call>", "</tool_call>", "tool_call"))
# The message fields a reasoning may arrive in (ours first); the template's own is the one its source reads.
REASONING_KEYS = ("reasoning", "thinking", "reasoning_content")
# End-of-turn tokens by their text, used only where rendering a probe conversation could not name the template's
# own (its Jinja refused the probe): each must be an added token the template's source writes.
TURN_END_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
    "<|END_OF_TURN_TOKEN|>",
    "<｜end▁of▁sentence｜>",
)
_PROBE = "ie-lab-probe-reply"


@dataclass(frozen=True)
class ChatConvention:
    """What a tokenizer's chat template can do. style: "harmony", "think" or "plain"."""

    style: str
    turn_end_ids: tuple[int, ...]  # the ids that end an assistant turn (generation stops there)
    reasoning_key: str | None  # the message field the template reads a reasoning from (None: not a field)
    reasoning_in_content: bool  # the template finds <think>...</think> inside the content (DeepSeek-R1 style)
    thinking_switch: bool  # the template reads enable_thinking
    markers: dict[str, int]  # marker text -> id, for every convention marker the tokenizer holds as one token

    @property
    def reasoning(self) -> bool:
        return self.reasoning_key is not None or self.reasoning_in_content


def _added(tok: Any) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in tok.get_added_vocab().items()}
    except Exception:  # a tokenizer without added-token bookkeeping has no convention markers
        return {}


def detect(tok: Any) -> ChatConvention:
    """The convention a tokenizer follows, from its added tokens and its template's source."""
    src = getattr(tok, "chat_template", None)
    if isinstance(src, dict):  # named templates: the default one renders a conversation
        src = src.get("default")
    src = src if isinstance(src, str) else ""
    added = _added(tok)
    names = {*HARMONY_MARKERS, *HARMONY_ENDS, *(m for a, b, _ in PAIRS for m in (a, b))}
    markers = {m: added[m] for m in names if m in added}
    key = next((k for k in REASONING_KEYS if re.search(rf"[.'\"]{k}\b", src)), None)
    if all(m in markers for m in HARMONY_MARKERS) and "<|channel|>" in src:
        style = "harmony"
        ends = tuple(markers[m] for m in HARMONY_STOPS if m in markers)
        in_content = False
    elif "<think>" in markers and "</think>" in markers and "</think>" in src:
        style = "think"
        ends = _turn_end(tok, src, added)
        in_content = key is None  # no field: the template reads the reasoning out of the content
    else:
        style, ends, in_content, key = "plain", _turn_end(tok, src, added), False, None
    return ChatConvention(style, ends, key, in_content, "enable_thinking" in src, markers)


def _turn_end(tok: Any, src: str, added: dict[str, int]) -> tuple[int, ...]:
    """The template's end-of-turn token: the first added token it writes after an assistant reply."""
    if not src:
        return ()
    probe = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tok.apply_chat_template(probe, tokenize=False)
        tail = text[text.index(_PROBE) + len(_PROBE) :]
        ids = list(tok(tail, add_special_tokens=False)["input_ids"]) if tail else []
    except Exception:  # the template refuses this probe (a system message first, say): name it by its text
        ids = []
    special = set(added.values()) | {int(i) for i in getattr(tok, "all_special_ids", ())}
    if ids and int(ids[0]) in special:
        return (int(ids[0]),)
    return tuple(added[n] for n in TURN_END_NAMES if n in added and n in src)


def no_reasoning(what: str) -> InputError:
    return InputError(
        f"{what}, but this tokenizer's chat template has no reasoning convention (no <think>/</think> added tokens "
        "it writes, no harmony channels, no reasoning_content or thinking field it reads): put the reasoning in "
        "the content, drop it, or set tokenizer.chat_template to a template that renders one (and add its marker "
        "tokens with tokenizer.add_special_tokens)."
    )


def with_reasoning(conv: ChatConvention, messages: Sequence[dict]) -> list[dict]:
    """The messages as the template reads them: a reasoning given under any of REASONING_KEYS moves to the field the
    template reads, or into the content between <think> markers where the template reads it from there."""
    out = []
    for i, m in enumerate(messages):
        given = [k for k in REASONING_KEYS if k in m]
        if not given:
            out.append(m)
            continue
        if not conv.reasoning:
            raise no_reasoning(f"message {i} has a '{given[0]}' field")
        if m.get("role") != "assistant":
            raise InputError(f"message {i} has a '{given[0]}' field, but only an assistant message reasons.")
        r = m[given[0]]
        if not isinstance(r, str):
            raise InputError(f"message {i}'s '{given[0]}' must be a string, got {type(r).__name__}.")
        m = {k: v for k, v in m.items() if k not in REASONING_KEYS}
        if conv.reasoning_key is not None:
            m[conv.reasoning_key] = r
        else:
            m["content"] = f"<think>\n{r}\n</think>\n\n{m.get('content') or ''}"
        out.append(m)
    return out


def template_kwargs(conv: ChatConvention, enable_thinking: Any) -> dict[str, Any]:
    if enable_thinking is None:
        return {}
    if not isinstance(enable_thinking, bool):
        raise InputError(f"enable_thinking must be True, False or None, got {enable_thinking!r}.")
    if not conv.thinking_switch:
        raise InputError(
            "enable_thinking was given, but this tokenizer's chat template has no enable_thinking switch (its "
            "source never reads it): leave enable_thinking out, or set tokenizer.chat_template to a template "
            "that reads it."
        )
    return {"enable_thinking": enable_thinking}


# ---- cutting ids into parts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """One part found in a sequence: its name, who speaks it, its tokens [start, end) and a harmony recipient."""

    part: str
    role: str
    start: int
    end: int
    recipient: str | None = None


def _trim(tok: Any, ids: Sequence[int], a: int, b: int) -> tuple[int, int]:
    """[a, b) without the whitespace-only tokens at its edges (the newlines a template puts around a part)."""
    while a < b and not tok.decode([ids[a]]).strip():
        a += 1
    while b > a and not tok.decode([ids[b - 1]]).strip():
        b -= 1
    return a, b


def cut(conv: ChatConvention, tok: Any, ids: Sequence[int]) -> list[Cut]:
    """The parts of a sequence by the convention's marker tokens (harmony channels, think-style pairs)."""
    ids = [int(i) for i in ids]
    if conv.style == "harmony":
        return _cut_harmony(conv, tok, ids)
    if conv.style == "think":
        return _cut_think(conv, tok, ids)
    return []


def _cut_harmony(conv: ChatConvention, tok: Any, ids: list[int]) -> list[Cut]:
    m = conv.markers
    start, message = m["<|start|>"], m["<|message|>"]
    ends = {m[e] for e in HARMONY_ENDS if e in m}
    out: list[Cut] = []
    head = 0  # where the current header starts (a generation's first message has no <|start|>)
    i = 0
    while i < len(ids):
        t = ids[i]
        if t == start:
            head = i + 1
        elif t in ends:
            head = i + 1
        elif t == message:
            header = tok.decode(ids[head:i], skip_special_tokens=False)
            role, _, rest = header.partition("<|channel|>")
            channel = rest.split("<|constrain|>")[0].split()[0] if rest.split() else ""
            found = re.search(r"\bto=(\S+)", header)
            recipient = found.group(1).split("<|")[0] if found else None
            role = role.split(" to=")[0].strip() or "assistant"
            j = i + 1
            while j < len(ids) and ids[j] not in ends and ids[j] != start:
                j += 1
            if role == "assistant" and recipient is not None:
                part = "tool_call"
            else:
                part = channel or "content"
            a, b = _trim(tok, ids, i + 1, j)
            out.append(Cut(part, role, a, b, recipient))
            head = i = j
            continue
        i += 1
    return out


def _cut_think(conv: ChatConvention, tok: Any, ids: list[int]) -> list[Cut]:
    """Reasoning between <think> and </think> (from the start where only the closing marker is present: a DeepSeek-R1
    generation prompt ends with the opening one); the final answer after </think> up to the turn's end, cut short by
    a tool call; tool calls between their markers."""
    m = conv.markers
    # the answer ends at the turn's end, or at any other added token (a next turn's header) where none is known
    pair_ids = {m[x] for pair in PAIRS for x in pair[:2] if x in m}
    ends = set(conv.turn_end_ids) | (set(_added(tok).values()) - pair_ids)
    out: list[Cut] = []
    opened: dict[int, tuple[int, str]] = {m[a]: (m[b], part) for a, b, part in PAIRS if a in m and b in m}
    closes = {c: part for c, part in opened.values()}
    pending: tuple[int, int, str] | None = None  # (open index, close id, part) of a pair not yet closed
    final_from = None
    since = 0  # after the last marker or end: where a reasoning closed with no opener began
    for i, t in enumerate(ids):
        if pending is None and t in opened:
            if final_from is not None:
                _final(tok, ids, final_from, i, out)
                final_from = None
            pending = (i, *opened[t])
        elif t in closes and (pending is None or t == pending[1]):
            part = closes[t]
            if pending is not None or part == "reasoning":
                out.append(Cut(part, "assistant", *_trim(tok, ids, pending[0] + 1 if pending else since, i)))
                final_from = i + 1 if part == "reasoning" else final_from
            pending = None
            since = i + 1
        elif t in ends and pending is None:
            if final_from is not None:
                _final(tok, ids, final_from, i, out)
                final_from = None
            since = i + 1
    if pending is not None:  # a part cut off (a generation that ran out of tokens inside it)
        out.append(Cut(pending[2], "assistant", *_trim(tok, ids, pending[0] + 1, len(ids))))
    elif final_from is not None:
        _final(tok, ids, final_from, len(ids), out)
    return [c for c in out if c.end > c.start]


def _final(tok: Any, ids: list[int], a: int, b: int, out: list[Cut]) -> None:
    out.append(Cut("final", "assistant", *_trim(tok, ids, a, b)))
