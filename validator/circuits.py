"""python -m validator circuits: ie_lab.attribution_graph against circuit-tracer's attribute() on the same model,
transcoders and token ids.

circuit-tracer runs in its own environment (.venvs/circuit_tracer, validator/envs/circuit_tracer.txt) through
engines/circuit_tracer_worker.py, which converts the SAELens transcoder folders ie_lab reads into circuit-tracer's
TranscoderSet and runs its nnsight backend on the saved HF folder. Both get the same settings: max 10 logits,
desired_logit_prob 0.95, no feature cap, fp32, CPU. circuit-tracer prepends a special token when the prompt does not
start with one; its token ids are handed to ie_lab, so both read the same ids.

What circuit-tracer does differently, by design (so it is matched, not judged): it zeroes every feature and the
error at position 0 (the BOS, "ignored during attribution"), and it has no bias nodes (a bias' write is in no row).
So the comparison is on the nodes both have: features at positions >= 1 by (layer, position, index), errors at
positions >= 1 by (layer, position), embeddings by position, logits by token id; an edge between two such nodes is
the same quantity in both (the source's direct effect through the same frozen model), whatever other nodes exist.

Per setup and prompt: the logit tokens equal; the active feature sets equal (positions >= 1); the activations'
max abs difference; the edges' max |diff| / max |w| over every (target, source) pair of common nodes (EDGE_TOL); the
pruned feature sets at the default thresholds (0.8, 0.98), each with its own rule (they differ: circuit-tracer
ranks errors with features and may drop them, ie_lab keeps every error and bias node), reported as an overlap.

And the graph files both ways (issue 32: "the export opens in circuit-tracer's reader"): ie_lab's pruned graph
written by Graph.to_json is listed, served and parsed as circuit-tracer's viewer gets it (its add_graph_metadata,
local_server, frontend graph_models.Model), every parsed node field and link equal to the file and to the graph;
circuit-tracer's create_graph_files output for the same prompt is read by ie_lab.Graph.from_json, every node and
link as the file has it, and the links both files have (each pruned by its own rule) agree within EDGE_TOL.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from .external import README as README  # the README this check re-renders (tests read it here)
from .external import ExternalCheck, call_worker
from .run import HERE, RESULTS, ROOT

WORKER = os.path.join(HERE, "engines", "circuit_tracer_worker.py")
# fp32 edges from two backward passes through the same frozen model: only summation order differs (d_model-long
# dot products, a few layers), measured at ~1e-6 of the largest edge; 1e-4 leaves room for other BLAS paths while
# a real disagreement (a norm scale left free, a wrong error vector) moves edges by percents.
EDGE_TOL = 1e-4
ACT_TOL = 1e-4
SETTINGS = {
    "max_n_logits": 10,
    "desired_logit_prob": 0.95,
    "batch_size": 64,
    "node_threshold": 0.8,
    "edge_threshold": 0.98,
}
DEMO_PROMPTS = (
    "Mary and John went to the park . John gave a ball to",
    "the cat sat on the mat and the dog sat on the",
    "one two three four five six",
)
TINY_PROMPTS = ("the cat sat on the mat and then it ran away", "a b c d e f g")
# The fixture families both support: circuit-tracer's nnsight backend maps Llama, Qwen 3, Gemma 2/3 and GPT-OSS;
# ie_lab refuses Gemma's soft-capped logits and GPT-OSS' sparse MoE; GPT-2 circuit-tracer reaches only through
# TransformerLens' hub model names (not offline from a folder).
TINY_FAMILIES = ("llama", "qwen3")
# Transcoders in circuit-tracer's own layout (read by its own loaders there, by ie_lab.load_transcoders here): a
# random cross-layer transcoder (each layer's features write into every later layer's MLP output) on the demo model
# and tiny Llama, and random per-layer skip transcoders (W_skip) on tiny Llama.
OWN_LAYOUT = ("demo-clt", "tiny-llama-clt", "tiny-llama-skip")


def ct_python() -> tuple[str | None, str]:
    return CHECK.python()


def worker_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}


def run_worker(py: str, job: dict, work: str, timeout: int = 1800) -> dict:
    path = os.path.join(work, "attribute.json")
    return call_worker(py, WORKER, "attribute", {**job, "work": work}, path, timeout, worker_env())


def setups(work: str, which: tuple[str, ...] | None = None) -> list[dict]:
    """(name, model folder, transcoder folders, prompts' token ids)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import ie_lab
    from tests.families import make_config, make_tokenizer, saved_model_dir
    from tests.transcoder_files import write_circuit_tracer, write_transcoders

    out = []
    if which is None or "demo" in which:
        tok = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False).tokenizer
        out.append(
            {
                "name": "demo",
                "model": ie_lab.DEMO_MODEL,
                "transcoders": ie_lab.DEMO_TRANSCODERS,
                "prompts": [tok(p)["input_ids"] for p in DEMO_PROMPTS],
                "texts": list(DEMO_PROMPTS),
            }
        )
    for fam in TINY_FAMILIES:
        if which is not None and f"tiny-{fam}" not in which:
            continue
        d = saved_model_dir(fam, work, attn_implementation="eager")
        cfg = make_config(fam)
        root = write_transcoders(os.path.join(work, f"tc-{fam}"), cfg.hidden_size, list(range(cfg.num_hidden_layers)))
        tok = make_tokenizer()
        out.append(
            {
                "name": f"tiny-{fam}",
                "model": d,
                "transcoders": root,
                "prompts": [tok(p)["input_ids"] for p in TINY_PROMPTS],
                "texts": list(TINY_PROMPTS),
            }
        )
    for name in OWN_LAYOUT:
        if which is not None and name not in which:
            continue
        if name.startswith("demo"):
            model, tok = ie_lab.DEMO_MODEL, ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False).tokenizer
            texts, n = DEMO_PROMPTS, 64
            with open(os.path.join(model, "config.json")) as f:
                mc = json.load(f)
            d, n_layers = mc["hidden_size"], mc["num_hidden_layers"]
        else:
            model, tok = saved_model_dir("llama", work, attn_implementation="eager"), make_tokenizer()
            texts, n = TINY_PROMPTS, 24
            d, n_layers = make_config("llama").hidden_size, make_config("llama").num_hidden_layers
        root = write_circuit_tracer(
            os.path.join(work, f"tc-{name}"),
            d,
            n_layers,
            n=n,
            clt=name.endswith("clt"),
            skip=name.endswith("skip"),
            seed=1,
        )
        out.append(
            {
                "name": name,
                "model": model,
                "transcoders": root,
                "own_layout": True,
                "prompts": [tok(p)["input_ids"] for p in texts],
                "texts": list(texts),
            }
        )
    return out


