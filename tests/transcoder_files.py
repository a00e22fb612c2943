"""Random per-layer transcoders written in SAELens' transcoder layout, for the transcoder and attribution-graph
tests (tests/test_transcoders.py, tests/test_attribution_graph.py)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def write_transcoders(
    root: str,
    d_model: int,
    layers: list[int],
    *,
    n: int = 24,
    arch: str = "jumprelu_transcoder",
    seed: int = 0,
    **cfg_extra,
) -> str:
    """One folder per layer under root (layer_L/cfg.json + sae_weights.safetensors): random weights whose
    features fire on a tiny model's MLP inputs (a few per token), hook names in TransformerLens bridge's spelling."""
    g = torch.Generator().manual_seed(seed)
    for L in layers:
        folder = os.path.join(root, f"layer_{L}")
        os.makedirs(folder, exist_ok=True)
        w = {
            "W_enc": torch.randn(d_model, n, generator=g) / d_model**0.5,
            "b_enc": torch.randn(n, generator=g) * 0.1,
            "W_dec": torch.randn(n, d_model, generator=g) * 0.3,
            "b_dec": torch.randn(d_model, generator=g) * 0.1,
        }
        if arch == "jumprelu_transcoder":
            w["threshold"] = torch.full((n,), 0.3)
        save_file(w, os.path.join(folder, "sae_weights.safetensors"))
        cfg = {
            "architecture": arch,
            "d_in": d_model,
            "d_sae": n,
            "d_out": d_model,
            "hook_name": f"blocks.{L}.mlp.hook_in",
            "hook_name_out": f"blocks.{L}.hook_mlp_out",
            **({"k": 4} if arch == "topk_transcoder" else {}),
            **cfg_extra,
        }
        with open(os.path.join(folder, "cfg.json"), "w") as f:
            json.dump(cfg, f)
    return root


def write_circuit_tracer(
    root: str,
    d_model: int,
    n_layers: int,
    *,
    n: int = 24,
    clt: bool = True,
    skip: bool = False,
    jumprelu: bool = True,
    seed: int = 0,
    hooks: tuple[str, str] | None = ("mlp.hook_in", "hook_mlp_out"),
) -> str:
    """Random transcoders in circuit-tracer's layout under root: a cross-layer transcoder (W_enc_<L>.safetensors with
    W_enc_<L> [n, d], b_enc_<L>, b_dec_<L>, threshold_<L>; W_dec_<L>.safetensors with W_dec_<L> [n, n_layers - L, d])
    or per-layer files (layer_<L>.safetensors: W_enc [n, d], W_dec, b_enc, b_dec, activation_function.threshold,
    W_skip [d, d] with skip=True), and a config.yaml naming the hooks (none when hooks is None)."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(root, exist_ok=True)
    d = d_model
    for L in range(n_layers):
        W_enc = torch.randn(n, d, generator=g) / d**0.5
        b_enc, b_dec = torch.randn(n, generator=g) * 0.1, torch.randn(d, generator=g) * 0.1
        th = torch.full((n,), 0.3)
        if clt:
            enc = {f"W_enc_{L}": W_enc, f"b_enc_{L}": b_enc, f"b_dec_{L}": b_dec}
            if jumprelu:
                enc[f"threshold_{L}"] = th
            save_file(enc, os.path.join(root, f"W_enc_{L}.safetensors"))
            W_dec = torch.randn(n, n_layers - L, d, generator=g) * 0.3
            save_file({f"W_dec_{L}": W_dec}, os.path.join(root, f"W_dec_{L}.safetensors"))
        else:
            w = {"W_enc": W_enc, "W_dec": torch.randn(n, d, generator=g) * 0.3, "b_enc": b_enc, "b_dec": b_dec}
            if jumprelu:
                w["activation_function.threshold"] = th
            if skip:
                w["W_skip"] = torch.randn(d, d, generator=g) * 0.2 / d**0.5
            save_file(w, os.path.join(root, f"layer_{L}.safetensors"))
    if hooks is not None:
        kind = "cross_layer_transcoder" if clt else "transcoder_set"
        with open(os.path.join(root, "config.yaml"), "w") as f:
            f.write(f"model_kind: {kind}\nfeature_input_hook: {hooks[0]}\nfeature_output_hook: {hooks[1]}\n")
    return root
