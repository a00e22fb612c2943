# %% [markdown]
# # Hook points with the picker
#
# The picker draws one block of *this* model in forward order — the residual spine, the attention and MLP
# branches, every point ie_lab can capture — with a card per point: definition, width with this model's
# numbers, the TransformerLens and nnsight names (and a warning where the same name means a different
# tensor), each backend's verdict, and a snippet. Click a point; Python sees the selection.

# %%
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
picker = s.picker()
picker

# %% [markdown]
# Clicking sets `picker.address`, an `ie_lab.Address` you can observe or use directly (shift-click adds to
# `picker.addresses`). Here we select from Python, as a click would:

# %%
# NBVAL_CHECK_OUTPUT
picker.select("mlp_out.2")
print(picker.address, repr(picker))
cache = s.capture("Mary went to the park .", [picker.address])
print(cache)

# %% [markdown]
# ## A cheat sheet for any family, without weights
# `ie_lab.cheatsheet` draws from a family name or a config alone. Gemma 2 has sandwich norms, so TransformerLens'
# `hook_mlp_out` is the *post-norm* output there — the card warns about it.

# %%
ie_lab.cheatsheet("gemma2")

# %%
# NBVAL_CHECK_OUTPUT
from ie_lab.mappers import from_engine
print("gemma2:", from_engine("blocks.3.hook_mlp_out", "gemma2"), "| llama:", from_engine("blocks.3.hook_mlp_out", "llama"))

# %% [markdown]
# On the vLLM backend the points it cannot serve are greyed out, each with the reason:

# %%
ie_lab.cheatsheet("llama", backend="vllm")