def folders(root: str) -> list[str]:
    return sorted(
        (os.path.join(root, n) for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "cfg.json"))),
        key=lambda p: int(p.rsplit("_", 1)[-1]),
    )


def node_key(d: dict) -> tuple:
    """A graph file's node as ie_lab's node key, read as circuit-tracer's create_nodes writes it: a feature's layer
    and index from its node_id "L_index_pos", an error's layer from its layer field (its node_id, "0_L_pos" in
    circuit-tracer's files, "L_-1_pos" in ie_lab's, is not read), a logit's token id from its feature field."""
    kind, pos = d["feature_type"], int(d["ctx_idx"])
    if kind == "embedding":
        return ("embedding", pos)
    if kind == "mlp reconstruction error":
        return ("error", int(d["layer"]), pos)
    if kind == "logit":
        return ("logit", int(d["feature"]))
    layer, index, _ = str(d["node_id"]).split("_")
    return ("feature", int(layer), pos, int(index))


def _edge(g: Any, target: tuple, source: tuple) -> float:
    return float(g.adjacency[g.index(g.node(*target)), g.index(g.node(*source))])


def check_graph_files(small: Any, ie_path: str, seen: dict, ct_path: str) -> dict:
    """The graph files both ways. seen: ie_lab's file (small.to_json) as circuit-tracer's viewer got it (the
    worker's read_graph_files: listed, served, parsed by its frontend models). ct_path: circuit-tracer's
    create_graph_files output for the same prompt, read by ie_lab.Graph.from_json."""
    import torch

    from ie_lab.core.graph import Graph

    # ie_lab's file, read by circuit-tracer: every node and link, each field as written, and the same as the graph
    with open(ie_path) as f:
        doc = json.load(f)
    nodes, links = seen["nodes"], seen["links"]
    ids = [n["node_id"] for n in nodes]
    mine = [n for n in small.nodes if n.kind != "bias"]
    keys = [node_key(n) for n in nodes]
    cols = [i for i, n in enumerate(small.nodes) if n.kind != "bias"]
    fields_equal = len(nodes) == len(doc["nodes"]) and all(
        m == {k: d[k] for k in m} for m, d in zip(nodes, doc["nodes"])
    )
    feats_equal = all(m["activation"] == small.node(*k).activation for m, k in zip(nodes, keys) if k[0] == "feature")
    at = dict(zip(ids, keys))
    links_equal = links == doc["links"] and all(
        x["source"] in at and x["target"] in at and _edge(small, at[x["target"]], at[x["source"]]) == x["weight"]
        for x in links
    )
    ie_ok = (
        seen["listed"]
        and seen["served_equal"]
        and fields_equal
        and feats_equal
        and links_equal
        and len(set(ids)) == len(ids)  # the viewer looks nodes up by node_id
        and sorted(keys) == sorted(n.key for n in mine)
        and len(links) == int((small.adjacency[cols][:, cols] != 0).sum())
    )
    # circuit-tracer's file, read by ie_lab: every node (by its key), every link whose ends' node_ids are unique in
    # the file (circuit-tracer's error ids "0_L_pos" can equal a layer-0 feature's "0_index_pos"), the same weight
    with open(ct_path) as f:
        cdoc = json.load(f)
    back = Graph.from_json(ct_path)
    ckeys = [node_key(d) for d in cdoc["nodes"]]
    by_id: dict[str, list[tuple]] = {}
    for d, k in zip(cdoc["nodes"], ckeys):
        by_id.setdefault(d["node_id"], []).append(k)
    plain = [x for x in cdoc["links"] if len(by_id[x["source"]]) == 1 and len(by_id[x["target"]]) == 1]
    read_equal = all(
        _edge(back, by_id[x["target"]][0], by_id[x["source"]][0]) == float(torch.tensor(x["weight"])) for x in plain
    )
    acts_equal = all(
        back.node(*k).activation == float(d["activation"]) for d, k in zip(cdoc["nodes"], ckeys) if k[0] == "feature"
    )
    ct_ok = (
        len(back) == len(ckeys)
        and sorted(n.key for n in back.nodes) == sorted(ckeys)
        and read_equal
        and acts_equal
        and (len(plain) < len(cdoc["links"]) or int((back.adjacency != 0).sum()) == len(cdoc["links"]))
        and {k for k in ckeys if k[0] == "logit"} == {n.key for n in small.of_kind("logit")}
    )
    # the links both files have (each pruned by its own rule): the same edge of the same model
    mine_keys = {n.key for n in small.nodes}
    both = [
        (float(torch.tensor(x["weight"])), _edge(small, by_id[x["target"]][0], by_id[x["source"]][0]))
        for x in plain
        if by_id[x["target"]][0] in mine_keys and by_id[x["source"]][0] in mine_keys
    ]
    both = [(a, b) for a, b in both if b != 0.0]
    scale = max((abs(b) for _, b in both), default=0.0)
    common_rel = max((abs(a - b) for a, b in both), default=0.0) / scale if scale else 0.0
    return {
        "export_nodes": len(nodes),
        "export_links": len(links),
        "export_read_by_circuit_tracer": bool(ie_ok),
        "ct_file_nodes": len(ckeys),
        "ct_file_links": len(cdoc["links"]),
        "ct_file_links_ambiguous": len(cdoc["links"]) - len(plain),
        "ct_file_read_by_ie_lab": bool(ct_ok),
        "files_common_links": len(both),
        "files_common_links_rel": common_rel,
    }


