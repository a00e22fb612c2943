"""Runs in .venvs/circuit_tracer only: circuit-tracer's attribute() on a saved HF Llama with transcoders read from
SAELens transcoder folders, for validator/circuits.py and benchmarks/attribution_graph.py.

    python circuit_tracer_worker.py attribute JOB.json    -> JOB.json.out (+ one safetensors file per prompt, and
                                                            with "graph_files": create_graph_files' JSON per prompt)
    python circuit_tracer_worker.py read_graph_files JOB.json -> JOB.json.out (each graph file as circuit-tracer's
                                                            frontend reads it)

The converter: each SAELens folder (cfg.json + sae_weights.safetensors: W_enc [d_in, d_sae], W_dec [d_sae, d_out],
b_enc, b_dec, threshold) becomes circuit-tracer's SingleLayerTranscoder (W_enc stored [d_sae, d_in], W_dec
[d_sae, d_out], JumpReLU with the same threshold, or ReLU), all layers in one TranscoderSet reading
``mlp.hook_in`` (the MLP's input after its norm) and writing ``mlp.hook_out`` (the MLP's output): the points
ie_lab's transcoders read and predict (mlp_in.L, mlp_out.L). The model is circuit-tracer's nnsight backend
(NNSightReplacementModel) loaded from the local folder: no hub.

A job whose "transcoders" is one folder in circuit-tracer's own layout (a cross-layer transcoder's W_enc_<L> /
W_dec_<L>.safetensors, or per-layer layer_<L>.safetensors, with or without W_skip; config.yaml naming the hooks) is
read by circuit-tracer's own loaders (load_clt, load_transcoder_set): nothing converted, the files ie_lab reads.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def transcoder_set(folders: list[str]):
    import torch
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet
    from safetensors.torch import load_file

    by_layer = {}
    for folder in folders:
        with open(os.path.join(folder, "cfg.json")) as f:
            cfg = json.load(f)
        w = load_file(os.path.join(folder, "sae_weights.safetensors"))
        # SAELens 6 keeps the hook name under metadata; older folders at the top
        hook = cfg.get("hook_name") or cfg.get("metadata", {}).get("hook_name")
        layer = int(hook.split(".")[1])
        if cfg.get("apply_b_dec_to_input") or cfg.get("normalize_activations", "none") != "none":
            raise SystemExit(f"{folder}: b_dec applied to the input / normalised activations: not converted here")
        arch = cfg["architecture"]
        if arch == "jumprelu_transcoder":
            act = JumpReLU(w["threshold"].float().clone())
        elif arch == "transcoder":
            act = torch.nn.ReLU()
        else:
            raise SystemExit(f"{folder}: architecture {arch} has no circuit-tracer counterpart here")
        d_in, d_sae = w["W_enc"].shape
        t = SingleLayerTranscoder(d_in, d_sae, act, layer, device=torch.device("cpu"), dtype=torch.float32)
        with torch.no_grad():
            t.W_enc.copy_(w["W_enc"].T.float())
            t.W_dec.copy_(w["W_dec"].float())
            t.b_enc.copy_(w["b_enc"].float())
            t.b_dec.copy_(w["b_dec"].float())
        by_layer[layer] = t
    return TranscoderSet(by_layer, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")


def own_layout(folder: str):
    """Transcoders in circuit-tracer's layout, through its own loaders, fp32 on CPU, every tensor in memory."""
    import glob

    import torch
    import yaml
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    with open(os.path.join(folder, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    hooks = {"feature_input_hook": cfg["feature_input_hook"], "feature_output_hook": cfg["feature_output_hook"]}
    cpu, f32 = torch.device("cpu"), torch.float32
    if cfg["model_kind"] == "cross_layer_transcoder":
        return load_clt(folder, **hooks, device=cpu, dtype=f32, lazy_decoder=False, lazy_encoder=False)
    n = len(glob.glob(os.path.join(folder, "layer_*.safetensors")))
    paths = {i: os.path.join(folder, f"layer_{i}.safetensors") for i in range(n)}
    return load_transcoder_set(
        paths, scan="ie_lab-validator", **hooks, device=cpu, dtype=f32, lazy_encoder=False, lazy_decoder=False
    )


def readable_folder(model: str, work: str) -> str:
    """The model folder as transformers 4.57 reads it: a folder saved by transformers 5 names its tokenizer class
    TokenizersBackend, which 4.57 lacks; the same tokenizer.json under PreTrainedTokenizerFast. Every other file is
    a link to the original (the same weights)."""
    path = os.path.join(model, "tokenizer_config.json")
    if not os.path.exists(path):
        return model
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("tokenizer_class") != "TokenizersBackend":
        return model
    out = os.path.join(work, "model-" + os.path.basename(os.path.normpath(model)))
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(model):
        if name != "tokenizer_config.json" and not os.path.exists(os.path.join(out, name)):
            os.symlink(os.path.join(os.path.abspath(model), name), os.path.join(out, name))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out


def attribute(job: dict) -> dict:
    import torch
    from circuit_tracer import ReplacementModel, attribute
    from circuit_tracer.graph import compute_node_influence, prune_graph
    from safetensors.torch import save_file

    torch.set_num_threads(int(job.get("threads") or torch.get_num_threads()))
    tcs = own_layout(job["transcoders"]) if isinstance(job["transcoders"], str) else transcoder_set(job["transcoders"])
    model = ReplacementModel.from_pretrained_and_transcoders(
        readable_folder(job["model"], job["work"]),
        tcs,
        backend="nnsight",
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    outs = []
    for k, ids in enumerate(job["prompts"]):
        tokens = model.ensure_tokenized(torch.tensor(ids))
        times = []
        graph = None
        for _ in range(int(job.get("repeats", 1))):
            t0 = time.perf_counter()
            graph = attribute(
                tokens,
                model,
                max_n_logits=job["max_n_logits"],
                desired_logit_prob=job["desired_logit_prob"],
                batch_size=job["batch_size"],
                max_feature_nodes=None,
            )
            times.append(time.perf_counter() - t0)
        assert graph is not None
        weights = torch.zeros(graph.adjacency_matrix.shape[0])
        weights[-len(graph.logit_targets) :] = graph.logit_probabilities
        influence = compute_node_influence(graph.adjacency_matrix, weights)
        pr = prune_graph(graph, node_threshold=job["node_threshold"], edge_threshold=job["edge_threshold"])
        graph_file = None
        if job.get("graph_files"):
            from circuit_tracer.utils.create_graph_files import create_graph_files

            create_graph_files(
                graph,
                slug=f"ct{k}",
                output_path=job["graph_files"],
                scan="ie_lab-validator",
                node_threshold=job["node_threshold"],
                edge_threshold=job["edge_threshold"],
            )
            graph_file = os.path.join(job["graph_files"], f"ct{k}.json")
        path = os.path.join(job["work"], f"ct{k}.safetensors")
        save_file(
            {
                "adjacency": graph.adjacency_matrix.float().contiguous(),
                "active_features": graph.active_features.long().contiguous(),
                "activation_values": graph.activation_values.float().contiguous(),
                "selected_features": graph.selected_features.long().contiguous(),
                "logit_probabilities": graph.logit_probabilities.float().contiguous(),
                "node_mask": pr.node_mask.contiguous(),
                "node_influence": influence.float().contiguous(),
            },
            path,
        )
        outs.append(
            {
                "file": path,
                "input_tokens": [int(t) for t in graph.input_tokens.tolist()],
                "logit_tokens": [int(t.vocab_idx) for t in graph.logit_targets],
                "seconds": times,
                "graph_file": graph_file,
            }
        )
    return {"graphs": outs, "threads": torch.get_num_threads(), "versions": versions()}


def read_graph_files(job: dict) -> dict:
    """Each graph file (its folder, its slug: <slug>.json) as circuit-tracer's viewer gets it: listed in the folder's
    graph-metadata.json by circuit-tracer's add_graph_metadata, served by its local_server (the viewer fetches
    ./data/graph-metadata.json and ./graph_data/<slug>.json), and parsed by its frontend models (graph_models.Model).
    Returns what the parse holds: metadata, nodes (every field), links."""
    import urllib.request

    from circuit_tracer.frontend.graph_models import Model
    from circuit_tracer.frontend.local_server import serve
    from circuit_tracer.frontend.utils import add_graph_metadata

    out = []
    for path in job["files"]:
        folder, slug = os.path.dirname(path), os.path.basename(path)[: -len(".json")]
        with open(path) as f:
            model = Model.model_validate_json(f.read())
        add_graph_metadata(model.metadata.model_dump(), folder)
        server = serve(data_dir=folder, port=0)  # port 0: any free port
        try:
            base = f"http://127.0.0.1:{server.httpd.server_address[1]}"
            with urllib.request.urlopen(f"{base}/data/graph-metadata.json", timeout=30) as r:
                listed = [g["slug"] for g in json.load(r)["graphs"]]
            with urllib.request.urlopen(f"{base}/graph_data/{slug}.json", timeout=30) as r:
                served = Model.model_validate_json(r.read())
        finally:
            server.stop()
        out.append(
            {
                "file": path,
                "listed": slug in listed and served.metadata.slug == model.metadata.slug,
                "served_equal": served == model,
                "metadata": served.metadata.model_dump(),
                "nodes": [n.model_dump() for n in served.nodes],
                "links": served.links,
            }
        )
    return {"files": out, "versions": versions()}


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("circuit-tracer", "nnsight", "transformers", "torch")}


def main() -> None:
    cmd, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        job = json.load(f)
    commands = {"attribute": attribute, "read_graph_files": read_graph_files}
    if cmd not in commands:
        raise SystemExit(f"unknown command {cmd}")
    out = commands[cmd](job)
    with open(path + ".out", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
