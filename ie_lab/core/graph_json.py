"""An attribution graph as the JSON file circuit-tracer's create_graph_files writes and Neuronpedia's graph viewer
reads, and back (Graph.to_json / Graph.from_json; docs/CIRCUITS.md "Export").

The layout (circuit-tracer's frontend/graph_models.py, facts only): {"metadata": {slug, scan, transcoder_list,
prompt_tokens, prompt, node_threshold, schema_version}, "qParams": {pinnedIds, supernodes, linkType, clickedId,
sg_pos}, "nodes": [...], "links": [{source, target, weight}]}. Node ids: a feature "L_index_pos" (feature: the
Cantor pairing of layer and index, feature_type "cross layer transcoder", the viewer's name for any transcoder
feature), an error "L_-1_pos" ("mlp reconstruction error"), an embedding "E_tokenid_pos" (layer "E"), a logit
"(n_layers+1)_tokenid_pos". The viewer has no bias node: bias nodes and their edges are left out of the file (their
count is in metadata["ie_lab"]), so a graph read back has none. What ie_lab adds and the viewer ignores sits in
metadata["ie_lab"]: each node's value (pre-activation, demeaned logit), the graph's info.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..errors import InputError


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def _ids(graph: Any, n_layers: int) -> list[str | None]:
    out: list[str | None] = []
    for n in graph.nodes:
        if n.kind == "feature":
            out.append(f"{n.layer}_{n.index}_{n.position}")
        elif n.kind == "error":
            out.append(f"{n.layer}_-1_{n.position}")
        elif n.kind == "embedding":
            out.append(f"E_{graph.tokens[n.position]}_{n.position}")  # type: ignore[index]
        elif n.kind == "logit":
            out.append(f"{n_layers + 1}_{n.index}_{len(graph.tokens) - 1}")
        else:
            out.append(None)
    return out


def write(graph: Any, path: Any, slug: str | None = None, scan: str = "ie_lab") -> str:
    n_layers = int(graph.info.get("n_layers", 0))
    ids = _ids(graph, n_layers)
    # The viewer's pruning slider compares a node's `influence` with a threshold as circuit-tracer writes it: the
    # share of all influence held by the nodes ranked at or above it (a cumulative rank score in (0, 1], 1 for the
    # least influential), not the raw influence. Ranked here over the nodes the file holds (bias nodes have no id).
    raw = graph.influence()
    written = [i for i, nid in enumerate(ids) if nid is not None]
    infl = torch.zeros_like(raw)
    if written:
        sub = raw[written].clamp_min(0)
        order = torch.sort(sub, descending=True, stable=True).indices
        total = float(sub.sum())
        ranked = torch.cumsum(sub[order], 0) / total if total > 0 else torch.ones(len(written), dtype=raw.dtype)
        shares = torch.empty_like(sub)
        shares[order] = ranked
        infl[written] = shares
    last = len(graph.tokens) - 1
    nodes = []
    first_logit = True
    for i, (n, nid) in enumerate(zip(graph.nodes, ids)):
        if nid is None:
            continue
        d: dict[str, Any] = {"node_id": nid, "ctx_idx": n.position if n.position is not None else last}
        if n.kind == "feature":
            d.update(
                feature=_cantor(n.layer, n.index),  # type: ignore[arg-type]
                layer=str(n.layer),
                feature_type="cross layer transcoder",
                jsNodeId=f"{n.layer}_{n.index}-0",
                activation=n.activation,
            )
        elif n.kind == "error":
            d.update(
                feature=-1,
                layer=str(n.layer),
                feature_type="mlp reconstruction error",
                jsNodeId=f"{n.layer}_-1-{n.position}",
            )
        elif n.kind == "embedding":
            tok = graph.tokens[n.position]  # type: ignore[index]
            d.update(feature=n.position, layer="E", feature_type="embedding", jsNodeId=f"E_{tok}-{n.position}")
        else:
            d.update(
                feature=n.index,
                layer=str(n_layers + 1),
                feature_type="logit",
                token_prob=n.probability,
                is_target_logit=first_logit,
                jsNodeId=f"L_{n.index}-{last}",
                clerp=f'Output "{n.token}" (p={n.probability:.3f})',
            )
            first_logit = False
        d.setdefault("token_prob", 0.0)
        d.setdefault("is_target_logit", False)
        d.update(run_idx=0, reverse_ctx_idx=0)
        d.setdefault("clerp", "")
        d["influence"] = float(infl[i])
        d.setdefault("activation", None)
        nodes.append(d)
    adj = graph.adjacency
    links = [
        {"source": ids[s], "target": ids[t], "weight": float(adj[t, s])}
        for t, s in adj.nonzero().tolist()
        if ids[s] is not None and ids[t] is not None
    ]
    pruned = graph.info.get("pruned") or {}
    meta = {
        "slug": slug or "ie-lab-graph",
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": list(graph.str_tokens),
        "prompt": "".join(graph.str_tokens),
        "node_threshold": pruned.get("node_threshold"),
        "schema_version": 1,
        "ie_lab": {
            "values": {nid: n.value for n, nid in zip(graph.nodes, ids) if nid is not None},
            "bias_nodes_left_out": sum(1 for n in graph.nodes if n.kind == "bias"),
            "info": graph.info,
        },
    }
    doc = {
        "metadata": meta,
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": nodes,
        "links": links,
    }
    out = os.fspath(path)
    with open(out, "w") as f:
        json.dump(doc, f)
    return out


def read(path: Any) -> tuple[list[dict[str, Any]], torch.Tensor, list[int], list[str], dict[str, Any]]:
    """(each node's fields, in the adjacency's order; the adjacency; the prompt's token ids; its token texts; the
    info): core/graph.py's Graph.from_json builds the Graph (this module imports none of graph.py, which imports
    this one)."""
    from .files import read_json

    doc = read_json(path, "the graph file")
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not isinstance(doc.get("links"), list):
        raise InputError(f"{os.fspath(path)}: not a graph file (an object with 'nodes' and 'links' lists).")
    meta = doc.get("metadata") or {}
    extra = meta.get("ie_lab") or {}
    values = extra.get("values") or {}
    prompt_tokens = list(meta.get("prompt_tokens") or [])
    parsed: list[tuple[tuple, dict[str, Any], str]] = []
    tokens: dict[int, int] = {}
    n_layers = 0
    order = {"feature": 0, "error": 1, "embedding": 2, "logit": 4}
    try:
        for seq, d in enumerate(doc["nodes"]):
            kind_name, nid, pos = d["feature_type"], str(d["node_id"]), int(d["ctx_idx"])
            parts = nid.split("_")
            text = prompt_tokens[pos] if 0 <= pos < len(prompt_tokens) else ""
            if kind_name == "embedding":
                tokens[pos] = int(parts[1])
                node = dict(kind="embedding", position=pos, token=text, value=float(values.get(nid, 0.0)))
            elif kind_name == "mlp reconstruction error":
                node = dict(kind="error", layer=int(d["layer"]), position=pos, token=text)
            elif kind_name == "logit":
                n_layers = int(d["layer"]) - 1
                clerp = str(d.get("clerp", ""))
                tok_text = clerp[len('Output "') : clerp.rfind('" (p=')] if clerp.startswith('Output "') else ""
                node = dict(
                    kind="logit",
                    index=int(d["feature"]),
                    token=tok_text,
                    value=float(values.get(nid, 0.0)),
                    probability=float(d.get("token_prob", 0.0)),
                )
            else:
                node = dict(
                    kind="feature",
                    layer=int(parts[0]),
                    position=pos,
                    index=int(parts[1]),
                    token=text,
                    activation=float(d.get("activation") or 0.0),
                    value=float(values.get(nid, 0.0)),
                )
            # the adjacency's order: features, errors (by layer, position, index), embeddings, logits as written
            key = (order[str(node["kind"])], node.get("layer") or 0, node.get("position") or 0, node.get("index") or 0)
            parsed.append(((4, 0, 0, seq) if node["kind"] == "logit" else key, node, nid))
        parsed.sort(key=lambda x: x[0])
        index = {nid: i for i, (_, _, nid) in enumerate(parsed)}
        adj = torch.zeros(len(parsed), len(parsed))
        for link in doc["links"]:
            adj[index[str(link["target"])], index[str(link["source"])]] = float(link["weight"])
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise InputError(
            f"{os.fspath(path)}: a node or link is not in the graph file's layout ({type(e).__name__}: {e})."
        ) from None
    info = dict(extra.get("info") or {})
    info["n_layers"] = n_layers
    ids = [tokens[p] for p in sorted(tokens)]
    return [n for _, n, _ in parsed], adj, ids, prompt_tokens, info
