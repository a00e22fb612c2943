"""The attribution graph as a record: its nodes, its adjacency (targets x sources), the lookups, and pruning by
influence on the logits. Built by ie_lab/eager/attribution_graph.py; plain torch, no model in it.

Pruning (``Graph.prune``), the exact rule (docs/CIRCUITS.md "Pruning"):
  1. A = |adjacency| with each row (a target's incoming edges) divided by its sum (a row of zeros stays zero).
  2. w: each logit node weighted by its probability over the logit nodes' total, every other node 0.
  3. Influence of node n: (w (A + A^2 + A^3 + ...))[n], the logit-weighted sum over every path into the logits of
     the products of normalised edge weights (the series ends: the graph has no cycle).
  4. Nodes: every embedding, error, bias and logit node is kept; feature nodes in decreasing influence until their
     cumulative influence reaches node_threshold of all the features' influence (ties in order of node index).
  5. Edges among the kept nodes: A and the influence recomputed on that subgraph; an edge's score is
     A[target, source] x (influence[target] + w[target]); edges in decreasing score until their cumulative score
     reaches edge_threshold of the total; the rest set to 0. A feature left with no kept edge is dropped.
The pruned graph keeps the original edge weights, so its rows no longer sum to the targets' values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import InputError

KINDS = ("embedding", "feature", "error", "bias", "logit")
# What node(kind, ...) takes after the kind.
KEYS = {
    "embedding": ("position",),
    "feature": ("layer", "position", "index"),
    "error": ("layer", "position"),
    "bias": ("name",),
    "logit": ("index",),
}


@dataclass(frozen=True, eq=False)
class GraphOrigin:
    """What a graph was built from: its model (a weak reference, so a graph does not keep a closed model alive), its
    transcoders by layer and its prompt's token ids."""

    model: Any
    transcoders: dict[int, Any]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Node:
    """One node. feature: layer, position, index (the feature), activation and pre-activation; error: layer,
    position (the MLP's output minus the transcoder's); embedding: position (what the stack's input holds there);
    bias: name (a parameter, written at every position); logit: index (the token id), its probability and its
    demeaned logit (value)."""

    kind: str
    layer: int | None = None
    position: int | None = None
    index: int | None = None
    name: str = ""
    token: str = ""  # the prompt's token at position, or the logit's token
    activation: float = 0.0  # feature: its activation (the edges out of it are per unit of its write times this)
    value: float = 0.0  # feature: pre-activation; logit: the demeaned logit; the sum of the edges into it
    probability: float = 0.0  # logit nodes
    # where the node was built (GraphOrigin: the model, the transcoders, the prompt's ids), so that intervene= can
    # clamp a feature node on its own (core/transcoder_splice.py); None for a node read from a file or made by hand
    origin: Any = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple:
        return (self.kind,) + tuple(getattr(self, k) for k in KEYS[self.kind])

    def __repr__(self) -> str:
        if self.kind == "feature":
            return f"Node(feature L{self.layer} @{self.position} #{self.index}, act {self.activation:.3g})"
        if self.kind == "error":
            return f"Node(error L{self.layer} @{self.position})"
        if self.kind == "embedding":
            return f"Node(embedding @{self.position} {self.token!r})"
        if self.kind == "bias":
            return f"Node(bias {self.name})"
        return f"Node(logit {self.index} {self.token!r}, p={self.probability:.3f})"


