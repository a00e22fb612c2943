"""Runs in the saelens environment (validator/envs/saelens.txt), never imports ie_lab.

    python saelens_worker.py build JOB.json    # write each SAE with SAELens' own classes (save_model)
    python saelens_worker.py encode JOB.json   # SAE.load_from_disk(folder).encode(acts) for each SAE

Tensors come and go as safetensors files; the job and its answer are JSON (JOB.json -> JOB.json.out).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(int(os.environ.get("IE_LAB_VALIDATOR_THREADS", "1")))


def _classes(arch: str):
    import sae_lens as L

    return {
        "standard": (L.StandardSAE, L.StandardSAEConfig),
        "jumprelu": (L.JumpReLUSAE, L.JumpReLUSAEConfig),
        "topk": (L.TopKSAE, L.TopKSAEConfig),
    }[arch]


def build(job: dict) -> dict:
    from sae_lens.saes.sae import SAEMetadata

    made = {}
    for item in job["saes"]:
        cls, cfg_cls = _classes(item["arch"])
        extra = {"k": item["k"]} if item["arch"] == "topk" else {}
        cfg = cfg_cls(
            d_in=item["d_in"],
            d_sae=item["d_sae"],
            apply_b_dec_to_input=True,
            metadata=SAEMetadata(hook_name=item["hook_name"], model_name=item.get("model_name", "")),
            **extra,
        )
        sae = cls(cfg)
        # SAELens initialises biases (and JumpReLU's threshold) to zero: random ones make every term count
        g = torch.Generator().manual_seed(item["seed"])
        with torch.no_grad():
            for name, p in sorted(sae.named_parameters()):
                if name == "threshold":
                    p.copy_(torch.rand(p.shape, generator=g) * 0.2)
                elif name.startswith("b_"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[0] ** 0.5)
        sae.save_model(item["folder"])
        made[item["folder"]] = sorted(os.listdir(item["folder"]))
    return {"made": made}


def encode(job: dict) -> dict:
    from sae_lens import SAE

    for item in job["saes"]:
        sae = SAE.load_from_disk(item["folder"], device="cpu")
        x = load_file(item["acts"])["x"]
        with torch.no_grad():
            f = sae.encode(x.to(sae.dtype))
        save_file({"f": f.float().contiguous()}, item["out"])
    return {}


def main(argv) -> int:
    import importlib.metadata as md

    cmd, path = argv[1], argv[2]
    with open(path) as f:
        job = json.load(f)
    ans = {"build": build, "encode": encode}[cmd](job)
    ans["versions"] = {d: md.version(d) for d in ("sae-lens", "transformer-lens", "transformers", "torch")}
    with open(path + ".out", "w") as f:
        json.dump(ans, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
