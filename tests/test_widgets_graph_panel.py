"""The attribution-graph panel in plain Python (issue 32 item 5), on the demo model and its demo transcoders: the
nodes and edges it sends are graph.prune's (read back through Graph.edges_into, not through the panel's arrays),
also after a re-prune from the front end; a transcoder feature's dashboard against the transcoder's own encoder
over captures made here; supernodes grouped and ungrouped; hostile front-end messages refused with the state
unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ie_lab
from ie_lab.errors import InputError
from ie_lab.widgets import GraphPanel
from ie_lab.widgets.graph_panel_data import DRAWN, graph_data, node_id

PROMPT = "Mary and John went to the park . John gave a ball to"
TEXTS = ["One Monday , Otto went to the garage .", "Jade gave a ball to Mary .", "John and Mary went to the park ."]


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False, replace=False)
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def tcs(s):
    return ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)


@pytest.fixture(scope="module")
def g(s, tcs):
    return ie_lab.attribution_graph(s, PROMPT, tcs, batch_size=128)


@pytest.fixture
def panel(s, g, tcs):
    return s.graph_panel(g, transcoders=tcs, corpus=TEXTS)


def _msg(p, content, buffers=None):
    p._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": buffers or []})


def _sent(p):
    """The panel's arrays, decoded: ids per node, kinds, rows, and {(source id, target id): weight}."""
    i32 = lambda b: np.frombuffer(b, dtype="<i4")  # noqa: E731
    ids = list(p.node_ids)
    src, dst, w = i32(p.edge_src), i32(p.edge_dst), np.frombuffer(p.edge_weight, dtype="<f4")
    edges = {(ids[a], ids[b]): float(x) for a, b, x in zip(src, dst, w, strict=True)}
    return ids, [DRAWN[k] for k in i32(p.node_kind)], i32(p.node_row), edges


def _expected(pruned):
    """From the pruned graph's own lookups: the drawn nodes' ids and kinds, and every edge between them."""
    drawn = [n for n in pruned.nodes if n.kind != "bias"]
    edges = {}
    for t in drawn:
        for src, w in pruned.edges_into(t).items():
            if src.kind != "bias":
                edges[(node_id(src), node_id(t))] = w
    return [node_id(n) for n in drawn], [n.kind for n in drawn], edges


def _check_sent(p, pruned, n_layers):
    ids, kinds, rows, edges = _sent(p)
    want_ids, want_kinds, want_edges = _expected(pruned)
    assert ids == want_ids and kinds == want_kinds
    assert edges.keys() == want_edges.keys()
    assert all(edges[k] == pytest.approx(want_edges[k], rel=1e-6, abs=1e-7) for k in edges)
    for n, r in zip([n for n in pruned.nodes if n.kind != "bias"], rows, strict=True):
        want_row = {"embedding": 0, "logit": n_layers + 1}.get(n.kind, (n.layer or 0) + 1)
        assert r == want_row
    return edges


def test_the_nodes_and_edges_sent_are_graph_prunes_also_after_a_re_prune_from_the_front_end(panel, g):
    n_layers = g.info["n_layers"]
    first = _check_sent(panel, g.prune(0.8, 0.98), n_layers)
    assert sum(k == "feature" for k in _sent(panel)[1]) > 3
    assert "bias nodes not drawn" in panel.graph_note
    _msg(panel, {"cmd": "prune", "node_threshold": 0.5, "edge_threshold": 0.9})
    assert panel.rejected == [] and (panel.node_threshold, panel.edge_threshold) == (0.5, 0.9)
    second = _check_sent(panel, g.prune(0.5, 0.9), n_layers)
    assert second != first  # the neighbouring thresholds' graph differs: the check above can fail
    with pytest.raises(AssertionError):
        _check_sent(panel, g.prune(0.8, 0.98), n_layers)


def test_a_feature_node_click_sends_the_transcoders_feature_data(panel, s, tcs):
    ids, kinds, _, _ = _sent(panel)
    fid = next(i for i, k in zip(ids, kinds, strict=True) if k == "feature")
    _, layer, _, index = fid.split(":")
    layer, index = int(layer), int(index)
    _msg(panel, {"cmd": "select", "node": fid})
    assert panel.rejected == [] and panel.selected == fid and panel.feature == index
    assert panel.address == f"mlp_in.{layer}" and "direct effect on the logits" in panel.logit_note
    # independent reference: the transcoder's encoder on each text's mlp_in captured one at a time
    col = torch.cat(
        [tcs[layer].encode(s.capture(t, [f"mlp_in.{layer}"])[f"mlp_in.{layer}"][0])[:, index] for t in TEXTS]
    )
    assert panel.max_act == pytest.approx(float(col.max()), rel=1e-5)
    assert panel.n_fired == int((col > 0).sum()) and panel.n_tokens == col.numel()
    assert panel.n_promoted > 0 and len(panel.logit_tokens) == 2 * panel.n_promoted


