"""What training the demo dictionaries shares (scripts/train_demo_sae.py, the demo SAE; scripts/train_demo_transcoders.py,
the demo transcoders): the arguments both take, the seeding, the demo model and fresh streams of the corpus it was
trained on, the Adam loop with unit-norm decoder rows, and the SAELens metadata and training report both write.

Both scripts import it as a sibling (`python scripts/train_demo_sae.py` puts scripts/ on the path).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
for _p in (str(REPO_ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import train_demo_model as tdm  # noqa: E402

DEMO_MODEL = REPO_ROOT / "ie_lab" / "demo_model"
SHARES = {"repeat": 0.40, "story": 0.42, "ioi": 0.18}  # the demo model's (training_report.json)


def parser(doc: str, out: Path, *, seed: int, d_sae: int, k: int, train_rows: int, eval_rows: int, epochs: int):
    """The arguments both scripts take, with each one's defaults (a script adds its own after)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--d-sae", type=int, default=d_sae)
    ap.add_argument("--k", type=int, default=k)
    ap.add_argument("--train-rows", type=int, default=train_rows)  # rows of --ctx tokens
    ap.add_argument("--eval-rows", type=int, default=eval_rows)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=epochs)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def seeded(args) -> float:
    """Threads, every seed and deterministic kernels set from args; the start time."""
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    return time.time()


def demo_model():
    """(the demo model in float32, eval mode; a function seed -> a fresh DocStream of its training corpus)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32).eval()
    vocab = AutoTokenizer.from_pretrained(str(DEMO_MODEL)).get_vocab()
    special = {vocab[t] for t in tdm.SPECIALS}
    return model, lambda seed: tdm.DocStream(vocab, special, SHARES, seed)


def unit_rows(W: torch.Tensor) -> torch.Tensor:
    """W with each row divided by its norm, in place."""
    W /= W.norm(dim=1, keepdim=True)
    return W


def train(p: dict, n: int, loss_of: Callable[[torch.Tensor], torch.Tensor], args, g: torch.Generator, tag: str) -> int:
    """Adam on loss_of(the batch's row indices) over `args.epochs` shuffles of n rows, the learning rate flat then
    decaying linearly over the last half; p["W_dec"]'s rows stay unit-norm (the gradient along each row dropped,
    the rows renormalised after each step). Returns the steps taken."""
    for v in p.values():
        v.requires_grad_(True)
    opt = torch.optim.Adam(p.values(), lr=args.lr)
    steps = args.epochs * (n // args.batch_tokens)
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=g)
        for i in range(n // args.batch_tokens):
            lr = args.lr * min(1.0, 2 * (1 - step / steps))
            for group in opt.param_groups:
                group["lr"] = lr
            loss = loss_of(order[i * args.batch_tokens : (i + 1) * args.batch_tokens])
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                W, G = p["W_dec"], p["W_dec"].grad
                G -= (G * W).sum(1, keepdim=True) * W
            opt.step()
            with torch.no_grad():
                unit_rows(p["W_dec"])
            step += 1
            if step % 100 == 0 or step == steps:
                print(f"{tag}epoch {epoch} step {step}/{steps} loss {loss.item():.4f}", flush=True)
    return steps


def metadata(hook_name: str, ctx: int) -> dict:
    """SAELens' cfg.json metadata of a demo dictionary."""
    return {
        "model_name": "ie_lab-demo",
        "hook_name": hook_name,
        "hook_head_index": None,
        "prepend_bos": True,
        "context_size": ctx,
        "dataset_path": "scripts/train_demo_model.py DocStream",
        "sae_lens_training_version": None,
    }


def recipe(script: str, args, head: dict, counts: dict, t0: float, t_acts: float) -> dict:
    """The training report's recipe: the command and its arguments, the model, `head`, the corpus, `counts`, the
    seconds spent."""
    return {
        "command": f"nice -n 10 python scripts/{script}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "model": "ie_lab/demo_model",
        **head,
        "corpus": {"generator": "scripts/train_demo_model.py DocStream", "shares": SHARES},
        **counts,
        "activation_seconds": round(t_acts, 1),
        "total_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }


def write_report(out: Path, report: dict, t0: float) -> None:
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {time.time() - t0:.1f} s", flush=True)
