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

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO_ROOT))
import train_demo_model as tdm  # noqa: E402

DEMO_MODEL = REPO_ROOT / "ie_lab" / "demo_model"
DEFAULT_OUT = REPO_ROOT / "ie_lab" / "demo_sae"
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=1)  # the demo model trained on seed 0's stream: other documents
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--d-sae", type=int, default=512)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--train-rows", type=int, default=4096)  # x ctx 128 = 524,288 tokens
    ap.add_argument("--eval-rows", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()

    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32).eval()
    vocab = AutoTokenizer.from_pretrained(str(DEMO_MODEL)).get_vocab()
    special = {vocab[t] for t in tdm.SPECIALS}
    shares = {"repeat": 0.40, "story": 0.42, "ioi": 0.18}  # the demo model's (training_report.json)
    train_x = activations(
        model, tdm.DocStream(vocab, special, shares, args.seed), args.train_rows, args.ctx, args.layer
    )
    eval_x = activations(
        model, tdm.DocStream(vocab, special, shares, args.seed + 1000), args.eval_rows, args.ctx, args.layer
    )
    t_acts = time.time() - t0
    d = train_x.shape[1]
    print(f"activations: train {tuple(train_x.shape)}, eval {tuple(eval_x.shape)} in {t_acts:.1f} s", flush=True)

    g = torch.Generator().manual_seed(args.seed)
    W_dec = torch.randn(args.d_sae, d, generator=g)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    p = {
        "W_enc": W_dec.t().clone().contiguous(),
        "b_enc": torch.zeros(args.d_sae),
        "W_dec": W_dec,
        "b_dec": train_x.mean(0).clone(),
    }
    for v in p.values():
        v.requires_grad_(True)
    opt = torch.optim.Adam(p.values(), lr=args.lr)
    n = train_x.shape[0]
    steps = args.epochs * (n // args.batch_tokens)
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=g)
        for i in range(n // args.batch_tokens):
            x = train_x[order[i * args.batch_tokens : (i + 1) * args.batch_tokens]]
            lr = args.lr * min(1.0, 2 * (1 - step / steps))  # flat, then linear decay over the last half
            for group in opt.param_groups:
                group["lr"] = lr
            loss = (decode(encode(x, p, args.k), p) - x).pow(2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            # the decoder's rows stay unit-norm: drop the gradient along each row, step, renormalise
            with torch.no_grad():
                W, G = p["W_dec"], p["W_dec"].grad
                G -= (G * W).sum(1, keepdim=True) * W
            opt.step()
            with torch.no_grad():
                p["W_dec"] /= p["W_dec"].norm(dim=1, keepdim=True)
            step += 1
            if step % 100 == 0 or step == steps:
                print(f"epoch {epoch} step {step}/{steps} loss {loss.item():.4f}", flush=True)

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
        "metadata": {
            "model_name": "ie_lab-demo",
            "hook_name": hook_name,
            "hook_head_index": None,
            "prepend_bos": True,
            "context_size": args.ctx,
            "dataset_path": "scripts/train_demo_model.py DocStream",
            "sae_lens_training_version": None,
        },
    }
    (out / "cfg.json").write_text(json.dumps(cfg, indent=2) + "\n")
    report = {
        "recipe": {
            "command": "nice -n 10 python scripts/train_demo_sae.py",
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
            "model": "ie_lab/demo_model",
            "point": f"resid_post.{args.layer}",
            "hook_name": hook_name,
            "corpus": {"generator": "scripts/train_demo_model.py DocStream", "shares": shares},
            "train_tokens": int(n),
            "tokens_seen": int(steps * args.batch_tokens),
            "steps": steps,
            "activation_seconds": round(t_acts, 1),
            "total_seconds": round(time.time() - t0, 1),
            "torch": torch.__version__,
        },
        "held_out": held_out,
        "train_sample": train_metrics,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
