# %% [markdown]
# # Capture and the cache
#
# `capture` runs the model's own forward once with hooks at the requested points and returns a `Cache`:
# a mapping keyed by `Address` that also takes the string form.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "When Mary and John went to the store , John gave a drink to"
points = ["embeddings", "resid_pre.2", "attn_out_post.2", "resid_mid.2", "mlp_out_post.2", "resid_post.2",
          "value.2", "z.2", "attn_probs.2", "mlp_act.2"]
cache = s.capture(prompt, points)

# %%
# NBVAL_CHECK_OUTPUT
print(cache)

# %% [markdown]
# Every tensor is exactly what a module produced, so the residual stream adds up: what attention adds to
# the input of layer 2 is `resid_mid.2`, and what the MLP adds to that is `resid_post.2`.

# %%
# NBVAL_CHECK_OUTPUT
mid = cache["resid_pre.2"] + cache["attn_out_post.2"]
post = cache["resid_mid.2"] + cache["mlp_out_post.2"]
print("resid_pre + attn_out_post == resid_mid:", torch.allclose(mid, cache["resid_mid.2"], atol=1e-5))
print("resid_mid + mlp_out_post == resid_post:", torch.allclose(post, cache["resid_post.2"], atol=1e-5))

# %% [markdown]
# Heads: `z.2.head-1` is head 1's slice of `z.2`, and `attn_probs.2.head-1` that head's pattern.

# %%
# NBVAL_CHECK_OUTPUT
heads = s.capture(prompt, ["z.2.head-1", "attn_probs.2.head-1"])
d = s.facts.head_dim
print(torch.equal(heads["z.2.head-1"], cache["z.2"][..., d:2 * d]), tuple(heads["attn_probs.2.head-1"].shape))

# %% [markdown]
# Points that do not exist on this family are refused with the reason — never answered with a neighbour.

# %%
# NBVAL_CHECK_OUTPUT
try:
    s.capture(prompt, ["q_norm_in.1"])
except ie_lab.PointAbsent as e:
    print(e)

# %%
# NBVAL_CHECK_OUTPUT
print(s.points())

# %% [markdown]
# Activation norms by point, as a chart:

# %%
cache.plot()
