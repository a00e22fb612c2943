"""The operations' records: one frozen dataclass per operation, whose fields are the operation's arguments.

A call is turned into its record once, where it enters (the Session method and its awaited twin, the free
function `ie_lab.capture(lm, ...)`, a remote server's request frame), by `Record.build`: an unknown keyword, a
missing or doubled argument is refused there, with an InputError that names the nearest keyword. From there the
record is handed down as it is: the Backend protocol (ie_lab/backend.py) and every backend receive it, never
`**kwargs`. The signatures users read are made from these fields too (`help(s.capture)`, `help(ie_lab.capture)`),
and so are a remote server's per-argument checks: each field names its wire check (`arg(..., wire="prompts")`,
ie_lab/remote/ops.py's CHECKS), or None where the argument does not cross to a server (a local-only argument such
as capture's grad=, refused there by name). A new keyword is one line here.

What the meaning of a value is (an address that exists, a temperature >= 0) is checked by the operation itself,
against the model, where it computes; this module is plain Python (no torch), so `import ie_lab` stays light.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import KW_ONLY, MISSING, dataclass
from typing import Any, ClassVar

from ..errors import InputError

_WIRE = "wire"


def arg(default: Any = MISSING, *, wire: str | None = None) -> Any:
    """A field of a record: its default (none: required) and the remote server's check of its kind (a name of
    ie_lab/remote/ops.py's CHECKS; None: it does not cross to a server; "local": checked and kept by the client)."""
    return dataclasses.field(default=default, metadata={_WIRE: wire})


