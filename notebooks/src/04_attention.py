# %% [markdown]
# # Attention
#
# `attention()` returns probabilities, pre-softmax scores and values per layer and head. The demo model runs
# PyTorch's fused sdpa kernel, which never materialises the matrix; ie_lab rebuilds it from the q and k the
# kernel received, and the result equals the eager kernel's own probabilities.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "When Mary and John went to the store , John gave a drink to"
att = s.attention(prompt)

# %%
# NBVAL_CHECK_OUTPUT
print(att)
print("rows sum to one:", torch.allclose(att.probs[2].sum(-1), torch.ones(att.probs[2].shape[:-1]), atol=1e-5))

# %% [markdown]
# Where does the final token (`to`) look, in each head of the last layer?

# %%
# NBVAL_CHECK_OUTPUT
last = s.facts.n_layers - 1
for h in range(s.facts.n_heads):
    k = int(att.probs[last][h, -1].argmax())
    print(f"head {h}: attends most to {k}:{att.str_tokens[k]!r}")

# %%
att.plot(layer=last, head=0)

# %% [markdown]
# The interactive viewer (`s.show_attention(prompt)`) shows every head as a thumbnail and fetches the
# selected one on demand; see `05_steering_panel` and `docs/WIDGETS.md`.
