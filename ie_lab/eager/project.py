"""project(): per-token scores of one point against probe directions or an SAE encoder, computed in the hook.

The hook that reads the point applies ie_lab/ops/projection.py to the rows as they pass and keeps only the
[tokens, k] scores, never the full-width activation. ``make_encoder`` (ie_lab/core/projection_args.py) is the
one place that checks what a user may pass (shared with the vLLM backend, which ships the checked encoder to its
worker). See docs/PROJECTION.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..address import Address
from ..core.addresses import slice_head
from ..core.inputs import prepare, str_tokens
from ..core.projection_args import check_gen, make_encoder, one_address, point_width
from ..core.results import Projection
from ..core.steer_spec import issued_specs
from ..errors import CapabilityUnsupported, InputError, StructureError
from ..ops.projection import Encoder, scores
from . import hook_calls
from .model import lm_of
from .taps import Taps

# ---- the hooks ------------------------------------------------------------------------------------------


class _ProjTaps(Taps):
    """Taps that keep the scores of each forward's rows instead of the rows themselves."""

    def __init__(self, lm: Any, addr: Address, enc: Encoder):
        super().__init__(lm, [addr])
        self.addr, self.enc = addr, enc
        self.parts: list[torch.Tensor] = []
        self._shape_handle: torch.utils.hooks.RemovableHandle | None = None

    def _keep(self, base: Address, t: torch.Tensor) -> None:
        b, s = self.shape
        if t.dim() == 2 and b and t.shape[0] == b * s:
            t = t.reshape(b, s, -1)  # layers that flatten tokens around the MLP (OPT)
        if self.addr.head is not None:
            t = slice_head(self.addr, t, self.lm.facts)
        if t.shape[-1] != self.enc.d:
            raise StructureError(f"{self.addr} came out {t.shape[-1]} wide where {self.enc.d} was expected.")
        self.parts.append(scores(t.detach(), self.enc))

    def __enter__(self) -> "_ProjTaps":
        def shape(mod, args, kwargs):  # (batch, new tokens) of each forward, for the flattening families
            if not self._mine():
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            if ids is not None:
                self.shape = (int(ids.shape[0]), int(ids.shape[1]))

        self._shape_handle = hook_calls.on_input(self.lm.hf, shape)
        try:
            super().__enter__()
            return self
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._shape_handle is not None:
            self._shape_handle.remove()
            self._shape_handle = None
        super().close()


def project(
    model: Any,
    prompt: Any,
    address: Any,
    directions: Any,
    *,
    bias: Any = None,
    activation: str | None = None,
    threshold: Any = None,
    k: Any = None,
    max_new_tokens: int = 0,
    steer: Any = None,
    **gen: Any,
) -> Projection:
    """Per-token scores [tokens, k] of `address` against probe directions or an SAE encoder (docs/PROJECTION.md).

    Every argument is checked before a hook is placed. With max_new_tokens > 0 the model generates (greedy
    unless temperature= etc.) and the scores cover every token it read."""
    from .generate import generate
    from .steer import run_issued

    lm = lm_of(model)
    addr = one_address(lm, address)
    d = point_width(addr, lm.facts)
    n_new = check_gen(max_new_tokens, gen)
    enc = make_encoder(d, directions, bias=bias, activation=activation, threshold=threshold, k=k)
    specs = issued_specs(lm, steer)
    ids, mask = prepare(lm, prompt)
    if ids.shape[0] != 1:
        raise InputError("prompt: project takes one prompt per call (its scores are [tokens, k]); loop over prompts.")
    if mask is not None and not bool(mask.all()):
        raise InputError("prompt: the attention mask hides tokens; pass the prompt without padding.")
    generated: list[int] = []
    with lm.lock:  # re-entrant: the forwards below take it too; no other forward may pass through these hooks
        taps = _ProjTaps(lm, addr, enc)  # refuses a point this family lacks before any hook exists
        with taps:
            if n_new == 0:

                def forward():
                    with torch.no_grad():
                        lm.hf(input_ids=ids, use_cache=False)

                run_issued(lm, specs, forward)
            else:
                # stops where generate(prompt) would: a Chat at its stop_ids, a conversation at its turn end
                res = generate(lm, ids, n_new, steer=specs, keep_logits=False, _stops_of=prompt, **gen)
                generated = [int(t) for t in res.ids]
    if not taps.parts:
        raise CapabilityUnsupported(str(addr), "no forward passed through this point.", "use capture() to check it.")
    sc = torch.cat([p.reshape(-1, enc.k) for p in taps.parts])
    read = torch.cat([ids[0].cpu(), torch.tensor(generated, dtype=ids.dtype)])[: sc.shape[0]]
    if sc.shape[0] != read.shape[0]:
        raise StructureError(
            f"{addr}: {sc.shape[0]} rows for {read.shape[0]} tokens read; the point is seen more "
            "than once per forward on this family."
        )
    tok = lm.tokenizer
    text = tok.decode(generated) if (tok is not None and generated) else ""
    return Projection(addr, sc, read, str_tokens(lm, read[None])[0], generated, text)