def compare(g: Any, ct: dict, ref: dict, small: Any = None) -> dict:
    """One prompt: ie_lab's Graph g against circuit-tracer's graph (ct: the worker's tensors, ref: its record)."""
    import torch

    from ie_lab.core.graph import Graph

    A = ct["adjacency"]
    feats_ct = [tuple(int(v) for v in r) for r in ct["active_features"].tolist()]
    S, n_layers = len(ref["input_tokens"]), g.info["n_layers"]
    n_f = len(feats_ct)
    logits_ct = ref["logit_tokens"]
    # circuit-tracer's columns: features, errors (layer-major: L * S + p), token embeddings, logits
    ct_index: dict[tuple, int] = {("feature", *f): j for j, f in enumerate(feats_ct)}
    ct_index.update({("error", L, p): n_f + L * S + p for L in range(n_layers) for p in range(S)})
    ct_index.update({("embedding", p): n_f + n_layers * S + p for p in range(S)})
    ct_index.update({("logit", t): n_f + (n_layers + 1) * S + k for k, t in enumerate(logits_ct)})
    mine_feats = {n.key[1:]: n for n in g.of_kind("feature")}
    at0 = sum(1 for k in mine_feats if k[1] == 0)
    set_ie = {k for k in mine_feats if k[1] >= 1}
    set_ct = set(feats_ct)
    common = [
        n.key
        for n in g.nodes
        if n.key in ct_index and not (n.kind in ("feature", "error") and n.position == 0) and n.kind != "bias"
    ]
    targets = [k for k in common if k[0] in ("feature", "logit")]
    ie_rows = torch.tensor([g.index(g.node(*k)) for k in targets])
    ie_cols = torch.tensor([g.index(g.node(*k)) for k in common])
    ct_rows = torch.tensor([ct_index[k] for k in targets])
    ct_cols = torch.tensor([ct_index[k] for k in common])
    w_ie = g.adjacency[ie_rows][:, ie_cols].double()
    w_ct = A[ct_rows][:, ct_cols].double()
    scale = float(w_ie.abs().max())
    diff = float((w_ie - w_ct).abs().max())
    acts_ct = dict(zip(feats_ct, ct["activation_values"].tolist()))
    act_diff = max((abs(mine_feats[k].activation - acts_ct[k]) for k in set_ie & set_ct), default=0.0)
    # influence on the logits, on the nodes circuit-tracer has (ie_lab's graph without its position-0 features,
    # position-0 errors and bias nodes): the same quantity when the edges agree
    nodes = [n for n in g.nodes if n.key in ct_index and not (n.kind in ("feature", "error") and n.position == 0)]
    keep = torch.tensor([g.index(n) for n in nodes])
    sub = Graph(nodes, g.adjacency[keep][:, keep], g.tokens, g.str_tokens, dict(g.info))
    infl_ie = sub.influence()
    infl_ct = ct["node_influence"].double() / float(ct["logit_probabilities"].double().sum())
    infl_ct = infl_ct[torch.tensor([ct_index[n.key] for n in nodes])]
    infl_rel = float((infl_ie - infl_ct).abs().max() / infl_ie.abs().max().clamp_min(1e-30))
    kept_sub = {n.key[1:] for n in sub.prune(SETTINGS["node_threshold"], SETTINGS["edge_threshold"]).of_kind("feature")}
    # pruning, each with its own rule
    if small is None:
        small = g.prune(SETTINGS["node_threshold"], SETTINGS["edge_threshold"])
    kept_ie = {n.key[1:] for n in small.of_kind("feature")}
    mask = ct["node_mask"].bool()
    kept_ct = {f for j, f in enumerate(feats_ct) if bool(mask[j])}
    kept_ie_1 = {k for k in kept_ie if k[1] >= 1}
    union = kept_ie_1 | kept_ct
    union_sub = kept_sub | kept_ct
    return {
        "tokens": S,
        "logits_equal": [n.index for n in g.of_kind("logit")] == logits_ct,
        "n_logits": len(logits_ct),
        "features_ie_lab": len(mine_feats),
        "features_ie_lab_at_position_0": at0,
        "features_circuit_tracer": len(set_ct),
        "feature_sets_equal": set_ie == set_ct,
        "activation_max_abs": act_diff,
        "edges_compared": int(w_ie.numel()),
        "edge_max_abs": diff,
        "edge_max_weight": scale,
        "edge_rel": diff / scale if scale else 0.0,
        "pruned_features_ie_lab": len(kept_ie_1),
        "pruned_features_circuit_tracer": len(kept_ct),
        "pruned_overlap": len(kept_ie_1 & kept_ct) / len(union) if union else 1.0,
        "pruned_equal": kept_ie_1 == kept_ct,
        "pruned_circuit_tracer_within_ie_lab": kept_ct <= kept_ie_1,
        "influence_rel": infl_rel,
        "pruned_same_nodes_features_ie_lab": len(kept_sub),
        "pruned_same_nodes_overlap": len(kept_sub & kept_ct) / len(union_sub) if union_sub else 1.0,
    }


