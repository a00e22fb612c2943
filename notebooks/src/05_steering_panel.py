# %% [markdown]
# # The steering panel
#
# A live panel: baseline and steered continuations side by side, token-level differences marked, and
# controls for the method and its coefficient. The vector here is a difference of means between happy and
# sad sentences at a middle layer of the demo model.

# %%
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
L = s.facts.n_layers // 2
panel = s.steering_panel(
    "One night , Megan went to the station . Megan felt sad and upset .",
    address=f"resid_post.{L}",
    positive=["Anna felt happy and joyful .", "Tom smiled and laughed .", "It was a sunny day ."],
    negative=["Anna felt sad and lonely .", "Tom cried and sighed .", "It was a gray day ."],
    scale=4.0, max_new_tokens=16)
panel

# %% [markdown]
# Moving the slider regenerates (a newer value cancels the generation in flight). From Python, `update` does
# what the slider does and waits for the text:

# %%
# NBVAL_CHECK_OUTPUT
panel.update(scale=0.0)
unsteered = panel.steered_text
panel.update(scale=4.0)
print("scale 0 equals the baseline:", unsteered == panel.baseline_text)
print("scale 4 changes the text:   ", panel.steered_text != panel.baseline_text)

# %%
print("baseline:", panel.baseline_text)
print("steered: ", panel.steered_text)

# %% [markdown]
# Other methods: `cap` clamps the projection on the direction, `ablate` removes it, `swap` sets it.

# %%
panel.update(method="ablate")
print(panel.steered_text)
