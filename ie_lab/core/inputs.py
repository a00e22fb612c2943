"""Turning what a user passes (text, token lists, tensors, conversations) into checked input ids.

Neutral: the checks read only the model's facts, tokenizer and device, which every backend's model carries, so
the eager and vLLM backends refuse the same inputs with the same words.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InputError, check_text
from . import chat


def prepare(lm: Any, tokens_or_text: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ([batch, seq] long input ids on the model's device, attention mask or None)."""
    mask = None
    if isinstance(tokens_or_text, dict):
        raise InputError(
            "expected text (str or list of str), token ids (tensor or list of ints) or a conversation "
            "(a list of {'role', 'content'} dicts), got a single dict: wrap a message in a list, e.g. "
            "[{'role': 'user', 'content': 'Hello'}]."
        )
    if isinstance(tokens_or_text, chat.Chat):  # a conversation already rendered (ie_lab.to_chat)
        tokens_or_text = tokens_or_text.ids
    elif chat.is_messages(tokens_or_text):
        # A conversation: rendered with the model's own chat template, as it reads it just before replying.
        tokens_or_text = torch.tensor([chat.render(lm, tokens_or_text)])
    if isinstance(tokens_or_text, str) or (
        isinstance(tokens_or_text, (list, tuple)) and tokens_or_text and all(isinstance(t, str) for t in tokens_or_text)
    ):
        tok = lm.tokenizer
        if tok is None:
            raise InputError(
                "this model was loaded without a tokenizer, so it cannot read text: pass token ids, or "
                "load it with tokenizer=AutoTokenizer.from_pretrained(...)."
            )
        texts = [tokens_or_text] if isinstance(tokens_or_text, str) else list(tokens_or_text)
        if any(not t for t in texts):
            raise InputError("empty text: give at least one character to tokenize.")
        for i, t in enumerate(texts):
            check_text(t, "the text" if len(texts) == 1 else f"text {i}")
        if len(texts) > 1 and tok.pad_token_id is None:
            raise InputError(
                "batching texts of different lengths needs a pad token, and this tokenizer has none: "
                "set tokenizer.pad_token = tokenizer.eos_token, or capture the texts one at a time."
            )
        enc = tok(texts, return_tensors="pt", padding=len(texts) > 1)
        ids = enc["input_ids"]
        if len(texts) > 1:
            mask = enc["attention_mask"]
    elif isinstance(tokens_or_text, torch.Tensor):
        ids = tokens_or_text
    elif isinstance(tokens_or_text, (list, tuple, np.ndarray)):
        if len(tokens_or_text) == 0:
            raise InputError("empty input: the token list is empty; give at least one token id (or a string).")
        try:
            ids = torch.as_tensor(
                np.asarray(tokens_or_text) if isinstance(tokens_or_text, np.ndarray) else tokens_or_text
            )
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InputError(
                f"could not read the token list ({e}); pass a list of ints, a list of equal-length "
                "lists of ints, or a string."
            ) from None
    else:
        raise InputError(
            f"expected text (str or list of str) or token ids (tensor or list of ints), "
            f"got {type(tokens_or_text).__name__}."
        )

    if ids.numel() == 0:  # before the dtype check: torch reads an empty list as float32
        raise InputError("empty input: there are no tokens to run; give at least one token.")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise InputError(
            f"token ids must be integers, got dtype {ids.dtype}: convert with tokens.long() (or pass the text itself)."
        )
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise InputError(f"token ids must be [seq] or [batch, seq], got shape {list(ids.shape)}.")
    if ids.numel() == 0 or ids.shape[1] == 0:
        raise InputError("empty input: there are no tokens to run; give at least one token.")
    vocab = lm.facts.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab and hi >= vocab):
        bad = lo if lo < 0 else hi
        raise InputError(
            f"token id {bad} is outside the vocabulary (0..{vocab - 1}); were these ids made by a different tokenizer?"
        )
    limit = lm.facts.max_positions
    if limit and ids.shape[1] > int(limit):
        raise InputError(
            f"the input has {ids.shape[1]} tokens but this model's context is {limit}: "
            f"truncate it, e.g. tokens[:, -{limit}:]."
        )
    device = lm.device
    ids = ids.to(device=device, dtype=torch.long)
    if mask is not None:
        mask = mask.to(device)
    return ids, mask


def str_tokens(lm: Any, ids: torch.Tensor) -> list[list[str]]:
    tok = lm.tokenizer
    if tok is None:
        return [[str(int(i)) for i in row] for row in ids]
    return [tok.convert_ids_to_tokens(row.tolist()) for row in ids.cpu()]


