# %% [markdown]
# # The steering panel
#
# A live panel: baseline and steered continuations side by side, token-level differences marked, and
# controls for the method and its coefficient. The vector here is a difference of means between happy and
# sad stories; the demo model was trained on both kinds, and adding the direction turns a sad story happy.

# %%
import json
import os
import re

import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)

# Six stories a side that differ only in their mood words: what they share (names, places, grammar) cancels
# out of the difference of means, and what is left is mood.
happy = [
    "One Monday , Anna went to the park . Anna felt happy and joyful . Anna smiled and laughed .",
    "One Sunday , Tom went to the beach . It was a sunny day at the beach . Tom was full of joy .",
    "One Friday , Lucy went to the garden . Lucy sang and danced . Lucy felt glad and proud .",
    "One Tuesday , Ben went to the market . Everyone at the market cheered . Ben felt cheerful .",
    "One Saturday , Emma went to the zoo . The bright morning made Emma feel excited . Emma giggled .",
    "One Thursday , Jack went to the lake . Jack felt thrilled and merry . Jack was full of delight .",
]
sad = [
    "One Monday , Anna went to the park . Anna felt sad and lonely . Anna cried and sighed .",
    "One Sunday , Tom went to the beach . It was a rainy day at the beach . Tom was full of sorrow .",
    "One Friday , Lucy went to the garden . Lucy wept and sobbed . Lucy felt gloomy and upset .",
    "One Tuesday , Ben went to the market . Everyone at the market mourned . Ben felt miserable .",
    "One Saturday , Emma went to the zoo . The dreary morning made Emma feel hopeless . Emma frowned .",
    "One Thursday , Jack went to the lake . Jack felt heartbroken and weary . Jack was full of grief .",
]

# %% [markdown]
# The direction is added to the output of the first layer (`resid_post.0`) at every position, with coefficient 8:
# on this model that turns all of 40 held-out sad openings happy while the text stays the model's own kind of
# sentence (`tests/test_demo_model_defaults.py` measures it). At layers 1 and 2 the same coefficient turns fewer of them and some fall apart ("day day
# day"), as they do at layer 0 above 9. Move the slider to see where the mood turns, and try the other layers.

# %%
panel = s.steering_panel(
    "One Monday , Fiona went to the farm . Fiona cried and sobbed .",
    address="resid_post.0",
    positive=happy,
    negative=sad,
    scale=8.0,
    max_new_tokens=24,
)
panel

# %% [markdown]
# The demo model's mood words, as its training script recorded them, count what changed:

# %%
lexicon = json.load(open(os.path.join(ie_lab.DEMO_MODEL, "training_report.json")))["lexicon"]
HAPPY, SAD = set(lexicon["happy_words"]), set(lexicon["sad_words"])


def moods(text):
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w in HAPPY for w in words), sum(w in SAD for w in words)


print("baseline:", panel.baseline_text)
print("steered: ", panel.steered_text)

# %%
# NBVAL_CHECK_OUTPUT
(bh, bs), (sh, ss) = moods(panel.baseline_text), moods(panel.steered_text)
print("baseline: sad words and no happy ones:", bs > 0 and bh == 0)
print("steered:  happy words and no sad ones:", sh > 0 and ss == 0)

# %% [markdown]
# Moving the slider regenerates (a newer value cancels the generation in flight). From Python, `update` does
# what the slider does and waits for the text:

# %%
# NBVAL_CHECK_OUTPUT
panel.update(scale=0.0)
print("scale 0 equals the baseline:", panel.steered_text == panel.baseline_text)
panel.update(scale=8.0)
print("back at scale 8, happy again:", moods(panel.steered_text)[1] == 0)

# %% [markdown]
# ## Ablation, in a second panel
#
# Other methods: `cap` clamps the projection on the direction, `swap` sets it, `ablate` removes it. Ablating
# the mood direction from a *happy* story takes away what made it happy. The model does not fall silent on
# mood: left with no mood signal, it writes what it writes after a neutral opening, and this model's default
# mood is sad (see the neutral opening below). The same vector, from the first panel:

# %%
ablation = s.steering_panel(
    "One Monday , Fiona went to the farm . Fiona smiled and laughed .",
    address="resid_post.0",
    vector=panel.vector,
    method="ablate",
    max_new_tokens=24,
)
ablation

# %%
print("baseline:", ablation.baseline_text)
print("ablated: ", ablation.steered_text)
print("a neutral opening:", s.generate("One Monday , Fiona went to the farm .", 24).text)

# %%
# NBVAL_CHECK_OUTPUT
(bh, bs), (ah, as_) = moods(ablation.baseline_text), moods(ablation.steered_text)
print("happy story: happy words and no sad ones:", bh > 0 and bs == 0)
print("direction ablated: more sad words than happy ones:", as_ > ah)

# %% [markdown]
# Both panels stay live: the first is still adding the direction at coefficient 8. `panel.link(s.picker())`
# moves a panel's address when a steerable point is clicked in the picker; `docs/WIDGETS.md` has the rest.
