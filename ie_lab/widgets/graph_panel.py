"""The attribution-graph panel: ``s.graph_panel(graph, transcoders=None, corpus=None)``, a pruned graph drawn by
layer (rows: embeddings at the bottom, each layer's features and error above, the logits at the top) and position
(columns: the prompt's tokens).

Hover a node for its label and its strongest incoming and outgoing edges; click a feature node and the kernel sends
that feature's dashboard (its top contexts over ``corpus``, its promoted and suppressed tokens: feature_data over a
the layer's Transcoder, which reads as an SAE), drawn below the graph; select several feature nodes (shift-click) and name the group: the
kernel keeps ``panel.supernodes`` ({name: [node ids]}) and the drawing shows one box with the group's edges summed;
change the node and edge thresholds and the kernel prunes the full graph again (``graph.prune``) and sends the new
subgraph. The numbers travel as binary buffers (float32 / int32); what the panel draws is ``graph_panel_data``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from ..core.graph import Graph
from ..errors import InputError, plural
from . import _base, _static
from .dashboard import FeatureTraits
from .dashboard_data import MAX_TOP, EncodedCorpus, encode_corpus, feature_data
from .graph_panel_data import LOGIT_NOTE, graph_data, node_id


def _f32(a: Any) -> bytes:
    return np.asarray(a, dtype="<f4").tobytes()


def _i32(a: Any) -> bytes:
    return np.asarray(a, dtype="<i4").tobytes()


MAX_GROUP = 64  # feature nodes in one supernode
MAX_NAME = 60


class GraphPanel(FeatureTraits, _base.Panel):
    """An attribution graph's panel; ``prune(...)``, ``select(node id)``, ``group(name, ids)`` and ``ungroup(name)``
    do from Python what the panel's controls do. ``shown``: the pruned graph drawn; ``data_sent``: its arrays as sent
    (GraphData); ``data``: the selected feature's FeatureData."""

    _esm = _static.bundle("graph.js")
    COMMANDS = {
        "prune": {"node_threshold": _base.number(1e-3, 1.0), "edge_threshold": _base.number(1e-3, 1.0)},
        "select": {"node": _base.text(80)},
        "group": {"name": _base.text(MAX_NAME), "nodes": _base.text_list(MAX_GROUP, 80)},
        "ungroup": {"name": _base.text(MAX_NAME)},
    }

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)  # the prompt's tokens (the columns)
    n_layers = traitlets.Int(0).tag(sync=True)
    node_threshold = traitlets.Float(0.8).tag(sync=True)
    edge_threshold = traitlets.Float(0.98).tag(sync=True)
    node_ids = traitlets.List(traitlets.Unicode()).tag(sync=True)
    node_labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    node_kind = traitlets.Bytes(b"").tag(sync=True)  # int32: 0 embedding, 1 feature, 2 error, 3 logit
    node_row = traitlets.Bytes(b"").tag(sync=True)  # int32
    node_col = traitlets.Bytes(b"").tag(sync=True)  # int32
    node_value = traitlets.Bytes(b"").tag(sync=True)  # float32: activation / probability
    node_influence = traitlets.Bytes(b"").tag(sync=True)  # float32
    edge_src = traitlets.Bytes(b"").tag(sync=True)  # int32
    edge_dst = traitlets.Bytes(b"").tag(sync=True)  # int32
    edge_weight = traitlets.Bytes(b"").tag(sync=True)  # float32
    graph_note = traitlets.Unicode("").tag(sync=True)
    supernodes = traitlets.Dict().tag(sync=True)  # name -> [node ids]
    selected = traitlets.Unicode("").tag(sync=True)  # the feature node whose dashboard is below ("" none)
    dashboard_note = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        session: Any,
        graph: Graph,
        *,
        transcoders: Any = None,
        corpus: Any = None,
        node_threshold: float = 0.8,
        edge_threshold: float = 0.98,
        top: int = 8,
    ):
        if not isinstance(graph, Graph):
            raise InputError(
                f"graph_panel needs an ie_lab.Graph (ie_lab.attribution_graph(...)), got {type(graph).__name__}."
            )
        if corpus is not None and transcoders is None:
            raise InputError("corpus= gives feature dashboards their contexts: pass transcoders= too (the graph's).")
        if corpus is not None and (isinstance(corpus, str) or not isinstance(corpus, (list, tuple)) or not corpus):
            raise InputError("corpus= is a non-empty list of texts (each feature's top contexts are read from it).")
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_TOP:
            raise InputError(f"top={top!r}: an int from 1 to {MAX_TOP} (contexts in a feature's dashboard).")
        self._session, self._graph, self._tcs, self._texts, self._top = session, graph, transcoders, corpus, top
        self._encoded: dict[int, EncodedCorpus] = {}
        self.shown = graph.prune(node_threshold, edge_threshold)  # checks the thresholds before the panel exists
        super().__init__(
            tokens=list(graph.str_tokens),
            dashboard_note=""
            if corpus is not None
            else "click a feature node: its dashboard needs transcoders= and corpus=",
        )
        self._send_graph(node_threshold, edge_threshold)

    def _send_graph(self, node_threshold: float, edge_threshold: float) -> None:
        d = self.data_sent = graph_data(self.shown)
        with self.hold_sync():
            self.n_layers = d.n_layers
            self.node_labels, self.node_kind, self.node_row = d.labels, _i32(d.kind), _i32(d.row)
            self.node_col, self.node_value, self.node_influence = _i32(d.col), _f32(d.value), _f32(d.influence)
            self.edge_src, self.edge_dst, self.edge_weight = _i32(d.src), _i32(d.dst), _f32(d.weight)
            self.graph_note = d.note
            self.node_threshold, self.edge_threshold = float(node_threshold), float(edge_threshold)
            self.error = ""
            self.node_ids = d.ids  # last: the front end redraws on it

    # ---- what the controls do ------------------------------------------------------------------------------
    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> None:
        """Prune the full graph again with these thresholds (graph.prune) and draw the result."""
        self.shown = self._graph.prune(node_threshold, edge_threshold)
        self._send_graph(node_threshold, edge_threshold)

    def select(self, node: str) -> None:
        """Show feature node `node`'s dashboard (an id such as "feat:1:5:17") below the graph."""
        n = self._feature_node(node)
        if self._tcs is None or self._texts is None:
            raise InputError(
                "this panel has no feature dashboards: open it with transcoders= and corpus= (a list of texts)."
            )
        tc = self._tcs[n.layer]  # a Transcoder reads as an SAE: address, encode, W_dec, d_sae
        if n.layer not in self._encoded:
            self._encoded[n.layer] = encode_corpus(self._session, tc, list(self._texts))
        d = feature_data(self._session, tc, int(n.index), self._encoded[n.layer], top=self._top)  # type: ignore[arg-type]
        d.logit_note = LOGIT_NOTE.format(layer=n.layer)
        self.n_features = tc.d_sae
        self.address = str(tc.address)
        self.dashboard_note = (
            f"feature {n.index} of layer {n.layer} (node {node}) over {plural(len(self._texts), 'text')}"
        )
        self._put(d)
        self.selected = node  # after the data: the front end draws the dashboard on it

    def group(self, name: str, nodes: list[str]) -> None:
        """Group feature nodes into one supernode called `name` (drawn as one box, its edges summed)."""
        if not isinstance(name, str) or not name.strip():
            raise InputError("a supernode needs a name (a non-empty text).")
        if name in self.supernodes:
            raise InputError(f"there is a supernode {name!r} already: ungroup it first, or pick another name.")
        ids = list(dict.fromkeys(nodes))
        if len(ids) < 2:
            raise InputError("a supernode groups two or more feature nodes.")
        for i in ids:
            self._feature_node(i)
        taken = {i: k for k, v in self.supernodes.items() for i in v}
        if any(i in taken for i in ids):
            i = next(i for i in ids if i in taken)
            raise InputError(f"node {i} is in supernode {taken[i]!r} already: ungroup that first.")
        self.supernodes = {**self.supernodes, name: ids}

    def ungroup(self, name: str) -> None:
        if name not in self.supernodes:
            raise InputError(f"no supernode {name!r}; these are: {', '.join(map(repr, self.supernodes)) or 'none'}.")
        self.supernodes = {k: v for k, v in self.supernodes.items() if k != name}

    def _feature_node(self, node_id_: str) -> Any:
        for n in self.shown.nodes:
            if n.kind == "feature" and node_id(n) == node_id_:
                return n
        raise InputError(f"no feature node {node_id_!r} in the graph shown (ids such as 'feat:1:5:17').")

    # ---- the front end's commands (checked by _base first) ---------------------------------------------------
    def on_prune(self, node_threshold: float, edge_threshold: float) -> None:
        self.prune(node_threshold, edge_threshold)

    def on_select(self, node: str) -> None:
        self.select(node)

    def on_group(self, name: str, nodes: list[str]) -> None:
        self.group(name, nodes)
        self.error = ""

    def on_ungroup(self, name: str) -> None:
        self.ungroup(name)
        self.error = ""

    def __repr__(self) -> str:
        kinds = np.frombuffer(self.node_kind, dtype="<i4")
        counts = ", ".join(
            f"{int((kinds == k).sum())} {name}" for k, name in enumerate(("embedding", "feature", "error", "logit"))
        )
        return (
            f"GraphPanel({counts} nodes, {plural(len(self.data_sent.weight), 'edge')} at node_threshold "
            f"{self.node_threshold:g}, edge_threshold {self.edge_threshold:g}; {plural(len(self.supernodes), 'supernode')})"
        )


def for_session(session: Any, graph: Any, **kwargs: Any) -> GraphPanel:
    session.facts  # refuses a closed session before any work  # noqa: B018
    return GraphPanel(session, graph, **kwargs)
