"""What a served request will cost, read from its checked arguments and the model's facts before any work starts:
the tokens it runs through the model, and the bytes of tensors its answer will hold.

The server refuses a request over its limits (max_request_tokens, max_capture_bytes) with these numbers before
the Session sees it, so an oversized request never holds the model. Prompts are tokenized here exactly as the
Session will (core.inputs, with the server's own copy of the tokenizer, so this never races an operation's);
each answer's size is computed from the shapes it will have: batch x positions x the point's width (points.py's
widths on the model's facts) x the model's element size, an attention pattern heads x queries x keys.

Every figure is a lower bound of what the operation then does: a width this module cannot tell (a mixer's
state, an argument the Session will refuse) counts as nothing, and the server keeps its check of the encoded
answer as a backstop. Generation counts every token it asks for (max_new_tokens per prompt), whether or not it
stops earlier: that is what it may cost. A patch sweep counts its prompt once per cell of its grid.
"""

from __future__ import annotations

import copy
import threading
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..address import Address
from ..cache import Cache
from ..core.addresses import head_count
from ..core.inputs import prepare, prepare_prompts
from ..errors import IELabError
from ..points import Width, width_of

ID_BYTES = 8  # token ids travel as int64


@dataclass(frozen=True)
class Cost:
    tokens: int  # tokens run through the model (a prompt's tokens, plus the new ones it asks for)
    bytes: int  # tensor bytes of the answer (a whole stream's, for generate_stream)


