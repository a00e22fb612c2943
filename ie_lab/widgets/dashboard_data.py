"""What a feature dashboard shows, computed in one place and testable without a browser: ``feature_data``.

For one SAE feature over a corpus of activations: its top-activating contexts (a window of tokens around each of
the corpus's largest activations, with the feature's value at every token), a histogram of its non-zero
activations and its density (the fraction of tokens where it fires, value > 0), the tokens its decoder direction
promotes and suppresses through the model's read-out, and, given a prompt, generation with and without steering
along that direction (``sae.steer``, i.e. ``s.steer``).

The corpus is either an ``ActivationCorpus`` (the reading interface of ``ie_lab.Activations``, a harvest on disk;
any object with the same members will do) or a list of texts, whose activations at the SAE's point are captured
here with batched ``s.capture`` calls. The corpus is encoded once (``EncodedCorpus``: the SAE's encoder over every
row, kept sparse, one column per feature), so switching feature costs a column read, not an encode.

The promoted and suppressed tokens: the decoder direction goes through the model's own read-out as the logit lens
decodes a residual (``eager/lens.py`` ``decode_residual``: the trunk's last stream scale, the final norm, the
unembedding, the family's logit post-processing), minus the read-out of a zero residual, which removes what is the
same for every feature (a LayerNorm's bias, the head's bias). What is approximated: the final norm sees the
direction alone, so it divides by the direction's own scale, not by the scale of a real residual the direction is
added to (a norm frozen at any one scale gives the same token order, with values in proportion); a LayerNorm centres
the direction as it would any input. A soft-capped family (Gemma 2) bends the values, not their order for one
token. It reads the model's weights, so it runs where the model is in this process (eager, through ``s.run``);
elsewhere the data says why it is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..corpus.features import sae_identity
from ..errors import CapabilityUnsupported, InputError, plural

MAX_TOP = 64  # contexts per feature
MAX_WINDOW = 64  # tokens on either side of a context's peak
MAX_BINS = 200
MAX_LOGITS = 64
CAPTURE_BATCH = 16  # texts per s.capture call on the list-of-texts path
ENCODE_ROWS = 4096  # rows encoded at once (the SAE's [rows, d_sae] scores of one chunk are held, then dropped)


@runtime_checkable
class ActivationCorpus(Protocol):
    """The reading interface of ``ie_lab.Activations`` (a harvest on disk) that the dashboards use: ``acts[address]``
    a float tensor [rows, width]; ``token_ids``, ``prompt_ids``, ``positions`` long tensors [rows]; ``rows_of(i)``
    prompt i's rows (a range, a slice or a (start, stop) pair: rows of one prompt are contiguous, by position);
    ``addresses``; ``len()``."""

    @property
    def addresses(self) -> Sequence[Any]: ...

    @property
    def token_ids(self) -> torch.Tensor: ...

    @property
    def prompt_ids(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    def __getitem__(self, address: Any) -> torch.Tensor: ...

    def rows_of(self, i: int) -> Any: ...

    def __len__(self) -> int: ...


class TextCorpus:
    """A list of texts read at one point: batched ``s.capture`` calls, the rows of every prompt (BOS included where
    the session prepends one) one after another. Implements ``ActivationCorpus``."""

    def __init__(self, session: Any, texts: Sequence[Any], address: Any):
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
            raise InputError(
                "acts must be an ie_lab.Activations (a harvest) or a non-empty list of texts; got "
                f"{type(texts).__name__}" + (" (one string: wrap it in a list)" if isinstance(texts, str) else "") + "."
            )
        key = str(address)
        rows, ids, starts = [], [], [0]
        for i in range(0, len(texts), CAPTURE_BATCH):
            chunk = list(texts[i : i + CAPTURE_BATCH])
            caches = session.capture(chunk, [address])
            caches = caches if isinstance(caches, list) else [caches]
            toks = [session.tokens(t) for t in chunk]
            for c, t in zip(caches, toks, strict=True):
                x = c[address][0].detach().float().cpu()
                rows.append(x)
                ids.append(t[0, -x.shape[0] :].cpu())  # the captured rows are the prompt's own tokens
                starts.append(starts[-1] + x.shape[0])
        self._x = torch.cat(rows)
        self._address = key
        self._starts = starts
        self.token_ids = torch.cat(ids).long()
        self.prompt_ids = torch.cat([torch.full((r.shape[0],), i, dtype=torch.long) for i, r in enumerate(rows)])
        self.positions = torch.cat([torch.arange(r.shape[0]) for r in rows])
        self.addresses = [key]

    def __getitem__(self, address: Any) -> torch.Tensor:
        if str(address) != self._address:
            raise InputError(f"this corpus was captured at {self._address}, not {address}.")
        return self._x

    def rows_of(self, i: int) -> range:
        return range(self._starts[i], self._starts[i + 1])

    def __len__(self) -> int:
        return len(self._starts) - 1


def _row_range(r: Any) -> tuple[int, int]:
    if isinstance(r, range) and r.step == 1:
        return r.start, r.stop
    if isinstance(r, slice) and r.step in (None, 1):
        return int(r.start or 0), int(r.stop)
    if isinstance(r, (tuple, list)) and len(r) == 2:
        return int(r[0]), int(r[1])
    raise InputError(f"acts.rows_of(i) gave {type(r).__name__} {r!r}; expected a range of rows (start, stop).")


@dataclass
class EncodedCorpus:
    """The SAE's scores over every row of a corpus, kept sparse by feature (CSC): feature f's firing rows are
    ``rows[ptr[f]:ptr[f+1]]`` with values ``vals[...]``, in row order."""

    address: str
    n_rows: int
    d_sae: int
    ptr: torch.Tensor  # [d_sae + 1] long
    rows: torch.Tensor  # [nnz] long
    vals: torch.Tensor  # [nnz] float32
    token_ids: torch.Tensor  # [n_rows] long
    prompt_ids: torch.Tensor
    positions: torch.Tensor
    spans: dict[int, tuple[int, int]]  # prompt -> its rows (start, stop)

    def column(self, f: int) -> torch.Tensor:
        """[n_rows] float32: feature f's activation at every row (0 where it does not fire)."""
        out = torch.zeros(self.n_rows)
        a, b = int(self.ptr[f]), int(self.ptr[f + 1])
        out[self.rows[a:b]] = self.vals[a:b]
        return out

    def counts(self) -> torch.Tensor:
        """[d_sae]: on how many rows each feature fires."""
        return self.ptr[1:] - self.ptr[:-1]

    def maxima(self) -> torch.Tensor:
        """[d_sae]: each feature's largest activation over the corpus (0 where it never fires)."""
        out = torch.zeros(self.d_sae)
        feat = torch.repeat_interleave(torch.arange(self.d_sae), self.counts())
        return out.scatter_reduce(0, feat, self.vals, "amax", include_self=True)


