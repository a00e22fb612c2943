# %% [markdown]
# # Logit lens
#
# Decode the residual stream at every layer through the model's own final norm and unembedding.

# %%
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
lens = s.logit_lens("When Mary and John went to the store , John gave a drink to", k=3)

# %%
# NBVAL_CHECK_OUTPUT
print(lens.note)
print(lens)

# %% [markdown]
# The last layer's lens is the model's own prediction. At the final position:

# %%
# NBVAL_CHECK_OUTPUT
for i, layer in enumerate(lens.layers):
    print(layer, lens.top_tokens[i][-1])

# %%
lens.plot()
