# %% [markdown]
# # Tutorial 4 — Steering with difference-of-means vectors
#
# The demo model was trained on happy and sad stories. The difference between the mean residual of happy
# and of sad stories at a middle layer is a *mood direction*; adding it while the model continues a sad story
# makes the story happier.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
L = 1  # the layer where the demo model card measured the mood direction
happy = ["One morning , Anna went to the park . Anna felt happy and joyful .",
         "It was a sunny day at the beach . Tom smiled and laughed .",
         "One evening , Lucy went to the garden . Lucy was full of joy .",
         "Everyone at the market cheered . Ben felt glad and proud ."]
sad = ["One morning , Anna went to the park . Anna felt sad and lonely .",
       "It was a gray day at the beach . Tom cried and sighed .",
       "One evening , Lucy went to the garden . Lucy was full of sorrow .",
       "Everyone at the market wept . Ben felt gloomy and miserable ."]

def mean_resid(texts):
    return torch.stack([s.capture(t, [f"resid_post.{L}"])[f"resid_post.{L}"][0].mean(0) for t in texts]).mean(0)

mood = mean_resid(happy) - mean_resid(sad)

# %% [markdown]
# ## Steering
# Add `scale * mood` to `resid_post.L` at every position while the model continues sad story openings.

# %%
import json, os, re

# The demo model's mood vocabularies, as its training script recorded them.
lexicon = json.load(open(os.path.join(ie_lab.DEMO_MODEL, "training_report.json")))["lexicon"]
HAPPY, SAD = set(lexicon["happy_words"]), set(lexicon["sad_words"])
openings = ["One night , Megan went to the station . Megan felt sad and upset .",
            "One day , Steve went to the library . Steve felt lonely and gloomy .",
            "One afternoon , Fiona went to the farm . Fiona felt miserable and sorry ."]

def happy_fraction(steer=None):
    h = sd = 0
    for o in openings:
        words = re.findall(r"[A-Za-z]+", s.generate(o, 24, steer=steer).text)
        h += sum(w in HAPPY for w in words)
        sd += sum(w in SAD for w in words)
    return h / max(1, h + sd)

base = happy_fraction()
steered = happy_fraction(s.steer(f"resid_post.{L}", mood, scale=8.0))

# %%
# NBVAL_CHECK_OUTPUT
print(f"happy share of mood words: baseline below one half: {base < 0.5}; steered above one half: {steered > 0.5}")

# %%
print("baseline:", s.generate(openings[0], 24).text)
print("steered: ", s.generate(openings[0], 24, steer=s.steer(f"resid_post.{L}", mood, scale=8.0)).text)

# %% [markdown]
# **Exercise.** Instead of adding the direction, *ablate* it (`method="ablate"`) on a happy story. What
# happens to the mood words?

# %%
# Your code here

# %% [markdown]
# **Solution.**

# %%
spec = s.steer(f"resid_post.{L}", mood, method="ablate")
print(s.generate("One morning , Anna went to the park . Anna felt happy and joyful .", 24, steer=spec).text)

# %% [markdown]
# The steering panel (`s.steering_panel(prompt)`) does this with sliders; see `05_steering_panel`.