def holds_features_of(acts: Any, sae: Any) -> bool:
    """Whether `acts` is a harvest that kept this SAE's features (harvested with sae=): every directory's manifest
    names the SAE by its point, width, activation and the hash of its encoder's numbers (corpus/features.py
    sae_identity), so features of another SAE, or of this one since changed, are never read as its own."""
    manifests = getattr(acts, "manifests", None)
    if not callable(getattr(acts, "features", None)) or not isinstance(manifests, list) or not manifests:
        return False
    try:
        want = sae_identity(sae)
    except (InputError, AttributeError, TypeError):  # not an ie_lab SAE (a transcoder read as one): encode it
        return False
    return all(
        isinstance(m, dict) and isinstance(m.get("sae"), dict) and all(m["sae"].get(k) == v for k, v in want.items())
        for m in manifests
    )


def encode_corpus(session: Any, sae: Any, acts: Any) -> EncodedCorpus:
    """Encode a corpus (an ActivationCorpus, or a list of texts captured here) with the SAE, once. A harvest that
    kept this SAE's features (``harvest(..., sae=sae)``) is read, not encoded again."""
    addr = sae.address
    if addr is None:
        raise InputError(
            "this SAE is attached to no point: load it with the model (ie_lab.load_sae(path, s)) or pass address=."
        )
    key = str(addr)
    if isinstance(acts, (list, tuple, str)):
        acts = TextCorpus(session, acts, addr)
    if not isinstance(acts, ActivationCorpus):
        raise InputError(
            f"acts must be an ie_lab.Activations (a harvest) or a list of texts, got {type(acts).__name__}."
        )
    stored: Any = acts if holds_features_of(acts, sae) else None  # an Activations whose features are this SAE's
    x: Any = None
    if stored is not None:  # read, not encoded: the harvest's rows of the point may even be absent
        n = len(acts)
    else:
        have = [str(a) for a in acts.addresses]
        if key not in have:
            raise InputError(
                f"the corpus holds no activations at {key}, the SAE's point (it holds {', '.join(have) or 'none'}): "
                f"harvest {key}, or pass a list of texts to capture there."
            )
        x = acts[key]
        if len(x.shape) != 2 or x.shape[1] != sae.d_in:  # a harvest's Rows is lazy: a shape, no dim()
            raise InputError(
                f"acts[{key!r}] has shape {list(x.shape)}; the SAE reads [rows, {sae.d_in}]: it was harvested at "
                "another point or model."
            )
        n = int(x.shape[0])
    token_ids, prompt_ids, positions = (
        torch.as_tensor(t).long().reshape(-1) for t in (acts.token_ids, acts.prompt_ids, acts.positions)
    )
    if not (token_ids.shape[0] == prompt_ids.shape[0] == positions.shape[0] == n):
        raise InputError(
            f"the corpus has {n} rows of activations but {token_ids.shape[0]} token ids, {prompt_ids.shape[0]} prompt "
            f"ids and {positions.shape[0]} positions: one of each per row."
        )
    r_all, f_all, v_all = [], [], []
    for a in range(0, n, ENCODE_ROWS):
        b = min(a + ENCODE_ROWS, n)
        z = stored.features(range(a, b)) if stored is not None else sae.encode(x[a:b].float())
        nz = (z > 0).nonzero()
        r_all.append(nz[:, 0] + a)
        f_all.append(nz[:, 1])
        v_all.append(z[nz[:, 0], nz[:, 1]])
    rows, feats, vals = torch.cat(r_all), torch.cat(f_all), torch.cat(v_all).float()
    order = torch.argsort(feats * n + rows)  # by feature, then row
    rows, feats, vals = rows[order], feats[order], vals[order]
    ptr = torch.zeros(sae.d_sae + 1, dtype=torch.long)
    ptr[1:] = torch.cumsum(torch.bincount(feats, minlength=sae.d_sae), 0)
    spans = {int(p): _row_range(acts.rows_of(int(p))) for p in torch.unique(prompt_ids).tolist()}
    return EncodedCorpus(key, n, sae.d_sae, ptr, rows, vals, token_ids, prompt_ids, positions, spans)


