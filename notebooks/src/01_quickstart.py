# %% [markdown]
# # Quickstart
#
# Load the bundled demo model (a 4-layer Llama trained for these notebooks; it ships inside the package,
# so this works offline and on Colab), generate a story, and capture the residual stream.

# %%
import torch
import ie_lab

torch.manual_seed(0)
s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
s

# %%
# NBVAL_CHECK_OUTPUT
print(s.describe())

# %% [markdown]
# Sampling with a seed gives the same story on every run: `temperature` > 0 samples from the model's
# distribution, `seed` fixes the draw.

# %%
# NBVAL_CHECK_OUTPUT
story = s.generate("One Monday , Mary went to the park .", 24, temperature=0.8, seed=1)
print(story.text)

# %% [markdown]
# Without `temperature`, generation is greedy: always the likeliest next word. A model this small then
# repeats itself within a sentence or two, which is worth seeing once:

# %%
# NBVAL_CHECK_OUTPUT
print(s.generate("One Monday , Mary went to the park .", 12).text)

# %% [markdown]
# A capture names tensors by *address*: point name, layer, and optionally a head.

# %%
# NBVAL_CHECK_OUTPUT
cache = s.capture("When Mary and John went to the store , John gave a drink to",
                  ["resid_post.1", "attn_probs.2", "z.3.head-0"])
print(cache)

# %% [markdown]
# Where to go next: `02_capture_and_cache`, `03_hook_points_picker`, `04_attention`, `05_steering_panel`,
# `06_logit_lens`, `07_activation_patching`, `08_vllm_backend`, `09_porting_from_transformerlens_nnsight`,
# `10_attribution_and_gradients`, `11_chat_quantized_and_more_points`, and the tutorials in `../tutorials`.
