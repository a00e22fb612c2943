"""Streaming generation with our own KV-cached decode loop over the raw HF model.

Each step yields the chosen token, its text, the top-n log-probabilities (of the model's own
distribution, before temperature) and the logits. Captures are read from the cached forwards as they
happen, never by re-running prompt + generated afterwards: each step carries the rows its forward
produced (``GenStep.captured``, at ``GenStep.captured_positions``), and the last step also the whole
cache (``GenStep.cache``). Steering hooks stay installed for the whole loop and are removed however it
ends (exhausted, stopped, broken out of, interrupted).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from ..address import Address, AddressLike
from ..cache import Cache
from ..errors import InputError
from .capture import parse_addresses, slice_head
from .inputs import prepare, str_tokens
from .steer import ForwardState, SteerSpec, check_positions_fit, issued_specs, running, steering
from .taps import Taps


@dataclass
class GenStep:
    index: int
    token_id: int
    token: str
    logprob: float
    top_logprobs: dict[str, float]
    logits: torch.Tensor | None = field(default=None, repr=False)
    # With capture=: the rows of each captured point that this step's forward produced, at absolute positions
    # captured_positions (prompt + generated). Step 0 holds the prompt's rows; step i the row of token i - 1 (the
    # token fed in to choose this one); the last step also the row of its own token, read by one more cached
    # forward. Concatenating every step's rows along the position axis gives `cache` (attention matrices:
    # [batch, heads, new queries, keys so far], so pad their key axis to the full length first).
    captured: Cache | None = field(default=None, repr=False)
    captured_positions: range | None = field(default=None, repr=False)
    # On the last step only (when capture= was given): the whole cache, the same as generate(...).cache.
    cache: Cache | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        cap = f", captured positions {self.captured_positions.start}..{self.captured_positions.stop - 1}" \
            if self.captured_positions is not None else ""
        return f"GenStep({self.index}: {self.token!r}, logprob={self.logprob:.3f}{cap})"


@dataclass
class GenerationResult:
    prompt_ids: torch.Tensor
    ids: list[int]
    text: str
    steps: list[GenStep]
    stop_reason: str
    cache: Cache | None = None

    def __repr__(self) -> str:
        cap = f", captured {len(self.cache)} point(s)" if self.cache is not None else ""
        return f"GenerationResult({len(self.ids)} tokens, stop={self.stop_reason}{cap}): {self.text!r}"

    def _repr_html_(self) -> str:
        import html

        toks = "".join(f"<span title='logprob {s.logprob:.2f}' style='border-bottom:1px dotted #888'>"
                       f"{html.escape(s.token)}</span> " for s in self.steps)
        return f"<div><b>generated</b> ({len(self.ids)} tokens, stop: {self.stop_reason})<br>{toks}</div>"


def _eos_ids(lm: Any) -> set[int]:
    out: set[int] = set()
    for src in (getattr(lm.tokenizer, "eos_token_id", None), getattr(lm.hf.config, "eos_token_id", None),
                getattr(getattr(lm.hf, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            out.add(src)
        elif isinstance(src, (list, tuple)):
            out.update(int(x) for x in src)
    return out


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
            gen: torch.Generator | None) -> int:
    if temperature == 0.0:
        return int(logits.argmax())
    # Shift by the maximum and divide in float64: a tiny temperature then sends every other logit to -inf
    # (sampling the argmax) instead of overflowing to inf - inf = nan.
    x = logits.double()
    x = (x - x.max()) / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(x, min(top_k, x.shape[-1])).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) >= top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_args(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, n_logprobs: Any, *,
                vocab: int | None = None, seed: Any = None, stop: Any = None, keep_logits: Any = True,
                ignore_eos: Any = False, has_tokenizer: bool = True) -> list[str]:
    """Refuse every unusable generation argument before any work starts; return the stop strings as a list.

    The vLLM session calls this with the first five (its own checks cover the rest)."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}.")
    if top_k is not None and (not _is_int(top_k) or top_k < 1 or (vocab and top_k > vocab)):
        raise InputError(f"top_k must be None (no top-k cut) or an integer from 1 to the vocabulary size "
                         f"({vocab or 'of the model'}), got {top_k!r}.")
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):  # a nan fails the comparison too
        raise InputError(f"top_p must be a number in (0, 1] or None (no nucleus cut), got {top_p!r}.")
    if not _is_int(n_logprobs) or n_logprobs < 0 or (vocab and n_logprobs > vocab):
        raise InputError(f"n_logprobs must be an integer from 0 to the vocabulary size ({vocab}), got {n_logprobs!r}.")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise InputError(f"seed must be an integer in [0, 2**64) or None (unseeded), got {seed!r}.")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        stops = []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
        raise InputError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}.")
    if stops and not has_tokenizer:
        raise InputError("stop strings need a tokenizer to read the generated text, and this model was loaded "
                         "without one: stop on ids with the model's EOS instead, or load a tokenizer.")
    for name, flag in (("keep_logits", keep_logits), ("ignore_eos", ignore_eos)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {flag!r}.")
    return list(stops)


def _cache_keyword(hf: Any) -> str:
    """The keyword this transformers version takes the KV cache under.

    Newer transformers renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); older ones
    only know `past_key_values`. Read it off the forward's signature rather than a version number."""
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _join(a: Address, parts: list[torch.Tensor], start: int) -> torch.Tensor:
    """One point's rows from consecutive cached forwards, the first beginning at absolute position `start`."""
    if a.point.width.value == "n_heads*q*k":
        # Each forward saw the keys its cache held: all earlier positions, or only the last few on a
        # sliding-window layer whose cache is cropped. Place them at their absolute positions, keys 0..end.
        total = start + sum(p.shape[2] for p in parts)
        fill = float("-inf") if a.name == "attn_scores" else 0.0  # unseen keys: masked
        placed, end = [], start
        for p in parts:
            end += p.shape[2]
            placed.append(torch.nn.functional.pad(p, (end - p.shape[-1], total - end), value=fill))
        return placed[0] if len(placed) == 1 else torch.cat(placed, dim=2)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class _Run:
    """State of one generation: the hooks, the cache, and what has been captured so far."""

    def __init__(self, lm: Any, ids: torch.Tensor, capture: list[Address], specs: list[SteerSpec]):
        self.lm, self.ids, self.capture, self.specs = lm, ids, capture, specs
        self.taps = Taps(lm, capture) if capture else None
        self.state = ForwardState(prompt_len=ids.shape[1])
        self.steer_ctx = steering(lm, specs, self.state) if specs else None
        self.past = None
        self.offset = 0
        self.cache_kw = _cache_keyword(lm.hf)
        self._handed = 0  # forwards whose rows earlier steps already carry
        self._handed_pos = 0  # the positions those forwards covered

    def forward(self, cur: torch.Tensor) -> torch.Tensor:
        shape = (cur.shape[0], cur.shape[1])
        if self.taps is not None:
            self.taps.shape = shape
        # The forward is marked as this generation's, so only its own steering acts (with the positions the
        # cache already holds, so masks count over prompt + generated), never a `with` block's raw-forward hooks.
        with running(self.steer_ctx, self.specs, offset=self.offset, shape=shape):
            out = self.lm.hf(input_ids=cur, use_cache=True, **{self.cache_kw: self.past})
        self.past = getattr(out, self.cache_kw)
        self.offset += cur.shape[1]
        return out.logits[:, -1]

    def new_rows(self) -> tuple[dict[Address, torch.Tensor], range]:
        """The rows of every captured point from the forwards since the last call, and their positions."""
        start = self._handed_pos
        out: dict[Address, torch.Tensor] = {}
        for a in self.capture:
            parts = self.taps.collected.get(a.without_head(), [])[self._handed:]
            out[a] = slice_head(a, _join(a, parts, start), self.lm.facts)
        n = len(self.taps.collected[self.capture[0].without_head()]) if self.capture else 0
        self._handed, self._handed_pos = n, self.offset
        return out, range(start, self.offset)

    def collected(self) -> dict[Address, torch.Tensor]:
        return {a: slice_head(a, _join(a, self.taps.collected.get(a.without_head(), []), 0), self.lm.facts)
                for a in self.capture}


def generate_stream(model: Any, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop: str | Sequence[str] | None = None, n_logprobs: int = 0,
                    capture: AddressLike | Iterable[AddressLike] | None = None,
                    steer: SteerSpec | Sequence[SteerSpec] | None = None, keep_logits: bool = True,
                    ignore_eos: bool = False, _result: dict | None = None) -> Iterator[GenStep]:
    """Yield one GenStep per generated token. Greedy when temperature is 0; ignore_eos=True runs to the length.

    With capture=, each step carries its forward's new rows (GenStep.captured) and the last step the whole
    cache (GenStep.cache); see docs/GENERATION.md."""
    from .. import _as_lm

    lm = _as_lm(model)
    stops = _check_args(max_new_tokens, temperature, top_k, top_p, n_logprobs, vocab=lm.facts.vocab_size,
                        seed=seed, stop=stop, keep_logits=keep_logits, ignore_eos=ignore_eos,
                        has_tokenizer=lm.tokenizer is not None)
    ids, mask = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise InputError("generate takes one prompt at a time on the eager backend; loop over prompts (the vLLM "
                         "backend batches concurrent calls).")
    limit = lm.facts.max_positions
    if limit and ids.shape[1] + max_new_tokens > int(limit):
        raise InputError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"context of {limit}; lower max_new_tokens or shorten the prompt.")
    addrs = parse_addresses(lm, capture) if capture else []
    specs = list(issued_specs(lm, steer))  # the `with` blocks open where this was issued, then steer=
    check_positions_fit(specs, ids.shape[1] + max_new_tokens)
    eos = set() if ignore_eos else _eos_ids(lm)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tok = lm.tokenizer
    run = _Run(lm, ids, addrs, specs)
    generated: list[int] = []
    reason = "length"
    cache = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(lm.lock)
        stack.enter_context(torch.no_grad())
        if run.taps is not None:
            stack.enter_context(run.taps)
        if run.steer_ctx is not None:
            stack.enter_context(run.steer_ctx)
        cur = ids
        for i in range(max_new_tokens):
            logits = run.forward(cur)[0]
            logp = torch.log_softmax(logits.float(), -1)
            token_id = _choose(logits, temperature, top_k, top_p, gen)
            generated.append(token_id)
            text_tok = tok.decode([token_id]) if tok is not None else str(token_id)
            top = {}
            if n_logprobs:
                vals, idx = logp.topk(n_logprobs)
                top = {(tok.decode([int(j)]) if tok is not None else str(int(j))): float(v) for v, j in zip(vals, idx)}
            cur = torch.tensor([[token_id]], device=ids.device)
            # Decide before yielding whether this is the last step, so that step can carry the last token's
            # rows and the whole cache.
            if token_id in eos:
                reason = "eos"
            elif stops and any(s in tok.decode(generated) for s in stops):
                reason = "stop"
            last = reason != "length" or i == max_new_tokens - 1
            step = GenStep(i, token_id, text_tok, float(logp[token_id]), top,
                           logits.detach().clone() if keep_logits else None)
            if run.taps is not None:
                if last:
                    run.forward(cur)  # one more cached step so captures cover the last generated token too
                rows, positions = run.new_rows()
                at = _tokens_at(ids, generated, positions)
                step.captured = Cache(rows, tokens=at, str_tokens=str_tokens(lm, at))
                step.captured_positions = positions
                if last:
                    full = torch.cat([ids, torch.tensor([generated], device=ids.device)], dim=1)
                    cache = step.cache = Cache(run.collected(), tokens=full, str_tokens=str_tokens(lm, full))
            yield step
            if last:
                break
        if _result is not None:
            _result["prompt_ids"] = ids
            _result["ids"] = generated
            _result["reason"] = reason
            _result["cache"] = cache


def _tokens_at(prompt: torch.Tensor, generated: list[int], positions: range) -> torch.Tensor:
    full = torch.cat([prompt, torch.tensor([generated], dtype=prompt.dtype, device=prompt.device)], dim=1)
    return full[:, positions.start:positions.stop]


def generate(model: Any, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> GenerationResult:
    """Run generate_stream to the end and return the text, tokens, steps and any captures."""
    from .. import _as_lm

    lm = _as_lm(model)
    box: dict = {}
    steps = list(generate_stream(lm, prompt, max_new_tokens, _result=box, **kwargs))
    ids = box["prompt_ids"]
    gen_ids = box.get("ids", [s.token_id for s in steps])
    text = lm.tokenizer.decode(gen_ids) if lm.tokenizer is not None else " ".join(map(str, gen_ids))
    return GenerationResult(ids, gen_ids, text, steps, box.get("reason", "length"), box.get("cache"))
