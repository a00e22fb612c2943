# %% [markdown]
# # Tutorial 3 — Finding the IOI circuit with patching
#
# "When Mary and John went to the store , John gave a drink to" → **Mary**. The model must find the name that
# appears once (the indirect object, IO) rather than the repeated subject (S). We measure this on names the
# model never saw in such sentences, then locate where the information flows with activation patching.

# %%
import random
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
tok = s.tokenizer
held_out = ["Steve", "Megan", "Tony", "Fiona", "Alex", "Sara", "Martin", "Paula", "Eric", "Wendy"]
template = "When {A} and {B} went to the store , {S} gave a drink to"

def logit_diff(io, s_name, text):
    with torch.no_grad():
        logits = s.model(s.tokens(text)).logits[0, -1]
    return float(logits[tok.convert_tokens_to_ids(io)] - logits[tok.convert_tokens_to_ids(s_name)])

# %% [markdown]
# ## 1. The behaviour, on held-out names

# %%
# NBVAL_CHECK_OUTPUT
rng = random.Random(0)
diffs = []
for _ in range(40):
    io, sub = rng.sample(held_out, 2)
    a, b = (io, sub) if rng.random() < 0.5 else (sub, io)
    diffs.append(logit_diff(io, sub, template.format(A=a, B=b, S=sub)))
diffs = torch.tensor(diffs)
print(f"mean logit diff IO - S > 1: {bool(diffs.mean() > 1)}; accuracy > 0.9: {bool((diffs > 0).float().mean() > 0.9)}")

# %% [markdown]
# ## 2. Patching the residual stream
# Corrupt the prompt by swapping which name repeats, then restore one (layer, position) at a time from the
# clean run. Cells that bring the metric back carry the information.

# %%
clean = template.format(A="Steve", B="Megan", S="Megan")
corrupt = template.format(A="Steve", B="Megan", S="Steve")
metric = ie_lab.logit_diff(tok.convert_tokens_to_ids("Steve"), tok.convert_tokens_to_ids("Megan"))
grid = s.patch_sweep(clean, corrupt, metric, point="resid_pre", progress=False)
grid.plot()

# %% [markdown]
# Early layers: the information sits at the position of the repeated name (`S`). Late layers: at the final
# position, after attention has moved it there.

# %%
# NBVAL_CHECK_OUTPUT
pos_S = len(s.to_str_tokens(clean)) - 1 - s.to_str_tokens(clean)[::-1].index("Megan")  # the repeated S
print("layer 0, at S restores most of the effect:",
      bool(grid.values[0, pos_S] - grid.corrupted > 0.5 * (grid.clean - grid.corrupted)))
print("last layer, at the final token restores most:",
      bool(grid.values[-1, -1] - grid.corrupted > 0.5 * (grid.clean - grid.corrupted)))

# %% [markdown]
# ## 3. Which heads?
# Patch each head's output (`z`) from the clean run into the corrupted one.

# %%
heads = s.patch_sweep(clean, corrupt, metric, over="layer_head", progress=False)
heads.plot()

# %% [markdown]
# **Exercise.** For the head with the largest effect, look at where the final token attends in the clean
# prompt. Does it attend to the indirect object?

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
L, H = divmod(int(heads.values.argmax()), s.facts.n_heads)
att = s.attention(clean, layers=[L])
k = int(att.probs[L][H, -1].argmax())
print(f"head {L}.{H} attends most from the last token to {k}:{att.str_tokens[k]!r}")

# %% [markdown]
# Attribution patching gives a first-order estimate of the whole sweep from one forward and one backward:
# `ie_lab.attribution_patch(s, clean, corrupt, metric)`.
