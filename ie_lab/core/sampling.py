"""The sampling arguments of a generation (length, temperature, top-k/p, seed, stop strings, flags), checked.

Neutral: the rules are the model's vocabulary and Python's numbers, nothing a backend decides, so eager and vLLM
refuse the same arguments with the same words before any work starts.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..errors import InputError, check_flag, shown_value


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    """math.isfinite that answers False for an integer past float's range (float() of it overflows)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_generation_args(
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    n_logprobs: Any,
    *,
    vocab: int | None = None,
    seed: Any = None,
    stop: Any = None,
    keep_logits: Any = True,
    ignore_eos: Any = False,
    has_tokenizer: bool = True,
) -> list[str]:
    """Refuse every unusable generation argument before any work starts; return the stop strings as a list.

    The vLLM session calls this too (vllm/checks.py check_sampling), before a request reaches the engine."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {shown_value(max_new_tokens)}.")
    if not _is_real(temperature) or not _finite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0 is greedy), got {shown_value(temperature)}.")
    if top_k is not None and (not _is_int(top_k) or top_k < 1 or (vocab and top_k > vocab)):
        raise InputError(
            f"top_k must be None (no top-k cut) or an integer from 1 to the vocabulary size "
            f"({vocab or 'of the model'}), got {shown_value(top_k)}."
        )
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):  # a nan fails the comparison too
        raise InputError(f"top_p must be a number in (0, 1] or None (no nucleus cut), got {shown_value(top_p)}.")
    if not _is_int(n_logprobs) or n_logprobs < 0 or (vocab and n_logprobs > vocab):
        raise InputError(
            f"n_logprobs must be an integer from 0 to the vocabulary size ({vocab}), got {shown_value(n_logprobs)}."
        )
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise InputError(f"seed must be an integer in [0, 2**64) or None (unseeded), got {shown_value(seed)}.")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        stops = []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        raise InputError(
            f"stop must be a non-empty string or a list of non-empty strings, got {shown_value(stop)}; to stop at "
            "a token id, decode it first: tokenizer.decode([id])."
        )
    if stops and not has_tokenizer:
        raise InputError(
            "stop strings need a tokenizer to read the generated text, and this model was loaded "
            "without one: stop on ids with the model's EOS instead, or load a tokenizer."
        )
    check_flag("keep_logits", keep_logits)
    check_flag("ignore_eos", ignore_eos)
    return list(stops)
