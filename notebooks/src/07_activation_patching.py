# %% [markdown]
# # Activation patching
#
# Run a *corrupted* prompt with activations taken from a *clean* one, one (layer, position) at a time, and
# watch a metric: here the logit difference between the two names.

# %%
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
tok = s.tokenizer
clean = "When Mary and John went to the store , John gave a drink to"
corrupt = "When Mary and John went to the store , Mary gave a drink to"
metric = ie_lab.logit_diff(tok.convert_tokens_to_ids("Mary"), tok.convert_tokens_to_ids("John"))

# %%
grid = s.patch_sweep(clean, corrupt, metric, point="resid_pre", progress=False)
print(grid)

# %%
# NBVAL_CHECK_OUTPUT
print("clean metric > 0:", grid.clean > 0, "| corrupted metric < 0:", grid.corrupted < 0)
same = s.patch_sweep(clean, clean, metric, progress=False)
print("patching a prompt into itself changes nothing:", bool((same.values - same.clean).abs().max() < 1e-4))

# %%
grid.plot()

# %% [markdown]
# Heads: patch each head's output (`z`) from the clean run.

# %%
heads = s.patch_sweep(clean, corrupt, metric, over="layer_head", progress=False)
heads.plot()
