"""qk_attribution(): why a head attended where it did, in an attribution graph's nodes, on the eager backend.

An attribution graph freezes every attention pattern, so an edge through a head says nothing about why the head
looked there. This decomposes the head's pre-softmax score at one (query, key) entry instead. In the graph's local
replacement model (docs/CIRCUITS.md: each MLP a transcoder plus an error node, every norm's scale frozen at the run's
value, every earlier pattern frozen) the residual stream at any layer is linear in the nodes' writes (embeddings,
features, errors, biases); so is the query at the query position and the key at the key position: q_proj / k_proj
are linear, rotary embeddings are a fixed rotation per position (applied to each contribution), and a query or key
norm (Qwen 3's q_norm / k_norm, OLMo 2's) is frozen at the run's scale like every other norm (it is not linear: its
gradient would not sum to its output). Then

    score = scaling * q . k + position_bias = sum over (query node i, key node j) of scaling * q_i . k_j + position_bias

exactly: a bilinear sum over pairs of nodes, plus the mask's additive term at that entry (ALiBi's per-head
distance bias, a constant; 0 on RoPE and learned-position families). q_i: node i's contribution to the query,
read as the graph reads an edge (one backward per query and key coordinate, in batches of copies of the prompt,
through attribution_graph's frozen forward with that layer's query and key left live): the gradient at the node's
write dotted with the write.

Refused (naming why): soft-capped attention scores (tanh of q . k is not bilinear), a layer whose kernel is called
several times with different queries or keys (differential attention), a masked entry (its score is -inf), and
whatever attribution_graph refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..address import Address
from ..arch import attention_tap
from ..core.graph import Graph, Node
from ..errors import CapabilityUnsupported, InputError, shown_value
from ..ops.attention import allowed_mask
from ..ops.attribution import FrozenNorm, freeze_norm
from .attribution import _norm_forms, _param
from .attribution_graph import (
    _bias_names,
    _check_model,
    _clean_run,
    _edges,
    _errors,
    _first_tensor,
    _freeze,
    _frozen_forward,
)
from .model import lm_of

# Relative (to |score|, or to scaling x |q| x |k| for a score near 0); beyond it the decomposition is not the score.
COMPLETENESS_TOL = {torch.float32: 1e-3, torch.float64: 1e-3}
COMPLETENESS_TOL_16BIT = 0.1


@dataclass(frozen=True)
class QKAttribution:
    """The score of one head at (query_pos, key_pos) as a sum over pairs of nodes (docs/CIRCUITS.md "Why a head
    attends: QK attribution"). nodes: every node with a nonzero contribution to the query or the key; query / key
    [nodes, head_dim]: each node's contribution to the post-rotary query at query_pos / key at key_pos (their sums
    are the model's query and key); pairs: the `top` pairs (query node, key node, scaling x q_i . k_j) by size;
    query_marginals / key_marginals: each node's share with the other side whole (scaling x q_i . k, scaling x
    q . k_j), largest first; score: the model's own pre-softmax score there (eager's attn_scores); total: the sum
    of every pair plus position_bias."""

    layer: int
    head: int
    kv_head: int
    query_pos: int
    key_pos: int
    score: float
    scaling: float
    position_bias: float
    nodes: list[Node]
    query: torch.Tensor
    key: torch.Tensor
    pairs: list[tuple[Node, Node, float]]
    query_marginals: dict[Node, float]
    key_marginals: dict[Node, float]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> float:
        q, k = self.query.double().sum(0), self.key.double().sum(0)
        return float(self.scaling * (q @ k)) + self.position_bias

    @property
    def completeness(self) -> float:
        """|total - score| relative to max(|score|, 1e-3 x scaling x |q| x |k|)."""
        q, k = self.query.double().sum(0), self.key.double().sum(0)
        scale = max(abs(self.score), 1e-3 * self.scaling * float(q.norm() * k.norm()), 1e-12)
        return abs(self.total - self.score) / scale

    def pair(self, query_node: Node, key_node: Node) -> float:
        """scaling x (query_node's query contribution . key_node's key contribution): 0 for a node not in nodes."""
        at = {n.key: i for i, n in enumerate(self.nodes)}
        i, j = at.get(query_node.key), at.get(key_node.key)
        if i is None or j is None:
            return 0.0
        return float(self.scaling * (self.query[i].double() @ self.key[j].double()))

    def matrix(self) -> torch.Tensor:
        """[nodes, nodes]: every pair's term, query nodes by rows, key nodes by columns (memory: nodes squared)."""
        return self.scaling * self.query.double() @ self.key.double().T

    def __repr__(self) -> str:
        return (
            f"QKAttribution(layer {self.layer} head {self.head}, query @{self.query_pos} -> key @{self.key_pos}: "
            f"score {self.score:.4g} = {len(self.nodes)}x{len(self.nodes)} pairs + position bias "
            f"{self.position_bias:.3g}, relative error {self.completeness:.2g})"
        )