class Costs:
    """Counts a request's cost for one served model. `tokenizer` is copied: the Session's own is used by its
    operations on their threads meanwhile, and a fast tokenizer's settings are not safe to share."""

    def __init__(self, facts: Any, tokenizer: Any, dtype: torch.dtype):
        self.facts = facts
        self.lm = types.SimpleNamespace(facts=facts, tokenizer=copy.deepcopy(tokenizer), device=torch.device("cpu"))
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._lock = threading.Lock()  # one tokenization at a time on the copy

    # ---- prompts -------------------------------------------------------------------------------------------
    def shapes(self, prompt: Any, *, rows: bool = False) -> list[tuple[int, int]]:
        """(batch, positions) of each prompt as the Session will read it: a list of prompts one by one (ragged,
        never padded: a lower bound where the Session pads them into one batch); [] where it will refuse."""
        with self._lock:
            try:
                many = prepare_prompts(self.lm, prompt, rows=rows)
                ids = many if many is not None else [prepare(self.lm, prompt)[0]]
            except (IELabError, TypeError, ValueError, RuntimeError, OverflowError):
                return []  # the Session refuses it with its own words, before any forward
        return [(int(t.shape[0]), int(t.shape[1])) for t in ids]

    @staticmethod
    def _tokens(shapes: list[tuple[int, int]], new: int = 0) -> int:
        return sum(b * (seq + new) for b, seq in shapes)

    # ---- widths -------------------------------------------------------------------------------------------
    def _addresses(self, addresses: Any) -> list[Address]:
        out = []
        for a in [addresses] if isinstance(addresses, str) else list(addresses or ()):
            try:
                out.append(Address.parse(a))
            except (IELabError, TypeError, ValueError):
                continue  # the Session refuses it
        return out

    def _row(self, addr: Address, keys: int) -> int:
        """Elements one position of one prompt holds at `addr`, whose attention reads `keys` positions."""
        w, f = addr.point.width, self.facts
        if w is Width.ATTN:
            return (1 if addr.head is not None else int(f.n_heads)) * keys
        if w is Width.D_MLP and addr.layer is not None and addr.layer in tuple(getattr(f, "moe_layers", ()) or ()):
            return 0  # a sparse MoE layer has no dense MLP neurons of that width
        n = width_of(w, f)
        if not isinstance(n, int) or n <= 0:
            return 0  # a mixer's state: one per sequence, shaped by the mixer's kind
        return n // max(1, head_count(addr, f)) if addr.head is not None and w.head_axis else n

    def _points(self, addresses: list[Address], batch: int, positions: int) -> int:
        return sum(batch * positions * self._row(a, positions) for a in addresses) * self.itemsize

    # ---- operations ---------------------------------------------------------------------------------------
    def of(self, name: str, args: list, kwargs: dict, params: tuple) -> Cost:
        """The cost of a request to operation `name`, from its checked (bound) arguments. A cost this cannot
        count (facts of a model it does not foresee) is none: the server's checks after the work still hold."""
        try:
            return self._of(name, args, kwargs, params)
        except Exception:  # noqa: BLE001 - counting never refuses a request by failing itself
            return Cost(0, 0)

    def _of(self, name: str, args: list, kwargs: dict, params: tuple) -> Cost:
        names = [p[0] for p in params]
        a = {**dict(zip(names, args)), **kwargs}
        f = self.facts
        vocab = int(f.vocab_size or 0)
        if name == "capture":
            shapes = self.shapes(a.get("tokens_or_text"))
            addrs = self._addresses(a.get("addresses"))
            return Cost(
                self._tokens(shapes),
                sum(self._points(addrs, b, seq) + ID_BYTES * b * seq for b, seq in shapes),
            )
        if name in ("generate", "generate_stream"):
            new = int(a.get("max_new_tokens", 32))
            shapes = self.shapes(a.get("prompt"), rows=True)
            addrs = self._addresses(a.get("capture"))
            logits = vocab * self.itemsize if a.get("keep_logits", True) else 0
            return Cost(
                self._tokens(shapes, new),
                sum(self._points(addrs, b, seq + new) + b * new * logits + ID_BYTES * b * seq for b, seq in shapes),
            )
        if name == "attention":
            shapes = self.shapes(a.get("prompt"))
            layers = self._count_layers(a.get("layers"))
            heads, kv = int(f.n_heads), int(width_of(Width.KV_HEADS, f))  # probs [heads, q, k]; values [seq, kv]
            return Cost(
                self._tokens(shapes),
                sum(layers * b * (heads * seq * seq + seq * kv) for b, seq in shapes) * self.itemsize,
            )
        if name == "logit_lens":
            shapes = self.shapes(a.get("prompt"))
            layers = self._count_layers(a.get("layers"))
            kept = vocab * self.itemsize if a.get("keep_logits", False) else 0
            return Cost(self._tokens(shapes), sum(layers * b * seq * kept for b, seq in shapes))
        if name == "project":
            new = int(a.get("max_new_tokens", 0))
            shapes = self.shapes(a.get("prompt"))
            n = self._directions(a.get("directions")) if a.get("k") is None else 0
            return Cost(self._tokens(shapes, new), sum(b * (seq + new) * n for b, seq in shapes) * self.itemsize)
        if name == "logit_attribution":  # one forward; the pieces are a few numbers per position
            return Cost(self._tokens(self.shapes(a.get("prompt"))), 0)
        if name == "mean_difference":
            pos = [s for p in a.get("positive") or () for s in self.shapes(p)]
            neg = [s for p in a.get("negative") or () for s in self.shapes(p)]
            return Cost(self._tokens(pos) + self._tokens(neg), 0)
        if name == "patch":
            shapes = self.shapes(a.get("prompt"))
            source = a.get("source")
            tokens = self._tokens(shapes) + (0 if isinstance(source, Cache) else self._tokens(self.shapes(source)))
            return Cost(tokens, sum(b * seq for b, seq in shapes) * vocab * self.itemsize)
        if name == "patch_sweep":
            clean, corrupted = self.shapes(a.get("clean")), self.shapes(a.get("corrupted"))
            layers = self._count_layers(a.get("layers"))
            seq = max((s for _, s in clean), default=0)
            cells = layers * (int(f.n_heads) if a.get("over") == "layer_head" else seq)
            return Cost(self._tokens(clean) * (cells + 1) + self._tokens(corrupted), 0)
        if name == "gradients":
            shapes = self.shapes(a.get("prompt"))
            addrs = self._addresses(a.get("addresses"))
            return Cost(self._tokens(shapes), sum(self._points(addrs, b, seq) for b, seq in shapes))
        return Cost(0, 0)  # the tables: no model work

    def _count_layers(self, layers: Any) -> int:
        if layers is None:
            return int(self.facts.n_layers)
        if isinstance(layers, int):
            return 1
        try:
            return len(layers)
        except TypeError:
            return 0

    @staticmethod
    def _directions(directions: Any) -> int:
        """How many scores per token project returns for these directions (probes [n, d] or an SAE's W_enc
        [d, n]); 0 where the Session will refuse them."""
        if isinstance(directions, torch.Tensor):
            return 1 if directions.dim() == 1 else int(directions.shape[0]) if directions.dim() == 2 else 0
        if isinstance(directions, dict) and isinstance(directions.get("W_enc"), torch.Tensor):
            w = directions["W_enc"]
            return int(w.shape[-1]) if w.dim() == 2 else 0
        return 0
