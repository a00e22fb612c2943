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
