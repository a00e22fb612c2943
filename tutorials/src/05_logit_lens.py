# %% [markdown]
# # Tutorial 5 — The logit lens
#
# Read out what each layer "would predict" by passing its residual stream through the model's own final norm
# and unembedding. Then fit a tuned lens: one linear map per layer that translates that layer's residual into
# the last layer's basis before reading it out.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "When Mary and John went to the store , John gave a drink to"
lens = s.logit_lens(prompt, k=3, keep_logits=True)

# %%
# NBVAL_CHECK_OUTPUT
print(lens.note)
for i, L in enumerate(lens.layers):
    print(f"layer {L}: top-1 at the last position = {lens.top_tokens[i][-1][0]!r}")

# %%
lens.plot()

# %% [markdown]
# ## A tuned lens
# Fit on some stories, evaluate on a held-out sentence: the KL divergence to the model's final distribution
# should drop for early layers.

# %%
corpus = [f"One morning , {n} went to the {p} . {n} felt happy ." for n in ["Anna", "Tom", "Lucy", "Ben"]
          for p in ["park", "store", "beach", "library", "garden"]]
tuned = s.run(lambda lm: ie_lab.fit_tuned_lens(lm, corpus))
held = "One evening , Grace went to the museum . Grace felt sad ."
plain = s.logit_lens(held, keep_logits=True)
fitted = s.logit_lens(held, keep_logits=True, transports=tuned.transports)
target = torch.log_softmax(plain.logits[-1], -1)

def kl(logits):
    lp = torch.log_softmax(logits, -1)
    return float((target.exp() * (target - lp)).sum(-1).mean())

# %%
# NBVAL_CHECK_OUTPUT
print("layer 0 KL lower with the tuned lens:", kl(fitted.logits[0]) < kl(plain.logits[0]))

# %% [markdown]
# **Exercise.** At which layer does the plain lens first put the correct name (`Mary`) on top?

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
first = next((L for i, L in enumerate(lens.layers) if lens.top_tokens[i][-1][0].strip() == "Mary"), None)
print("first layer predicting Mary:", first)
