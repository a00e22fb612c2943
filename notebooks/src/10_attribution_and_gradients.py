# %% [markdown]
# # Which head wrote the answer: attribution, the Jacobian lens, and the gradient verdict
#
# Three tools that read *why* the model predicts what it does, all on the demo model:
#
# 1. `attn_result.L`: what each attention head writes into the residual stream, and `logit_attribution`, which
#    splits one logit (or a logit difference) into those pieces, summing to it exactly.
# 2. `fit_jacobian_lens`: the model's own linear map from each layer's residual to the final one, averaged over
#    text, for a logit lens that reads early layers in the final layer's coordinates.
# 3. `grad_support()`: whether this model and backend can give gradients at all, answered before anything runs.

# %%
import torch

import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "When Mary and John went to the store , John gave a drink to"

# %% [markdown]
# ## What each head writes
#
# `attn_result.L` is `[batch, seq, heads, d_model]`: head h's slice of `z` through its slice of the output
# projection. Summed over heads (plus the projection's bias, none here) it is `attn_out.L`.

# %%
# NBVAL_CHECK_OUTPUT
cache = s.capture(prompt, ["attn_result.1", "attn_out.1"])
per_head = cache["attn_result.1"]
print(tuple(per_head.shape))
print("heads sum to attn_out:", torch.allclose(per_head.sum(dim=2), cache["attn_out.1"], atol=1e-5))

# %% [markdown]
# ## Direct logit attribution
#
# The logit difference "Mary" minus "John" at the last position, split by head. The final norm's scale is
# frozen at its value on this run, so the pieces are linear and add up to the logit difference exactly.

# %%
# NBVAL_CHECK_OUTPUT
r = s.logit_attribution(prompt, ["Mary", "John"], by="head")
print(r.note)
print("pieces sum to the logit difference:", abs(float(r.total[0] - r.logit[0])) < 1e-4)

# %%
for label, value in r.top(5):
    print(f"{label:>22}  {value:+.3f}")

# %%
r.plot()

# %% [markdown]
# ## The Jacobian lens
#
# The plain logit lens decodes layer L's residual as if it were the final one. The Jacobian lens first maps it
# through the average Jacobian of the final residual with respect to it (exact autograd, one vector-Jacobian
# product per row), so early layers are read in the coordinates the unembedding expects.

# %%
texts = ["When Mary and John went to the store", "The cat sat on the mat", "Mary felt sad and"]
jl = s.fit_jacobian_lens(texts, progress=False)
print(jl)

# %%
# NBVAL_CHECK_OUTPUT
last = s.facts.n_layers - 1
print("the last layer's Jacobian is the identity:", torch.equal(jl.jacobian(last), torch.eye(s.facts.d_model)))
plain = s.logit_lens(prompt, k=3)
jacobian = s.logit_lens(prompt, k=3, transports=jl.transports)
print(jacobian.note)

# %%
for i, layer in enumerate(plain.layers):
    print(layer, "plain:", plain.top_tokens[i][-1], "| jacobian:", jacobian.top_tokens[i][-1])

# %% [markdown]
# The last layer reads the same either way (its Jacobian is the identity). In the middle layers of this 4-layer
# model the averaged Jacobian points at special tokens the model never predicts: one linear map averaged over a
# few prompts is a poor stand-in for two nonlinear layers here. The lens is exact about what it computes (checked
# against finite differences in tests/test_jacobian_lens.py); whether that is a good reading of a layer is the
# question it lets you ask, and on larger models the answer is usually better than on this one.

# %% [markdown]
# ## Can this model give gradients?
#
# Before a gradient run, ask. The verdict names what blocks gradients (the backend, quantized weights, a module
# that runs under `torch.no_grad()`) and what to do instead.

# %%
# NBVAL_CHECK_OUTPUT
print(s.grad_support())

# %%
s.close()
