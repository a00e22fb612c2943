"""Streaming generation with our own KV-cached decode loop over the raw HF model.

Each step yields the chosen token, its text, the top-n log-probabilities (of the model's own
distribution, before temperature) and the logits. Captures are read from the cached forwards as they
happen, never by re-running prompt + generated afterwards; steering hooks stay installed for the
whole loop and are removed however it ends (exhausted, stopped, broken out of, interrupted).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from ..address import Address, AddressLike
from ..cache import Cache
from ..errors import InputError
from .capture import parse_addresses, slice_head
from .inputs import prepare, str_tokens
from .steer import ForwardState, SteerSpec, check_positions_fit, steering
from .taps import Taps


@dataclass
class GenStep:
    index: int
    token_id: int
    token: str
    logprob: float
    top_logprobs: dict[str, float]
    logits: torch.Tensor | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"GenStep({self.index}: {self.token!r}, logprob={self.logprob:.3f})"


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
    x = logits.float() / temperature
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


def _check_args(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, n_logprobs: int):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if temperature < 0:
        raise InputError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k must be >= 1, got {top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p}.")
    if n_logprobs < 0:
        raise InputError(f"n_logprobs must be >= 0, got {n_logprobs}.")


def _as_specs(steer: SteerSpec | Sequence[SteerSpec] | None) -> list[SteerSpec]:
    if steer is None:
        return []
    return [steer] if isinstance(steer, SteerSpec) else list(steer)


class _Run:
    """State of one generation: the hooks, the cache, and what has been captured so far."""

    def __init__(self, lm: Any, ids: torch.Tensor, capture: list[Address], specs: list[SteerSpec]):
        self.lm, self.ids, self.capture, self.specs = lm, ids, capture, specs
        self.taps = Taps(lm, capture) if capture else None
        self.state = ForwardState(prompt_len=ids.shape[1])
        self.steer_ctx = steering(lm, specs, self.state) if specs else None
        self.past = None
        self.offset = 0

    def forward(self, cur: torch.Tensor) -> torch.Tensor:
        shape = (cur.shape[0], cur.shape[1])
        if self.taps is not None:
            self.taps.shape = shape
        # Our own steering and any `with spec:` block around this call: tell each where the prompt ends
        # and how many positions the cache already holds, so position masks count over prompt + generated.
        for ctx in list(self.lm.__dict__.get("_steering_active", [])):
            ctx.writers.offset = self.offset
            ctx.writers.shape = shape
            ctx.state.offset = self.offset
            ctx.state.prompt_len = self.ids.shape[1]
        out = self.lm.hf(input_ids=cur, past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        self.offset += cur.shape[1]
        return out.logits[:, -1]

    def collected(self) -> dict[Address, torch.Tensor]:
        out: dict[Address, torch.Tensor] = {}
        for a in self.capture:
            parts = self.taps.collected.get(a.without_head(), [])
            if a.point.width.value == "n_heads*q*k":
                # Each step saw the keys its cache held: all earlier positions, or only the last few on a
                # sliding-window layer whose cache is cropped. Place them at their absolute positions.
                total = sum(p.shape[2] for p in parts)
                placed, end = [], 0
                for p in parts:
                    end += p.shape[2]
                    k = p.shape[-1]
                    fill = float("-inf") if a.name == "attn_scores" else 0.0  # unseen keys: masked
                    placed.append(torch.nn.functional.pad(p, (end - k, total - end), value=fill))
                full = torch.cat(placed, dim=2)
            else:
                full = torch.cat(parts, dim=1)
            out[a] = slice_head(a, full, self.lm.facts)
        return out


def generate_stream(model: Any, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop: str | Sequence[str] | None = None, n_logprobs: int = 0,
                    capture: AddressLike | Iterable[AddressLike] | None = None,
                    steer: SteerSpec | Sequence[SteerSpec] | None = None, keep_logits: bool = True,
                    ignore_eos: bool = False, _result: dict | None = None) -> Iterator[GenStep]:
    """Yield one GenStep per generated token. Greedy when temperature is 0; ignore_eos=True runs to the length."""
    from .. import _as_lm

    lm = _as_lm(model)
    _check_args(max_new_tokens, temperature, top_k, top_p, n_logprobs)
    ids, mask = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise InputError("generate takes one prompt at a time on the eager backend; loop over prompts (the vLLM "
                         "backend batches concurrent calls).")
    limit = lm.facts.max_positions
    if limit and ids.shape[1] + max_new_tokens > int(limit):
        raise InputError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"context of {limit}; lower max_new_tokens or shorten the prompt.")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    addrs = parse_addresses(lm, capture) if capture else []
    specs = _as_specs(steer)
    check_positions_fit(specs, ids.shape[1] + max_new_tokens)
    eos = set() if ignore_eos else _eos_ids(lm)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tok = lm.tokenizer
    run = _Run(lm, ids, addrs, specs)
    generated: list[int] = []
    reason = "length"
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
            yield GenStep(i, token_id, text_tok, float(logp[token_id]), top, logits.detach().clone() if keep_logits else None)
            cur = torch.tensor([[token_id]], device=ids.device)
            if token_id in eos:
                reason = "eos"
                break
            if stops and tok is not None:
                so_far = tok.decode(generated)
                if any(s in so_far for s in stops):
                    reason = "stop"
                    break
        if run.taps is not None and generated:
            run.forward(cur)  # one more cached step so captures cover the last generated token too
        for ctx in list(lm.__dict__.get("_steering_active", [])):  # back to plain-forward semantics
            ctx.writers.offset = ctx.state.offset = 0
            ctx.state.prompt_len = None
        if _result is not None:
            _result["prompt_ids"] = ids
            _result["ids"] = generated
            _result["reason"] = reason
            if run.taps is not None:
                _result["captured"] = run.collected()


def generate(model: Any, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> GenerationResult:
    """Run generate_stream to the end and return the text, tokens, steps and any captures."""
    from .. import _as_lm

    lm = _as_lm(model)
    box: dict = {}
    steps = list(generate_stream(lm, prompt, max_new_tokens, _result=box, **kwargs))
    ids = box["prompt_ids"]
    gen_ids = box.get("ids", [s.token_id for s in steps])
    text = lm.tokenizer.decode(gen_ids) if lm.tokenizer is not None else " ".join(map(str, gen_ids))
    cache = None
    if "captured" in box:
        full = torch.cat([ids, torch.tensor([gen_ids], device=ids.device)], dim=1)
        cache = Cache(box["captured"], tokens=full, str_tokens=str_tokens(lm, full))
    return GenerationResult(ids, gen_ids, text, steps, box.get("reason", "length"), cache)
