#!/usr/bin/env python
"""Train the demo transcoders shipped with ie_lab (ie_lab/demo_transcoders/): one command, CPU, seeded, minutes.

    nice -n 10 python scripts/train_demo_transcoders.py

One per-layer transcoder for each of the demo model's 4 decoder layers (ie_lab.DEMO_MODEL): each reads the MLP's
input after its norm (ie_lab's mlp_in.L, TransformerLens bridge's blocks.L.mlp.hook_in) and predicts the MLP's
output (mlp_out.L, blocks.L.hook_mlp_out), over fresh documents of the corpus the demo model was trained on
(scripts/train_demo_model.py's DocStream, another seed than the model's training), the recipe of
scripts/train_demo_sae.py:

  * trained as TopK (the k largest pre-activations, ReLU'd): W_dec rows kept unit-norm, W_enc initialised as W_dec's
    transpose, b_dec at the MLP output's mean, Adam on the mean squared error of the predicted MLP output;
  * then shipped as JumpReLU (SAELens' `jumprelu_transcoder`, which SAELens and circuit-tracer read; SAELens has no
    TopK transcoder): one threshold for every feature of a layer, the pre-activation value above which the training
    tokens keep k features on average, so the shipped activation is a plain elementwise function;
  * no input normalisation (ie_lab refuses weights whose scale lives outside them).

Writes one SAELens folder per layer (layer_L/cfg.json + sae_weights.safetensors) and training_report.json: the
recipe, per layer the L0 and the explained variance of the MLP output on held-out tokens (TopK as trained and the
JumpReLU shipped), dead features, tokens seen, seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import demo_dictionaries as dd  # scripts/: the scaffolding this script shares with train_demo_sae.py
import torch

DEFAULT_OUT = dd.REPO_ROOT / "ie_lab" / "demo_transcoders"


def activations(model, stream, rows: int, ctx: int, batch: int = 64) -> tuple[list, list]:
    """Per layer, ([rows * ctx, d_model] MLP inputs, the same MLP outputs), over `rows` packed rows of the corpus."""
    layers = model.model.layers
    ins: list[list] = [[] for _ in layers]
    outs: list[list] = [[] for _ in layers]

    def hook(L):
        def read(module, args, out):
            ins[L].append(args[0].reshape(-1, args[0].shape[-1]).to(torch.float16))
            outs[L].append(out.reshape(-1, out.shape[-1]).to(torch.float16))

        return read

    handles = [layer.mlp.register_forward_hook(hook(L)) for L, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for start in range(0, rows, batch):
                model(input_ids=stream.batch(min(batch, rows - start), ctx))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(x) for x in ins], [torch.cat(x) for x in outs]


def pre_acts(x: torch.Tensor, p: dict) -> torch.Tensor:
    return x @ p["W_enc"] + p["b_enc"]


def topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    top = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))


def jumprelu(pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return pre * (pre > threshold)


def measure(x: torch.Tensor, y: torch.Tensor, p: dict, act) -> dict:
    with torch.no_grad():
        f = act(pre_acts(x, p))
        err = (y - (f @ p["W_dec"] + p["b_dec"])).pow(2).sum()
        var = (y - y.mean(0)).pow(2).sum()
        fired = (f > 0).sum(0)
    return {
        "tokens": int(x.shape[0]),
        "l0": float((f > 0).sum(-1).float().mean()),
        "explained_variance": float(1 - err / var),
        "dead_features": int((fired == 0).sum()),
    }


def train_layer(x: torch.Tensor, y: torch.Tensor, args, g: torch.Generator, L: int) -> dict:
    """Trained on x / cx and y / cy (each row's median norm brought to sqrt(width), so one learning rate suits every
    layer, the last one's large outputs included), the scales folded back into the saved weights."""
    d_in, d_out = x.shape[1], y.shape[1]
    cx = float(x[:65536].float().norm(dim=1).median()) / d_in**0.5
    cy = float(y[:65536].float().norm(dim=1).median()) / d_out**0.5
    W_dec = dd.unit_rows(torch.randn(args.d_sae, d_out, generator=g))
    p = {
        "W_enc": (W_dec.t().clone() * 0.5).contiguous() if d_in == d_out else torch.randn(d_in, args.d_sae) * 0.05,
        "b_enc": torch.zeros(args.d_sae),
        "W_dec": W_dec,
        "b_dec": y[:65536].float().mean(0).clone() / cy,
    }

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        xb, yb = x[idx].float() / cx, y[idx].float() / cy
        return (topk(pre_acts(xb, p), args.k) @ p["W_dec"] + p["b_dec"] - yb).pow(2).sum(-1).mean()

    steps = dd.train(p, x.shape[0], loss_of, args, g, f"layer {L} ")
    w = {name: v.detach().contiguous() for name, v in p.items()}
    w["W_enc"], w["W_dec"], w["b_dec"] = w["W_enc"] / cx, w["W_dec"] * cy, w["b_dec"] * cy  # the scales folded in
    # one threshold per layer: the pre-activation above which the training tokens keep k features on average
    with torch.no_grad():
        pre = pre_acts(x[:65536].float(), w)
        theta = float(torch.quantile(pre.flatten()[: 2**24], 1 - args.k / args.d_sae).clamp_min(0))
    w["threshold"] = torch.full((args.d_sae,), theta)
    return {"weights": w, "steps": steps}


def main() -> None:
    # the demo model trained on seed 0's stream, the demo SAE on 1
    ap = dd.parser(__doc__, DEFAULT_OUT, seed=2, d_sae=256, k=12, train_rows=2048, eval_rows=256, epochs=8)
    args = ap.parse_args()  # --train-rows 2048 x ctx 128 = 262,144 tokens

    t0 = dd.seeded(args)
    from safetensors.torch import save_file

    model, stream = dd.demo_model()
    train_in, train_out = activations(model, stream(args.seed), args.train_rows, args.ctx)
    eval_in, eval_out = activations(model, stream(args.seed + 1000), args.eval_rows, args.ctx)
    t_acts = time.time() - t0
    print(f"activations: {len(train_in)} layers, train {tuple(train_in[0].shape)} in {t_acts:.1f} s", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(args.seed)
    layers = {}
    steps = 0
    for L in range(len(train_in)):
        r = train_layer(train_in[L], train_out[L], args, g, L)
        w, steps = r["weights"], r["steps"]
        ex, ey = eval_in[L].float(), eval_out[L].float()
        layers[f"layer_{L}"] = {
            "point_in": f"mlp_in.{L}",
            "point_out": f"mlp_out.{L}",
            "threshold": float(w["threshold"][0]),
            "held_out_topk_as_trained": measure(ex, ey, w, lambda pre: topk(pre, args.k)),
            "held_out_jumprelu_shipped": measure(ex, ey, w, lambda pre, t=w["threshold"]: jumprelu(pre, t)),
        }
        print(f"layer {L}:", json.dumps(layers[f"layer_{L}"]), flush=True)
        folder = out / f"layer_{L}"
        folder.mkdir(exist_ok=True)
        save_file(w, str(folder / "sae_weights.safetensors"))
        d = int(w["W_enc"].shape[0])
        cfg = {  # SAELens 6.x's JumpReLU transcoder layout (JumpReLUTranscoderConfig.to_dict's fields)
            "architecture": "jumprelu_transcoder",
            "d_in": d,
            "d_sae": args.d_sae,
            "d_out": int(w["W_dec"].shape[1]),
            "dtype": "float32",
            "device": "cpu",
            "apply_b_dec_to_input": False,
            "normalize_activations": "none",
            "reshape_activations": "none",
            "hook_name_out": f"blocks.{L}.hook_mlp_out",
            "hook_layer_out": L,
            "hook_head_index_out": None,
            # TransformerLens bridge's name; TL's ln2.hook_normalized is before the gain
            "metadata": dd.metadata(f"blocks.{L}.mlp.hook_in", args.ctx),
        }
        (folder / "cfg.json").write_text(json.dumps(cfg, indent=2) + "\n")
    head = {
        "trained_as": "topk",
        "shipped_as": "jumprelu_transcoder (one threshold per layer, calibrated to k features per token)",
    }
    counts = {
        "train_tokens": int(train_in[0].shape[0]),
        "tokens_seen_per_layer": int(steps * args.batch_tokens),
        "steps_per_layer": steps,
    }
    report = {"recipe": dd.recipe("train_demo_transcoders.py", args, head, counts, t0, t_acts), "layers": layers}
    dd.write_report(out, report, t0)


if __name__ == "__main__":
    main()
