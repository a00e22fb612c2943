# %% [markdown]
# # Tutorial 1 — What an address is
#
# Every tensor ie_lab hands you has a standard name, an **address**: `name[.layer][.head-H][.stream-S]`.
# In this tutorial you learn to read addresses, to check that a tensor is what its name claims using
# identities of the residual stream, and to recognise when a point does not exist on a model.

# %%
import torch
import ie_lab
from ie_lab import Address

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "One morning , Mary went to the park . Mary felt happy ."

# %% [markdown]
# ## 1. Reading an address
# `resid_post.2` is the residual stream leaving layer 2; `z.1.head-3` is head 3's slice of the
# attention-weighted values entering layer 1's output projection; `embeddings` is a trunk point (no layer).

# %%
# NBVAL_CHECK_OUTPUT
for text in ["resid_post.2", "z.1.head-3", "embeddings"]:
    a = Address.parse(text)
    print(f"{text:14} name={a.name:11} layer={a.layer} head={a.head} width={a.point.width.value}")

# %% [markdown]
# Mistakes are caught with a hint:

# %%
# NBVAL_CHECK_OUTPUT
for bad in ["resid_psot.2", "embeddings.0", "resid_post.2.head-1"]:
    try:
        Address.parse(bad)
    except ie_lab.AddressError as e:
        print(f"{bad}: {e}")

# %% [markdown]
# ## 2. Checking a claim with an identity
# A block adds attention's contribution and then the MLP's to the residual stream. So
# `resid_pre.L + attn_out_post.L == resid_mid.L` and `resid_mid.L + mlp_out_post.L == resid_post.L`.
# A plausible-but-wrong tensor (say, the normalised MLP input `mlp_in` in place of `resid_mid`) fails.

# %%
# NBVAL_CHECK_OUTPUT
L = 1
c = s.capture(prompt, [f"{n}.{L}" for n in ["resid_pre", "attn_out_post", "resid_mid", "mlp_in", "mlp_out_post",
                                            "resid_post"]])
print("attention identity:", torch.allclose(c[f"resid_pre.{L}"] + c[f"attn_out_post.{L}"], c[f"resid_mid.{L}"], atol=1e-5))
print("MLP identity:      ", torch.allclose(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], atol=1e-5))
print("with mlp_in instead:", torch.allclose(c[f"resid_pre.{L}"] + c[f"attn_out_post.{L}"], c[f"mlp_in.{L}"], atol=1e-5))

# %% [markdown]
# **Exercise.** Check the identity `probs @ value == z` for every head of layer 2. The demo model has as many
# key/value heads as query heads. (Hint: `value.2` is `[batch, seq, n_kv_heads * head_dim]`.)

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
# NBVAL_CHECK_OUTPUT
c = s.capture(prompt, ["attn_probs.2", "value.2", "z.2"])
b, n, _ = c["value.2"].shape
H, d = s.facts.n_heads, s.facts.head_dim
v = c["value.2"].reshape(b, n, s.facts.n_kv_heads, d).transpose(1, 2).repeat_interleave(H // s.facts.n_kv_heads, 1)
z = (c["attn_probs.2"] @ v).transpose(1, 2).reshape(b, n, H * d)
print(torch.allclose(z, c["z.2"], atol=1e-5))

# %% [markdown]
# ## 3. Points that do not exist
# The registry lists every point ie_lab knows; a given family may lack some. The demo model (a Llama) has no
# QK-norm and no mixture of experts:

# %%
# NBVAL_CHECK_OUTPUT
table = s.points()
print([r.name for r in table.rows if not r.served][:6])

# %% [markdown]
# ## 4. The same on a diagram
# The picker draws this model's block in forward order, with every address on it. Hover a point (or Tab to it)
# for its card: definition, width on this model, the names other libraries give it, and a snippet to copy.
# Points this model or backend cannot serve are greyed, with the reason. Clicking one selects it; more in the
# `03_hook_points_picker` notebook.

# %%
picker = s.picker()
picker

# %% [markdown]
# **Exercise.** Click `attn_out` in layer 2 (the layer arrows are at the top), then capture it from Python
# through `picker.address`, and check its width.

# %%
# Your code here

# %% [markdown]
# **Solution.** `picker.select(...)` does what the click does (hidden until you want it: click the `⋯` below,
# or the bar to its left):

# %% [solution]
# NBVAL_CHECK_OUTPUT
picker.select("attn_out.2")
out = s.capture(prompt, [picker.address])[str(picker.address)]
print(picker.address, tuple(out.shape[-1:]), "== d_model:", out.shape[-1] == s.facts.d_model)
