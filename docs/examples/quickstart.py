"""Quickstart: open a Session on a model, capture a few points, and check one identity. Runs offline.

./dev quickstart            # the bundled demo model if present, else a tiny random Llama
"""

import os

import torch

import ie_lab
from ie_lab.toy import tiny_model

if os.path.isdir(ie_lab.DEMO_MODEL):
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu")
else:
    print("(demo model not bundled in this checkout: using a tiny random Llama)")
    s = ie_lab.Session(*tiny_model("llama"))
print(s)

prompt = "When Mary and John went to the store, John gave a drink to"
mid = s.facts.n_layers // 2
cache = s.capture(
    prompt, [f"resid_pre.{mid}", f"attn_out_post.{mid}", f"resid_mid.{mid}", f"attn_probs.{mid}", f"z.{mid}.head-0"]
)
s.close()
print(cache)

# The residual identity every family satisfies: what attention adds, added to the input, is resid_mid.
torch.testing.assert_close(cache[f"resid_pre.{mid}"] + cache[f"attn_out_post.{mid}"], cache[f"resid_mid.{mid}"])
print("resid_pre + attn_out_post == resid_mid  ✓")
print("tokens:", cache.str_tokens[0])