@dataclass
class Context:
    """One top-activating context: the tokens around the row where the feature peaks, with its value at each."""

    prompt: int
    position: int  # the peak's position in its prompt
    row: int  # the peak's row in the corpus
    value: float  # the feature's activation there
    at: int  # the peak's index in this window
    token_ids: list[int]
    tokens: list[str]
    values: np.ndarray  # float32 [window]


@dataclass
class Steering:
    """Greedy generation from a prompt without and with the feature's decoder direction added at the SAE's point."""

    prompt: str
    scale: float
    max_new_tokens: int
    baseline: str
    steered: str


@dataclass
class FeatureData:
    """Everything a dashboard shows for one feature (numpy arrays; no browser needed to read or test it)."""

    feature: int
    address: str
    d_sae: int
    contexts: list[Context]
    n_tokens: int  # rows of the corpus
    n_fired: int  # rows where the feature is > 0
    density: float  # n_fired / n_tokens
    max_activation: float
    mean_activation: float  # over the rows where it fires
    hist_counts: np.ndarray  # int64 [bins]: the non-zero activations
    hist_edges: np.ndarray  # float32 [bins + 1]
    promoted_ids: np.ndarray  # int64 [n]: the tokens the decoder direction raises most, strongest first
    promoted_tokens: list[str]
    promoted_values: np.ndarray  # float32 [n]
    suppressed_ids: np.ndarray  # lowers most, strongest first
    suppressed_tokens: list[str]
    suppressed_values: np.ndarray
    logit_note: str
    steering: Steering | None = None
    notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        best = f"; top context peaks at {self.contexts[0].value:.3g}" if self.contexts else ""
        return (
            f"FeatureData(feature {self.feature} at {self.address}: fires on {self.n_fired} of "
            f"{plural(self.n_tokens, 'token')} (density {self.density:.3g}){best})"
        )


