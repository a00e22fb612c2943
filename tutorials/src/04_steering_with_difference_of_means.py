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
L = s.facts.n_layers // 2
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
HAPPY = set("happy joyful glad cheerful delighted excited proud thrilled merry smiled laughed danced sang cheered "
            "giggled grinned hugged celebrated clapped sunny bright wonderful lovely beautiful perfect amazing "
            "fantastic joy fun laughter delight love sunshine".split())
SAD = set("sad unhappy gloomy miserable lonely upset heartbroken hopeless sorry cried wept sobbed sighed frowned "
          "mourned moaned whimpered grieved sulked gray rainy dreary dark cold bleak awful terrible sorrow tears "
          "grief pain misery gloom".split())
openings = ["One night , Megan went to the station . Megan felt sad and upset .",
            "One day , Steve went to the library . Steve felt lonely and gloomy .",
            "One afternoon , Fiona went to the farm . Fiona felt miserable and sorry ."]

def happy_fraction(steer=None):
    h = sd = 0
    for o in openings:
        words = s.generate(o, 24, steer=steer).text.split()
        h += sum(w in HAPPY for w in words)
        sd += sum(w in SAD for w in words)
    return h / max(1, h + sd)

base = happy_fraction()
steered = happy_fraction(s.steer(f"resid_post.{L}", mood, scale=4.0))

# %%
# NBVAL_CHECK_OUTPUT
print(f"happy share of mood words: baseline below one half: {base < 0.5}; steered above one half: {steered > 0.5}")

# %%
print("baseline:", s.generate(openings[0], 24).text)
print("steered: ", s.generate(openings[0], 24, steer=s.steer(f"resid_post.{L}", mood, scale=4.0)).text)

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
