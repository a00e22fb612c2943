"""EagerBackend: the Backend protocol (ie_lab/backend.py) on transformers' own model, in this process.

Every operation returns a plain function of no arguments; the Session computes it holding its operation lock
(a plain call on the caller's thread, an awaited twin on the loop thread) and adds `add_cancel_hooks` around it.
The steering of the caller's context (`with spec:` blocks, then steer=) is read when the function is made, that
is where the call is issued, not where it computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from ..address import Address
from ..backend import OperationCancelled, SessionClosed
from ..capabilities import require
from ..core import calls
from ..core.addresses import parse_addresses
from ..core.inputs import prepare, prepare_prompts
from ..core.load_checks import check_tokenizer_arg, pick_device, resolve_dtype
from ..core.splice_spec import wants_acts
from ..core.steer_spec import issued_specs
from ..errors import InputError, plural
from ..points_table import PointsTable
from .attention import attention
from .attribution import logit_attribution
from .batcher import (
    BatchedCall,
    BatchedCapture,
    BatchedStream,
    Batcher,
    CaptureRequest,
    GradRequest,
    Request,
    shareable,
)
from .capture import capture
from .generate import generate, generate_stream, plan
from .grad_support import grad_support
from .harvest import harvest
from .jacobian_lens import fit_jacobian_lens
from .lens import logit_lens
from .loading import load
from .means import auto_batch_size, mean_difference
from .model import lm_of
from .patching import gradients, patch, patch_sweep
from .points_table import points_table
from .project import project
from .splice import capture_with_acts, folded, keywords, make_splice
from .steer import make_spec, run_issued
from .taps import resolve
from .writers import WRITABLE, Writers


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise InputError(
            f"run() takes a function of the model handle, e.g. s.run(lambda lm: ...); got {type(fn).__name__}."
        )


_REQUEST_ARGS = frozenset(("temperature", "top_k", "top_p", "n_logprobs", "keep_logits"))


def compute(model: Any, call: calls.Record) -> Any:
    """One operation's record computed on an eager model, on this thread, by itself (no batch, no lock): what
    the free functions run (`ie_lab.capture(lm, ...)` builds the record and calls this) and what EagerBackend runs
    for a call it does not batch. A generation's steering, and capture's, is read here, where it is issued."""
    lm = lm_of(model)
    call = folded(call, lm)  # splice= travels in steer= from here (eager/splice.py)
    if isinstance(call, calls.Capture):
        specs = issued_specs(lm, call.steer)  # the `with` blocks open in this context, then steer=
        read = capture_with_acts if wants_acts(call.addresses) else capture
        return run_issued(lm, specs, lambda: read(lm, call.tokens_or_text, call.addresses, grad=call.grad))
    if isinstance(call, calls.GenerateStream):
        kw = keywords(call)
        kw["steer"] = issued_specs(lm, call.steer)  # read now, where the stream is issued, not at its first step
        return generate_stream(lm, call.prompt, call.max_new_tokens, **kw)
    if isinstance(call, calls.Generate):
        return generate(lm, call.prompt, call.max_new_tokens, **keywords(call))
    if isinstance(call, calls.Run):
        _check_callable(call.fn)
        return call.fn(lm)
    return _COMPUTE[type(call)](lm, *call.positional(), **call.keywords())


_COMPUTE: dict[type, Callable[..., Any]] = {
    calls.Attention: attention,
    calls.LogitLens: logit_lens,
    calls.Project: project,
    calls.Patch: patch,
    calls.PatchSweep: patch_sweep,
    calls.Gradients: gradients,
    calls.FitJacobianLens: fit_jacobian_lens,
    calls.MeanDifference: mean_difference,
    calls.Harvest: harvest,
    calls.LogitAttribution: logit_attribution,
}


class EagerBackend:
    name = "eager"
    on_loop = False
    thread_name = "ie_lab-session"
    extras: tuple[str, ...] = ()
    collect_on_close = False

    def __init__(
        self,
        model: Any,
        device: Any = None,
        dtype: Any = None,
        tokenizer: Any = None,
        *,
        trust_remote_code: bool = False,
        progress: bool = True,
    ):
        # Bad arguments fail here, in the caller's thread, before a thread starts or the model is touched.
        resolve_dtype(dtype)
        check_tokenizer_arg(tokenizer)
        if device is not None:
            pick_device(device, announce=False)
        self._args = (model, tokenizer, device, dtype, trust_remote_code, progress)
        self.lm: Any = None
        self._batcher: Batcher | None = None  # concurrent single-prompt generations share one decode loop

    # ---- lifecycle ------------------------------------------------------------------------------
    def attach(self, session: Any) -> None:
        pass  # nothing of the session is needed: the Session computes these functions itself

    def load(self) -> Callable[[], Any]:
        model, tokenizer, device, dtype, trust_remote_code, progress = self._args

        def load_model():
            with tqdm(total=2, desc="loading model", disable=not progress, leave=False) as bar:
                lm = load(
                    model,
                    tokenizer,
                    backend="eager",
                    device=device,
                    dtype=dtype,
                    trust_remote_code=trust_remote_code,
                    quiet=False,
                )
                bar.update(2)
            self.lm = lm
            # where padding could change what a prompt computes, requests run one at a time as before
            self._batcher = Batcher(lm) if shareable(lm) else None
            return lm

        return load_model

    def stop(self) -> None:
        pass

    def close(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close(SessionClosed("this Session was closed; create a new one: Session(...)."))
        lm, self.lm = self.lm, None  # the backend's reference goes; memory follows unless the caller holds the model
        if hasattr(lm, "release"):
            lm.release()  # the caller's model object goes back in the training mode it came in

    def add_cancel_hooks(self, token: Any) -> list:
        """Layer pre-hooks that stop a forward at the next layer once the token is cancelled."""

        batcher = self._batcher

        def check(mod, args):
            # A batched forward also computes other requests: it stops half-way only if all of them are
            # cancelled; otherwise the batch drops this one at the next step boundary.
            if token.cancelled and (batcher is None or batcher.may_stop_forward()):
                raise OperationCancelled("interrupted")

        handles = []
        for lb in self.lm.binding.layers:
            handles.append(lb.layer.register_forward_pre_hook(check))
        return handles

    def require(self, capability: str) -> None:
        require(capability, self.name)  # this backend's column of the table

    # ---- operations: each returns the function the Session computes -------------------------------
    def _steered(self, steer: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
        """fn carrying the steering of the caller's context, read now, where the request is issued: the
        `with s.steer(...)` blocks open in this task or thread, then steer= (docs/STEERING.md, Scope)."""
        lm = self.lm
        specs = issued_specs(lm, steer)
        return lambda: run_issued(lm, specs, fn)

    def issued(self, steer: Any) -> Any:
        return issued_specs(self.lm, steer)

    def capture(self, call: calls.Capture):
        lm = self.lm
        call = folded(call, self.lm)
        if wants_acts(call.addresses):  # a spliced SAE's features: read on its own, from this call's forward
            if prepare_prompts(lm, call.tokens_or_text) is None:  # bad input is refused here, before it queues
                prepare(lm, call.tokens_or_text)
            return self._steered(
                call.steer, lambda: capture_with_acts(lm, call.tokens_or_text, call.addresses, grad=call.grad)
            )
        batched = self._capture_request(call)
        if batched is not None:
            return batched
        if prepare_prompts(lm, call.tokens_or_text) is None:  # bad input is refused here, before the call queues
            prepare(lm, call.tokens_or_text)
        return self._steered(call.steer, lambda: capture(lm, call.tokens_or_text, call.addresses, grad=call.grad))

    def _capture_request(self, call: calls.Capture) -> Any:
        """A capture as requests (one per prompt of a list) that are read together with the captures queued
        meanwhile (ie_lab/eager/batcher.py), checked now (every prompt read, points and steering resolved, so no
        request can fail another's forward); None where it runs on its own: a [batch, seq] tensor (one batch,
        one Cache), a model that cannot pad, and grad=True: the caller's own backward would free the saved
        tensors of a shared graph (a neighbour's backward then fails) and one Cache would keep every neighbour's
        activations alive; concurrent gradients() calls, whose backward is the operation's own, do share one
        forward and backward (Batcher.gradients)."""
        batcher = self._batcher
        if batcher is None or call.grad is not False:
            return None
        lm = self.lm
        addrs = parse_addresses(lm, call.addresses)
        if any(a.name in ("mixer_state", "mixer_conv_state") for a in addrs):
            return None  # read from the cache of a forward of its own (eager.mixer_state), not by the batch's hooks
        many = prepare_prompts(lm, call.tokens_or_text)
        if many is not None:
            prompts: list[tuple[Any, Any]] = [(ids, None) for ids in many]
        else:
            ids, mask = prepare(lm, call.tokens_or_text)
            if ids.shape[0] != 1:
                return None
            prompts = [(ids, mask)]
        specs = list(issued_specs(lm, call.steer))
        for a in {a.without_head() for a in addrs} | {a for sp in specs for a in sp.addresses}:
            resolve(lm, a)  # an absent point is refused here, in the caller's words
        reqs = [CaptureRequest(ids, mask, addrs, specs) for ids, mask in prompts]
        return BatchedCapture(batcher, reqs, lambda width, points: auto_batch_size(lm, width, points), many is not None)

    def generate(self, call: calls.Generate):
        lm = self.lm
        call = folded(call, self.lm)
        call = call.replace(steer=self.issued(call.steer))
        batcher, reqs, batch = self._request(call, stream=False)
        if batcher is not None:
            return BatchedCall(batcher, reqs, batch)
        return lambda: generate(lm, call.prompt, call.max_new_tokens, **keywords(call))

    def stream(self, call: calls.GenerateStream) -> Iterator:
        call = folded(call, self.lm)
        batcher, reqs, _ = self._request(call, stream=True)
        if batcher is not None:
            return BatchedStream(batcher, reqs)
        return generate_stream(self.lm, call.prompt, call.max_new_tokens, **keywords(call))

    def _request(self, call: calls.Generate, stream: bool) -> tuple[Batcher | None, list[Request], bool]:
        """A generation as requests of the shared batch (ie_lab/eager/batcher.py), one per prompt of a list, each
        with that prompt's seed and the call's steering, captures, stops and length; checked now, every prompt
        before any request is queued. No batcher where it runs on its own: a model that cannot pad."""
        batcher = self._batcher
        if batcher is None:
            return None, [], False
        kwargs = keywords(call)
        p = plan(self.lm, call.prompt, call.max_new_tokens, **kwargs)
        own = {k: v for k, v in kwargs.items() if k in _REQUEST_ARGS}
        reqs = [
            Request(
                replace(p, rows=[row], seeds=[seed], batch=False), call.max_new_tokens, stream=stream, index=i, **own
            )
            for i, (row, seed) in enumerate(zip(p.rows, p.seeds))
        ]
        return batcher, reqs, p.batch

    def check_printable(self, prompt: Any) -> None:
        if prepare_prompts(self.lm, prompt, rows=True) is not None:
            raise InputError(
                "print_tokens=True prints one prompt's stream; for a list of prompts, loop over "
                "s.generate_stream(prompts) and print step.token by step.prompt_index."
            )

    def attention(self, call: calls.Attention):
        return self._steered(None, lambda: compute(self.lm, call))

    def logit_lens(self, call: calls.LogitLens):
        return self._steered(None, lambda: compute(self.lm, call))

    def project(self, call: calls.Project):
        lm = self.lm
        call = call.replace(steer=self.issued(call.steer))  # read now, where it is issued
        return lambda: compute(lm, call)

    def patch(self, call: calls.Patch):
        return self._steered(None, lambda: compute(self.lm, call))

    def patch_sweep(self, call: calls.PatchSweep):
        return self._steered(None, lambda: compute(self.lm, call))

    def mean_difference(self, call: calls.MeanDifference):
        return self._steered(None, lambda: compute(self.lm, call))

    def harvest(self, call: calls.Harvest):
        return self._steered(None, lambda: compute(self.lm, call))

    def fit_jacobian_lens(self, call: calls.FitJacobianLens):
        return self._steered(None, lambda: compute(self.lm, call))

    def logit_attribution(self, call: calls.LogitAttribution):
        return self._steered(None, lambda: compute(self.lm, call))

    def gradients(self, call: calls.Gradients):
        batched = self._gradients_request(call.prompt, call.metric, call.addresses, call.of)
        if batched is not None:
            return batched
        return self._steered(None, lambda: compute(self.lm, call))

    def _gradients_request(self, prompt: Any, metric: Any, addresses: Any, of: Any) -> Any:
        """A one-prompt, unsteered gradients() as a request computed together with those queued meanwhile, in one
        forward and one backward (Batcher._grad_group), checked now; None where it runs on its own: a list or a
        batch tensor, steering open where it was issued (a steering edit and a derivative probe at the same
        point would have to keep the solo order), anything gradients() itself refuses (in its own words)."""
        batcher, lm = self._batcher, self.lm
        if batcher is None or not callable(metric) or issued_specs(lm, None):
            return None
        addrs = parse_addresses(lm, addresses)
        if any(a.name not in WRITABLE for a in addrs) or prepare_prompts(lm, prompt) is not None:
            return None
        ids, mask = prepare(lm, prompt)
        if ids.shape[0] != 1:
            return None
        measured = parse_addresses(lm, of) if of is not None else []
        Writers(lm, [(a, lambda t, off: t) for a in addrs])  # refuses what it cannot write, before any forward
        for a in {a.without_head() for a in [*addrs, *measured]}:
            resolve(lm, a)  # an absent point is refused here, in the caller's words
        req = GradRequest(ids, mask, addrs, measured, isinstance(of, (str, Address)), metric)

        def rows_for(width: int, points: int) -> int:
            # the backward needs every layer's activations kept: one layer's budget shared by all layers
            return max(1, auto_batch_size(lm, width, points) // max(1, lm.facts.n_layers))

        return BatchedCapture(batcher, [req], rows_for, False)

    def run(self, call: calls.Run):
        _check_callable(call.fn)
        lm = self.lm
        return self._steered(None, lambda: call.fn(lm))

    def steer(self, address: Any, vector: Any, method: str = "add", **kwargs: Any):
        return make_spec(self.lm, address, vector, method=method, **kwargs)

    def splice(self, sae: Any, *, error: bool = False):
        return make_splice(self.lm, sae, error=error)

    # ---- facts and reprs ------------------------------------------------------------------------
    def raw_model(self) -> Any:
        return self.lm.hf

    def describe(self) -> str:
        f, st = self.lm.facts, self.lm.binding.structure
        kinds = sorted(set(f.layer_kinds))
        parts = [
            f"{f.model_type}: {plural(f.n_layers, 'layer')}, d_model {f.d_model}, {plural(f.n_heads, 'head')} x "
            f"{f.head_dim} ({plural(f.n_kv_heads, 'key/value head')}), d_mlp {f.d_mlp}, vocabulary {f.vocab_size}.",
            f"Attention: {', '.join(kinds)}" + (f" (window {f.sliding_window})" if f.sliding_window else "") + ".",
            "Block: "
            + ("parallel attention + MLP" if st["parallel_block"] else "sequential")
            + (
                ", sandwich norms"
                if st["sandwich_norms"] and st["pre_norms"]
                else ", post-sublayer norms only"
                if st["sandwich_norms"]
                else ", pre-norms"
            )
            + (", gated MLP" if st["gated_mlp"] else "")
            + (", QK-norm" if st["qk_norm"] else "")
            + (f", MoE on layers {list(st['moe_layers'])}" if st["moe_layers"] else "")
            + ".",
            # what the binder measured that the points' definitions do not say (RWKV's stream norm, rescaling, ...)
            *(f"Note: {n[0].upper()}{n[1:]}" for n in self.lm.binding.notes),
        ]
        return " ".join(parts)

    def points(self) -> PointsTable:
        return points_table(self.lm)

    def grad_support(self) -> Any:
        return grad_support(self.lm)

    def summary(self) -> str:
        f = self.lm.facts
        return (
            f"backend=eager, family={f.model_type}, layers={f.n_layers}, d_model={f.d_model}, "
            f"device={self.lm.device.type}, dtype={str(self.lm.dtype).replace('torch.', '')}"
        )

    def headline(self) -> str:
        return f"backend eager, {self.describe()}"


__all__ = ["EagerBackend", "compute"]
