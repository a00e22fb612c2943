#!/usr/bin/env python
"""Train the demo SAE shipped with ie_lab (ie_lab/demo_sae/): one command, CPU, seeded, a minute or two.

    nice -n 10 python scripts/train_demo_sae.py

A TopK sparse autoencoder (SAELens' `topk` architecture: the k largest pre-activations, ReLU'd) on the residual
stream of the demo model (ie_lab.DEMO_MODEL) after its middle decoder layer, resid_post.1 (TransformerLens'
blocks.1.hook_resid_post; the layer the demo model's mood steering uses), over fresh documents of the corpus the
demo model was trained on (scripts/train_demo_model.py's DocStream: stories, IOI sentences and repeated random
tokens in the same shares, drawn with another seed than the model's training).

Plain torch, not SAELens (SAELens 6.54 wants TransformerLens < 4 and its own environment; a TopK SAE is a few lines):
  * activations read from transformers' hidden_states[2] (the output of decoder layer 1 = ie_lab's resid_post.1;
    tests/test_demo_sae.py checks the shipped SAE against ie_lab's own capture of that point),
  * W_dec initialised as W_enc's transpose with unit-norm rows (kept unit-norm after each step), b_dec at the
    activations' mean, Adam on the mean squared reconstruction error,
  * no input normalisation (ie_lab refuses SAEs whose scale lives outside the weights).

Writes SAELens' on-disk layout (cfg.json + sae_weights.safetensors, so `ie_lab.load_sae(folder, s)` and SAELens'
`SAE.load_from_disk(folder)` read it) and training_report.json: the recipe, L0, explained variance and dead
features on held-out tokens, tokens seen, seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import demo_dictionaries as dd  # scripts/: the scaffolding this script shares with train_demo_transcoders.py
import torch

DEFAULT_OUT = dd.REPO_ROOT / "ie_lab" / "demo_sae"
HOOK_NAME = "blocks.{layer}.hook_resid_post"


def activations(model, stream, rows: int, ctx: int, layer: int, batch: int = 64) -> torch.Tensor:
    """[rows * ctx, d_model]: the output of decoder layer `layer` over `rows` packed rows of the corpus."""
    out = []
    with torch.no_grad():
        for start in range(0, rows, batch):
            ids = stream.batch(min(batch, rows - start), ctx)
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            out.append(hs[layer + 1].reshape(-1, hs[0].shape[-1]).float())  # hidden_states[0] is the embedding
    return torch.cat(out)


def encode(x: torch.Tensor, p: dict, k: int) -> torch.Tensor:
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    top = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))


def decode(f: torch.Tensor, p: dict) -> torch.Tensor:
    return f @ p["W_dec"] + p["b_dec"]


def measure(x: torch.Tensor, p: dict, k: int) -> dict:
    with torch.no_grad():
        f = encode(x, p, k)
        err = (x - decode(f, p)).pow(2).sum()
        var = (x - x.mean(0)).pow(2).sum()
        fired = (f > 0).sum(0)
    return {
        "tokens": int(x.shape[0]),
        "l0": float((f > 0).sum(-1).float().mean()),
        "explained_variance": float(1 - err / var),
        "mse": float(err / x.numel()),
        "dead_features": int((fired == 0).sum()),
        "features_firing_on_under_1e-4_of_tokens": int((fired < 1e-4 * x.shape[0]).sum()),
    }


def main() -> None:
    # the demo model trained on seed 0's stream: other documents
    ap = dd.parser(__doc__, DEFAULT_OUT, seed=1, d_sae=512, k=16, train_rows=4096, eval_rows=512, epochs=2)
    ap.add_argument("--layer", type=int, default=1)
    args = ap.parse_args()  # --train-rows 4096 x ctx 128 = 524,288 tokens

    t0 = dd.seeded(args)
    model, stream = dd.demo_model()
    train_x = activations(model, stream(args.seed), args.train_rows, args.ctx, args.layer)
    eval_x = activations(model, stream(args.seed + 1000), args.eval_rows, args.ctx, args.layer)
    t_acts = time.time() - t0
    d = train_x.shape[1]
    print(f"activations: train {tuple(train_x.shape)}, eval {tuple(eval_x.shape)} in {t_acts:.1f} s", flush=True)

    g = torch.Generator().manual_seed(args.seed)
    W_dec = dd.unit_rows(torch.randn(args.d_sae, d, generator=g))
    p = {
        "W_enc": W_dec.t().clone().contiguous(),
        "b_enc": torch.zeros(args.d_sae),
        "W_dec": W_dec,
        "b_dec": train_x.mean(0).clone(),
    }
    n = train_x.shape[0]

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        x = train_x[idx]
        return (decode(encode(x, p, args.k), p) - x).pow(2).sum(-1).mean()

    steps = dd.train(p, n, loss_of, args, g, "")

    weights = {name: v.detach().contiguous() for name, v in p.items()}
    held_out = measure(eval_x, weights, args.k)
    train_metrics = measure(train_x[:65536], weights, args.k)
    print("held-out:", json.dumps(held_out), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(weights, str(out / "sae_weights.safetensors"))
    hook_name = HOOK_NAME.format(layer=args.layer)
    cfg = {  # SAELens 6.x's TopK layout (what TopKSAEConfig.to_dict writes), the fields it reads on load
        "architecture": "topk",
        "d_in": d,
        "d_sae": args.d_sae,
        "k": args.k,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "rescale_acts_by_decoder_norm": False,
        "metadata": dd.metadata(hook_name, args.ctx),
    }
    (out / "cfg.json").write_text(json.dumps(cfg, indent=2) + "\n")
    head = {"point": f"resid_post.{args.layer}", "hook_name": hook_name}
    counts = {"train_tokens": int(n), "tokens_seen": int(steps * args.batch_tokens), "steps": steps}
    report = {
        "recipe": dd.recipe("train_demo_sae.py", args, head, counts, t0, t_acts),
        "held_out": held_out,
        "train_sample": train_metrics,
    }
    dd.write_report(out, report, t0)


if __name__ == "__main__":
    main()