def _count(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InputError(f"{name}={value!r}: an int from {lo} to {hi}.")
    return value


def check_feature(feature: Any, d_sae: int) -> int:
    if isinstance(feature, bool) or not isinstance(feature, (int, np.integer)) or not 0 <= int(feature) < d_sae:
        raise InputError(f"feature={feature!r}: an int from 0 to {d_sae - 1} (the SAE has {d_sae} features).")
    return int(feature)


def _names(session: Any, ids: list[int]) -> list[str]:
    if not ids:
        return []
    return list(session.to_str_tokens(torch.tensor([ids]))[0])


def top_contexts(enc: EncodedCorpus, f: int, col: torch.Tensor, top: int, before: int, after: int) -> list[dict]:
    """The `top` rows with the largest activation (> 0; ties in row order), each with its window in its prompt.
    Sorted among the rows where the feature fires only (held in row order), not over the whole corpus."""
    a, b = int(enc.ptr[f]), int(enc.ptr[f + 1])
    firing = enc.rows[a:b]
    order = firing[np.argsort(-enc.vals[a:b].numpy(), kind="stable")[:top]]
    out = []
    for r in order.tolist():
        p = int(enc.prompt_ids[r])
        a, b = enc.spans[p]
        lo, hi = max(a, r - before), min(b, r + after + 1)
        out.append(
            {
                "prompt": p,
                "position": int(enc.positions[r]),
                "row": r,
                "value": float(col[r]),
                "at": r - lo,
                "token_ids": enc.token_ids[lo:hi].tolist(),
                "values": col[lo:hi].numpy().astype(np.float32),
            }
        )
    return out


def direction_logits(session: Any, direction: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """[vocab] logits a residual direction adds through the model's read-out (module docstring), or None and why."""
    from ..eager.lens import decode_residual

    def read(lm: Any) -> torch.Tensor:
        h = torch.stack([direction, torch.zeros_like(direction)]).to(lm.dtype)
        dev = next(lm.hf.parameters()).device
        out = decode_residual(lm, h.to(dev)).float().cpu()
        return out[0] - out[1]

    try:
        logits = session.run(read)
    except CapabilityUnsupported as e:
        return None, f"no promoted tokens: the unembedding is not in this process ({e})"
    note = (
        "the decoder direction through the final norm and the unembedding as the logit lens decodes a residual, minus "
        "a zero residual's read-out; the norm sees the direction alone (its scale is the direction's own: the order "
        "of tokens holds at any frozen scale, the values are in proportion)"
    )
    return logits, note


def feature_data(
    session: Any,
    sae: Any,
    feature: int,
    acts: Any,
    *,
    top: int = 10,
    before: int = 8,
    after: int = 4,
    bins: int = 24,
    logits: int = 10,
    prompt: str | None = None,
    scale: float | None = None,
    max_new_tokens: int = 16,
) -> FeatureData:
    """One feature's dashboard data over `acts` (an ActivationCorpus, a list of texts, or an EncodedCorpus from
    ``encode_corpus``, which switching features reuses). scale: the steering coefficient along the decoder
    direction (None: 4 x the feature's largest activation in the corpus)."""
    enc = acts if isinstance(acts, EncodedCorpus) else encode_corpus(session, sae, acts)
    f = check_feature(feature, enc.d_sae)
    top = _count("top", top, 1, MAX_TOP)
    before, after = _count("before", before, 0, MAX_WINDOW), _count("after", after, 0, MAX_WINDOW)
    bins = _count("bins", bins, 1, MAX_BINS)
    k = _count("logits", logits, 1, MAX_LOGITS)
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"prompt= is the text to steer (a str), got {type(prompt).__name__}.")
    col = enc.column(f)
    fired = col[col > 0]
    vmax = float(fired.max()) if fired.numel() else 0.0
    counts, edges = np.histogram(fired.numpy(), bins=bins, range=(0.0, vmax if vmax > 0 else 1.0))
    ctxs = top_contexts(enc, f, col, top, before, after)
    names = _names(session, sorted({t for c in ctxs for t in c["token_ids"]}))
    lookup = dict(zip(sorted({t for c in ctxs for t in c["token_ids"]}), names, strict=True))
    contexts = [Context(**c, tokens=[lookup[t] for t in c["token_ids"]]) for c in ctxs]
    notes = [] if ctxs else [f"feature {f} never fires on this corpus ({plural(enc.n_rows, 'token')})"]
    if sae.W_dec is None:
        raise InputError("this SAE has no W_dec (an encoder-only dict): a dashboard reads its decoder directions.")
    lg, note = direction_logits(session, sae.W_dec[f].detach().float())
    if lg is not None:
        k = min(k, lg.shape[0])
        pv, pi = lg.topk(k)
        sv, si = (-lg).topk(k)
        sv = -sv
    else:
        pv = pi = sv = si = torch.zeros(0)
    steering = None
    if prompt is not None:
        coef = 4.0 * vmax if scale is None else float(scale)
        base = session.generate(prompt, max_new_tokens)
        steered = session.generate(prompt, max_new_tokens, steer=sae.steer(session, f, scale=coef))
        steering = Steering(prompt, coef, max_new_tokens, base.text, steered.text)
    return FeatureData(
        feature=f,
        address=enc.address,
        d_sae=enc.d_sae,
        contexts=contexts,
        n_tokens=enc.n_rows,
        n_fired=int(fired.numel()),
        density=float(fired.numel()) / max(1, enc.n_rows),
        max_activation=vmax,
        mean_activation=float(fired.mean()) if fired.numel() else 0.0,
        hist_counts=counts.astype(np.int64),
        hist_edges=edges.astype(np.float32),
        promoted_ids=pi.long().numpy(),
        promoted_tokens=_names(session, pi.long().tolist()),
        promoted_values=pv.float().numpy(),
        suppressed_ids=si.long().numpy(),
        suppressed_tokens=_names(session, si.long().tolist()),
        suppressed_values=sv.float().numpy(),
        logit_note=note,
        steering=steering,
        notes=notes,
    )


def as_plain(d: FeatureData) -> dict:
    """The data as JSON-able lists (the static export embeds it; the panel sends the same as binary buffers)."""

    def fl(a: Any) -> list[float]:
        return [round(float(v), 5) for v in a]

    return {
        "feature": d.feature,
        "address": d.address,
        "d_sae": d.d_sae,
        "n_tokens": d.n_tokens,
        "n_fired": d.n_fired,
        "density": d.density,
        "max": d.max_activation,
        "mean": d.mean_activation,
        "contexts": [
            {
                "prompt": c.prompt,
                "position": c.position,
                "value": c.value,
                "at": c.at,
                "tokens": c.tokens,
                "values": fl(c.values),
            }
            for c in d.contexts
        ],
        "hist": {"counts": [int(v) for v in d.hist_counts], "edges": fl(d.hist_edges)},
        "promoted": [[t, float(v)] for t, v in zip(d.promoted_tokens, d.promoted_values, strict=True)],
        "suppressed": [[t, float(v)] for t, v in zip(d.suppressed_tokens, d.suppressed_values, strict=True)],
        "logit_note": d.logit_note,
        "steering": None
        if d.steering is None
        else {
            "prompt": d.steering.prompt,
            "scale": d.steering.scale,
            "baseline": d.steering.baseline,
            "steered": d.steering.steered,
        },
        "notes": list(d.notes),
    }
