# %% [markdown]
# # Tutorial 4 — Steering with difference-of-means vectors
#
# The demo model was trained on happy and sad stories. The difference between the mean residual of happy
# and of sad stories is a *mood direction*; adding it while the model continues a sad story makes the story
# happier, and removing it from a happy story shows what the model writes without it.

# %%
import torch
import ie_lab

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
L = 0  # the output of the first layer: where, on this model, the direction turns stories without breaking them
# Pairs of stories that differ only in their mood words, so names, places and grammar cancel in the difference.
happy = ["One Monday , Anna went to the park . Anna felt happy and joyful . Anna smiled and laughed .",
         "One Sunday , Tom went to the beach . It was a sunny day at the beach . Tom was full of joy .",
         "One Friday , Lucy went to the garden . Lucy sang and danced . Lucy felt glad and proud .",
         "One Tuesday , Ben went to the market . Everyone at the market cheered . Ben felt cheerful ."]
sad = ["One Monday , Anna went to the park . Anna felt sad and lonely . Anna cried and sighed .",
       "One Sunday , Tom went to the beach . It was a rainy day at the beach . Tom was full of sorrow .",
       "One Friday , Lucy went to the garden . Lucy wept and sobbed . Lucy felt gloomy and upset .",
       "One Tuesday , Ben went to the market . Everyone at the market mourned . Ben felt miserable ."]

def mean_resid(texts):
    return torch.stack([s.capture(t, [f"resid_post.{L}"])[f"resid_post.{L}"][0].mean(0) for t in texts]).mean(0)

mood = mean_resid(happy) - mean_resid(sad)
print("the same as ie_lab's mean_difference:",
      torch.allclose(mood, s.mean_difference(happy, sad, f"resid_post.{L}"), atol=1e-5))

# %% [markdown]
# ## Steering
# Add `scale * mood` to `resid_post.L` at every position while the model continues sad story openings, and
# count the mood words in what it writes.

# %%
import json, os, re

# The demo model's mood vocabularies, as its training script recorded them.
lexicon = json.load(open(os.path.join(ie_lab.DEMO_MODEL, "training_report.json")))["lexicon"]
HAPPY, SAD = set(lexicon["happy_words"]), set(lexicon["sad_words"])
sad_openings = ["One night , Megan went to the station . Megan felt sad and upset .",
                "One Monday , Fiona went to the farm . Fiona cried and sobbed .",
                "One Friday , Holly went to the cafe . Holly was full of sorrow ."]

def mood_words(openings, steer=None):
    """(happy words, sad words) in 24-token greedy continuations of the openings."""
    h = sd = 0
    for o in openings:
        words = re.findall(r"[A-Za-z]+", s.generate(o, 24, steer=steer).text)
        h += sum(w in HAPPY for w in words)
        sd += sum(w in SAD for w in words)
    return h, sd

add = s.steer(f"resid_post.{L}", mood, scale=8.0)
base, steered = mood_words(sad_openings), mood_words(sad_openings, add)
print("(happy, sad) words: baseline", base, "steered", steered)

# %%
# NBVAL_CHECK_OUTPUT
print(f"baseline mostly sad: {base[1] > base[0]}; steered mostly happy: {steered[0] > steered[1]}")

# %%
for o in sad_openings[:2]:
    print("baseline:", s.generate(o, 24).text)
    print("steered: ", s.generate(o, 24, steer=add).text)

# %% [markdown]
# Try other layers and coefficients: at layers 1 and 2, and at layer 0 above 9, the text starts to fall apart
# ("day day day"); below 6 many stories stay sad. The model card (`docs/DEMO_MODEL.md`) measures the same effect on
# sampled text, with a vector from 200 stories a side.
#
# **Exercise.** Instead of adding the direction, *ablate* it (`method="ablate"`: the component of each
# position along the direction is removed) while the model continues *happy* stories. What happens to the mood
# words, and why?

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
happy_openings = ["One Monday , Fiona went to the farm . Fiona smiled and laughed .",
                  "One Sunday , Luke went to the river . It was a sunny day at the river .",
                  "One Friday , Holly went to the cafe . Holly was full of joy ."]
ablate = s.steer(f"resid_post.{L}", mood, method="ablate")
print("happy openings:           (happy, sad) =", mood_words(happy_openings))
print("happy openings, ablated:  (happy, sad) =", mood_words(happy_openings, ablate))
neutral = [o.rsplit(" . ", 1)[0] + " ." for o in happy_openings]  # the same openings without the mood sentence
print("neutral openings:         (happy, sad) =", mood_words(neutral))
print(s.generate(happy_openings[0], 24, steer=ablate).text)

# %%
# NBVAL_CHECK_OUTPUT
print("ablated happy stories turn sad:", mood_words(happy_openings, ablate)[1] > mood_words(happy_openings, ablate)[0])
print("as neutral openings do:        ", mood_words(neutral)[1] > mood_words(neutral)[0])

# %% [markdown]
# The happy stories turn sad. Ablation does not make the text neutral: it removes the mood signal at layer 0,
# and what the later layers then write is the model's default, the continuation of a story with no mood in it.
# For this model that default is sad, as the neutral openings show (it saw as many sad stories as happy ones;
# greedy decoding always takes the side that is ahead, however slightly). Adding the direction showed that it is
# *enough* to turn the mood; ablating it shows that, at this layer, the model has no other copy of the mood to
# fall back on: the happy words in the prompt stop counting.
#
# Try the same ablation at `resid_post.1` or `resid_post.2` (measure a new vector there): the result changes,
# because each layer has its own direction and its own zero point.

# %% [markdown]
# ## The same with sliders
# The steering panel runs the baseline and the steered story side by side with this tutorial's vector, and marks
# the tokens that changed. Drag the coefficient from 0 up to watch where the mood turns; switch the method to
# `ablate` and the prompt to a happy story to repeat the exercise. More in the `05_steering_panel` notebook.

# %%
panel = s.steering_panel(sad_openings[1], address=f"resid_post.{L}", vector=mood, scale=8.0, max_new_tokens=24)
panel

# %%
# NBVAL_CHECK_OUTPUT
print("the panel shows what s.generate gives:", panel.steered_text == s.generate(sad_openings[1], 24, steer=add).text)

# %% [markdown]
# ## Reading the direction: the feature panel
# The mood direction is also a *probe*: projecting each token's `resid_post.L` on it scores how happy the model
# reads that token. The feature panel colours a text's tokens by such scores (negative ones in the theme's error
# colour); hover a token for its score. It takes a `[k, d]` matrix of directions, one feature each, as here, or a
# sparse autoencoder's features: pass `ie_lab.load_sae(path, s)` instead of the matrix (docs/SAE.md), and the
# picker above the tokens lists the features most active on the text.

# %%
story = "One Saturday , Megan went to the zoo . Megan laughed and felt joyful . Then the day was rainy . Megan cried and felt lonely ."
probe = s.feature_panel(story, f"resid_post.{L}", (mood / mood.norm())[None])
probe

# %%
# NBVAL_CHECK_OUTPUT
scores = probe.feature_values()  # what the panel colours the tokens by: the projection on the mood direction
order = scores.argsort(descending=True).tolist()
print("most happy:", [probe.tokens[i] for i in order[:2]], "most sad:", probe.tokens[order[-1]])
print("the panel shows s.project's scores:",
      torch.allclose(scores, s.project(story, f"resid_post.{L}", (mood / mood.norm())[None]).scores[:, 0]))
