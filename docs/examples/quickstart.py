"""Quickstart: load a model, capture a few points, and check one identity. Runs offline.

./dev quickstart            # the bundled demo model if present, else a tiny random Llama
"""

import os

import torch

import ie_lab
from ie_lab.toy import tiny_model

if os.path.isdir(ie_lab.DEMO_MODEL):
    lm = ie_lab.load(ie_lab.DEMO_MODEL, device="cpu")
else:
    print("(demo model not bundled in this checkout: using a tiny random Llama)")
    lm = ie_lab.load(*tiny_model("llama"))
print(lm)

prompt = "When Mary and John went to the store, John gave a drink to"
mid = lm.facts.n_layers // 2
cache = ie_lab.capture(
    lm, prompt, [f"resid_pre.{mid}", f"attn_out_post.{mid}", f"resid_mid.{mid}", f"attn_probs.{mid}", f"z.{mid}.head-0"]
)
print(cache)

# The residual identity every family satisfies: what attention adds, added to the input, is resid_mid.
torch.testing.assert_close(cache[f"resid_pre.{mid}"] + cache[f"attn_out_post.{mid}"], cache[f"resid_mid.{mid}"])
print("resid_pre + attn_out_post == resid_mid  ✓")
print("tokens:", cache.str_tokens[0])
