"""The operations of a VLLMBackend, each a coroutine the Session runs on its loop, taking the operation's record
(ie_lab/core/calls.py): capture, mean_difference, harvest, project, generation (generate and astream), logit_lens and
attention. A room of VLLMBackend (ie_lab/vllm/backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import torch

from .. import points as _points
from ..address import Address, layer_list
from ..arch import quirks
from ..backend import CancelToken
from ..cache import Cache
from ..capabilities import require
from ..core import calls
from ..core.addresses import slice_head
from ..core.chat import stop_ids_for
from ..core.inputs import str_tokens
from ..core.projection_args import check_gen, make_encoder, one_address, point_width
from ..core.results import AttentionResult, GenerationResult, GenStep, LensResult, Projection, token_names
from ..core.splice_spec import fold, split_acts, unknown_acts
from ..core.steer_spec import check_positions_fit
from ..errors import (
    AddressError,
    CapabilityUnsupported,
    InputError,
    check_flag,
    shown_value,
)
from ..ops.lens import describe_postprocess
from ..ops.projection import to_plain
from ..points import Scope, Width
from .checks import (
    _Work,
    check_served,
)

# vllm itself is imported inside the methods that build requests (SamplingParams, TokensPrompt): it is an optional,
# heavy dependency, and importing this module must not import it.
from .results import _StepRows
from .wire import RECOMPUTED, pack, unpack


class _Operations:
    """The operations: arguments checked, requests built (requests.py), results assembled (results.py)."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _assemble: Any
    _check_room: Any
    _entered_specs: Any
    _graph: Any
    _ids: Any
    _len_why: Any
    _max_len: Any
    _mode: Any
    _params: Any
    _refuse_in_generate_mode: Any
    _refuse_in_graph_mode: Any
    _request: Any
    _tokens: Any
    _work_for: Any
    lm: Any

    # ---- capture ----------------------------------------------------------------------------------
    async def _acapture(self, tokens_or_text: Any, addresses: Any, grad: bool = False, steer: Any = None) -> Cache:
        from vllm import SamplingParams

        self._refuse_in_generate_mode("capture")
        if grad:
            require("gradients", "vllm")
        ids = self._ids(tokens_or_text)
        points, acts = split_acts(addresses)  # a spliced SAE's features, read in the worker (docs/SAE.md)
        addrs, work = self._work_for(points, steer)
        keep = {p["splice"]["acts"]: p["splice"] for p in work.steer if p["method"] == "splice"}
        for n in acts:
            if n not in keep:
                raise unknown_acts(n, list(keep))
            keep[n]["keep"] = True
        if not addrs and not acts:
            raise AddressError("no addresses given: name at least one point, e.g. ['resid_post.0'].")
        self._check_room(ids.shape[1], "a capture")

        async def one(row: torch.Tensor) -> dict:
            box: dict = {}
            params = SamplingParams(max_tokens=1, temperature=0.0)
            async for _ in self._request(row.tolist(), params, work, box):
                pass
            return box["collected"]

        results = await asyncio.gather(*(one(r) for r in ids))
        out: dict[Address, torch.Tensor] = {}
        for a in addrs:
            parts = []
            for res in results:
                if a.name in RECOMPUTED:
                    t = unpack(res["attn"][a.layer]["scores" if a.name == "attn_scores" else "probs"])
                else:
                    t = unpack(res["points"][str(a.without_head())])
                parts.append(t)
            full = torch.stack(parts).to(self.lm.dtype)
            out[a] = slice_head(a, full, self.lm.facts)
        features = {n: torch.stack([unpack(res["project"][n]["scores"]) for res in results]) for n in acts}
        return Cache(out, tokens=ids, str_tokens=str_tokens(self.lm, ids), features=features)

    def capture(self, call: calls.Capture) -> Any:
        call = fold(call, self.lm)  # splice= travels in steer= from here
        return self._acapture(call.tokens_or_text, call.addresses, call.grad, call.steer)

    # ---- difference of means ----------------------------------------------------------------------
    async def _amean_difference(
        self, positive: Any, negative: Any, address: Any, *, batch_size: int | None = None
    ) -> torch.Tensor:
        """mean(positive) - mean(negative) at `address`, each prompt averaged over its own tokens first (as eager's
        ie_lab.mean_difference); the prompts go to vLLM as concurrent requests, `batch_size` at a time."""
        if isinstance(address, (list, tuple)):
            raise InputError(f"address must name one point, got {len(address)}: {list(address)}.")
        addr = Address.parse(address)
        if addr.point.width.value == "n_heads*q*k":
            raise InputError(
                f"{addr} is an attention matrix, not a per-token activation: a mean over tokens of it "
                "is no steering direction; use a residual point such as resid_post."
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise InputError(
                f"batch_size must be a positive integer (requests in flight at once) or None, got {batch_size!r}."
            )
        sides = []
        for name, prompts in (("positive", positive), ("negative", negative)):
            if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
                raise InputError(f"{name} must be a non-empty list of prompts, got {prompts!r:.80}.")
            sides.append(list(prompts))
        step = batch_size or 64

        async def mean_of(prompts: list) -> torch.Tensor:
            rows = []
            for i in range(0, len(prompts), step):
                caps = await asyncio.gather(*(self._acapture(p, [addr]) for p in prompts[i : i + step]))
                rows += [c[addr][0].float().mean(0).cpu() for c in caps]
            return torch.stack(rows).mean(0)

        pos, neg = [await mean_of(side) for side in sides]
        return pos - neg

    def mean_difference(self, call: calls.MeanDifference) -> Any:
        """mean(positive) - mean(negative) at `address`; the prompts run as concurrent vLLM requests (no bar:
        progress is checked as on eager, and has nothing to draw)."""
        check_flag("progress", call.progress)
        return self._amean_difference(call.positive, call.negative, call.address, batch_size=call.batch_size)

    # ---- corpus harvest ---------------------------------------------------------------------------
    async def _aharvest(self, call: calls.Harvest) -> Any:
        """The harvest driver (ie_lab/corpus/run.py) over capture requests: each batch's prompts go to vLLM as
        concurrent requests (batch_size at a time, default 64), their rows written as the requests return."""
        from ..corpus.run import Harvester

        self._refuse_in_generate_mode("harvest")
        addrs, _ = self._work_for(call.addresses, None)  # every address checked as served before any request
        if call.batch_size is not None and (
            isinstance(call.batch_size, bool) or not isinstance(call.batch_size, int) or call.batch_size < 1
        ):
            raise InputError(
                f"batch_size must be a positive integer (requests in flight at once), got {call.batch_size!r}."
            )
        h = Harvester(
            self.lm,
            call.texts_or_dataset,
            addrs,
            call.out_dir,
            batch_size=call.batch_size or 64,
            max_tokens_per_prompt=call.max_tokens_per_prompt,
            text_column=call.text_column,
            shard_rows=call.shard_rows,
            progress=call.progress,
            sae=call.sae,
            top_k=call.top_k,
            prepend_bos=call.prepend_bos,
        )
        take = h.capture_addrs
        self._work_for(take, None)  # the SAE's point too
        try:
            for batch in h.batches():
                caches = await asyncio.gather(*(self._acapture(ids, take) for _, ids in batch))
                h.add(batch, [{str(a): c[a][0] for a in take} for c in caches])
            return h.finish()
        finally:
            h.close()

    def harvest(self, call: calls.Harvest) -> Any:
        return self._aharvest(call)

    # ---- projection -------------------------------------------------------------------------------
    async def _aproject(
        self,
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
    ):
        """Scores computed in the worker (ie_lab/ops/projection.py): only [tokens, k] crosses back. In graph mode
        the point must be declared; the compiled trunk fills its static buffer and the worker projects the rows."""
        from vllm import SamplingParams

        self._refuse_in_generate_mode("project()")
        addr = one_address(self.lm, address)
        width = point_width(addr, self.lm.facts)
        check_served(self.lm, addr)
        if addr.name in RECOMPUTED:  # pragma: no cover - point_width refuses attention patterns first
            raise AddressError(f"address {addr}: attention patterns are not per-token vectors.")
        n_new = check_gen(max_new_tokens, gen)
        enc = make_encoder(width, directions, bias=bias, activation=activation, threshold=threshold, k=k)
        if n_new:
            params = self._params(
                n_new,
                gen.get("temperature", 0.0),
                gen.get("top_k"),
                gen.get("top_p"),
                gen.get("seed"),
                gen.get("stop"),
                0,
                gen.get("ignore_eos", False),
                None if gen.get("ignore_eos", False) else stop_ids_for(self.lm, prompt, set()),  # as generate stops
            )
        else:
            params = SamplingParams(max_tokens=1, temperature=0.0)
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError(
                "prompt: project takes one prompt per call (its scores are [tokens, k]); concurrent "
                "calls are batched by vLLM."
            )
        P = ids.shape[1]
        # the model reads prompt + generated[:-1]; vLLM needs one more free position after what it runs
        self._check_room(P + max(n_new - 1, 0), "a projection")
        _, work = self._work_for(None, steer)
        check_positions_fit(work.specs, P + n_new)
        point = str(addr.without_head())
        work.project = {
            point: {"encoder": to_plain(enc, pack), "head": addr.head, "head_dim": int(self.lm.facts.head_dim)}
        }
        box: dict = {}
        generated: list[int] = []
        async for out in self._request(ids[0].tolist(), params, work, box):
            if n_new:
                generated += [int(t) for t in out.outputs[0].token_ids]  # DELTA outputs
        got = box["collected"].get("project", {}).get(point)
        n_read = P + max(len(generated) - 1, 0)
        if got is None:
            raise RuntimeError(f"ie_lab: the worker returned no scores for {addr}")
        pos, sc = unpack(got["positions"]), unpack(got["scores"]).float()
        if not torch.equal(pos[:n_read], torch.arange(n_read, dtype=pos.dtype)):
            raise RuntimeError(
                f"ie_lab: the worker filed positions {pos.tolist()} for {addr}; expected 0..{n_read - 1}"
            )
        sc = sc[:n_read]  # a position past what the model read is never filed; never hand out a wrong row
        read = torch.cat([ids[0].cpu(), torch.tensor(generated, dtype=ids.dtype)])[:n_read]
        tok = self.lm.tokenizer
        text = tok.decode(generated) if (tok is not None and generated) else ""
        return Projection(addr, sc, read, str_tokens(self.lm, read[None])[0], generated, text)

    def project(self, call: calls.Project) -> Any:
        """Per-token scores [tokens, k] computed in the worker; see docs/PROJECTION.md."""
        return self._aproject(*call.positional(), **call.keywords())

    # ---- generation -------------------------------------------------------------------------------

    def astream(self, token: CancelToken, call: calls.GenerateStream) -> AsyncGenerator:
        return self._astream(token, call, None)

    async def _astream(self, token: CancelToken, call: calls.Generate, box: dict | None) -> AsyncGenerator:
        """The steps of one generation; with `box` (generate()), collected once at the end instead of drained at
        every step. keep_logits is not read: the logits stay in the worker on vLLM."""
        call = fold(call, self.lm)  # splice= travels in steer= from here
        streaming = box is None
        box = {} if box is None else box
        prompt, max_new_tokens, capture, steer = call.prompt, call.max_new_tokens, call.capture, call.steer
        if capture or steer is not None or (self._mode == "generate" and self._entered_specs()):
            self._refuse_in_generate_mode("generation with capture= or steering")
        # every argument is checked before the prompt is even prepared: nothing unchecked reaches the engine
        params = self._params(
            max_new_tokens,
            call.temperature,
            call.top_k,
            call.top_p,
            call.seed,
            call.stop,
            call.n_logprobs,
            call.ignore_eos,
            # a conversation stops at the end of the assistant's turn (vLLM adds these to the model's own EOS)
            None if call.ignore_eos else stop_ids_for(self.lm, prompt, set()),
        )
        n_lp = int(call.n_logprobs)
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError("generate takes one prompt per call; concurrent calls are batched by vLLM.")
        limit = self.lm.facts.max_positions
        if limit and ids.shape[1] + max_new_tokens > int(limit):
            raise InputError(
                f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({shown_value(max_new_tokens)}) exceeds the model's "
                f"context of {limit}; lower max_new_tokens or shorten the prompt."
            )
        if self._len_why and self._max_len and ids.shape[1] + max_new_tokens > self._max_len:  # vLLM would stop early
            raise CapabilityUnsupported(
                f"a generation of {ids.shape[1]} + {max_new_tokens} tokens on backend='vllm'",
                self._len_why,
                f"keep prompt + max_new_tokens within {self._max_len}, or use backend='eager'.",
            )
        addrs, work = self._work_for(capture, steer)
        check_positions_fit(work.specs, ids.shape[1] + max_new_tokens)
        if addrs:  # the follow-up forward that covers the last generated token needs its own free position
            self._check_room(ids.shape[1] + max_new_tokens, "a capture during generation")
        tok = self.lm.tokenizer
        generated: list[int] = []
        reason = "length"
        rows = _StepRows(self, addrs, ids) if (streaming and addrs) else None
        held = None  # the last step waits for the follow-up forward that reads its own token's row
        self._tokens.add(token)
        try:
            tail = (lambda: generated) if addrs else None
            async with contextlib.aclosing(self._request(ids[0].tolist(), params, work, box, tail)) as outs:
                async for out in outs:
                    comp = out.outputs[0]
                    if rows is not None and comp.token_ids:
                        await rows.drain(box["rid"])
                    lps = comp.logprobs or [None] * len(comp.token_ids)
                    for k, (tid, lp) in enumerate(zip(comp.token_ids, lps)):
                        if token.cancelled:
                            return
                        top: dict[str, float] = {}
                        logprob = float("nan")
                        if lp is not None:
                            logprob = float(lp[tid].logprob) if tid in lp else float("nan")
                            ranked = sorted(
                                ((v.rank, j, v.logprob) for j, v in lp.items() if v.rank is not None),
                                key=lambda x: x[0],
                            )
                            top = (
                                {
                                    (tok.decode([j]) if tok is not None else str(j)): float(v)
                                    for r, j, v in ranked[:n_lp]
                                }
                                if n_lp
                                else {}
                            )
                        generated.append(int(tid))
                        step = GenStep(
                            len(generated) - 1,
                            int(tid),
                            tok.decode([tid]) if tok is not None else str(tid),
                            logprob,
                            top,
                            None,
                        )
                        if rows is not None:
                            step.captured = None
                            # step i carries the row of the token fed in to choose it (step 0: the prompt's rows)
                            rows.attach(step, generated)
                            if comp.finish_reason is not None and k == len(comp.token_ids) - 1:
                                held = step
                                continue
                        yield step
                    if comp.finish_reason is not None:
                        reason = {
                            "length": "length",
                            # a stop token id (a chat's turn end) ends like the EOS; a stop string is "stop"
                            "stop": "stop" if isinstance(comp.stop_reason, str) else "eos",
                            "abort": "aborted",
                        }.get(comp.finish_reason, comp.finish_reason)
                    await asyncio.sleep(0)
                    if token.cancelled:
                        return
        finally:
            self._tokens.discard(token)
        if held is not None and rows is not None:  # held is only set where rows are drained
            rows.finish(held, generated, box.get("collected", {}))
            yield held
        box["ids"] = generated
        box["reason"] = reason
        if addrs and "collected" in box and not streaming:
            box["captured"] = self._assemble(addrs, box["collected"])

    async def _agenerate(self, call: calls.Generate):
        box: dict = {}
        token = CancelToken()
        steps = [s async for s in self._astream(token, call, box)]
        ids = self._ids(call.prompt)
        gen_ids = box.get("ids", [s.token_id for s in steps])
        tok = self.lm.tokenizer
        text = tok.decode(gen_ids) if tok is not None else " ".join(map(str, gen_ids))
        cache = None
        if "captured" in box:
            full = torch.cat([ids, torch.tensor([gen_ids], dtype=ids.dtype)], dim=1)
            cache = Cache(box["captured"], tokens=full, str_tokens=str_tokens(self.lm, full))
        return GenerationResult(ids, gen_ids, text, steps, box.get("reason", "length"), cache)

    def generate(self, call: calls.Generate) -> Any:
        """Generate to the end. A capture covers prompt + every generated token, as on eager."""
        return self._agenerate(call)

    # ---- lens, attention --------------------------------------------------------------------------
    async def _alogit_lens(
        self,
        prompt: Any,
        layers: Sequence[int] | None = None,
        *,
        k: int = 5,
        point: str = "resid_post",
        transports: Any = None,
        keep_logits: bool = False,
    ):
        from vllm import SamplingParams

        self._refuse_in_generate_mode("the logit lens")
        if self._graph is not None:
            self._refuse_in_graph_mode("the logit lens")
        if transports or keep_logits:
            raise CapabilityUnsupported(
                "logit_lens(transports=..., keep_logits=True) on backend='vllm'",
                "the read-out runs inside the worker and only the top-k crosses back; "
                "transports and full logits need the residual itself.",
                "capture the points and decode them on backend='eager'.",
            )
        p = _points.get(point)
        if p.width is not Width.D_MODEL or p.scope is not Scope.LAYER:
            raise AddressError(f"a lens decodes d_model-wide per-layer points; {point} is {p.width.value} wide.")
        vocab = self.lm.facts.vocab_size
        # refused here, as on eager: a k past the vocabulary would reach torch's topk inside the worker
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (vocab and k > vocab):
            raise InputError(
                f"k (how many top tokens per cell) must be an integer from 1 to the vocabulary size {vocab}, "
                f"got {shown_value(k)}."
            )
        layers = layer_list(layers, self.lm.facts)
        for L in layers:
            check_served(self.lm, Address(point, L).check(self.lm.facts))
        ids = self._ids(prompt)
        if ids.shape[0] != 1:
            raise InputError("logit_lens takes one prompt.")
        self._check_room(ids.shape[1], "a logit lens")
        work = _Work([], [], [], {"point": point, "layers": layers, "k": k})
        box: dict = {}
        async for _ in self._request(ids[0].tolist(), SamplingParams(max_tokens=1, temperature=0.0), work, box):
            pass
        res = box["collected"]["lens"]
        top_ids = torch.stack([unpack(res[L]["ids"]) for L in layers])
        top_probs = torch.stack([unpack(res[L]["probs"]) for L in layers])
        tok = self.lm.tokenizer
        names = token_names(tok, top_ids.tolist())
        return LensResult(
            layers,
            point,
            str_tokens(self.lm, ids)[0],
            top_ids,
            top_probs,
            names,
            describe_postprocess(self.lm.facts) + "; read out inside the vLLM worker",
        )

    def logit_lens(self, call: calls.LogitLens) -> Any:
        return self._alogit_lens(*call.positional(), **call.keywords())

    async def _aattention(self, prompt: Any, layers: Any = None):
        self._refuse_in_generate_mode("attention()")
        layers = list(range(self.lm.facts.n_layers)) if layers is None else [int(x) for x in layers]
        scored = self.lm.family not in quirks.VLLM_SCORES_UNCHECKED
        c: Any = await self._acapture(
            prompt,
            [f"attn_probs.{L}" for L in layers]
            + [f"value.{L}" for L in layers]
            + ([f"attn_scores.{L}" for L in layers] if scored else []),
        )
        if c.tokens.shape[0] != 1:
            raise CapabilityUnsupported("attention() on a batch", "the viewer shows one prompt.", "call it per prompt.")
        kv, d = self.lm.facts.n_kv_heads, self.lm.facts.head_dim
        notes = ["rebuilt from the post-RoPE q and k the paged-attention kernel received"]
        if not scored:  # as eager does on these families: probabilities only, and why
            notes.append(
                f"scores unavailable: transformers' {self.lm.family} never hands out pre-softmax scores "
                "to check them against"
            )
        return AttentionResult(
            layers,
            c.str_tokens[0],
            {L: c[f"attn_probs.{L}"][0] for L in layers},
            {L: c[f"attn_scores.{L}"][0] if scored else None for L in layers},
            {L: c[f"value.{L}"][0].reshape(-1, kv, d) for L in layers},
            notes,
        )

    def attention(self, call: calls.Attention) -> Any:
        return self._aattention(call.prompt, call.layers)