def _is_batch(x: Any, rows: bool) -> bool:
    """A list of prompts (each text, ids or a conversation); with rows=True also a [batch > 1, seq] tensor."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return rows and x.ndim == 2 and x.shape[0] > 1
    if not isinstance(x, (list, tuple)) or not x or chat.is_messages(x):
        return False
    # A flat list of ints is one prompt; anything else with items that are prompts themselves is a list of them.
    return all(isinstance(p, (str, list, tuple, torch.Tensor, np.ndarray, dict, chat.Chat)) for p in x) and not all(
        isinstance(p, dict) for p in x
    )


def _kind(p: Any) -> str:
    if isinstance(p, str):
        return "text"
    if chat.is_messages(p) or isinstance(p, chat.Chat):
        return "conversation"
    return "ids"


def prepare_prompts(lm: Any, prompts: Any, *, rows: bool = False) -> list[torch.Tensor] | None:
    """A list of prompts as one checked [1, seq] id tensor each (ragged, unpadded); None for a single prompt.

    rows=True also reads a [batch > 1, seq] tensor of ids as that many prompts (generation, which has no
    batched result); capture keeps such a tensor one batch, returned as one Cache.

    Every prompt is checked before any work starts, and a refusal names its index. A list mixing text with
    ids is refused: it is far more often a mistake (a token list split into items) than meant."""
    if isinstance(prompts, (list, tuple)) and len(prompts) == 0:
        raise InputError(
            "empty input: the token list is empty (no prompt, no token); give a string, token ids, a conversation "
            "or a list of prompts."
        )
    if not _is_batch(prompts, rows):
        return None
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        prompts = list(torch.as_tensor(prompts))
    kinds = [_kind(p) for p in prompts]
    if "text" in kinds and "ids" in kinds:
        i = kinds.index("ids") if kinds[0] == "text" else kinds.index("text")
        raise InputError(
            f"prompt {i} is {kinds[i]} but prompt 0 is {kinds[0]}: a list of prompts is all text or "
            "all token ids (conversations may go with either); convert one kind to the other "
            "(lm.to_tokens(text)[0].tolist())."
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            raise InputError(
                f"prompt {i} is a single dict: a conversation is a list of {{'role', 'content'}} "
                "dicts, e.g. [{'role': 'user', 'content': 'Hello'}]."
            )
        try:
            ids, _ = prepare(lm, p)
        except InputError as e:
            raise InputError(f"prompt {i}: {e}") from None
        if ids.shape[0] != 1:
            raise InputError(
                f"prompt {i} holds {ids.shape[0]} rows; each item of a list of prompts is one prompt "
                "(text, a list of ids, or a conversation): pass the rows as separate items."
            )
        out.append(ids)
    return out


# ---- prepend_bos (TransformerLens' switch) ------------------------------------------------------------------

# The parameters of the Backend protocol's operations that take prompts (ie_lab/backend.py).
PROMPT_PARAMETERS = ("tokens_or_text", "prompt", "prompts", "source", "clean", "corrupted", "positive", "negative")


def check_prepend_bos(value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise InputError(f"prepend_bos must be True, False or None (the tokenizer's own choice), got {value!r}.")


def text_ids(tok: Any, text: str, prepend_bos: bool) -> list[int]:
    """One text's token ids with the beginning-of-sequence token decided by prepend_bos, as TransformerLens does:
    the text's own tokens (no special tokens the tokenizer would add), then, with prepend_bos=True, the tokenizer's
    BOS id first, or its EOS id where it has no BOS token (GPT-2's <|endoftext|> serves as both; TransformerLens sets
    bos_token to eos_token the same way). prepend_bos=False: the text's own tokens only, even where the tokenizer
    adds a BOS by itself (Llama, Gemma)."""
    if tok is None:
        raise InputError(
            "this model was loaded without a tokenizer, so it cannot read text: pass token ids, or "
            "load it with tokenizer=AutoTokenizer.from_pretrained(...)."
        )
    if not text:
        raise InputError("empty text: give at least one character to tokenize.")
    check_text(text)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if prepend_bos:
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if bos is None:
            raise InputError(
                "prepend_bos=True, but this tokenizer has neither a BOS nor an EOS token to put first: set "
                "tokenizer.bos_token, or pass prepend_bos=False (or None: the tokenizer's own choice)."
            )
        ids = [int(bos), *ids]
    return ids


def with_bos(tok: Any, prompt: Any, prepend_bos: bool | None) -> Any:
    """A prompt argument with its text turned into token ids by prepend_bos (None: unchanged, the tokenizer adds
    what it adds by default). A list of texts becomes a list of id lists (each one prompt, as a list of texts is);
    ids, tensors and conversations pass unchanged (a conversation's chat template places its own BOS)."""
    if prepend_bos is None:
        return prompt
    if isinstance(prompt, str):
        return text_ids(tok, prompt, prepend_bos)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        return [text_ids(tok, p, prepend_bos) for p in prompt]
    return prompt
