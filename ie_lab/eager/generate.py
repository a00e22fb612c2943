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
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..address import Address, AddressLike
from ..cache import Cache
from ..core.addresses import parse_addresses, slice_head
from ..core.chat import stop_ids_for
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..core.results import GenerationResult, GenStep
from ..core.sampling import check_generation_args
from ..core.steer_spec import ForwardState, SteerSpec, check_positions_fit, issued_specs
from ..errors import CapabilityUnsupported, InputError, RequestFailed, plural, shown_value
from .model import lm_of
from .steer import running
from .steer_hooks import steering
from .taps import Taps


def _eos_ids(lm: Any) -> set[int]:
    out: set[int] = set()
    for src in (
        getattr(lm.tokenizer, "eos_token_id", None),
        getattr(lm.hf.config, "eos_token_id", None),
        getattr(getattr(lm.hf, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(src, int):
            out.add(src)
        elif isinstance(src, (list, tuple)):
            out.update(int(x) for x in src)
    return out


def non_finite(step: int, steered: bool) -> RequestFailed:
    """The refusal of a sampled step whose logits hold a nan or an inf: there is no distribution to draw from."""
    if steered:
        return RequestFailed(
            f"steering made the logits non-finite (nan or inf) at step {step} of this request, so there is no "
            "distribution to sample from; lower the steering scale (or the vector's norm), or steer fewer "
            "positions or layers."
        )
    return RequestFailed(
        f"the model's logits were non-finite (nan or inf) at step {step} of this request, so there is no "
        "distribution to sample from; check the model's weights and dtype (float16 overflows where bfloat16 or "
        "float32 does not)."
    )


def _choose(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    gen: torch.Generator | None,
    step: int = 0,
    steered: bool = False,
) -> int:
    """The next token: the argmax when greedy, else a draw from the tempered, cut distribution (a non-finite one
    is refused as `non_finite`, naming the step)."""
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
    if not bool(torch.isfinite(probs).all()):  # a nan anywhere, an inf maximum, or every logit -inf
        raise non_finite(step, steered)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _cache_keyword(hf: Any) -> str:
    """The keyword this transformers version takes the KV cache under.

    Newer transformers renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); older ones
    only know `past_key_values`. Read it off the forward's signature rather than a version number."""
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returns_a_kv_cache(hf: Any) -> bool:
    """Whether the forward takes a KV cache and its declared output carries one back. State-space and recurrent
    trunks keep their state elsewhere (Mamba's cache_params; RecurrentGemma's output has no cache field), and the
    decode loop must refuse them before the first forward rather than fail after it."""
    sig = inspect.signature(hf.forward)
    key = "cache" if "cache" in sig.parameters else "past_key_values"
    if key not in sig.parameters:
        return False
    ann = sig.return_annotation
    outs = [c for c in (*getattr(ann, "__args__", ()), ann) if hasattr(c, "__dataclass_fields__")]
    return not outs or any(key in c.__dataclass_fields__ for c in outs)


def _join(a: Address, parts: list[torch.Tensor], start: int) -> torch.Tensor:
    """One point's rows from consecutive cached forwards, the first beginning at absolute position `start`."""
    if a.point.is_attention:
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


def _pad_id(lm: Any) -> int:
    """The id left padding is filled with: never attended to, so any id in the vocabulary would do."""
    pid = getattr(lm.tokenizer, "pad_token_id", None)
    return pid if isinstance(pid, int) and 0 <= pid < (lm.facts.vocab_size or pid + 1) else 0


class _Run:
    """State of one generation over one or more prompts: the hooks, the KV cache, what has been captured.

    Several prompts run as one left-padded batch: every prompt ends at the same cache index, so each decode
    step appends one column. Each forward gets an attention mask that hides the pads and position ids that
    count each row's own tokens (learned and rotary positions alike); sliding windows count cache indices,
    whose distances padding does not change. Captured rows are handed out per prompt with the pads cut off,
    at positions over that prompt's own tokens."""

    def __init__(self, lm: Any, rows: list[torch.Tensor], capture: list[Address], specs: list[SteerSpec]):
        if not _returns_a_kv_cache(lm.hf):
            raise CapabilityUnsupported(
                f"generating with {lm.facts.model_type}",
                "its forward does not hand back a KV cache (past_key_values): it keeps a recurrent state of its own "
                "(Mamba's cache_params, RecurrentGemma's internal state), which ie_lab's decode loop does not carry "
                "yet.",
                "capture, lens and steering work on a prompt; to generate, call the raw model's generate().",
            )
        self.lm, self.capture, self.specs = lm, capture, specs
        self.rows = rows
        self.lens = [r.shape[1] for r in rows]
        width = max(self.lens)
        device = rows[0].device
        self.pad = torch.tensor([width - n for n in self.lens], device=device)
        self.padded = bool(self.pad.any())
        self.ids = torch.full((len(rows), width), _pad_id(lm), dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            self.ids[i, width - r.shape[1] :] = r[0]
        self.taps = Taps(lm, capture) if capture else None
        self.state = ForwardState(prompt_len=width, pad=self.pad if self.padded else None)
        self.steer_ctx = steering(lm, specs, self.state) if specs else None
        self.past = None
        self.offset = 0
        self.cache_kw = _cache_keyword(lm.hf)
        # Only the last position's logits choose a token (as in HF generate): the prompt forward skips the
        # unembedding of every other position, unless lm_head itself is captured.
        self.keep_last = "logits_to_keep" in inspect.signature(lm.hf.forward).parameters and not any(
            a.name == "lm_head" for a in capture
        )
        self.spans: list[tuple[int, int]] = []  # padded-frame positions each forward covered
        b = len(rows)
        self._handed = [0] * b  # per prompt: forwards whose rows earlier steps already carry

    def forward(self, cur: torch.Tensor) -> torch.Tensor:
        shape = (cur.shape[0], cur.shape[1])
        if self.taps is not None:
            self.taps.shape = shape
            self.taps.owner = threading.get_ident()  # the thread that runs this step (a stream may move threads)
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self.keep_last else {}
        if self.padded:
            end = self.offset + cur.shape[1]
            mask = torch.arange(end, device=cur.device)[None] >= self.pad[:, None]
            kwargs["attention_mask"] = mask.long()
            # Each row's own positions; a pad (only ever in the prompt forward) gets 0, and is never attended to.
            own = torch.arange(self.offset, end, device=cur.device)[None] - self.pad[:, None]
            kwargs["position_ids"] = own.clamp(min=0)
        # The forward is marked as this generation's, so only its own steering acts (with the positions the
        # cache already holds, so masks count over prompt + generated), never a `with` block's raw-forward hooks.
        with running(self.steer_ctx, self.specs, offset=self.offset, shape=shape):
            out = self.lm.hf(input_ids=cur, use_cache=True, **{self.cache_kw: self.past}, **kwargs)
        self.past = getattr(out, self.cache_kw)
        self.spans.append((self.offset, self.offset + cur.shape[1]))
        self.offset += cur.shape[1]
        return out.logits[:, -1]

    def _rows(self, r: int, first: int, upto: int) -> tuple[dict[Address, torch.Tensor], range]:
        """Prompt r's rows of every captured point from forwards first..upto-1, pads cut, and their positions
        over r's own tokens."""
        start = self.spans[first][0] if first < upto else self.spans[upto - 1][1]
        stop = self.spans[upto - 1][1] if first < upto else start
        p = int(self.pad[r])
        drop = max(p - start, 0)
        out: dict[Address, torch.Tensor] = {}
        if self.taps is None:  # nothing captured
            return out, range(start + drop - p, stop - p)
        for a in self.capture:
            parts = self.taps.collected.get(a.without_head(), [])[first:upto]
            if not parts:
                continue
            t = _join(a, parts, start)
            if a.point.is_attention:
                t = t[r : r + 1, :, drop:, p:]  # the pads' queries and keys
            else:
                t = t[r : r + 1, drop:]
            out[a] = slice_head(a, t, self.lm.facts)
        return out, range(start + drop - p, stop - p)

    def new_rows(self, r: int, upto: int) -> tuple[dict[Address, torch.Tensor], range]:
        """Prompt r's rows from the forwards since its last call, up to forward `upto`."""
        out = self._rows(r, self._handed[r], upto)
        self._handed[r] = upto
        return out

    def collected(self, r: int, upto: int) -> dict[Address, torch.Tensor]:
        return self._rows(r, 0, upto)[0]


def check_batchable(lm: Any) -> None:
    """Refuse a list of prompts on a model whose padded batch could differ from each prompt run alone.

    Measured: every family in tests/families.py (dense, sliding-window, learned positions, ALiBi, top-k MoE)
    gives each prompt of a ragged batch its solo greedy tokens. Two things would break that, and are refused
    rather than run subtly different: a forward that cannot be told the pads (no attention mask or position
    ids), and experts with a capacity (pad tokens would take capacity from real ones)."""
    cfg = lm.hf.config
    kind = getattr(cfg, "model_type", type(lm.hf).__name__)
    params = inspect.signature(lm.hf.forward).parameters
    missing = [k for k in ("attention_mask", "position_ids") if k not in params]
    if missing:
        raise CapabilityUnsupported(
            f"generating a list of prompts on {kind}",
            f"its forward takes no {' or '.join(missing)}, so left padding would shift every shorter prompt",
            "generate the prompts one at a time (a loop over generate)",
        )
    for attr in ("expert_capacity", "capacity_factor", "moe_capacity_factor"):
        if getattr(cfg, attr, None):
            raise CapabilityUnsupported(
                f"generating a list of prompts on {kind}",
                f"its experts have a capacity ({attr}={getattr(cfg, attr)}), so padding tokens would take "
                "capacity from real ones and change what a prompt computes alone",
                "generate the prompts one at a time (a loop over generate)",
            )


def _check_seeds(seed: Any, n: int, batch: bool) -> list[int | None]:
    """seed= as one seed per prompt: one integer seeds every prompt alike (each its own generator, so each
    prompt samples what it samples alone with that seed); a list gives each prompt its own."""
    if batch and isinstance(seed, (list, tuple)):
        if len(seed) != n:
            raise InputError(
                f"seed= has {plural(len(seed), 'seed')} for {plural(n, 'prompt')}: give one per prompt, or one integer for all."
            )
        for x in seed:
            check_generation_args(1, 0.0, None, None, 0, seed=x) if x is not None else None
        return [None if x is None else int(x) for x in seed]
    # a plain int: torch's manual_seed refuses a numpy integer, which the check accepts as an integer
    return [None if seed is None else int(seed)] * n


@dataclass
class Plan:
    """A generation request checked and read: everything the decode loop needs, nothing computed yet."""

    rows: list[torch.Tensor]  # one [1, seq] id tensor per prompt
    batch: bool  # a list of prompts (results come back as a list)
    stops: list[str]
    seeds: list[int | None]
    addrs: list[Address]
    specs: list[SteerSpec]
    eos: set[int]


def plan(
    lm: Any,
    prompt: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    n_logprobs: int = 0,
    capture: AddressLike | Iterable[AddressLike] | None = None,
    steer: SteerSpec | Sequence[SteerSpec] | None = None,
    keep_logits: bool = True,
    ignore_eos: bool = False,
    stops_of: Any = None,
) -> Plan:
    """Check every argument of a generation and read its prompts, before any forward (refusals name the prompt).
    stops_of: the prompt as the caller was given it, where `prompt` is its ids (project): where it stops."""
    many = prepare_prompts(lm, prompt, rows=True)
    batch = many is not None
    stops = check_generation_args(
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        n_logprobs,
        vocab=lm.facts.vocab_size,
        seed=None if batch and isinstance(seed, (list, tuple)) else seed,
        stop=stop,
        keep_logits=keep_logits,
        ignore_eos=ignore_eos,
        has_tokenizer=lm.tokenizer is not None,
    )
    rows = many if many is not None else [prepare(lm, prompt)[0]]
    if not batch and rows[0].shape[0] != 1:
        raise InputError("internal: one prompt with several rows")  # prepare_prompts reads those as a list
    seeds = _check_seeds(seed, len(rows), batch)
    limit = lm.facts.max_positions
    for i, r in enumerate(rows):
        if limit and r.shape[1] + max_new_tokens > int(limit):
            which = (
                f"prompt {i} ({plural(r.shape[1], 'token')})" if batch else f"prompt ({plural(r.shape[1], 'token')})"
            )
            raise InputError(
                f"{which} + max_new_tokens ({shown_value(max_new_tokens)}) exceeds the model's context of {limit}; "
                "lower max_new_tokens or shorten the prompt."
            )
    if len(rows) > 1:
        check_batchable(lm)
    addrs = parse_addresses(lm, capture) if capture else []
    specs = list(issued_specs(lm, steer))  # the `with` blocks open where this was issued, then steer=
    for i, r in enumerate(rows):
        try:
            check_positions_fit(specs, r.shape[1] + max_new_tokens)
        except InputError as e:
            raise InputError(f"prompt {i}: {e}" if batch else str(e)) from None
    # A conversation stops at the end of the assistant's turn, a Chat at its stop_ids (core/chat.py)
    eos = set() if ignore_eos else stop_ids_for(lm, prompt if stops_of is None else stops_of, _eos_ids(lm))
    return Plan(rows, batch, stops, seeds, addrs, specs, eos)


def stop_reason(lm: Any, token_id: int, generated: list[int], eos: set[int], stops: list[str]) -> str | None:
    """Why a prompt ends with this token ("eos", "stop"), or None while it runs on."""
    if token_id in eos:
        return "eos"
    if stops and any(s in lm.tokenizer.decode(generated) for s in stops):
        return "stop"
    return None


def make_step(
    lm: Any, index: int, token_id: int, row_logits: torch.Tensor, n_logprobs: int, keep_logits: bool, prompt_index: int
) -> GenStep:
    """The GenStep of one chosen token: its text, log-probability, top alternatives and (kept) logits."""
    tok = lm.tokenizer
    logp = torch.log_softmax(row_logits.float(), -1)
    text_tok = tok.decode([token_id]) if tok is not None else str(token_id)
    top = {}
    if n_logprobs:
        vals, idx = logp.topk(n_logprobs)
        top = {(tok.decode([int(j)]) if tok is not None else str(int(j))): float(v) for v, j in zip(vals, idx)}
    return GenStep(
        index,
        token_id,
        text_tok,
        float(logp[token_id]),
        top,
        row_logits.detach().clone() if keep_logits else None,
        prompt_index=prompt_index,
    )


def generate_stream(
    model: Any,
    prompt: Any,
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    n_logprobs: int = 0,
    capture: AddressLike | Iterable[AddressLike] | None = None,
    steer: SteerSpec | Sequence[SteerSpec] | None = None,
    keep_logits: bool = True,
    ignore_eos: bool = False,
    _result: dict | None = None,
    _stops_of: Any = None,
) -> Iterator[GenStep]:
    """Yield one GenStep per generated token. Greedy when temperature is 0; ignore_eos=True runs to the length.

    A list of prompts (or a [batch, seq] tensor of ids) runs as one batch: each decode step yields one GenStep
    per prompt still running, in prompt order, with ``step.prompt_index`` saying which. With capture=, each
    step carries its forward's new rows (GenStep.captured) and the last step the whole cache (GenStep.cache);
    see docs/GENERATION.md."""
    lm = lm_of(model)
    p = plan(
        lm,
        prompt,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop,
        n_logprobs=n_logprobs,
        capture=capture,
        steer=steer,
        keep_logits=keep_logits,
        ignore_eos=ignore_eos,
        stops_of=_stops_of,
    )
    rows = p.rows
    gens = [torch.Generator().manual_seed(x) if x is not None else None for x in p.seeds]
    run = _Run(lm, rows, p.addrs, p.specs)
    b = len(rows)
    generated: list[list[int]] = [[] for _ in range(b)]
    reasons = ["length"] * b
    caches: list[Cache | None] = [None] * b
    if _result is not None:
        _result.update(prompt_ids=rows, ids=generated, reasons=reasons, caches=caches, batch=p.batch)
    pad_id = _pad_id(lm)
    with contextlib.ExitStack() as stack:
        stack.enter_context(lm.lock)
        stack.enter_context(torch.no_grad())
        if run.taps is not None:
            stack.enter_context(run.taps)
        if run.steer_ctx is not None:
            stack.enter_context(run.steer_ctx)
        cur = run.ids
        active = list(range(b))
        pending = None  # logits of a forward already run (to capture finishing prompts' last tokens)
        for i in range(max_new_tokens):
            logits = pending if pending is not None else run.forward(cur)
            pending = None
            nxt = [pad_id] * b  # a finished prompt's row is fed padding: computed, never read
            finishing: set[int] = set()
            chosen = {}
            for r in active:
                token_id = _choose(logits[r], temperature, top_k, top_p, gens[r], i, bool(p.specs))
                generated[r].append(token_id)
                nxt[r] = token_id
                chosen[r] = token_id
                reasons[r] = stop_reason(lm, token_id, generated[r], p.eos, p.stops) or "length"
                if reasons[r] != "length" or i == max_new_tokens - 1:
                    finishing.add(r)
            cur = torch.tensor([[t] for t in nxt], device=run.ids.device)
            if run.taps is not None and finishing:
                # One more cached step so captures cover the last generated token of every prompt ending here;
                # the prompts still running take their next logits from it.
                pending = run.forward(cur)
            steps = []
            for r in active:
                step = make_step(lm, i, chosen[r], logits[r], n_logprobs, keep_logits, r)
                if run.taps is not None:
                    last = r in finishing
                    upto = len(run.spans) - (1 if pending is not None and not last else 0)
                    got, positions = run.new_rows(r, upto)
                    at = _tokens_at(rows[r], generated[r], positions)
                    step.captured = Cache(got, tokens=at, str_tokens=str_tokens(lm, at))
                    step.captured_positions = positions
                    if last:
                        full = torch.cat([rows[r], torch.tensor([generated[r]], device=rows[r].device)], dim=1)
                        caches[r] = step.cache = Cache(
                            run.collected(r, upto), tokens=full, str_tokens=str_tokens(lm, full)
                        )
                steps.append(step)
            yield from steps
            active = [r for r in active if r not in finishing]
            if not active:
                break


def _tokens_at(prompt: torch.Tensor, generated: list[int], positions: range) -> torch.Tensor:
    full = torch.cat([prompt, torch.tensor([generated], dtype=prompt.dtype, device=prompt.device)], dim=1)
    return full[:, positions.start : positions.stop]


def generate(model: Any, prompt: Any, max_new_tokens: int = 32, **kwargs: Any) -> Any:
    """Run generate_stream to the end and return the text, tokens, steps and any captures.

    A list of prompts returns a list of GenerationResult, one per prompt, in order."""
    lm = lm_of(model)
    box: dict = {}
    steps = list(generate_stream(lm, prompt, max_new_tokens, _result=box, **kwargs))
    results = []
    for r, ids in enumerate(box["prompt_ids"]):
        gen_ids = box["ids"][r]
        text = lm.tokenizer.decode(gen_ids) if lm.tokenizer is not None else " ".join(map(str, gen_ids))
        results.append(
            GenerationResult(
                ids, gen_ids, text, [s for s in steps if s.prompt_index == r], box["reasons"][r], box["caches"][r]
            )
        )
    return results if box["batch"] else results[0]