@dataclass
class Graph:
    """nodes (in the order of the adjacency's rows and columns: features, errors, embeddings, biases, logits) and
    adjacency [targets, sources]: adjacency[t, s] is source s's direct linear effect on target t in the local
    replacement model (docs/CIRCUITS.md)."""

    nodes: list[Node]
    adjacency: torch.Tensor
    tokens: list[int]
    str_tokens: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {n.key: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, node: Node) -> int:
        i = self._index.get(node.key)
        if i is None:
            raise InputError(f"{node!r} is not a node of this graph.")
        return i

    def node(self, kind: str, *key: Any) -> Node:
        """graph.node("logit", token_id), ("feature", layer, position, index), ("error", layer, position),
        ("embedding", position), ("bias", name)."""
        if kind not in KEYS:
            raise InputError(f"kind {kind!r}: one of {list(KEYS)}.")
        if len(key) != len(KEYS[kind]):
            raise InputError(f"graph.node({kind!r}, ...) takes {', '.join(KEYS[kind])}; got {len(key)} value(s).")
        i = self._index.get((kind,) + tuple(key))
        if i is None:
            near = [n for n in self.nodes if n.kind == kind][:5]
            raise InputError(f"no {kind} node {key} in this graph; some that are: {near}.")
        return self.nodes[i]

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    def edges_into(self, node: Node) -> dict[Node, float]:
        """Source -> weight, the nonzero edges into node (their sum is node.value on an unpruned graph)."""
        row = self.adjacency[self.index(node)]
        return {self.nodes[int(j)]: float(row[j]) for j in row.nonzero().flatten()}

    def edges_from(self, node: Node) -> dict[Node, float]:
        """Target -> weight, the nonzero edges out of node."""
        col = self.adjacency[:, self.index(node)]
        return {self.nodes[int(i)]: float(col[i]) for i in col.nonzero().flatten()}

    def logit_weights(self) -> torch.Tensor:
        w = torch.zeros(len(self.nodes), dtype=torch.float64)
        for i, n in enumerate(self.nodes):
            if n.kind == "logit":
                w[i] = n.probability
        return w / w.sum() if float(w.sum()) > 0 else w

    def influence(self) -> torch.Tensor:
        """[nodes]: each node's influence on the logits (steps 1-3 of the module's rule)."""
        return _influence(self.adjacency, self.logit_weights())

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Graph:
        """The graph with the features and edges that carry node_threshold / edge_threshold of the influence on the
        logits (the rule: this module's docstring, docs/CIRCUITS.md "Pruning")."""
        for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise InputError(f"{name}={v!r}: a fraction in (0, 1].")
        infl = self.influence()
        feats = [i for i, n in enumerate(self.nodes) if n.kind == "feature"]
        keep = [i for i, n in enumerate(self.nodes) if n.kind != "feature"]
        if feats:
            fi = infl[feats]
            order = sorted(range(len(feats)), key=lambda j: (-float(fi[j]), feats[j]))
            total, run = float(fi.sum()), 0.0
            for j in order:
                if total > 0 and run >= node_threshold * total:
                    break
                keep.append(feats[j])
                run += float(fi[j])
        keep.sort()
        sub = self.adjacency[keep][:, keep].clone()
        w = self.logit_weights()[keep]
        a = _normalised(sub)
        infl2 = _influence(sub, w)
        score = a * (infl2 + w)[:, None].to(a.dtype)
        flat = score.flatten()
        total = float(flat.sum())
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if total > 0:
            vals, idx = flat.sort(descending=True, stable=True)
            cum = vals.cumsum(0)
            n_keep = int((cum < edge_threshold * total).sum()) + 1
            mask[idx[:n_keep]] = True
        sub = torch.where(mask.view_as(sub), sub, torch.zeros_like(sub))
        alive = [
            j
            for j, i in enumerate(keep)
            if self.nodes[i].kind != "feature" or bool(sub[j].any()) or bool(sub[:, j].any())
        ]
        nodes = [self.nodes[keep[j]] for j in alive]
        info = dict(self.info, pruned={"node_threshold": node_threshold, "edge_threshold": edge_threshold})
        return replace(self, nodes=nodes, adjacency=sub[alive][:, alive], info=info)

    def to_json(self, path: Any, slug: str | None = None, scan: str = "ie_lab") -> str:
        """Write the graph as circuit-tracer's create_graph_files does (the file Neuronpedia's viewer reads; bias
        nodes left out, the viewer has none): ie_lab/core/graph_json.py. Prune first (graph.prune()) for the
        viewer: it draws every node and edge it is given."""
        from .graph_json import write

        return write(self, path, slug, scan)

    @classmethod
    def from_json(cls, path: Any) -> Graph:
        """A graph file (circuit-tracer's layout) read back: its nodes and edges (no bias nodes)."""
        from .graph_json import read

        nodes, adjacency, tokens, str_tokens, info = read(path)
        return cls([Node(**n) for n in nodes], adjacency, tokens, str_tokens, info)

    def __repr__(self) -> str:
        counts = {k: sum(1 for n in self.nodes if n.kind == k) for k in KINDS}
        edges = int((self.adjacency != 0).sum())
        return f"Graph({len(self.nodes)} nodes {counts}, {edges} edges, prompt {''.join(self.str_tokens)!r})"


def _normalised(adj: torch.Tensor) -> torch.Tensor:
    a = adj.abs().double()
    return a / a.sum(1, keepdim=True).clamp_min(1e-300)


def _influence(adj: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = _normalised(adj)
    x = w.double() @ a
    total = x.clone()
    for _ in range(len(w)):  # a path visits each node once at most: the series ends within len(w) terms
        x = x @ a
        if not bool(x.any()):
            break
        total += x
    return total


def completeness(graph: Graph) -> torch.Tensor:
    """[targets]: per feature and logit node, |sum of incoming edges - value| / max(|value|, 1e-2 x sum of
    |incoming edges|, 1e-3 x that sum's mean over the targets)."""
    rows = [i for i, n in enumerate(graph.nodes) if n.kind in ("feature", "logit")]
    if not rows:
        return torch.zeros(0)
    adj = graph.adjacency[rows].double()
    vals = torch.tensor([graph.nodes[i].value for i in rows], dtype=torch.float64)
    l1 = adj.abs().sum(1)
    # a value near 0 whose edges are near 0 too (a ReLU feature just above 0) is measured against the graph's scale
    denom = torch.maximum(vals.abs(), 1e-2 * l1).clamp_min(max(1e-3 * float(l1.mean()), 1e-12))
    return (adj.sum(1) - vals).abs() / denom
