"""Transcoder splicing and interventions on an attribution graph's features (docs/CIRCUITS.md, "Interventions").

A TranscoderSplice replaces each spliced layer's MLP output (the transcoder's output point, mlp_out.L) by the
transcoder's reconstruction from the features it reads at its input point (mlp_in.L), with chosen features clamped
first; with error=True the transcoder's error term (the MLP's true output minus the reconstruction) is added back,
so the run is exactly the plain run except for the clamps' decoder-direction change, (value - act) x W_dec[f]
(ops/splice.py's arithmetic, which writes where it does not read). It is a SteerSpec, carried and scoped as every
splice and steering spec is (core/splice_spec.py): its hooks are a reader at mlp_in.L and a writer at mlp_out.L
that share what the reader saw in the same forward (``writes``). A cross-layer transcoder (CLT) splices whole: layer
L's writer also adds every earlier layer's (edited) features times their decoders into L (with the error kept, their
edits' change alone), so clamping a layer-l feature moves every layer l' >= l's output by (value - act) x
W_dec[l -> l'][f]; a skip transcoder's skip path joins its reconstruction when the error is dropped.

``intervene={node: value}`` on capture / generate / generate_stream is folded here into such a splice (error=True)
of the layers intervened on (``with_interventions``): a graph's feature node clamps its feature at its position of
the graph's prompt only; a (layer, feature) pair clamps it at every position, prompt and generated.

Neutral: the transcoders are held by duck typing (W_enc, b_enc, W_dec, b_dec, activate, address_in, address_out,
layer, d_sae: ie_lab/transcoders.py's Transcoder); a graph's nodes by their fields (ie_lab/core/graph.py).
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..address import Address
from ..errors import InputError, shown_value
from ..ops.splice import splice as splice_rows
from .client_model import ClientModel
from .inputs import prepare, prepare_prompts
from .steer_spec import ForwardState, SteerSpec, position_mask

# (layer, feature, position or None for every position, value)
Clamp = tuple[int, int, int | None, float]


def is_transcoder(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("W_enc", "W_dec", "address_in", "address_out", "activate"))


def is_transcoders(x: Any) -> bool:
    """A transcoder, or a collection of them (ie_lab.load_transcoders' Transcoders, or a list)."""
    if is_transcoder(x):
        return True
    if isinstance(x, (list, tuple)):
        return bool(x) and all(is_transcoder(t) for t in x)
    return hasattr(x, "layers") and hasattr(x, "__iter__") and all(is_transcoder(t) for t in x)


def _same(a: Any, b: Any) -> bool:
    """One transcoder (a spec holds shallow copies: the same weight tensors)."""
    return a is b or (a.W_dec is b.W_dec and a.W_enc is b.W_enc)


@dataclass(eq=False, repr=False)
class TranscoderSplice(SteerSpec):
    """Transcoders spliced in, each in place of its layer's MLP output. ``.clamp(features, value)`` /
    ``.ablate(features)`` return a new spec (features: ints on a one-layer splice, or (layer, feature) pairs), the
    features set at every position before decoding; this one is unchanged."""

    transcoders: tuple[Any, ...] = ()  # one per layer, in layer order
    error: bool = False
    clamps: tuple[Clamp, ...] = ()
    name: str = "transcoders"
    _weights: dict = field(default_factory=dict, compare=False)  # (layer, device) -> the weights moved once

    def of_layer(self, layer: int) -> Any:
        return next((t for t in self.transcoders if t.layer == layer), None)

    # ---- edits -------------------------------------------------------------------------------------
    def clamp(self, features: Any, value: Any) -> TranscoderSplice:
        """A new spec with these features' activations set to value at every position before decoding."""
        v = finite_value(value, "clamp")
        items = features if isinstance(features, list) else [features]
        if not items:
            raise InputError("clamp: no feature given; pass a feature index, a (layer, feature) pair or a list.")
        return self.with_clamps([(*self._pair(f, "clamp"), None, v) for f in items])

    def ablate(self, features: Any) -> TranscoderSplice:
        """clamp(features, 0.0)."""
        return self.clamp(features, 0.0)

    def _pair(self, f: Any, what: str) -> tuple[int, int]:
        if isinstance(f, tuple) and len(f) == 2:
            return check_feature(self, f[0], f[1], what)
        if isinstance(f, numbers.Integral) and not isinstance(f, bool) and len(self.transcoders) == 1:
            return check_feature(self, self.transcoders[0].layer, f, what)
        which = "a feature index or " if len(self.transcoders) == 1 else ""
        raise InputError(
            f"{what}: {shown_value(f)} names no feature; pass {which}a (layer, feature) pair such as (2, 17) "
            f"(this splice covers layers {[t.layer for t in self.transcoders]})."
        )

    def with_clamps(self, new: list[Clamp]) -> TranscoderSplice:
        """A new spec with these clamps; a later one of the same (layer, feature, position) replaces an earlier."""
        keys = {c[:3] for c in new}
        kept = tuple(c for c in self.clamps if c[:3] not in keys)
        return replace(self, clamps=kept + tuple(new))

    # ---- the edits the hooks apply -----------------------------------------------------------------
    def edit(self, state: ForwardState, special_ids: frozenset[int]):
        raise RuntimeError("a transcoder splice reads one point and writes another: place it through writes()")

    def _on(self, t: Any, device: Any) -> tuple[torch.Tensor, ...]:
        key = (t.layer, device)
        if key not in self._weights:
            th = getattr(t, "threshold", None)
            self._weights[key] = tuple(
                None if w is None else w.detach().to(device, torch.float32)
                for w in (t.W_enc, t.b_enc, t.W_dec, t.b_dec, th)
            )
        return self._weights[key]

    def _extra(self, t: Any, device: Any) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """A CLT layer's decoders into later layers and a skip transcoder's W_skip, moved once."""
        key = (t.layer, device, "extra")
        if key not in self._weights:
            dec = {L: W.detach().to(device, torch.float32) for L, W in getattr(t, "decoders", {}).items()}
            skip = getattr(t, "W_skip", None)
            self._weights[key] = (dec, None if skip is None else skip.detach().to(device, torch.float32))
        return self._weights[key]

    def writes(self, state: ForwardState, special_ids: frozenset[int]) -> list[tuple[Address, Callable]]:
        out: list[tuple[Address, Callable]] = []
        # a CLT's features of the running forward, {layer: (f, f')}: layer L's writer adds the earlier layers' writes
        # into its output (the layers run in order, so an earlier layer's entry is this forward's)
        clt = threading.local()
        for t in self.transcoders:
            out += self._layer_writes(t, state, special_ids, clt)
        return out

    def _layer_writes(self, t: Any, state: ForwardState, special_ids: frozenset[int], clt: Any) -> list:
        mine = [c for c in self.clamps if c[0] == t.layer]
        idx = torch.tensor([c[1] for c in mine], dtype=torch.long)
        vals = torch.tensor([c[3] for c in mine], dtype=torch.float32)
        seen = threading.local()  # the input this thread's forward read at mlp_in, for its mlp_out in the same layer
        keep_error = self.error

        def read(x: torch.Tensor, offset: int) -> torch.Tensor:
            seen.x = x
            return x

        def write(y: torch.Tensor, offset: int) -> torch.Tensor:
            x = getattr(seen, "x", None)
            seen.x = None
            if x is None or x.shape[:2] != y.shape[:2]:
                raise RuntimeError(f"transcoder splice at layer {t.layer}: {t.address_out} ran without its input")
            W_enc, b_enc, W_dec, b_dec, th = self._on(t, y.device)
            pre = x.float() @ W_enc + b_enc
            f = t.activate(pre) if th is None else pre * (pre > th)
            where = None
            if any(c[2] is not None for c in mine):
                masks = []
                for c in mine:
                    m = (
                        None
                        if c[2] is None
                        else position_mask((c[2],), y.shape[:2], offset, state, special_ids, y.device)
                    )
                    masks.append(torch.ones(y.shape[:2], dtype=torch.bool, device=y.device) if m is None else m)
                where = torch.stack(masks, -1)
            new, edited = splice_rows(y, f, W_dec, b_dec, idx, vals, keep_error, where)
            later, skip = self._extra(t, y.device)
            if skip is not None and not keep_error:  # kept, the error term holds the skip path's write already
                new = new + x.float() @ skip
            if getattr(t, "clt_layers", ()):
                feats = getattr(clt, "feats", None)
                if feats is None or t.layer == min(t.clt_layers):
                    feats = clt.feats = {}
                for src, (f0, f1, dec) in feats.items():
                    if f0.shape[:-1] != y.shape[:-1]:
                        raise RuntimeError(f"CLT splice at layer {t.layer}: layer {src}'s features are of another run")
                    if t.layer in dec:
                        new = new + ((f1 - f0) if keep_error else f1) @ dec[t.layer]
                feats[t.layer] = (f, edited, later)
            return new.to(y.dtype)

        return [(t.address_in, read), (t.address_out, write)]

    def __repr__(self) -> str:
        def one(c: Clamp) -> str:
            at = "every position" if c[2] is None else f"@{c[2]}"
            return f"L{c[0]} #{c[1]} {at} -> {c[3]:g}"

        edits = ", ".join(one(c) for c in self.clamps) or "none"
        return (
            f"TranscoderSplice(layers {[t.layer for t in self.transcoders]}; error="
            f"{'kept' if self.error else 'dropped'}; edits: {edits})"
        )


def finite_value(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        value = value.item()
    elif not isinstance(value, (int, float)) and hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()  # numpy scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(
            f"{what}: value {shown_value(value)} ({type(value).__name__}) is not a number; pass a finite real number "
            "(0.0 ablates the feature)."
        )
    v = float(value)
    if not math.isfinite(v):
        raise InputError(f"{what}: value {v} is not finite; pass a finite real number (0.0 ablates the feature).")
    return v


def check_feature(spec: TranscoderSplice, layer: Any, feature: Any, what: str) -> tuple[int, int]:
    for name, v in (("layer", layer), ("feature", feature)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InputError(f"{what}: the {name} of ({shown_value(layer)}, {shown_value(feature)}) is not an int.")
    t = spec.of_layer(int(layer))
    if t is None:
        raise InputError(
            f"{what}: no transcoder at layer {layer} in this splice (it covers layers "
            f"{[t.layer for t in spec.transcoders]}); splice that layer's transcoder too (s.splice(tcs, error=True))."
        )
    if not 0 <= int(feature) < t.d_sae:
        raise InputError(
            f"{what}: feature {feature} is not a feature of layer {layer}'s transcoder; its features are 0 to "
            f"{t.d_sae - 1} (d_sae = {t.d_sae})."
        )
    return int(layer), int(feature)


def replaces_mlp(t: Any) -> bool:
    """Whether transcoder t stands in for its layer's MLP: it reads mlp_in.L (or resid_mid.L, before the MLP's norm)
    and predicts mlp_out.L (or mlp_out_post.L, the MLP with its post-norm). The splice and the attribution graph
    both replace MLPs, so both take only these."""
    L = t.layer
    reads = t.address_in in (Address.parse(f"mlp_in.{L}"), Address.parse(f"resid_mid.{L}"))
    return reads and t.address_out in (Address.parse(f"mlp_out.{L}"), Address.parse(f"mlp_out_post.{L}"))


def make_transcoder_splice(lm: Any, transcoders: Any, *, error: bool = False) -> TranscoderSplice:
    """A splice of a transcoder (or of every transcoder of a collection) on lm, checked against the model's facts
    before anything is placed."""
    if not isinstance(error, bool):
        raise InputError(f"splice: error={error!r}; pass error=True (keep the error term) or error=False.")
    items = [transcoders] if is_transcoder(transcoders) else list(transcoders)
    if not items:
        raise InputError("splice: no transcoder given; pass ie_lab.load_transcoders(path, s) or one of its layers.")
    layers = [t.layer for t in items]
    if len(set(layers)) != len(layers):
        raise InputError(f"splice: two transcoders for one layer ({sorted(layers)}); splice one per layer.")
    missing = sorted({c for t in items for c in getattr(t, "clt_layers", ())} - set(layers))
    if missing:
        raise InputError(
            f"splice: a cross-layer transcoder splices whole (each layer's output holds every earlier layer's writes); "
            f"its layers {missing} are missing: pass the whole ie_lab.load_transcoders(...) result."
        )
    held = []
    for t in sorted(items, key=lambda t: t.layer):
        L = t.layer
        if not replaces_mlp(t):
            raise InputError(
                f"splice: the transcoder at layer {L} reads {t.address_in} and predicts {t.address_out}; a transcoder "
                f"splice replaces an MLP: it reads mlp_in.{L} (or resid_mid.{L}) and predicts mlp_out.{L} (or "
                f"mlp_out_post.{L})."
            )
        for a in (t.address_in, t.address_out):
            try:
                a.check(lm.facts)
            except Exception as e:  # noqa: BLE001 - an AddressError or a layer past the model's
                raise InputError(
                    f"splice: {a} is not a point of this model ({e}); load the transcoders with this model "
                    "(ie_lab.load_transcoders(path, s))."
                ) from None
        if int(t.W_enc.shape[0]) != lm.facts.d_model:
            raise InputError(
                f"splice: the transcoder at layer {L} reads {int(t.W_enc.shape[0])}-wide rows, this model's are "
                f"{lm.facts.d_model}; load transcoders trained on this model."
            )
        held.append(copy.copy(t))  # later changes of t's attributes do not reach the spec (its tensors are shared)
    addrs = tuple(a for t in held for a in (t.address_in, t.address_out))
    return TranscoderSplice(lm, addrs, torch.zeros(0), transcoders=tuple(held), error=error)


# ---- intervene= ----------------------------------------------------------------------------------------


def _prompts_ids(lm: Any, prompt: Any) -> list[list[int]]:
    many = prepare_prompts(lm, prompt, rows=True)
    if many is not None:
        return [r[0].tolist() for r in many]
    ids, mask = prepare(lm, prompt)
    rows = []
    for i in range(ids.shape[0]):
        row = ids[i] if mask is None else ids[i][mask[i].bool()]
        rows.append(row.tolist())
    return rows


def _same_model(built_on: Any, lm: Any) -> bool:
    """Whether a graph built on ``built_on`` names positions and features of ``lm``: the same model, or, where lm's
    weights live elsewhere (a vLLM engine, which builds no graph: it has no gradients), a model loaded from the same
    checkpoint (the same folder or id, and the same facts)."""
    if built_on is lm:
        return True
    if built_on is None or not isinstance(lm, ClientModel) or isinstance(built_on, ClientModel):
        return False
    names = [str(getattr(m, "name", "") or "") for m in (built_on, lm)]
    where = [os.path.realpath(n) if os.path.isdir(n) else n for n in names]
    return bool(names[0]) and where[0] == where[1] and built_on.facts == lm.facts


def _node_target(node: Any, lm: Any, prompt_ids: Callable[[], list[list[int]]]) -> tuple[int, int, int, Any]:
    """(layer, feature, position, its transcoder) of a graph's feature node, checked against this call."""
    if node.kind != "feature":
        raise InputError(
            f"intervene: {node!r} is {'an' if node.kind[0] in 'aeiou' else 'a'} {node.kind} node, not a feature: only a transcoder feature has an activation "
            "to clamp; pick a feature node (graph.node('feature', layer, position, index) or graph.of_kind('feature'))."
        )
    origin = getattr(node, "origin", None)
    if origin is None:
        raise InputError(
            f"intervene: {node!r} carries no model or transcoders (a node made by hand or read from a graph file); "
            "use a node of a graph built here (ie_lab.attribution_graph(s, prompt, tcs)), or a (layer, feature) pair "
            "with the transcoders spliced into the call (splice=s.splice(tcs, error=True))."
        )
    if not _same_model(origin.model(), lm):
        raise InputError(
            f"intervene: {node!r} is a node of a graph built on another model; build the graph on this one "
            "(ie_lab.attribution_graph(s, prompt, tcs) with this Session; for a vLLM Session, with an eager Session "
            "of the same checkpoint: the same folder or id)."
        )
    t = origin.transcoders.get(node.layer)
    if t is None or not 0 <= int(node.index) < t.d_sae:
        raise InputError(f"intervene: {node!r} names no feature of its graph's transcoders; use a node of the graph.")
    graph_ids = list(origin.tokens)
    for row in prompt_ids():
        if row[: len(graph_ids)] != graph_ids:
            raise InputError(
                f"intervene: {node!r} is at position {node.position} of its graph's prompt ({len(graph_ids)} tokens), "
                "but this call's prompt does not begin with that prompt, so the position names another token: run the "
                "graph's own prompt (or a continuation of it), or pass a (layer, feature) pair to clamp the feature at "
                "every position."
            )
    return int(node.layer), int(node.index), int(node.position), t


def with_interventions(intervene: Any, spliced: list[Any], lm: Any, prompt: Any) -> list[Any]:
    """The call's splice= list with intervene= folded in: the clamps go to the call's own transcoder splice of their
    layer where there is one, and to a new splice with error=True of the other layers (that one appended)."""
    if not isinstance(intervene, dict):
        raise InputError(
            f"intervene= takes a dict {{node: value}}, got {type(intervene).__name__}; e.g. intervene={{graph.node("
            "'feature', layer, position, index): 0.0}} (0.0 ablates) or {(layer, feature): value}."
        )
    if not intervene:
        return spliced
    ids: list[list[int]] = []

    def prompt_ids() -> list[list[int]]:
        if not ids:
            ids.extend(_prompts_ids(lm, prompt))
        return ids

    known: dict[int, Any] = {}  # layer -> transcoder, from the call's transcoder splices, then the nodes
    for sp in spliced:
        if isinstance(sp, TranscoderSplice):
            for t in sp.transcoders:
                known.setdefault(t.layer, t)
    targets: list[tuple[int, int, int | None, float]] = []
    pairs = []
    for key, value in intervene.items():
        v = finite_value(value, f"intervene[{key!r}]")
        if hasattr(key, "kind") and hasattr(key, "key"):
            L, f, p, t = _node_target(key, lm, prompt_ids)
            if L in known and not _same(known[L], t):
                raise InputError(
                    f"intervene: {key!r} belongs to another transcoder of layer {L} than another node or the call's "
                    "splice: intervene with nodes of one graph (or the transcoders that graph was built with)."
                )
            known.setdefault(L, t)
            for c in getattr(t, "clt_layers", ()):  # a CLT splices whole: every layer of it, from the node's graph
                known.setdefault(c, key.origin.transcoders[c])
            targets.append((L, f, p, v))
        elif isinstance(key, tuple) and len(key) == 2:
            pairs.append((key, v))
        else:
            raise InputError(
                f"intervene: the key {shown_value(key)} is neither a graph's feature node nor a (layer, feature) pair; "
                "pass graph.node('feature', layer, position, index) or (layer, feature)."
            )
    for (layer, feature), v in pairs:
        if isinstance(layer, numbers.Integral) and not isinstance(layer, bool) and int(layer) not in known:
            raise InputError(
                f"intervene: ({layer}, {feature}) names a feature of no transcoder this call knows (layers "
                f"{sorted(known)}); splice the transcoders into the call (splice=s.splice(tcs, error=True)) or "
                "intervene on a graph's nodes, whose graph knows its transcoders."
            )
        probe = TranscoderSplice(lm, (), torch.zeros(0), transcoders=tuple(known.values()))
        L, f = check_feature(probe, layer, feature, "intervene")
        targets.append((L, f, None, v))
    out = list(spliced)
    placed: set[int] = set()
    for i, sp in enumerate(out):
        if isinstance(sp, TranscoderSplice):
            mine = [c for c in targets if sp.of_layer(c[0]) is not None and c[0] not in placed]
            if mine:
                out[i] = sp.with_clamps(mine)
            placed |= {t.layer for t in sp.transcoders}
    rest = [c for c in targets if c[0] not in placed]
    if rest:
        layers = sorted({c[0] for c in rest} | {c for r in rest for c in getattr(known[r[0]], "clt_layers", ())})
        spec = make_transcoder_splice(lm, [known[L] for L in layers], error=True)
        out.append(spec.with_clamps(rest))
    return out
