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
# ## The interactive viewer
#
# `s.show_attention(prompt)` shows every head of a layer as a thumbnail; click one (or use the arrow keys) to see
# its pattern, and hover a token to colour what it attends to. Only the layer on screen and the selected head
# are sent to the page. Below it opens on the last layer; more in `docs/WIDGETS.md`.

# %%
view = s.show_attention(prompt, layer=last, head=0)
view

# %% [markdown]
# The same viewer can be driven from Python: `view.show(layer, head)` does what a click does, and
# `view.head_pattern()` is the pattern on screen, the same numbers `attention()` returned.

# %%
# NBVAL_CHECK_OUTPUT
view.show(last, 1)
print(f"showing layer {view.layer}, head {view.head}, {len(view.tokens)} tokens")
print("on screen == att.probs:", torch.equal(view.head_pattern(), att.probs[last][1].float()))