def test_supernodes_group_and_ungroup_from_python_and_from_messages(panel):
    feats = [i for i, k in zip(*_sent(panel)[:2], strict=True) if k == "feature"]
    _msg(panel, {"cmd": "group", "name": "names", "nodes": feats[:2]})
    assert panel.rejected == [] and panel.supernodes == {"names": feats[:2]}
    panel.group("more", feats[2:4])
    assert panel.supernodes == {"names": feats[:2], "more": feats[2:4]}
    with pytest.raises(InputError, match="in supernode 'names' already"):
        panel.group("again", feats[1:3])
    with pytest.raises(InputError, match="no feature node"):
        panel.group("errs", ["err:0:1", feats[5]])
    _msg(panel, {"cmd": "ungroup", "name": "names"})
    assert panel.supernodes == {"more": feats[2:4]}
    panel.ungroup("more")
    assert panel.supernodes == {}


HOSTILE = [
    {"cmd": "prune", "node_threshold": "0.5", "edge_threshold": 0.9},
    {"cmd": "prune", "node_threshold": float("nan"), "edge_threshold": 0.9},
    {"cmd": "prune", "node_threshold": 0.0, "edge_threshold": 0.9},
    {"cmd": "prune", "node_threshold": 0.5, "edge_threshold": 2},
    {"cmd": "prune", "node_threshold": 0.5},
    {"cmd": "prune", "node_threshold": 0.5, "edge_threshold": 0.9, "extra": 1},
    {"cmd": "select", "node": "emb:0"},
    {"cmd": "select", "node": "feat:9:9:9"},
    {"cmd": "select", "node": ["feat:0:0:0"]},
    {"cmd": "select", "node": "x" * 81},
    {"cmd": "group", "name": "g", "nodes": ["emb:0", "emb:1"]},
    {"cmd": "group", "name": "", "nodes": []},
    {"cmd": "group", "name": "g", "nodes": ["feat"] * 65},
    {"cmd": "group", "name": "g", "nodes": "feat:0:0:0"},
    {"cmd": "ungroup", "name": "nobody"},
    {"cmd": "exec", "code": "import os"},
    {"cmd": "__init__"},
    "prune",
]


@pytest.mark.parametrize("content", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_messages_are_refused_and_change_nothing(s, g, content):
    p = GraphPanel(s, g)
    before = (list(p.node_ids), bytes(p.edge_weight), dict(p.supernodes), p.selected, p.node_threshold)
    _msg(p, content)
    assert len(p.rejected) == 1 and p.error
    assert (list(p.node_ids), bytes(p.edge_weight), dict(p.supernodes), p.selected, p.node_threshold) == before


def test_state_from_the_front_end_and_buffers_are_refused(s, g):
    p = GraphPanel(s, g)
    p._handle_msg({"content": {"data": {"method": "update", "state": {"supernodes": {"x": ["emb:0"]}}}}})
    _msg(p, {"cmd": "prune", "node_threshold": 0.5, "edge_threshold": 0.9}, buffers=[b"\0"])
    assert p.supernodes == {} and p.node_threshold == 0.8 and len(p.rejected) == 2


def test_bad_arguments_are_refused_with_the_fix(s, g, tcs):
    with pytest.raises(InputError, match="ie_lab.Graph"):
        s.graph_panel("not a graph")
    with pytest.raises(InputError, match="transcoders="):
        s.graph_panel(g, corpus=TEXTS)
    with pytest.raises(InputError, match="node_threshold"):
        s.graph_panel(g, node_threshold=0)
    with pytest.raises(InputError, match="top="):
        s.graph_panel(g, transcoders=tcs, corpus=TEXTS, top=0)
    p = s.graph_panel(g)
    feat = next(i for i in p.node_ids if i.startswith("feat:"))
    with pytest.raises(InputError, match="corpus="):
        p.select(feat)
    assert tcs[0].address == tcs[0].address_in  # the panel's dashboards read the Transcoder as an SAE
    d = graph_data(g.prune())
    assert d.kind.dtype == np.int32 and d.weight.dtype == np.float32


def test_a_graph_read_back_from_json_is_drawn_the_same(s, g, tmp_path):
    small = g.prune()
    back = ie_lab.Graph.from_json(small.to_json(str(tmp_path / "g.json")))
    a, b = graph_data(small), graph_data(back)
    assert a.ids == b.ids and a.n_layers == b.n_layers == g.info["n_layers"]
    assert np.array_equal(a.row, b.row) and np.array_equal(a.col, b.col)
    assert np.allclose(a.weight, b.weight, rtol=1e-5) and "bias" not in b.note