@dataclass(frozen=True)
class Record:
    """One call of an operation. `op` is its name (``s.<op>(...)``, ``ie_lab.<op>(model, ...)``)."""

    op: ClassVar[str] = ""
    doc: ClassVar[str] = ""
    # where the remote server reads the number of new tokens a request asks for (checked against its limit)
    tokens: ClassVar[str | None] = None

    # ---- the door -------------------------------------------------------------------------------
    @classmethod
    def build(cls, args: tuple = (), kwargs: dict | None = None, *, door: tuple[str, ...] = ()) -> Record:
        """The record of op(*args, **kwargs), or an InputError naming what is wrong and the fix. `door`: the
        keywords the caller's door takes besides the record's (a Session's prepend_bos), offered as near matches."""
        kwargs = dict(kwargs or {})
        params = cls.parameters()
        names = [p.name for p in params]
        for k in kwargs:
            if k not in names:
                raise InputError(cls._unknown(k, (*names, *door)))
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        if len(args) > len(positional):
            raise InputError(
                f"{cls.op}() takes {len(positional)} positional argument(s) ({', '.join(positional)}), got "
                f"{len(args)}; pass the rest by keyword: {cls.op}{cls.signature()}."
            )
        for name in positional[: len(args)]:
            if name in kwargs:
                raise InputError(f"{cls.op}() got {name!r} twice, by position and by keyword; pass it once.")
        bound = dict(zip(positional, args), **kwargs)
        missing = [p.name for p in params if p.default is p.empty and p.name not in bound]
        if missing:
            raise InputError(
                f"{cls.op}() is missing {', '.join(map(repr, missing))}: call it as {cls.op}{cls.signature()}."
            )
        return cls(**bound)

    @classmethod
    def _unknown(cls, name: Any, known: tuple[str, ...]) -> str:
        shown = str(name)[:60]
        near = difflib.get_close_matches(shown, known, n=1, cutoff=0.6)
        fix = f"did you mean {near[0]!r}? " if near else ""
        return f"{cls.op}() has no argument {shown!r}; {fix}It takes {', '.join(known)}."

    # ---- what the fields say ---------------------------------------------------------------------
    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The operation's parameters, in order: the positional ones, then the keyword-only ones."""
        return list(inspect.signature(cls).parameters.values())

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The parameters as a signature (no annotations: what an error message shows)."""
        return inspect.Signature([p.replace(annotation=p.empty) for p in cls.parameters()])

    @classmethod
    def wire_checks(cls) -> dict[str, str | None]:
        """Field name -> the remote server's check of its kind (ie_lab/remote/ops.py CHECKS), None where the
        argument does not cross, "local" where the client keeps it."""
        return {f.name: f.metadata.get(_WIRE) for f in dataclasses.fields(cls)}

    def positional(self) -> tuple:
        """The values of the positional parameters, in order."""
        return tuple(getattr(self, p.name) for p in self.parameters() if p.kind is p.POSITIONAL_OR_KEYWORD)

    def keywords(self) -> dict[str, Any]:
        """The keyword-only parameters by name (every one, defaults included)."""
        return {p.name: getattr(self, p.name) for p in self.parameters() if p.kind is p.KEYWORD_ONLY}

    def given(self) -> dict[str, Any]:
        """The keyword-only parameters that differ from their defaults (what a request needs to carry)."""
        out = {}
        for p in self.parameters():
            if p.kind is not p.KEYWORD_ONLY:
                continue
            v = getattr(self, p.name)
            if v is p.default or (_plain(p.default) and type(v) is type(p.default) and v == p.default):
                continue
            out[p.name] = v
        return out

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)


def _plain(x: Any) -> bool:
    return isinstance(x, (bool, int, float, str))


# ---- the operations ------------------------------------------------------------------------------------
# Wire checks: ie_lab/remote/ops.py CHECKS. "prompts": one prompt or a list; "prompt": one.


@dataclass(frozen=True)
class Capture(Record):
    op: ClassVar[str] = "capture"
    doc: ClassVar[str] = (
        "One forward; the activations at `addresses` in a Cache (a list of prompts: a list of Cache). "
        "steer=: steering specs for this call; grad=True keeps the autograd graph (eager only); splice=: SAEs "
        "spliced in (s.splice(sae); their features read as 'sae.<name>.acts'; not remote, docs/SAE.md); intervene=: "
        "{graph feature node or (layer, feature): value} clamps transcoder features (docs/CIRCUITS.md)."
    )
    tokens_or_text: Any = arg(wire="prompts")
    addresses: Any = arg(wire="addresses")
    _: KW_ONLY
    steer: Any = arg(None, wire="steer")
    grad: bool = arg(False)
    splice: Any = arg(None)  # local: a spec holding an SAE's weights, folded into steer= where it enters
    intervene: Any = arg(None)  # local: {graph feature node or (layer, feature): value}, folded into splice=


@dataclass(frozen=True)
class Generate(Record):
    op: ClassVar[str] = "generate"
    doc: ClassVar[str] = (
        "Generate to the end (greedy by default; temperature/top_k/top_p/seed to sample). capture= covers "
        "prompt + every generated token; a list of prompts returns a list of results (docs/GENERATION.md). "
        "splice= / intervene=: SAEs or transcoders spliced in, features clamped (docs/SAE.md, docs/CIRCUITS.md)."
    )
    tokens: ClassVar[str | None] = "max_new_tokens"
    prompt: Any = arg(wire="prompts")
    max_new_tokens: int = arg(32, wire="int")
    _: KW_ONLY
    temperature: float = arg(0.0, wire="real")
    top_k: int | None = arg(None, wire="optional_int")
    top_p: float | None = arg(None, wire="optional_real")
    seed: Any = arg(None, wire="seed")
    stop: Any = arg(None, wire="stop")
    n_logprobs: int = arg(0, wire="int")
    capture: Any = arg(None, wire="optional_addresses")
    steer: Any = arg(None, wire="steer")
    keep_logits: bool = arg(True, wire="flag")
    ignore_eos: bool = arg(False, wire="flag")
    splice: Any = arg(None)  # local: s.splice(sae) specs, folded into steer= where it enters (not remote)
    intervene: Any = arg(None)  # local: {graph feature node or (layer, feature): value}, folded into splice=


@dataclass(frozen=True)
class GenerateStream(Generate):
    op: ClassVar[str] = "generate_stream"
    doc: ClassVar[str] = (
        "Yield GenStep objects as tokens are produced (one per prompt still running, for a list); an interrupt "
        "stops within one token. The arguments are generate's."
    )


@dataclass(frozen=True)
class Attention(Record):
    op: ClassVar[str] = "attention"
    doc: ClassVar[str] = "Attention patterns (and values) of one prompt, for the viewers."
    prompt: Any = arg(wire="prompt")
    layers: Any = arg(None, wire="layers")


@dataclass(frozen=True)
class LogitLens(Record):
    op: ClassVar[str] = "logit_lens"
    doc: ClassVar[str] = (
        "The logit lens: each layer's residual (`point`) read out through the unembedding, the top `k` per "
        "position; transports= per-layer maps applied first (a tuned lens; eager only)."
    )
    prompt: Any = arg(wire="prompt")
    layers: Any = arg(None, wire="layers")
    _: KW_ONLY
    k: int = arg(5, wire="int")
    point: str = arg("resid_post", wire="text")
    transports: Any = arg(None)
    keep_logits: bool = arg(False, wire="flag")


@dataclass(frozen=True)
class LogitAttribution(Record):
    op: ClassVar[str] = "logit_attribution"
    doc: ClassVar[str] = (
        "Direct logit attribution: the target logit (one token) or logit difference (a pair) at `positions` (the "
        "last by default) split into what each piece of the residual stream writes (the embeddings; by='layer', "
        "'point' or 'head'; the biases), read through the final norm frozen at the run's scale; the pieces sum "
        "to the model's logit (docs/ATTRIBUTION.md)."
    )
    prompt: Any = arg(wire="prompt")
    target_tokens: Any = arg(wire="targets")
    _: KW_ONLY
    by: str = arg("layer", wire="text")
    positions: Any = arg(None, wire="optional_position_list")


@dataclass(frozen=True)
class Project(Record):
    op: ClassVar[str] = "project"
    doc: ClassVar[str] = (
        "Per-token scores [tokens, k] of one point against probe directions or an SAE encoder, computed where "
        "the activation is read; max_new_tokens > 0 generates (with the sampling arguments) and scores every "
        "token read (docs/PROJECTION.md)."
    )
    tokens: ClassVar[str | None] = "max_new_tokens"
    prompt: Any = arg(wire="prompt")
    address: Any = arg(wire="address")
    directions: Any = arg(wire="directions")
    _: KW_ONLY
    bias: Any = arg(None, wire="optional_vector")
    activation: str | None = arg(None, wire="optional_text")
    threshold: Any = arg(None, wire="threshold")
    k: int | None = arg(None, wire="optional_int")
    max_new_tokens: int = arg(0, wire="int")
    steer: Any = arg(None, wire="steer")
    temperature: float = arg(0.0, wire="real")
    top_k: int | None = arg(None, wire="optional_int")
    top_p: float | None = arg(None, wire="optional_real")
    seed: Any = arg(None, wire="seed")
    stop: Any = arg(None, wire="stop")
    ignore_eos: bool = arg(False, wire="flag")

    def sampling(self) -> dict[str, Any]:
        """The generation arguments (used when max_new_tokens > 0)."""
        return {k: getattr(self, k) for k in ("temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")}


@dataclass(frozen=True)
class Patch(Record):
    op: ClassVar[str] = "patch"
    doc: ClassVar[str] = (
        "Run the prompt with activations replaced from `source` (a Cache, or prompts to capture it from) at "
        "`addresses` (at `positions` only, if given); the logits."
    )
    prompt: Any = arg(wire="prompts")
    source: Any = arg(wire="source")
    addresses: Any = arg(wire="addresses")
    _: KW_ONLY
    positions: Any = arg(None, wire="optional_positions")


@dataclass(frozen=True)
class PatchSweep(Record):
    op: ClassVar[str] = "patch_sweep"
    doc: ClassVar[str] = (
        "Patch every (layer, position) of the clean run into the corrupted one (over='layer_head': every "
        "(layer, head) of z); the metric per cell."
    )
    clean: Any = arg(wire="prompts")
    corrupted: Any = arg(wire="prompts")
    metric: Any = arg(wire="metric")
    _: KW_ONLY
    point: str = arg("resid_pre", wire="text")
    over: str = arg("layer_position", wire="text")
    layers: Any = arg(None, wire="layers")
    progress: bool = arg(True, wire="local")
    batch_size: int | None = arg(None, wire="optional_int")


@dataclass(frozen=True)
class Gradients(Record):
    op: ClassVar[str] = "gradients"
    doc: ClassVar[str] = (
        "Gradients of metric(logits) with respect to the activations at `addresses` (of=: the metric reads "
        "those points instead of the logits)."
    )
    prompt: Any = arg(wire="prompts")
    metric: Any = arg(wire="metric")
    addresses: Any = arg(wire="addresses")
    _: KW_ONLY
    of: Any = arg(None, wire="optional_addresses")


@dataclass(frozen=True)
class FitJacobianLens(Record):
    op: ClassVar[str] = "fit_jacobian_lens"
    doc: ClassVar[str] = (
        "The Jacobian lens: per layer, the Jacobian of the final residual (what the final norm reads) with respect "
        "to `point` at the same position, averaged over every position of `prompts` (autograd; eager only). Its "
        ".transports go to logit_lens(transports=...) (docs/LENS.md)."
    )
    prompts: Any = arg(wire="prompts")
    layers: Any = arg(None, wire="layers")
    _: KW_ONLY
    point: str = arg("resid_post", wire="text")
    batch_size: int | None = arg(None, wire="optional_int")
    progress: bool = arg(True)


@dataclass(frozen=True)
class MeanDifference(Record):
    op: ClassVar[str] = "mean_difference"
    doc: ClassVar[str] = (
        "mean(positive) - mean(negative) at `address`, each prompt averaged over its own tokens, the prompts "
        "in batches of batch_size (None: sized to fit)."
    )
    positive: Any = arg(wire="prompt_list")
    negative: Any = arg(wire="prompt_list")
    address: Any = arg(wire="address")
    _: KW_ONLY
    batch_size: int | None = arg(None, wire="optional_int")
    progress: bool = arg(True)


@dataclass(frozen=True)
class Harvest(Record):
    op: ClassVar[str] = "harvest"
    doc: ClassVar[str] = (
        "Activations at `addresses` over a corpus (a list of texts, or a dataset with a text column), written to "
        "out_dir as memory-mappable shards as the model runs; the same call again resumes where it stopped. "
        "sae=: an SAE's features kept too, sparse, with each feature's top_k rows. prepend_bos: True / False put "
        "a BOS token first in each text or not (None: the tokenizer's own choice; a Session's door fills in its "
        "own setting when the call gives none). Returns ie_lab.Activations(out_dir) (docs/HARVEST.md)."
    )
    # not served: it writes files where the model runs (RemoteBackend refuses it by name, ie_lab/remote/ops.py)
    texts_or_dataset: Any = arg()
    addresses: Any = arg()
    out_dir: Any = arg()
    _: KW_ONLY
    batch_size: int | None = arg(None)
    max_tokens_per_prompt: int | None = arg(1024)
    text_column: str = arg("text")
    shard_rows: int = arg(16384)
    progress: bool = arg(True)
    sae: Any = arg(None)
    top_k: int = arg(32)
    # a field, not only the door's keyword as on the other operations: the texts are read lazily (a dataset of any
    # size), so the door cannot turn them into ids up front; the Harvester applies it to each text as it reads it
    prepend_bos: bool | None = arg(None)


@dataclass(frozen=True)
class Run(Record):
    op: ClassVar[str] = "run"
    doc: ClassVar[str] = (
        "Run fn(model) queued behind the session's other operations (for custom analyses), on the calling "
        "thread; interrupts stop it between layers."
    )
    fn: Any = arg()


RECORDS: dict[str, type[Record]] = {
    r.op: r
    for r in (Capture, Generate, GenerateStream, Attention, LogitLens, Project, Patch, PatchSweep, Gradients)
    + (FitJacobianLens, MeanDifference, LogitAttribution, Harvest, Run)
}


def signature_with(record: type[Record], *, before: tuple[str, ...] = (), door: dict[str, Any] | None = None):
    """The signature a door shows: `before` positional parameters (self, model), the record's, then the door's own
    keywords (name -> default), keyword-only."""
    P = inspect.Parameter
    head = [P(n, P.POSITIONAL_OR_KEYWORD) for n in before]
    tail = [P(n, P.KEYWORD_ONLY, default=d) for n, d in (door or {}).items()]
    return inspect.Signature([*head, *record.parameters(), *tail])  # no return annotation: the record's is None


__all__ = ["RECORDS", "Record", "signature_with", *(r.__name__ for r in RECORDS.values())]