def run(
    out_dir: str | None = RESULTS, which: tuple[str, ...] | None = None, log=print, n_prompts: int | None = None
) -> dict:
    import torch
    import transformers
    from safetensors.torch import load_file

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import ie_lab

    py, why = ct_python()
    if py is None:
        raise RuntimeError(why)
    work = tempfile.mkdtemp(prefix="ie_lab_validator_circuits_")
    ie_dir = os.path.join(work, "ie-files")
    os.makedirs(ie_dir)
    rows, versions, exported = [], {}, []
    for st in setups(work, which):
        st["prompts"], st["texts"] = st["prompts"][:n_prompts], st["texts"][:n_prompts]
        res = run_worker(
            py,
            {
                "model": st["model"],
                "transcoders": st["transcoders"] if st.get("own_layout") else folders(st["transcoders"]),
                "prompts": st["prompts"],
                "graph_files": os.path.join(work, "ct-files", st["name"]),
                **SETTINGS,
            },
            work,
        )
        versions = res["versions"]
        s = ie_lab.Session(st["model"], device="cpu", progress=False)
        try:
            tcs = ie_lab.load_transcoders(st["transcoders"], s)
            for k, (text, ref) in enumerate(zip(st["texts"], res["graphs"])):
                ids = torch.tensor([ref["input_tokens"]])
                g = ie_lab.attribution_graph(
                    s,
                    ids,
                    tcs,
                    max_logits=SETTINGS["max_n_logits"],
                    desired_logit_prob=SETTINGS["desired_logit_prob"],
                    batch_size=SETTINGS["batch_size"],
                )
                small = g.prune(SETTINGS["node_threshold"], SETTINGS["edge_threshold"])
                r = {"setup": st["name"], "prompt": text, **compare(g, load_file(ref["file"]), ref, small)}
                slug = f"{st['name']}-{k}"
                exported.append(
                    (r, small, small.to_json(os.path.join(ie_dir, f"{slug}.json"), slug), ref["graph_file"])
                )
                rows.append(r)
        finally:
            s.close()
    # ie_lab's files as circuit-tracer's viewer gets them, all in one worker run
    job = {"files": [e[2] for e in exported]}
    seen = call_worker(py, WORKER, "read_graph_files", job, os.path.join(work, "read.json"), 600, worker_env())["files"]
    for (r, small, ie_path, ct_path), got in zip(exported, seen):
        r.update(check_graph_files(small, ie_path, got, ct_path))
        r["verdict"] = (
            "PASS"
            if r["logits_equal"]
            and r["feature_sets_equal"]
            and r["edge_rel"] <= EDGE_TOL
            and r["activation_max_abs"] <= ACT_TOL
            and r["influence_rel"] <= EDGE_TOL
            and r["export_read_by_circuit_tracer"]
            and r["ct_file_read_by_ie_lab"]
            and r["files_common_links_rel"] <= EDGE_TOL
            else "FAIL"
        )
        log(
            f"{r['setup']:11s} {r['prompt'][:40]!r:44s} feats {r['features_circuit_tracer']:4d} "
            f"edges {r['edges_compared']:7d} rel {r['edge_rel']:.2g} pruned overlap {r['pruned_overlap']:.3f} "
            f"files {r['export_read_by_circuit_tracer']}/{r['ct_file_read_by_ie_lab']} {r['verdict']}"
        )
    doc = {
        "what": "ie_lab.attribution_graph vs circuit-tracer attribute() (nnsight backend), same model, transcoders, ids",
        "settings": SETTINGS,
        "tolerance_edge_rel": EDGE_TOL,
        "tolerance_activation_max_abs": ACT_TOL,
        "dtype": "float32",
        "versions": {**versions, "ie_lab_transformers": transformers.__version__, "ie_lab_torch": torch.__version__},
        "rows": rows,
        "all_pass": all(r["verdict"] == "PASS" for r in rows),
    }
    CHECK.save(doc, out_dir)
    return doc


