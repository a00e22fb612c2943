# %% [markdown]
# # Tutorial 2 — Attention and induction heads
#
# An *induction head* completes patterns: having seen `... A B ... A`, it attends from the second `A` to the
# token after the first `A` (that is, `B`) and copies it. We find one in the demo model.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
g = torch.Generator().manual_seed(0)
n_rep, vocab = 20, s.facts.vocab_size
bos = s.tokenizer.bos_token_id
seq = torch.randint(10, vocab, (1, n_rep), generator=g)
tokens = torch.cat([torch.tensor([[bos]]), seq, seq], dim=1)  # BOS, r, r

# %% [markdown]
# ## 1. The model predicts the repeat
# Loss on the second copy is far lower than on the first: the model has learned to look back.

# %%
# NBVAL_CHECK_OUTPUT
with torch.no_grad():
    logits = s.model(tokens).logits
logp = torch.log_softmax(logits[0, :-1].float(), -1)
loss = -logp.gather(1, tokens[0, 1:, None])[:, 0]
first, second = loss[:n_rep - 1].mean(), loss[n_rep:].mean()
print(f"second copy / first copy loss: {float(second / first):.2f} (below 0.5: {bool(second / first < 0.5)})")

# %% [markdown]
# ## 2. Induction scores
# For each head, average the attention from each token of the second copy to the token *after* its earlier
# occurrence: position `i` attends to `i - n_rep + 1`.

# %%
att = s.attention(tokens)
scores = torch.zeros(s.facts.n_layers, s.facts.n_heads)
for L in att.layers:
    p = att.probs[L]  # [heads, q, k]
    q = torch.arange(n_rep + 1, 2 * n_rep + 1)
    scores[L] = p[:, q, q - n_rep + 1].mean(-1)

# %%
# NBVAL_CHECK_OUTPUT
best = int(scores.argmax())
L_best, H_best = divmod(best, s.facts.n_heads)
print(f"best induction head: layer {L_best}, head {H_best}, score {float(scores.max()):.2f} (above 0.3: {bool(scores.max() > 0.3)})")

# %%
import plotly.express as px

px.imshow(scores.numpy(), labels=dict(x="head", y="layer", color="induction score"), color_continuous_scale="Blues")

# %%
att.plot(layer=L_best, head=H_best)

# %% [markdown]
# **Exercise.** Induction heads usually rely on an earlier *previous-token head* that writes "the token before
# me was X" into each position. Find the head whose attention from position `i` to `i - 1` is highest on the
# first copy.

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
prev = torch.zeros(s.facts.n_layers, s.facts.n_heads)
for L in att.layers:
    q = torch.arange(2, n_rep + 1)
    prev[L] = att.probs[L][:, q, q - 1].mean(-1)
L_prev, H_prev = divmod(int(prev.argmax()), s.facts.n_heads)
print(f"previous-token head: layer {L_prev}, head {H_prev} ({float(prev.max()):.2f}); "
      f"it sits before the induction head: {L_prev < L_best}")

# %% [markdown]
# ## 3. See it in the attention viewer
# The viewer shows the same matrices, opened on the induction head. Its pattern is an off-diagonal stripe:
# each token of the second copy looks `n_rep - 1` tokens back. Click the previous-token head (the solution
# above) in the thumbnails, or any other head, to compare; hover a token to see where it looks.

# %%
view = s.show_attention(tokens, layer=L_best, head=H_best)
view

# %%
# NBVAL_CHECK_OUTPUT
print("viewer shows the induction head's pattern:", torch.equal(view.head_pattern(), att.probs[L_best][H_best].float()))
