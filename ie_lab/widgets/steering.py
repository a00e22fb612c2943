"""The live steering panel: ``session.steering_panel(prompt, address=..., vector=...)``.

Baseline (unsteered) and steered continuations side by side. Moving a control sends one ``steer``
command (the front end debounces); the kernel validates it, cancels the generation in flight and
starts a new one on the session's loop, streaming tokens back as they are produced. The finished
text is stored in traits, so ``panel.steered_text`` in the kernel and a saved notebook agree with the
screen. The vector comes from a difference of means of two prompt lists, a saved tensor (or a path
to a .pt / .npy file), or a capture.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
import traitlets

from ..address import Address
from ..errors import AddressError, IELabError, InputError, plural
from ..ops.steering import METHOD_HELP, METHODS
from ..points import all_points
from ..sizing import GIB, batch_size_for
from . import _base, _static
from .steering_vector import load_vector, mean_difference_source
from .token_pieces import TokenPieces

STEERABLE = tuple(p.name for p in all_points() if p.steerable and not p.multi_stream_only)
MAX_NEW_TOKENS = 256
# The defaults a panel opens at when the caller names no address or coefficient: a difference of means added a
# quarter of the way into the model, 8 times over. Steering acts on the features a model has built by then and
# still leaves it layers to write fluent text; on the demo model (4 layers) that is resid_post.0, where 8 turns all
# of 40 held-out sad stories happy and breaks none, while the middle layer at 4 turned none of them
# (tests/test_demo_model_defaults.py holds it).
DEFAULT_SCALE = 8.0


def default_address(n_layers: int) -> Address:
    """resid_post of the layer a quarter of the way in (0 on models of up to 4 layers)."""
    return Address("resid_post", max(0, (n_layers - 1) // 4))


_N = _base.number(-1e6, 1e6)


class SteeringPanel(_base.Panel):
    """Baseline vs steered text; method, coefficient and caps as controls; tokens stream in."""

    _esm = _static.bundle("steering.js")
    COMMANDS = {
        "steer": {
            "seq": _base.integer(0, 1 << 40),
            "method": _base.choice(METHODS),
            "scale": _N,
            "cap_min": _N,
            "cap_max": _N,
            "target": _N,
        },
        "address": {"seq": _base.integer(0, 1 << 40), "address": _base.text(80)},
        "contrast": {"seq": _base.integer(0, 1 << 40), "positive": _base.text_list(), "negative": _base.text_list()},
        "prompt": {"seq": _base.integer(0, 1 << 40), "prompt": _base.text(4000)},
        "cancel": {},
    }
    OPTIONAL = frozenset({"method", "scale", "cap_min", "cap_max", "target"})

    prompt = traitlets.Unicode("").tag(sync=True)
    address = traitlets.Unicode("").tag(sync=True)
    n_layers = traitlets.Int(1).tag(sync=True)
    # the steerable points this model has (on at least one layer), and per point on which layers ("1"/"0" each)
    points = traitlets.List(traitlets.Unicode(), list(STEERABLE)).tag(sync=True)
    point_layers = traitlets.Dict().tag(sync=True)
    methods = traitlets.List(traitlets.Unicode(), list(METHODS)).tag(sync=True)
    method_help = traitlets.Dict(dict(METHOD_HELP)).tag(sync=True)  # ie_lab/ops/steering.py: one sentence each
    method = traitlets.Unicode("add").tag(sync=True)
    scale = traitlets.Float(DEFAULT_SCALE).tag(sync=True)
    cap_min = traitlets.Float(-1.0).tag(sync=True)
    cap_max = traitlets.Float(1.0).tag(sync=True)
    target = traitlets.Float(0.0).tag(sync=True)
    scale_range = traitlets.List(traitlets.Float(), [-10.0, 10.0, 0.1]).tag(sync=True)
    proj_range = traitlets.List(traitlets.Float(), [-10.0, 10.0, 0.1]).tag(sync=True)
    max_new_tokens = traitlets.Int(24).tag(sync=True)
    vector_source = traitlets.Unicode("none").tag(sync=True)
    positive = traitlets.List(traitlets.Unicode()).tag(sync=True)
    negative = traitlets.List(traitlets.Unicode()).tag(sync=True)
    baseline = traitlets.List(traitlets.Unicode()).tag(sync=True)
    baseline_ids = traitlets.List(traitlets.Int()).tag(sync=True)
    steered = traitlets.List(traitlets.Unicode()).tag(sync=True)
    steered_ids = traitlets.List(traitlets.Int()).tag(sync=True)
    seq = traitlets.Int(0).tag(sync=True)
    # ready | no vector (nothing to steer with yet) | generating | vector (computing one) | error
    status = traitlets.Unicode("ready").tag(sync=True)
    has_vector = traitlets.Bool(False).tag(sync=True)  # the front end disables the knobs until there is one
    progress = traitlets.List(traitlets.Int(), [0, 0]).tag(sync=True)  # [prompts captured, of] while status == vector
    var_name = traitlets.Unicode("s").tag(sync=True)  # the session's variable in the code the panel shows
    # Activation memory one forward of the vector job may take (its batches are sized from it by ie_lab.sizing);
    # fixed, as ie_lab.mean_difference's default, so the batch split is reproducible.
    VECTOR_BUDGET_BYTES = 1 * GIB

    def __init__(
        self,
        session: Any,
        prompt: str,
        *,
        address: Any = None,
        vector: Any = None,
        positive: Sequence[str] | None = None,
        negative: Sequence[str] | None = None,
        method: str = "add",
        scale: float = DEFAULT_SCALE,
        cap_min: float | None = None,
        cap_max: float | None = None,
        target: float = 0.0,
        max_new_tokens: int = 24,
        scale_range: tuple[float, float] = (-10.0, 10.0),
        var_name: str | None = None,
    ):
        if method not in METHODS:
            raise InputError(f"unknown steering method {method!r}; choose one of {', '.join(METHODS)}.")
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise InputError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens!r}.")
        lo, hi = (float(x) for x in scale_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise InputError(f"scale_range must be two finite numbers, low < high; got {scale_range!r}.")
        self._session = session
        self._check_prompt(prompt, max_new_tokens)
        facts = session.facts
        addr = Address.parse(address) if address is not None else default_address(facts.n_layers)
        self._check_address(addr, facts)
        # offered: only the points this model has (the picker's verdicts), not every steerable name in the registry
        self._served = {n: v for n, v in session.served_layers().items() if n in STEERABLE and "1" in v[0]}
        self._check_served(addr)
        self._vector: torch.Tensor | None = None
        self._lock = threading.RLock()
        self._active: object | None = None  # the job allowed to commit results; a newer command replaces it
        self._future: concurrent.futures.Future | None = None
        self._done = threading.Event()
        self._done.set()
        super().__init__(
            prompt=prompt,
            address=str(addr),
            n_layers=facts.n_layers,
            method=method,
            scale=float(scale),
            target=float(target),
            max_new_tokens=max_new_tokens,
            scale_range=[lo, hi, (hi - lo) / 200],
            var_name=_base.var_name(session, var_name, "s"),
            points=[n for n in STEERABLE if n in self._served],
            point_layers={n: v[0] for n, v in self._served.items()},
        )
        if vector is not None:
            self._vector, self.vector_source = load_vector(vector, addr)
            self._check_vector()
        elif positive is not None or negative is not None:
            self.set_contrast(list(positive or []), list(negative or []), regenerate=False)
        self.has_vector = self._vector is not None
        self._set_ranges(cap_min, cap_max)
        self._generate_now()

    # ---- checks and derived values ----------------------------------------------------------------
    @staticmethod
    def _check_address(addr: Address, facts: Any) -> None:
        addr.check(facts)
        if addr.name not in STEERABLE or addr.head is not None or addr.stream is not None:
            raise AddressError(f"{addr} cannot be steered: choose a per-layer d_model point ({', '.join(STEERABLE)}).")

    def _check_served(self, addr: Address) -> None:
        """The point is one this model has at that layer (the picker's verdict and reason otherwise)."""
        v = self._served.get(addr.name)
        L = addr.layer or 0
        if v is None or v[0][L] != "1":
            why = v[1].get(str(L), "") if v is not None else f"{self._session.facts.model_type} has no such tensor."
            offered = ", ".join(n for n in STEERABLE if n in self._served)
            raise AddressError(f"{addr} cannot be steered on this model: {why} Points it has: {offered}.")

    def _check_prompt(self, prompt: Any, max_new_tokens: int | None = None) -> None:
        """A prompt the model can continue by max_new_tokens; refused here, before it replaces the current one."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError("the steering panel needs a non-empty text prompt.")
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        ids = self._session.tokens(prompt)  # refuses a prompt over the model's context itself
        n = ids.shape[-1]
        if not hasattr(self, "_prompt_ids"):
            self._prompt_ids: dict[str, list[int]] = {}
        if len(self._prompt_ids) > 8:  # the current prompt and a few earlier ones (a refused prompt puts one back)
            self._prompt_ids.pop(next(iter(self._prompt_ids)))
        self._prompt_ids[prompt] = ids.reshape(-1)[-4:].tolist()
        limit = self._session.facts.max_positions
        if limit and n + new > int(limit):
            raise InputError(
                f"the prompt has {plural(n, 'token')}; with max_new_tokens={new} that is over the model's "
                f"context of {limit} tokens: shorten the prompt to at most {int(limit) - new} tokens."
            )

    def _check_contrast(self, positive: Sequence[str], negative: Sequence[str]) -> tuple[list[str], list[str]]:
        pos, neg = [p for p in positive if p.strip()], [n for n in negative if n.strip()]
        if not pos or not neg:
            raise InputError("a difference of means needs at least one prompt on each side.")
        for p in pos + neg:
            self._session.tokens(p)  # over the context: refused before any capture
        return pos, neg

    def _check_vector(self) -> None:
        d = self._session.facts.d_model
        v = self._vector
        if v is None:
            return
        if v.dim() != 1 or v.shape[0] != d or not torch.isfinite(v).all():
            self._vector = None
            raise InputError(f"the steering vector must be finite and d_model = {d} wide, got shape {list(v.shape)}.")

    def _set_ranges(self, cap_min: float | None = None, cap_max: float | None = None) -> None:
        """Slider ranges for cap/swap from the prompt's own projections on the direction."""
        if self._vector is None or float(self._vector.norm()) == 0:
            return
        h = self._session.capture(self.prompt, [self.address])[self.address][0]
        self._apply_ranges(self._ranges(self._vector, h, cap_min, cap_max))

    @staticmethod
    def _ranges(
        vector: torch.Tensor, h: torch.Tensor, cap_min: float | None = None, cap_max: float | None = None
    ) -> dict[str, Any] | None:
        if float(vector.norm()) == 0:
            return None
        proj = h.float().cpu() @ (vector / vector.norm())
        span = max(1e-3, float(proj.abs().max()) * 2)
        mag = 10 ** math.floor(math.log10(span))
        span = math.ceil(span / mag) * mag
        lo = float(proj.min()) if cap_min is None else float(cap_min)
        hi = float(proj.max()) if cap_max is None else float(cap_max)
        return {"proj_range": [-span, span, span / 100], "cap_min": round(lo, 4), "cap_max": round(hi, 4)}

    def _apply_ranges(self, ranges: dict[str, Any] | None) -> None:
        if ranges is not None:
            self.proj_range = ranges["proj_range"]
            self.cap_min, self.cap_max = ranges["cap_min"], ranges["cap_max"]

    def _spec(self) -> Any:
        if self._vector is None:
            return None
        kw: dict[str, Any] = {"method": self.method}
        if self.method in ("add", "orthogonal", "norm_scaled_add"):
            kw["scale"] = self.scale
        elif self.method == "cap":
            kw.update(min=self.cap_min, max=self.cap_max)
        elif self.method == "swap":
            kw["target"] = self.target
        return self._session.steer(self.address, self._vector, **kw)

    def _idle_status(self) -> str:
        # without a vector the steered text is the baseline: say so rather than "ready"
        return "ready" if self._vector is not None else "no vector"

    @property
    def vector(self) -> torch.Tensor | None:
        return None if self._vector is None else self._vector.clone()

    @property
    def baseline_text(self) -> str:
        return self._decode(self.baseline_ids, self.baseline)

    @property
    def steered_text(self) -> str:
        return self._decode(self.steered_ids, self.steered)

    def _decode(self, ids: list[int], toks: list[str]) -> str:
        tok = self._session.tokenizer
        return tok.decode(ids) if tok is not None else "".join(toks)

    # ---- generation ---------------------------------------------------------------------------------
    def _pieces(self) -> TokenPieces:
        # the prompt's ids as _check_prompt read them (on the kernel's thread): a job on the session's loop must not
        # call back into the session (a remote one would wait on that loop)
        return TokenPieces(self._session.tokenizer, self._prompt_ids.get(self.prompt, []))

    def _generate_now(self) -> None:
        """Synchronous baseline + steered (construction and Python-side calls); no streaming."""
        s = self._session
        spec = self._spec()
        if spec is None:
            b = s.generate(self.prompt, self.max_new_tokens, keep_logits=False)
            steps = b.steps
        else:
            stream = s.generate_stream(self.prompt, self.max_new_tokens, steer=spec, keep_logits=False)
            steps = [next(stream)]
            # queued while the steered stream holds the model, so the baseline joins its batch (eager)
            base = s.submit(s.agenerate(self.prompt, self.max_new_tokens, keep_logits=False))
            try:
                steps += list(stream)
                b = base.result()
            except BaseException:
                base.cancel()  # an interrupt or an error: the baseline leaves the batch too
                raise
        bp, sp = self._pieces(), self._pieces()
        with self.hold_sync():
            self.baseline = [bp.add(st.token_id, st.token) for st in b.steps]
            self.baseline_ids = list(b.ids)
            self.steered = [sp.add(st.token_id, st.token) for st in steps]
            self.steered_ids = [st.token_id for st in steps]
            self.status = self._idle_status()

    async def _job(self, seq: int, spec: Any, baseline: bool, previous_prompt: str | None = None) -> None:
        """The steered continuation (and with `baseline`, the unsteered one beside it), streamed token by token.

        The baseline stream starts once the steered one has its first token, so it joins that stream's batch at
        the next step (eager: one decode loop for both, each stream handed its steps as the loop produces them;
        vLLM batches concurrent requests itself): both texts grow side by side. A newer command cancels this job,
        and the baseline stream with it, so neither stale request stays in the batch."""
        s = self._session
        base: asyncio.Future | None = None
        btoks: list[str] = []
        bids: list[int] = []

        async def stream_baseline() -> None:
            pieces = self._pieces()
            async for st in s.agenerate_stream(self.prompt, self.max_new_tokens, keep_logits=False):
                btoks.append(pieces.add(st.token_id, st.token))
                bids.append(st.token_id)
                self.send({"type": "token", "seq": seq, "which": "baseline", "token": btoks[-1], "id": st.token_id})

        try:
            pieces = self._pieces()
            self.send({"type": "start", "seq": seq, "baseline": baseline})
            toks, ids = [], []
            async for st in s.agenerate_stream(
                self.prompt, self.max_new_tokens, keep_logits=False, **({"steer": spec} if spec is not None else {})
            ):
                if baseline and base is None:
                    base = asyncio.ensure_future(stream_baseline())
                toks.append(pieces.add(st.token_id, st.token))
                ids.append(st.token_id)
                self.send({"type": "token", "seq": seq, "which": "steered", "token": toks[-1], "id": st.token_id})
            if base is not None:
                await base
                self.baseline, self.baseline_ids = btoks, bids
            with self.hold_sync():
                self.steered, self.steered_ids = toks, ids
                self.seq = seq
                self.status = self._idle_status()
                self.error = ""
            self.send({"type": "done", "seq": seq})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - shown in the panel
            if previous_prompt is not None:
                self.prompt = previous_prompt  # a prompt the model cannot continue must not break later commands
            self._fail(seq, e)
        finally:
            if base is not None and not base.done():
                base.cancel()  # a newer command: the stale baseline stream leaves the batch too
            self._done.set()

    def _fail(self, seq: int, e: Exception) -> None:
        self.error = str(e) if isinstance(e, IELabError) else f"{type(e).__name__}: {e}"
        self.status = "error"
        self.send({"type": "error", "seq": seq, "message": self.error})

    async def _vector_job(self, job: object, seq: int, pos: list[str], neg: list[str], address: str) -> None:
        """A difference of means in memory-bounded batches on the session's loop, then the steered text.

        The kernel's shell is free meanwhile (128 prompts take seconds on a real model); progress is the
        ``progress`` trait, moved once per batch, and a newer command or close() cancels it between two batches.
        Nothing is committed (vector, address, lists, ranges) unless it finishes while still the newest job.
        """
        s = self._session
        total = len(pos) + len(neg)
        try:
            rows = self._batch_rows(pos + neg)
            means = []
            done = 0
            for side in (pos, neg):
                per_prompt: list[torch.Tensor] = []
                for i in range(0, len(side), rows):
                    batch = side[i : i + rows]
                    per_prompt += await self._prompt_means(batch, address)
                    done += len(batch)
                    with self._lock:
                        live = self._active is job
                    if live:  # set outside the lock: an observer of progress may take its time
                        self.progress = [done, total]
                    await asyncio.sleep(0)  # a cancellation point between batches
                means.append(torch.stack(per_prompt).mean(0))
            vector = means[0] - means[1]
            h = (await s.acapture(self.prompt, [address]))[address][0]
            ranges = self._ranges(vector, h)
            with self._lock:
                if self._active is not job:
                    return
                with self.hold_sync():
                    self._vector = vector
                    self.has_vector = True
                    self.address = address
                    self.positive, self.negative = pos, neg
                    self.vector_source = mean_difference_source(address, pos, neg)
                    self._apply_ranges(ranges)
                    self.status = "generating"
                spec = self._spec()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - shown in the panel; the previous vector stays
            self._fail(seq, e)
            self._done.set()
            return
        await self._job(seq, spec, False)

    def _batch_rows(self, prompts: list[str]) -> int:
        """Prompts per forward of the vector job: what ie_lab.sizing fits in VECTOR_BUDGET_BYTES for the longest
        prompt at one point (float32, the widest dtype a session computes in, so the bound holds for all)."""
        longest = max(int(self._session.tokens(p).shape[-1]) for p in prompts)
        return batch_size_for(self._session.facts, longest, 1, self.VECTOR_BUDGET_BYTES)

    async def _prompt_means(self, prompts: list[str], address: str) -> list[torch.Tensor]:
        """Each prompt's mean over its own tokens at `address`, the prompts read together.

        A list capture is one right-padded forward that hands back each prompt's own rows, so no padding enters a
        mean (the path of ie_lab.mean_difference). vLLM takes one prompt a request and batches concurrent ones."""
        s = self._session
        if getattr(s, "served_backend", s.backend) == "vllm":
            caps = await asyncio.gather(*(s.acapture(p, [address]) for p in prompts))
        else:
            caps = await s.acapture(list(prompts), [address])
        return [c[address][0].float().mean(0).cpu() for c in caps]

    def _start(
        self,
        seq: int,
        baseline: bool = False,
        contrast: tuple[list[str], list[str], str] | None = None,
        previous_prompt: str | None = None,
    ) -> None:
        """Cancel what is in flight and start a new job (a generation, or a vector then its generation).

        Returns at once; the job runs on the session's loop.
        """
        with self._lock:
            if self._future is not None:
                self._future.cancel()
            job = self._active = object()
            if contrast is None:
                try:
                    spec = self._spec()
                except IELabError as e:
                    self._fail(seq, e)
                    return
                coro = self._job(seq, spec, baseline, previous_prompt)
                self.status = "generating"
            else:
                coro = self._vector_job(job, seq, *contrast)
                with self.hold_sync():
                    self.progress = [0, len(contrast[0]) + len(contrast[1])]
                    self.status = "vector"
            self._done.clear()
            try:
                self._future = self._session.submit(coro)
            except BaseException:  # a closed session: nothing runs, so nothing is in flight to wait for
                self._future = None
                self._done.set()
                raise
            self._future.add_done_callback(lambda f: self._done.set())

    def wait(self, timeout: float = 60) -> "SteeringPanel":
        """Block until the generation in flight (if any) has finished."""
        fut = self._future
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except concurrent.futures.CancelledError:
                pass
        return self

    # ---- Python-side controls (same paths as the front end) -------------------------------------------
    def update(self, *, wait: bool = True, **values: Any) -> "SteeringPanel":
        """Change method / scale / cap_min / cap_max / target and regenerate, e.g. panel.update(scale=8)."""
        for k in values:
            if k not in ("method", "scale", "cap_min", "cap_max", "target"):
                raise InputError(f"update() takes method, scale, cap_min, cap_max, target; got {k!r}.")
        try:
            clean = {k: (_base.choice(METHODS) if k == "method" else _N)(v) for k, v in values.items()}
        except _base.Rejected as e:
            raise InputError(str(e)) from None
        self.on_steer(self.seq + 1, **clean)
        return self.wait() if wait else self

    def set_address(self, address: Any, *, wait: bool = True) -> "SteeringPanel":
        self.on_address(self.seq + 1, str(Address.parse(address)))
        return self.wait() if wait else self

    def set_contrast(self, positive: Sequence[str], negative: Sequence[str], *, regenerate: bool = True) -> None:
        """The vector as mean(positive) - mean(negative) of the panel's address, averaged over tokens.

        Blocks until done (a Python call, interruptible); the prompts run in batches (Session.mean_difference), as
        the panel's own box does in the background.
        """
        pos, neg = self._check_contrast(positive, negative)
        a = self.address
        self._vector = self._session.mean_difference(pos, neg, a).detach().float().cpu()
        self.has_vector = True
        self.positive, self.negative = pos, neg
        self.vector_source = mean_difference_source(a, pos, neg)
        if regenerate:
            self._set_ranges()

    def link(self, picker: Any) -> "SteeringPanel":
        """Follow a picker: selecting a steerable point there moves the steering address here."""

        def follow(change: dict) -> None:
            a = change["new"]
            if a is not None and a.name in STEERABLE:
                self.on_address(self.seq + 1, str(a))

        picker.observe(follow, "address")
        return self

    # ---- front-end commands (validated by the base class) ----------------------------------------------
    def on_steer(self, seq: int, **values: Any) -> None:
        with self.hold_sync():
            for k, v in values.items():
                setattr(self, k, v)
        if self._vector is None:  # nothing to steer with: the knobs are kept, no generation is started
            self.status = "no vector"
            return
        self._start(seq)

    def on_address(self, seq: int, address: str) -> None:
        try:
            addr = Address.parse(address)
            self._check_address(addr, self._session.facts)
            self._check_served(addr)
        except IELabError as e:
            self._reject(str(e))
            return
        if self.positive and self.negative and self.vector_source.startswith("difference of means"):
            # the vector is re-measured at the new point; the address moves with it when that is done
            self._start(seq, contrast=(list(self.positive), list(self.negative), str(addr)))
            return
        self.address = str(addr)
        self._start(seq)

    def on_contrast(self, seq: int, positive: list[str], negative: list[str]) -> None:
        try:
            pos, neg = self._check_contrast(positive, negative)
        except IELabError as e:
            self._reject(str(e))
            return
        self._start(seq, contrast=(pos, neg, self.address))

    def on_prompt(self, seq: int, prompt: str) -> None:
        try:
            self._check_prompt(prompt)
        except IELabError as e:
            self._reject(str(e))  # the previous prompt stays, and so does everything that works with it
            return
        previous, self.prompt = self.prompt, prompt
        self._start(seq, baseline=True, previous_prompt=previous)

    def on_cancel(self) -> None:
        with self._lock:
            self._active = None
            if self._future is not None:
                self._future.cancel()
            with self.hold_sync():
                self.status = self._idle_status()
                self.progress = [0, 0]

    def close(self) -> None:
        if getattr(self, "_lock", None) is not None:  # a panel whose construction failed has nothing in flight
            self.on_cancel()
        super().close()

    def __repr__(self) -> str:
        def short(t: str) -> str:
            return repr(t if len(t) <= 60 else t[:57] + "...")

        knob = {
            "cap": f"min={self.cap_min:g}, max={self.cap_max:g}",
            "swap": f"target={self.target:g}",
            "ablate": "",
        }.get(self.method, f"scale={self.scale:g}")
        return (
            f"SteeringPanel({self.method} at {self.address}{', ' + knob if knob else ''}; vector: "
            f"{self.vector_source}; baseline {short(self.baseline_text)}; steered {short(self.steered_text)})"
        )
