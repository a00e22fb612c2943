"""What the graph panel draws, computed in the kernel and testable without a browser: ``graph_data``.

A pruned attribution graph (ie_lab/core/graph.py) as flat arrays: its drawn nodes (embedding, feature, error, logit;
bias nodes are not drawn, they are counted in a note with their summed weight) with their row (embeddings 0, layer
L's features and error L + 1, logits n_layers + 1), their column (the position), an id the front end names them by,
and its edges (source, target, weight) among the drawn nodes: the pruned adjacency's nonzero entries, unchanged.

A transcoder (ie_lab/transcoders.py's Transcoder) is what ``encode_corpus`` and ``feature_data`` read of an SAE
itself (``address``, ``encode``, ``W_dec``, ``d_sae``, ``steer``), so a transcoder feature's top contexts are its
activations over a corpus at the point its layer reads (``mlp_in``, or ``resid_mid`` for a CLT reading there) and its
promoted and suppressed tokens are its decoder row into its own layer's output (hence the residual) through the final
norm and the unembedding: its direct effect on the logits, not through the later layers (a CLT feature's writes into
later layers are on the graph's edges).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.graph import Graph, Node

DRAWN = ("embedding", "feature", "error", "logit")  # kind codes 0..3 in the arrays sent


def node_id(n: Node) -> str:
    """The id the front end names a node by: "emb:P", "feat:L:P:I", "err:L:P", "logit:T" (T the token id)."""
    if n.kind == "embedding":
        return f"emb:{n.position}"
    if n.kind == "feature":
        return f"feat:{n.layer}:{n.position}:{n.index}"
    if n.kind == "error":
        return f"err:{n.layer}:{n.position}"
    if n.kind == "logit":
        return f"logit:{n.index}"
    return f"bias:{n.name}"


@dataclass
class GraphData:
    """The drawn part of one (pruned) graph: per node kind, row, column, index, value, influence, id, label; per edge
    source and target (indices into the nodes) and weight."""

    ids: list[str]
    labels: list[str]
    kind: np.ndarray  # int32: DRAWN's index
    row: np.ndarray  # int32: 0 embeddings, L + 1 layer L's features and error, n_layers + 1 logits
    col: np.ndarray  # int32: the position (logits: the last)
    index: np.ndarray  # int32: the feature's index, the logit's token id, -1 otherwise
    value: np.ndarray  # float32: a feature's activation, a logit's probability, 0 otherwise
    influence: np.ndarray  # float32: each node's influence on the logits (graph.influence on this graph)
    src: np.ndarray  # int32 [edges]
    dst: np.ndarray  # int32 [edges]
    weight: np.ndarray  # float32 [edges]
    n_layers: int
    note: str


def label(n: Node) -> str:
    if n.kind == "feature":
        return f"feature {n.index} · layer {n.layer} · pos {n.position} {n.token!r} · activation {n.activation:.4g}"
    if n.kind == "error":
        return f"error · layer {n.layer} · pos {n.position} {n.token!r}"
    if n.kind == "embedding":
        return f"embedding · pos {n.position} {n.token!r}"
    return f"logit {n.token!r} (token {n.index}) · p = {n.probability:.4g}"


def graph_data(g: Graph) -> GraphData:
    n_layers = int(g.info.get("n_layers", 1 + max((n.layer for n in g.nodes if n.layer is not None), default=-1)))
    last = len(g.tokens) - 1
    keep = [i for i, n in enumerate(g.nodes) if n.kind in DRAWN]
    bias = [i for i, n in enumerate(g.nodes) if n.kind == "bias"]
    infl = g.influence().float()
    nodes = [g.nodes[i] for i in keep]

    def row(n: Node) -> int:
        return 0 if n.kind == "embedding" else n_layers + 1 if n.kind == "logit" else int(n.layer) + 1  # type: ignore[arg-type]

    sub = g.adjacency[keep][:, keep]
    dst, src = sub.nonzero(as_tuple=True)
    note = ""
    if bias:
        out = g.adjacency[:, bias]
        n_b = int((out[keep] != 0).sum())
        note = (
            f"{len(bias)} bias nodes not drawn (the parameters the frozen model adds at every position: "
            f"{', '.join(g.nodes[i].name for i in bias[:3])}{'...' if len(bias) > 3 else ''}); "
            f"{n_b} edges from them, summing to {float(out[keep].sum()):.4g}"
        )
    return GraphData(
        ids=[node_id(n) for n in nodes],
        labels=[label(n) for n in nodes],
        kind=np.array([DRAWN.index(n.kind) for n in nodes], dtype=np.int32),
        row=np.array([row(n) for n in nodes], dtype=np.int32),
        col=np.array([last if n.kind == "logit" else int(n.position) for n in nodes], dtype=np.int32),  # type: ignore[arg-type]
        index=np.array([n.index if n.kind in ("feature", "logit") else -1 for n in nodes], dtype=np.int32),
        value=np.array(
            [n.activation if n.kind == "feature" else n.probability if n.kind == "logit" else 0.0 for n in nodes],
            dtype=np.float32,
        ),
        influence=infl[keep].numpy().astype(np.float32),
        src=src.numpy().astype(np.int32),
        dst=dst.numpy().astype(np.int32),
        weight=sub[dst, src].float().numpy().astype(np.float32),
        n_layers=n_layers,
        note=note,
    )


LOGIT_NOTE = (
    "a transcoder feature: its decoder row (what it adds to the MLP's output at layer {layer}, hence to the residual) "
    "through the final norm and the unembedding: its direct effect on the logits, not what reaches them through the "
    "later layers"
)