START = "<!-- validator-circuits:start (generated by `python -m validator circuits` from results/circuits.json) -->"
END = "<!-- validator-circuits:end -->"


def table(doc: dict) -> str:
    """The README's circuit-tracer table, from results/circuits.json alone."""
    v, st = doc["versions"], doc["settings"]
    lines = [
        f"circuit-tracer {v.get('circuit-tracer')} (nnsight {v.get('nnsight')}, transformers {v.get('transformers')}, "
        f"torch {v.get('torch')}) vs ie_lab (transformers {v.get('ie_lab_transformers')}); fp32, CPU; max "
        f"{st['max_n_logits']} logits, desired_logit_prob {st['desired_logit_prob']}, no feature cap; tolerance: "
        f"edges max |diff| / max |w| {doc['tolerance_edge_rel']:g}, activations max abs "
        f"{doc['tolerance_activation_max_abs']:g}. Pruning at node {st['node_threshold']}, edge "
        f"{st['edge_threshold']}, each with its own rule: overlap = |both| / |either| of the kept features (positions "
        ">= 1); \"c-t's nodes\": ie_lab's rule on its graph cut to circuit-tracer's nodes. Influence rel: max |diff| / "
        "max of each common node's influence on the logits (normalised logit weights). Graph files: ie_lab's pruned "
        "`Graph.to_json` listed (add_graph_metadata), served (local_server) and parsed (frontend graph_models.Model) "
        "by circuit-tracer, every node field and link as written and as in the graph; circuit-tracer's "
        "create_graph_files output read by `ie_lab.Graph.from_json`, every node and every link whose ends' node_ids "
        "are unique in the file (\"ambiguous\": circuit-tracer's error id `0_L_pos` equals layer-0 feature L's) with "
        "the file's weight; common links: those in both files, max |diff| / max |w|.",
        "",
        "| setup | prompt | tokens | logits equal | features (+ ie_lab's at pos 0) | feature sets equal | edges | "
        "edge rel | act max abs | influence rel | pruned features ie_lab / c-t (c-t within ie_lab) | overlap | "
        "overlap, c-t's nodes | ie_lab's file read by c-t (nodes / links) | c-t's file read by ie_lab (nodes / "
        "links, ambiguous) | common links (rel) | verdict |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | "
        "--- |",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['setup']} | {r['prompt']!r} | {r['tokens']} | {r['logits_equal']} | "
            f"{r['features_circuit_tracer']} (+{r['features_ie_lab_at_position_0']}) | {r['feature_sets_equal']} | "
            f"{r['edges_compared']} | {r['edge_rel']:.2g} | {r['activation_max_abs']:.2g} | {r['influence_rel']:.2g} | "
            f"{r['pruned_features_ie_lab']} / {r['pruned_features_circuit_tracer']} "
            f"({r['pruned_circuit_tracer_within_ie_lab']}) | {r['pruned_overlap']:.3f} | "
            f"{r['pruned_same_nodes_overlap']:.3f} | {r['export_read_by_circuit_tracer']} ({r['export_nodes']} / "
            f"{r['export_links']}) | {r['ct_file_read_by_ie_lab']} ({r['ct_file_nodes']} / {r['ct_file_links']}, "
            f"{r['ct_file_links_ambiguous']}) | {r['files_common_links']} ({r['files_common_links_rel']:.2g}) | "
            f"{r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


CHECK = ExternalCheck(
    env="circuit_tracer",
    results_file="circuits.json",
    start=START,
    end=END,
    table=table,
    run=run,
    verdict_key="all_pass",
    label="circuit-tracer check",
    good="every row PASS",
    bad="NOT all PASS",
)
readme_with = CHECK.readme_with
write_readme = CHECK.write_readme
main = CHECK.main