def _check_int(name: str, v: Any, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
        raise InputError(f"{name} must be an integer in [0, {hi}), got {shown_value(v)}.")
    return v


def qk_attribution(
    model: Any,
    graph: Graph,
    layer: int,
    head: int,
    query_pos: int,
    key_pos: int,
    *,
    top: int = 20,
    batch_size: int = 32,
) -> QKAttribution:
    """Head `head` of layer `layer`'s pre-softmax score at (query_pos, key_pos) on the graph's prompt, as a sum over
    pairs of the graph's nodes (the query side's and the key side's) plus the mask's additive term. model: the
    Session (or loaded model) the graph was built on; graph: what ie_lab.attribution_graph returned (pruned or not:
    a feature a pruned graph dropped joins its layer's error node, as max_features does); top: how many pairs to
    list; batch_size: query and key coordinates per backward pass."""
    lm = lm_of(model)
    _check_family(lm)
    if not isinstance(graph, Graph):
        raise InputError(f"graph must be what ie_lab.attribution_graph returns, got {type(graph).__name__}.")
    origin = next((n.origin for n in graph.nodes if n.origin is not None), None)
    if origin is None:
        raise InputError(
            "this graph has no model behind it (read from a file, or without feature nodes): rebuild it with "
            "ie_lab.attribution_graph(s, prompt, transcoders) and pass that."
        )
    if origin.model() is not lm:
        raise InputError("this graph was built on another model: pass the Session or model it was built on.")
    for name, v in (("top", top), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be an integer >= 1, got {shown_value(v)}.")
    f = lm.facts
    n_layers = len(lm.binding.layers)
    S = len(origin.tokens)
    layer = _check_int("layer", layer, n_layers)
    head = _check_int("head", head, f.n_heads)
    query_pos = _check_int("query_pos", query_pos, S)
    key_pos = _check_int("key_pos", key_pos, S)
    by_layer = _check_model(lm, _Collection(origin.transcoders))
    ids = torch.tensor([list(origin.tokens)], device=lm.device)  # the graph's prompt, as it tokenised it
    with lm.lock:
        return _attribute(lm, graph, ids, by_layer, layer, head, query_pos, key_pos, top, batch_size)


def _check_family(lm: Any) -> None:
    """The family's refusals, before any graph is read: attribution_graph's own (through _check_model with no
    transcoders: ALiBi's families on this transformers, Bloom and MPT, compute attention in their own module and are
    refused there), then what makes a score no sum over pairs."""
    _check_model(lm, _Collection({}))
    why = None
    if lm.facts.attn_logit_softcap:
        why = "its attention scores are soft-capped (softcap x tanh(q.k / softcap)), which is not bilinear in q and k"
    for lb in lm.binding.layers:
        if lb.kernel_calls > 1 and not lb.kernel_same_qk:
            why = f"layer {lb.index} calls the attention kernel {lb.kernel_calls} times with different queries or keys"
    if why is not None:
        raise CapabilityUnsupported(
            f"qk_attribution on {lm.binding.family}",
            f"{why}, so its score is no sum over pairs of nodes",
            "the graph's edges (attribution_graph) still work on it",
        )


class _Collection(list):
    """The graph's transcoders by layer as the collection _check_model reads (it iterates and reads .layers)."""

    def __init__(self, by_layer: dict[int, Any]) -> None:
        super().__init__(by_layer[L] for L in sorted(by_layer))
        self.layers = sorted(by_layer)


def _attribute(
    lm: Any,
    graph: Graph,
    ids: torch.Tensor,
    by_layer: dict[int, Any],
    layer: int,
    head: int,
    qp: int,
    kp: int,
    top: int,
    batch_size: int,
    freeze_qk_norms: bool = True,
) -> QKAttribution:
    """The record, computed under the model's lock; freeze_qk_norms off: the query and key norms left live (the
    tests' wrong answer, which the completeness check must refuse)."""
    n_layers, S = len(lm.binding.layers), ids.shape[1]
    lb = lm.binding.layers[layer]
    ins = {L: by_layer[L].address_in if L in by_layer else Address.parse(f"mlp_in.{L}") for L in range(n_layers)}
    outs = {L: by_layer[L].address_out if L in by_layer else Address.parse(f"mlp_out.{L}") for L in range(n_layers)}
    qk_norms = [m for m in dict.fromkeys((lb.q_norm, lb.k_norm)) if m is not None]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    calls: list[attention_tap.AttentionCall] = []

    def record(m: Any, args: tuple, kwargs: dict, y: Any) -> None:
        seen[id(m)] = (_first_tensor(args, kwargs)[0].detach().clone(), y[0].detach().clone())

    handles = []
    try:  # the clean run, also reading this layer's attention call (scale, mask) and its query / key norms
        for m in qk_norms:
            handles.append(m.register_forward_hook(record, with_kwargs=True))
        with torch.no_grad(), attention_tap.listening({id(lb.attn): lambda m, c: calls.append(c)}):
            clean = _clean_run(lm, ids, ins, outs)
    finally:
        for h in handles:
            h.remove()
    call = calls[0]
    scaling = call.scaling
    q_run, k_run = call.query[0].float(), call.key[0].float()  # [H, S, d], [KV, S, d]
    kv_head = head // (q_run.shape[0] // k_run.shape[0])
    mask = call.attention_mask
    if not bool(allowed_mask(S, S, mask, call.kwargs.get("sliding_window"), q_run.device)[0, 0, qp, kp]):
        raise InputError(
            f"key position {kp} is masked for query position {qp} at layer {layer} (causal, or outside a sliding "
            f"window): its score is -inf, not a sum. Pick key_pos <= query_pos within the window."
        )
    bias = 0.0
    if mask is not None and mask.dtype != torch.bool and mask.dim() == 4:  # ALiBi rides in the additive mask
        add = mask[..., -S:, -S:]
        bias = float(add[0, min(head, add.shape[1] - 1), qp, kp])
    score = float(scaling * (q_run[head, qp] @ k_run[kv_head, kp])) + bias  # as eager's attn_scores computes it
    tol = 1e-4 if lm.dtype in (torch.float32, torch.float64) else 3e-2
    frozen = _freeze(lm, clean, outs)
    qk_frozen: dict[int, FrozenNorm] = {}
    for m in qk_norms:
        x, y = seen[id(m)]
        fz = freeze_norm(x, y, _param(m, "weight"), _param(m, "bias"), tol, _norm_forms(m))
        if fz is None:
            raise CapabilityUnsupported(
                f"qk_attribution on {lm.binding.family}",
                f"layer {layer}'s query or key norm ({type(m).__name__}) is not input * gain / scale on this run, so "
                "its scale cannot be frozen",
                "a family whose query and key norms are RMSNorm or LayerNorm (or have none)",
            )
        qk_frozen[id(m)] = fz
    if not freeze_qk_norms:
        qk_norms = []
    feats = [(n.layer, n.position, n.index, n.activation, n.value) for n in graph.of_kind("feature")]
    errors = _errors(clean, by_layer, feats, n_layers, S)
    bias_names, bias_rows = _bias_names(lm, by_layer)
    d = q_run.shape[-1]
    targets = [("q", head, qp, i) for i in range(d)] + [("k", kv_head, kp, i) for i in range(d)]

    def frozen_qk_norm(m: Any, args: tuple, kwargs: dict, y: Any) -> Any:
        x = _first_tensor(args, kwargs)
        return y.detach() + qk_frozen[id(m)].apply((x - x.detach()).float()).to(y.dtype)

    handles = []
    try:
        for m in qk_norms:
            handles.append(m.register_forward_hook(frozen_qk_norm, with_kwargs=True))
        B = min(batch_size, len(targets))
        fwd = _frozen_forward(lm, ids, B, clean, frozen, bias_rows, True, ins, outs, by_layer, qk_layer=layer)
    finally:
        for h in handles:
            h.remove()
    rows = torch.zeros(len(targets), len(feats) + n_layers * S + S + len(bias_names))
    for start in range(0, len(targets), B):
        chunk = targets[start : start + B]
        rows[start : start + len(chunk)] = _edges(
            fwd, chunk, clean, by_layer, feats, errors, bias_names, bias_rows, S, retain=start + B < len(targets)
        )
    del fwd
    nodes = _source_nodes(graph, feats, n_layers, S, bias_names)
    Q, K = rows[:d].T.contiguous(), rows[d:].T.contiguous()  # [sources, d]
    keep = ((Q != 0).any(1) | (K != 0).any(1)).nonzero().flatten()
    nodes, Q, K = [nodes[int(i)] for i in keep], Q[keep], K[keep]
    rec = _record(layer, head, kv_head, qp, kp, score, scaling, bias, nodes, Q, K, top)
    err = rec.completeness
    rec.info.update(
        completeness_relative_error=err,
        frozen="norm scales (query and key norms too) and every attention pattern at this prompt's values; "
        "this layer's query and key live",
        query_norm_frozen=bool(qk_norms),
    )
    if err > COMPLETENESS_TOL.get(lm.dtype, COMPLETENESS_TOL_16BIT):
        raise CapabilityUnsupported(
            f"qk_attribution on {lm.binding.family}",
            f"the pairs miss the score by {err:.2g} (relative): this layer's query and key are not linear in the nodes' "
            "writes the way ie_lab builds them (a nonlinearity between the residual and q, k beyond norms and rotary)",
            "report the family; the graph's edges still hold",
        )
    return rec


def _source_nodes(graph: Graph, feats: list, n_layers: int, S: int, bias_names: list[str]) -> list[Node]:
    """The sources in _edges' column order (features, errors, embeddings, biases): the graph's own nodes where it has
    them (a bias under frozen patterns, such as q_proj's, is no node of the graph: made here)."""

    def own(kind: str, *key: Any, **fields: Any) -> Node:
        try:
            return graph.node(kind, *key)
        except InputError:
            return Node(kind, **fields)

    toks = graph.str_tokens
    nodes = [own("feature", L, p, i) for (L, p, i, _, _) in feats]
    nodes += [own("error", L, p, layer=L, position=p, token=toks[p]) for L in range(n_layers) for p in range(S)]
    nodes += [own("embedding", p, position=p, token=toks[p]) for p in range(S)]
    nodes += [own("bias", n, name=n) for n in bias_names]
    return nodes


def _record(
    layer: int,
    head: int,
    kv_head: int,
    qp: int,
    kp: int,
    score: float,
    scaling: float,
    bias: float,
    nodes: list[Node],
    Q: torch.Tensor,
    K: torch.Tensor,
    top: int,
) -> QKAttribution:
    q, k = Q.double().sum(0), K.double().sum(0)
    qm = (scaling * Q.double() @ k).tolist()
    km = (scaling * K.double() @ q).tolist()
    # the top pairs, a block of query rows at a time (nodes squared terms in all)
    best: list[tuple[float, int, int]] = []
    for start in range(0, len(nodes), 1024):
        block = scaling * Q[start : start + 1024].double() @ K.double().T
        n = min(top, block.numel())
        vals, idx = block.abs().flatten().topk(n)
        best += [(float(block.flatten()[j]), start + int(j) // block.shape[1], int(j) % block.shape[1]) for j in idx]
    best = sorted(best, key=lambda t: -abs(t[0]))[:top]
    return QKAttribution(
        layer,
        head,
        kv_head,
        qp,
        kp,
        score,
        scaling,
        bias,
        nodes,
        Q,
        K,
        [(nodes[i], nodes[j], v) for v, i, j in best],
        dict(sorted(((nodes[i], v) for i, v in enumerate(qm) if v != 0), key=lambda t: -abs(t[1]))),
        dict(sorted(((nodes[i], v) for i, v in enumerate(km) if v != 0), key=lambda t: -abs(t[1]))),
    )
