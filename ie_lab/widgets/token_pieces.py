"""The text each streamed token adds to a decoded continuation, so a panel shows the words with their spaces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenPieces:
    """Each new token's piece of the decoded continuation: the text decoding adds when it is appended, so the
    pieces joined are the text with its spaces (a word-level or SentencePiece tokenizer's token carries none of the
    space before it; decoding puts it there). Decoded after a few prompt tokens, so the first piece gets the space
    between the prompt and the continuation too. Without a tokenizer, or where a piece is not yet whole (a
    character split over byte tokens), the token's own text."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]):
        self.tok = tokenizer
        self.ctx = [int(i) for i in list(prompt_ids)[-4:]]
        self.ids: list[int] = []
        self.text = tokenizer.decode(self.ctx) if tokenizer is not None else ""

    def add(self, token_id: int, token: str) -> str:
        if self.tok is None:
            return token
        self.ids.append(int(token_id))
        now = self.tok.decode(self.ctx + self.ids)
        piece = now[len(self.text) :] if now.startswith(self.text) else token
        self.text = now
        return piece
